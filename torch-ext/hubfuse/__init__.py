"""hubfuse: fused LLM-training kernels (Triton) as Hugging Face hub kernels.

As a hub kernel (the umbrella repo, assembled by `scripts/build.py`), `layers` exposes every op family's Layers
and Layouts; each family is also a sub-package (`rmsnorm`, ...) of the built umbrella. As a Python package
(`pip install -e .`, the source tree, which holds no op package), it provides
`KernelConfig`, the transformers `KernelConfig` that works for training and on CPU (imported lazily: the
hub kernel itself needs nothing beyond torch), and `presets` (`kernel_mapping(family)`, `enable_losses(model,
family)`: every kernel that applies to a model family).
"""
__all__ = ["layers", "KernelConfig", "kernel_state_snapshot", "restore_global_state", "presets", "kernel_mapping",
           "enable_losses"]


def __getattr__(name):
    if name == "layers":  # only in the built umbrella, which vendors the op packages beside this module
        import importlib

        return importlib.import_module(f"{__name__}.layers")
    if name in ("KernelConfig", "kernel_state_snapshot", "restore_global_state"):
        from . import kernel_config

        return getattr(kernel_config, name)
    if name == "presets":
        import importlib

        return importlib.import_module(f"{__name__}.presets")
    if name in ("kernel_mapping", "enable_losses"):
        from . import presets

        return getattr(presets, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
