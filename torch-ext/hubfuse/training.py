"""Training-time behaviour of a kernelized model, per instance.

`skip_cache_in_training(model)`: in training mode, a forward that leaves `use_cache` at its default builds no KV
cache. transformers' decoder models read `use_cache=None` as the config's `use_cache` (True for every causal LM),
so each training forward builds a `DynamicCache` and every attention layer writes its keys and values into it,
for nothing: a training step never reads them back. That costs memory and time, and under torch.compile the
cache's per-layer state (`past_key_values.layers[i].is_initialized`) is guarded on, so the compiled attention
recompiles for every layer. `use_cache=True` passed explicitly is honoured, and eval / `generate` are unchanged.
"""
from __future__ import annotations

import inspect

import torch

_HOOKED = "_hubfuse_skip_cache_in_training"


def _no_default_cache_in_training(module, args, kwargs):
    if module.training and kwargs.get("use_cache") is None:
        return args, {**kwargs, "use_cache": False}
    return None


def skip_cache_in_training(model: torch.nn.Module) -> torch.nn.Module:
    """Make `model` build no KV cache in training mode unless `use_cache=True` is passed.

    Registers a forward pre-hook on every transformers model module of `model` that takes `use_cache` (the
    decoder model, e.g. `model.model`, and the causal LM itself): while `module.training`, a `use_cache` keyword
    that is missing or None becomes False (transformers' decoder models take `use_cache` by keyword only: their
    `merge_with_config_defaults` wrapper does not see a positional one). Per instance (the classes and other
    models are untouched); idempotent. `hubfuse.KernelConfig` calls it on every model it loads. Returns the model.
    """
    from transformers import PreTrainedModel

    for module in model.modules():
        if not isinstance(module, PreTrainedModel) or _HOOKED in module.__dict__:
            continue
        forward = inspect.unwrap(type(module).forward)
        if "use_cache" not in inspect.signature(forward).parameters:
            continue
        module.__dict__[_HOOKED] = True
        module.register_forward_pre_hook(_no_default_cache_in_training, with_kwargs=True)
    return model


__all__ = ["skip_cache_in_training"]
