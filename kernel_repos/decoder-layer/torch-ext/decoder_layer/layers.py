"""Layers (stateless, for the hub names) and Layouts (stateful, replace HF classes by class-name regex).

`DecoderLayer` / `DecoderLayerLayout` (1-to-1) replace the dense decoder layer of Qwen3 (`^Qwen3DecoderLayer$`),
Llama (`^LlamaDecoderLayer$`) and Qwen2 (`^Qwen2DecoderLayer$`): same `__init__(config, layer_idx)`, same
submodule and parameter names (`self_attn.*`, `mlp.*`, `input_layernorm`, `post_attention_layernorm`), except
that the MLP holds one `gate_up_proj` (`[2I, H]`) for `gate_proj` + `up_proj`, as swiglu's `SwiGLUMLPLayout`;
the `conversion_mapping` concatenates them on load and transformers splits them back on save.

The submodules are the other families' Layouts (`rotary`'s attention, `swiglu`'s MLP, `rmsnorm`'s norm). The
Layer's forward runs, in eager training and inference without a KV cache or a mask (transformers' sdpa, the
conditions of rotary's attention block, hook-free submodules with x's dtype): the whole layer as one autograd
node (`ops._decoder_layer_block`, bit for bit the per-op path below, with one node a layer instead of five).
Elsewhere (a KV cache, a mask, torch.compile, hooks or adapters on a submodule, another attention
implementation): the per-op path, which is what the per-module kernels compute (rmsnorm's `RMSNorm`, rotary's
attention Layers, swiglu's `rms_norm_swiglu_mlp`; a projection that is not a plain `nn.Linear` is called by them),
except that a submodule of the layer with a hook of its own is called and runs its Layout's forward (HF's code).
The Layout's own forward is the HF reference path: its submodules called in HF's order.

Gradient checkpointing: the Layout keeps transformers' `GradientCheckpointingLayer` contract (the
`gradient_checkpointing` flag and `_gradient_checkpointing_func` that `model.gradient_checkpointing_enable()`
sets), without importing transformers; `every_n_layers` does not apply to it (every layer is checkpointed).
"""
import functools
import logging
from typing import Optional

import torch
from torch import nn

from hubfuse._common.causal_marker import is_causal_marker
from hubfuse._common.modules import hooked, only_weight_recorders, plain_linear
from hubfuse.rmsnorm.layers import RMSNorm, RMSNormLayout
from hubfuse.rotary.layers import QKNormRopeAttention, QKNormRopeAttentionLayout, RopeAttention, \
    RopeAttentionLayout, _attention_block_applies
from hubfuse.swiglu.layers import SwiGLUMLP, SwiGLUMLPLayout, _ConversionMapping, _fused_projections, \
    _gate_up_converters
from hubfuse.swiglu.ops import rms_norm_swiglu_mlp
from .ops import _decoder_layer_block

logger = logging.getLogger(__name__)

# config.model_type -> whether its attention has q/k norms, and the HF attention class the submodule stands in for
_MODEL_TYPES = {"qwen3": True, "llama": False, "qwen2": False}
_ATTENTION_CLASSES = {"qwen3": "Qwen3Attention", "llama": "LlamaAttention", "qwen2": "Qwen2Attention"}
# the kernel forwards `kernelize` may have bound to a submodule (the umbrella repo shares these classes)
_LAYER_FORWARDS = frozenset({RMSNorm.forward, QKNormRopeAttention.forward, RopeAttention.forward,
                             SwiGLUMLP.forward})


def _plain(module: nn.Module) -> bool:
    """Whether calling the submodule is what its kernel computes: no hook of its own, and no instance-level forward
    other than a hubfuse kernel's (accelerate's hooks replace `module.forward`)."""
    if hooked(module) and not _skippable_recorders(module):
        return False
    forward = module.__dict__.get("forward")
    return forward is None or getattr(forward, "__func__", None) in _LAYER_FORWARDS


