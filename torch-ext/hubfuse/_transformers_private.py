"""Every access hubfuse makes to transformers internals, in one place. Read from transformers 5.22.2.

transformers 5.22.2 has no public surface for these; each entry says what it needs and why. A transformers release
that renames or reshapes one of them fails `tests/test_transformers_private.py` (names, types and signatures)
rather than hubfuse silently doing the wrong thing.

1. `hub_kernels.register_kernel_replacements_and_fusions(cls, config, kernel_config)`: the only call of a
   kernelized `from_pretrained` that carries the model class and config (the preset is chosen from
   `config.model_type`). No `KernelConfig` method receives them, and nothing is called on failure. The function is
   imported from its module at every call, so `install_kernel_registration_hook` wraps that module attribute
   (once per process; a load whose kernel config does not ask for the hook runs the stock function unchanged).
2. The process-global registries a kernelized load leaves behind, and the state a failed one leaves half-done:
   `monkey_patching._monkey_patch_mapping_cache` (+ `_monkey_patch_lock`), the module classes `apply_patches`
   swaps (it has no try/finally), `conversion_mapping._checkpoint_conversion_mapping_cache` and
   `USER_REGISTERED_MAPPINGS` (the public register/get functions can neither delete an entry nor return the
   cache), and the class-level `_can_record_outputs` dicts (and their `OutputRecorder.target_class`) that
   `patch_output_recorders` edits in place. `GlobalState` captures and restores all of them.
3. `output_capturing.install_all_output_capturing_hooks` and the `_output_capturing_hooks_installed` flag: the
   hooks read the (patched) class-level recorders when installed, so they are installed on the model before the
   recorders are restored.
"""
from __future__ import annotations

import functools
import sys

TRANSFORMERS_VERSION = "5.22.2"  # the version every access below was read from


# ------------------------------------------------------------------ 1. the registration call of a kernelized load


def install_kernel_registration_hook(hook) -> None:
    """Make `from_pretrained` call `hook(register, cls, config, kernel_config)` where it calls
    `register_kernel_replacements_and_fusions(cls, config, kernel_config)` (`register`: the stock function).

    transformers 5.22.2, `PreTrainedModel.from_pretrained`: `from .integrations.hub_kernels import
    register_kernel_replacements_and_fusions` then the call, only when `kernel_config` is given and `use_kernels`.
    Installed once per process; `hook` decides per call (a stock `KernelConfig` gets `register` unchanged)."""
    from transformers.integrations import hub_kernels

    current = hub_kernels.register_kernel_replacements_and_fusions
    if getattr(current, "_hubfuse_hook", None) is hook:
        return
    stock = current.__wrapped__ if hasattr(current, "_hubfuse_hook") else current

    @functools.wraps(stock)
    def register_kernel_replacements_and_fusions(cls, config, kernel_config):
        return hook(stock, cls, config, kernel_config)

    register_kernel_replacements_and_fusions._hubfuse_hook = hook
    hub_kernels.register_kernel_replacements_and_fusions = register_kernel_replacements_and_fusions


# ------------------------------------------------------------------ 2. global registries


def _transformers_modules(prefix: str = "transformers"):
    return [(name, module) for name, module in list(sys.modules.items())
            if name.startswith(prefix) and module is not None]


def _snapshot_output_recorders():
    """(class, {output: (recorder value, [(OutputRecorder, target_class)])}) for every loaded HF model class."""
    from transformers.utils.output_capturing import OutputRecorder

    snapshot = []
    for _, module in _transformers_modules("transformers.models."):
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


class GlobalState:
    """What a kernelized `from_pretrained` mutates in transformers, captured so that `restore()` puts it back."""

    def __init__(self):
        from transformers import conversion_mapping, monkey_patching

        conversion_mapping.get_checkpoint_conversion_mapping("llama")  # builds the cache if it is still None
        self.patch_mapping = monkey_patching.get_patch_mapping()
        self.conversions = dict(conversion_mapping._checkpoint_conversion_mapping_cache)
        self.user_registered = set(conversion_mapping.USER_REGISTERED_MAPPINGS)
        self.recorders = _snapshot_output_recorders()
        self.module_classes = {name: {k: v for k, v in vars(module).items() if isinstance(v, type)}
                               for name, module in _transformers_modules()}

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


# ------------------------------------------------------------------ 3. output-capturing hooks


def install_output_capturing_hooks(model) -> None:
    """Install transformers' output-recording hooks on `model` now (no-op if already installed), so that they
    target the classes the model was built with. A recorded class the model has no module of, because a Layout
    built that module under its own class (the decoder-layer Layout's attention), gets its hook on the modules
    that stand in for it (`recorded_as`: the HF class name); an attention-weight recorder is marked
    `_common.modules.RECORDS_ATTENTION_WEIGHTS`."""
    from transformers.modeling_utils import PreTrainedModel
    from transformers.utils.output_capturing import (_CAN_RECORD_REGISTRY, OutputRecorder,
                                                     install_all_output_capturing_hooks, install_output_capuring_hook)

    from ._common.modules import RECORDS_ATTENTION_WEIGHTS

    def own_modules(sub):
        """sub's modules, not descending into nested models (their own recorders apply there, as transformers does)."""
        for child in sub.children():
            yield child
            if not isinstance(child, PreTrainedModel):
                yield from own_modules(child)

    if getattr(model, "_output_capturing_hooks_installed", False):
        return
    install_all_output_capturing_hooks(model)
    for sub in [model, *(m for m in model.modules() if m is not model and isinstance(m, PreTrainedModel))]:
        modules = list(own_modules(sub))
        for key, specs in (_CAN_RECORD_REGISTRY.get(str(sub.__class__)) or {}).items():
            for spec in specs if isinstance(specs, list) else [specs]:
                # transformers' own reading of a spec (output_capturing.install_all_output_capturing_hooks)
                target = spec.target_class if isinstance(spec, OutputRecorder) else spec
                if not isinstance(target, type) or any(isinstance(m, target) for m in modules):
                    continue
                index = spec.index if isinstance(spec, OutputRecorder) else (0 if "hidden_states" in key else 1)
                for m in modules:
                    if getattr(m, "recorded_as", None) != target.__name__:
                        continue
                    before = set(m._forward_hooks)
                    install_output_capuring_hook(m, key, index)
                    for handle_id in set(m._forward_hooks) - before:
                        if key == "attentions":
                            setattr(m._forward_hooks[handle_id], RECORDS_ATTENTION_WEIGHTS, True)
