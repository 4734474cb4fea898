"""Layers (stateless, for the hub names) and Layouts (stateful, replace HF classes by class-name regex).

- `GatedDeltaNet` (+ `GatedDeltaNetLayout`) for `^Qwen3_5MoeGatedDeltaNet$` (hub name `Qwen3_5GatedDeltaNet`;
  Qwen3.5's dense `Qwen3_5GatedDeltaNet` has the same code): training runs the input projections, then ONE op
  for conv1d + SiLU + q/k/v split + q/k l2norm + beta = sigmoid(b) + g from A_log / dt_bias + the chunked delta
  rule (forward 5 launches: conv, solve, w/u, recurrence, output; backward 8: conv again, w/u, recurrence,
  reverse recurrence, gradients, key-head sums, conv dy, conv dx), then the gated RMSNorm (one launch
  each way) and the output projection. Generation (transformers' cache) runs the same kernels with the cache's
  conv and recurrent states, in transformers' order of updates. The Layout keeps the HF parameters
  (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, `conv1d`, `dt_bias`, `A_log`, `norm.weight`,
  `out_proj`): checkpoints load and save unchanged (`conversion_mapping = []`), and its `forward` is the HF
  torch path.
- Function hub names (transformers' `use_kernel_func_from_hub_with_fallback` hooks of the GatedDeltaNet module):
  `ChunkGatedDeltaRule` (`chunk_gated_delta_rule`), `FusedRecurrentGatedDeltaRule`
  (`fused_recurrent_gated_delta_rule`, the decode step: the same chunked kernels), `CausalConv1dFn`
  (`causal_conv1d_fn`), `CausalConv1dUpdate` (`causal_conv1d_update`). They bind process-wide (kernelize
  patches the module-global function objects of the modeling file).

transformers is not imported here: the kernel has no dependency on it.
"""
import torch
from torch import nn

from hubfuse._common.missing_init import init_missing
from hubfuse._common.modules import hooked
from hubfuse.rmsnorm.layers import RMSNormGatedLayout
from hubfuse.rmsnorm.ops import rms_norm_gated
from .ops import (causal_conv1d, causal_conv1d_update, chunk_gated_delta_rule, gated_delta_net_core,
                  gated_delta_rule_qwen3_5)
from .reference import (causal_conv1d_fn_hf, causal_conv1d_update_hf, chunk_gated_delta_rule_hf, gdn_gate_hf,
                        recurrent_gated_delta_rule_hf)


# ------------------------------------------------------------------ function hub names


def _chunk_rule_hook(query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                     kwargs):
    """The gated delta rule hooks' common body (transformers' extra kwargs: only `cu_seqlens` is used)."""
    return chunk_gated_delta_rule(query, key, value, g, beta, initial_state=initial_state,
                                  output_final_state=output_final_state,
                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                  cu_seqlens=kwargs.get("cu_seqlens"))


class ChunkGatedDeltaRule(nn.Module):
    """transformers' `chunk_gated_delta_rule` hook (q, k already repeated to the value heads by the caller)."""

    has_backward = True
    can_torch_compile = True

    def forward(self, query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **kwargs):
        return _chunk_rule_hook(query, key, value, g, beta, initial_state, output_final_state,
                                use_qk_l2norm_in_kernel, kwargs)


class FusedRecurrentGatedDeltaRule(ChunkGatedDeltaRule):
    """transformers' `fused_recurrent_gated_delta_rule` hook (decode): the same math, through the chunked kernels."""

    def forward(self, query, key, value, g, beta, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **kwargs):
        return _chunk_rule_hook(query, key, value, g, beta, initial_state, output_final_state,
                                use_qk_l2norm_in_kernel, kwargs)


class CausalConv1dFn(nn.Module):
    """transformers' `causal_conv1d_fn` hook: (B, C, S) in and out, conv + optional SiLU, fwd + bwd."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states, weight, bias=None, activation=None, **kwargs):
        out = causal_conv1d(hidden_states.transpose(1, 2), weight, bias, activation, kwargs.get("cu_seqlens"))
        return out.transpose(1, 2)


class CausalConv1dUpdate(nn.Module):
    """transformers' `causal_conv1d_update` hook: new tokens (B, C, L), conv_state updated in place."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states, conv_state, weight, bias=None, activation=None):
        return causal_conv1d_update(hidden_states, conv_state, weight, bias, activation)


