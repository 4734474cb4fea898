"""Custom ops and the functional API: chunked gated delta rule, causal conv1d + SiLU, and the fused Qwen3.5
GatedDeltaNet core (conv -> q/k/v split -> l2norm -> gates -> delta rule).

Every forward and backward is a custom op (`hubfuse._common.custom_op`) with a fake implementation and
autograd, so `torch.compile(fullgraph=True)` sees one opaque node per call; in eager mode the same implementations
run through a plain `autograd.Function` (`differentiable_op`: less dispatcher overhead). Each op dispatches on the
tensor's device at run time: Triton on CUDA/ROCm/XPU (and on CPU under `TRITON_INTERPRET=1`), the torch reference
otherwise. Packed sequences (`cu_seqlens`) need no host synchronisation: the chunk metadata is computed on the
device from a static bound.
The backward recomputes the chunk intermediates from the inputs and the forward's WY matrices T and decays
(saved: (tokens, value heads, 64) in the input dtype and (tokens, value heads) fp32). Calls of at most
`RECURRENT_MAX_TOKENS` tokens that need no gradient (decode) run the token-by-token kernel instead (one launch).
"""
from typing import Optional

import torch
import torch.nn.functional as F

from hubfuse._common.checks import check_offsets
from hubfuse._common.device import use_triton
from hubfuse._common.custom_op import call, custom_op, differentiable_op
from .reference import (causal_conv1d_bwd_reference, causal_conv1d_fwd_reference, gdn_bwd_reference,
                        gdn_fwd_reference, gdn_gate_hf, seq_idx_reference)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256


def _empty(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0)


def _opt(t: torch.Tensor) -> Optional[torch.Tensor]:
    return t if t is not None and t.numel() > 0 else None


def _meta(cu_seqlens, total: int, check: bool):
    """Metadata of packed sequences (None without): (chunk slots, first chunk of each sequence, each token's
    sequence) on the Triton path, (None, None, each token's sequence) on the torch path. `check` (the forwards):
    cu_seqlens' values are checked first, on the device (no host sync: on a GPU inside the metadata kernel's
    launch; on CPU a ValueError)."""
    if cu_seqlens is None:
        return None
    message = f"cu_seqlens must start at 0, never decrease and end at the number of tokens ({total})"
    in_kernel = check and use_triton(cu_seqlens) and cu_seqlens.device.type != "cpu"
    if check and not in_kernel:
        check_offsets(cu_seqlens, total, message)
    if use_triton(cu_seqlens):
        from .triton_varlen import varlen_meta

        return varlen_meta(cu_seqlens, total, message if in_kernel else None)
    return None, None, seq_idx_reference(cu_seqlens, total)[0]


# ------------------------------------------------------------------ gate (Qwen3.5): torch path backward


def _gate_bwd_reference(dg, dbeta, a, b, A_log, dt_bias):
    """Chain rule through g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)."""
    x = a.float() + dt_bias.float()
    g = -A_log.float().exp() * F.softplus(x)
    dsoftplus = torch.where(x > 20, torch.ones_like(x), torch.sigmoid(x))
    da = dg.float() * (-A_log.float().exp()) * dsoftplus
    beta = b.sigmoid().float()
    db = dbeta.float() * beta * (1 - beta)
    dA_log = (dg.float() * g).sum((0, 1))
    return da.to(a.dtype), db.to(b.dtype), dA_log.to(A_log.dtype), da.sum((0, 1)).to(dt_bias.dtype)


# ------------------------------------------------------------------ chunked gated delta rule


def _gdn_fwd_impl(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, scale, l2norm, output_final_state, meta=None):
    meta = meta if meta is not None else _meta(cu_seqlens, q.shape[1], check=True)
    if use_triton(q):
        from .triton_chunk import chunk_fwd

        o, ht, A, gc = chunk_fwd(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, meta, scale, l2norm,
                                 output_final_state)
        return o, (ht if output_final_state else _empty(q)), A, gc
    if A_log is not None:
        g, beta = gdn_gate_hf(g, beta, A_log, dt_bias)
    o, ht = gdn_fwd_reference(q, k, v, g, beta, scale, h0, cu_seqlens, l2norm, output_final_state)
    return o, (ht if output_final_state else _empty(q)), _empty(q), _empty(q)


