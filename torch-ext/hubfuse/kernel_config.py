"""`hubfuse.KernelConfig`: transformers' `KernelConfig`, made usable for training and on CPU.

Stock transformers 5.22.2 has three faults when hub kernels are used for training:

1. `create_compatible_mapping` rejects the `"cpu"` device, although `kernels.kernelize` supports it.
2. It registers each kernel for one mode only, the mode the model is in when loading ends (`eval`).
   `model.train()` re-kernelizes in TRAINING mode, finds nothing, and every module silently falls back to
   its class forward: the kernels are gone for the whole training run.
3. A kernelized load leaves process-global state behind: class patch mappings, checkpoint conversion
   mappings (which also grow with every load) and patched output recorders. A later plain load of the same
   architecture gets our Layouts, un-kernelized, and loses recorded outputs (router logits, attentions).
   A load that fails half-way (a Layout that cannot be built, a missing layer, a checkpoint that does not fit)
   also leaves transformers' module classes swapped (`apply_patches` has no try/finally). Also, the config
   object is rewritten in place and cannot serve a second load.

4. With a kernel that ships a Layout, every key is a class-name regex, so a hub-name key over-matches
   ("RMSNorm" also swaps `Qwen3_5MoeRMSNorm` and `Qwen3_5MoeRMSNormGated` for the standard norm).

This subclass takes the same mapping forms and fixes all four (hub-name keys select exactly the classes
transformers registered under that name): it registers every kernel for every mode
(inference, training, and their torch.compile forms), accepts cpu, binds a private copy of the compiled
mapping to the model (so the user's object can be reused), and restores the global state it found once the
model is built.

How a load is seen. transformers calls no `KernelConfig` method with the model class or config, and has no hook on
failure. The one call that carries them, `register_kernel_replacements_and_fusions(cls, config, kernel_config)`,
is hooked (`_transformers_private.install_kernel_registration_hook`, installed once per process when a
hubfuse.KernelConfig is created; `PreTrainedModel.from_pretrained` stays the stock object, and a load with another
kernel config runs the stock registration). There the mapping is resolved for the model (the preset of
`config.model_type`), the global state is captured, transformers registers the entries, and the model is built
once on the meta device with the patches applied (as transformers does for fusion keys), so that a Layout that
cannot be built raises there.

A load that fails (trade-off of having no failure hook):
- while resolving, registering or building the model (a bad mapping, a missing layer, a Layout that cannot be
  built from the class it replaces, a 1-to-1 Layout combined with a fusion): the global state is restored before
  the exception reaches the caller;
- later, while reading the checkpoint (a size mismatch): transformers gives no control back, so its
  registrations stay until the next kernelized load starts (which restores them first) or until
  `restore_global_state()` exits. Wrap a load that may fail that way in `with hubfuse.restore_global_state():`
  when a plain load of the same architecture follows in the process.
`restore_global_state()` / `kernel_state_snapshot()` are also exported for manual use.

On top of that, for the user: `KernelConfig()` with no mapping is the preset of the family being loaded
(`config.model_type`, read when the load starts) with the fused losses switched on once the model is built; every
kernel is loaded when the load starts, before the weights, with errors that name the cause (`sources.load_layer`);
a mapping that binds nothing raises; hub layers the mapping leaves out are registered without a kernel, so
`kernelize` does not warn once per module about them.
"""
from __future__ import annotations

import copy
import logging
import re
import sys
from contextlib import contextmanager

import transformers
from transformers.utils.kernel_config import infer_device

from . import _transformers_private as private


def _all_modes():
    from kernels import Mode

    return (Mode.INFERENCE, Mode.TRAINING, Mode.INFERENCE | Mode.TORCH_COMPILE, Mode.TRAINING | Mode.TORCH_COMPILE)


# States captured at the start of a hubfuse-kernelized load and not yet restored: the load in progress, or one that
# failed after the registration returned (while reading the checkpoint). The next kernelized load restores those
# before starting.
_UNFINISHED: list[private.GlobalState] = []


