"""RoPE (full / partial) and fused q/k RMSNorm + RoPE: ours vs HF eager, torch.compile, Liger, floor.

Same inputs, output convention and floor formula as shared/bench/anchor_bench.py: fn returns
`cat([q_embed.flatten(), k_embed.flatten()])` (one tensor, so fwd+bwd takes one random upstream grad).
Ours uses the flat-output entry points, which write exactly that tensor (no separate cat); the pair API
followed by a real `torch.cat` is also measured ("hubfuse+cat", the way Liger is measured).
"""

import torch


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope_eager(q, k, cos, sin):  # HF (partial-capable) apply_rotary_pos_emb, unsqueeze_dim=1, flattened
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rd = cos.shape[-1]
    q_rot, q_pass = q[..., :rd], q[..., rd:]
    k_rot, k_pass = k[..., :rd], k[..., rd:]
    qe = torch.cat([q_rot * cos + rotate_half(q_rot) * sin, q_pass], -1)
    ke = torch.cat([k_rot * cos + rotate_half(k_rot) * sin, k_pass], -1)
    return torch.cat([qe.flatten(), ke.flatten()])


def norm_rope_eager(q, k, wq, wk, cos, sin, norm):  # HF attention: q_norm/k_norm, transpose, RoPE
    return rope_eager(norm(q, wq).transpose(1, 2), norm(k, wk).transpose(1, 2), cos, sin)