def _skippable_recorders(module: nn.Module) -> bool:
    """The attention's only hooks record its attention weights (transformers' `output_attentions`), and it returns
    none (any implementation but "eager"): calling its kernel without them loses nothing."""
    config = getattr(module, "config", None)
    return (only_weight_recorders(module) and config is not None
            and getattr(config, "_attn_implementation", "eager") != "eager")


def _block_applies(layer, x, position_embeddings, attention_mask, past_key_values, kwargs) -> bool:
    """Whether `ops._decoder_layer_block` computes exactly what the per-op path would: rotary's attention-block
    conditions (sdpa, causal without a mask, no cache, no dropout, eager mode, plain projections ...), hook-free
    submodules, norm and MLP weights of x's dtype."""
    modules = layer._modules
    attn, mlp = modules["self_attn"], modules["mlp"]
    norms = (modules["input_layernorm"], modules["post_attention_layernorm"])
    if position_embeddings is None or not all(_plain(m) for m in (attn, mlp, *norms)):
        return False
    dtype = x.dtype
    if any(n._parameters.get("weight") is None or n.weight.dtype != dtype for n in norms):
        return False
    if not (plain_linear(mlp._modules["gate_up_proj"], dtype) and plain_linear(mlp._modules["down_proj"], dtype)):
        return False
    return _attention_block_applies(attn, x, position_embeddings, attention_mask, past_key_values, kwargs,
                                    layer.qk_norm)


def _run_block(layer, x, position_embeddings):
    attn, mlp = layer.self_attn, layer.mlp
    norm_in, norm_post = layer.input_layernorm, layer.post_attention_layernorm
    q_proj, k_proj, v_proj, o_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
    qk = layer.qk_norm
    cos, sin = position_embeddings
    return _decoder_layer_block(
        x.contiguous(), norm_in.weight, norm_in.variance_epsilon, q_proj.weight, k_proj.weight, v_proj.weight,
        q_proj.bias, k_proj.bias, v_proj.bias, attn.q_norm.weight if qk else None,
        attn.k_norm.weight if qk else None, attn.q_norm.variance_epsilon if qk else 0.0, cos, sin, o_proj.weight,
        o_proj.bias, attn.head_dim, attn.scaling, norm_post.weight, norm_post.variance_epsilon,
        mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, mlp.down_proj.weight, mlp.down_proj.bias)


def _attention_layer_forward(attn, **kwargs):
    """The attention submodule's kernel forward (rotary's Layer for its class)."""
    layer = QKNormRopeAttention if isinstance(attn, QKNormRopeAttentionLayout) else RopeAttention
    return layer.forward(attn, **kwargs)


def _decoder_forward(layer, hidden_states, attention_mask, position_ids, past_key_values, use_cache,
                     position_embeddings, kwargs, fused: bool):
    """HF's decoder layer: `h = x + self_attn(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h))`.
    fused: one node where `_block_applies`, else each submodule's kernel (a submodule that is not `_plain` is
    called); not fused: every submodule called (the Layouts' HF reference forwards)."""
    if fused:
        mask = None if is_causal_marker(attention_mask) else attention_mask
        if _block_applies(layer, hidden_states, position_embeddings, mask, past_key_values, kwargs):
            return _run_block(layer, hidden_states, position_embeddings)
    attn, mlp = layer.self_attn, layer.mlp
    norm_in, norm_post = layer.input_layernorm, layer.post_attention_layernorm
    residual = hidden_states
    if fused and _plain(norm_in):
        hidden_states = RMSNorm.forward(norm_in, hidden_states)
    else:
        hidden_states = norm_in(hidden_states)
    attention = functools.partial(_attention_layer_forward, attn) if fused and _plain(attn) else attn
    hidden_states, _ = attention(hidden_states=hidden_states, attention_mask=attention_mask,
                                 position_ids=position_ids, past_key_values=past_key_values, use_cache=use_cache,
                                 position_embeddings=position_embeddings, **kwargs)
    hidden_states = residual + hidden_states
    residual = hidden_states
    if fused and _plain(norm_post) and _plain(mlp) and _fused_projections(mlp):
        hidden_states = rms_norm_swiglu_mlp(hidden_states, norm_post.weight, norm_post.variance_epsilon,
                                            mlp.gate_up_proj.weight, mlp.down_proj.weight, mlp.gate_up_proj.bias,
                                            mlp.down_proj.bias)
    else:
        hidden_states = (RMSNorm.forward(norm_post, hidden_states) if fused and _plain(norm_post)
                         else norm_post(hidden_states))
        hidden_states = SwiGLUMLP.forward(mlp, hidden_states) if fused and _plain(mlp) else mlp(hidden_states)
    return residual + hidden_states


