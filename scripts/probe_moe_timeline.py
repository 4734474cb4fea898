"""Probe (GPU): what separates the MoE step's stream time from its kernel sum — idle gaps or slower kernels under
sustained load (SM clock / power). Exploratory, not uploaded.

    python scripts/probe_moe_timeline.py [T E K H I]

1. one profiled route+fwd+bwd after warm-up, kernels in launch order: start offset, duration, idle gap before;
   span vs busy time (the union of kernel intervals) vs the sum of durations;
2. 20 steps back to back after ~2 s of load, profiled: per step span, busy time, idle gaps, the kernels waited on;
3. the same step back to back for ~3 s (do_bench, long rep) and a dense bf16 GEMM of the same FLOPs, with the SM
   clock, power and temperature sampled by nvidia-smi every 50 ms during each: the MoE step's ms, the dense GEMM's
   TFLOP/s and the clocks they ran at.
"""
import subprocess
import sys
import threading
from collections import defaultdict
import time
from pathlib import Path

import torch
import triton
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernel_repos/moe/torch-ext"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernel_repos/moe/benchmarks"))
from moe import reference, triton_kernels as tk  # noqa: E402
from tune_moe import make_inputs  # noqa: E402


class Clocks:
    """nvidia-smi samples (sm MHz, W, C) while the block runs."""

    def __enter__(self):
        self.samples, self._stop = [], False
        self.proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits",
             "-lms", "50"], stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        time.sleep(0.3)
        return self

    def _read(self):
        for line in self.proc.stdout:
            try:
                self.samples.append(tuple(float(v) for v in line.split(",")))
            except ValueError:
                pass

    def __exit__(self, *exc):
        self.proc.terminate()
        self.thread.join(timeout=2)

    def summary(self, skip=6):
        s = self.samples[skip:] or self.samples
        if not s:
            return "no samples"
        med = [sorted(c)[len(c) // 2] for c in zip(*s)]
        return (f"sm clock median {med[0]:.0f} MHz (min {min(x[0] for x in s):.0f}, max {max(x[0] for x in s):.0f}), "
                f"power median {med[1]:.0f} W, temp {med[2]:.0f} C, {len(s)} samples")


def gaps_under_load(step, steps=20):
    """Steps back to back after ~2 s of the same load (clocks and power as in a long do_bench), profiled without a
    sync between them: per step, the span, the kernels' busy time and the idle gaps, and the kernels that most
    often wait (the gap before them), so stream time minus kernel time splits into gaps and slower kernels."""
    triton.testing.do_bench(step, warmup=25, rep=2000, return_mode="median")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    ev = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0)
    per_kernel = defaultdict(lambda: [0.0, 0.0, 0])  # name -> [duration, gap before, count]
    end, busy, gaps = ev[0][0], 0.0, 0.0
    for s, e, n in ev:
        gap = max(0.0, s - end)
        gaps += gap
        busy += e - max(s, end) if e > end else 0.0
        k = per_kernel[n[:60]]
        k[0] += e - s
        k[1] += gap
        k[2] += 1
        end = max(end, e)
    span = end - ev[0][0]
    print(f"under load, {steps} steps back to back: per step span {span / steps / 1e3:.3f} ms, busy "
          f"{busy / steps / 1e3:.3f}, idle gaps {gaps / steps / 1e3:.3f} ({len(ev) / steps:.0f} launches per step)")
    print(f"{'dur/step':>9s} {'gap/step':>9s} {'n':>4s}  kernel (us)")
    for n, (d, g, c) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:15]:
        print(f"{d / steps:9.1f} {g / steps:9.1f} {c:4d}  {n}")


def main():
    T, E, K, H, I = [int(v) for v in sys.argv[1:6]] if len(sys.argv) > 5 else (8192, 128, 8, 2048, 768)
    x, idx, w, gu, dn, dout = make_inputs(T, E, K, H, I, "cuda", torch.bfloat16)
    flops = 3 * (2 * T * K * H * 2 * I + 2 * T * K * H * I)
    print(f"T={T} E={E} K={K} H={H} I={I}; backward impl {tk.backward_impl(x, H, I, E)}; {flops / 1e9:.0f} GFLOP/step")

    def step():
        s, o = reference.route(idx, E)
        out, gout, pos = tk.moe_fwd(x, idx, w, gu, dn, s, o)
        return tk.moe_bwd(dout, x, idx, w, gu, dn, gout, s, o, pos)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    ev = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0)
    t0, end, busy, ksum = ev[0][0], float("-inf"), 0.0, 0.0
    print(f"{'start':>8s} {'dur':>7s} {'gap':>6s}  kernel (us)")
    for s, e, n in ev:
        gap = max(0.0, s - end) if end > float("-inf") else 0.0
        busy += e - max(s, end) if e > end else 0.0
        ksum += e - s
        end = max(end, e)
        print(f"{s - t0:8.1f} {e - s:7.1f} {gap:6.1f}  {n[:100]}")
    print(f"profiled step: span {(end - t0) / 1e3:.3f} ms, busy {busy / 1e3:.3f}, kernel sum {ksum / 1e3:.3f}, "
          f"idle {(end - t0 - busy) / 1e3:.3f}", flush=True)

    gaps_under_load(step)

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_flops = 2 * 8192**3
    for label, rep in (("short (rep 100 ms)", 100), ("sustained (rep 3000 ms)", 3000)):
        with Clocks() as c:
            ms = triton.testing.do_bench(step, warmup=25, rep=rep, return_mode="median")
        print(f"moe route+fwd+bwd {label}: {ms:.3f} ms = {flops / ms / 1e9:.0f} TFLOP/s; {c.summary()}", flush=True)
        with Clocks() as c:
            mm = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=rep, return_mode="median")
        print(f"dense 8192^3 bf16 mm {label}: {mm:.3f} ms = {mm_flops / mm / 1e9:.0f} TFLOP/s; {c.summary()}",
              flush=True)
    with Clocks() as c:
        time.sleep(1.0)
    print(f"idle: {c.summary(skip=2)}")


if __name__ == "__main__":
    main()