def _recover_from_failed_loads():
    while _UNFINISHED:
        _UNFINISHED.pop().restore()  # the oldest is restored last: it holds the state before all of them


def _build_on_meta(cls, config) -> None:
    """Build the model on the meta device with the registered patches applied: a Layout that cannot be built
    raises here, inside the registration hook, where the global state can still be put back."""
    import torch
    from transformers.monkey_patching import apply_patches

    with apply_patches(), torch.device("meta"):
        cls(copy.deepcopy(config))


def _registration_hook(register, cls, config, kernel_config):
    """Called by `from_pretrained` in place of `register_kernel_replacements_and_fusions` (see
    `_transformers_private`): leftovers of a failed load are restored first; a hubfuse.KernelConfig resolves its
    mapping for `cls` / `config`, and a failure while registering or building the model restores the state."""
    _recover_from_failed_loads()
    if not isinstance(kernel_config, KernelConfig):
        return register(cls, config, kernel_config)
    kernel_config._begin_load(cls, config)  # raises before anything global is touched
    try:
        register(cls, config, kernel_config)
        _build_on_meta(cls, config)
    except BaseException:
        kernel_config._abort_load()
        raise


def _hub_name_classes(hub_name: str) -> list[str]:
    """Names of the transformers model classes registered under `hub_name` (`@use_kernel_forward_from_hub`)."""
    names = set()
    for mod_name, module in list(sys.modules.items()):
        if not mod_name.startswith("transformers.models.") or module is None:
            continue
        for obj in list(vars(module).values()):
            if (isinstance(obj, type) and obj.__module__ == mod_name
                    and obj.__dict__.get("kernel_layer_name") == hub_name):
                names.add(obj.__name__)
    return sorted(names)


def _mapping_value(value):
    """(repo name, metadata) of a mapping value (`"org/repo:Layer"`, a tuple with metadata, or `{device: ...}`)."""
    if isinstance(value, dict):  # {device: repo}
        value = next(iter(value.values()))
    return value if isinstance(value, tuple) else (value, {})


def _with_default_meta(value):
    """A hub value with neither `revision` nor `version` gets `revision="v1"` for a local build (LOCAL_KERNELS)
    and `version=1` otherwise, so that one mapping serves the hub and `hubfuse.use_local_builds()` alike."""
    from .sources import default_meta

    if isinstance(value, dict):
        return {device: _with_default_meta(v) for device, v in value.items()}
    repo_name, meta = value if isinstance(value, tuple) else (value, {})
    if not isinstance(repo_name, str) or not isinstance(meta, dict) or meta.get("revision") is not None \
            or meta.get("version") is not None:
        return value  # stock validation reports malformed values
    return repo_name, {**meta, **default_meta(repo_name.partition(":")[0])}


def anchor_hub_name_keys(mapping: dict, use_local_kernel: bool = False, layouts: dict | None = None) -> dict:
    """Rewrite plain hub-name keys whose kernel ships a Layout into anchored class-name regexes.

    transformers treats every key as a class-name regex (`re.search`) as soon as the kernel has a Layout, so
    the hub name "RMSNorm" also matches `Qwen3_5MoeRMSNorm` and `Qwen3_5MoeRMSNormGated` and swaps them for the
    standard RMSNorm Layout: a silent wrong result. A hub name is meant to select exactly the classes
    transformers registered under it, so it becomes `^(Qwen3RMSNorm|LlamaRMSNorm|...)$`. `layouts` (key -> the
    kernel's Layout or None) saves loading the kernels again.
    """
    from .sources import load_layer

    rewritten = {}
    for key, value in mapping.items():
        if isinstance(key, str) and key.isidentifier():
            classes = _hub_name_classes(key)
            if layouts is not None:
                layout = layouts[key]
            else:
                layout = load_layer(*_mapping_value(value), use_local_kernel=use_local_kernel)[1]
            if classes and layout is not None:
                key = "^(" + "|".join(classes) + ")$"
        rewritten[key] = value
    return rewritten


