"""Layers (stateless, for the hub names) and Layouts (stateful, replace HF classes by class-name regex).

- `RotaryPosEmb`: the hub function name `rotary_pos_emb` (`apply_rotary_pos_emb` of Qwen3, Qwen3-MoE, Llama,
  Qwen2): `forward(self, q, k, cos, sin, unsqueeze_dim=1)`, full or partial RoPE, q and k in one launch.
- `RopeAttention` (+ `Layout`) for `^LlamaAttention$` / `^Qwen2Attention$`: the attention with RoPE on q and k
  in one launch (the `rotary_pos_emb` kernel), bound per instance. (The hub name `rotary_pos_emb` binds the same
  kernel to the family's module-global `apply_rotary_pos_emb`: every later model of that family in the process
  would run it; the Layout does not.)
- `QKNormRopeAttention` (+ `Layout`) for `^Qwen3Attention$` / `^Qwen3MoeAttention$`, and
  `GatedQKNormRopeAttention` (+ `Layout`) for `^Qwen3_5MoeAttention$`: n-to-1 in effect — `q_norm`, `k_norm`
  and RoPE run as one fused kernel.
- The attention Layouts own the parameters with the HF names (`q_proj`, `k_proj`, `v_proj`, `o_proj`, and
  `q_norm.weight`, `k_norm.weight` where HF has them), so checkpoints load and save unchanged (`conversion_mapping`
  is empty: no re-layout pays here), and their `forward` is the HF reference path.
  Attention itself goes through transformers' `ALL_ATTENTION_FUNCTIONS` (sdpa / flash / eager all work) and
  the KV cache is updated as in HF. A mask that is `_common.causal_marker`'s marker (passed by hubfuse.training)
  reaches the attention function as None: the causal path.
- In eager training with transformers' sdpa, no mask and no KV cache, the Qwen3 / Qwen3-MoE / Llama / Qwen2
  attention runs as one autograd node (`ops._attention_block`, preconditions in `_attention_block_applies`):
  it keeps neither the rotated q / k nor the input norm's output where hubfuse's RMSNorm made it, and rebuilds
  both in its backward. Elsewhere the per-op path below runs.
- In training (no KV cache, no saved-tensor hooks, not under torch.compile) the q/k norm + RoPE attentions free
  the rotated q and k the attention function saved once it returns, and rebuild them bit for bit from the
  projections (which the norm + RoPE backward keeps anyway) when the backward reaches the attention
  (`_common.released`): the memory of one copy of q and k per layer, for one norm + RoPE pass in the backward.
  Likewise the input norm's output the q/k/v projections saved, where hubfuse's RMSNorm made it (rebuilt from
  the norm's saved input) and the decoder layer is one of `SEQUENTIAL_DECODERS`.

transformers is imported lazily (only when an attention module runs): the kernel has no dependency on it.
"""
import functools
from typing import Optional

import torch
from torch import nn

from hubfuse._common.causal_marker import is_causal_marker
from hubfuse._common.device import autocast_dtype
from hubfuse._common.modules import hooked, plain_linear
from hubfuse._common.released import can_release, rebuildable, release_until_backward
from hubfuse.rmsnorm.layers import RMSNormLayout, RMSNormZeroCenteredLayout
from .ops import _cos_sin_need_grad, _qkv_projections, apply_rotary_pos_emb, qk_norm_rope, _qk_norm_rope_rebuild, \
    _attention_block, qk_norm_rope_zero_centered
from .reference import apply_rotary_pos_emb_hf


class RotaryPosEmb(nn.Module):
    """HF `apply_rotary_pos_emb` (hub name `rotary_pos_emb`): full or partial RoPE, fwd + bwd, one launch."""

    has_backward = True
    can_torch_compile = True

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)


# ------------------------------------------------------------------ attention helpers (module level)


class HeadRMSNorm(RMSNormLayout):
    """Qwen3 per-head RMSNorm, same parameter and attribute names as `Qwen3RMSNorm` (`weight`, `variance_epsilon`)."""


class HeadRMSNormZeroCentered(RMSNormZeroCenteredLayout):
    """Qwen3.5 per-head zero-centred RMSNorm, same names as `Qwen3_5MoeRMSNorm` (`weight` init 0, `eps`)."""


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def eager_attention_forward(module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0,
                            **kwargs):
    """transformers' `eager_attention_forward` of the Qwen3 family (the default of `get_interface`)."""
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, attn_weights


def _attention_interface(attn_implementation):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS.get_interface(attn_implementation, eager_attention_forward)


