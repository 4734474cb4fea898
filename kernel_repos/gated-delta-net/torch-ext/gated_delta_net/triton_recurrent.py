"""Triton kernel of the gated delta rule token by token (decode, no backward). This module imports triton:
import it lazily."""
import torch
import triton
import triton.language as tl

from hubfuse._common.launch import launch

from .triton_common import _block, _gate, _rule_inputs


@triton.jit
def _recurrent_kernel(Q, K_, V_, G_IN, B_IN, A_LOG, DT_BIAS, H0, O, HT, T, H, HV, K, V, scale,
                      stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                      GROUP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
                      GATE: tl.constexpr, ROUND_BETA: tl.constexpr, USE_H0: tl.constexpr):
    """transformers' recurrent form, one launch for a few tokens (decode): per token, h <- exp(g) h;
    h += k (beta (v - k^T h)); o = (s q)^T h. No per-chunk work, fp32 state in registers."""
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    b = (i_bh // HV).to(tl.int64)
    hv = i_bh % HV
    hk = hv // GROUP
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    state_offs = (i_bh.to(tl.int64) * K + o_k[:, None]) * V + o_v[None, :]
    if USE_H0:
        h = tl.load(H0 + state_offs, mask=m_k[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    else:
        h = tl.zeros([BK, BV], dtype=tl.float32)
    zero = tl.zeros([1], dtype=tl.int32)
    for t in range(T):
        q = tl.load(Q + b * stride_qb + t * stride_qt + hk * stride_qh + o_k, mask=m_k, other=0.0).to(tl.float32)
        k = tl.load(K_ + b * stride_kb + t * stride_kt + hk * stride_kh + o_k, mask=m_k, other=0.0).to(tl.float32)
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6)
            k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
        v = tl.load(V_ + b * stride_vb + t * stride_vt + hv * stride_vh + o_v, mask=m_v, other=0.0).to(tl.float32)
        g, beta = _gate(G_IN, B_IN, A_LOG, DT_BIAS, zero + (b * T + t) * HV + hv, zero == 0, hv, GATE, ROUND_BETA)
        h = h * tl.exp(tl.sum(g, 0))
        delta = (v - tl.sum(h * k[:, None], 0)) * tl.sum(beta, 0)
        h = h + k[:, None] * delta[None, :]
        o = tl.sum(h * (q * scale)[:, None], 0)
        tl.store(O + ((b * T + t) * HV + hv) * V + o_v, o.to(O.dtype.element_ty), mask=m_v)
    tl.store(HT + state_offs, h, mask=m_k[:, None] & m_v[None, :])


def recurrent_fwd(q, k, v, g_in, b_in, A_log, dt_bias, h0, scale: float, l2norm: bool):
    """The rule token by token (no backward): (o (B, T, HV, V) in q's dtype, fp32 final state)."""
    q, k, v, g_in, b_in = _rule_inputs(q, k, v, g_in, b_in)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BV = _block(V, 64)
    gate = A_log is not None
    o = torch.empty(B, T, HV, V, dtype=q.dtype, device=q.device)
    ht = torch.empty(B, HV, K, V, dtype=torch.float32, device=q.device)
    launch(_recurrent_kernel, (triton.cdiv(V, BV), B * HV), q, k, v, g_in, b_in, A_log if gate else g_in,
           dt_bias if gate else g_in, h0 if h0 is not None else ht, o, ht, T, H, HV, K, V, scale,
           q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
           v.stride(0), v.stride(1), v.stride(2), GROUP=HV // H, BK=_block(K), BV=BV, L2NORM=l2norm, GATE=gate,
           ROUND_BETA=gate and b_in.dtype != torch.float32, USE_H0=h0 is not None, num_warps=4)
    return o, ht
