"""Triton helpers shared by the chunked (`triton_chunk`) and token-by-token (`triton_recurrent`) gated delta
rule: the gate inputs (Qwen3.5's raw a, b, A_log, dt_bias or g, beta), the row layout of q, k, v and block sizes.
This module imports triton: import it lazily."""
import torch
import triton
import triton.language as tl

CHUNK = 64  # tokens per chunk of the chunked rule and of its varlen metadata


@triton.jit
def _softplus(x):
    """torch's softplus (threshold 20: x above it), stably: max(x, 0) + log1p(exp(-|x|)), log1p(y) as
    y log(1 + y) / ((1 + y) - 1) (exact to fp32 rounding where 1 + y rounds; y itself where 1 + y == 1)."""
    y = tl.exp(-tl.abs(x))
    u = 1.0 + y
    d = u - 1.0
    log1p = tl.where(d == 0.0, y, tl.log(u) * (y / tl.where(d == 0.0, 1.0, d)))
    return tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p)


@triton.jit
def _gate(G_IN, B_IN, A_LOG, DT_BIAS, offs, row_mask, hv, GATE: tl.constexpr, ROUND_BETA: tl.constexpr):
    """(log decay g, beta) in fp32 at element offsets `offs` of the (rows, HV) gate inputs, value head hv.
    GATE: g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b) rounded to b's dtype (transformers
    computes it in that dtype)."""
    if GATE:
        a = tl.load(G_IN + offs, mask=row_mask, other=0.0).to(tl.float32)
        x = a + tl.load(DT_BIAS + hv).to(tl.float32)
        g = -tl.exp(tl.load(A_LOG + hv).to(tl.float32)) * _softplus(x)
        beta = tl.sigmoid(tl.load(B_IN + offs, mask=row_mask, other=0.0).to(tl.float32))
        if ROUND_BETA:
            beta = beta.to(B_IN.dtype.element_ty).to(tl.float32)
    else:
        g = tl.load(G_IN + offs, mask=row_mask, other=0.0).to(tl.float32)
        beta = tl.load(B_IN + offs, mask=row_mask, other=0.0).to(tl.float32)
    return tl.where(row_mask, g, 0.0), tl.where(row_mask, beta, 0.0)

def _token_rows(t: torch.Tensor):
    """t (B, T, H, D) as the kernels index it: unit stride in D and the batches one after another on the token
    stride (row b * T + t at `row * stride(1)`), i.e. stride(0) = T * stride(1) when B > 1. A view where one
    exists (any strides with B = 1; one token per batch: the token stride set to the batch stride), else None."""
    B, T = t.shape[:2]
    if t.stride(-1) != 1:
        return None
    if B == 1 or t.stride(0) == T * t.stride(1):
        return t
    if T == 1:  # a size-1 dim's stride is arbitrary (views of the conv output have H * D there)
        return t.as_strided(t.shape, (t.stride(0), t.stride(0), *t.stride()[2:]), t.storage_offset())
    return None


def _rows_in(t: torch.Tensor) -> torch.Tensor:
    """An input in the kernels' row layout (`_token_rows`, else a contiguous copy)."""
    rows = _token_rows(t)
    return rows if rows is not None else t.contiguous()


def _rule_inputs(q, k, v, g_in, b_in):
    """The rule's inputs as the kernels index them: q, k, v by rows (`_rows_in`), the gate inputs contiguous."""
    return _rows_in(q), _rows_in(k), _rows_in(v), g_in.contiguous(), b_in.contiguous()


def _block(n: int, cap: int = 1 << 30, least: int = 16) -> int:
    return min(max(least, triton.next_power_of_2(n)), max(cap, least))
