"""Triton kernels for the RMSNorm family (standard, zero-centred `1+w`, gated).

One kernel per direction, specialised by MODE. All arithmetic is fp32 (loads are cast up, stores cast
down); the casts that HF performs between steps are reproduced so the output matches eager bit for bit
in the common cases. This module imports triton: import it lazily.
"""
import torch
import triton
import triton.language as tl

from hubfuse._common.device import sm_count
from hubfuse._common.launch import cdiv, next_power_of_2, launch
from .reference import GATED

MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_fwd_kernel(
    X, R, H, W, G, Y, RSTD, M, N, stride_x, stride_g, stride_y, eps,
    MODE: tl.constexpr, ROUND_T: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # HAS_RESIDUAL: the input is the sum x + r, rounded to x's dtype as torch's add rounds it, and written to H
    # (R and H with X's row stride); R and H are placeholders otherwise (never read or written)
    eps = tl.cast(eps, tl.float32)  # Inductor passes a Python float as fp64 (torch.compile, ops inlined)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    mask = row_mask[:, None] & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    x_raw = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
        x_raw = (x_raw.to(tl.float32) + r.to(tl.float32)).to(x_raw.dtype)
        tl.store(H + rows64 * stride_x + cols[None, :], x_raw, mask=mask)
    x = x_raw.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
    n = x * rstd[:, None]
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if MODE == 0:  # standard: cast the normalised value to the input dtype, then * w
        y = n.to(x_raw.dtype).to(tl.float32) * w
    elif MODE == 1:  # zero-centred: (1 + w) in fp32, cast once at the end
        y = n * (1.0 + w)
    else:  # gated: (w * cast(n)) rounded to its dtype, * silu(gate) in fp32
        t = n.to(x_raw.dtype).to(tl.float32) * w
        if ROUND_T:
            t = t.to(x_raw.dtype).to(tl.float32)
        g = tl.load(G + rows64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = t * (g * tl.sigmoid(g))
    tl.store(Y + rows64 * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit
def _rms_norm_bwd_kernel(
    DY, X, W, G, RSTD, DX, DG, DW_PARTIAL, Y, DR, M, N, rows_per_program,
    stride_dy, stride_x, stride_g, stride_dx, stride_dg, stride_y,
    MODE: tl.constexpr, ROUND_T: tl.constexpr, STORE_Y: tl.constexpr, HAS_DR: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Each program owns a contiguous slab of rows and writes one fp32 partial of dweight: the partials
    # are summed afterwards in a fixed order, so dweight is deterministic (no atomics).
    # STORE_Y (standard mode): also writes the forward's output y again, bit for bit (same x, rstd and w), for a
    # caller that did not keep it; Y may be DY (each tile of dy is read before its y is stored).
    # HAS_DR: dx is the norm's gradient plus DR (a gradient reaching x by another path, DX's row stride), summed
    # as torch adds the two tensors: the norm's gradient rounded to DX's dtype first.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    row_begin = pid * rows_per_program
    row_end = tl.minimum(row_begin + rows_per_program, M)
    for start in range(row_begin, row_end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        x_raw = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
        x = x_raw.to(tl.float32)
        dy = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)[:, None]
        n = x * rstd
        if MODE == 0:
            dn = dy * w
            n_cast = n.to(x_raw.dtype).to(tl.float32)
            dw_acc += tl.sum(dy * n_cast, axis=0)
            if STORE_Y:
                tl.store(Y + rows64 * stride_y + cols[None, :], (n_cast * w).to(Y.dtype.element_ty), mask=mask)
        elif MODE == 1:
            dn = dy * (1.0 + w)
            dw_acc += tl.sum(dy * n, axis=0)
        else:
            n_cast = n.to(x_raw.dtype).to(tl.float32)
            t = n_cast * w
            if ROUND_T:
                t = t.to(x_raw.dtype).to(tl.float32)
            g = tl.load(G + rows64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(g)
            dt = dy * (g * sig)
            dg = dy * t * sig * (1.0 + g * (1.0 - sig))
            tl.store(DG + rows64 * stride_dg + cols[None, :], dg.to(DG.dtype.element_ty), mask=mask)
            dn = dt * w
            dw_acc += tl.sum(dt * n_cast, axis=0)
        # d/dx of x * rstd(x) = rstd * (dn - n * mean(dn * n))
        dx = rstd * (dn - n * (tl.sum(dn * n, axis=1) / N)[:, None])
        if HAS_DR:
            dr = tl.load(DR + rows64 * stride_dx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dx = dx.to(DX.dtype.element_ty).to(tl.float32) + dr
        tl.store(DX + rows64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW_PARTIAL + pid * N + cols, dw_acc, mask=col_mask)


@triton.jit
def _sum_partials_kernel(P, OUT_A, OUT_B, split, rows, N, HAS_B: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    # program (group, column block): column sums of P[0:split] into OUT_A (group 0) or of P[split:rows] into
    # OUT_B (group 1, only with HAS_B), in fp32, tile by tile in a fixed order (deterministic), cast to the
    # outputs' dtype
    group = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    begin = group * split
    end = tl.where(group == 0, split, rows)
    acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    for start in range(begin, end, BLOCK_R):
        r = start + tl.arange(0, BLOCK_R)
        mask = (r < end)[:, None] & col_mask[None, :]
        acc += tl.load(P + r.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    if not HAS_B:  # OUT_B is a placeholder: no store to it in the kernel (a traced launch checks that)
        tl.store(OUT_A + cols, total.to(OUT_A.dtype.element_ty), mask=col_mask)
    elif group == 0:
        tl.store(OUT_A + cols, total.to(OUT_A.dtype.element_ty), mask=col_mask)
    else:
        tl.store(OUT_B + cols, total.to(OUT_B.dtype.element_ty), mask=col_mask)


def _sum_config(n_cols: int):
    """(BLOCK_R, BLOCK_N, num_warps): 16-column strips, 512 rows a tile, so that the sum runs on many SMs
    (H200, alone: 256 x 1024 partials 2.4 us, 528 x 128 in two groups 2.6 us, against 7.8 us for 256-column strips
    of 32 rows; inside Qwen3-0.6B's step: 3.4 us a call, against 48 us)."""
    return 512, min(16, next_power_of_2(n_cols)), 8


def sum_partials(partials: torch.Tensor, split: int, dtype: torch.dtype):
    """Column sums of the fp32 (rows, N) `partials` (per-program partial weight gradients), cast to `dtype`, in
    one launch (instead of a sum and a cast): (sum of rows [0, split), sum of rows [split, rows)); the second
    is None when split == rows."""
    rows, N = partials.shape
    out_a = torch.empty(N, dtype=dtype, device=partials.device)
    out_b = torch.empty(N, dtype=dtype, device=partials.device) if split < rows else None
    block_r, block_n, num_warps = _sum_config(N)
    launch(_sum_partials_kernel, (1 if out_b is None else 2, cdiv(N, block_n)),
        partials, out_a, out_b if out_b is not None else out_a, split, rows, N, HAS_B=out_b is not None,
        BLOCK_R=block_r, BLOCK_N=block_n, num_warps=num_warps,
    )
    return out_a, out_b


def _fwd_config(n_cols: int):
    """(BLOCK_M, BLOCK_N, num_warps): whole rows per program; several rows when rows are short."""
    block_n = next_power_of_2(n_cols)
    block_m = max(1, min(64, 2048 // block_n))
    num_warps = min(16, max(1, block_m * block_n // 512))
    return block_m, block_n, num_warps


def _bwd_config(n_cols: int, device: torch.device):
    """(BLOCK_M, BLOCK_N, num_warps, max programs): each program loops over a slab of rows, one tile at a time.
    Rows of 1024-2048 features: 4 rows a tile, 4 warps, 4 programs per SM (H200, 8192 rows, kernel + partial sums:
    18.5 / 36.1 us at N = 1024 / 2048, against 41.0 / 56.6 us with 16 rows, 16 warps and 2 programs per SM). Other
    widths: tiles of ~16K elements, 2 programs per SM (short rows need many rows per tile or the loop is
    latency-bound)."""
    block_n = next_power_of_2(n_cols)
    if 1024 <= block_n <= 2048:
        return 4, block_n, 4, sm_count(device) * 4
    block_m = max(1, min(128, 16384 // block_n))
    num_warps = 16 if block_m * block_n >= 8192 else 8
    return block_m, block_n, num_warps, sm_count(device) * 2


def _round_t(x, weight, mode):
    # HF rounds `weight * cast(n)` to promote(weight, x); a no-op unless that dtype is narrower than fp32
    return mode == GATED and torch.promote_types(weight.dtype, x.dtype) != torch.float32


def rms_norm_fwd(x, weight, gate, eps: float, mode: int, out_dtype: torch.dtype, y=None, residual=None, h=None):
    """(y, rstd); `y` given: written in place ((M, N), unit stride on N, out_dtype). With `residual` (x's shape,
    dtype and strides) the norm is of h = x + residual, written into `h` (the same layout)."""
    M, N = x.shape
    y = torch.empty((M, N), dtype=out_dtype, device=x.device) if y is None else y
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    block_m, block_n, num_warps = _fwd_config(N)
    g = gate if gate is not None else x
    launch(_rms_norm_fwd_kernel, (cdiv(M, block_m),),
        x, residual if residual is not None else x, h if h is not None else x, weight, g, y, rstd, M, N,
        x.stride(0), g.stride(0), y.stride(0), eps,
        MODE=mode, ROUND_T=_round_t(x, weight, mode), HAS_RESIDUAL=residual is not None, BLOCK_M=block_m,
        BLOCK_N=block_n, num_warps=num_warps,
    )
    return y, rstd


def rms_norm_bwd(dy, x, weight, gate, rstd, mode: int, y=None, dresidual=None):
    """(dx, dweight, dgate); with `y` (standard mode) the forward's output is also written into it; with
    `dresidual` (x's shape, dtype and strides, contiguous) dx is the norm's gradient + dresidual."""
    M, N = x.shape
    block_m, block_n, num_warps, programs = _bwd_config(N, x.device)
    rows_per_program = cdiv(cdiv(M, min(programs, cdiv(M, block_m))), block_m) * block_m
    grid = cdiv(M, rows_per_program)
    dx = torch.empty_like(x)
    dgate = torch.empty_like(gate) if gate is not None else x.new_empty(0)
    dw_partial = torch.empty((grid, N), dtype=torch.float32, device=x.device)
    g = gate if gate is not None else x
    dg = dgate if gate is not None else dx
    y_out = y if y is not None else dx
    launch(_rms_norm_bwd_kernel, (grid,),
        dy, x, weight, g, rstd, dx, dg, dw_partial, y_out, dresidual if dresidual is not None else dy, M, N,
        rows_per_program, dy.stride(0), x.stride(0), g.stride(0), dx.stride(0), dg.stride(0), y_out.stride(0),
        MODE=mode, ROUND_T=_round_t(x, weight, mode), STORE_Y=y is not None, HAS_DR=dresidual is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    return dx, sum_partials(dw_partial, grid, weight.dtype)[0], dgate
