"""Torch reference path: transformers' numerics for the forward, and the chunked analytic backward.

- `*_hf` functions are the Qwen3.5 / Qwen3-Next torch code of transformers 5.22.2 (same math, same cast order):
  the Layouts' `forward` and the CPU path of the custom ops use them.
- `gdn_fwd_reference` / `gdn_bwd_reference` extend the HF chunked rule with what the custom ops support (key
  heads shared by several value heads, packed sequences, any scale) and give its gradients in closed form,
  chunk by chunk, in the same decomposition as the Triton kernels (the spec they implement).
- `causal_conv1d_*_reference`: depthwise causal conv + SiLU, forward and backward, sequence-aware.

Notation of the chunked rule (chunk of C = 64 tokens, per value head; `g` is the within-chunk cumulative log
decay, `G = exp(g)`, `Gamma_ij = exp(g_i - g_j)`, `s` the query scale):
  T   = (I + strict_lower(beta_i k_i.k_j Gamma_ij))^-1        (the WY / UT transform)
  w   = T (beta G k),  u = T (beta v)
  v'  = u - w h                                               (h: state at the chunk start, K x V)
  o   = s (q G) h + M v',  M = s tril(q k^T * Gamma)           (diagonal included)
  h+  = G_last h + (k exp(g_last - g))^T v'
"""
import torch
import torch.nn.functional as F

CHUNK = 64
L2NORM_EPS = 1e-6


# ------------------------------------------------------------------ transformers' torch path


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = L2NORM_EPS) -> torch.Tensor:
    """`x * rsqrt(sum(x^2) + eps)` (transformers' / FLA's l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def _prepare_hf(query, key, value, g, beta, use_qk_l2norm_in_kernel, scale, compute_dtype):
    """(q * scale, k, v, beta, g) as (B, H, T, .) tensors in compute_dtype (transformers: fp32), q and k
    l2-normalised if asked."""
    query, key, value, beta, g = [x.transpose(1, 2).to(compute_dtype, memory_format=torch.contiguous_format)
                                  for x in (query, key, value, beta, g)]
    if use_qk_l2norm_in_kernel:
        query, key = l2norm(query), l2norm(key)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return query * scale, key, value, beta, g


def chunk_gated_delta_rule_hf(query, key, value, g, beta, chunk_size: int = CHUNK, initial_state=None,
                              output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                              scale=None, compute_dtype=torch.float32, **kwargs):
    """transformers' `torch_chunk_gated_delta_rule` (q, k: (B, T, H, K), v: (B, T, H, V), g, beta: (B, T, H)).
    Returns (o in q's dtype, final state (B, H, K, V) in compute_dtype, or None). `compute_dtype=torch.float64`
    gives the float64 run of the same code (transformers hard-codes fp32)."""
    out_dtype = query.dtype
    B, T, _, K = key.shape
    H, V = value.shape[-2:]
    q, k, v, beta, g = _prepare_hf(query, key, value, g, beta, use_qk_l2norm_in_kernel, scale, compute_dtype)
    pad = (chunk_size - T % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    n_chunks = (T + pad) // chunk_size
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(B, H, n_chunks, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(B, H, n_chunks, chunk_size).cumsum(dim=-1)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * decay
    attn = (q @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(ut, k_beta * g.exp().unsqueeze(-1), upper=False, unitriangular=True)
    state = (torch.zeros(B, H, K, V, dtype=u.dtype, device=u.device) if initial_state is None
             else initial_state.to(u))
    out = torch.zeros_like(u)
    q = q * g.exp().unsqueeze(-1)
    k = k * (g[..., -1:] - g).exp().unsqueeze(-1)
    chunk_decay = g[..., -1].exp()[..., None, None]
    for i in range(n_chunks):
        v_new = u[:, :, i] - w[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + attn[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(B, H, -1, V)[:, :, :T].transpose(1, 2).to(out_dtype, memory_format=torch.contiguous_format)
    return out, (state if output_final_state else None)


def recurrent_gated_delta_rule_hf(query, key, value, g, beta, initial_state=None, output_final_state: bool = False,
                                  use_qk_l2norm_in_kernel: bool = False, scale=None, compute_dtype=torch.float32,
                                  **kwargs):
    """transformers' `torch_recurrent_gated_delta_rule`: the token-by-token recurrence (decode path)."""
    out_dtype = query.dtype
    B, T, _, K = key.shape
    H, V = value.shape[-2:]
    q, k, v, beta, g = _prepare_hf(query, key, value, g, beta, use_qk_l2norm_in_kernel, scale, compute_dtype)
    state = (torch.zeros(B, H, K, V, dtype=v.dtype, device=v.device) if initial_state is None
             else initial_state.to(v))
    out = torch.zeros_like(v)
    for i in range(T):
        state = state * g[:, :, i].exp()[..., None, None]
        kv_mem = (state * k[:, :, i].unsqueeze(-1)).sum(dim=-2)
        delta = (v[:, :, i] - kv_mem) * beta[:, :, i].unsqueeze(-1)
        state = state + k[:, :, i].unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, i] = (state * q[:, :, i].unsqueeze(-1)).sum(dim=-2)
    out = out.transpose(1, 2).contiguous().to(out_dtype)
    return out, (state if output_final_state else None)


