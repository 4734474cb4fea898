"""Probe (GPU): where the training step's peak memory is, for our config on one bench.py slice.

    python scripts/probe_peak_memory.py [--slice qwen3_30b_a3b] [--moe-impls grouped_mm grouped_mm_lean]

Builds/loads the slice like scripts/bench.py (config "ours"), runs warm-up steps, then records the CUDA
allocator's history over one step per MoE backward impl (GPU_CONFIGS["backward"] of the loaded moe kernel) and
prints the peak, when it happens (the innermost frames of the allocation that made it) and the largest blocks
live at that moment. Exploratory, not uploaded.
"""
import argparse
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import torch  # noqa: E402

import bench  # noqa: E402


def where(frames, n=4):
    keep = [f for f in frames if "site-packages/torch/" not in f["filename"] or "autograd" in f["filename"]]
    return " <- ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in (keep or frames)[:n])


def analyse(snapshot, base):
    live, cur, peak, peak_at, peak_live = {}, base, base, None, None
    for ev in snapshot["device_traces"][0]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            cur += ev["size"]
            if cur > peak:
                peak, peak_at, peak_live = cur, ev, dict(live)
        elif ev["action"] == "free_completed":  # also blocks from before the recording (e.g. last step's grads)
            live.pop(ev["addr"], None)
            cur -= ev["size"]
    return peak, peak_at, peak_live


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--slice", default="qwen3_30b_a3b")
    p.add_argument("--moe-impls", nargs="*", default=["grouped_mm", "grouped_mm_lean"])
    a = p.parse_args()
    args = argparse.Namespace(layers=4, smoke=False)
    path = Path("/tmp/hubfuse_probe_models") / a.slice
    from hubfuse import presets
    from tests.utils import register_local_kernels

    register_local_kernels(*presets.kernel_repos(bench.SLICES[a.slice]["family"]))
    bench.ensure_model(a.slice, path, args, "cuda")
    model, extra, _ = bench.load_model(a.slice, "ours", path, "cuda")
    print("kernels bound:", extra, flush=True)
    moe_tk = [m for name, m in sys.modules.items() if name.endswith("triton_kernels") and hasattr(m, "BACKWARD_IMPLS")]
    step = bench.probe_step(a.slice, model)
    for _ in range(2):
        step()
    for impl in a.moe_impls if moe_tk else ["-"]:
        for m in moe_tk:
            m.GPU_CONFIGS["backward"] = dict(m.GPU_CONFIGS["backward"], impl=impl)
        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=400000)
        step()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        peak, at, live = analyse(snap, base)
        print(f"\nmoe backward {impl}: max_memory_allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB; "
              f"trace peak {peak / 2**30:.2f} GiB (at step start {base / 2**30:.2f})", flush=True)
        if at is not None:
            print(f"  peak reached by a {at['size'] / 2**20:.0f} MiB alloc at {where(at['frames'], 8)}")
            by_site = defaultdict(lambda: [0, 0])
            for ev in live.values():
                site = where(ev["frames"], 3)
                by_site[site][0] += ev["size"]
                by_site[site][1] += 1
            print(f"  allocated during the step and live at the peak: {sum(v[0] for v in by_site.values()) / 2**30:.2f} GiB")
            for site, (size, n) in sorted(by_site.items(), key=lambda kv: -kv[1][0])[:14]:
                print(f"    {size / 2**20:8.0f} MiB x{n:<3d} {site[:230]}")


if __name__ == "__main__":
    main()
