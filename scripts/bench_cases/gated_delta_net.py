"""Gated delta rule (Qwen3.5-MoE linear attention): ours vs transformers' torch path and flash-linear-attention.

Shapes of transformers' `Qwen3_5MoeTextConfig` defaults: bf16, 16 key heads / 32 value heads, head dims 128,
`use_qk_l2norm_in_kernel=True`, batch 8 x 1024, 2 x 8192 and 1 x 32768 tokens; fwd+bwd of the rule alone, g (fp32)
and beta (bf16) as transformers computes them. "packed" = the same tokens as one row of B * T tokens split into the
B sequences by `cu_seqlens` (varlen), next to the dense rows of the same op. "repeated" = q, k given with the 16 key
heads repeated to 32, as transformers' GatedDeltaNet calls the hook; "native" = 16 key heads shared by two value
heads each (what our GatedDeltaNet layer passes; FLA accepts it too). flash-linear-attention 0.6.0's backward
refuses to run on Hopper with Triton >= 3.4, < 3.7.1 (its issue #640: its results may be wrong there): it is run
with that guard bypassed, as a timing anchor only. Floor: the bytes the op must move (q, k, v, g, beta, o; do, dq,
dk, dv, dg, dbeta) over the measured copy bandwidth. `HUBFUSE_GDN_BENCH_SHAPES=2x8192,1x32768` runs only those
batch x tokens shapes (FLA autotunes for minutes at each new one).
"""
import os
import sys

import torch
import torch.nn.functional as F

SHAPES = [(8, 1024), (2, 8192), (1, 32768)]


def _shapes():
    wanted = os.environ.get("HUBFUSE_GDN_BENCH_SHAPES")
    if not wanted:
        return SHAPES
    shapes = [tuple(int(n) for n in item.split("x")) for item in wanted.split(",")]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise SystemExit(f"HUBFUSE_GDN_BENCH_SHAPES: {unknown} not among {SHAPES}")
    return shapes
HK, HV, D = 16, 32, 128


def _fla():
    """FLA's chunk_gated_delta_rule with the Hopper guard of its gated backward bypassed, or None. FLA comes from
    its own site dir ($HUBFUSE_FLA_SITE) where one is given (scripts/gpu_check.sh keeps it out of the common site:
    with FLA installed, transformers' Qwen3.5 would run it)."""
    site = os.environ.get("HUBFUSE_FLA_SITE")
    if site and site not in sys.path:
        sys.path.insert(0, site)
    try:
        import fla.ops.common.chunk_o as chunk_o
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # noqa: BLE001 - FLA is a peer, not a dependency
        return None
    chunk_o.TRITON_ABOVE_3_7_1 = True  # the guard's condition; the kernels are unchanged
    return chunk_gated_delta_rule


def make(B, T, key_heads, dev, dt, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(B, T, key_heads, D, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(B, T, key_heads, D, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(B, T, HV, D, device=dev, dtype=dt, requires_grad=True)
    g = F.logsigmoid(torch.randn(B, T, HV, device=dev) + 3.0).requires_grad_()   # fp32, as transformers' g
    beta = torch.sigmoid(torch.randn(B, T, HV, device=dev)).to(dt).requires_grad_()
    return q, k, v, g, beta


def run(h):
    kg = h.load_kernel("gated-delta-net")
    fla = _fla()
    dev, dt = h.dev, h.dt
    for B, T in _shapes():
        op = f"gated_delta_rule {B}x{T}"
        n = B * T
        io = n * (2 * HK * D * 2 + HV * D * 2 + HV * 6)          # q, k, v, g (fp32), beta
        floor = (2 * io + 2 * n * HV * D * 2) / h.COPY_BW * 1e3   # fwd: in + o; bwd: do + in + grads
        rep = lambda B=B, T=T: make(B, T, HV, dev, dt)  # noqa: E731
        native = lambda B=B, T=T: make(B, T, HK, dev, dt)  # noqa: E731
        if T <= 8192:  # its loop over chunks: 0.28 s a call at 2 x 8192 on an H100, longer than the rest together
            h.bench(op, "transformers torch path (repeated)",
                    lambda q, k, v, g, b: kg.chunk_gated_delta_rule_hf(q, k, v, g, b, use_qk_l2norm_in_kernel=True)[0],
                    rep, floor, note="transformers' torch_chunk_gated_delta_rule (bitwise copy), fp32 inside")
        if fla is not None:  # as transformers calls it (repeated key heads); its autotuning takes minutes per layout
            h.bench(op, "flash-linear-attention 0.6.0 (repeated)",
                    lambda q, k, v, g, b: fla(q, k, v, g, b, use_qk_l2norm_in_kernel=True)[0], rep, floor,
                    note="Hopper guard bypassed: FLA says its gated backward may be WRONG on this Triton; "
                         "timing anchor only")
        for label, mk in (("repeated", rep), ("native", native)):
            h.bench(op, f"hubfuse ({label})",
                    lambda q, k, v, g, b: kg.chunk_gated_delta_rule(q, k, v, g, b, use_qk_l2norm_in_kernel=True)[0],
                    mk, floor)
        if B > 1:  # the same tokens packed: one row of B * T tokens, B sequences
            cu = torch.arange(0, B * T + 1, T, device=dev, dtype=torch.int32)
            packed = lambda B=B, T=T: make(1, B * T, HK, dev, dt)  # noqa: E731
            h.bench(op, f"hubfuse (native, packed 1x{B * T})",
                    lambda q, k, v, g, b, cu=cu: kg.chunk_gated_delta_rule(q, k, v, g, b, use_qk_l2norm_in_kernel=True,
                                                                           cu_seqlens=cu)[0],
                    packed, floor)