# ------------------------------------------------------------------ Qwen3.5 GatedDeltaNet


def _init_gated_delta_net(module: nn.Module, config, layer_idx: int) -> None:
    """`Qwen3_5MoeGatedDeltaNet.__init__` (transformers 5.22.2): same attributes, parameters and init."""
    module.hidden_size = config.hidden_size
    module.num_v_heads = config.linear_num_value_heads
    module.num_k_heads = config.linear_num_key_heads
    module.head_k_dim = config.linear_key_head_dim
    module.head_v_dim = config.linear_value_head_dim
    module.key_dim = module.head_k_dim * module.num_k_heads
    module.value_dim = module.head_v_dim * module.num_v_heads
    module.conv_kernel_size = config.linear_conv_kernel_dim
    module.layer_idx = layer_idx
    module.activation = config.hidden_act
    module.layer_norm_epsilon = config.rms_norm_eps
    module.conv_dim = module.key_dim * 2 + module.value_dim
    module.conv1d = nn.Conv1d(in_channels=module.conv_dim, out_channels=module.conv_dim, bias=False,
                              kernel_size=module.conv_kernel_size, groups=module.conv_dim,
                              padding=module.conv_kernel_size - 1)
    module.dt_bias = nn.Parameter(torch.ones(module.num_v_heads))
    module.A_log = nn.Parameter(torch.log(torch.empty(module.num_v_heads).uniform_(0.01, 16)))
    module.norm = RMSNormGatedLayout(module.head_v_dim, eps=module.layer_norm_epsilon)
    module.out_proj = nn.Linear(module.value_dim, module.hidden_size, bias=False)
    module.layer_type = config.layer_types[layer_idx]
    module.in_proj_qkv = nn.Linear(module.hidden_size, module.key_dim * 2 + module.value_dim, bias=False)
    module.in_proj_z = nn.Linear(module.hidden_size, module.value_dim, bias=False)
    module.in_proj_b = nn.Linear(module.hidden_size, module.num_v_heads, bias=False)
    module.in_proj_a = nn.Linear(module.hidden_size, module.num_v_heads, bias=False)


def _mask_padding(hidden_states, attention_mask):
    """transformers' `apply_mask_to_padding_states` (2-D padding mask of the linear-attention layers)."""
    if attention_mask is not None:
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    return hidden_states


def _conv_through_cache(module, mixed_qkv, conv_state, cache_params, seq_len, fused):
    """The conv of the cached paths, in transformers' order: one-token decode updates the conv state in place;
    otherwise the cache concatenates its state with the new inputs and the conv runs over all of it.
    mixed_qkv, result: (B, S, C)."""
    weight = module.conv1d.weight.squeeze(1)
    if conv_state is not None and seq_len == 1 and not cache_params.is_recording_past(module.layer_idx):
        update = causal_conv1d_update if fused else causal_conv1d_update_hf
        return update(mixed_qkv.transpose(1, 2), conv_state, weight, module.conv1d.bias,
                      module.activation).transpose(1, 2)
    full = cache_params.update_conv_state(mixed_qkv.transpose(1, 2), module.layer_idx,
                                          conv_kernel_size=module.conv_kernel_size)
    if fused:
        out = causal_conv1d(full.transpose(1, 2), weight, module.conv1d.bias, module.activation)
    else:
        out = causal_conv1d_fn_hf(full, weight, module.conv1d.bias, activation=module.activation).transpose(1, 2)
    return out[:, -seq_len:]


