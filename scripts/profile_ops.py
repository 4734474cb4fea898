#!/usr/bin/env python
"""GPU kernel time vs wall time of one fwd+bwd step, per implementation (torch.profiler), for tuning.

    python scripts/profile_ops.py rmsnorm
Prints, per impl: wall ms/step (CPU-bound if much larger than GPU), GPU ms/step, and the top kernels.
"""
import sys

import torch

sys.path.insert(0, __import__("os").path.dirname(__file__))
import bench_ops as h  # noqa: E402


def profile_step(name, fn, make_inputs, steps=20):
    inputs = make_inputs()
    out = fn(*inputs)
    g = torch.randn_like(out) if out.dim() > 0 else None

    def step():
        o = fn(*inputs)
        o.backward(g) if g is not None else o.backward()

    wall, prof = h.wall_and_profile(step, steps, warmup=5)
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    gpu = sum(e.self_device_time_total for e in events) / steps / 1e3
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:4]
    kernels = "; ".join(f"{e.key[:50]} {e.self_device_time_total / steps / 1e3:.3f}" for e in top)
    print(f"{name:34s} wall {wall:7.3f} ms  gpu {gpu:7.3f} ms  | {kernels}", flush=True)


def rmsnorm_cases():
    k = h.load_kernel("rmsnorm")
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction as L

    mk = lambda: (torch.randn(16384, 4096, dtype=torch.bfloat16, device="cuda", requires_grad=True),
                  torch.randn(4096, dtype=torch.bfloat16, device="cuda", requires_grad=True))
    mkg = lambda: (torch.randn(524288, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True),
                   torch.randn(524288, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True),
                   torch.randn(128, dtype=torch.bfloat16, device="cuda", requires_grad=True))
    profile_step("rmsnorm hubfuse", lambda x, w: k.rms_norm(x, w), mk)
    profile_step("rmsnorm liger", lambda x, w: L.apply(x, w, 1e-6, 0.0, "llama"), mk)
    profile_step("rmsnorm_zc hubfuse", lambda x, w: k.rms_norm_zero_centered(x, w), mk)
    profile_step("rmsnorm_gated hubfuse", lambda x, g, w: k.rms_norm_gated(x, g, w), mkg)



def rmsnorm_sweep_cases():
    """Launch-shape sweep of the rmsnorm kernels (patches the loaded module's launch helpers)."""
    k = h.load_kernel("rmsnorm")
    mk = lambda: (torch.randn(16384, 4096, dtype=torch.bfloat16, device="cuda", requires_grad=True),
                  torch.randn(4096, dtype=torch.bfloat16, device="cuda", requires_grad=True))
    k.rms_norm(*mk())  # imports triton_kernels
    tk = sys.modules[k.__name__ + ".triton_kernels"]
    orig = tk._bwd_config
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for block_m, warps, per_sm in [(1, 8, 1), (1, 8, 2), (1, 8, 4), (1, 16, 2), (2, 8, 2), (2, 16, 2),
                                   (4, 16, 2), (1, 4, 4), (2, 8, 1)]:
        tk._bwd_config = lambda n, d, bm=block_m, w=warps, p=per_sm: (bm, 4096, w, sms * p)
        profile_step(f"rmsnorm bwd block_m={block_m} warps={warps} x{per_sm}", lambda x, w: k.rms_norm(x, w), mk)
    tk._bwd_config = orig


if __name__ == "__main__":
    for case in sys.argv[1:] or ["rmsnorm"]:
        globals()[f"{case}_cases"]()
