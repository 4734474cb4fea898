#!/usr/bin/env python
"""Training steps of several configurations in one process, interleaved (A B C A B C ...): a ratio between them
that process-level noise does not move.

`scripts/bench.py` runs each configuration in its own process; on the GPU machines here a host-bound step (plain
eager, ~80-100 ms for Qwen3-0.6B) moves by up to ~15 % from one process to the next, more than a change of host
work a layer shows. Here every configuration's model is loaded into one process (`bench.load_model` /
`bench.make_step`, as bench.py does), warmed up, and then each round runs one step of each, every step
synchronised. Reported: median, min and max step ms of each, its speed relative to the first configuration
(the first's median step over this one's), and the time Python's garbage collector ran during its steps
(`--gc-freeze`: the objects alive after the warm-up moved out of its reach first).
Configurations: bench.py's `eager`, `ours`, `ours_modules`, `compile`, `compile_ro`, `ours_compile`, `ours_ro`
(`ours_graph` and Liger patch or capture process-wide: not here).
A compiled configuration in the process slows the eager ones: plain hubfuse's step took +7 % (H200) to +20 % with
a compiled HF model alive in its process, run or not (docs/benchmarks.md, "a compiled model in the process"). Mixed
eager / compiled sets understate the eager rows; compare those in processes of their own (bench.py).

    python scripts/bench_interleaved.py ours ours_modules compile                   # Qwen3-0.6B, 30 rounds
    python scripts/bench_interleaved.py ours eager --slice qwen3_small --rounds 10
    python scripts/bench_interleaved.py ours ours_modules --smoke                   # CPU, tiny widths
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (puts the repo root and torch-ext on sys.path)

CONFIGS = ("eager", "ours", "ours_modules", "compile", "compile_ro", "ours_compile", "ours_ro")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="+", choices=CONFIGS, metavar="CONFIG", help=f"of {list(CONFIGS)}")
    p.add_argument("--slice", default="qwen3_0_6b", choices=sorted(bench.SLICES))
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=4, help="steps of each configuration before the rounds")
    p.add_argument("--smoke", action="store_true", help="tiny widths on CPU (eager configurations only)")
    p.add_argument("--gc-freeze", action="store_true",
                   help="gc.freeze() after the warm-up: the collector no longer walks the objects alive then")
    args = p.parse_args(argv)
    if len(set(args.configs)) != len(args.configs):
        p.error("each configuration once")
    device = "cpu" if args.smoke else "cuda"
    if args.smoke and set(args.configs) & set(bench.COMPILED):
        p.error("--smoke runs the eager configurations only")

    import torch

    from hubfuse import presets
    from tests.utils import register_local_kernels

    family = bench.SLICES[args.slice]["family"]
    register_local_kernels(*presets.kernel_repos(family))
    shape_args = argparse.Namespace(seq=None, batch=None, layers=None, smoke=args.smoke)
    layers, batch_size, seq = bench.shape_of(args.slice, shape_args)
    vocab = bench.slice_config(args.slice, layers, args.smoke).vocab_size
    g = torch.Generator().manual_seed(1234)
    batches = []
    for _ in range(8):
        ids = torch.randint(0, vocab, (batch_size, seq), generator=g).to(device)
        batches.append({"input_ids": ids, "labels": ids})

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    with tempfile.TemporaryDirectory(prefix="hubfuse_interleaved_") as tmp:
        path = Path(tmp) / args.slice
        bench.ensure_model(args.slice, path, shape_args, device)
        steps = {}
        for config in args.configs:
            model, _, _ = bench.load_model(args.slice, config, path, device)
            steps[config] = bench.make_step(model, config, device, batches[0])[0]
            for i in range(args.warmup):  # compiles here
                steps[config](batches[i % len(batches)]).item()
            print(f"{config}: ready", flush=True)
    times = {c: [] for c in args.configs}
    gc_ms = {c: [0.0, 0, 0] for c in args.configs}  # ms in the collector, collections, of them generation 2
    running, started = None, 0.0

    def on_gc(phase, info):  # charges each collection to the configuration whose step it ran in
        nonlocal started
        if running is None:
            return
        if phase == "start":
            started = time.perf_counter()
            return
        stats = gc_ms[running]
        stats[0] += (time.perf_counter() - started) * 1e3
        stats[1] += 1
        stats[2] += info["generation"] == 2

    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    gc.callbacks.append(on_gc)
    try:
        for r in range(args.rounds):
            for config in args.configs:
                sync()
                running = config
                t0 = time.perf_counter()
                steps[config](batches[r % len(batches)])
                sync()
                times[config].append((time.perf_counter() - t0) * 1e3)
                running = None
    finally:
        gc.callbacks.remove(on_gc)
    median = {c: statistics.median(t) for c, t in times.items()}
    where = torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)"
    print(f"\n{args.slice}, {batch_size} x {seq} tokens, {layers} layers, {where}; {args.rounds} interleaved rounds "
          f"after {args.warmup} warm-up steps each\n")
    print(f"| config | median step ms | min | max | speed / {args.configs[0]}'s | GC ms a step (collections, gen 2) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for c in args.configs:
        ms, n, n2 = gc_ms[c]
        print(f"| {c} | {median[c]:.1f} | {min(times[c]):.1f} | {max(times[c]):.1f} | "
              f"{median[args.configs[0]] / median[c]:.3f} | {ms / args.rounds:.2f} ({n}, {n2}) |")
    if set(args.configs) & set(bench.COMPILED):
        print("\n" + bench.dynamo_note(bench.dynamo_stats()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