def _init_attention(module: nn.Module, config, layer_idx: int, gated: bool, qk_norm: bool = True) -> None:
    """The HF `__init__` of Qwen3Attention / Qwen3MoeAttention (gated=False), Qwen3_5MoeAttention (gated=True), or
    LlamaAttention / Qwen2Attention (qk_norm=False)."""
    module.config = config
    module.layer_idx = layer_idx
    module.head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    module.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
    module.scaling = module.head_dim**-0.5
    module.attention_dropout = config.attention_dropout
    module.is_causal = True
    # Qwen2's config has no `attention_bias`: its q/k/v projections are biased, o_proj is not
    qkv_bias = getattr(config, "attention_bias", True)
    o_bias = getattr(config, "attention_bias", False)
    q_out = config.num_attention_heads * module.head_dim * (2 if gated else 1)  # gated: query and output gate
    module.q_proj = nn.Linear(config.hidden_size, q_out, bias=qkv_bias)
    module.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * module.head_dim, bias=qkv_bias)
    module.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * module.head_dim, bias=qkv_bias)
    module.o_proj = nn.Linear(config.num_attention_heads * module.head_dim, config.hidden_size, bias=o_bias)
    if gated:
        module.q_norm = HeadRMSNormZeroCentered(module.head_dim, eps=config.rms_norm_eps)
        module.k_norm = HeadRMSNormZeroCentered(module.head_dim, eps=config.rms_norm_eps)
        return
    if qk_norm:
        module.q_norm = HeadRMSNorm(module.head_dim, eps=config.rms_norm_eps)
        module.k_norm = HeadRMSNorm(module.head_dim, eps=config.rms_norm_eps)
    if hasattr(config, "layer_types"):  # Qwen3, Qwen2: per-layer sliding window
        module.layer_type = config.layer_types[layer_idx]
        module.sliding_window = config.sliding_window if module.layer_type == "sliding_attention" else None
    elif qk_norm:  # Qwen3-MoE
        module.layer_type = None
        module.sliding_window = getattr(config, "sliding_window", None)
    # Llama: no sliding window, none passed to the attention function


# model types whose decoder layers feed the input norm's output to the attention alone (nothing reads it after)
SEQUENTIAL_DECODERS = frozenset({"qwen3", "qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text", "llama", "qwen2"})


