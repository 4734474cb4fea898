"""Training-time defaults of a kernelized model, per instance: `apply_training_defaults(model)`.

In training mode, a forward of a transformers decoder model that leaves these arguments at their defaults gets:

1. **No KV cache** unless `use_cache=True` is passed. transformers reads `use_cache=None` as the config's
   `use_cache` (True for every causal LM), so each training forward builds a `DynamicCache` and every attention
   layer writes its keys and values into it, for nothing: a training step never reads them back. That costs
   memory and time, and under torch.compile the cache's per-layer state is guarded on.
2. **The causal mask SDPA's `is_causal` path takes**, when no `attention_mask` and no `position_ids` are passed
   (the model numbers the tokens itself, so the batch is not packed) and no cache is used: the prepared mask
   mapping `{layer type: None}`, which is what transformers computes itself in eager mode for such a batch. Under
   torch.compile or CUDA-graph capture transformers cannot check the positions for packed sequences (a host
   read) and builds a full (batch, 1, seq, seq) mask instead, which keeps SDPA off its causal flash / cuDNN
   kernels (the backward above all). For model classes that take a prepared mask mapping
   (`MASK_MAPPING_MODELS`): that mapping. For those that build one mask from whatever they are given
   (`CAUSAL_MARKER_MODELS`) and whose every attention module is a hubfuse Layout: the causal marker
   (`hubfuse._common.causal_marker`), which transformers passes through unbuilt and the Layouts read as `is_causal`
   (in eager mode this also saves transformers' host read of the positions). SDPA or flash-attention
   implementations and no sliding-window layers only.

`use_cache=True`, a mask or positions passed explicitly are honoured, and eval / `generate` are unchanged.
"""
from __future__ import annotations

import inspect

import torch

from ._common.causal_marker import causal_marker

_HOOKED = "_hubfuse_training_defaults"
# decoder models whose forward takes a prepared {layer type: mask} mapping as `attention_mask`
MASK_MAPPING_MODELS = ("Qwen3Model", "Qwen2Model", "Qwen3_5MoeTextModel")
# decoder models that build one causal mask from `attention_mask` and pass a 4D one through unchanged
CAUSAL_MARKER_MODELS = ("Qwen3MoeModel", "LlamaModel")
# attention implementations that read a None mask as causal (`is_causal`)
_CAUSAL_WITHOUT_MASK = ("sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4")


def _causal_mask(module, device):
    """What to pass as `attention_mask` for a causal, unpadded, unpacked batch: the {layer type: None} mapping or
    the causal marker, or None where transformers' own mask must stay (other models, eager attention, sliding
    windows, attention modules that do not read the marker)."""
    config = module.config
    if config._attn_implementation not in _CAUSAL_WITHOUT_MASK:
        return None
    name = type(module).__name__
    if name in MASK_MAPPING_MODELS:
        layer_types = getattr(config, "layer_types", None)
        if not layer_types or "sliding_attention" in layer_types:
            return None
        return dict.fromkeys(layer_types)
    if (name in CAUSAL_MARKER_MODELS and getattr(config, "sliding_window", None) is None
            and all(getattr(layer.self_attn, "accepts_causal_marker", False) for layer in module.layers)):
        return causal_marker(device)  # zero elements: no allocation, nothing for a trace to keep
    return None


def _training_defaults(module, args, kwargs):
    if not module.training:
        return None
    kwargs = dict(kwargs)
    if kwargs.get("use_cache") is None:
        kwargs["use_cache"] = False
    if (not kwargs["use_cache"] and not args and kwargs.get("past_key_values") is None
            and kwargs.get("attention_mask") is None and kwargs.get("position_ids") is None):
        inputs = kwargs.get("input_ids")
        if inputs is None:
            inputs = kwargs.get("inputs_embeds")
        mask = None if inputs is None else _causal_mask(module, inputs.device)
        if mask is not None:
            kwargs["attention_mask"] = mask
    return args, kwargs


def apply_training_defaults(model: torch.nn.Module) -> torch.nn.Module:
    """Give `model` the training-mode defaults of this module's docstring (no KV cache, the causal mask mapping).

    Registers a forward pre-hook on every transformers model module of `model` that takes `use_cache` (the
    decoder model, e.g. `model.model`, and the causal LM itself); it acts only while `module.training`, on
    keyword arguments (transformers' decoder models take `use_cache` by keyword only: their
    `merge_with_config_defaults` wrapper does not see a positional one). Per instance (the classes and other
    models are untouched); idempotent. `hubfuse.KernelConfig` calls it on every model it loads. Returns the model.
    """
    from transformers import PreTrainedModel

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"apply_training_defaults: model must be a torch.nn.Module, got {type(model).__name__}")
    for module in model.modules():
        if not isinstance(module, PreTrainedModel) or _HOOKED in module.__dict__:
            continue
        forward = inspect.unwrap(type(module).forward)
        if "use_cache" not in inspect.signature(forward).parameters:
            continue
        module.__dict__[_HOOKED] = True
        module.register_forward_pre_hook(_training_defaults, with_kwargs=True)
    return model


__all__ = ["CAUSAL_MARKER_MODELS", "MASK_MAPPING_MODELS", "apply_training_defaults"]
