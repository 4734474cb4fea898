"""Triton kernels of the chunked gated delta rule (forward + backward).

Chunked rule, chunks of 64 tokens (notation of reference.py), one program per (chunk, value head) unless said:
- `_solve_kernel`: the within-chunk cumulative decay g (optionally from Qwen3.5's raw gate inputs a, b, A_log,
  dt_bias) and the WY transform T = (I + strict_lower(beta K K^T * Gamma))^-1: Gram blocks of the raw keys
  (l2norm applied as row scales), forward substitution on 16x16 diagonal blocks, blocks merged in fp32. Few
  warp (latency-bound reductions). The forward's T and g are saved for the backward.
- `_wu_kernel`: w = T (beta G k) (16 bits), u = T (beta v) (fp32) and the key rows' l2norm scales (fp32), which
  the forward recurrence and the output kernel load instead of reducing the raw k rows again; in the backward's run
  also the intra-chunk attention M = s tril(q k^T * Gamma) in 16 bits (the backward recurrence's dot operand).
- `_recurrence_fwd_kernel`, one program per (sequence, value head, V block), sequential over chunks:
  v' = u - w h, h <- G_last h + (k exp(g_last - g))^T v'; stores the state at each chunk's start and v' (fp32 for
  the forward's output, 16-bit when the backward runs it again).
- `_output_kernel`, one program per (chunk, value head, V block), chunk-parallel: o = s (q G) h + M v', M formed
  there in fp32. The serial loop carries only the two state products, so long sequences (few sequence x head
  programs) are not held back by the output's work.
- `_recurrence_bwd_kernel`, same grid, reverse: dv' = M^T do + (k e) dh, dh <- G_last dh + s (q G)^T do - w^T dv'.
- `_grads_kernel`: every input gradient of a chunk (q, k, v, g or a, beta or b, A_log / dt_bias partial sums);
  with one value head per key head also the l2norm backward, else fp32 per-value-head partials of dq, dk that
  `_group_reduce_kernel` sums in a fixed order (no repeated q/k, no atomics: deterministic). It loops over V in
  blocks (as FLA's chunk_bwd_dqkwg): the sums over V accumulate in fp32, dv is final per block, and only
  [64, BV] slices of do, v', dv', v and [BV, K] slices of the states are live at a time. It holds five fp32 sums
  over V (too many registers a thread: it spills); `CONFIG["grads"]["split"]` = 1 runs it as two kernels, its dq
  side (two sums) then its dk side (three), the same operations in the same order.

Hopper: Triton 3.4-3.7.0 miscompiles `tl.dot(tl.trans(x), y)` when `x` is itself a `tl.dot` result (FLA #640:
the transposed accumulator layout feeding a wgmma). No kernel here transposes a computed matrix: transposed
operands are loaded through transposed pointers, and the two computed matrices needed transposed (dM * Gamma
and D in `_grads_kernel`) go through a per-program scratch tile in global memory (store, barrier, transposed
load), as FLA PR #826 proposed (split in two kernels: the dq side stores dM * Gamma, the dk side reads it).

Every matmul accumulates in fp32; operands are in the input dtype (bf16 on GPUs, exact fp32 dots for fp32
inputs). The forward keeps o within ~1.1x of the error of transformers' fp32-inside path (16-bit inputs): no
operand whose 16-bit rounding was a large share of o's error is rounded once:
- the l2-normalised q, k: every kernel loads the raw 16-bit q, k as dot operands and applies the l2norm scales in
  fp32 to the other factor or to the product (`_l2norm_scale`);
- the scaled T in u, and M, v' in o's M v': fp32 tiles split in two 16-bit terms (`_split`, `_dot_hilo2`: two and
  three tensor-core dots instead of one); u is stored in fp32, M stays in the output kernel's registers.
Still 16-bit: T, w, the per-chunk state operand h (q h, w h) and the decayed v' of the state update.
Addresses: int64 scalar bases, int32 offsets within tiles. This module imports triton: import it lazily.
"""
import torch
import triton
import triton.language as tl

from hubfuse._common.launch import launch

from .triton_common import CHUNK, _block, _gate, _rule_inputs, _token_rows
from .triton_varlen import n_chunk_slots

SUB = 16  # diagonal block size of the triangular solve


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, acc=None):
    """a @ b (+ acc) with fp32 accumulation; exact fp32 products for fp32 operands."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _mm(a, b, IEEE: tl.constexpr):
    """fp32 [16, 16] products of the triangular solve: exact (fp32 inputs, tests) or 3xTF32 (tensor cores)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision="tf32x3")


@triton.jit
def _split(x, DT: tl.constexpr):
    """fp32 x as hi + lo, two 16-bit tiles (hi = x rounded, lo = the rest rounded): a product with x as hi and lo
    terms carries ~16 (bf16) / 22 (fp16) bits of x instead of 8 / 11, for one more tensor-core dot."""
    hi = x.to(DT)
    return hi, (x - hi.to(tl.float32)).to(DT)