def _gdn_bwd_impl(do, dht, q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, scale, l2norm, dq=None, dk=None,
                  dv=None, meta=None, A=None, gc=None):
    """(dq, dk, dv, d(g or a), d(beta or b), dA_log, ddt_bias, dh0); absent ones are None. A, gc: the forward's
    WY matrices and cumulative decays (Triton path), solved again when not given."""
    if use_triton(q):
        from .triton_chunk import chunk_bwd

        meta = meta if meta is not None else _meta(cu_seqlens, q.shape[1], check=False)
        return chunk_bwd(do, dht, q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, meta, scale, l2norm, dq, dk, dv,
                         _opt(A), _opt(gc))
    gate = A_log is not None
    gd, bd = gdn_gate_hf(g, beta, A_log, dt_bias) if gate else (g, beta)
    rq, rk, rv, rg, rb, dh0 = gdn_bwd_reference(q, k, v, gd, bd, scale, h0, do, dht, cu_seqlens, l2norm)
    dA_log = ddt_bias = None
    if gate:
        rg, rb, dA_log, ddt_bias = _gate_bwd_reference(rg, rb, g, beta, A_log, dt_bias)
    for out, val in ((dq, rq), (dk, rk), (dv, rv)):
        if out is not None:
            out.copy_(val)
    return rq, rk, rv, rg.to(g.dtype), rb.to(beta.dtype), dA_log, ddt_bias, dh0


@custom_op("gdn_fwd")
def _gdn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], initial_state: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor], scale: float, l2norm: bool, output_final_state: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _gdn_fwd_impl(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, l2norm,
                         output_final_state)


@_gdn_fwd.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, l2norm, output_final_state):
    B, T, HV, V = v.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    ht = q.new_empty(N, HV, q.shape[-1], V, dtype=torch.float32) if output_final_state else q.new_empty(0)
    return q.new_empty(B, T, HV, V), ht, *_saved_shapes(q, v)


def _saved_shapes(q, v):
    """Fake (A, gc) the forward hands to the backward: (rows, HV, 64) in q's dtype, (rows, HV) fp32 on the
    Triton path; empty on the torch path."""
    if not use_triton(q):
        return q.new_empty(0), q.new_empty(0)
    rows, HV = q.shape[0] * q.shape[1], v.shape[2]
    return q.new_empty(rows, HV, 64), q.new_empty(rows, HV, dtype=torch.float32)


@custom_op("gdn_bwd")
def _gdn_bwd(
    do: torch.Tensor, dht: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    g: torch.Tensor, beta: torch.Tensor, A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
    initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], A: torch.Tensor, gc: torch.Tensor,
    scale: float, l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    grads = _gdn_bwd_impl(do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, l2norm,
                          A=A, gc=gc)
    return tuple(x if x is not None else _empty(q) for x in grads)


@_gdn_bwd.register_fake
def _(do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, A, gc, scale, l2norm):
    gate = A_log is not None
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), torch.empty_like(A_log) if gate else q.new_empty(0),
            torch.empty_like(dt_bias) if gate else q.new_empty(0),
            initial_state.new_empty(initial_state.shape, dtype=torch.float32) if initial_state is not None
            else q.new_empty(0))


def _gdn_setup_context(ctx, inputs, output):
    q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, scale, l2norm, output_final_state = inputs
    _, ht, A, gc = output
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, A, gc)
    ctx.scale, ctx.l2norm = scale, l2norm
    ctx.mark_non_differentiable(A, gc)
    if not output_final_state:
        ctx.mark_non_differentiable(ht)
    ctx.set_materialize_grads(False)  # else autograd fills zero gradients of A and gc (launches) that nothing reads


def _gdn_grads_out(ctx, grads, h0):
    dq, dk, dv, dg, db, dA_log, ddt_bias, dh0 = grads
    dh0 = dh0.to(h0.dtype) if h0 is not None and dh0 is not None else None
    return dq, dk, dv, dg, db, _opt(dA_log), _opt(ddt_bias), dh0, None, None, None, None


