"""Layers (stateless, for the hub names) and Layouts (stateful modules with a reference forward).

`CrossEntropyLoss` replaces `torch.nn.CrossEntropyLoss` (same `forward(input, target)`, reads the host's
`ignore_index`, `reduction`, `label_smoothing`; class weights are not supported). It does not overwrite the
caller's logits unless the host module sets `inplace = True`.

`LinearCrossEntropyLoss` is for custom training loops: `forward(hidden, weight, labels, bias=None)` with
the options read from the host module (`LinearCrossEntropyLossLayout` carries them). There is no HF class
for it; the Layout's `__init__` takes the kernel's options.
"""
from typing import Optional

import torch
from torch import nn

from .ops import cross_entropy, linear_cross_entropy
from .reference import cross_entropy_reference, linear_cross_entropy_reference


def _options(module) -> dict:
    return dict(
        ignore_index=getattr(module, "ignore_index", -100),
        reduction=getattr(module, "reduction", "mean"),
        label_smoothing=getattr(module, "label_smoothing", 0.0),
        z_loss_weight=getattr(module, "z_loss_weight", 0.0),
        softcap=getattr(module, "softcap", None),
    )


def _check_no_class_weights(module) -> None:
    if getattr(module, "weight", None) is not None:
        raise ValueError("CrossEntropyLoss: per-class weights are not supported by the fused kernel")


class CrossEntropyLoss(nn.Module):
    """Drop-in for `nn.CrossEntropyLoss` on (N, C) or (..., C) logits with integer targets."""

    has_backward = True
    can_torch_compile = True

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        _check_no_class_weights(self)
        return cross_entropy(input, target, inplace=getattr(self, "inplace", False), **_options(self))


class CrossEntropyLossLayout(nn.Module):
    conversion_mapping = []  # no parameters

    def __init__(self, weight=None, size_average=None, ignore_index: int = -100, reduce=None,
                 reduction: str = "mean", label_smoothing: float = 0.0) -> None:
        super().__init__()
        if size_average is not None or reduce is not None:
            reduction = nn.modules.loss._Reduction.legacy_get_string(size_average, reduce)
        self.register_buffer("weight", weight)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        _check_no_class_weights(self)
        return cross_entropy_reference(input, target, **_options(self))[0]


class LinearCrossEntropyLoss(nn.Module):
    """`loss = CE(hidden @ weight.T + bias, labels)` without the logits; options from the host module."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return linear_cross_entropy(hidden, weight, labels, bias, chunk_size=getattr(self, "chunk_size", None),
                                    **_options(self))


class LinearCrossEntropyLossLayout(nn.Module):
    conversion_mapping = []

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 z_loss_weight: float = 0.0, softcap: Optional[float] = None, chunk_size: Optional[int] = None):
        super().__init__()
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.z_loss_weight = z_loss_weight
        self.softcap = softcap
        self.chunk_size = chunk_size

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        opts = _options(self)
        opts["softcap"] = opts["softcap"] or 0.0
        return linear_cross_entropy_reference(hidden, weight, labels, bias, **opts)[0]


__all__ = ["CrossEntropyLoss", "CrossEntropyLossLayout", "LinearCrossEntropyLoss", "LinearCrossEntropyLossLayout"]