def run(h):
    kr = h.load_kernel("rotary")
    dev, dt = h.dev, h.dt
    liger_rope = None
    if h.liger is not None:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb as liger_rope
    B, T = 8, 2048

    # --- RoPE alone: full (Qwen3-8B: 32 q / 8 kv heads, d128) and partial (Qwen3.5: 16 / 2, d256, rotary 64)
    for name, hq, hk, d, rd in [("rope_full", 32, 8, 128, 128), ("rope_partial", 16, 2, 256, 64)]:
        nbytes = B * T * (hq + hk) * d * 2
        floor = 4 * nbytes / h.COPY_BW * 1e3 if rd == d else 4 * nbytes * rd / d / h.COPY_BW * 1e3
        oop = f"; out-of-place floor {4 * nbytes / h.COPY_BW * 1e3:.3f} ms" if rd != d else ""
        mk = lambda hq=hq, hk=hk, d=d, rd=rd: (
            torch.randn(B, hq, T, d, dtype=dt, device=dev, requires_grad=True),
            torch.randn(B, hk, T, d, dtype=dt, device=dev, requires_grad=True),
            torch.randn(B, T, rd, dtype=dt, device=dev), torch.randn(B, T, rd, dtype=dt, device=dev))
        h.bench(name, "eager", rope_eager, mk, floor,
                note="floor for partial counts only rotated dims (in-place)" + oop)
        h.bench(name, "torch.compile", h.comp(rope_eager), mk, floor)
        if rd == d and liger_rope is not None:
            h.bench(name, "liger", lambda q, k, c, s: torch.cat([t.flatten() for t in liger_rope(q, k, c, s)]), mk,
                    floor)
        h.bench(name, "hubfuse", lambda q, k, c, s: kr.apply_rotary_pos_emb_flat(q, k, c, s), mk, floor,
                note="flat-output op: writes the same tensor as the eager fn, q+k one launch")
        if rd != d:
            # in place needs non-leaf q/k: fn makes them with a copy, which "GPU ms" leaves out (rotary kernels
            # only); peak and the stream time include the copies
            h.bench(name, "hubfuse in place (rotary kernels only)", lambda q, k, c, s: torch.cat(
                [t.flatten() for t in kr.apply_rotary_pos_emb_(q * 1, k * 1, c, s)]), mk, floor,
                note="apply_rotary_pos_emb_ on q*1, k*1; GPU ms = the rotary Triton kernels alone (_fwd_kernel, "
                     "_bwd_kernel)", kernels=("_fwd_kernel", "_bwd_kernel"))
        h.bench(name, "hubfuse+cat", lambda q, k, c, s: torch.cat([t.flatten() for t in kr.apply_rotary_pos_emb(q, k, c, s)]),
                mk, floor, note="pair API (what models call) + torch.cat")
        # the layout models hand over: q/k are transposed (B, S, H, D) projections
        mkt = lambda hq=hq, hk=hk, d=d, rd=rd: (
            torch.randn(B, T, hq, d, dtype=dt, device=dev).transpose(1, 2).requires_grad_(),
            torch.randn(B, T, hk, d, dtype=dt, device=dev).transpose(1, 2).requires_grad_(),
            torch.randn(B, T, rd, dtype=dt, device=dev), torch.randn(B, T, rd, dtype=dt, device=dev))
        h.bench(name, "torch.compile (model layout)", h.comp(rope_eager), mkt, floor,
                note="q/k as transposed (B,S,H,D) views")
        h.bench(name, "hubfuse (model layout)", lambda q, k, c, s: kr.apply_rotary_pos_emb_flat(q, k, c, s), mkt,
                floor, note="q/k as transposed (B,S,H,D) views")

    # --- q/k RMSNorm + RoPE: the fused kernel vs the two ops separately (ours and compile) and compile whole
    kn = h.load_kernel("rmsnorm")
    liger_norm = None
    if h.liger is not None:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction as liger_norm
    for name, hq, hk, d, rd, zc in [("qk_norm_rope_full", 32, 8, 128, 128, False),
                                    ("qk_norm_rope_partial_zc", 16, 2, 256, 64, True)]:
        nbytes = B * T * (hq + hk) * d * 2
        floor = 5 * nbytes / h.COPY_BW * 1e3  # fwd: read q,k, write out; bwd: read dy, q, k, write dq, dk
        mk = lambda hq=hq, hk=hk, d=d, rd=rd, zc=zc: (
            torch.randn(B, T, hq, d, dtype=dt, device=dev, requires_grad=True),
            torch.randn(B, T, hk, d, dtype=dt, device=dev, requires_grad=True),
            (torch.randn(d, dtype=dt, device=dev) * 0.1 + (0.0 if zc else 1.0)).requires_grad_(),
            (torch.randn(d, dtype=dt, device=dev) * 0.1 + (0.0 if zc else 1.0)).requires_grad_(),
            torch.randn(B, T, rd, dtype=dt, device=dev), torch.randn(B, T, rd, dtype=dt, device=dev))
        # HF eager norms: Qwen3RMSNorm / Qwen3_5MoeRMSNorm, the kernel's HF-exact references
        norm_hf = kr.reference.rms_norm_zero_centered_hf if zc else kr.reference.rms_norm_hf
        norm_eager = lambda x, w, norm_hf=norm_hf: norm_hf(x, w, 1e-6)  # noqa: E731
        eager = lambda q, k, wq, wk, c, s, norm=norm_eager: norm_rope_eager(q, k, wq, wk, c, s, norm)
        h.bench(name, "eager", eager, mk, floor, note="HF q_norm, k_norm, transpose, apply_rotary_pos_emb")
        h.bench(name, "torch.compile (whole)", h.comp(eager), mk, floor)
        norm_c, rope_c = h.comp(norm_eager), h.comp(rope_eager)
        h.bench(name, "torch.compile (2 ops)",
                lambda q, k, wq, wk, c, s: rope_c(norm_c(q, wq).transpose(1, 2), norm_c(k, wk).transpose(1, 2), c, s),
                mk, floor, note="norm and RoPE compiled separately")
        nfn = kn.rms_norm_zero_centered if zc else kn.rms_norm
        h.bench(name, "hubfuse (2 ops)",
                lambda q, k, wq, wk, c, s: kr.apply_rotary_pos_emb_flat(nfn(q, wq, 1e-6).transpose(1, 2),
                                                                        nfn(k, wk, 1e-6).transpose(1, 2), c, s),
                mk, floor, note="rmsnorm kernel + rotary kernel")
        if not zc and liger_norm is not None and liger_rope is not None:
            h.bench(name, "liger (2 ops)",
                    lambda q, k, wq, wk, c, s: torch.cat([t.flatten() for t in liger_rope(
                        liger_norm.apply(q, wq, 1e-6, 0.0, "llama").transpose(1, 2),
                        liger_norm.apply(k, wk, 1e-6, 0.0, "llama").transpose(1, 2), c, s)]), mk, floor)
        h.bench(name, "hubfuse (fused)",
                lambda q, k, wq, wk, c, s, zc=zc: kr.qk_norm_rope_flat(q, k, wq, wk, c, s, 1e-6, zero_centered=zc),
                mk, floor, note="one kernel each way, q+k one launch")