def _gdn_backward(ctx, do, dht, _dA, _dgc):
    q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, A, gc = ctx.saved_tensors
    dht = dht.contiguous() if dht is not None and dht.numel() > 0 else None
    do = do.contiguous() if do is not None else torch.zeros(v.shape, dtype=q.dtype, device=q.device)
    grads = call(ctx, _gdn_bwd, do, dht, q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, A, gc, ctx.scale,
                 ctx.l2norm)
    return _gdn_grads_out(ctx, [_opt(x) if i >= 5 else x for i, x in enumerate(grads)], h0)


_gdn = differentiable_op(_gdn_fwd, _gdn_setup_context, _gdn_backward)


# decode: a few tokens, no gradient -> the token-by-token kernel (one launch, no chunk work)
RECURRENT_MAX_TOKENS = 16


@custom_op("gdn_recurrent_fwd")
def _gdn_recurrent_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], initial_state: Optional[torch.Tensor],
    scale: float, l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(q):
        from .triton_recurrent import recurrent_fwd

        return recurrent_fwd(q, k, v, g, beta, A_log, dt_bias, initial_state, scale, l2norm)
    from .reference import recurrent_gated_delta_rule_hf

    if A_log is not None:
        g, beta = gdn_gate_hf(g, beta, A_log, dt_bias)
    n_rep = v.shape[2] // q.shape[2]
    q, k = (q.repeat_interleave(n_rep, 2), k.repeat_interleave(n_rep, 2)) if n_rep > 1 else (q, k)
    return recurrent_gated_delta_rule_hf(q, k, v, g, beta, initial_state, True, l2norm, scale)


@_gdn_recurrent_fwd.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, scale, l2norm):
    B, T, HV, V = v.shape
    return q.new_empty(B, T, HV, V), q.new_empty(B, HV, q.shape[-1], V, dtype=torch.float32)


def _wants_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _check_tensor(name, what, t, dtypes=_DTYPES):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: {what} must be a tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: {what} must be one of {', '.join(str(d) for d in dtypes)}, got {t.dtype}")


def _check_device(name, what, t, ref, ref_name="query"):
    if t.device != ref.device:
        raise ValueError(f"{name}: {what} is on {t.device} but {ref_name} on {ref.device}")


def _check_cu_seqlens(name, cu_seqlens, q, initial_state):
    """cu_seqlens' type, shape and device, on the host (its values: `_meta`, in the ops, on the device)."""
    if cu_seqlens is None:
        return
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: cu_seqlens must be an int32 or int64 tensor")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{name}: cu_seqlens must be 1-D with at least 2 entries, got {tuple(cu_seqlens.shape)}")
    _check_device(name, "cu_seqlens", cu_seqlens, q)
    if q.shape[0] != 1:
        raise ValueError(f"{name}: with cu_seqlens the batch size must be 1 (packed sequences), got {q.shape[0]}")
    if initial_state is not None and initial_state.shape[0] != cu_seqlens.numel() - 1:
        raise ValueError(f"{name}: initial_state has {initial_state.shape[0]} states for "
                         f"{cu_seqlens.numel() - 1} sequences")


