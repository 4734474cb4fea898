"""Triton kernels: RoPE (full and partial) and fused per-head RMSNorm + RoPE, forward and backward.

All tensors are seen as canonical (B, H, S, D) views with arbitrary strides (last dim contiguous); q and
k go through ONE launch (programs [0, Pq) take q rows, the rest k rows). A program owns a contiguous range of
rows (b, h, s); each row is read once as three column groups: the two rotary halves [0, R/2), [R/2, R)
and the pass-through part [R, D). cos/sin are (Bc, S, R) with Bc in {1, B} (batch stride 0 broadcasts).
With TUNING[...]["row_tile"] and R < D, the row-tile kernels read the row as ONE tile instead (rotate_half
partners by second, cache-hitting loads): one register layout, no shuffles between column groups.

Arithmetic is fp32. The forward reproduces HF's roundings when the output dtype is narrower than fp32
(each product rounded, then the sum; the norm output rounded before the rotation), so outputs match eager
bit for bit in the usual cases. The RoPE backward (inverse rotation) rounds the same way autograd does.
Both launches pass `enable_fp_fusion=False`: with contraction on, the GPU compiler narrows the rounded
products to bf16/fp16 multiplies and fuses each with the following add into one `fma` (one rounding instead
of HF's two), which the interpreter never shows; fp32 outputs likewise lose eager's separate mul and add.
The fused backward is plain fp32 and deterministic: each program accumulates its dweight share as 2-D
register tiles (reduced once, at the end) and writes one fp32 partial; the partials are summed afterwards.
Launch shapes come from `TUNING`, read at every launch. This module imports triton: import it lazily.
"""
import torch
import triton
import triton.language as tl

from hubfuse._common.device import sm_count
from hubfuse._common.launch import cdiv, next_power_of_2, launch
from hubfuse.rmsnorm.triton_kernels import sum_partials
from .reference import NONE


@triton.jit
def _row_offsets(rows, H, S, s_b, s_h, s_s, HEAD_INNER: tl.constexpr):
    # row index -> (b, h, s) in int64 and the row's offset; HEAD_INNER: h innermost (rows of a program share s),
    # else s innermost
    if HEAD_INNER:
        h = rows % H
        t = rows // H
        s = t % S
        b = t // S
    else:
        s = rows % S
        t = rows // S
        h = t % H
        b = t // H
    b = b.to(tl.int64)
    h = h.to(tl.int64)
    s = s.to(tl.int64)
    return b, h, s, b * s_b + h * s_h + s * s_s


@triton.jit
def _norm_block(x, rstd, w, ref, NORM: tl.constexpr, ROUND_NORM: tl.constexpr):
    # the q/k RMSNorm of one block of a row (fp32 in and out), given the row's rstd, at HF's cast points; ref: a
    # tensor of the input dtype
    if NORM == 1:  # standard: cast(n) to the input dtype, then * w (HF: `weight * h.to(dtype)`)
        x = (x * rstd).to(ref.dtype).to(tl.float32) * w
    else:  # zero-centred: n * (1 + w) in fp32
        x = x * rstd * (1.0 + w)
    if ROUND_NORM:  # the norm's output tensor has the input dtype
        x = x.to(ref.dtype).to(tl.float32)
    return x


@triton.jit
def _load_halves(ptr, off, ch, HALF, m):
    # the two rotated halves [0, R/2) and [R/2, R) of rows at `off`, columns ch, in fp32 (masked lanes 0)
    first = tl.load(ptr + off[:, None] + ch[None, :], mask=m, other=0.0).to(tl.float32)
    second = tl.load(ptr + off[:, None] + HALF + ch[None, :], mask=m, other=0.0).to(tl.float32)
    return first, second


@triton.jit
def _rope_products(x, cos, partner, sin, OUT, ROUND_ROPE: tl.constexpr):
    # The two products of a RoPE output, x * cos and partner * sin, in fp32; with ROUND_ROPE each is rounded to
    # OUT's element type first, as HF computes them in the input dtype (q * cos + rotate_half(q) * sin)
    a = x * cos
    p = partner * sin
    if ROUND_ROPE:
        a = a.to(OUT.dtype.element_ty).to(tl.float32)
        p = p.to(OUT.dtype.element_ty).to(tl.float32)
    return a, p