@functools.lru_cache(maxsize=None)
def _sdpa_attention_forward():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def _attention_block_applies(module, x, position_embeddings, attention_mask, past_key_values, kwargs,
                             qk_norm: bool) -> bool:
    """Whether `ops._attention_block` computes exactly what the per-op path would: transformers' sdpa
    attention, causal without a mask, no cache, no dropout, no option sdpa_attention_forward reads, plain
    `nn.Linear` projections (`_common.modules.plain_linear`) and hook-free q/k norms with weights of x's dtype,
    eager mode. (Submodules and parameters are read from the module's dicts: this runs every layer, every step.)"""
    if (past_key_values is not None or attention_mask is not None or torch.compiler.is_compiling()
            or x.dim() != 3 or (module.training and module.attention_dropout)
            or getattr(module, "sliding_window", None) is not None):
        return False
    if any(kwargs.get(key) is not None for key in ("softcap", "cache", "position_bias", "is_causal")) \
            or kwargs.get("output_attentions"):
        return False
    cos, sin = position_embeddings
    dtype = x.dtype
    modules = module._modules
    projections = [modules.get(name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    if not all(plain_linear(m, dtype) for m in projections) \
            or len({m._parameters.get("bias") is None for m in projections[:3]}) > 1:
        return False
    if qk_norm:
        for norm in (modules.get("q_norm"), modules.get("k_norm")):
            weight = norm._parameters.get("weight") if norm is not None else None
            if weight is None or weight.dtype != dtype or hooked(norm):
                return False
    if cos.dtype != dtype or sin.dtype != dtype:
        return False
    if _cos_sin_need_grad(cos, sin) or autocast_dtype(x) is not None or torch.are_deterministic_algorithms_enabled():
        return False
    if x.device.type == "cuda" and (dtype not in (torch.float16, torch.bfloat16) or not (
            torch.backends.cuda.flash_sdp_enabled() or torch.backends.cuda.cudnn_sdp_enabled())):
        return False  # the node would run SDPA's forward again in its backward (no flash / cuDNN kernel to call)
    return _attention_interface(module.config._attn_implementation) is _sdpa_attention_forward()


def _run_attention_block(module, hidden_states, position_embeddings, qk_norm: bool):
    """The attention in one autograd node (`ops._attention_block`). Where the input norm's output is its input
    (hubfuse's RMSNorm marked it rebuildable, and the decoder layer feeds it to the attention alone), the node
    keeps the norm's input instead of it and rebuilds it in the backward: the output is freed after the forward."""
    cos, sin = position_embeddings
    q_proj, k_proj, v_proj, o_proj = module.q_proj, module.k_proj, module.v_proj, module.o_proj
    x_rebuild = rebuildable(hidden_states)
    if x_rebuild is not None and (module.config.model_type not in SEQUENTIAL_DECODERS or not can_release()):
        x_rebuild = None
    out = _attention_block(
        hidden_states, q_proj.weight, k_proj.weight, v_proj.weight, q_proj.bias, k_proj.bias, v_proj.bias,
        module.q_norm.weight if qk_norm else None, module.k_norm.weight if qk_norm else None, cos, sin,
        o_proj.weight, o_proj.bias, module.q_norm.variance_epsilon if qk_norm else 0.0, module.head_dim,
        module.scaling, x_rebuild)
    return out, None


def _attention_forward(module, hidden_states, position_embeddings, attention_mask, past_key_values, kwargs,
                       gated: bool, fused: bool, qk_norm: bool = True):
    if is_causal_marker(attention_mask):  # hubfuse.training's "causal, no mask" (see _common.causal_marker)
        attention_mask = None
    if fused and not gated and _attention_block_applies(
            module, hidden_states, position_embeddings, attention_mask, past_key_values, kwargs, qk_norm):
        return _run_attention_block(module, hidden_states, position_embeddings, qk_norm)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, module.head_dim)
    # what this attention frees after the attention function and rebuilds when the backward reaches it
    release = fused and past_key_values is None and can_release()
    if fused:  # one op: the backward sums the three input gradients inside its GEMMs
        q, k, v = _qkv_projections(hidden_states, module.q_proj, module.k_proj, module.v_proj)
    else:
        q, k, v = module.q_proj(hidden_states), module.k_proj(hidden_states), module.v_proj(hidden_states)
    if not qk_norm:  # Llama / Qwen2: RoPE on the (B, H, S, D) projections, as HF
        query_states = q.view(hidden_shape).transpose(1, 2)
        key_states = k.view(hidden_shape).transpose(1, 2)
    elif gated:
        q_raw, gate = torch.chunk(q.view(*input_shape, -1, module.head_dim * 2), 2, dim=-1)
        gate = gate.reshape(*input_shape, -1)
    else:
        q_raw = q.view(hidden_shape)
    if qk_norm:
        k_raw = k.view(hidden_shape)
    value_states = v.view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    # the fused q/k norm reads the norms' weights: hooks on a norm module make it call the modules (HF path)
    fused_norms = fused and not (qk_norm and (hooked(module.q_norm) or hooked(module.k_norm)))

    if not qk_norm:
        rope = apply_rotary_pos_emb if fused else apply_rotary_pos_emb_hf  # q and k in one launch
        query_states, key_states = rope(query_states, key_states, cos, sin)
    elif fused_norms:  # q_norm, k_norm, transpose and RoPE in one kernel, q and k in one launch
        if gated:
            query_states, key_states = qk_norm_rope_zero_centered(
                q_raw, k_raw, module.q_norm.weight, module.k_norm.weight, cos, sin, module.q_norm.eps)
        else:
            query_states, key_states = qk_norm_rope(
                q_raw, k_raw, module.q_norm.weight, module.k_norm.weight, cos, sin, module.q_norm.variance_epsilon)
    else:  # HF reference path
        query_states = module.q_norm(q_raw.view(hidden_shape)).transpose(1, 2)
        key_states = module.k_norm(k_raw).transpose(1, 2)
        query_states, key_states = apply_rotary_pos_emb_hf(query_states, key_states, cos, sin)

    if past_key_values is not None:
        key_states, value_states = past_key_values.update(key_states, value_states, module.layer_idx)

    attention_interface = _attention_interface(module.config._attn_implementation)
    if hasattr(module, "sliding_window"):  # Qwen3, Qwen3-MoE, Qwen2 (not Llama, not Qwen3.5)
        kwargs = {"sliding_window": module.sliding_window, **kwargs}
    attn_output, attn_weights = attention_interface(
        module, query_states, key_states, value_states, attention_mask,
        dropout=0.0 if not module.training else module.attention_dropout, scaling=module.scaling, **kwargs,
    )
    if release and attn_weights is None and attn_output.grad_fn is not None:
        _release(module, attn_output, hidden_states, query_states, key_states,
                 (q_raw, k_raw, cos, sin) if fused_norms and qk_norm and not _cos_sin_need_grad(cos, sin) else None,
                 gated)
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    if gated:
        attn_output = attn_output * torch.sigmoid(gate)
    attn_output = module.o_proj(attn_output)
    return attn_output, attn_weights


def _release(module, attn_output, hidden_states, query_states, key_states, qk_inputs, gated: bool) -> None:
    """Free, until the backward reaches `attn_output`, what this attention's backward reads and can rebuild:
    - the input norm's output the q/k/v projections saved (hubfuse's RMSNorm marked it rebuildable from its own
      saved input), where the decoder layer feeds it to the attention alone;
    - the rotated q / k the attention function saved (6 KiB a token at Qwen3-0.6B's widths), rebuilt from the
      projections the norm + RoPE backward keeps (`qk_inputs`: q, k projections, cos, sin), one kernel pass.
    Every reader of them in the backward (the attention's backward, then the projections') comes after the
    gradient of `attn_output`."""
    tensors, rebuilds = [], []
    rebuild_input = rebuildable(hidden_states)
    if rebuild_input is not None and module.config.model_type in SEQUENTIAL_DECODERS:
        tensors.append(hidden_states)
        rebuilds.append(rebuild_input)
    if qk_inputs is not None:
        norm = module.q_norm
        tensors += [query_states, key_states]
        rebuilds.append(functools.partial(_qk_norm_rope_rebuild, *qk_inputs[:2], norm.weight, module.k_norm.weight,
                                          *qk_inputs[2:], norm.eps if gated else norm.variance_epsilon, gated))
    if not tensors:
        return
    if len(rebuilds) == 1:
        release_until_backward([attn_output], tensors, rebuilds[0])
        return

    def rebuild_both(x, q, k):
        rebuilds[0](x)
        rebuilds[1](q, k)

    release_until_backward([attn_output], tensors, rebuild_both)


# ------------------------------------------------------------------ Llama / Qwen2 attention


class RopeAttention(nn.Module):
    """Llama / Qwen2 attention with RoPE on q and k in one kernel launch (for `RopeAttentionLayout`)."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        return _attention_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, kwargs,
                                  gated=False, fused=True, qk_norm=False)


class RopeAttentionLayout(nn.Module):
    """Replaces `^LlamaAttention$` / `^Qwen2Attention$`: same `__init__(config, layer_idx)` and parameters (Llama:
    `config.attention_bias` on every projection; Qwen2: biased q/k/v, unbiased o_proj; Qwen2's sliding window)."""

    conversion_mapping = []  # same parameter names and shapes as the HF class: nothing to re-lay
    accepts_causal_marker = True  # hubfuse.training may pass the causal marker as the mask

    def __init__(self, config, layer_idx: int):
        super().__init__()
        _init_attention(self, config, layer_idx, gated=False, qk_norm=False)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: Optional[torch.Tensor], past_key_values=None, **kwargs):
        return _attention_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, kwargs,
                                  gated=False, fused=False, qk_norm=False)