def _check_gdn(name, q, k, v, g, beta, initial_state, cu_seqlens, gate_params=()):
    for what, t in (("query", q), ("key", k), ("value", v)):
        _check_tensor(name, what, t)
        if t.dim() != 4:
            raise ValueError(f"{name}: {what} must be (batch, seq, heads, head_dim), got {tuple(t.shape)}")
    _check_tensor(name, "g", g)
    _check_tensor(name, "beta", beta)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{name}: query, key and value must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if k.shape != q.shape:
        raise ValueError(f"{name}: key shape {tuple(k.shape)} does not match query {tuple(q.shape)}")
    if v.shape[:2] != (B, T):
        raise ValueError(f"{name}: value batch/seq {tuple(v.shape[:2])} do not match query {(B, T)}")
    if q.numel() == 0 or v.numel() == 0:
        raise ValueError(f"{name}: empty input (query {tuple(q.shape)}, value {tuple(v.shape)})")
    if HV % H:
        raise ValueError(f"{name}: value heads ({HV}) must be a multiple of key heads ({H})")
    if K > _MAX_HEAD_DIM or V > _MAX_HEAD_DIM:
        raise ValueError(f"{name}: head dims up to {_MAX_HEAD_DIM} are supported, got key {K}, value {V}")
    for what, t in (("g", g), ("beta", beta)):
        if t.shape != (B, T, HV):
            raise ValueError(f"{name}: {what} must be (batch, seq, value_heads) = {(B, T, HV)}, got {tuple(t.shape)}")
    for what, t in (("key", k), ("value", v), ("g", g), ("beta", beta), *gate_params):
        _check_device(name, what, t, q)
    if initial_state is not None:
        _check_tensor(name, "initial_state", initial_state)
        N = B if cu_seqlens is None else (cu_seqlens.numel() - 1 if isinstance(cu_seqlens, torch.Tensor) else -1)
        if initial_state.dim() != 4 or initial_state.shape[1:] != (HV, K, V):
            raise ValueError(f"{name}: initial_state must be (sequences, {HV}, {K}, {V}), got "
                             f"{tuple(initial_state.shape)}")
        if cu_seqlens is None and initial_state.shape[0] != N:
            raise ValueError(f"{name}: initial_state has {initial_state.shape[0]} states for batch {B}")
        _check_device(name, "initial_state", initial_state, q)
    _check_cu_seqlens(name, cu_seqlens, q, initial_state)


def _apply_gdn(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, l2norm, output_final_state):
    g, beta = g.contiguous(), beta.contiguous()
    h0 = initial_state.contiguous() if initial_state is not None else None
    cu = cu_seqlens.contiguous() if cu_seqlens is not None else None
    if cu is None and q.shape[1] <= RECURRENT_MAX_TOKENS and not _wants_grad(q, k, v, g, beta, A_log, dt_bias, h0):
        o, ht = _gdn_recurrent_fwd(q, k, v, g, beta, A_log, dt_bias, h0, float(scale), bool(l2norm))
        return o, (ht if output_final_state else None)
    args = (q, k, v, g, beta, A_log, dt_bias, h0, cu, float(scale), bool(l2norm), bool(output_final_state))
    o, ht, _, _ = _gdn(*args)
    return o, (ht if output_final_state else None)


def chunk_gated_delta_rule(q, k, v, g, beta, scale: Optional[float] = None, initial_state=None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           cu_seqlens=None):
    """Gated delta rule, chunked (transformers' / FLA's `chunk_gated_delta_rule` semantics), forward + backward.

    q, k: (B, T, H, K); v: (B, T, HV, V) with HV a multiple of H (key heads shared by HV / H value heads, not
    repeated); g: (B, T, HV) log decay (<= 0); beta: (B, T, HV). `scale` defaults to K^-0.5. With `cu_seqlens`
    (N + 1 offsets of N packed sequences) B must be 1 and `initial_state` is (N, HV, K, V). Returns o (B, T, HV, V)
    in q's dtype and the fp32 final state (N, HV, K, V) if `output_final_state`, else None. Gradients flow to
    q, k, v, g, beta and initial_state."""
    name = "chunk_gated_delta_rule"
    _check_gdn(name, q, k, v, g, beta, initial_state, cu_seqlens)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _apply_gdn(q, k, v, g, beta, None, None, initial_state, cu_seqlens, scale, use_qk_l2norm_in_kernel,
                      output_final_state)


def gated_delta_rule_qwen3_5(q, k, v, a, b, A_log, dt_bias, initial_state=None, output_final_state: bool = False,
                             cu_seqlens=None):
    """The Qwen3.5 / Qwen3-Next rule with its gates computed inside the kernels: g = -exp(A_log) softplus(a +
    dt_bias), beta = sigmoid(b); q, k l2-normalised, scale K^-0.5. a, b: (B, T, HV) raw projections; A_log,
    dt_bias: (HV,). Gradients flow to q, k, v, a, b, A_log, dt_bias and initial_state."""
    name = "gated_delta_rule_qwen3_5"
    HV = v.shape[2] if isinstance(v, torch.Tensor) and v.dim() == 4 else -1
    for what, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        _check_tensor(name, what, t)
        if t.shape != (HV,):
            raise ValueError(f"{name}: {what} must be ({HV},), got {tuple(t.shape)}")
    _check_gdn(name, q, k, v, a, b, initial_state, cu_seqlens, (("A_log", A_log), ("dt_bias", dt_bias)))
    return _apply_gdn(q, k, v, a, b, A_log.contiguous(), dt_bias.contiguous(), initial_state, cu_seqlens,
                      q.shape[-1] ** -0.5, True, output_final_state)