class DecoderLayer(nn.Module):
    """The dense decoder layer of Qwen3 / Llama / Qwen2, one autograd node in eager training (for
    `DecoderLayerLayout`). Hub name `DecoderLayer`."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, past_key_values=None, use_cache: bool = False,
                position_embeddings: Optional[tuple[torch.Tensor, torch.Tensor]] = None, **kwargs) -> torch.Tensor:
        return _decoder_forward(self, hidden_states, attention_mask, position_ids, past_key_values, use_cache,
                                position_embeddings, kwargs, fused=True)


class DecoderLayerLayout(nn.Module):
    """Replaces `^Qwen3DecoderLayer$`, `^LlamaDecoderLayer$`, `^Qwen2DecoderLayer$`: `__init__(config, layer_idx)`,
    the submodules of the HF class (the MLP's gate and up projections in one `gate_up_proj`)."""

    conversion_mapping = _ConversionMapping(lambda: _gate_up_converters("mlp", "mlp"))
    gradient_checkpointing = False  # transformers' GradientCheckpointingLayer contract (see the module docstring)

    def __init__(self, config, layer_idx: int):
        super().__init__()
        model_type = getattr(config, "model_type", None)
        if model_type not in _MODEL_TYPES:
            raise ValueError(
                f"{type(self).__name__} replaces the dense decoder layers of Qwen3, Llama and Qwen2 (config.model_type "
                f"{', '.join(map(repr, _MODEL_TYPES))}), got model_type {model_type!r}. For other models map the "
                "per-module kernels (attention, MLP, norms) instead.")
        self.hidden_size = config.hidden_size
        self.qk_norm = _MODEL_TYPES[model_type]
        attention = QKNormRopeAttentionLayout if self.qk_norm else RopeAttentionLayout
        self.self_attn = attention(config, layer_idx)
        # transformers records `output_attentions` from its attention class: hubfuse.KernelConfig hooks this one
        self.self_attn.recorded_as = _ATTENTION_CLASSES[model_type]
        self.mlp = SwiGLUMLPLayout(config)
        self.input_layernorm = RMSNormLayout(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNormLayout(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, *args, **kwargs):
        if self.gradient_checkpointing and self.training:
            # as transformers' GradientCheckpointingLayer: the recomputation must not write the cache again
            dropped = [k for k in ("use_cache", "past_key_values") if kwargs.get(k) not in (None, False)]
            if dropped:
                kwargs.update({"use_cache": False, "past_key_values": None})
                _warn_once(f"Caching is incompatible with gradient checkpointing in {type(self).__name__}. "
                           f"Setting {', '.join(f'`{k}`' for k in dropped)} off.")
            return self._gradient_checkpointing_func(functools.partial(super().__call__, **kwargs), *args)
        return super().__call__(*args, **kwargs)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, past_key_values=None, use_cache: bool = False,
                position_embeddings: Optional[tuple[torch.Tensor, torch.Tensor]] = None, **kwargs) -> torch.Tensor:
        return _decoder_forward(self, hidden_states, attention_mask, position_ids, past_key_values, use_cache,
                                position_embeddings, kwargs, fused=False)


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    logger.warning(message)


__all__ = ["DecoderLayer", "DecoderLayerLayout"]
