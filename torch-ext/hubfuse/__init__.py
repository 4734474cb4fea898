"""hubfuse: fused LLM-training kernels (Triton) as Hugging Face hub kernels.

Every op family is a sub-package: `hubfuse.rmsnorm`, `hubfuse.rotary`, ... In the source tree (a clone, `pip
install -e .`) they are the kernel repos' packages, `kernel_repos/<op>/torch-ext/<pkg>/`, which `__path__` takes in
(`hubfuse.build.families()` lists them); in the built umbrella hub kernel they are physical sub-packages. `layers`
exposes every family's Layers and Layouts. The package also provides `KernelConfig`, the transformers
`KernelConfig` that works for training and on CPU and, with no mapping, turns on every hubfuse kernel for the model
being loaded (imported lazily: the hub kernel itself needs nothing beyond torch), `presets`
(`kernel_mapping(family)`, `enable_losses(model, family)`: every kernel that applies to a model family),
`use_local_builds()` (build this clone's kernel repos and load them instead of the hub's), `optim` (`AdamW`:
torch's AdamW with a one-pass update of each large tensor on the GPU), `distributed` (FSDP2 +
expert parallelism over a kernelized model, HF-format checkpoints of the sharded model), `cuda_graphs` (a whole
training step captured in one CUDA graph) and `training` (`apply_training_defaults`: in training mode no KV cache
unless `use_cache=True` is passed, and SDPA's causal path under compile and CUDA graphs too; KernelConfig applies
it to every model it loads).
"""
from pathlib import Path as _Path

_here = _Path(__file__).resolve().parent
if _here.parent.name == "torch-ext" and (_here.parents[1] / "kernel_repos").is_dir():  # the source tree
    from .build import families as _families

    __path__.extend(str(repo / "torch-ext") for repo in _families(_here.parents[1]).values())
    del _families
del _Path, _here

__all__ = ["layers", "KernelConfig", "kernel_state_snapshot", "restore_global_state", "presets", "distributed",
           "cuda_graphs", "training", "optim", "kernel_mapping", "enable_losses", "use_local_builds", "local_builds"]


def __getattr__(name):
    import importlib

    if name in ("KernelConfig", "kernel_state_snapshot", "restore_global_state"):
        from . import kernel_config

        return getattr(kernel_config, name)
    if name in ("layers", "presets", "sources", "distributed", "cuda_graphs", "training", "optim"):
        return importlib.import_module(f"{__name__}.{name}")
    if name in ("kernel_mapping", "enable_losses"):
        from . import presets

        return getattr(presets, name)
    if name in ("use_local_builds", "local_builds"):
        from . import sources

        return getattr(sources, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