class _Entry:
    """One entry of the user's mapping, as transformers will see it, and whether it can bind on the model.

    kind: "hub" (a stateless kernel under a hub name: kernelize binds it to the HF classes registered under that
    name), "class" (a kernel with a Layout: the key is a class-name regex, hub names anchored), "fusion" (an
    n-to-1 tuple key). `name` is the key transformers' compiled mapping gets: the hub name, or the kernel class.
    """

    def __init__(self, user_key, key, value, layer_cls, layout):
        self.user_key, self.key, self.value, self.layout = user_key, key, value, layout
        self.kind = "fusion" if isinstance(key, tuple) else "class" if layout is not None else "hub"
        self.name = key if self.kind == "hub" else layer_cls.__name__

    def matches_statically(self, namespace: dict) -> bool:
        """Can this entry bind on a model whose modeling module has `namespace` (its classes and hub functions)?"""
        if self.kind == "fusion":
            return True  # transformers matches the module paths on a meta model and raises if none matches
        if self.kind == "hub":
            return any(getattr(obj, "kernel_layer_name", None) == self.key for obj in namespace.values()
                       if isinstance(obj, type) or hasattr(obj, "kernel_layer_name"))
        pattern = re.compile(self.key)
        return any(isinstance(obj, type) and pattern.search(name) for name, obj in namespace.items())

    def applies(self, model, registered: set, namespace: dict) -> bool:
        """Did this entry bind anything on the built model?"""
        if self.kind == "hub":
            return self.key in registered
        if self.kind == "class" and not self.matches_statically(namespace):
            return False
        return any(isinstance(m, self.layout) for m in model.modules())


def _model_namespace(cls) -> dict:
    """The module that defines the model class: its classes (what the class-name keys can patch) and hub
    functions. Wrappers made at run time (FSDP2's `FSDP<Model>`) are skipped for the class they wrap."""
    for c in cls.__mro__:
        if "config_class" not in vars(c):  # mixins such as FSDPModule, or no model class at all
            continue
        module = sys.modules.get(c.__module__)
        if module is not None and getattr(module, c.__name__, None) is c:
            return dict(vars(module))
    return {}


def kernel_state_snapshot():
    """Capture transformers' global kernel/patch/conversion state; call `.restore()` to put it back."""
    return private.GlobalState()


@contextmanager
def restore_global_state():
    """Context manager: whatever a kernelized load registers inside is undone on exit, also when the load raises
    while reading the checkpoint (see the module docstring)."""
    state = private.GlobalState()
    try:
        yield
    finally:
        state.restore()


logger = logging.getLogger(__name__)


