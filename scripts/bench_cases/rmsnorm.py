"""RMSNorm family: ours vs HF eager, torch.compile of the HF code, Liger (where it has the op), floor."""
import torch


def run(h):
    k = h.load_kernel("rmsnorm")
    # HF eager: the kernel's own HF-exact references (rmsnorm/reference.py)
    rmsnorm_eager = lambda x, w: k.rms_norm_hf(x, w, 1e-6)  # noqa: E731
    rmsnorm_zc_eager = lambda x, w: k.rms_norm_zero_centered_hf(x, w, 1e-6)  # noqa: E731
    rmsnorm_gated_eager = lambda x, gate, w: k.rms_norm_gated_hf(x, gate, w, 1e-6)  # noqa: E731
    N, H = 16384, 4096
    floor = 5 * N * H * 2 / h.COPY_BW * 1e3  # fwd: read x, write y; bwd: read dy, x, write dx
    mk = lambda: (torch.randn(N, H, dtype=h.dt, device=h.dev, requires_grad=True),
                  (torch.randn(H, dtype=h.dt, device=h.dev) * 0.1 + 1).requires_grad_())
    liger_fn = None
    if h.liger is not None:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction as liger_fn
    for op, eager, ours, offset, casting in [
        ("rmsnorm", rmsnorm_eager, k.rms_norm, 0.0, "llama"),
        ("rmsnorm_zero_centered", rmsnorm_zc_eager, k.rms_norm_zero_centered, 1.0, "gemma"),
    ]:
        h.bench(op, "eager", eager, mk, floor)
        h.bench(op, "torch.compile", h.comp(eager), mk, floor)
        if liger_fn is not None:
            h.bench(op, "liger", lambda x, w, o=offset, c=casting: liger_fn.apply(x, w, 1e-6, o, c), mk, floor)
        h.bench(op, "hubfuse", lambda x, w, f=ours: f(x, w, 1e-6), mk, floor)
    # gated: head_v_dim 128 rows (Qwen3.5 linear attention), same total elements
    Ng, Hg = N * 32, 128
    floorg = 7 * Ng * Hg * 2 / h.COPY_BW * 1e3  # fwd: x, gate -> y; bwd: dy, x, gate -> dx, dgate
    mkg = lambda: (torch.randn(Ng, Hg, dtype=h.dt, device=h.dev, requires_grad=True),
                   torch.randn(Ng, Hg, dtype=h.dt, device=h.dev, requires_grad=True),
                   (torch.randn(Hg, dtype=h.dt, device=h.dev) * 0.1 + 1).requires_grad_())
    h.bench("rmsnorm_gated", "eager", rmsnorm_gated_eager, mkg, floorg)
    h.bench("rmsnorm_gated", "torch.compile", h.comp(rmsnorm_gated_eager), mkg, floorg)
    h.bench("rmsnorm_gated", "hubfuse", lambda x, g, w: k.rms_norm_gated(x, g, w, 1e-6), mkg, floorg,
            note="Liger has no gated RMSNorm")