def _activation(x, activation):
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise ValueError(f"unsupported activation {activation!r} (None, 'silu' or 'swish')")


def causal_conv1d_fn_hf(hidden_states, weight, bias=None, activation=None, **kwargs):
    """transformers' `causal_conv1d_fn`: hidden_states (B, C, S), weight (C, W); conv in weight's dtype."""
    _, channels, seq_len = hidden_states.shape
    out = F.conv1d(hidden_states.to(weight.dtype), weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1,
                   groups=channels)[:, :, :seq_len]
    return _activation(out, activation).to(hidden_states.dtype)


def causal_conv1d_update_hf(hidden_states, conv_state, weight, bias=None, activation=None):
    """transformers' `causal_conv1d_update`: one (or a few) new tokens, `conv_state` (B, C, L) updated in place."""
    _, channels, seq_len = hidden_states.shape
    state_len = conv_state.shape[-1]
    full = torch.cat([conv_state, hidden_states], dim=-1).to(weight.dtype)
    conv_state.copy_(full[:, :, -state_len:])
    out = F.conv1d(full, weight.unsqueeze(1), bias, padding=0, groups=channels)[:, :, -seq_len:]
    return _activation(out, activation).to(hidden_states.dtype)


def gdn_gate_hf(a, b, A_log, dt_bias):
    """transformers' `beta = b.sigmoid()`, `g = -exp(A_log) * softplus(a + dt_bias)` (fp32 g)."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


# ------------------------------------------------------------------ the custom ops' reference (any layout)


def _sequences(x, cu_seqlens):
    """Per-sequence (1, L, ...) slices of a (1, T_total, ...) packed tensor, or the batch as one piece."""
    if cu_seqlens is None:
        return [x]
    bounds = cu_seqlens.tolist()
    return [x[:, s:e] for s, e in zip(bounds[:-1], bounds[1:])]


def _expand_heads(x, n_rep):
    return x.repeat_interleave(n_rep, dim=2) if n_rep > 1 else x


def gdn_fwd_reference(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm, output_final_state,
                      compute_dtype=torch.float32):
    """Chunked gated delta rule with shared key heads (H | HV) and packed sequences, transformers' numerics.

    q, k: (B, T, H, K); v: (B, T, HV, V); g (log decay), beta: (B, T, HV). With `cu_seqlens` B is 1 and every
    sequence starts from its own initial state (N, HV, K, V). Returns (o in q's dtype, fp32 final state or None)."""
    n_rep = v.shape[2] // q.shape[2]
    q, k = _expand_heads(q, n_rep), _expand_heads(k, n_rep)
    pieces = list(zip(*[_sequences(x, cu_seqlens) for x in (q, k, v, g, beta)]))
    outs, states = [], []
    for i, (qs, ks, vs, gs, bs) in enumerate(pieces):
        h0 = None
        if initial_state is not None:
            h0 = initial_state if cu_seqlens is None else initial_state[i:i + 1]
        if qs.shape[1] == 0:  # empty sequence: the state passes through
            outs.append(qs.new_empty((*qs.shape[:3], vs.shape[-1])))
            states.append(h0.to(compute_dtype) if h0 is not None else
                          torch.zeros(1, vs.shape[2], qs.shape[-1], vs.shape[-1], dtype=compute_dtype,
                                      device=qs.device))
            continue
        o, ht = chunk_gated_delta_rule_hf(qs, ks, vs, gs, bs, initial_state=h0, output_final_state=True,
                                          use_qk_l2norm_in_kernel=use_qk_l2norm, scale=scale,
                                          compute_dtype=compute_dtype)
        outs.append(o)
        states.append(ht)
    o = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    return o, (torch.cat(states, dim=0) if output_final_state else None)


def _chunked(x, n_chunks):
    """(B, H, T_pad, ...) -> (B, H, n_chunks, C, ...)."""
    return x.reshape(*x.shape[:2], n_chunks, CHUNK, *x.shape[3:])


def _gdn_bwd_one(q, k, v, g, beta, scale, h0, do, dht, use_qk_l2norm):
    """Analytic gradients of one batch of equal-length sequences, head counts already equal.
    Inputs (B, T, H, .) in any float dtype; math in fp32 (fp64 for fp64 inputs). Returns dq, dk, dv, dg, dbeta,
    dh0 in the compute dtype."""
    ct = torch.promote_types(q.dtype, torch.float32)
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, do = (x.transpose(1, 2).to(ct) for x in (q, k, v, do))
    g, beta = g.transpose(1, 2).to(ct), beta.transpose(1, 2).to(ct)
    qn, kn = (l2norm(q), l2norm(k)) if use_qk_l2norm else (q, k)
    pad = (CHUNK - T % CHUNK) % CHUNK
    n_chunks = (T + pad) // CHUNK
    qn_, kn_, v_, do_ = (_chunked(F.pad(x, (0, 0, 0, pad)), n_chunks) for x in (qn, kn, v, do))
    g_, beta_ = (_chunked(F.pad(x, (0, pad)), n_chunks) for x in (g, beta))
    gc = g_.cumsum(-1)                                            # within-chunk cumulative log decay
    idx = torch.arange(CHUNK, device=q.device)
    incl, strict = idx[:, None] >= idx[None, :], idx[:, None] > idx[None, :]
    gam = (gc[..., :, None] - gc[..., None, :]).masked_fill(~incl, float("-inf")).exp()
    G, e = gc.exp(), (gc[..., -1:] - gc).exp()                   # G_i, exp(g_last - g_i)
    gl = gc[..., -1].exp()                                        # chunk decay
    P = kn_ @ kn_.transpose(-1, -2)
    L = beta_[..., :, None] * P * gam * strict
    eye = torch.eye(CHUNK, dtype=ct, device=q.device)
    Tm = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)
    kbg, vb = kn_ * (beta_ * G)[..., None], v_ * beta_[..., None]
    w, u = Tm @ kbg, Tm @ vb
    QK = qn_ @ kn_.transpose(-1, -2)
    M = scale * QK * gam                                          # gam is 0 above the diagonal
    ke = kn_ * e[..., None]
    # forward recurrence: the state at each chunk start, and v'
    h = torch.zeros(B, H, K, V, dtype=ct, device=q.device) if h0 is None else h0.to(ct)
    hs, vns = [], []
    for c in range(n_chunks):
        hs.append(h)
        vn = u[:, :, c] - w[:, :, c] @ h
        vns.append(vn)
        h = gl[:, :, c, None, None] * h + ke[:, :, c].transpose(-1, -2) @ vn
    hs, vn = torch.stack(hs, 2), torch.stack(vns, 2)
    # backward recurrence: dv' and the state gradient at each chunk end
    dh = torch.zeros(B, H, K, V, dtype=ct, device=q.device) if dht is None else dht.to(ct)
    dhs, dvns = [None] * n_chunks, [None] * n_chunks
    qg = scale * qn_ * G[..., None]
    for c in reversed(range(n_chunks)):
        dhs[c] = dh
        dvn = M[:, :, c].transpose(-1, -2) @ do_[:, :, c] + ke[:, :, c] @ dh
        dvns[c] = dvn
        dh = gl[:, :, c, None, None] * dh + qg[:, :, c].transpose(-1, -2) @ do_[:, :, c] \
            - w[:, :, c].transpose(-1, -2) @ dvn
    dh0 = dh
    dhn, dvn = torch.stack(dhs, 2), torch.stack(dvns, 2)
    # per-chunk gradients
    tmp = do_ @ hs.transpose(-1, -2)                              # do h^T
    dq = scale * G[..., None] * tmp
    dgc = (dq * qn_).sum(-1)
    dM = (do_ @ vn.transpose(-1, -2)) * incl
    dQK = scale * dM * gam
    dq = dq + dQK @ kn_
    dk = dQK.transpose(-1, -2) @ qn_
    dMM = dM * M
    dgc = dgc + dMM.sum(-1) - dMM.sum(-2)
    tmp = e[..., None] * (vn @ dhn.transpose(-1, -2))             # d(k e)
    dk = dk + tmp
    dke = (tmp * kn_).sum(-1)
    dgc = dgc - dke
    dg_last = dke.sum(-1) + gl * (hs * dhn).sum((-1, -2))
    dw = -dvn @ hs.transpose(-1, -2)
    dkbg = Tm.transpose(-1, -2) @ dw
    dvb = Tm.transpose(-1, -2) @ dvn
    dv = beta_[..., None] * dvb
    dbeta = (dvb * v_).sum(-1) + (dkbg * kn_).sum(-1) * G
    dk = dk + (beta_ * G)[..., None] * dkbg
    dgc = dgc + (dkbg * kbg).sum(-1)
    dT = dw @ kbg.transpose(-1, -2) + dvn @ vb.transpose(-1, -2)
    dL = -(Tm.transpose(-1, -2) @ dT @ Tm.transpose(-1, -2)) * strict
    D = dL * gam
    dbeta = dbeta + (D * P).sum(-1)
    dk = dk + beta_[..., None] * (D @ kn_) + D.transpose(-1, -2) @ (beta_[..., None] * kn_)
    dLL = dL * L
    dgc = dgc + dLL.sum(-1) - dLL.sum(-2)
    dgc[..., -1] += dg_last
    dg = dgc.flip(-1).cumsum(-1).flip(-1)                         # d(cumsum) = reverse cumsum
    unchunk = lambda x: x.reshape(B, H, n_chunks * CHUNK, *x.shape[4:])[:, :, :T]  # noqa: E731
    dq, dk, dv = (unchunk(x) for x in (dq, dk, dv))
    dg, dbeta = (x.reshape(B, H, -1)[:, :, :T] for x in (dg, dbeta))
    if use_qk_l2norm:
        dq, dk = l2norm_bwd(q, dq), l2norm_bwd(k, dk)
    return (dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), dg.transpose(1, 2), dbeta.transpose(1, 2),
            dh0)


