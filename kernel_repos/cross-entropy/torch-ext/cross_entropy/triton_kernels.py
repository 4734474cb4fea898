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

from hubfuse._common.device import sm_count
from hubfuse._common.launch import cdiv, next_power_of_2, launch


@triton.jit
def _tanh(u):
    # tanh without libdevice (works under TRITON_INTERPRET too); stable for large |u|
    e = tl.exp(-2.0 * tl.abs(u))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(u >= 0, t, -t)


@triton.jit
def _load_logits(row_ptr, cols, V, softcap, sum_vec, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr):
    # one block of a row's logits in fp32 (soft-capped), -inf past V; their sum added to sum_vec (label smoothing)
    mask = cols < V
    x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        x = softcap * _tanh(x / softcap)
    if HAS_SMOOTHING:
        sum_vec += tl.where(mask, x, 0.0)
    return tl.where(mask, x, float("-inf")), sum_vec


@triton.jit
def _ce_rows_kernel(
    LOGITS, stride_row, LABELS, SCALE, scale_stride, LOSS, ZLOSS, V,
    ignore_index, label_smoothing, z_loss_weight, softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_Z: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr, VECTOR_LSE: tl.constexpr,
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

    if VECTOR_LSE:
        # pass 1, per-lane online log-sum-exp: every lane keeps its own running max / sum and the lanes are
        # combined once per row, so no cross-warp reduction (max + sum, each a barrier) per block. Still one
        # exp per element: with d = min(x, m) - max(x, m) <= 0, a new max rescales the old sum by e^d and
        # adds 1, an old max adds e^d.
        m_vec = tl.full([BLOCK_V], float("-inf"), dtype=tl.float32)
        s_vec = tl.zeros([BLOCK_V], dtype=tl.float32)
        sum_vec = tl.zeros([BLOCK_V], dtype=tl.float32)
        for start in range(0, V, BLOCK_V):
            x, sum_vec = _load_logits(row_ptr, start + cols0, V, softcap, sum_vec, HAS_SOFTCAP, HAS_SMOOTHING)
            m_new = tl.maximum(m_vec, x)
            # lanes where both are -inf (masked tail, or -inf logits so far) add nothing
            e = tl.where(m_new == float("-inf"), 0.0, tl.exp(tl.minimum(x, m_vec) - m_new))
            s_vec = tl.where(x > m_vec, s_vec * e + 1.0, s_vec + e)
            m_vec = m_new
        m = tl.max(m_vec, axis=0)
        s = tl.sum(tl.where(m_vec == float("-inf"), 0.0, s_vec * tl.exp(m_vec - m)), axis=0)
    else:
        # pass 1: online log-sum-exp with a running scalar max (one exp per element: the SFU, not the
        # memory, would otherwise bound this pass on H100/H200); two block reductions per block
        m = float("-inf")
        s = 0.0
        sum_vec = tl.zeros([BLOCK_V], dtype=tl.float32)
        for start in range(0, V, BLOCK_V):
            x, sum_vec = _load_logits(row_ptr, start + cols0, V, softcap, sum_vec, HAS_SOFTCAP, HAS_SMOOTHING)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: add nothing, not nan
            s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(x - m_ref), axis=0)
            m = m_new
    lse = m + tl.log(s)

    # the host checks the label range (ValueError, or a device-side assert when checked asynchronously);
    # the masked load keeps a bad label from ever reading outside the row
    x_label = tl.load(row_ptr + label, mask=(label >= 0) & (label < V), other=0.0).to(tl.float32)
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


