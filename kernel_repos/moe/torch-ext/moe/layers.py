"""Layers (stateless, for the hub names), Layouts (stateful, replace HF classes by class-name regex), and the
`experts_implementation` entry point.

Two ways into transformers, both supported:
- `register_experts_implementation()` adds this kernel to `ALL_EXPERTS_FUNCTIONS`; then
  `from_pretrained(..., experts_implementation="hubfuse_moe")` or `model.set_experts_implementation(...)`.
- `KernelConfig({"^Qwen3MoeExperts$": "hubfuse/moe:GroupedGemmExperts", ...})`: the Layout replaces the HF
  experts class (same `__init__(config)` and parameter names, so checkpoints load and save unchanged) and
  `kernelize` binds `GroupedGemmExperts.forward` to it. The router stays HF's, so `output_router_logits` and
  the aux loss keep working.

Both run expert-parallel when the experts are sharded over an EP mesh (`expert_parallel.shard_experts`, or
transformers' `distributed_config` EP plan): see expert_parallel.py.
"""
import functools

import torch
import torch.nn.functional as F
from torch import nn

from hubfuse._common.missing_init import init_missing
from . import expert_parallel
from .expert_parallel import EXPERT_PARAMS, is_expert_parallel
from .ops import moe_experts
from .reference import experts_hf

EXPERTS_IMPLEMENTATION_NAME = "hubfuse_moe"


def _is_silu(act_fn) -> bool:
    return act_fn is F.silu or isinstance(act_fn, nn.SiLU) or type(act_fn).__name__ == "SiLUActivation"


def _fused(module) -> bool:
    # the fused epilogue is SwiGLU only; any other activation takes the HF reference path
    return _is_silu(getattr(module, "act_fn", F.silu))


def _local_experts(module, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj):
    if not _fused(module):
        return experts_hf(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, module.act_fn)
    return moe_experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj)


def _experts_forward(module, hidden_states, top_k_index, top_k_weights):
    if is_expert_parallel(module):  # experts sharded over an EP mesh: all-to-all around the local experts
        return expert_parallel.experts_forward(module, hidden_states, top_k_index, top_k_weights,
                                               functools.partial(_local_experts, module), fused=_fused(module))
    return _local_experts(module, hidden_states, top_k_index, top_k_weights, module.gate_up_proj, module.down_proj)


class GroupedGemmExperts(nn.Module):
    """Qwen3-MoE / Qwen3.5-MoE routed experts (`gate_up_proj` (E, 2I, H), `down_proj` (E, H, I), SwiGLU).
    Hub name `GroupedGemmExperts`; map it onto `"^Qwen3MoeExperts$"` / `"^Qwen3_5MoeExperts$"`."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return _experts_forward(self, hidden_states, top_k_index, top_k_weights)


class GroupedGemmExpertsLayout(nn.Module):
    """Same `__init__` and parameters as `Qwen3MoeExperts` / `Qwen3_5MoeExperts`; `forward` is HF's eager loop
    (expert-parallel around it when the experts are sharded)."""

    conversion_mapping = []  # the kernel reads the HF v5 layout directly: no re-layout, checkpoints unchanged

    def __init__(self, config):
        super().__init__()
        from transformers.activations import ACT2FN

        self.num_experts = config.num_experts
        self.hidden_dim = config.hidden_size
        self.intermediate_dim = config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))
        self.act_fn = ACT2FN[config.hidden_act]

    def init_missing_parameters(self, std: float) -> None:
        """HF's initialisation of the experts (normal, `initializer_range`) for parameters not loaded."""
        init_missing(self, dict.fromkeys(EXPERT_PARAMS, lambda p: p.normal_(0.0, std)))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if is_expert_parallel(self):
            return expert_parallel.experts_forward(
                self, hidden_states, top_k_index, top_k_weights,
                lambda h, i, w, gate_up, down: experts_hf(h, i, w, gate_up, down, self.act_fn))
        return experts_hf(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                          self.act_fn)

    def extra_repr(self):
        return f"experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}"


def hubfuse_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """`ALL_EXPERTS_FUNCTIONS` signature: `(experts_module, hidden_states, top_k_index, top_k_weights)`."""
    if (not getattr(self, "has_gate", True) or getattr(self, "has_bias", False)
            or getattr(self, "is_transposed", False) or not getattr(self, "is_concatenated", True)
            or getattr(self, "has_post_expert_norm", False)):
        raise ValueError(
            f"{EXPERTS_IMPLEMENTATION_NAME}: {type(self).__name__} is not supported: the kernel needs concatenated "
            "gate/up weights (E, 2I, H), no bias, no post-expert norm, not transposed")
    apply_gate = getattr(type(self), "_apply_gate", None)
    if apply_gate is not None and getattr(apply_gate, "__name__", "") != "_default_apply_gate":
        raise ValueError(f"{EXPERTS_IMPLEMENTATION_NAME}: {type(self).__name__} has a custom gate; only "
                         "act(gate) * up is supported")
    return _experts_forward(self, hidden_states, top_k_index, top_k_weights)


def register_experts_implementation(name: str = EXPERTS_IMPLEMENTATION_NAME) -> str:
    """Register the kernel in transformers' `ALL_EXPERTS_FUNCTIONS` under `name` and return `name`."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(name, hubfuse_experts_forward)
    return name


__all__ = ["GroupedGemmExperts", "GroupedGemmExpertsLayout", "register_experts_implementation",
           "hubfuse_experts_forward", "EXPERTS_IMPLEMENTATION_NAME"]