def l2norm_bwd(x, dy, eps: float = L2NORM_EPS):
    """Gradient of `l2norm(x)`: r (dy - y (y . dy)), r = rsqrt(|x|^2 + eps), y = x r."""
    r = torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
    y = x * r
    return r * (dy - y * (y * dy).sum(-1, keepdim=True))


def gdn_bwd_reference(q, k, v, g, beta, scale, initial_state, do, dht, cu_seqlens, use_qk_l2norm):
    """Gradients of `gdn_fwd_reference` w.r.t. q, k, v, g, beta and the initial state (analytic, chunked).
    Returns dq, dk, dv, dg, dbeta in the inputs' dtypes and dh0 in fp32 (None without an initial state)."""
    H, HV = q.shape[2], v.shape[2]
    n_rep = HV // H
    qe, ke = _expand_heads(q, n_rep), _expand_heads(k, n_rep)
    pieces = list(zip(*[_sequences(x, cu_seqlens) for x in (qe, ke, v, g, beta, do)]))
    grads = []
    for i, (qs, ks, vs, gs, bs, dos) in enumerate(pieces):
        sl = slice(None) if cu_seqlens is None else slice(i, i + 1)
        h0 = initial_state[sl] if initial_state is not None else None
        dhts = dht[sl] if dht is not None else None
        if qs.shape[1] == 0:
            ct = torch.promote_types(q.dtype, torch.float32)
            empty = lambda x, d: x.new_zeros(x.shape[:3] + (d,), dtype=ct)  # noqa: E731
            dh0 = dhts.to(ct) if dhts is not None else qs.new_zeros(1, HV, q.shape[-1], v.shape[-1], dtype=ct)
            grads.append((empty(qs, q.shape[-1]), empty(ks, k.shape[-1]), empty(vs, v.shape[-1]),
                          gs.new_zeros(gs.shape, dtype=ct), bs.new_zeros(bs.shape, dtype=ct), dh0))
            continue
        grads.append(_gdn_bwd_one(qs, ks, vs, gs, bs, scale, h0, dos, dhts, use_qk_l2norm))
    dq, dk, dv, dg, dbeta, dh0 = (torch.cat(x, dim=1 if j < 5 else 0) for j, x in enumerate(zip(*grads)))
    if n_rep > 1:
        dq = dq.unflatten(2, (H, n_rep)).sum(3)
        dk = dk.unflatten(2, (H, n_rep)).sum(3)
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype),
            dh0.float() if initial_state is not None else None)


