"""Torch reference paths.

* `cross_entropy_reference` / `linear_cross_entropy_reference`: the plain, materialised formulation
  (HF's `ForCausalLMLoss` math: upcast the logits to fp32, `F.cross_entropy`), differentiable by autograd.
  The Layouts' `forward` and the model hook's fallback use them.
* `ce_rows_reference`: the per-row kernel contract in torch (what `triton_kernels.ce_rows` does): loss per
  row, z-loss per row, and -- optionally -- the gradient of the scaled loss written in place into the logits
  buffer. The custom ops use it on devices without Triton.

Per row i with label y (not ignored), logits x (after the optional soft-cap c: x = c * tanh(raw / c)),
lse = logsumexp(x), smoothing eps, z-loss weight w:
    loss_i = (1 - eps) * (lse - x_y) + eps * (lse - mean_j x_j) + w * lse^2
    d loss_i / d x_j = (1 + 2 w lse) * softmax_j - (1 - eps) * [j == y] - eps / V
    d x_j / d raw_j = 1 - (x_j / c)^2
Ignored rows have loss 0 and gradient 0 (torch's semantics; the mean divides by the number of valid rows).
"""
from typing import Optional

import torch
import torch.nn.functional as F

REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}


def _softcap(x: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    return softcap * torch.tanh(x / softcap) if softcap else x


def cross_entropy_reference(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100, reduction: str = "mean",
    label_smoothing: float = 0.0, z_loss_weight: float = 0.0, softcap: float = 0.0,
    num_items_in_batch=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Materialised reference: returns (loss, z_loss) with the same reductions as the fused ops.

    Computes in fp32 (or the logits' dtype if wider, e.g. float64 in the tests). `num_items_in_batch`
    replaces the mean's denominator (HF gradient accumulation).
    """
    compute_dtype = torch.promote_types(logits.dtype, torch.float32)
    x = _softcap(logits.to(compute_dtype), softcap)
    x = x.reshape(-1, x.shape[-1])
    labels = labels.reshape(-1)
    valid = labels != ignore_index
    elementwise = F.cross_entropy(x, labels, ignore_index=ignore_index, reduction="none",
                                  label_smoothing=label_smoothing)
    lse = torch.logsumexp(x, dim=-1)
    z_rows = torch.where(valid, z_loss_weight * lse * lse, torch.zeros_like(lse))
    loss_rows = elementwise + z_rows
    if reduction == "none":
        return loss_rows, z_rows
    if num_items_in_batch is not None:
        denom = num_items_in_batch
        if torch.is_tensor(denom):
            denom = denom.to(device=x.device, dtype=compute_dtype)
        return loss_rows.sum() / denom, z_rows.sum() / denom
    if reduction == "sum":
        return loss_rows.sum(), z_rows.sum()
    n_valid = valid.sum().to(compute_dtype)
    return loss_rows.sum() / n_valid, z_rows.sum() / n_valid


def linear_cross_entropy_reference(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: Optional[torch.Tensor] = None,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """lm_head projection (in the inputs' dtype, like `nn.Linear`) then `cross_entropy_reference`."""
    logits = F.linear(hidden, weight, bias)
    return cross_entropy_reference(logits, labels, **options)


def ce_rows_reference(
    logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor, ignore_index: int,
    label_smoothing: float, z_loss_weight: float, softcap: float, compute_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of the Triton row kernel. `logits` (rows, V) is overwritten with the gradient of
    `sum_i scale_i * loss_i` when `compute_grad` (`scale` has 1 element or one per row)."""
    V = logits.shape[-1]
    raw = logits.float()
    x = _softcap(raw, softcap)
    valid = labels != ignore_index
    safe_labels = torch.where(valid, labels, torch.zeros_like(labels))
    lse = torch.logsumexp(x, dim=-1)
    x_y = x.gather(1, safe_labels[:, None]).squeeze(1)
    eps = label_smoothing
    z_rows = z_loss_weight * lse * lse
    loss_rows = (1.0 - eps) * (lse - x_y) + z_rows
    if eps > 0:
        loss_rows = loss_rows + eps * (lse - x.mean(dim=-1))
    zero = torch.zeros_like(lse)
    loss_rows = torch.where(valid, loss_rows, zero)
    z_rows = torch.where(valid, z_rows, zero)
    if compute_grad:
        p = torch.exp(x - lse[:, None])
        g = p * (1.0 + 2.0 * z_loss_weight * lse)[:, None] - eps / V
        g.scatter_add_(1, safe_labels[:, None], torch.full_like(x_y[:, None], -(1.0 - eps)))
        if softcap > 0:
            g = g * (1.0 - (x / softcap) ** 2)
        row_scale = scale.float().reshape(-1)
        g = g * (row_scale[:, None] if row_scale.numel() > 1 else row_scale)
        g = torch.where(valid[:, None], g, torch.zeros_like(g))
        logits.copy_(g)
    return loss_rows, z_rows
