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
model is built. A load that raises restores it before the exception reaches the caller: creating a
hubfuse.KernelConfig wraps `PreTrainedModel.from_pretrained` once per process (`_guard_from_pretrained`; loads
without a hubfuse.KernelConfig run unchanged through it). `restore_global_state()` / `kernel_state_snapshot()`
are also exported for manual use.
"""
from __future__ import annotations

import copy
import functools
import sys
from contextlib import contextmanager

import transformers
from transformers.utils.kernel_config import infer_device


def _all_modes():
    from kernels import Mode

    return (Mode.INFERENCE, Mode.TRAINING, Mode.INFERENCE | Mode.TORCH_COMPILE, Mode.TRAINING | Mode.TORCH_COMPILE)


class _GlobalState:
    """What a kernelized `from_pretrained` mutates in transformers, captured so it can be put back."""

    def __init__(self):
        from transformers import conversion_mapping, monkey_patching

        conversion_mapping.get_checkpoint_conversion_mapping("llama")  # make sure the cache exists
        self.patch_mapping = monkey_patching.get_patch_mapping()
        self.conversions = dict(conversion_mapping._checkpoint_conversion_mapping_cache)
        self.user_registered = set(conversion_mapping.USER_REGISTERED_MAPPINGS)
        self.recorders = _snapshot_output_recorders()
        # `apply_patches` swaps classes in transformers' modules and has no try/finally: a load that fails
        # while building the model leaves them swapped. Keep the originals to put back.
        self.module_classes = {name: {k: v for k, v in vars(module).items() if isinstance(v, type)}
                               for name, module in list(sys.modules.items())
                               if name.startswith("transformers") and module is not None}

    def restore(self):
        from transformers import conversion_mapping, monkey_patching

        with monkey_patching._monkey_patch_lock:
            monkey_patching._monkey_patch_mapping_cache.clear()
            monkey_patching._monkey_patch_mapping_cache.update(self.patch_mapping)
        conversion_mapping._checkpoint_conversion_mapping_cache = dict(self.conversions)
        conversion_mapping.USER_REGISTERED_MAPPINGS.clear()
        conversion_mapping.USER_REGISTERED_MAPPINGS.update(self.user_registered)
        for cls, entries in self.recorders:
            recorders = cls.__dict__["_can_record_outputs"]
            recorders.clear()
            for key, (value, targets) in entries.items():
                for recorder, target in targets:
                    recorder.target_class = target
                recorders[key] = value
        for name, classes in self.module_classes.items():
            module = sys.modules.get(name)
            if module is None:
                continue
            for attr, cls in classes.items():
                if vars(module).get(attr) is not cls:
                    setattr(module, attr, cls)


# States captured at the start of a kernelized load and not yet restored. The `from_pretrained` guard restores
# them when a load raises; the next load (through any hubfuse.KernelConfig) also restores any left before
# starting (a load that did not go through the guard).
_UNFINISHED: list[_GlobalState] = []


def _recover_from_failed_loads():
    while _UNFINISHED:
        _UNFINISHED.pop().restore()  # the oldest is restored last: it holds the state before all of them


def _guard_from_pretrained():
    """Wrap `PreTrainedModel.from_pretrained` (once per process): a load given a hubfuse.KernelConfig that raises
    restores transformers' global state, and the config's own mapping, before the exception propagates.

    transformers registers the class patches and conversion mappings before it builds the model and has no
    try/finally around the build or the checkpoint load, so there is no hook inside the load to do it from.
    Loads without a hubfuse.KernelConfig call the stock function unchanged."""
    from transformers import PreTrainedModel

    stock = PreTrainedModel.__dict__["from_pretrained"].__func__
    if getattr(stock, "_hubfuse_guard", False):
        return

    @functools.wraps(stock)
    def from_pretrained(cls, *args, **kwargs):
        kernel_config = kwargs.get("kernel_config")
        if not isinstance(kernel_config, KernelConfig):
            return stock(cls, *args, **kwargs)
        try:
            return stock(cls, *args, **kwargs)
        except BaseException:
            kernel_config._abort_load()
            raise

    from_pretrained._hubfuse_guard = True
    PreTrainedModel.from_pretrained = classmethod(from_pretrained)


def _snapshot_output_recorders():
    """(class, {output: (recorder value, [(OutputRecorder, target_class)])}) for every loaded HF model class.

    `patch_output_recorders` edits these class-level dicts (and the OutputRecorder objects in them) in place.
    """
    from transformers.utils.output_capturing import OutputRecorder

    snapshot = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("transformers.models.") or module is None:
            continue
        for obj in list(vars(module).values()):
            recorders = obj.__dict__.get("_can_record_outputs") if isinstance(obj, type) else None
            if not isinstance(recorders, dict):
                continue
            entries = {}
            for key, value in recorders.items():
                items = value if isinstance(value, list) else [value]
                targets = [(r, r.target_class) for r in items if isinstance(r, OutputRecorder)]
                entries[key] = (list(value) if isinstance(value, list) else value, targets)
            snapshot.append((obj, entries))
    return snapshot


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


def _kernel_has_layout(value, use_local_kernel: bool) -> bool:
    """Does the kernel layer named by a mapping value ship a `<Layer>Layout` beside it?"""
    from pathlib import Path

    from kernels import LayerRepository, LocalLayerRepository

    if isinstance(value, dict):  # {device: repo}
        value = next(iter(value.values()))
    repo_name, meta = value if isinstance(value, tuple) else (value, {})
    repo_id, _, layer = repo_name.partition(":")
    if use_local_kernel:
        repo = LocalLayerRepository(repo_path=Path(repo_id), layer_name=layer)
    else:
        revision = meta.get("revision")
        repo = LayerRepository(repo_id=repo_id, layer_name=layer, revision=revision,
                               version=meta.get("version", None if revision is not None else 1),
                               trust_remote_code=meta.get("trust_remote_code", False))
    cls = repo.load()
    return hasattr(sys.modules.get(cls.__module__), f"{cls.__name__}Layout")


def anchor_hub_name_keys(mapping: dict, use_local_kernel: bool = False) -> dict:
    """Rewrite plain hub-name keys whose kernel ships a Layout into anchored class-name regexes.

    transformers treats every key as a class-name regex (`re.search`) as soon as the kernel has a Layout, so
    the hub name "RMSNorm" also matches `Qwen3_5MoeRMSNorm` and `Qwen3_5MoeRMSNormGated` and swaps them for the
    standard RMSNorm Layout: a silent wrong result. A hub name is meant to select exactly the classes
    transformers registered under it, so it becomes `^(Qwen3RMSNorm|LlamaRMSNorm|...)$`.
    """
    rewritten = {}
    for key, value in mapping.items():
        if isinstance(key, str) and key.isidentifier():
            classes = _hub_name_classes(key)
            if classes and _kernel_has_layout(value, use_local_kernel):
                key = "^(" + "|".join(classes) + ")$"
        rewritten[key] = value
    return rewritten


def kernel_state_snapshot():
    """Capture transformers' global kernel/patch/conversion state; call `.restore()` to put it back."""
    return _GlobalState()