# ------------------------------------------------------------------ depthwise causal conv + SiLU


def _shift(x, d, seq_idx):
    """x[:, t - d] (zero where t - d is before the start of t's sequence); x: (B, S, C), d may be negative."""
    S = x.shape[1]
    if d == 0:
        return x
    out = torch.zeros_like(x)
    if abs(d) >= S:  # every source position is outside the sequence (the conv is wider than it)
        return out
    if d > 0:
        out[:, d:] = x[:, :S - d]
    else:
        out[:, :S + d] = x[:, -d:]
    if seq_idx is not None:
        same = torch.zeros(seq_idx.shape, dtype=torch.bool, device=x.device)
        if d > 0:
            same[:, d:] = seq_idx[:, d:] == seq_idx[:, :S - d]
        else:
            same[:, :S + d] = seq_idx[:, :S + d] == seq_idx[:, -d:]
        out = torch.where(same[..., None], out, 0.0)  # not a product: a NaN / inf stays in its sequence
    return out


def causal_conv1d_fwd_reference(x, weight, bias, seq_idx, activation: bool, out_dtype):
    """x: (B, S, C) channels-last, weight (C, W), bias (C,) or None, seq_idx (B, S) int or None (each token only
    sees its own sequence). Conv in fp32, rounded to weight's dtype as F.conv1d does, then SiLU. Returns (B, S, C)."""
    W = weight.shape[-1]
    x32, w32 = x.to(weight.dtype).float(), weight.float()
    y = sum(w32[:, j] * _shift(x32, W - 1 - j, seq_idx) for j in range(W))
    if bias is not None:
        y = y + bias.float()
    y = y.to(weight.dtype)
    return (F.silu(y.float()) if activation else y.float()).to(out_dtype)