@triton.jit
def _dot_hilo2(a, b, acc, DT: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ b for fp32 a and b (exact fp32 for fp32 inputs): both split by `_split`, three dots
    (hi hi + lo hi + hi lo; lo lo is below the fp32 accumulation's error)."""
    if IEEE:
        return _dot(a, b, IEEE, acc)
    else:
        a_hi, a_lo = _split(a, DT)
        b_hi, b_lo = _split(b, DT)
        return _dot(a_hi, b_lo, IEEE, _dot(a_lo, b_hi, IEEE, _dot(a_hi, b_hi, IEEE, acc)))


@triton.jit
def _chunk_coords(slot, i_bh, HV, CU, CHUNK_INFO, T, NT, VARLEN: tl.constexpr):
    """(sequence, chunk within it, first token row, sequence length, per-chunk state slot) of the program's chunk
    slot (grid dim 0) and (batch, value head) i_bh (dim 1); sequence -1: unused slot (packed inputs)."""
    if VARLEN:
        n = tl.load(CHUNK_INFO + slot * 2)
        it = tl.load(CHUNK_INFO + slot * 2 + 1)
        nc = tl.maximum(n, 0)
        bos = tl.load(CU + nc).to(tl.int64)
        seqlen = (tl.load(CU + nc + 1) - tl.load(CU + nc)).to(tl.int32)
        chunk = slot.to(tl.int64)
    else:
        n = i_bh // HV
        it = slot
        bos = n.to(tl.int64) * T
        seqlen = T
        chunk = n.to(tl.int64) * NT + slot
    return n, it, bos, seqlen, chunk


@triton.jit
def _l2norm_scale(x, AXIS: tl.constexpr, L2NORM: tl.constexpr):
    """fp32 scales r = rsqrt(sum x^2 + eps) over AXIS of a 16-bit q or k tile, l2norm(x) = r x (transformers'
    l2norm); ones without the in-kernel l2norm. The kernels never round l2norm(x) to 16 bits: they use the raw
    16-bit x as the dot operand and put r in fp32 on the other factor or on the product."""
    if L2NORM:
        return tl.rsqrt(tl.sum(x.to(tl.float32) * x.to(tl.float32), AXIS) + 1e-6)
    else:
        return tl.full([x.shape[1 - AXIS]], 1.0, tl.float32)


@triton.jit
def _row_scale(S, hv, R, row0, mask, L2NORM: tl.constexpr, FULL: tl.constexpr = False):
    """The l2norm scales of 64 rows from row0 that `_wu_kernel` stored ((HV, R) fp32; unmasked under FULL, as
    `_ld`); ones without the in-kernel l2norm."""
    if L2NORM:
        return _ld(S + hv.to(tl.int64) * R + row0 + tl.arange(0, 64), mask, FULL)
    else:
        return tl.full([64], 1.0, tl.float32)


@triton.jit
def _decay_block(gr, gc, rmask, cmask, STRICT: tl.constexpr, ri, ci):
    """exp(g_r - g_c) where row > col (STRICT) or row >= col, and both are valid tokens; 0 elsewhere."""
    if STRICT:
        keep = (ri[:, None] > ci[None, :]) & rmask[:, None] & cmask[None, :]
    else:
        keep = (ri[:, None] >= ci[None, :]) & rmask[:, None] & cmask[None, :]
    return tl.where(keep, tl.exp(tl.where(keep, gr[:, None] - gc[None, :], 0.0)), 0.0)


@triton.jit
def _invert_unit_lower(L, o_s):
    """(I + L)^-1 of a strictly lower [SUB, SUB] block, by forward substitution (fp32)."""
    Ai = -L
    for i in range(2, L.shape[0]):
        a = tl.sum(tl.where((o_s == i)[:, None], -L, 0.0), 0)
        a = tl.where(o_s < i, a, 0.0)
        a = a + tl.sum(a[:, None] * Ai, 0)
        Ai = tl.where((o_s == i)[:, None], a[None, :], Ai)
    return Ai + (o_s[:, None] == o_s[None, :]).to(tl.float32)


@triton.jit
def _store_block(base, row0, o_s, row_mask, col0, val, row_stride):
    """A [16, 16] block of T at rows row0.., columns col0.. of the (rows, HV, 64) buffer (`base`: first row)."""
    tl.store(base + (row0 + o_s)[:, None] * row_stride + col0 + o_s[None, :], val.to(base.dtype.element_ty),
             mask=row_mask[:, None])


@triton.jit
def _solve_kernel(
    K_, G_IN, B_IN, A_LOG, DT_BIAS, CU, CHUNK_INFO, GC, A,
    T, NT, HV, K, stride_kt, stride_kh,
    GROUP: tl.constexpr, BKC: tl.constexpr, L2NORM: tl.constexpr, GATE: tl.constexpr, ROUND_BETA: tl.constexpr,
    VARLEN: tl.constexpr, IEEE: tl.constexpr,
):
    """One (chunk, value head): cumulative decay g (stored), the WY transform T = (I + L)^-1,
    L = strict_lower(diag(beta) k k^T * Gamma), stored as (rows, HV, 64). One warp (CONFIG): the 16x16 forward
    substitutions are latency-bound reductions."""
    slot = tl.program_id(0)
    i_bh = tl.program_id(1)
    hv = i_bh % HV
    hk = hv // GROUP
    n, it, bos, seqlen, chunk = _chunk_coords(slot, i_bh, HV, CU, CHUNK_INFO, T, NT, VARLEN)
    if n < 0:
        return
    t0 = it * 64
    row0 = bos + t0
    o_c = tl.arange(0, 64)
    o_s = tl.arange(0, 16)
    m_c = t0 + o_c < seqlen
    gate_base = row0 * HV + hv
    g, _ = _gate(G_IN, B_IN, A_LOG, DT_BIAS, gate_base + o_c * HV, m_c, hv, GATE, ROUND_BETA)
    tl.store(GC + gate_base + o_c * HV, tl.cumsum(g, 0), mask=m_c)
    # Gram blocks P_rc = k_r k_c^T (r >= c) of the raw keys over K in BKC slices, and the rows' squared norms
    m0, m1, m2, m3 = t0 + o_s < seqlen, t0 + 16 + o_s < seqlen, t0 + 32 + o_s < seqlen, t0 + 48 + o_s < seqlen
    k_base = K_ + row0 * stride_kt + hk * stride_kh
    P00 = tl.zeros([16, 16], dtype=tl.float32)
    P10 = tl.zeros([16, 16], dtype=tl.float32)
    P11 = tl.zeros([16, 16], dtype=tl.float32)
    P20 = tl.zeros([16, 16], dtype=tl.float32)
    P21 = tl.zeros([16, 16], dtype=tl.float32)
    P22 = tl.zeros([16, 16], dtype=tl.float32)
    P30 = tl.zeros([16, 16], dtype=tl.float32)
    P31 = tl.zeros([16, 16], dtype=tl.float32)
    P32 = tl.zeros([16, 16], dtype=tl.float32)
    P33 = tl.zeros([16, 16], dtype=tl.float32)
    n0 = tl.zeros([16], dtype=tl.float32)
    n1 = tl.zeros([16], dtype=tl.float32)
    n2 = tl.zeros([16], dtype=tl.float32)
    n3 = tl.zeros([16], dtype=tl.float32)
    for kk in range(0, K, BKC):
        o_k = kk + tl.arange(0, BKC)
        m_k = o_k[None, :] < K
        k0 = tl.load(k_base + o_s[:, None] * stride_kt + o_k[None, :], mask=m0[:, None] & m_k, other=0.0)
        k1 = tl.load(k_base + (o_s + 16)[:, None] * stride_kt + o_k[None, :], mask=m1[:, None] & m_k, other=0.0)
        k2 = tl.load(k_base + (o_s + 32)[:, None] * stride_kt + o_k[None, :], mask=m2[:, None] & m_k, other=0.0)
        k3 = tl.load(k_base + (o_s + 48)[:, None] * stride_kt + o_k[None, :], mask=m3[:, None] & m_k, other=0.0)
        P00 = _dot(k0, tl.trans(k0), IEEE, P00)
        P10 = _dot(k1, tl.trans(k0), IEEE, P10)
        P11 = _dot(k1, tl.trans(k1), IEEE, P11)
        P20 = _dot(k2, tl.trans(k0), IEEE, P20)
        P21 = _dot(k2, tl.trans(k1), IEEE, P21)
        P22 = _dot(k2, tl.trans(k2), IEEE, P22)
        P30 = _dot(k3, tl.trans(k0), IEEE, P30)
        P31 = _dot(k3, tl.trans(k1), IEEE, P31)
        P32 = _dot(k3, tl.trans(k2), IEEE, P32)
        P33 = _dot(k3, tl.trans(k3), IEEE, P33)
        if L2NORM:
            n0 += tl.sum(k0.to(tl.float32) * k0.to(tl.float32), 1)
            n1 += tl.sum(k1.to(tl.float32) * k1.to(tl.float32), 1)
            n2 += tl.sum(k2.to(tl.float32) * k2.to(tl.float32), 1)
            n3 += tl.sum(k3.to(tl.float32) * k3.to(tl.float32), 1)
    if L2NORM:  # l2norm(k_i) . l2norm(k_j) = r_i r_j k_i . k_j
        r0, r1, r2, r3 = tl.rsqrt(n0 + 1e-6), tl.rsqrt(n1 + 1e-6), tl.rsqrt(n2 + 1e-6), tl.rsqrt(n3 + 1e-6)
        P00 *= r0[:, None] * r0[None, :]
        P10 *= r1[:, None] * r0[None, :]
        P11 *= r1[:, None] * r1[None, :]
        P20 *= r2[:, None] * r0[None, :]
        P21 *= r2[:, None] * r1[None, :]
        P22 *= r2[:, None] * r2[None, :]
        P30 *= r3[:, None] * r0[None, :]
        P31 *= r3[:, None] * r1[None, :]
        P32 *= r3[:, None] * r2[None, :]
        P33 *= r3[:, None] * r3[None, :]
    tl.debug_barrier()  # the sub-block reads below see the stored cumulative decay
    g0 = tl.load(GC + gate_base + o_s * HV, mask=m0, other=0.0)
    g1 = tl.load(GC + gate_base + (o_s + 16) * HV, mask=m1, other=0.0)
    g2 = tl.load(GC + gate_base + (o_s + 32) * HV, mask=m2, other=0.0)
    g3 = tl.load(GC + gate_base + (o_s + 48) * HV, mask=m3, other=0.0)
    _, b0 = _gate(G_IN, B_IN, A_LOG, DT_BIAS, gate_base + o_s * HV, m0, hv, GATE, ROUND_BETA)
    _, b1 = _gate(G_IN, B_IN, A_LOG, DT_BIAS, gate_base + (o_s + 16) * HV, m1, hv, GATE, ROUND_BETA)
    _, b2 = _gate(G_IN, B_IN, A_LOG, DT_BIAS, gate_base + (o_s + 32) * HV, m2, hv, GATE, ROUND_BETA)
    _, b3 = _gate(G_IN, B_IN, A_LOG, DT_BIAS, gate_base + (o_s + 48) * HV, m3, hv, GATE, ROUND_BETA)
    # L_rc = beta_r P_rc Gamma_rc (strictly lower overall)
    L00 = b0[:, None] * P00 * _decay_block(g0, g0, m0, m0, True, o_s, o_s)
    L11 = b1[:, None] * P11 * _decay_block(g1, g1, m1, m1, True, o_s, o_s)
    L22 = b2[:, None] * P22 * _decay_block(g2, g2, m2, m2, True, o_s, o_s)
    L33 = b3[:, None] * P33 * _decay_block(g3, g3, m3, m3, True, o_s, o_s)
    L10 = b1[:, None] * P10 * _decay_block(g1, g0, m1, m0, True, o_s + 16, o_s)
    L20 = b2[:, None] * P20 * _decay_block(g2, g0, m2, m0, True, o_s + 32, o_s)
    L21 = b2[:, None] * P21 * _decay_block(g2, g1, m2, m1, True, o_s + 32, o_s + 16)
    L30 = b3[:, None] * P30 * _decay_block(g3, g0, m3, m0, True, o_s + 48, o_s)
    L31 = b3[:, None] * P31 * _decay_block(g3, g1, m3, m1, True, o_s + 48, o_s + 16)
    L32 = b3[:, None] * P32 * _decay_block(g3, g2, m3, m2, True, o_s + 48, o_s + 32)
    T00 = _invert_unit_lower(L00, o_s)
    T11 = _invert_unit_lower(L11, o_s)
    T22 = _invert_unit_lower(L22, o_s)
    T33 = _invert_unit_lower(L33, o_s)
    # off-diagonal blocks of the inverse: T_rc = -T_rr sum_{c <= m < r} L_rm T_mc, fp32 operands (3xTF32 on
    # tensor cores: fp32-level accuracy; exact fp32 for fp32 inputs)
    T10 = -_mm(T11, _mm(L10, T00, IEEE), IEEE)
    T21 = -_mm(T22, _mm(L21, T11, IEEE), IEEE)
    T32 = -_mm(T33, _mm(L32, T22, IEEE), IEEE)
    T20 = -_mm(T22, _mm(L20, T00, IEEE) + _mm(L21, T10, IEEE), IEEE)
    T31 = -_mm(T33, _mm(L31, T11, IEEE) + _mm(L32, T21, IEEE), IEEE)
    T30 = -_mm(T33, _mm(L30, T00, IEEE) + _mm(L31, T10, IEEE) + _mm(L32, T20, IEEE), IEEE)
    zero = tl.zeros([16, 16], dtype=tl.float32)
    a_base = A + gate_base * 64
    rs = HV * 64
    _store_block(a_base, 0, o_s, m0, 0, T00, rs)
    _store_block(a_base, 0, o_s, m0, 16, zero, rs)
    _store_block(a_base, 0, o_s, m0, 32, zero, rs)
    _store_block(a_base, 0, o_s, m0, 48, zero, rs)
    _store_block(a_base, 16, o_s, m1, 0, T10, rs)
    _store_block(a_base, 16, o_s, m1, 16, T11, rs)
    _store_block(a_base, 16, o_s, m1, 32, zero, rs)
    _store_block(a_base, 16, o_s, m1, 48, zero, rs)
    _store_block(a_base, 32, o_s, m2, 0, T20, rs)
    _store_block(a_base, 32, o_s, m2, 16, T21, rs)
    _store_block(a_base, 32, o_s, m2, 32, T22, rs)
    _store_block(a_base, 32, o_s, m2, 48, zero, rs)
    _store_block(a_base, 48, o_s, m3, 0, T30, rs)
    _store_block(a_base, 48, o_s, m3, 16, T31, rs)
    _store_block(a_base, 48, o_s, m3, 32, T32, rs)
    _store_block(a_base, 48, o_s, m3, 48, T33, rs)


@triton.jit
def _wu_kernel(
    Q, K_, V_, G_IN, B_IN, A_LOG, DT_BIAS, CU, CHUNK_INFO, GC, A,
    W, U, RK, M,
    T, NT, HV, K, V, R, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    GROUP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, GATE: tl.constexpr,
    ROUND_BETA: tl.constexpr, VARLEN: tl.constexpr, IEEE: tl.constexpr, M_OUT: tl.constexpr,
):
    """One (chunk, value head), from T: w = T diag(beta G) kn (16 bits), u = T diag(beta) v (fp32), kn the
    (l2-normalised) k, and with L2NORM the l2norm scales rk of the chunk's key rows (fp32, (HV, R) with R the rows:
    one contiguous load of 64 a chunk) for the serial forward recurrence and the output kernel. M_OUT (the
    backward's run): also the intra-chunk attention M = s qn kn^T Gamma (diagonal included), (rows, HV, 64) in 16
    bits, the dot operand of the backward recurrence (the forward's output kernel forms M itself, in fp32)."""
    slot = tl.program_id(0)
    i_bh = tl.program_id(1)
    hv = i_bh % HV
    hk = hv // GROUP
    n, it, bos, seqlen, chunk = _chunk_coords(slot, i_bh, HV, CU, CHUNK_INFO, T, NT, VARLEN)
    if n < 0:
        return
    t0 = it * 64
    row0 = bos + t0
    o_c = tl.arange(0, 64)
    o_k = tl.arange(0, BK)
    m_c = t0 + o_c < seqlen
    DT = K_.dtype.element_ty
    qk_mask = m_c[:, None] & (o_k[None, :] < K)
    k = tl.load(K_ + row0 * stride_kt + hk * stride_kh + o_c[:, None] * stride_kt + o_k[None, :], mask=qk_mask,
                other=0.0)
    rk = _l2norm_scale(k, 1, L2NORM)
    gate_base = row0 * HV + hv
    if L2NORM:
        tl.store(RK + hv.to(tl.int64) * R + row0 + o_c, rk, mask=m_c)
    _, beta = _gate(G_IN, B_IN, A_LOG, DT_BIAS, gate_base + o_c * HV, m_c, hv, GATE, ROUND_BETA)
    gc = tl.load(GC + gate_base + o_c * HV, mask=m_c, other=0.0)
    cc_tile = o_c[:, None] * (HV * 64) + o_c[None, :]
    if M_OUT:
        q = tl.load(Q + row0 * stride_qt + hk * stride_qh + o_c[:, None] * stride_qt + o_k[None, :], mask=qk_mask,
                    other=0.0)
        att = (scale * _l2norm_scale(q, 1, L2NORM))[:, None] * _dot(q, tl.trans(k), IEEE) * (
            rk[None, :] * _decay_block(gc, gc, m_c, m_c, False, o_c, o_c))
        tl.store(M + gate_base * 64 + cc_tile, att.to(M.dtype.element_ty), mask=m_c[:, None])
    Tm = tl.load(A + gate_base * 64 + cc_tile, mask=m_c[:, None], other=0.0).to(tl.float32)
    # w = T (beta G kn) = (T diag(beta G rk)) k, u = (T diag(beta)) v: scale T's columns, not the [64, D] tiles
    # (the 16-bit scaled T is a small error of w, which is rounded to 16 bits anyway, but a large one of u: u's is
    # split in two 16-bit terms, two dots, and u is stored in fp32)
    w = _dot((Tm * (beta * tl.exp(gc) * rk)[None, :]).to(DT), k, IEEE)
    tl.store(W + gate_base * K + o_c[:, None] * (HV * K) + o_k[None, :], w.to(W.dtype.element_ty),
             mask=m_c[:, None] & (o_k[None, :] < K))
    Tb_hi, Tb_lo = _split(Tm * beta[None, :], DT)
    v_base = V_ + row0 * stride_vt + hv * stride_vh
    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        vmask = m_c[:, None] & (o_v[None, :] < V)
        vv = tl.load(v_base + o_c[:, None] * stride_vt + o_v[None, :], mask=vmask, other=0.0)
        u = _dot(Tb_hi, vv, IEEE)
        if not IEEE:  # (fp32 inputs: Tb_hi is exact)
            u = _dot(Tb_lo, vv, IEEE, u)
        tl.store(U + gate_base * V + o_c[:, None] * (HV * V) + o_v[None, :], u.to(U.dtype.element_ty), mask=vmask)


@triton.jit
def _ld(ptr, mask, FULL: tl.constexpr):
    """tl.load, masked (0 outside) unless FULL (a full chunk of unpadded tiles: no mask to compute or apply)."""
    if FULL:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=mask, other=0.0)


@triton.jit
def _st(ptr, value, mask, FULL: tl.constexpr):
    """tl.store, masked unless FULL (`_ld`)."""
    if FULL:
        tl.store(ptr, value)
    else:
        tl.store(ptr, value, mask=mask)


@triton.jit
def _serial_program(INIT, T, HV, K, V, CU, CHUNK_OFFSETS, GROUP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    USE_INIT: tl.constexpr, VARLEN: tl.constexpr, EVEN: tl.constexpr):
    """A serial recurrence program (V block, sequence x value head): its (sequence, value head) index, value and
    key head, sequence (first row, length, first per-chunk state slot, chunks, the 64-row chunks run unmasked: all
    but a shorter last one under EVEN, else none), its V block's state tile (K, V offsets, element offsets in a
    (K, V) state, mask) and its fp32 starting state (from INIT under USE_INIT, else zeros)."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    n = i_nh // HV
    hv = i_nh % HV
    hk = hv // GROUP
    if VARLEN:
        bos = tl.load(CU + n).to(tl.int64)
        seqlen = (tl.load(CU + n + 1) - tl.load(CU + n)).to(tl.int32)
        first_chunk = tl.load(CHUNK_OFFSETS + n).to(tl.int64)
    else:
        bos = n.to(tl.int64) * T
        seqlen = T
        first_chunk = n.to(tl.int64) * tl.cdiv(T, 64)
    n_chunks = tl.cdiv(seqlen, 64)
    n_full = seqlen // 64 if EVEN else 0
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    state_tile = o_k[:, None] * V + o_v[None, :]
    state_mask = (o_k < K)[:, None] & (o_v < V)[None, :]
    if USE_INIT:
        h = tl.load(INIT + i_nh.to(tl.int64) * K * V + state_tile, mask=state_mask, other=0.0).to(tl.float32)
    else:
        h = tl.zeros([BK, BV], dtype=tl.float32)
    return i_nh, hv, hk, bos, seqlen, first_chunk, n_chunks, n_full, o_k, o_v, state_tile, state_mask, h


@triton.jit
def _chunk_rows(it, bos, seqlen, K, V, o_k, o_v):
    """Chunk `it` of a sequence: its token offsets, first token, first row, and the row, K and V masks."""
    o_c = tl.arange(0, 64)
    t0 = it * 64
    row0 = bos + t0
    return o_c, t0, row0, t0 + o_c < seqlen, o_k < K, o_v < V


@triton.jit
def _recurrence_fwd_kernel(
    K_, W, U, GC, RK, H0, CU, CHUNK_OFFSETS,
    HT, HS, VN,
    T, HV, K, V, R, stride_kt, stride_kh,
    GROUP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_H0: tl.constexpr, STORE_FINAL: tl.constexpr,
    L2NORM: tl.constexpr, VARLEN: tl.constexpr, IEEE: tl.constexpr, EVEN: tl.constexpr,
):
    """One (sequence, value head, V block), sequential over chunks. EVEN (K = BK, V a multiple of BV): the
    sequence's 64-row chunks run without masks, then its last, shorter chunk (if any) with them."""
    i_nh, hv, hk, bos, seqlen, first_chunk, n_chunks, n_full, o_k, o_v, state_tile, state_mask, h = _serial_program(
        H0, T, HV, K, V, CU, CHUNK_OFFSETS, GROUP, BK, BV, USE_H0, VARLEN, EVEN)
    for it in range(n_full):
        h = _recurrence_fwd_chunk(h, it, bos, seqlen, first_chunk, hv, hk, K_, W, U, GC, RK, HS, VN, HV, K, V, R,
                                  stride_kt, stride_kh, o_k, o_v, BK, BV, L2NORM, IEEE, True)
    for it in range(n_full, n_chunks):
        h = _recurrence_fwd_chunk(h, it, bos, seqlen, first_chunk, hv, hk, K_, W, U, GC, RK, HS, VN, HV, K, V, R,
                                  stride_kt, stride_kh, o_k, o_v, BK, BV, L2NORM, IEEE, False)
    if STORE_FINAL:
        tl.store(HT + i_nh.to(tl.int64) * K * V + state_tile, h, mask=state_mask)


@triton.jit
def _recurrence_fwd_chunk(h, it, bos, seqlen, first_chunk, hv, hk, K_, W, U, GC, RK, HS, VN, HV, K, V, R,
                          stride_kt, stride_kh, o_k, o_v, BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
                          IEEE: tl.constexpr, FULL: tl.constexpr):
    """Chunk `it` of the forward recurrence: stores the state at its start and v' = u - w h, returns
    h <- exp(g_last) h + kn^T diag(exp(g_last - g)) v'."""
    DT = W.dtype.element_ty
    o_c, t0, row0, m_c, m_k, m_v = _chunk_rows(it, bos, seqlen, K, V, o_k, o_v)
    _st(HS + ((first_chunk + it) * HV + hv) * K * V + o_k[:, None] * V + o_v[None, :], h.to(DT),
        m_k[:, None] & m_v[None, :], FULL)
    w = _ld(W + (row0 * HV + hv) * K + o_c[:, None] * (HV * K) + o_k[None, :], m_c[:, None] & m_k[None, :], FULL)
    vmask = m_c[:, None] & m_v[None, :]
    vv = (row0 * HV + hv) * V + o_c[:, None] * (HV * V) + o_v[None, :]  # (token, v) in (rows, HV, V) buffers
    u = _ld(U + vv, vmask, FULL).to(tl.float32)
    v_new = u - _dot(w, h.to(DT), IEEE)  # fp32: the output kernel takes it in fp32, the backward in 16 bits
    _st(VN + vv, v_new.to(VN.dtype.element_ty), vmask, FULL)
    gc = _ld(GC + (row0 * HV + hv) + o_c * HV, m_c, FULL)
    if FULL:
        g_last = tl.load(GC + (row0 + 63) * HV + hv)
    else:
        g_last = tl.load(GC + (bos + tl.minimum(t0 + 63, seqlen - 1)) * HV + hv)
    # h <- exp(g_last) h + kn^T diag(exp(g_last - g)) v' = exp(g_last) h + k^T diag(rk exp(g_last - g)) v',
    # k^T read through transposed pointers
    kt = _ld(K_ + row0 * stride_kt + hk * stride_kh + o_c[None, :] * stride_kt + o_k[:, None],
             m_k[:, None] & m_c[None, :], FULL)
    rk = _row_scale(RK, hv, R, row0, m_c, L2NORM, FULL)
    e = tl.exp(g_last - gc) * rk
    if not FULL:
        e = tl.where(m_c, e, 0.0)
    v_dec = (v_new * e[:, None]).to(DT)
    return _dot(kt, v_dec, IEEE, h * tl.exp(g_last))


@triton.jit
def _output_kernel(
    Q, K_, HS, VN, GC, RK, CU, CHUNK_INFO, O,
    T, NT, HV, K, V, R, scale, stride_qt, stride_qh, stride_kt, stride_kh,
    GROUP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, VARLEN: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One (chunk, value head, V block), chunk-parallel: o = s diag(G) qn h + M v' = s diag(G rq) q h + M v' from
    the state at the chunk's start and v' (fp32), both stored by the recurrence, with the intra-chunk attention
    M = s diag(rq) q k^T diag(rk) Gamma (diagonal included) formed here in fp32."""
    slot = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_v = tl.program_id(2)
    hv = i_bh % HV
    hk = hv // GROUP
    n, it, bos, seqlen, chunk = _chunk_coords(slot, i_bh, HV, CU, CHUNK_INFO, T, NT, VARLEN)
    if n < 0:
        return
    t0 = it * 64
    row0 = bos + t0
    o_c = tl.arange(0, 64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_c = t0 + o_c < seqlen
    m_k = o_k < K
    m_v = o_v < V
    DT = Q.dtype.element_ty
    gate_base = row0 * HV + hv
    qk_mask = m_c[:, None] & m_k[None, :]
    q = tl.load(Q + row0 * stride_qt + hk * stride_qh + o_c[:, None] * stride_qt + o_k[None, :], mask=qk_mask,
                other=0.0)
    k = tl.load(K_ + row0 * stride_kt + hk * stride_kh + o_c[:, None] * stride_kt + o_k[None, :], mask=qk_mask,
                other=0.0)
    h = tl.load(HS + (chunk * HV + hv) * K * V + o_k[:, None] * V + o_v[None, :],
                mask=m_k[:, None] & m_v[None, :], other=0.0)
    gc = tl.load(GC + gate_base + o_c * HV, mask=m_c, other=0.0)
    vmask = m_c[:, None] & m_v[None, :]
    vv_tile = o_c[:, None] * (HV * V) + o_v[None, :]
    v_new = tl.load(VN + gate_base * V + vv_tile, mask=vmask, other=0.0)
    rq = scale * _l2norm_scale(q, 1, L2NORM)
    rk = _row_scale(RK, hv, R, row0, m_c, L2NORM)
    att = rq[:, None] * _dot(q, tl.trans(k), IEEE) * (rk[None, :] * _decay_block(gc, gc, m_c, m_c, False, o_c, o_c))
    o = (tl.exp(gc) * rq)[:, None] * _dot(q, h, IEEE)
    o = _dot_hilo2(att, v_new, o, DT, IEEE)  # M, v' in fp32: their 16-bit roundings were o's largest error
    tl.store(O + gate_base * V + vv_tile, o.to(O.dtype.element_ty), mask=vmask)


@triton.jit
def _recurrence_bwd_kernel(
    Q, K_, W, GC, M, DO, DHT, CU, CHUNK_OFFSETS,
    DH0, DHS, DVN,
    T, HV, K, V, scale, stride_qt, stride_qh, stride_kt, stride_kh,
    GROUP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
    L2NORM: tl.constexpr, VARLEN: tl.constexpr, IEEE: tl.constexpr, EVEN: tl.constexpr,
):
    """One (sequence, value head, V block), reverse over chunks: the last, shorter chunk (if any) with masks, then
    (EVEN, as `_recurrence_fwd_kernel`) the 64-row chunks without."""
    i_nh, hv, hk, bos, seqlen, first_chunk, n_chunks, n_full, o_k, o_v, state_tile, state_mask, dh = _serial_program(
        DHT, T, HV, K, V, CU, CHUNK_OFFSETS, GROUP, BK, BV, USE_DHT, VARLEN, EVEN)
    for i in range(n_chunks - n_full):
        dh = _recurrence_bwd_chunk(dh, n_chunks - 1 - i, bos, seqlen, first_chunk, hv, hk, Q, K_, W, GC, M, DO, DHS,
                                   DVN, HV, K, V, scale, stride_qt, stride_qh, stride_kt, stride_kh, o_k, o_v, BK, BV,
                                   L2NORM, IEEE, False)
    for i in range(n_full):
        dh = _recurrence_bwd_chunk(dh, n_full - 1 - i, bos, seqlen, first_chunk, hv, hk, Q, K_, W, GC, M, DO, DHS,
                                   DVN, HV, K, V, scale, stride_qt, stride_qh, stride_kt, stride_kh, o_k, o_v, BK, BV,
                                   L2NORM, IEEE, True)
    if STORE_DH0:
        tl.store(DH0 + i_nh.to(tl.int64) * K * V + state_tile, dh, mask=state_mask)


@triton.jit
def _recurrence_bwd_chunk(dh, it, bos, seqlen, first_chunk, hv, hk, Q, K_, W, GC, M, DO, DHS, DVN, HV, K, V, scale,
                          stride_qt, stride_qh, stride_kt, stride_kh, o_k, o_v, BK: tl.constexpr, BV: tl.constexpr,
                          L2NORM: tl.constexpr, IEEE: tl.constexpr, FULL: tl.constexpr):
    """Chunk `it` of the backward recurrence: stores the state gradient at its end and dv', returns dh at its start."""
    DT = W.dtype.element_ty
    o_c, t0, row0, m_c, m_k, m_v = _chunk_rows(it, bos, seqlen, K, V, o_k, o_v)
    dh_d = dh.to(DT)
    _st(DHS + ((first_chunk + it) * HV + hv) * K * V + o_k[:, None] * V + o_v[None, :], dh_d,
        m_k[:, None] & m_v[None, :], FULL)
    gc = _ld(GC + (row0 * HV + hv) + o_c * HV, m_c, FULL)
    if FULL:
        g_last = tl.load(GC + (row0 + 63) * HV + hv)
    else:
        g_last = tl.load(GC + (bos + tl.minimum(t0 + 63, seqlen - 1)) * HV + hv)
    vmask = m_c[:, None] & m_v[None, :]
    vv = (row0 * HV + hv) * V + o_c[:, None] * (HV * V) + o_v[None, :]
    do = _ld(DO + vv, vmask, FULL)
    # M^T (16 bits) through transposed pointers: att_t[j, i] = M[i, j]
    att_t = _ld(M + (row0 * HV + hv) * 64 + o_c[None, :] * (HV * 64) + o_c[:, None], m_c[None, :], FULL)
    k = _ld(K_ + row0 * stride_kt + hk * stride_kh + o_c[:, None] * stride_kt + o_k[None, :],
            m_c[:, None] & m_k[None, :], FULL)
    # dv' = M^T do + diag(exp(g_last - g)) kn dh = M^T do + diag(rk exp(g_last - g)) k dh
    ek = tl.exp(g_last - gc) * _l2norm_scale(k, 1, L2NORM)
    if not FULL:
        ek = tl.where(m_c, ek, 0.0)
    dv_new = ek[:, None] * _dot(k, dh_d, IEEE)
    dv_new = _dot(att_t, do, IEEE, dv_new).to(DT)
    _st(DVN + vv, dv_new, vmask, FULL)
    # dh <- exp(g_last) dh + s qn^T diag(G) do - w^T dv' (qn^T diag(G) = q^T diag(rq G))
    qt = _ld(Q + row0 * stride_qt + hk * stride_qh + o_c[None, :] * stride_qt + o_k[:, None],
             m_k[:, None] & m_c[None, :], FULL)
    wt = _ld(W + (row0 * HV + hv) * K + o_c[None, :] * (HV * K) + o_k[:, None], m_k[:, None] & m_c[None, :], FULL)
    do_g = (do.to(tl.float32) * (scale * tl.exp(gc) * _l2norm_scale(qt, 0, L2NORM))[:, None]).to(DT)
    dh = _dot(qt, do_g, IEEE, dh * tl.exp(g_last))
    return _dot(wt, -dv_new, IEEE, dh)


_GRADS_KERNEL_NAMES = {(True, False): "_grads_dq_kernel", (False, True): "_grads_dk_kernel"}


def _grads_kernel_name(specialization):
    """The compiled kernel's name (profiler rows): `_grads_kernel`, or the name of one of its two halves."""
    sides = tuple(bool(specialization.constants.get(name)) for name in ("DQ_SIDE", "DK_SIDE"))
    return _GRADS_KERNEL_NAMES.get(sides, "_grads_kernel")


@triton.jit(repr=_grads_kernel_name)
def _grads_kernel(
    Q, K_, V_, G_IN, B_IN, A_LOG, DT_BIAS, CU, CHUNK_INFO,
    GC, A, HS, DHS, VN, DVN, DO, SCRATCH, DGC_PART,
    DQ, DK, DQP, DKP, DV, DG, DB, DA_LOG_PART, DDT_PART,
    T, NT, HV, K, V, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    GROUP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, GATE: tl.constexpr,
    ROUND_BETA: tl.constexpr, VARLEN: tl.constexpr, IEEE: tl.constexpr, DQ_SIDE: tl.constexpr,
    DK_SIDE: tl.constexpr, CHUNKS: tl.constexpr = 0,
):
    """One (chunk, value head): every input gradient of the chunk. dq, dk: final (with the l2norm backward) when
    each key head has one value head, else fp32 partials per value head summed by `_group_reduce_kernel`.
    First a loop over V blocks of BV (sums over V, dv), then the [64, 64] and [64, K] remainder.
    DQ_SIDE and DK_SIDE: the whole kernel. Or split in two kernels launched one after the other, each with fewer
    fp32 sums over V live (the whole kernel holds five: ~128 registers a thread at 8 warps):
    - DQ_SIDE alone: the sums do h^T, do v'^T; dq and its terms of dg (dgc), which it stores (fp32, DGC_PART) with
      the scratch tile of the (s dM Gamma)^T qn term of dk;
    - DK_SIDE alone: the sums v' dh^T, dv' h^T, dv' v^T, h . dh and dv, then dk, dbeta, dg and the gate's partial
      sums, from dgc and the scratch tile that the first half stored.
    The halves do the whole kernel's operations in its order: the same gradients (bitwise under the interpreter).
    CHUNKS: 0 every chunk; 1 the 64-row chunks only, with row masks the compiler knows to be all true; 2 the
    shorter (last) chunks only. A length read from cu_seqlens leaves the compiler nothing to know of the masks, and
    the dk half then spills more (0.90 against 0.73 ms dense at 8 x 1024, H100): packed input runs 1, then 2."""
    slot = tl.program_id(0)
    i_bh = tl.program_id(1)
    hv = i_bh % HV
    hk = hv // GROUP
    n, it, bos, seqlen, chunk = _chunk_coords(slot, i_bh, HV, CU, CHUNK_INFO, T, NT, VARLEN)
    program = slot.to(tl.int64) * tl.num_programs(1) + i_bh  # (slot, batch, value head)
    if n < 0:  # a chunk slot no sequence of the packed input uses: zero partial sums of the gate parameters
        if VARLEN and DK_SIDE and GATE:
            tl.store(DA_LOG_PART + program, 0.0)
            tl.store(DDT_PART + program, 0.0)
        return
    t0 = it * 64
    row0 = bos + t0
    o_c = tl.arange(0, 64)
    o_k = tl.arange(0, BK)
    if CHUNKS == 1:
        if t0 + 64 > seqlen:
            return
        m_c = tl.full([64], 1, tl.int1)
        last = 63
    else:
        if CHUNKS == 2:
            if t0 + 64 <= seqlen:
                return
        m_c = t0 + o_c < seqlen
        last = tl.minimum(t0 + 63, seqlen - 1) - t0
    m_k = o_k < K
    DT = Q.dtype.element_ty
    qk_mask = m_c[:, None] & m_k[None, :]
    strict = (o_c[:, None] > o_c[None, :]) & m_c[:, None] & m_c[None, :]
    incl = (o_c[:, None] >= o_c[None, :]) & m_c[:, None] & m_c[None, :]
    scratch = SCRATCH + program * 2 * 64 * 64
    cc = o_c[:, None] * 64 + o_c[None, :]
    cc_t = o_c[None, :] * 64 + o_c[:, None]
    gate_base = row0 * HV + hv
    g_raw, beta = _gate(G_IN, B_IN, A_LOG, DT_BIAS, gate_base + o_c * HV, m_c, hv, GATE, ROUND_BETA)
    gc = tl.load(GC + gate_base + o_c * HV, mask=m_c, other=0.0)
    g_last = tl.load(GC + gate_base + last * HV)
    Gd = tl.where(m_c, tl.exp(gc), 0.0)
    e = tl.where(m_c, tl.exp(g_last - gc), 0.0)
    if DK_SIDE:  # T^T through transposed pointers
        Tt = tl.load(A + gate_base * 64 + o_c[None, :] * (HV * 64) + o_c[:, None], mask=m_c[None, :], other=0.0)
    state = (chunk * HV + hv) * K * V
    v_base = gate_base * V
    # the sums over V, one [64, BV] block of do, v', dv', v and [BV, BK] block of h^T, dh^T at a time
    if DQ_SIDE:
        do_h = tl.zeros([64, BK], dtype=tl.float32)   # do h^T
        dM = tl.zeros([64, 64], dtype=tl.float32)     # do v'^T
    if DK_SIDE:
        vn_dh = tl.zeros([64, BK], dtype=tl.float32)  # v' dh^T
        dvn_h = tl.zeros([64, BK], dtype=tl.float32)  # dv' h^T
        dvn_v = tl.zeros([64, 64], dtype=tl.float32)  # dv' v^T
        dbeta = tl.zeros([64], dtype=tl.float32)
        hdh = tl.zeros([BK], dtype=tl.float32)        # sum_v h * dh, for the chunk's total decay
    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        m_v = o_v < V
        vmask = m_c[:, None] & m_v[None, :]
        vv_tile = o_c[:, None] * (HV * V) + o_v[None, :]
        # h^T and dh^T (state at the chunk start, its gradient at the chunk end) through transposed pointers
        state_t_tile = o_k[None, :] * V + o_v[:, None]
        state_t_mask = m_v[:, None] & m_k[None, :]
        hs_t = tl.load(HS + state + state_t_tile, mask=state_t_mask, other=0.0)
        if DK_SIDE:
            dhs_t = tl.load(DHS + state + state_t_tile, mask=state_t_mask, other=0.0)
        if DQ_SIDE:
            do = tl.load(DO + v_base + vv_tile, mask=vmask, other=0.0)
        vn = tl.load(VN + v_base + vv_tile, mask=vmask, other=0.0)
        if DK_SIDE:
            dvn = tl.load(DVN + v_base + vv_tile, mask=vmask, other=0.0)
            vv = tl.load(V_ + row0 * stride_vt + hv * stride_vh + o_c[:, None] * stride_vt + o_v[None, :],
                         mask=vmask, other=0.0)
        if DQ_SIDE:
            do_h = _dot(do, hs_t, IEEE, do_h)
            dM = _dot(do, tl.trans(vn), IEEE, dM)
        if DK_SIDE:
            vn_dh = _dot(vn, dhs_t, IEEE, vn_dh)
            hdh += tl.sum(hs_t.to(tl.float32) * dhs_t.to(tl.float32), 0)
            # u = T diag(beta) v: dv = diag(beta) T^T dv', final per block
            dvb = _dot(Tt, dvn, IEEE)
            tl.store(DV + row0 * stride_dvt + hv * stride_dvh + o_c[:, None] * stride_dvt + o_v[None, :],
                     (dvb * beta[:, None]).to(DV.dtype.element_ty), mask=vmask)
            dbeta += tl.sum(dvb * vv.to(tl.float32), 1)
            dvn_v = _dot(dvn, tl.trans(vv), IEEE, dvn_v)
            dvn_h = _dot(dvn, hs_t, IEEE, dvn_h)
    if DK_SIDE:  # w = T diag(beta G) k, v' = u - w h: dw = -dv' h^T
        dw = (-dvn_h).to(DT)
    # raw q, k (input dtype) and their l2norm scales rq, rk: qn = diag(rq) q, kn = diag(rk) k are never rounded
    # to 16 bits (that rounding was the largest error in dg, hence in dA_log, ddt_bias); the scales go on the other
    # factor of each product (q k^T, k k^T are exact dots of the raw inputs) and on the fp32 row sums
    q = tl.load(Q + row0 * stride_qt + hk * stride_qh + o_c[:, None] * stride_qt + o_k[None, :], mask=qk_mask,
                other=0.0)
    k = tl.load(K_ + row0 * stride_kt + hk * stride_kh + o_c[:, None] * stride_kt + o_k[None, :], mask=qk_mask,
                other=0.0)
    rq = _l2norm_scale(q, 1, L2NORM)
    rk = _l2norm_scale(k, 1, L2NORM)
    part_tile = (gate_base * K) + o_c[:, None] * (HV * K) + o_k[None, :]
    if DQ_SIDE:  # o = s diag(G) q h + M v'
        gam = _decay_block(gc, gc, m_c, m_c, False, o_c, o_c)
        dq = (scale * Gd)[:, None] * do_h
        dgc = rq * tl.sum(dq * q.to(tl.float32), 1)
        att = (scale * rq)[:, None] * _dot(q, tl.trans(k), IEEE) * (rk[None, :] * gam)  # s (qn kn^T) Gamma
        dM = tl.where(incl, dM, 0.0)
        dgc += tl.sum(dM * att, 1) - tl.sum(dM * att, 0)
        dqk = scale * dM * gam
        dq = _dot((dqk * rk[None, :]).to(DT), k, IEEE, dq)             # dqk kn
        tl.store(scratch + cc, (dqk * rq[:, None]).to(DT))             # dqk^T qn = (diag(rq) dqk)^T q
        _store_qk_grad(dq, q, rq, DQ + row0 * stride_dqt + hk * stride_dqh,
                       o_c[:, None] * stride_dqt + o_k[None, :], DQP + part_tile, qk_mask, GROUP, L2NORM)
        if not DK_SIDE:
            tl.store(DGC_PART + program * 64 + o_c, dgc)
    else:
        dgc = tl.load(DGC_PART + program * 64 + o_c)
    if DK_SIDE:
        # h+ = exp(g_last) h + (k e)^T v'
        dk = e[:, None] * vn_dh
        dke_row = rk * tl.sum(dk * k.to(tl.float32), 1)
        dgc -= dke_row
        dg_last = tl.sum(dke_row, 0) + tl.exp(g_last) * tl.sum(hdh, 0)
        dT = beta[None, :] * dvn_v                               # dv' (beta v)^T
        bG = beta * Gd
        dT = (bG * rk)[None, :] * _dot(dw, tl.trans(k), IEEE) + dT    # + dw (beta G kn)^T
        dkbg = _dot(Tt, dw, IEEE)                                # T^T dw
        dkbg_k = rk * tl.sum(dkbg * k.to(tl.float32), 1)
        dbeta += Gd * dkbg_k
        dgc += bG * dkbg_k
        dk += bG[:, None] * dkbg
        # T = (I + L)^-1, L = strict(diag(beta) k k^T Gamma): dL = -T^T dT T^T
        dL = -_dot(_dot(Tt, dT.to(DT), IEEE).to(DT), Tt, IEEE)
        dL = tl.where(strict, dL, 0.0)
        # Gamma, computed again here: not live through the dk side's first [64, K] tiles (fewer registers)
        gam = _decay_block(gc, gc, m_c, m_c, False, o_c, o_c)
        D = dL * gam
        P = rk[:, None] * _dot(k, tl.trans(k), IEEE) * rk[None, :]      # kn kn^T
        dbeta += tl.sum(D * P, 1)
        dLL = dL * (beta[:, None] * P * gam)
        dgc += tl.sum(dLL, 1) - tl.sum(dLL, 0)
        dk += beta[:, None] * _dot((D * rk[None, :]).to(DT), k, IEEE)      # D kn
        tl.store(scratch + 64 * 64 + cc, (D * (beta * rk)[:, None]).to(DT))  # (diag(beta) D)^T kn
        tl.debug_barrier()  # the two scratch tiles are written: read them transposed
        dk = _dot(tl.load(scratch + cc_t), q, IEEE, dk)               # (s dM Gamma)^T qn
        dk = _dot(tl.load(scratch + 64 * 64 + cc_t), k, IEEE, dk)     # (diag(beta) D)^T kn
        dgc = tl.where(o_c == last, dgc + dg_last, dgc)
        dgc = tl.where(m_c, dgc, 0.0)
        dg = tl.cumsum(dgc, 0, reverse=True)                     # through the within-chunk cumsum
        gate_offs = gate_base + o_c * HV
        if GATE:
            a = tl.load(G_IN + gate_offs, mask=m_c, other=0.0).to(tl.float32)
            x = a + tl.load(DT_BIAS + hv).to(tl.float32)
            dsoftplus = tl.where(x > 20.0, 1.0, tl.sigmoid(x))
            da = dg * (-tl.exp(tl.load(A_LOG + hv).to(tl.float32))) * dsoftplus
            da = tl.where(m_c, da, 0.0)
            tl.store(DG + gate_offs, da.to(DG.dtype.element_ty), mask=m_c)
            tl.store(DA_LOG_PART + program, tl.sum(dg * g_raw, 0))
            tl.store(DDT_PART + program, tl.sum(da, 0))
            tl.store(DB + gate_offs, (dbeta * beta * (1.0 - beta)).to(DB.dtype.element_ty), mask=m_c)
        else:
            tl.store(DG + gate_offs, dg.to(DG.dtype.element_ty), mask=m_c)
            tl.store(DB + gate_offs, dbeta.to(DB.dtype.element_ty), mask=m_c)
        _store_qk_grad(dk, k, rk, DK + row0 * stride_dkt + hk * stride_dkh,
                       o_c[:, None] * stride_dkt + o_k[None, :], DKP + part_tile, qk_mask, GROUP, L2NORM)


@triton.jit
def _l2norm_bwd(dy, x, r):
    """d l2norm(x) = r (dy - y (y . dy)) = r dy - r^3 (x . dy) x, y = l2norm(x) = r x (fp32 rows)."""
    return r[:, None] * dy - (r * r * r * tl.sum(x * dy, 1))[:, None] * x


@triton.jit
def _store_qk_grad(dx, x, rx, out, tile, partial, mask, GROUP: tl.constexpr, L2NORM: tl.constexpr):
    """dq or dk of a chunk, from the gradient dx of the (normalised) rows: with one value head per key head the
    final gradient at `out + tile` (with the l2norm backward), else the fp32 partial at `partial`, which
    `_group_reduce_kernel` sums over the value heads of each key head (fixed order)."""
    if GROUP > 1:
        tl.store(partial, dx, mask=mask)
    else:
        if L2NORM:
            dx = _l2norm_bwd(dx, x.to(tl.float32), rx)
        tl.store(out + tile, dx.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _group_reduce_kernel(Q, K_, DQP, DKP, DQ, DK, R, H, HV, K, stride_qt, stride_qh, stride_kt, stride_kh,
                         stride_dqt, stride_dqh, stride_dkt, stride_dkh,
                         GROUP: tl.constexpr, BK: tl.constexpr, L2NORM: tl.constexpr):
    """dq, dk of a key head = sum of its value heads' fp32 partials (fixed order), then the l2norm backward."""
    pid = tl.program_id(0)
    hk = tl.program_id(1)
    row0 = pid.to(tl.int64) * 32
    o_r = tl.arange(0, 32)
    o_k = tl.arange(0, BK)
    mask = ((row0 + o_r) < R)[:, None] & (o_k[None, :] < K)
    part = (row0 * HV + hk * GROUP) * K + o_r[:, None] * (HV * K) + o_k[None, :]
    dq = tl.zeros([32, BK], dtype=tl.float32)
    dk = tl.zeros([32, BK], dtype=tl.float32)
    for j in range(GROUP):
        dq += tl.load(DQP + part + j * K, mask=mask, other=0.0)
        dk += tl.load(DKP + part + j * K, mask=mask, other=0.0)
    if L2NORM:
        q = tl.load(Q + row0 * stride_qt + hk * stride_qh + o_r[:, None] * stride_qt + o_k[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        dq = _l2norm_bwd(dq, q, tl.rsqrt(tl.sum(q * q, 1) + 1e-6))
        k = tl.load(K_ + row0 * stride_kt + hk * stride_kh + o_r[:, None] * stride_kt + o_k[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        dk = _l2norm_bwd(dk, k, tl.rsqrt(tl.sum(k * k, 1) + 1e-6))
    tl.store(DQ + row0 * stride_dqt + hk * stride_dqh + o_r[:, None] * stride_dqt + o_k[None, :],
             dq.to(DQ.dtype.element_ty), mask=mask)
    tl.store(DK + row0 * stride_dkt + hk * stride_dkh + o_r[:, None] * stride_dkt + o_k[None, :],
             dk.to(DK.dtype.element_ty), mask=mask)

# ------------------------------------------------------------------ chunked gated delta rule: launch wrappers

# Launch settings, from `scripts/sweep_gated_delta_net.py` on H100 / H200 (triton 3.6) at Qwen3.5's 8 x 2048 tokens,
# 1 x 32768 and 8 x 1024 packed; the sweeps, and the variants measured and not adopted, are in docs/benchmarks.md
# ("Gated DeltaNet"):
# - solve: one warp (its 16 x 16 substitutions are latency-bound reductions);
# - wu: one 128-wide V block, one stage, a cap of 168 registers a thread (three programs an SM: memory-bound);
# - the serial recurrences: 64-wide V blocks at 8 warps; 32-wide blocks at 4 warps where the (sequence, value head,
#   V block) programs would not fill the GPU twice over, the backward then at 2 stages if its programs outnumber
#   the SMs; full chunks without masks where the tiles hold no padding (`unmasked`);
# - output: one 128-wide V block;
# - grads: the gradient kernel as its dq and dk halves (`split`: the one kernel holds five fp32 sums over V and
#   spills ~1 KB a thread), 64-wide V blocks, each launched over the full 64-row chunks first (`full_chunks`: row
#   masks the compiler knows, fewer spills in the dk half).

CONFIG = {
    "solve": dict(num_warps=1, num_stages=2, block_k=32),
    # maxnreg 168: three programs (12 warps) an SM instead of two at 176 registers (memory-bound; 24-52 bytes of
    # spills a thread)
    "wu": dict(num_warps=4, num_stages=1, block_v=128, maxnreg=168),
    "recurrence": dict(num_warps=8, num_stages=3, block_v=64, block_v_few=32, num_warps_few=4, unmasked=1,
                       bwd_stages_few_waves=2),
    "output": dict(num_warps=4, num_stages=2, block_v=128),
    "grads": dict(num_warps=8, num_stages=3, block_v=32, split=1, full_chunks=0),
    "grads_dq": dict(num_warps=4, num_stages=2, block_v=64, full_chunks=1),
    "grads_dk": dict(num_warps=8, num_stages=3, block_v=64, full_chunks=1),
}


def _options(cfg: dict) -> dict:
    """A family's launch options: warps, stages and, where set (non-zero), `maxnreg`, a cap on registers a thread
    (more programs an SM for a memory-bound kernel, at the price of spills; ptxas reports both for sm_90 without a
    GPU: `_wu` takes 176 a thread at 4 warps uncapped, two programs an SM)."""
    options = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if cfg.get("maxnreg") and torch.version.hip is None:  # an NVIDIA option
        options["maxnreg"] = cfg["maxnreg"]
    return options


class _Problem:
    """Shapes, launch grids and the chunk metadata of one call."""

    def __init__(self, q, v, cu_seqlens, meta):
        self.B, self.T, self.H, self.K = q.shape
        self.HV, self.V = v.shape[2], v.shape[3]
        self.group = self.HV // self.H
        self.varlen = cu_seqlens is not None
        self.rows = self.B * self.T
        if self.varlen:
            self.N = cu_seqlens.numel() - 1
            self.NT = 1
            self.slots = n_chunk_slots(self.T, self.N)
            self.chunk_info, self.chunk_offsets = meta[0], meta[1]
            self.cu = cu_seqlens
        else:
            self.N = self.B
            self.NT = triton.cdiv(self.T, CHUNK)
            self.slots = self.NT
            self.chunk_info = self.chunk_offsets = self.cu = q  # unused
        self.n_chunks = self.slots if self.varlen else self.B * self.NT  # per-chunk state slots
        self.ieee = q.dtype == torch.float32
        # 16-bit tensor-core tiles at least 64 wide: the shapes the GPU tests run at real head dims (smaller head
        # dims are padded and masked)
        self.least = 16 if self.ieee else 64
        self.BK = _block(self.K, least=self.least)
        self.sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 0

    def chunk_classes(self, full_chunks: int) -> tuple[int, ...]:
        """The `CHUNKS` launches of a kernel that takes it: (0,) one launch over every chunk; with `full_chunks`,
        (1,) where every chunk has 64 rows (dense rows of a multiple of 64), else (1, 2): the 64-row chunks, then
        the shorter ones (packed input: the lengths live on the device)."""
        if not full_chunks:
            return (0,)
        return (1,) if not self.varlen and self.T % CHUNK == 0 else (1, 2)

    def even_tiles(self, BV: int) -> bool:
        """Whether the K and V tiles of BV-wide V blocks hold no padding (the unmasked full-chunk steps)."""
        return self.K == self.BK and self.V % BV == 0

    def block_v(self, cap: int = 1 << 30) -> int:
        return _block(self.V, cap, min(self.least, cap))

    def recurrence_launch(self) -> tuple[int, int, int]:
        """(V block, warps, the backward's pipeline stages) of the serial recurrences: narrower blocks where the wide
        blocks' programs would not fill the GPU twice, unless the key lanes are padded (K < BK): there the narrow
        blocks gave non-finite gradients from `_recurrence_bwd_kernel` on an H100 (triton 3.6, K = 20, fp16 / bf16;
        not under the interpreter; the wide blocks are exact there, tests/test_gated_delta_net.py's V-block cases).
        Narrow blocks whose programs outnumber the SMs run the backward at `bwd_stages_few_waves` stages: less
        shared memory a program, two programs share an SM instead of running in two waves."""
        cfg = CONFIG["recurrence"]
        bv = self.block_v(cfg["block_v"])
        if self.K == self.BK and self.N * self.HV * triton.cdiv(self.V, bv) < 2 * self.sms:
            bv = self.block_v(cfg["block_v_few"])
            waves = self.N * self.HV * triton.cdiv(self.V, bv) > self.sms
            return bv, cfg["num_warps_few"], cfg["bwd_stages_few_waves"] if waves else cfg["num_stages"]
        return bv, cfg["num_warps"], cfg["num_stages"]


def _solve(p: _Problem, k, g_in, b_in, A_log, dt_bias, l2norm):
    """(A = T per chunk (rows, HV, 64) in k's dtype, within-chunk cumulative decay (rows, HV) fp32)."""
    gate = A_log is not None
    gc = torch.empty(p.rows, p.HV, dtype=torch.float32, device=k.device)
    A = torch.empty(p.rows, p.HV, CHUNK, dtype=k.dtype, device=k.device)
    cfg = CONFIG["solve"]
    launch(_solve_kernel, (p.slots, p.B * p.HV), k, g_in, b_in, A_log if gate else g_in, dt_bias if gate else g_in,
           p.cu, p.chunk_info, gc, A, p.T, p.NT, p.HV, p.K, k.stride(1), k.stride(2), GROUP=p.group,
           BKC=min(p.BK, cfg["block_k"]), L2NORM=l2norm, GATE=gate, ROUND_BETA=gate and b_in.dtype != torch.float32,
           VARLEN=p.varlen, IEEE=p.ieee, **_options(cfg))
    return A, gc


def _wu(p: _Problem, q, k, v, g_in, b_in, A_log, dt_bias, A, gc, scale, l2norm, with_m=False):
    """(w in k's dtype, u fp32, the key rows' l2norm scales rk (HV, rows) fp32 (unused without l2norm), and
    `with_m` (the backward) the intra-chunk attention M (rows, HV, 64) in k's dtype, else None) from T."""
    dev, dt = k.device, k.dtype
    gate = A_log is not None
    w = torch.empty(p.rows, p.HV, p.K, dtype=dt, device=dev)
    u = torch.empty(p.rows, p.HV, p.V, dtype=torch.float32, device=dev)
    rk = torch.empty(p.HV, p.rows, dtype=torch.float32, device=dev) if l2norm else gc
    M = torch.empty(p.rows, p.HV, CHUNK, dtype=dt, device=dev) if with_m else None
    cfg = CONFIG["wu"]
    launch(_wu_kernel, (p.slots, p.B * p.HV), q, k, v, g_in, b_in, A_log if gate else g_in,
           dt_bias if gate else g_in, p.cu, p.chunk_info, gc, A, w, u, rk,
           M if with_m else u, p.T, p.NT, p.HV, p.K, p.V, p.rows, scale, q.stride(1), q.stride(2),
           k.stride(1), k.stride(2), v.stride(1), v.stride(2), GROUP=p.group, BK=p.BK,
           BV=p.block_v(cfg["block_v"]), L2NORM=l2norm, GATE=gate, ROUND_BETA=gate and b_in.dtype != torch.float32,
           VARLEN=p.varlen, IEEE=p.ieee, M_OUT=with_m, **_options(cfg))
    return w, u, rk, M


def _recurrence_fwd(p, k, w, u, gc, rk, h0, l2norm, output_final_state, vn_dtype):
    """(fp32 final state or an unused tensor, the state at each chunk's start in w's dtype, v' in vn_dtype): the
    serial recurrence."""
    dev, dt = w.device, w.dtype
    cfg = CONFIG["recurrence"]
    BV, warps, _ = p.recurrence_launch()
    ht = torch.empty(p.N, p.HV, p.K, p.V, dtype=torch.float32, device=dev) if output_final_state else w
    hs = torch.empty(p.n_chunks, p.HV, p.K, p.V, dtype=dt, device=dev)
    vn = torch.empty(p.rows, p.HV, p.V, dtype=vn_dtype, device=dev)
    launch(_recurrence_fwd_kernel, (triton.cdiv(p.V, BV), p.N * p.HV), k, w, u, gc, rk,
           h0 if h0 is not None else w, p.cu, p.chunk_offsets, ht, hs, vn,
           p.T, p.HV, p.K, p.V, p.rows, k.stride(1), k.stride(2), GROUP=p.group, BK=p.BK, BV=BV, USE_H0=h0 is not None,
           STORE_FINAL=output_final_state, L2NORM=l2norm, VARLEN=p.varlen, IEEE=p.ieee,
           EVEN=p.even_tiles(BV) and bool(cfg["unmasked"]), num_warps=warps, num_stages=cfg["num_stages"])
    return ht, hs, vn


def _output(p, q, k, hs, vn, gc, rk, scale, l2norm):
    """o (B, T, HV, V) in q's dtype from the per-chunk states and v' (chunk-parallel)."""
    cfg = CONFIG["output"]
    BV = p.block_v(cfg["block_v"])
    o = torch.empty(p.B, p.T, p.HV, p.V, dtype=q.dtype, device=q.device)
    launch(_output_kernel, (p.slots, p.B * p.HV, triton.cdiv(p.V, BV)), q, k, hs, vn, gc, rk, p.cu, p.chunk_info,
           o, p.T, p.NT, p.HV, p.K, p.V, p.rows, scale, q.stride(1), q.stride(2), k.stride(1), k.stride(2),
           GROUP=p.group, BK=p.BK, BV=BV, L2NORM=l2norm, VARLEN=p.varlen, IEEE=p.ieee, **_options(cfg))
    return o


def chunk_fwd(q, k, v, g_in, b_in, A_log, dt_bias, h0, cu_seqlens, meta, scale: float, l2norm: bool,
              output_final_state: bool):
    """Forward of the chunked rule: (o (B, T, HV, V) in q's dtype, fp32 final state or an unused tensor, and the
    WY matrices T and the cumulative decays, which the backward takes instead of solving again)."""
    q, k, v, g_in, b_in = _rule_inputs(q, k, v, g_in, b_in)
    p = _Problem(q, v, cu_seqlens, meta)
    A, gc = _solve(p, k, g_in, b_in, A_log, dt_bias, l2norm)
    w, u, rk, _ = _wu(p, q, k, v, g_in, b_in, A_log, dt_bias, A, gc, scale, l2norm)
    ht, hs, vn = _recurrence_fwd(p, k, w, u, gc, rk, h0, l2norm, output_final_state, torch.float32)
    del w, u
    return _output(p, q, k, hs, vn, gc, rk, scale, l2norm), ht, A, gc


def chunk_bwd(do, dht, q, k, v, g_in, b_in, A_log, dt_bias, h0, cu_seqlens, meta, scale: float, l2norm: bool,
              dq=None, dk=None, dv=None, A=None, gc=None):
    """Backward of the chunked rule (recomputes w, u, M and the per-chunk states; T and the decays come from the
    forward, or are solved again when not given). `dq`, `dk`, `dv` may be given as (strided) output views.
    Returns dq, dk, dv, d(g or a), d(beta or b), dA_log, ddt_bias (None without the gate), dh0 (fp32, None
    without an initial state)."""
    q, k, v, g_in, b_in = _rule_inputs(q, k, v, g_in, b_in)
    p = _Problem(q, v, cu_seqlens, meta)
    dev, dt = q.device, q.dtype
    gate = A_log is not None
    if A is None or gc is None:
        A, gc = _solve(p, k, g_in, b_in, A_log, dt_bias, l2norm)
    w, u, rk, M = _wu(p, q, k, v, g_in, b_in, A_log, dt_bias, A, gc, scale, l2norm, with_m=True)
    _, hs, vn = _recurrence_fwd(p, k, w, u, gc, rk, h0, l2norm, False, dt)
    del u
    cfg = CONFIG["recurrence"]
    BV, warps, bwd_stages = p.recurrence_launch()
    dhs = torch.empty_like(hs)
    dvn = torch.empty_like(vn)
    dh0 = torch.empty(p.N, p.HV, p.K, p.V, dtype=torch.float32, device=dev) if h0 is not None else None
    launch(_recurrence_bwd_kernel, (triton.cdiv(p.V, BV), p.N * p.HV), q, k, w, gc, M, do,
           dht if dht is not None else w, p.cu, p.chunk_offsets, dh0 if dh0 is not None else w, dhs, dvn,
           p.T, p.HV, p.K, p.V, scale, q.stride(1), q.stride(2), k.stride(1), k.stride(2), GROUP=p.group, BK=p.BK,
           BV=BV, USE_DHT=dht is not None, STORE_DH0=dh0 is not None, L2NORM=l2norm, VARLEN=p.varlen, IEEE=p.ieee,
           EVEN=p.even_tiles(BV) and bool(cfg["unmasked"]), num_warps=warps, num_stages=bwd_stages)
    del w, M
    # the given output views where they have the row layout, else new buffers copied into them at the end
    given = (dq, dk, dv)
    views = [_token_rows(d) if d is not None else None for d in given]
    dq, dk, dv = (view if view is not None else torch.empty(x.shape, dtype=x.dtype, device=dev)
                  for view, x in zip(views, (q, k, v)))
    dg = torch.empty_like(g_in)
    db = torch.empty_like(b_in)
    n_programs = p.slots * p.B * p.HV
    scratch = torch.empty(n_programs * 2 * CHUNK * CHUNK, dtype=dt, device=dev)
    dA_part = torch.empty(n_programs if gate else 1, dtype=torch.float32, device=dev)
    ddt_part = torch.empty(n_programs if gate else 1, dtype=torch.float32, device=dev)
    grouped = p.group > 1
    dq_part = torch.empty(p.rows, p.HV, p.K, dtype=torch.float32, device=dev) if grouped else scratch
    dk_part = torch.empty(p.rows, p.HV, p.K, dtype=torch.float32, device=dev) if grouped else scratch
    if CONFIG["grads"]["split"]:  # dq side, then dk side (it takes the first half's dg terms: dgc_part)
        dgc_part = torch.empty(n_programs * CHUNK, dtype=torch.float32, device=dev)
        halves = ((True, False, CONFIG["grads_dq"]), (False, True, CONFIG["grads_dk"]))
    else:
        dgc_part = scratch  # unused
        halves = ((True, True, CONFIG["grads"]),)
    for dq_side, dk_side, cfg in halves:
        for chunks in p.chunk_classes(cfg["full_chunks"]):
            launch(_grads_kernel, (p.slots, p.B * p.HV), q, k, v, g_in, b_in, A_log if gate else g_in,
                   dt_bias if gate else g_in, p.cu, p.chunk_info, gc, A, hs, dhs, vn, dvn, do, scratch, dgc_part,
                   dq, dk, dq_part, dk_part, dv, dg, db, dA_part, ddt_part, p.T, p.NT, p.HV, p.K, p.V, scale,
                   q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2),
                   dq.stride(1), dq.stride(2), dk.stride(1), dk.stride(2), dv.stride(1), dv.stride(2),
                   GROUP=p.group, BK=p.BK, BV=p.block_v(cfg["block_v"]), L2NORM=l2norm, GATE=gate,
                   ROUND_BETA=gate and b_in.dtype != torch.float32, VARLEN=p.varlen, IEEE=p.ieee, DQ_SIDE=dq_side,
                   DK_SIDE=dk_side, CHUNKS=chunks, **_options(cfg))
    if grouped:
        launch(_group_reduce_kernel, (triton.cdiv(p.rows, 32), p.H), q, k, dq_part, dk_part, dq, dk, p.rows, p.H,
               p.HV, p.K, q.stride(1), q.stride(2), k.stride(1), k.stride(2), dq.stride(1), dq.stride(2),
               dk.stride(1), dk.stride(2), GROUP=p.group, BK=p.BK, L2NORM=l2norm, num_warps=4)
    dA_log = ddt_bias = None
    if gate:
        dA_log = dA_part.view(-1, p.HV).sum(0).to(A_log.dtype)
        ddt_bias = ddt_part.view(-1, p.HV).sum(0).to(dt_bias.dtype)
    for out, view, buf in zip(given, views, (dq, dk, dv)):
        if out is not None and view is None:
            out.copy_(buf)
    dq, dk, dv = (out if out is not None else buf for out, buf in zip(given, (dq, dk, dv)))
    return dq, dk, dv, dg, db, dA_log, ddt_bias, dh0
