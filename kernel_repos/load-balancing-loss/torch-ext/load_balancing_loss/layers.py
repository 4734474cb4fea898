"""Layers (stateless, bound to the HF router they replace) and Layouts (replace an HF class by regex).

`SoftmaxTopKRouter` is the hub name transformers declares on `Qwen3_5MoeTopKRouter` (softmax, top-k, always
renormalised). `TopKRouter` + `TopKRouterLayout` replace `Qwen3MoeTopKRouter` (renormalised only when
`config.norm_topk_prob`), which carries no hub decorator. Both return exactly HF's
`(router_logits, router_scores, router_indices)`, so `output_router_logits` recording and the aux loss keep
working. The router GEMM stays a cuBLAS `F.linear`; softmax + top-k + renormalisation + cast are one kernel.
"""
import torch
from torch import nn

from hubfuse._common.missing_init import init_missing
from .ops import topk_router
from .reference import topk_router_hf


class SoftmaxTopKRouter(nn.Module):
    """Qwen3.5-MoE `Qwen3_5MoeTopKRouter` (`weight` (E, H), `top_k`). Hub name `SoftmaxTopKRouter`."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor):
        if hasattr(self, "e_score_correction_bias"):
            # another model (Laguna) declares this hub name for a sigmoid router with a selection bias
            raise NotImplementedError(
                f"SoftmaxTopKRouter: {type(self).__name__} is a sigmoid/bias router, not softmax-top-k; "
                "do not map this kernel onto it")
        return topk_router(hidden_states, self.weight, self.top_k, True)


class TopKRouter(nn.Module):
    """Qwen3-MoE `Qwen3MoeTopKRouter` (`weight`, `top_k`, `norm_topk_prob`). Use with `TopKRouterLayout`
    under the key `"^Qwen3MoeTopKRouter$"`."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor):
        return topk_router(hidden_states, self.weight, self.top_k, bool(self.norm_topk_prob))


class TopKRouterLayout(nn.Module):
    conversion_mapping = []  # same parameter (`weight`) as the HF class: nothing to re-lay

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.norm_topk_prob = config.norm_topk_prob
        self.hidden_dim = config.hidden_size
        self.weight = nn.Parameter(torch.zeros(self.num_experts, self.hidden_dim))

    def init_missing_parameters(self, std: float) -> None:
        """HF's initialisation of the router (normal, `initializer_range`) if the weight was not loaded."""
        init_missing(self, {"weight": lambda p: p.normal_(0.0, std)})

    def forward(self, hidden_states: torch.Tensor):
        return topk_router_hf(hidden_states, self.weight, self.top_k, bool(self.norm_topk_prob))

    def extra_repr(self):
        return f"experts={self.num_experts}, hidden={self.hidden_dim}, top_k={self.top_k}, norm={self.norm_topk_prob}"


__all__ = ["SoftmaxTopKRouter", "TopKRouter", "TopKRouterLayout"]
