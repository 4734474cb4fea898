"""Layers (stateless, for the hub names) and Layouts (stateful modules with a reference forward).

`CrossEntropyLoss` replaces `torch.nn.CrossEntropyLoss` (same `forward(input, target)` and shapes: input (C,),
(N, C) or (N, C, d1, ..., dk) with the classes on dim 1, target (), (N,) or (N, d1, ..., dk) of class indices;
reads the host's `ignore_index`, `reduction`, `label_smoothing`; class weights and class-probability targets
are not supported). It does not overwrite the caller's logits unless the host module sets `inplace = True`.

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


def _classes_last(input, target) -> torch.Tensor:
    """`torch.nn.CrossEntropyLoss`'s shapes -> logits with the classes last: input (C,) / (N, C) as they are,
    (N, C, d1, ..., dk) -> (N, d1, ..., dk, C) (a view). Checks the target against torch's expected shape."""
    if not isinstance(input, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise TypeError("CrossEntropyLoss: input and target must be tensors")
    if target.is_floating_point():
        raise TypeError(f"CrossEntropyLoss: target must hold class indices (an integer tensor); class "
                        f"probabilities ({target.dtype}) are not supported")
    if input.dim() == 0:
        raise ValueError("CrossEntropyLoss: input must be (C,), (N, C) or (N, C, d1, ..., dk), got a scalar")
    expected = (input.shape[0], *input.shape[2:]) if input.dim() > 1 else ()
    if tuple(target.shape) != expected:
        raise ValueError(f"CrossEntropyLoss: target shape {tuple(target.shape)} does not match input "
                         f"{tuple(input.shape)}: expected {expected} (classes on dim 1, as torch.nn.CrossEntropyLoss)")
    return input.movedim(1, -1) if input.dim() > 2 else input


class CrossEntropyLoss(nn.Module):
    """Drop-in for `nn.CrossEntropyLoss` on (N, C) or (..., C) logits with integer targets."""

    has_backward = True
    can_torch_compile = True

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        _check_no_class_weights(self)
        inplace = getattr(self, "inplace", False)
        logits = _classes_last(input, target)
        if inplace and logits is not input:
            logits = logits.contiguous()  # K-dimensional input: the gradient is written into this copy
        return cross_entropy(logits, target, inplace=inplace, **_options(self))


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
        options = _options(self)
        loss = cross_entropy_reference(_classes_last(input, target), target, **options)[0]
        return loss.view(target.shape) if options["reduction"] == "none" else loss


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