def causal_conv1d_bwd_reference(dout, x, weight, bias, seq_idx, activation: bool):
    """Gradients (dx, dweight, dbias or None) of `causal_conv1d_fwd_reference`, in fp32 (no intermediate rounding)."""
    W = weight.shape[-1]
    x32, w32 = x.float(), weight.float()
    shifted = [_shift(x32, W - 1 - j, seq_idx) for j in range(W)]
    y = sum(w32[:, j] * shifted[j] for j in range(W))
    if bias is not None:
        y = y + bias.float()
    dy = dout.float()
    if activation:
        sig = torch.sigmoid(y)
        dy = dy * sig * (1 + y * (1 - sig))
    dx = sum(w32[:, j] * _shift(dy, -(W - 1 - j), seq_idx) for j in range(W))
    dw = torch.stack([(shifted[j] * dy).sum((0, 1)) for j in range(W)], dim=-1)
    db = dy.sum((0, 1)) if bias is not None else None
    return dx.to(x.dtype), dw.to(weight.dtype), (db.to(bias.dtype) if bias is not None else None)


def seq_idx_reference(cu_seqlens, total: int):
    """(1, total) int32: the sequence each packed token belongs to."""
    t = torch.arange(total, device=cu_seqlens.device)
    return (torch.searchsorted(cu_seqlens[1:].to(torch.int64), t, right=True)).to(torch.int32)[None]