def _gated_delta_net_forward(module, hidden_states, cache_params, attention_mask, kwargs, fused: bool):
    hidden_states = _mask_padding(hidden_states, attention_mask)
    batch_size, seq_len, _ = hidden_states.shape
    conv_state = recurrent_state = None
    if cache_params is not None:
        conv_state = cache_params.get_conv_state(module.layer_idx, state_idx=0)
        recurrent_state = cache_params.get_recurrent_state(module.layer_idx, state_idx=0)
    mixed_qkv = module.in_proj_qkv(hidden_states)
    z = module.in_proj_z(hidden_states)
    b = module.in_proj_b(hidden_states)
    a = module.in_proj_a(hidden_states)
    cu_seqlens = kwargs.pop("cu_seq_lens_q", None)
    H, K, V = module.num_k_heads, module.head_k_dim, module.head_v_dim

    if fused and cache_params is None and module.activation in ("silu", "swish"):
        # training / no cache: conv, split, l2norm, gates and the rule in one op
        core = gated_delta_net_core(mixed_qkv, module.conv1d.weight.squeeze(1), module.conv1d.bias, a, b,
                                    module.A_log, module.dt_bias, H, K, V, cu_seqlens)
    else:
        if cache_params is not None:
            mixed_qkv = _conv_through_cache(module, mixed_qkv, conv_state, cache_params, seq_len, fused)
        elif fused:
            mixed_qkv = causal_conv1d(mixed_qkv, module.conv1d.weight.squeeze(1), module.conv1d.bias,
                                      module.activation, cu_seqlens)
        else:
            mixed_qkv = causal_conv1d_fn_hf(mixed_qkv.transpose(1, 2), module.conv1d.weight.squeeze(1),
                                            module.conv1d.bias, activation=module.activation).transpose(1, 2)
        query, key, value = torch.split(mixed_qkv, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
        query = query.reshape(batch_size, seq_len, -1, K)
        key = key.reshape(batch_size, seq_len, -1, K)
        value = value.reshape(batch_size, seq_len, -1, V)
        output_final_state = cache_params is not None
        if fused:
            core, last_state = gated_delta_rule_qwen3_5(query, key, value, a, b, module.A_log, module.dt_bias,
                                                        initial_state=recurrent_state,
                                                        output_final_state=output_final_state, cu_seqlens=cu_seqlens)
        else:
            g, beta = gdn_gate_hf(a, b, module.A_log, module.dt_bias)
            n_rep = module.num_v_heads // module.num_k_heads
            if n_rep > 1:
                query, key = query.repeat_interleave(n_rep, dim=2), key.repeat_interleave(n_rep, dim=2)
            rule = recurrent_gated_delta_rule_hf if recurrent_state is not None and seq_len == 1 \
                else chunk_gated_delta_rule_hf
            core, last_state = rule(query, key, value, g=g, beta=beta, initial_state=recurrent_state,
                                    output_final_state=output_final_state, use_qk_l2norm_in_kernel=True)
        if cache_params is not None:
            cache_params.update_recurrent_state(last_state, module.layer_idx)

    core = core.reshape(-1, V)
    z = z.reshape(-1, V)
    if fused and not hooked(module.norm):  # the fused norm reads its weight: a hooked norm is called
        core = rms_norm_gated(core, z, module.norm.weight, module.norm.variance_epsilon)
    else:
        core = module.norm(core, z)
    return module.out_proj(core.reshape(batch_size, seq_len, -1))


class GatedDeltaNet(nn.Module):
    """Qwen3.5 / Qwen3.5-MoE GatedDeltaNet (linear attention) with the fused kernels (for `GatedDeltaNetLayout`)."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        return _gated_delta_net_forward(self, hidden_states, cache_params, attention_mask, kwargs, fused=True)


class GatedDeltaNetLayout(nn.Module):
    """Replaces `^Qwen3_5MoeGatedDeltaNet$` (or `^Qwen3_5GatedDeltaNet$`): same `__init__(config, layer_idx)`,
    parameters and attributes; `forward` is the HF torch path."""

    conversion_mapping = []  # same parameter names and shapes as the HF class: nothing to re-lay

    def __init__(self, config, layer_idx: int):
        super().__init__()
        _init_gated_delta_net(self, config, layer_idx)

    def init_missing_parameters(self, std: float) -> None:
        """Qwen3.5's `_init_weights` for the gate parameters not loaded: dt_bias ones, A_log = log U(0.01, 16)."""
        init_missing(self, {"dt_bias": torch.nn.init.ones_, "A_log": lambda p: p.copy_(
            torch.empty(p.shape, device=p.device).uniform_(0.01, 16).log_())})

    def forward(self, hidden_states: torch.Tensor, cache_params=None, attention_mask=None, **kwargs):
        return _gated_delta_net_forward(self, hidden_states, cache_params, attention_mask, kwargs, fused=False)


__all__ = [
    "ChunkGatedDeltaRule", "FusedRecurrentGatedDeltaRule", "CausalConv1dFn", "CausalConv1dUpdate",
    "GatedDeltaNet", "GatedDeltaNetLayout",
]