# ------------------------------------------------------------------ causal depthwise conv1d (+ SiLU)


def _seq_idx(cu_seqlens, total, meta, check: bool):
    """(1, total) int32: each token's sequence (None without cu_seqlens)."""
    meta = meta if meta is not None else _meta(cu_seqlens, total, check)
    return meta[2][None] if meta is not None else None


def _conv_fwd_impl(x, weight, bias, cu_seqlens, activation, meta=None):
    seq_idx = _seq_idx(cu_seqlens, x.shape[1], meta, check=True)
    if use_triton(x):
        from .triton_conv1d import conv_fwd

        return conv_fwd(x, weight, bias, seq_idx, activation, x.dtype)
    return causal_conv1d_fwd_reference(x, weight, bias, seq_idx, activation, x.dtype).contiguous()


def _conv_bwd_impl(dout, x, weight, bias, cu_seqlens, activation, meta=None):
    seq_idx = _seq_idx(cu_seqlens, x.shape[1], meta, check=False)
    if use_triton(x):
        from .triton_conv1d import conv_bwd

        return conv_bwd(dout, x, weight, bias, seq_idx, activation)
    dx, dw, db = causal_conv1d_bwd_reference(dout, x, weight, bias, seq_idx, activation)
    return dx.contiguous(), dw, db


@custom_op("conv_fwd")
def _conv_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
              cu_seqlens: Optional[torch.Tensor], activation: bool) -> torch.Tensor:
    return _conv_fwd_impl(x, weight, bias, cu_seqlens, activation)


@_conv_fwd.register_fake
def _(x, weight, bias, cu_seqlens, activation):
    return x.new_empty(x.shape)


@custom_op("conv_bwd")
def _conv_bwd(dout: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
              cu_seqlens: Optional[torch.Tensor], activation: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dw, db = _conv_bwd_impl(dout, x, weight, bias, cu_seqlens, activation)
    return dx, dw, (db if db is not None else _empty(x))


@_conv_bwd.register_fake
def _(dout, x, weight, bias, cu_seqlens, activation):
    return x.new_empty(x.shape), torch.empty_like(weight), (torch.empty_like(bias) if bias is not None
                                                            else x.new_empty(0))


def _conv_setup_context(ctx, inputs, output):
    x, weight, bias, cu_seqlens, activation = inputs
    ctx.save_for_backward(x, weight, bias, cu_seqlens)
    ctx.activation = activation


def _conv_backward(ctx, dout):
    x, weight, bias, cu_seqlens = ctx.saved_tensors
    dx, dw, db = call(ctx, _conv_bwd, dout, x, weight, bias, cu_seqlens, ctx.activation)
    return dx, dw, (db if bias is not None else None), None, None


_conv = differentiable_op(_conv_fwd, _conv_setup_context, _conv_backward)


def _activation_flag(name, activation) -> bool:
    if activation is None:
        return False
    if activation in ("silu", "swish"):
        return True
    raise ValueError(f"{name}: activation must be None, 'silu' or 'swish', got {activation!r}")


def _check_conv(name, x, weight, bias, channel_dim, x_name="hidden_states", weight_name="weight"):
    _check_tensor(name, x_name, x)
    _check_tensor(name, weight_name, weight)
    if x.dim() != 3:
        raise ValueError(f"{name}: {x_name} must be 3-D, got {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[0] != x.shape[channel_dim]:
        raise ValueError(f"{name}: {weight_name} must be (channels={x.shape[channel_dim]}, width), got "
                         f"{tuple(weight.shape)}")
    if x.numel() == 0:
        raise ValueError(f"{name}: {x_name} is empty, got {tuple(x.shape)}")
    _check_device(name, weight_name, weight, x, x_name)
    if bias is not None:
        _check_tensor(name, "bias", bias)
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"{name}: bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")
        _check_device(name, "bias", bias, x, x_name)


def causal_conv1d(x, weight, bias=None, activation=None, cu_seqlens=None):
    """Depthwise causal conv1d (+ SiLU) over channels-last x (B, S, C), weight (C, W): out[t] =
    act(sum_j w[j] x[t - W + 1 + j] + bias), zero left padding (per sequence with `cu_seqlens`, B = 1).
    Numerics of transformers' `causal_conv1d_fn` (conv rounded to the weight's dtype, then the activation).
    Returns contiguous (B, S, C) in x's dtype; forward + backward (x, weight, bias)."""
    name = "causal_conv1d"
    _check_conv(name, x, weight, bias, 2)
    act = _activation_flag(name, activation)
    if cu_seqlens is not None:
        _check_cu_seqlens(name, cu_seqlens, x, None)
        cu_seqlens = cu_seqlens.contiguous()
    weight, bias = weight.contiguous(), (bias.contiguous() if bias is not None else None)
    return _conv(x, weight, bias, cu_seqlens, act)


def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, cu_seqlens=None):
    """transformers' `causal_conv1d_fn` layout: hidden_states (B, C, S) -> (B, C, S) (a channels-last tensor seen
    channels-first: `.transpose(1, 2)` of the result is contiguous, as the GatedDeltaNet wants it)."""
    if isinstance(hidden_states, torch.Tensor) and hidden_states.dim() == 3:
        return causal_conv1d(hidden_states.transpose(1, 2), weight, bias, activation, cu_seqlens).transpose(1, 2)
    return causal_conv1d(hidden_states, weight, bias, activation, cu_seqlens)


