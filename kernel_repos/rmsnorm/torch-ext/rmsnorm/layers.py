"""Layers (stateless, for the hub names) and Layouts (stateful, replace HF classes by class-name regex).

A Layer has no `__init__` and no state of its own: `kernelize` binds its `forward` to the HF module it
replaces, so it reads that module's `weight` and epsilon. A `<Name>Layout` owns the parameters: same
`__init__` signature and parameter names as the HF class (checkpoints load and save unchanged) and a real
`forward`, the HF reference path, used wherever the kernel is not bound.
"""
import torch
from torch import nn

from hubfuse._common.missing_init import init_missing
from .ops import _module_forward, rms_norm_gated
from .reference import STANDARD, ZERO_CENTERED, rms_norm_gated_hf, rms_norm_hf, rms_norm_zero_centered_hf


class RMSNorm(nn.Module):
    """Llama / Qwen2 / Qwen3 / Qwen3-MoE RMSNorm (`weight`, `variance_epsilon`). Hub name `RMSNorm`."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _module_forward(self, hidden_states, self.weight, self.variance_epsilon, STANDARD)


class RMSNormLayout(nn.Module):
    conversion_mapping = []  # same parameters as the HF class: nothing to re-lay

    def __init__(self, hidden_size, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm_hf(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class RMSNormZeroCentered(nn.Module):
    """Qwen3.5 / Qwen3-Next zero-centred RMSNorm, `(1 + weight)` (`weight`, `eps`). Hub name `RMSNormZeroCentered`."""

    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _module_forward(self, x, self.weight, self.eps, ZERO_CENTERED)


class RMSNormZeroCenteredLayout(nn.Module):
    conversion_mapping = []

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def init_missing_parameters(self, std: float) -> None:
        """Zeros, as Qwen3.5's `_init_weights` (transformers' generic "*RMSNorm*" rule would give ones)."""
        init_missing(self, {"weight": torch.nn.init.zeros_})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_zero_centered_hf(x, self.weight, self.eps)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class RMSNormGated(nn.Module):
    """Qwen3.5 / Qwen3-Next RMSNormGated, `forward(hidden_states, gate)`. Hub name `RMSNormGated`."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return rms_norm_gated(hidden_states, gate, self.weight, self.variance_epsilon)


class RMSNormGatedLayout(nn.Module):
    conversion_mapping = []

    def __init__(self, hidden_size: int, eps: float = 1e-6, **kwargs) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        self.activation = "silu"

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return rms_norm_gated_hf(hidden_states, gate, self.weight, self.variance_epsilon)


__all__ = [
    "RMSNorm", "RMSNormLayout",
    "RMSNormZeroCentered", "RMSNormZeroCenteredLayout",
    "RMSNormGated", "RMSNormGatedLayout",
]
