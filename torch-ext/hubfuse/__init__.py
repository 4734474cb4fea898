"""hubfuse: fused LLM-training kernels (Triton) as Hugging Face hub kernels.

As a hub kernel (the umbrella repo, assembled by `scripts/build.py`), `layers` exposes every op family's Layers
and Layouts; each family is also a sub-package (`rmsnorm`, ...) of the built umbrella. As a Python package
(`pip install -e .`, the source tree, which holds no op package), it provides
`KernelConfig`, the transformers `KernelConfig` that works for training and on CPU (imported lazily: the
hub kernel itself needs nothing beyond torch), `presets` (`kernel_mapping(family)`, `enable_losses(model,
family)`: every kernel that applies to a model family) and `distributed` (FSDP2 + expert parallelism over a
kernelized model, HF-format checkpoints of the sharded model).
"""
__all__ = ["layers", "KernelConfig", "kernel_state_snapshot", "restore_global_state", "presets", "distributed",
           "kernel_mapping", "enable_losses"]


def __getattr__(name):
    if name == "layers":  # only in the built umbrella, which vendors the op packages beside this module
        import importlib

        return importlib.import_module(f"{__name__}.layers")
    if name in ("KernelConfig", "kernel_state_snapshot", "restore_global_state"):
        from . import kernel_config

        return getattr(kernel_config, name)
    if name in ("presets", "distributed"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    if name in ("kernel_mapping", "enable_losses"):
        from . import presets

        return getattr(presets, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