@custom_op("conv_update", mutates_args=("conv_state",))
def _conv_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 activation: bool) -> torch.Tensor:
    if use_triton(x):
        from .triton_conv1d import conv_update

        return conv_update(x, conv_state, weight, bias, activation)
    from .reference import causal_conv1d_update_hf

    return causal_conv1d_update_hf(x, conv_state, weight, bias, "silu" if activation else None)


@_conv_update.register_fake
def _(x, conv_state, weight, bias, activation):
    return x.new_empty(x.shape)


def causal_conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None):
    """transformers' `causal_conv1d_update`: hidden_states (B, C, L) new tokens, conv_state (B, C, state_len)
    updated in place (the last state_len inputs), returns (B, C, L). One launch; when a gradient is needed
    (hidden_states, weight or bias require grad) it runs transformers' torch code instead, which autograd
    differentiates."""
    name = "causal_conv1d_update"
    _check_conv(name, hidden_states, weight, bias, 1)
    _check_tensor(name, "conv_state", conv_state)
    B, C, _ = hidden_states.shape
    if conv_state.dim() != 3 or conv_state.shape[:2] != (B, C) or conv_state.shape[2] < weight.shape[1] - 1:
        raise ValueError(f"{name}: conv_state must be ({B}, {C}, >= {weight.shape[1] - 1}), got "
                         f"{tuple(conv_state.shape)}")
    _check_device(name, "conv_state", conv_state, hidden_states, "hidden_states")
    if any(stride == 0 and size > 1 for stride, size in zip(conv_state.stride(), conv_state.shape)):
        raise ValueError(f"{name}: conv_state is updated in place: it cannot be an expanded (stride 0) view")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden_states, weight, bias)):
        from .reference import causal_conv1d_update_hf

        return causal_conv1d_update_hf(hidden_states, conv_state, weight, bias, activation)
    return _conv_update(hidden_states, conv_state, weight.contiguous(), bias.contiguous() if bias is not None else None,
                        _activation_flag(name, activation))


# ------------------------------------------------------------------ the fused Qwen3.5 GatedDeltaNet core


def _split(conv_out, num_k_heads, head_k_dim, head_v_dim):
    B, S, _ = conv_out.shape
    key_dim = num_k_heads * head_k_dim
    q = conv_out[..., :key_dim].view(B, S, num_k_heads, head_k_dim)
    k = conv_out[..., key_dim:2 * key_dim].view(B, S, num_k_heads, head_k_dim)
    v = conv_out[..., 2 * key_dim:].view(B, S, -1, head_v_dim)
    return q, k, v


