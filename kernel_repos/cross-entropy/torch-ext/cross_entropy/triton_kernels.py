"""Triton row kernel for cross-entropy: log-sum-exp, loss, z-loss and the gradient written in place.

One program per row of logits (a row is one token, V columns, any V). Pass 1 streams the row once with
an online max / sum-of-exp (plus the row sum for label smoothing); pass 2 streams it
again (mostly from L2) and overwrites it with the gradient, so the logits buffer becomes dlogits and no
fp32 copy of the logits ever exists. All arithmetic is fp32; loads are cast up, the store casts down.
This module imports triton: import it lazily.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _tanh(u):
    # tanh without libdevice (works under TRITON_INTERPRET too); stable for large |u|
    e = tl.exp(-2.0 * tl.abs(u))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(u >= 0, t, -t)


@triton.jit
def _ce_rows_kernel(
    LOGITS, stride_row, LABELS, SCALE, scale_stride, LOSS, ZLOSS, V,
    ignore_index, label_smoothing, z_loss_weight, softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_Z: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = LOGITS + row.to(tl.int64) * stride_row
    label = tl.load(LABELS + row).to(tl.int64)
    cols0 = tl.arange(0, BLOCK_V)
    if label == ignore_index:
        tl.store(LOSS + row, 0.0)
        tl.store(ZLOSS + row, 0.0)
        if COMPUTE_GRAD:
            zeros = tl.zeros([BLOCK_V], dtype=tl.float32)
            for start in range(0, V, BLOCK_V):
                cols = start + cols0
                tl.store(row_ptr + cols, zeros.to(LOGITS.dtype.element_ty), mask=cols < V)
        return

    # pass 1: online log-sum-exp with a running scalar max (one exp per element: the SFU, not the
    # memory, would otherwise bound this pass on H100/H200)
    m = float("-inf")
    s = 0.0
    sum_vec = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + cols0
        mask = cols < V
        x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            x = softcap * _tanh(x / softcap)
        if HAS_SMOOTHING:
            sum_vec += tl.where(mask, x, 0.0)
        x = tl.where(mask, x, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=0))  # finite: every block has at least one valid column
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)

    x_label = tl.load(row_ptr + label).to(tl.float32)
    if HAS_SOFTCAP:
        x_label = softcap * _tanh(x_label / softcap)
    loss = (1.0 - label_smoothing) * (lse - x_label)
    if HAS_SMOOTHING:
        loss += label_smoothing * (lse - tl.sum(sum_vec, axis=0) / V)
    z_row = 0.0
    if HAS_Z:
        z_row = z_loss_weight * lse * lse
        loss += z_row
    tl.store(LOSS + row, loss)
    tl.store(ZLOSS + row, z_row)

    if COMPUTE_GRAD:
        # pass 2: overwrite the row with d(scale * loss)/d(raw logits)
        scale = tl.load(SCALE + row * scale_stride).to(tl.float32)
        p_coef = scale
        if HAS_Z:
            p_coef = scale * (1.0 + 2.0 * z_loss_weight * lse)
        smooth_term = scale * label_smoothing / V
        label_term = scale * (1.0 - label_smoothing)
        for start in range(0, V, BLOCK_V):
            cols = start + cols0
            mask = cols < V
            x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                x = softcap * _tanh(x / softcap)
            g = p_coef * tl.exp(x - lse) - smooth_term
            g = tl.where(cols == label, g - label_term, g)
            if HAS_SOFTCAP:
                t = x / softcap
                g = g * (1.0 - t * t)
            tl.store(row_ptr + cols, g.to(LOGITS.dtype.element_ty), mask=mask)


def _block_v(V: int, device_type: str) -> int:
    if device_type == "cpu":  # interpreter: one block per row is fastest
        return min(triton.next_power_of_2(V), 16384)
    return min(triton.next_power_of_2(V), 4096)


def ce_rows(
    logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor, ignore_index: int,
    label_smoothing: float, z_loss_weight: float, softcap: float, compute_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (rows, V) with unit column stride (overwritten with the gradient when `compute_grad`);
    labels (rows,) int; scale fp32 with 1 element (all rows) or one per row. Returns fp32 (loss, z) rows."""
    rows, V = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    z_rows = torch.empty_like(loss)
    if rows == 0:
        return loss, z_rows
    block_v = _block_v(V, logits.device.type)
    num_warps = 8 if block_v >= 2048 else 4
    _ce_rows_kernel[(rows,)](
        logits, logits.stride(0), labels, scale, 1 if scale.numel() > 1 else 0, loss, z_rows, V,
        ignore_index, float(label_smoothing), float(z_loss_weight), float(softcap) if softcap > 0 else 1.0,
        HAS_SOFTCAP=softcap > 0, HAS_SMOOTHING=label_smoothing > 0, HAS_Z=z_loss_weight != 0,
        COMPUTE_GRAD=compute_grad, BLOCK_V=block_v, num_warps=num_warps,
    )
    return loss, z_rows