# Launch configuration of the row kernel on GPUs. `block_v`/`num_warps` 0 = automatic: 32768-wide blocks
# with 32 warps for the scalar kernel (few blocks per row, so few block reductions; Liger's choice on
# Hopper), 8192 with 16 warps for the per-lane kernel (its running max/sum take 2 registers per element
# of the block). ops.TUNING feeds these so a benchmark can compare the alternatives.
# H200, CE from logits 16384 x 151936 bf16 fwd+bwd: scalar LSE 4096 x 8 warps 3.87 ms, 32768 x 32 warps 4.63,
# vector LSE 4096 x 8 3.97, 8192 x 16 4.02 (Liger 4.44); linear CE: 4096 x 8 also the fastest row kernel.
GPU_MAX_BLOCK = {False: 4096, True: 8192}
GPU_WARPS = {False: 8, True: 16}


def _block_v(V: int, device_type: str, vector_lse: bool = False, block_v: int = 0) -> int:
    if block_v:
        return min(next_power_of_2(V), next_power_of_2(block_v))
    if device_type == "cpu":  # interpreter: one block per row is fastest
        return min(next_power_of_2(V), 16384)
    return min(next_power_of_2(V), GPU_MAX_BLOCK[vector_lse])


def _num_warps(block_v: int, device_type: str, vector_lse: bool, num_warps: int) -> int:
    if num_warps:
        return num_warps
    if device_type == "cpu":
        return 4
    return max(4, min(GPU_WARPS[vector_lse], block_v // 256))

def ce_rows(
    logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor, ignore_index: int,
    label_smoothing: float, z_loss_weight: float, softcap: float, compute_grad: bool,
    vector_lse: bool = False, block_v: int = 0, num_warps: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (rows, V) with unit column stride (overwritten with the gradient when `compute_grad`);
    labels (rows,) int; scale fp32 with 1 element (all rows) or one per row. Returns fp32 (loss, z) rows.
    `vector_lse`, `block_v`, `num_warps`: kernel variant and launch shape (0 = automatic)."""
    rows, V = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    z_rows = torch.empty_like(loss)
    if rows == 0:
        return loss, z_rows
    block_v = _block_v(V, logits.device.type, vector_lse, block_v)
    num_warps = _num_warps(block_v, logits.device.type, vector_lse, num_warps)
    launch(_ce_rows_kernel, (rows,),
        logits, logits.stride(0), labels, scale, 1 if scale.numel() > 1 else 0, loss, z_rows, V,
        ignore_index, float(label_smoothing), float(z_loss_weight), float(softcap) if softcap > 0 else 1.0,
        HAS_SOFTCAP=softcap > 0, HAS_SMOOTHING=label_smoothing > 0, HAS_Z=z_loss_weight != 0,
        COMPUTE_GRAD=compute_grad, BLOCK_V=block_v, VECTOR_LSE=bool(vector_lse), num_warps=num_warps,
    )
    return loss, z_rows

@triton.jit
def _scale_unless_one_kernel(X, G, n, BLOCK: tl.constexpr):
    # X *= G[0] in place, in fp32; every program returns at once when G[0] == 1 (the usual upstream gradient
    # of a scalar loss), so the skip costs one tiny launch and no host sync
    g = tl.load(G).to(tl.float32)
    if g != 1.0:
        pid = tl.program_id(0)
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        for _ in range(0, tl.cdiv(n - pid.to(tl.int64) * BLOCK, step)):
            mask = offs < n
            x = tl.load(X + offs, mask=mask).to(tl.float32)
            tl.store(X + offs, (x * g).to(X.dtype.element_ty), mask=mask)
            offs += step

def scale_unless_one_(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """x *= g in place (x contiguous, g a 1-element tensor on x's device), skipped on the device if g == 1."""
    n = x.numel()
    if n == 0:
        return x
    block = 4096 if x.device.type != "cpu" else 1024
    programs = sm_count(x.device) * 8 if x.device.type == "cuda" else 4
    grid = (max(1, min(programs, cdiv(n, block))),)
    launch(_scale_unless_one_kernel, grid, x, g.reshape(1).to(torch.float32), n, BLOCK=block,
                                   num_warps=8 if block >= 4096 else 4)
    return x
