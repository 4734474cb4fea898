"""Probe (GPU): where a training step's GPU time goes, per kernel family, for one bench.py slice and config.

    python scripts/probe_step_profile.py [--slice qwen3_30b_a3b] [--configs ours liger] [--top 30]

Loads the slice like scripts/bench.py (same builder, same loaders), runs warm-up steps, then profiles 3 steps
with torch.profiler and prints, per config: wall ms/step, summed GPU kernel ms/step, idle GPU time inside the
step (wall - kernel union), and the kernels grouped by name (ms/step, calls/step, share), largest first.
Exploratory, not uploaded. One process per config is not needed here: every config but liger is
process-clean (liger patches classes), so liger, if asked for, runs last.
"""
import argparse
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import torch  # noqa: E402

import bench  # noqa: E402
import bench_ops  # noqa: E402

STEPS = 3


def kernel_intervals(prof):
    out = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            out.append((ev.time_range.start, ev.time_range.end, ev.name))
    return sorted(out)


def union_us(intervals):
    total, end = 0.0, float("-inf")
    for s, e, _ in intervals:
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def short(name: str, width: int = 110) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def run(slice_name, config, path, top, moe_backward):
    load_as = {"compile": "eager", "ours_compile": "ours"}.get(config, config)
    model, extra, _ = bench.load_model(slice_name, load_as, path, "cuda")
    if moe_backward and load_as == "ours":
        bench.set_moe_backward(model, moe_backward)
    run_model = model
    if config in bench.COMPILED:  # as bench.py's child does
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        run_model = torch.compile(model)
    print(f"\n=== {slice_name} / {config}{' / moe ' + moe_backward if moe_backward else ''}: {extra}", flush=True)
    step = bench.probe_step(slice_name, model, run_model)
    wall_ms, prof = bench_ops.wall_and_profile(step, STEPS, warmup=3)
    iv = kernel_intervals(prof)
    busy = union_us(iv) / 1e3 / STEPS
    span = (iv[-1][1] - iv[0][0]) / 1e3 / STEPS if iv else 0.0
    by_name = defaultdict(lambda: [0.0, 0])
    for s, e, n in iv:
        by_name[n][0] += (e - s) / 1e3 / STEPS
        by_name[n][1] += 1
    ksum = sum(v[0] for v in by_name.values())
    print(f"wall {wall_ms:.1f} ms/step (unprofiled); profiled span {span:.1f}, kernels busy {busy:.1f} "
          f"(idle {span - busy:.1f}), kernel sum {ksum:.1f}", flush=True)
    for n, (ms, calls) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {ms:8.2f} ms {calls / STEPS:6.0f}x {100 * ms / ksum:5.1f}%  {short(n)}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--slice", default="qwen3_30b_a3b", choices=list(bench.SLICES))
    p.add_argument("--configs", nargs="+", default=["ours"], choices=list(bench.CONFIGS))
    p.add_argument("--moe-backward", default=None, help="ours: GPU_CONFIGS['backward'] impl of the moe kernel")
    p.add_argument("--top", type=int, default=30)
    a = p.parse_args()
    if "liger" in a.configs:  # class-level patches: last
        a.configs = [c for c in a.configs if c != "liger"] + ["liger"]
    path = Path("/tmp/hubfuse_probe_models") / a.slice
    from hubfuse import presets
    from tests.utils import register_local_kernels

    register_local_kernels(*presets.kernel_repos(bench.SLICES[a.slice]["family"]))
    bench.ensure_model(a.slice, path, argparse.Namespace(layers=4, smoke=False), "cuda")
    for config in a.configs:
        run(a.slice, config, path, a.top, a.moe_backward)
        torch.cuda.empty_cache()  # the config's model and optimizer went with run()'s frame


if __name__ == "__main__":
    main()