class KernelConfig(transformers.KernelConfig):
    """transformers' `KernelConfig`, same mapping forms, plus: every mode, cpu, reusable, no global leftovers;
    with no mapping, every hubfuse kernel for the model being loaded.

    Example::

        import hubfuse
        model = AutoModelForCausalLM.from_pretrained(ckpt, use_kernels=True, kernel_config=hubfuse.KernelConfig())
        model.train()   # still runs the kernels; the loss is the fused linear cross-entropy (+ fused MoE aux loss)

    - No mapping: the preset of the model's family, read from `config.model_type` when the load starts
      (`hubfuse.presets`: qwen3, qwen3_moe, qwen3_5_moe, llama, qwen2; another type raises, listing them), and the
      fused losses switched on once the model is built (`losses=False` keeps HF's loss). `family=` forces a preset.
    - An explicit mapping binds what it lists (`losses=True` adds the fused losses). A mapping, a preset or a
      family whose entries bind nothing on the model raises instead of loading an un-kernelized model; an entry
      that binds nothing is ignored (said once if it is a class-name regex that no preset marks optional).
    - Kernels come from the hub org `org` (`version=1` unless `revision`/`version` is given), or from this
      clone's builds: `local=True` (or `hubfuse.use_local_builds()` once) builds every repo and points
      LOCAL_KERNELS at them; presets then ask for `revision="v1"`.
    - `clean_global_state=False` keeps transformers' stock behaviour of leaving the patch and conversion
      mappings registered after a load that succeeds (one that raises is still undone, see the module docstring). `inherit_mapping` defaults to False (stock: True): only the kernels
      you list are bound, instead of also pulling transformers' default hub kernels for every other hooked
      layer on CUDA (a network fetch at load time, and numerics you did not ask for).
    """

    def __init__(self, kernel_mapping=None, use_local_kernel=False, inherit_mapping=False, clean_global_state=True,
                 *, family=None, org=None, revision=None, version=None, trust_remote_code=False, losses=None,
                 local=False):
        from . import presets
        from .sources import ORG, clone_repo_names, local_builds, use_local_builds

        if kernel_mapping is not None and family is not None:
            raise ValueError("hubfuse.KernelConfig: pass a kernel mapping or a family, not both")
        if family is not None:
            presets.family_of(family)  # unknown family: the error lists the supported ones
        self._preset = kernel_mapping is None  # the mapping is the preset of `family` or of the loaded model
        self._family = family
        self._source = dict(org=org or ORG, revision=revision, version=version, trust_remote_code=trust_remote_code)
        self._losses = losses
        if local and not {f"{org or ORG}/{name}" for name in clone_repo_names()} <= set(local_builds()):
            use_local_builds(org=org or ORG)  # once per process: later configs find the builds registered
        self._user_mapping = copy.deepcopy(kernel_mapping if kernel_mapping is not None else {})
        self._pending_state = None
        self._clean_global_state = clean_global_state
        self._load = None  # what the load in progress resolved (entries, family, losses)
        super().__init__(copy.deepcopy(self._user_mapping), use_local_kernel, inherit_mapping)
        private.install_kernel_registration_hook(_registration_hook)

    def _begin_load(self, cls, config):
        """The start of a kernelized `from_pretrained` of `cls` (from the registration hook, before transformers
        registers anything): resolve and check the mapping for this model, capture the global state."""
        self.kernel_mapping = self._start_load(cls, config)  # raises before anything global is touched
        self.registered_layer_names = {}
        self._pending_state = private.GlobalState()  # restored on failure, and on success if clean_global_state
        _UNFINISHED.append(self._pending_state)

    def _start_load(self, cls, config) -> dict:
        """Resolve and check the mapping for the model about to be built (nothing global is touched yet): the
        preset of its family, every kernel loaded (errors name the cause), entries that cannot bind refused."""
        from . import presets
        from .sources import load_kernel, load_layer

        model_type = getattr(config, "model_type", None) or getattr(getattr(cls, "config_class", None),
                                                                    "model_type", None)
        model_name = cls.__name__
        family = None
        if self._preset or self._losses:
            if self._family is None and model_type is None:
                raise ValueError("hubfuse.KernelConfig: cannot tell which model is being loaded (no config.model_type);"
                                 " pass KernelConfig(family=...) or an explicit mapping")
            family = presets.family_of(self._family or model_type, None if self._family else model_name)
        mapping = self._user_mapping  # not `kernel_mapping`: a load that failed late left transformers' rewrite there
        if self._preset:
            mapping = presets.kernel_mapping(family, **self._source)
        elif not self.use_local_kernel:
            mapping = {key: _with_default_meta(value) for key, value in mapping.items()}
        where = f"hubfuse.KernelConfig ({model_name})"
        loaded = {key: load_layer(*_mapping_value(value), use_local_kernel=self.use_local_kernel, where=where)
                  for key, value in mapping.items()}
        losses = self._losses if self._losses is not None else self._preset
        if losses:  # the loss kernels, checked now rather than after the weights are loaded
            for repo in ("cross-entropy", "load-balancing-loss") if family in presets.MOE_FAMILIES else ("cross-entropy",):
                repo_id = f"{self._source['org']}/{repo}"
                load_kernel(repo_id, presets._meta(repo_id, self._source["revision"], self._source["version"],
                                                   self._source["trust_remote_code"]), where=where)
        anchored = anchor_hub_name_keys(mapping, self.use_local_kernel, {k: layout for k, (_, layout) in loaded.items()})
        entries = [_Entry(user_key, key, value, *loaded[user_key])
                   for (user_key, value), key in zip(mapping.items(), anchored)]
        if entries:
            namespace = _model_namespace(cls)
            if not any(e.matches_statically(namespace) for e in entries):
                raise ValueError(self._binds_nothing(model_name, model_type, entries, family))
        self._load = dict(entries=entries, family=family, losses=losses, model_type=model_type)
        return anchored

    def _binds_nothing(self, model_name, model_type, entries, family) -> str:
        from . import presets

        what = f"the {family!r} preset" if self._preset else "the kernel mapping"
        try:
            own = presets.family_of(model_type) if model_type else None
        except ValueError:
            own = None
        hint = (f"for every hubfuse kernel of this model use hubfuse.KernelConfig() (the {own!r} preset)" if own else
                f"hubfuse presets exist for {', '.join(presets.FAMILIES)}")
        keys = ", ".join(repr(e.user_key) for e in entries)
        return (f"hubfuse.KernelConfig: {what} binds no kernel on {model_name} (model_type {model_type!r}): none of "
                f"its entries ({keys}) matches a module of this model; {hint}")

    def sanitize_kernel_mapping(self, model):
        """Stock validation, after dropping the entries that bind nothing on this model: one mapping can serve
        several model families (e.g. the RMSNorm, RMSNormZeroCentered and RMSNormGated entries together, for
        Qwen3 and Qwen3.5 alike). A class-name regex entry that matches nothing is said once (unless a preset marks
        it optional); a mapping of which no entry binds raises."""
        from . import presets

        if self._load is None:  # set_use_kernels(True, config) on a built model: no load start was seen
            self.kernel_mapping = self._start_load(type(model), model.config)
        self.store_registered_layer_names(model)
        registered = set(self.registered_layer_names.values())
        entries, namespace = self._load["entries"], _model_namespace(type(model))
        applied = {id(e): e.applies(model, registered, namespace) for e in entries}
        if entries and not any(applied.values()):
            message = self._binds_nothing(type(model).__name__, self._load["model_type"], entries,
                                          self._load["family"])
            self._abort_load()
            raise ValueError(message)
        bound_names = {e.name for e in entries if applied[id(e)]}
        for e in entries:
            if not applied[id(e)]:
                self.kernel_mapping.pop(e.key, None)  # still there when no load start rewrote the keys
                if e.name not in bound_names:
                    # also keeps kernelize from binding the kernel to HF classes that carry its name as a hub name
                    self.kernel_mapping.pop(e.name, None)
        unexpected = [e.user_key for e in entries if not applied[id(e)] and e.kind == "class" and not self._preset
                      and isinstance(e.user_key, str) and not e.user_key.isidentifier()
                      and e.user_key not in presets.OPTIONAL_KEYS]
        if unexpected:
            logger.warning("hubfuse.KernelConfig: %d mapping %s no module of %s and %s ignored: %s",
                           len(unexpected), "entry matches" if len(unexpected) == 1 else "entries match",
                           type(model).__name__, "is" if len(unexpected) == 1 else "are",
                           ", ".join(map(repr, unexpected)))
        super().sanitize_kernel_mapping(model)

    def create_compatible_mapping(self, model, compile=False):
        """Register each kernel for every mode on the model's device (cpu included), bind it to the model."""
        from kernels import LayerRepository, LocalLayerRepository

        device = infer_device(model)
        compatible = {}
        for layer_name, kernel in self.kernel_mapping.items():
            if isinstance(kernel, dict):  # {device: repo}: keep the entry for this model's device
                if device not in kernel:
                    continue
                kernel = kernel[device]
            repo_name, meta = kernel if isinstance(kernel, tuple) else (kernel, {})
            repo_id, _, layer = repo_name.partition(":")
            if self.use_local_kernel:
                from pathlib import Path

                repo = LocalLayerRepository(repo_path=Path(repo_id), layer_name=layer)
            else:
                revision = meta.get("revision")
                version = meta.get("version", None if revision is not None else 1)
                repo = LayerRepository(repo_id=repo_id, layer_name=layer, revision=revision, version=version,
                                       trust_remote_code=meta.get("trust_remote_code", False))
            compatible[layer_name] = {device: {mode: repo for mode in _all_modes()}}
        # The model's other hub-hooked layers (SiLU, the gated-delta-rule functions, ...) are deliberately left
        # unmapped: an entry without devices makes kernelize keep their forward without a warning per module.
        for name in set(self.registered_layer_names.values()) - set(compatible):
            compatible[name] = {}

        # The model keeps its own compiled copy (used again on every train()/eval()); this object goes back
        # to the user's mapping so it can serve another load.
        bound = copy.copy(self)
        bound.kernel_mapping = compatible
        bound._pending_state = None
        bound._load = None
        model.kernel_config = bound
        self._finish_load(model)

    def _abort_load(self):
        """After a load that raised while registering or building, or one this config refused once the model was
        built: the global state as it was before (with any other load's left behind), and the user's mapping back
        (so this object can serve another load)."""
        self._pending_state = None
        self._load = None
        self.registered_layer_names = {}
        self.kernel_mapping = copy.deepcopy(self._user_mapping)
        _recover_from_failed_loads()

    def _finish_load(self, model):
        load, self._load = self._load, None
        state, self._pending_state = self._pending_state, None
        self.registered_layer_names = {}
        self.kernel_mapping = copy.deepcopy(self._user_mapping)
        if state is not None:
            if state in _UNFINISHED:
                _UNFINISHED.remove(state)
            if self._clean_global_state:
                # Output-capturing hooks read the (patched) class-level recorders when first installed: install
                # them on this model now, then give the classes their original recorders back.
                private.install_output_capturing_hooks(model)
                state.restore()
        if load is not None and load["losses"] and (self._losses or _has_lm_head(model)):
            from . import presets

            presets.enable_losses(model, load["family"], **self._source)
        _init_missing_parameters(model)
        _name_decoder_layers_unsplit(model)
        from .training import apply_training_defaults  # no KV cache in training, the causal mask path (training.py)

        apply_training_defaults(model)