# ------------------------------------------------------------------ Qwen3 / Qwen3-MoE attention


class QKNormRopeAttention(nn.Module):
    """Qwen3 / Qwen3-MoE attention with q/k RMSNorm + RoPE fused into one kernel (for `QKNormRopeAttentionLayout`)."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        return _attention_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, kwargs,
                                  gated=False, fused=True)


class QKNormRopeAttentionLayout(nn.Module):
    """Replaces `^Qwen3Attention$` / `^Qwen3MoeAttention$`: same `__init__(config, layer_idx)` and parameters."""

    conversion_mapping = []  # same parameter names and shapes as the HF class: nothing to re-lay
    accepts_causal_marker = True  # hubfuse.training may pass the causal marker as the mask
    gated = False

    def __init__(self, config, layer_idx: int):
        super().__init__()
        _init_attention(self, config, layer_idx, gated=self.gated)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: Optional[torch.Tensor], past_key_values=None, **kwargs):
        return _attention_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, kwargs,
                                  gated=self.gated, fused=False)


# ------------------------------------------------------------------ Qwen3.5-MoE gated attention


class GatedQKNormRopeAttention(QKNormRopeAttention):
    """Qwen3.5-MoE gated attention: zero-centred q/k norm + partial RoPE fused, `* sigmoid(gate)` before o_proj."""

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        return _attention_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, kwargs,
                                  gated=True, fused=True)


class GatedQKNormRopeAttentionLayout(QKNormRopeAttentionLayout):
    """Replaces `^Qwen3_5MoeAttention$`: same `__init__(config, layer_idx)` and parameters (q_proj is 2x wide)."""

    gated = True
    forward = QKNormRopeAttentionLayout.forward  # transformers wants a forward in the Layout's own class dict


__all__ = [
    "RotaryPosEmb",
    "RopeAttention", "RopeAttentionLayout",
    "QKNormRopeAttention", "QKNormRopeAttentionLayout",
    "GatedQKNormRopeAttention", "GatedQKNormRopeAttentionLayout",
]