@triton.jit
def _fwd_rows(
    X, O, W, COS, SIN, row_begin, row_end, H, S,
    sx_b, sx_h, sx_s, so_b, so_h, so_s, sc_b, sc_s, eps, D, HALF,
    NORM: tl.constexpr, ROUND_NORM: tl.constexpr, ROUND_ROPE: tl.constexpr, HEAD_INNER: tl.constexpr,
    HAS_PASS: tl.constexpr, BLOCK_M: tl.constexpr, HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr,
):
    ch = tl.arange(0, HALF_BLOCK)
    hmask = ch < HALF
    cp = 2 * HALF + tl.arange(0, PASS_BLOCK)
    pmask = cp < D
    if NORM != 0:
        w1 = tl.load(W + ch, mask=hmask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(W + HALF + ch, mask=hmask, other=0.0).to(tl.float32)[None, :]
        if HAS_PASS:
            wp = tl.load(W + cp, mask=pmask, other=0.0).to(tl.float32)[None, :]
    for start in range(row_begin, row_end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        rmask = rows < row_end
        b, h, s, x_off = _row_offsets(rows, H, S, sx_b, sx_h, sx_s, HEAD_INNER)
        o_off = b * so_b + h * so_h + s * so_s
        c_off = b * sc_b + s * sc_s
        m = rmask[:, None] & hmask[None, :]
        x1_raw = tl.load(X + x_off[:, None] + ch[None, :], mask=m, other=0.0)
        x1 = x1_raw.to(tl.float32)
        x2 = tl.load(X + x_off[:, None] + HALF + ch[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_PASS:
            mp = rmask[:, None] & pmask[None, :]
            xp = tl.load(X + x_off[:, None] + cp[None, :], mask=mp, other=0.0).to(tl.float32)
        if NORM != 0:
            ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
            if HAS_PASS:
                ss += tl.sum(xp * xp, axis=1)
            rstd = tl.math.rsqrt(ss / D + eps)[:, None]  # as torch.rsqrt
            x1 = _norm_block(x1, rstd, w1, x1_raw, NORM, ROUND_NORM)
            x2 = _norm_block(x2, rstd, w2, x1_raw, NORM, ROUND_NORM)
            if HAS_PASS:
                xp = _norm_block(xp, rstd, wp, x1_raw, NORM, ROUND_NORM)
        c1, c2 = _load_halves(COS, c_off, ch, HALF, m)
        s1, s2 = _load_halves(SIN, c_off, ch, HALF, m)
        # y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2 (rotate_half(x) = [-x2, x1])
        a1, b1 = _rope_products(x1, c1, x2, s1, O, ROUND_ROPE)
        a2, b2 = _rope_products(x2, c2, x1, s2, O, ROUND_ROPE)
        tl.store(O + o_off[:, None] + ch[None, :], (a1 - b1).to(O.dtype.element_ty), mask=m)
        tl.store(O + o_off[:, None] + HALF + ch[None, :], (a2 + b2).to(O.dtype.element_ty), mask=m)
        if HAS_PASS:
            tl.store(O + o_off[:, None] + cp[None, :], xp.to(O.dtype.element_ty), mask=mp)


@triton.jit
def _partner(ptr, c, HALF, first, second):
    # rotate_half's partner of column c: ptr[c + HALF] where `first`, ptr[c - HALF] where `second`, else 0
    # (where, not a sum: keeps the sign of a zero)
    hi = tl.load(ptr + (c + HALF), mask=first, other=0.0)
    lo = tl.load(ptr + (c - HALF), mask=second, other=0.0)
    return tl.where(first, hi, lo)


@triton.jit
def _fwd_rows_tile(
    X, O, W, COS, SIN, row_begin, row_end, H, S,
    sx_b, sx_h, sx_s, so_b, so_h, so_s, sc_b, sc_s, eps, D, HALF,
    NORM: tl.constexpr, ROUND_NORM: tl.constexpr, ROUND_ROPE: tl.constexpr, HEAD_INNER: tl.constexpr,
    BLOCK_M: tl.constexpr, ROW_BLOCK: tl.constexpr,
):
    # As _fwd_rows, but each row is ONE [BLOCK_M, ROW_BLOCK] tile (partial RoPE, R < D): full-width vector
    # loads and a single register layout (the row sums need no shuffles between column groups). The
    # rotate_half partner of a rotated column c < R (c + R/2 in the first half, c - R/2 in the second) comes
    # from cache-hitting loads of the shifted row (two contiguous masked loads, so that they vectorise like
    # the row's; `_partner`); cos/sin are loaded for c < R only. Same roundings as _fwd_rows.
    c = tl.arange(0, ROW_BLOCK)
    cmask = c < D
    first = c < HALF  # y = x c - x[c + R/2] s here, y = x c + x[c - R/2] s in [R/2, R)
    second = (c >= HALF) & (c < 2 * HALF)
    rot = c < 2 * HALF
    if NORM != 0:
        w = tl.load(W + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
        wq = _partner(W, c, HALF, first, second).to(tl.float32)[None, :]
    for start in range(row_begin, row_end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        rmask = rows < row_end
        b, h, s, x_off = _row_offsets(rows, H, S, sx_b, sx_h, sx_s, HEAD_INNER)
        o_off = b * so_b + h * so_h + s * so_s
        c_off = b * sc_b + s * sc_s
        m = rmask[:, None] & cmask[None, :]
        mr = rmask[:, None] & rot[None, :]
        x_raw = tl.load(X + x_off[:, None] + c[None, :], mask=m, other=0.0)
        x = x_raw.to(tl.float32)
        xq = _partner(X + x_off[:, None], c[None, :], HALF, rmask[:, None] & first[None, :],
                      rmask[:, None] & second[None, :]).to(tl.float32)
        if NORM != 0:
            rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]  # as torch.rsqrt
            x = _norm_block(x, rstd, w, x_raw, NORM, ROUND_NORM)
            xq = _norm_block(xq, rstd, wq, x_raw, NORM, ROUND_NORM)
        cs = tl.load(COS + c_off[:, None] + c[None, :], mask=mr, other=0.0).to(tl.float32)
        sn = tl.load(SIN + c_off[:, None] + c[None, :], mask=mr, other=0.0).to(tl.float32)
        a, p = _rope_products(x, cs, xq, sn, O, ROUND_ROPE)
        y = tl.where(first[None, :], a - p, a + p)
        y = tl.where(rot[None, :], y, x)  # the pass-through part [R, D) as is
        tl.store(O + o_off[:, None] + c[None, :], y.to(O.dtype.element_ty), mask=m)


@triton.jit
def _fwd_variant(
    X, XO, W, COS, SIN, row_begin, row_end, H, S, sx_b, sx_h, sx_s, so_b, so_h, so_s, sc_b, sc_s, eps, D, HALF,
    NORM: tl.constexpr, ROUND_NORM: tl.constexpr, ROUND_ROPE: tl.constexpr, HEAD_INNER: tl.constexpr,
    HAS_PASS: tl.constexpr, BLOCK_M: tl.constexpr, HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr,
    ROW_TILE: tl.constexpr, ROW_BLOCK: tl.constexpr,
):
    # rows [row_begin, row_end) of one tensor (q or k) through the row variant the launcher picked
    if ROW_TILE:
        _fwd_rows_tile(X, XO, W, COS, SIN, row_begin, row_end, H, S, sx_b, sx_h, sx_s, so_b, so_h, so_s,
                       sc_b, sc_s, eps, D, HALF, NORM, ROUND_NORM, ROUND_ROPE, HEAD_INNER, BLOCK_M, ROW_BLOCK)
    else:
        _fwd_rows(X, XO, W, COS, SIN, row_begin, row_end, H, S, sx_b, sx_h, sx_s, so_b, so_h, so_s,
                  sc_b, sc_s, eps, D, HALF, NORM, ROUND_NORM, ROUND_ROPE, HEAD_INNER, HAS_PASS,
                  BLOCK_M, HALF_BLOCK, PASS_BLOCK)


@triton.jit
def _fwd_kernel(
    Q, K, QO, KO, WQ, WK, COS, SIN, Mq, Mk, rows_per_prog_q, rows_per_prog_k, n_prog_q, H_q, H_k, S,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sqo_b, sqo_h, sqo_s, sko_b, sko_h, sko_s, sc_b, sc_s, eps, D, HALF,
    NORM: tl.constexpr, ROUND_NORM: tl.constexpr, ROUND_ROPE: tl.constexpr,
    HEAD_INNER_Q: tl.constexpr, HEAD_INNER_K: tl.constexpr, HAS_PASS: tl.constexpr,
    BLOCK_M: tl.constexpr, HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr,
    ROW_TILE: tl.constexpr, ROW_BLOCK: tl.constexpr,
):
    eps = tl.cast(eps, tl.float32)  # Inductor passes a Python float as fp64 (torch.compile, ops inlined)
    # programs [0, n_prog_q) take q's rows, the rest k's
    pid = tl.program_id(0)
    if pid < n_prog_q:
        row_begin = pid * rows_per_prog_q
        row_end = tl.minimum(row_begin + rows_per_prog_q, Mq)
        _fwd_variant(Q, QO, WQ, COS, SIN, row_begin, row_end, H_q, S, sq_b, sq_h, sq_s, sqo_b, sqo_h, sqo_s,
                     sc_b, sc_s, eps, D, HALF, NORM, ROUND_NORM, ROUND_ROPE, HEAD_INNER_Q, HAS_PASS, BLOCK_M,
                     HALF_BLOCK, PASS_BLOCK, ROW_TILE, ROW_BLOCK)
    else:
        row_begin = (pid - n_prog_q) * rows_per_prog_k
        row_end = tl.minimum(row_begin + rows_per_prog_k, Mk)
        _fwd_variant(K, KO, WK, COS, SIN, row_begin, row_end, H_k, S, sk_b, sk_h, sk_s, sko_b, sko_h, sko_s,
                     sc_b, sc_s, eps, D, HALF, NORM, ROUND_NORM, ROUND_ROPE, HEAD_INNER_K, HAS_PASS, BLOCK_M,
                     HALF_BLOCK, PASS_BLOCK, ROW_TILE, ROW_BLOCK)


@triton.jit
def _bwd_rows(
    DY, X, DX, W, DW, COS, SIN, row_begin, row_end, H, S,
    sdy_b, sdy_h, sdy_s, sx_b, sx_h, sx_s, sdx_b, sdx_h, sdx_s, sc_b, sc_s, eps, D, HALF,
    NORM: tl.constexpr, ROUND_ROPE: tl.constexpr, HEAD_INNER: tl.constexpr, HAS_PASS: tl.constexpr,
    BLOCK_M: tl.constexpr, HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr,
):
    ch = tl.arange(0, HALF_BLOCK)
    hmask = ch < HALF
    cp = 2 * HALF + tl.arange(0, PASS_BLOCK)
    pmask = cp < D
    if NORM != 0:
        w1 = tl.load(W + ch, mask=hmask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(W + HALF + ch, mask=hmask, other=0.0).to(tl.float32)[None, :]
        # dweight summed over rows as (BLOCK_M, cols) tiles: no cross-warp reduction inside the loop
        dw1 = tl.zeros([BLOCK_M, HALF_BLOCK], dtype=tl.float32)
        dw2 = tl.zeros([BLOCK_M, HALF_BLOCK], dtype=tl.float32)
        if HAS_PASS:
            wp = tl.load(W + cp, mask=pmask, other=0.0).to(tl.float32)[None, :]
            dwp = tl.zeros([BLOCK_M, PASS_BLOCK], dtype=tl.float32)
    for start in range(row_begin, row_end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        rmask = rows < row_end
        b, h, s, dy_off = _row_offsets(rows, H, S, sdy_b, sdy_h, sdy_s, HEAD_INNER)
        dx_off = b * sdx_b + h * sdx_h + s * sdx_s
        c_off = b * sc_b + s * sc_s
        m = rmask[:, None] & hmask[None, :]
        dy1, dy2 = _load_halves(DY, dy_off, ch, HALF, m)
        if HAS_PASS:
            mp = rmask[:, None] & pmask[None, :]
            dyp = tl.load(DY + dy_off[:, None] + cp[None, :], mask=mp, other=0.0).to(tl.float32)
        c1, c2 = _load_halves(COS, c_off, ch, HALF, m)
        s1, s2 = _load_halves(SIN, c_off, ch, HALF, m)
        # inverse rotation: d1 = dy1 c1 + dy2 s2, d2 = dy2 c2 - dy1 s1
        a1, b1 = _rope_products(dy1, c1, dy2, s2, DX, ROUND_ROPE)
        a2, b2 = _rope_products(dy2, c2, dy1, s1, DX, ROUND_ROPE)
        d1 = a1 + b1
        d2 = a2 - b2
        if NORM == 0:
            tl.store(DX + dx_off[:, None] + ch[None, :], d1.to(DX.dtype.element_ty), mask=m)
            tl.store(DX + dx_off[:, None] + HALF + ch[None, :], d2.to(DX.dtype.element_ty), mask=m)
            if HAS_PASS:
                tl.store(DX + dx_off[:, None] + cp[None, :], dyp.to(DX.dtype.element_ty), mask=mp)
        else:
            x_off = b * sx_b + h * sx_h + s * sx_s
            x1_raw = tl.load(X + x_off[:, None] + ch[None, :], mask=m, other=0.0)
            x1 = x1_raw.to(tl.float32)
            x2 = tl.load(X + x_off[:, None] + HALF + ch[None, :], mask=m, other=0.0).to(tl.float32)
            ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
            if HAS_PASS:
                xp = tl.load(X + x_off[:, None] + cp[None, :], mask=mp, other=0.0).to(tl.float32)
                ss += tl.sum(xp * xp, axis=1)
            rstd = tl.math.rsqrt(ss / D + eps)[:, None]  # as torch.rsqrt
            n1 = x1 * rstd
            n2 = x2 * rstd
            if NORM == 1:  # y = w * cast(n)
                dw1 += d1 * n1.to(x1_raw.dtype).to(tl.float32)
                dw2 += d2 * n2.to(x1_raw.dtype).to(tl.float32)
                g1 = d1 * w1
                g2 = d2 * w2
            else:  # y = n * (1 + w)
                dw1 += d1 * n1
                dw2 += d2 * n2
                g1 = d1 * (1.0 + w1)
                g2 = d2 * (1.0 + w2)
            dot = tl.sum(g1 * n1, axis=1) + tl.sum(g2 * n2, axis=1)
            if HAS_PASS:
                np_ = xp * rstd
                if NORM == 1:
                    dwp += dyp * np_.to(x1_raw.dtype).to(tl.float32)
                    gp = dyp * wp
                else:
                    dwp += dyp * np_
                    gp = dyp * (1.0 + wp)
                dot += tl.sum(gp * np_, axis=1)
            mean = (dot / D)[:, None]
            # d/dx of x * rstd(x): rstd * (g - n * mean(g * n))
            tl.store(DX + dx_off[:, None] + ch[None, :], (rstd * (g1 - n1 * mean)).to(DX.dtype.element_ty), mask=m)
            tl.store(DX + dx_off[:, None] + HALF + ch[None, :], (rstd * (g2 - n2 * mean)).to(DX.dtype.element_ty),
                     mask=m)
            if HAS_PASS:
                tl.store(DX + dx_off[:, None] + cp[None, :], (rstd * (gp - np_ * mean)).to(DX.dtype.element_ty),
                         mask=mp)
    if NORM != 0:
        tl.store(DW + ch, tl.sum(dw1, axis=0), mask=hmask)
        tl.store(DW + HALF + ch, tl.sum(dw2, axis=0), mask=hmask)
        if HAS_PASS:
            tl.store(DW + cp, tl.sum(dwp, axis=0), mask=pmask)


@triton.jit
def _bwd_rows_tile(
    DY, X, DX, W, DW, COS, SIN, row_begin, row_end, H, S,
    sdy_b, sdy_h, sdy_s, sx_b, sx_h, sx_s, sdx_b, sdx_h, sdx_s, sc_b, sc_s, eps, D, HALF,
    NORM: tl.constexpr, ROUND_ROPE: tl.constexpr, HEAD_INNER: tl.constexpr,
    BLOCK_M: tl.constexpr, ROW_BLOCK: tl.constexpr,
):
    # As _bwd_rows with each row ONE [BLOCK_M, ROW_BLOCK] tile (see _fwd_rows_tile); the inverse rotation
    # reads the partners of dy and of sin as _fwd_rows_tile reads x's.
    c = tl.arange(0, ROW_BLOCK)
    cmask = c < D
    first = c < HALF  # d = dy c + dy[c + R/2] s[c + R/2] here, d = dy c - dy[c - R/2] s[c - R/2] in [R/2, R)
    second = (c >= HALF) & (c < 2 * HALF)
    rot = c < 2 * HALF
    if NORM != 0:
        w = tl.load(W + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
        # dweight summed over rows as a (BLOCK_M, cols) tile: no cross-warp reduction inside the loop
        dw = tl.zeros([BLOCK_M, ROW_BLOCK], dtype=tl.float32)
    for start in range(row_begin, row_end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        rmask = rows < row_end
        b, h, s, dy_off = _row_offsets(rows, H, S, sdy_b, sdy_h, sdy_s, HEAD_INNER)
        dx_off = b * sdx_b + h * sdx_h + s * sdx_s
        c_off = b * sc_b + s * sc_s
        m = rmask[:, None] & cmask[None, :]
        mr = rmask[:, None] & rot[None, :]
        dy = tl.load(DY + dy_off[:, None] + c[None, :], mask=m, other=0.0).to(tl.float32)
        mf = rmask[:, None] & first[None, :]
        ms = rmask[:, None] & second[None, :]
        dyq = _partner(DY + dy_off[:, None], c[None, :], HALF, mf, ms).to(tl.float32)
        cs = tl.load(COS + c_off[:, None] + c[None, :], mask=mr, other=0.0).to(tl.float32)
        snq = _partner(SIN + c_off[:, None], c[None, :], HALF, mf, ms).to(tl.float32)
        a, p = _rope_products(dy, cs, dyq, snq, DX, ROUND_ROPE)
        d = tl.where(first[None, :], a + p, a - p)
        d = tl.where(rot[None, :], d, dy)
        if NORM == 0:
            tl.store(DX + dx_off[:, None] + c[None, :], d.to(DX.dtype.element_ty), mask=m)
        else:
            x_off = b * sx_b + h * sx_h + s * sx_s
            x_raw = tl.load(X + x_off[:, None] + c[None, :], mask=m, other=0.0)
            x = x_raw.to(tl.float32)
            rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]  # as torch.rsqrt
            n = x * rstd
            if NORM == 1:  # y = w * cast(n)
                dw += d * n.to(x_raw.dtype).to(tl.float32)
                g = d * w
            else:  # y = n * (1 + w)
                dw += d * n
                g = d * (1.0 + w)
            mean = (tl.sum(g * n, axis=1) / D)[:, None]
            # d/dx of x * rstd(x): rstd * (g - n * mean(g * n))
            tl.store(DX + dx_off[:, None] + c[None, :], (rstd * (g - n * mean)).to(DX.dtype.element_ty), mask=m)
    if NORM != 0:
        tl.store(DW + c, tl.sum(dw, axis=0), mask=cmask)


@triton.jit
def _bwd_variant(
    DXO, X, DX, W, DW, COS, SIN, row_begin, row_end, H, S, sdo_b, sdo_h, sdo_s, sx_b, sx_h, sx_s,
    sg_b, sg_h, sg_s, sc_b, sc_s, eps, D, HALF,
    NORM: tl.constexpr, ROUND_ROPE: tl.constexpr, HEAD_INNER: tl.constexpr, HAS_PASS: tl.constexpr,
    BLOCK_M: tl.constexpr, HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr, ROW_TILE: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
):
    # rows [row_begin, row_end) of one tensor's grads (q or k) through the row variant the launcher picked
    if ROW_TILE:
        _bwd_rows_tile(DXO, X, DX, W, DW, COS, SIN, row_begin, row_end, H, S,
                       sdo_b, sdo_h, sdo_s, sx_b, sx_h, sx_s, sg_b, sg_h, sg_s, sc_b, sc_s, eps, D, HALF,
                       NORM, ROUND_ROPE, HEAD_INNER, BLOCK_M, ROW_BLOCK)
    else:
        _bwd_rows(DXO, X, DX, W, DW, COS, SIN, row_begin, row_end, H, S,
                  sdo_b, sdo_h, sdo_s, sx_b, sx_h, sx_s, sg_b, sg_h, sg_s, sc_b, sc_s, eps, D, HALF,
                  NORM, ROUND_ROPE, HEAD_INNER, HAS_PASS, BLOCK_M, HALF_BLOCK, PASS_BLOCK)


@triton.jit
def _bwd_kernel(
    DQO, DKO, Q, K, DQ, DK, WQ, WK, DWQ, DWK, COS, SIN,
    Mq, Mk, rows_per_prog_q, rows_per_prog_k, n_prog_q, H_q, H_k, S,
    sdq_b, sdq_h, sdq_s, sdk_b, sdk_h, sdk_s, sq_b, sq_h, sq_s, sk_b, sk_h, sk_s,
    sgq_b, sgq_h, sgq_s, sgk_b, sgk_h, sgk_s, sc_b, sc_s, eps, D, HALF,
    NORM: tl.constexpr, ROUND_ROPE: tl.constexpr, HEAD_INNER_Q: tl.constexpr, HEAD_INNER_K: tl.constexpr,
    HAS_PASS: tl.constexpr, BLOCK_M: tl.constexpr, HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr,
    ROW_TILE: tl.constexpr, ROW_BLOCK: tl.constexpr,
):
    eps = tl.cast(eps, tl.float32)  # Inductor passes a Python float as fp64 (torch.compile, ops inlined)
    # programs [0, n_prog_q) take q's rows, the rest k's; each writes its own row of the weight-grad partials
    pid = tl.program_id(0)
    if pid < n_prog_q:
        row_begin = pid * rows_per_prog_q
        row_end = tl.minimum(row_begin + rows_per_prog_q, Mq)
        _bwd_variant(DQO, Q, DQ, WQ, DWQ + pid * D, COS, SIN, row_begin, row_end, H_q, S,
                     sdq_b, sdq_h, sdq_s, sq_b, sq_h, sq_s, sgq_b, sgq_h, sgq_s, sc_b, sc_s, eps, D, HALF,
                     NORM, ROUND_ROPE, HEAD_INNER_Q, HAS_PASS, BLOCK_M, HALF_BLOCK, PASS_BLOCK, ROW_TILE, ROW_BLOCK)
    else:
        kp = pid - n_prog_q
        row_begin = kp * rows_per_prog_k
        row_end = tl.minimum(row_begin + rows_per_prog_k, Mk)
        _bwd_variant(DKO, K, DK, WK, DWK + kp * D, COS, SIN, row_begin, row_end, H_k, S,
                     sdk_b, sdk_h, sdk_s, sk_b, sk_h, sk_s, sgk_b, sgk_h, sgk_s, sc_b, sc_s, eps, D, HALF,
                     NORM, ROUND_ROPE, HEAD_INNER_K, HAS_PASS, BLOCK_M, HALF_BLOCK, PASS_BLOCK, ROW_TILE, ROW_BLOCK)


# ---------------------------------------------------------------------------------------------------------
# Launch wrappers. All 4-D tensors are canonical (B, H, S, D) views; cos/sin (Bc, S, R).
# ---------------------------------------------------------------------------------------------------------


# Launch shapes per kernel, read at every launch (benchmarks/tune_rotary.py sweeps them). block_elems: elements
# of one (BLOCK_M rows x padded row) tile; elems_per_warp: sets num_warps (a power of 2 in [1, 8]);
# programs_per_sm (fused backward): programs looping over rows, one fp32 dweight partial each (0: one per tile);
# row_tile: partial RoPE (R < D, not in place) runs the row-tile kernels (_fwd_rows_tile / _bwd_rows_tile: one
# [BLOCK_M, next_pow2(D)] tile per row) instead of three column groups; full RoPE is unaffected.
TUNING = {
    "rope_fwd": dict(block_elems=4096, elems_per_warp=512, row_tile=False),
    "rope_bwd": dict(block_elems=4096, elems_per_warp=512, row_tile=False),
    # H200 sweep: the row tile makes the fused partial zero-centred norm + RoPE 0.695 -> 0.630 ms
    "norm_fwd": dict(block_elems=2048, elems_per_warp=512, row_tile=True),
    # H200, Qwen3-0.6B's q/k (8 x 1024, 16 / 8 heads of 128), kernel + partial sums: 4 programs per SM 65.4 us,
    # 16 per SM 85.1 (more dweight partials to sum, no faster loop)
    "norm_bwd": dict(block_elems=2048, elems_per_warp=512, programs_per_sm=4, row_tile=True),
}


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _blocks(kind: str, D: int, R: int, has_pass: bool):
    """(BLOCK_M, HALF_BLOCK, PASS_BLOCK, ROW_BLOCK, num_warps) for TUNING[kind] and a row of D features, R
    rotated. ROW_BLOCK > 0: the row-tile kernels (one [BLOCK_M, ROW_BLOCK] tile per row; only with a
    pass-through part and TUNING[kind]["row_tile"]), else the column-group
    kernels (ROW_BLOCK 0)."""
    cfg = TUNING[kind]
    half_block = next_power_of_2(max(R // 2, 1))
    pass_block = next_power_of_2(D - R) if has_pass else 1
    row_block = next_power_of_2(D) if has_pass and cfg["row_tile"] else 0
    row_elems = row_block or 2 * half_block + (pass_block if has_pass else 0)
    block_m = _pow2_floor(cfg["block_elems"] // row_elems)
    num_warps = min(8, _pow2_floor(block_m * row_elems // cfg["elems_per_warp"]))
    return block_m, half_block, pass_block, row_block, num_warps


def _bhs(t):
    return t.stride(0), t.stride(1), t.stride(2)


def _head_inner(t) -> bool:
    # Rows of one program walk the heads of one position first: they then share their cos/sin row, which
    # is read once per program instead of once per row (for (B, H, S, D)-contiguous inputs the s-inner order
    # would read 2x as many cos/sin bytes from L2 as q/k bytes from HBM). Each row stays a contiguous chunk.
    return True


def _cos_strides(cos):
    return (cos.stride(0) if cos.shape[0] > 1 else 0), cos.stride(1)


def _round(dtype) -> bool:
    return dtype != torch.float32


def qk_rope_fwd(q, k, cos, sin, q_out, k_out, q_weight=None, k_weight=None, eps=0.0, norm=NONE,
                round_norm=False, inplace=False):
    """Writes rope(norm(q)) into q_out and rope(norm(k)) into k_out (both given, canonical views).
    inplace: q_out is q and k_out is k (no norm); only the rotated features [0, R) are read and written."""
    B, Hq, S, D = q.shape
    Hk = k.shape[1]
    R = cos.shape[-1]
    Mq, Mk = B * Hq * S, B * Hk * S
    has_pass = D > R and not inplace
    kind = "rope_fwd" if norm == NONE else "norm_fwd"
    block_m, half_block, pass_block, row_block, num_warps = _blocks(kind, D, R, has_pass)
    rpp = block_m
    n_prog_q, n_prog_k = cdiv(Mq, rpp), cdiv(Mk, rpp)
    wq = q_weight if q_weight is not None else cos
    wk = k_weight if k_weight is not None else cos
    sc_b, sc_s = _cos_strides(cos)
    launch(_fwd_kernel, (n_prog_q + n_prog_k,),
        q, k, q_out, k_out, wq, wk, cos, sin, Mq, Mk, rpp, rpp, n_prog_q, Hq, Hk, S,
        *_bhs(q), *_bhs(k), *_bhs(q_out), *_bhs(k_out), sc_b, sc_s, float(eps), D, R // 2,
        NORM=norm, ROUND_NORM=round_norm, ROUND_ROPE=_round(q_out.dtype),
        HEAD_INNER_Q=_head_inner(q), HEAD_INNER_K=_head_inner(k), HAS_PASS=has_pass,
        BLOCK_M=block_m, HALF_BLOCK=half_block, PASS_BLOCK=pass_block,
        ROW_TILE=row_block > 0, ROW_BLOCK=max(row_block, 1), num_warps=num_warps,
        enable_fp_fusion=False,  # keep HF's separate roundings (see the module docstring)
    )


def _num_programs(device: torch.device) -> int:
    per_sm = TUNING["norm_bwd"]["programs_per_sm"]
    if device.type == "cuda" and per_sm > 0:
        return sm_count(device) * per_sm
    return per_sm and 4  # the interpreter: a few programs, so that each loops over several tiles


def qk_rope_bwd(dq_out, dk_out, cos, sin, dq, dk, q=None, k=None, q_weight=None, k_weight=None, eps=0.0,
                norm=NONE):
    """Writes the input grads into dq / dk; with a norm, returns (dq_weight, dk_weight) in q_weight's dtype."""
    B, Hq, S, D = dq_out.shape
    Hk = dk_out.shape[1]
    R = cos.shape[-1]
    Mq, Mk = B * Hq * S, B * Hk * S
    kind = "rope_bwd" if norm == NONE else "norm_bwd"
    block_m, half_block, pass_block, row_block, num_warps = _blocks(kind, D, R, D > R)
    blocks_q, blocks_k = cdiv(Mq, block_m), cdiv(Mk, block_m)
    programs = _num_programs(dq_out.device)
    if norm == NONE or programs <= 0:  # one tile of rows per program
        rpp_q = rpp_k = block_m
    else:  # programs looping over rows, split between q and k by row count
        n_q = max(1, min(blocks_q, programs * Mq // (Mq + Mk)))
        n_k = max(1, min(blocks_k, programs * Mk // (Mq + Mk)))
        rpp_q = cdiv(blocks_q, n_q) * block_m
        rpp_k = cdiv(blocks_k, n_k) * block_m
    n_prog_q, n_prog_k = cdiv(Mq, rpp_q), cdiv(Mk, rpp_k)
    if norm != NONE:
        dw_partials = torch.empty((n_prog_q + n_prog_k, D), dtype=torch.float32, device=dq.device)
        dwq, dwk = dw_partials.narrow(0, 0, n_prog_q), dw_partials.narrow(0, n_prog_q, n_prog_k)
        qx, kx, wq, wk = q, k, q_weight, k_weight
    else:
        dwq = dwk = cos
        qx, kx, wq, wk = dq_out, dk_out, cos, cos
    sc_b, sc_s = _cos_strides(cos)
    launch(_bwd_kernel, (n_prog_q + n_prog_k,),
        dq_out, dk_out, qx, kx, dq, dk, wq, wk, dwq, dwk, cos, sin,
        Mq, Mk, rpp_q, rpp_k, n_prog_q, Hq, Hk, S,
        *_bhs(dq_out), *_bhs(dk_out), *_bhs(qx), *_bhs(kx), *_bhs(dq), *_bhs(dk), sc_b, sc_s,
        float(eps), D, R // 2,
        NORM=norm, ROUND_ROPE=(norm == NONE and _round(dq.dtype)),
        HEAD_INNER_Q=_head_inner(dq_out), HEAD_INNER_K=_head_inner(dk_out), HAS_PASS=D > R,
        BLOCK_M=block_m, HALF_BLOCK=half_block, PASS_BLOCK=pass_block,
        ROW_TILE=row_block > 0, ROW_BLOCK=max(row_block, 1), num_warps=num_warps,
        enable_fp_fusion=False,  # keep autograd's separate roundings (see the module docstring)
    )
    if norm != NONE:
        return sum_partials(dw_partials, n_prog_q, q_weight.dtype)
    return None