def _init_missing_parameters(model) -> None:
    """The Layouts' parameters the checkpoint lacked get the initialisation transformers gives the classes they
    replace (`hubfuse._common.missing_init`); loaded parameters are untouched."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    std = getattr(config, "initializer_range", 0.02)
    for module in model.modules():
        init = getattr(module, "init_missing_parameters", None)
        if callable(init):
            init(std)


def _name_decoder_layers_unsplit(model) -> None:
    """A Layout that replaces the decoder layer (`DecoderLayerLayout`, or the `Fused*DecoderLayer` subclass of an
    n-to-1 fusion) has a class name that `model._no_split_modules` lacks; wrap policies that find the layers by
    those names (accelerate's FSDP `TRANSFORMER_BASED_WRAP`) would miss them. This model instance's list gets the
    new names (the class's list is left as it is)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    names = getattr(model, "_no_split_modules", None)
    if layers is None or not names:
        return
    new = [n for n in dict.fromkeys(type(layer).__name__ for layer in layers) if n not in names]
    if new:  # transformers keeps a set on the instance (a list on the class)
        model._no_split_modules = set(names) | set(new) if isinstance(names, set) else [*names, *new]


def _has_lm_head(model) -> bool:
    import torch

    return isinstance(getattr(model, "lm_head", None), torch.nn.Linear) and \
        isinstance(getattr(model, "model", None), torch.nn.Module)