def _layer_fwd_impl(mixed, conv_w, conv_b, a, b, A_log, dt_bias, cu_seqlens, num_k_heads, head_k_dim, head_v_dim):
    meta = _meta(cu_seqlens, mixed.shape[1], check=True)
    conv_out = _conv_fwd_impl(mixed, conv_w, conv_b, cu_seqlens, True, meta)
    q, k, v = _split(conv_out, num_k_heads, head_k_dim, head_v_dim)
    o, _, A, gc = _gdn_fwd_impl(q, k, v, a, b, A_log, dt_bias, None, cu_seqlens, head_k_dim ** -0.5, True, False,
                                meta)
    return o, A, gc


def _layer_bwd_impl(do, mixed, conv_w, conv_b, a, b, A_log, dt_bias, cu_seqlens, num_k_heads, head_k_dim,
                    head_v_dim, A=None, gc=None):
    meta = _meta(cu_seqlens, mixed.shape[1], check=False)
    conv_out = _conv_fwd_impl(mixed, conv_w, conv_b, cu_seqlens, True, meta)   # recomputed, not saved
    q, k, v = _split(conv_out, num_k_heads, head_k_dim, head_v_dim)
    dconv = torch.empty_like(conv_out)
    dq, dk, dv = _split(dconv, num_k_heads, head_k_dim, head_v_dim)            # the rule writes into one buffer
    _, _, _, da, db, dA_log, ddt_bias, _ = _gdn_bwd_impl(do, None, q, k, v, a, b, A_log, dt_bias, None, cu_seqlens,
                                                         head_k_dim ** -0.5, True, dq, dk, dv, meta, A, gc)
    dmixed, dconv_w, dconv_b = _conv_bwd_impl(dconv, mixed, conv_w, conv_b, cu_seqlens, True, meta)
    return dmixed, dconv_w, dconv_b, da, db, dA_log, ddt_bias


