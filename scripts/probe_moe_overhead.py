"""Probe (GPU): is the MoE op's stream time bound by the host? Exploratory, not uploaded.

    python scripts/probe_moe_overhead.py [T E K H I] [--impl grouped_mm_lean] [--cprofile]

For the public op (`moe_experts`, custom op + autograd, fwd + bwd with a random upstream grad), at one shape:
1. stream ms: `do_bench` median, as bench_ops.py measures it;
2. host ms per step: the time the CPU takes to enqueue a step while the GPU is held busy by a long sleep kernel
   (so no launch ever waits for the device), and the same for route / moe_fwd / moe_bwd called directly;
3. graph ms: the same step captured in a CUDA graph and replayed (no host work at all);
4. kernel-sum ms from torch.profiler.
If host ms >= graph ms, the host sets the pace and the stream time shows launch overhead, not GPU work.
--cprofile: the top functions by cumulative host time over a few steps (GPU asleep meanwhile).
"""
import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "kernel_repos/moe/torch-ext"))
sys.path.insert(0, str(ROOT / "kernel_repos/moe/benchmarks"))
import moe  # noqa: E402
from moe import reference, triton_kernels as tk  # noqa: E402
from tune_moe import make_inputs  # noqa: E402

SLEEP_CYCLES = 4_000_000_000  # ~2 s at 2 GHz: longer than any host loop below


def host_ms(fn, steps=10):
    """CPU time to enqueue one call of fn while the GPU sleeps (no launch blocks on the device)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    ms = (time.perf_counter() - t0) / steps * 1e3
    torch.cuda.synchronize()
    return ms


def cprofile_calls(fn, calls):
    """pstats.Stats of `calls` calls of fn (after one warm-up call) while the GPU sleeps: host work only."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    return pstats.Stats(prof)


def graph_ms(step):
    """Median ms of one replay of `step` captured in a CUDA graph (warmed up on a side stream first)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    torch.cuda.synchronize()
    return triton.testing.do_bench(g.replay, warmup=25, rep=200, return_mode="median")


def kernel_sum_ms(step, steps=5):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA") / steps / 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("shape", nargs="*", type=int, default=[8192, 128, 8, 2048, 768])
    p.add_argument("--impl", default=None, help="GPU_CONFIGS['backward']['impl'] for this run")
    p.add_argument("--cprofile", action="store_true")
    a = p.parse_args()
    T, E, K, H, I = a.shape
    if a.impl:
        tk.GPU_CONFIGS["backward"] = dict(tk.GPU_CONFIGS["backward"], impl=a.impl)
    x, idx, w, gu, dn, dout = make_inputs(T, E, K, H, I, "cuda", torch.bfloat16)
    leaves = [t.requires_grad_() for t in (x, w, gu, dn)]
    print(f"T={T} E={E} K={K} H={H} I={I}; backward impl {tk.backward_impl(x, H, I, E)}", flush=True)

    def step():
        for t in leaves:
            t.grad = None
        moe.moe_experts(x, idx, w, gu, dn).backward(dout)

    with torch.no_grad():
        s, o = reference.route(idx, E)
        out, gout, pos = tk.moe_fwd(x, idx, w, gu, dn, s, o)
    parts = {
        "route": lambda: reference.route(idx, E),
        "moe_fwd (direct)": lambda: tk.moe_fwd(x, idx, w, gu, dn, s, o),
        "moe_bwd (direct)": lambda: tk.moe_bwd(dout, x, idx, w, gu, dn, gout, s, o, pos),
        "forward only (public op, no grad)": lambda: moe.moe_experts(x.detach(), idx, w.detach(), gu.detach(),
                                                                     dn.detach()),
        "step (public op fwd + bwd)": step,
    }
    for name, fn in parts.items():
        print(f"host ms {name}: {host_ms(fn):.3f}", flush=True)
    ms = triton.testing.do_bench(step, warmup=25, rep=200, return_mode="median")
    print(f"stream ms (do_bench median): {ms:.3f}", flush=True)
    print(f"kernel-sum ms (profiler): {kernel_sum_ms(step):.3f}", flush=True)
    print(f"graph ms (replay, do_bench median): {graph_ms(step):.3f}", flush=True)
    if a.cprofile:
        stats = cprofile_calls(step, 5)
        stats.sort_stats("cumulative").print_stats(30)
        stats.sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