@contextmanager
def restore_global_state():
    """Context manager: whatever a kernelized load registers inside is undone on exit."""
    state = _GlobalState()
    try:
        yield
    finally:
        state.restore()


class KernelConfig(transformers.KernelConfig):
    """transformers' `KernelConfig`, same mapping forms, plus: every mode, cpu, reusable, no global leftovers.

    Example::

        from hubfuse import KernelConfig
        kc = KernelConfig({"RMSNorm": ("hubfuse/rmsnorm:RMSNorm", {"version": 1})})
        model = AutoModelForCausalLM.from_pretrained(ckpt, use_kernels=True, kernel_config=kc)
        model.train()   # still runs the kernels

    `clean_global_state=False` keeps transformers' stock behaviour of leaving the patch and conversion
    mappings registered after the load. `inherit_mapping` defaults to False (stock: True): only the kernels
    you list are bound, instead of also pulling transformers' default hub kernels for every other hooked
    layer on CUDA (a network fetch at load time, and numerics you did not ask for).
    """

    def __init__(self, kernel_mapping=None, use_local_kernel=False, inherit_mapping=False, clean_global_state=True):
        self._user_mapping = copy.deepcopy(kernel_mapping if kernel_mapping is not None else {})
        self._pending_state = None
        self._clean_global_state = clean_global_state
        super().__init__(copy.deepcopy(self._user_mapping), use_local_kernel, inherit_mapping)
        _guard_from_pretrained()

    # transformers reads `kernel_mapping` first thing in `from_pretrained` (before it registers patches and
    # builds the model): that read is our hook to capture the global state the load is about to change and
    # to anchor hub-name keys.
    @property
    def kernel_mapping(self):
        # Only transformers' own first read of a fresh mapping starts a load; a user inspecting the mapping
        # sees it unchanged.
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if self.__dict__.get("_fresh", False) and caller.startswith("transformers."):
            self._fresh = False
            if self._clean_global_state and self._pending_state is None:
                _recover_from_failed_loads()
                self._pending_state = _GlobalState()
                _UNFINISHED.append(self._pending_state)
            self.__dict__["_kernel_mapping"] = anchor_hub_name_keys(self.__dict__["_kernel_mapping"],
                                                                    self.use_local_kernel)
        return self.__dict__["_kernel_mapping"]

    @kernel_mapping.setter
    def kernel_mapping(self, value):
        self.__dict__["_kernel_mapping"] = value
        if value == self.__dict__.get("_user_mapping"):
            self._fresh = True

    def sanitize_kernel_mapping(self, model):
        """Stock validation, except that entries no module of this model uses are dropped with a warning
        instead of raising: one mapping can then serve several model families (e.g. the RMSNorm,
        RMSNormZeroCentered and RMSNormGated entries together, for Qwen3 and Qwen3.5 alike)."""
        import logging

        self.store_registered_layer_names(model)
        present = set(self.registered_layer_names.values())
        for name in [k for k in self.kernel_mapping if isinstance(k, str) and k not in present]:
            logging.getLogger(__name__).warning("hubfuse.KernelConfig: no module of %s uses kernel %r; entry "
                                                "ignored for this model", type(model).__name__, name)
            del self.kernel_mapping[name]
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

        # The model keeps its own compiled copy (used again on every train()/eval()); this object goes back
        # to the user's mapping so it can serve another load.
        bound = copy.copy(self)
        bound.__dict__["_kernel_mapping"] = compatible
        bound._fresh = False
        bound._pending_state = None
        model.kernel_config = bound
        self._finish_load(model)

    def _abort_load(self):
        """After a load that raised: the global state as it was before, and the user's mapping back (so this
        object can serve another load)."""
        self._pending_state = None
        self.registered_layer_names = {}
        self.kernel_mapping = copy.deepcopy(self._user_mapping)
        _recover_from_failed_loads()

    def _finish_load(self, model):
        state, self._pending_state = self._pending_state, None
        self.registered_layer_names = {}
        self.kernel_mapping = copy.deepcopy(self._user_mapping)
        if state is None:
            return
        if state in _UNFINISHED:
            _UNFINISHED.remove(state)
        # Output-capturing hooks read the (patched) class-level recorders when first installed: install them
        # on this model now, then give the classes their original recorders back.
        from transformers.utils.output_capturing import install_all_output_capturing_hooks

        if not getattr(model, "_output_capturing_hooks_installed", False):
            install_all_output_capturing_hooks(model)
        state.restore()