@custom_op("gdn_layer_fwd")
def _gdn_layer_fwd(mixed: torch.Tensor, conv_w: torch.Tensor, conv_b: Optional[torch.Tensor], a: torch.Tensor,
                   b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
                   num_k_heads: int, head_k_dim: int, head_v_dim: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    return _layer_fwd_impl(mixed, conv_w, conv_b, a, b, A_log, dt_bias, cu_seqlens, num_k_heads, head_k_dim,
                           head_v_dim)


@_gdn_layer_fwd.register_fake
def _(mixed, conv_w, conv_b, a, b, A_log, dt_bias, cu_seqlens, num_k_heads, head_k_dim, head_v_dim):
    B, S, _ = mixed.shape
    return (mixed.new_empty(B, S, a.shape[-1], head_v_dim),
            *_saved_shapes(mixed.new_empty(B, S, 1, 1), a.new_empty(B, S, a.shape[-1], 1)))


@custom_op("gdn_layer_bwd")
def _gdn_layer_bwd(do: torch.Tensor, mixed: torch.Tensor, conv_w: torch.Tensor, conv_b: Optional[torch.Tensor],
                   a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                   cu_seqlens: Optional[torch.Tensor], A: torch.Tensor, gc: torch.Tensor, num_k_heads: int,
                   head_k_dim: int, head_v_dim: int,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                              torch.Tensor]:
    grads = _layer_bwd_impl(do, mixed, conv_w, conv_b, a, b, A_log, dt_bias, cu_seqlens, num_k_heads, head_k_dim,
                            head_v_dim, _opt(A), _opt(gc))
    return tuple(x if x is not None else _empty(mixed) for x in grads)


@_gdn_layer_bwd.register_fake
def _(do, mixed, conv_w, conv_b, a, b, A_log, dt_bias, cu_seqlens, A, gc, num_k_heads, head_k_dim, head_v_dim):
    return (torch.empty_like(mixed), torch.empty_like(conv_w),
            torch.empty_like(conv_b) if conv_b is not None else mixed.new_empty(0), torch.empty_like(a),
            torch.empty_like(b), torch.empty_like(A_log), torch.empty_like(dt_bias))


def _layer_setup_context(ctx, inputs, output):
    mixed, conv_w, conv_b, a, b, A_log, dt_bias, cu_seqlens, H, K, V = inputs
    _, A, gc = output
    ctx.save_for_backward(mixed, conv_w, conv_b, a, b, A_log, dt_bias, cu_seqlens, A, gc)
    ctx.dims = (H, K, V)
    ctx.mark_non_differentiable(A, gc)
    ctx.set_materialize_grads(False)  # no zero gradients of A and gc


def _layer_backward(ctx, do, _dA, _dgc):
    mixed, conv_w, conv_b, a, b, A_log, dt_bias, cu_seqlens, A, gc = ctx.saved_tensors
    if do is None:  # the output was not used: every gradient is zero
        return (None,) * 11
    dmixed, dw, db_conv, da, db, dA_log, ddt = call(ctx, _gdn_layer_bwd, do.contiguous(), mixed, conv_w, conv_b, a,
                                                    b, A_log, dt_bias, cu_seqlens, A, gc, *ctx.dims)
    return dmixed, dw, (db_conv if conv_b is not None else None), da, db, dA_log, ddt, None, None, None, None


_gdn_layer = differentiable_op(_gdn_layer_fwd, _layer_setup_context, _layer_backward)


def gated_delta_net_core(mixed_qkv, conv_weight, conv_bias, a, b, A_log, dt_bias, num_k_heads: int,
                         head_k_dim: int, head_v_dim: int, cu_seqlens=None):
    """Everything of Qwen3.5's GatedDeltaNet between the input projections and the gated norm, in one op:
    causal conv1d + SiLU over mixed_qkv (B, S, 2 * H * K + HV * V), split into q, k, v (views, no copies),
    q/k l2norm, beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), the chunked delta rule (zero initial
    state). Returns core_attn_out (B, S, HV, V). Saved for the backward: the inputs and the rule's WY matrices and
decays; the conv output is recomputed."""
    name = "gated_delta_net_core"
    _check_conv(name, mixed_qkv, conv_weight, conv_bias, 2, "mixed_qkv", "conv_weight")
    B, S, C = mixed_qkv.shape
    key_dim = num_k_heads * head_k_dim
    HV = (C - 2 * key_dim) // head_v_dim
    if HV <= 0 or 2 * key_dim + HV * head_v_dim != C:
        raise ValueError(f"{name}: mixed_qkv width {C} is not 2 * {num_k_heads} * {head_k_dim} + value heads * "
                         f"{head_v_dim}")
    if HV % num_k_heads:
        raise ValueError(f"{name}: value heads ({HV}) must be a multiple of key heads ({num_k_heads})")
    if max(head_k_dim, head_v_dim) > _MAX_HEAD_DIM:
        raise ValueError(f"{name}: head dims up to {_MAX_HEAD_DIM} are supported, got head_k_dim {head_k_dim}, "
                         f"head_v_dim {head_v_dim} (the heads of mixed_qkv)")
    for what, t, shape in (("a", a, (B, S, HV)), ("b", b, (B, S, HV)), ("A_log", A_log, (HV,)),
                           ("dt_bias", dt_bias, (HV,))):
        _check_tensor(name, what, t)
        if t.shape != shape:
            raise ValueError(f"{name}: {what} must be {shape}, got {tuple(t.shape)}")
        _check_device(name, what, t, mixed_qkv, "mixed_qkv")
    _check_cu_seqlens(name, cu_seqlens, mixed_qkv, None)
    mixed_qkv = mixed_qkv if mixed_qkv.stride(-1) == 1 else mixed_qkv.contiguous()
    conv_bias = conv_bias.contiguous() if conv_bias is not None else None
    cu_seqlens = cu_seqlens.contiguous() if cu_seqlens is not None else None
    args = (mixed_qkv, conv_weight.contiguous(), conv_bias, a.contiguous(), b.contiguous(), A_log.contiguous(),
            dt_bias.contiguous(), cu_seqlens, int(num_k_heads), int(head_k_dim), int(head_v_dim))
    return _gdn_layer(*args)[0]


__all__ = ["chunk_gated_delta_rule", "gated_delta_rule_qwen3_5", "causal_conv1d", "causal_conv1d_fn",
           "causal_conv1d_update", "gated_delta_net_core"]
