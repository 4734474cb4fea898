#!/usr/bin/env python
"""Side-by-side per-op benchmark on one GPU: ours vs HF eager, torch.compile, Liger, and the floor.

    python scripts/bench_ops.py                 # every op family in scripts/bench_cases/
    python scripts/bench_ops.py rmsnorm rotary  # selected families
    python scripts/bench_ops.py --fingerprint out/new.json [--root OLD_TREE] [cases]
                                                # no timing: hashes of every hubfuse row's output and input
                                                # grads on fixed inputs (compare two trees bit for bit)

Method (as shared/bench/anchor_bench.py, so the anchors are measured again in the same run): forward +
backward with a random upstream gradient, median of `triton.testing.do_bench` after warm-up; host us = the
median time to enqueue one fwd + bwd call with the GPU queue drained (what the op costs the CPU); launches =
kernels per call (torch.profiler); GPU ms = the summed kernel time per call; peak = extra
device memory during one step over what the inputs hold; floor = the fewest bytes an ideal fused kernel must
move over the measured copy bandwidth, or its FLOPs over the measured bf16 matmul rate. Writes
$OUT/bench_ops.json and $OUT/bench_ops.md (OUT defaults to ./out).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import statistics
import time
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "scripts" / "bench_cases"
KERNEL_ROOT = ROOT  # the tree whose kernels load_kernel builds and loads (--root)
FINGERPRINT: dict | None = None  # --fingerprint: row -> hashes of the output and input grads, no timing
dev = "cuda"
dt = torch.bfloat16
RESULTS: list[dict] = []
COPY_BW = None  # bytes/s, measured
MM_RATE = None  # FLOP/s, measured
try:
    import liger_kernel as liger
except ImportError:  # a peer, not a dependency
    liger = None


def _version(dist):
    from importlib.metadata import version

    return version(dist)


def comp(f):
    return torch.compile(f, dynamic=False)


def measure_ceilings():
    global COPY_BW, MM_RATE
    a = torch.empty(2 * 1024**3 // 2, dtype=dt, device=dev).normal_()
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=50, rep=200, return_mode="median")
    COPY_BW = 2 * a.numel() * 2 / (ms * 1e-3)
    del a, b
    x = torch.randn(8192, 8192, dtype=dt, device=dev)
    y = torch.randn(8192, 8192, dtype=dt, device=dev)
    ms = triton.testing.do_bench(lambda: x @ y, warmup=50, rep=200, return_mode="median")
    MM_RATE = 2 * 8192**3 / (ms * 1e-3)
    print(f"ceilings: copy {COPY_BW / 1e12:.2f} TB/s, bf16 mm {MM_RATE / 1e12:.0f} TFLOP/s", flush=True)


def bench(op, impl, fn, make_inputs, floor_ms, note="", kernels=None):
    """fn(*inputs) -> output tensor (or scalar loss); runs fwd + bwd with a random upstream grad.
    `kernels`: GPU ms counts only the kernels whose names contain one of these strings (e.g. to leave out input
    copies that fn needs but the op does not)."""
    torch.cuda.empty_cache()
    t0 = time.time()
    if FINGERPRINT is not None:
        row = dict(op=op, impl=impl)
        if impl.startswith("hubfuse"):
            try:
                FINGERPRINT[f"{op} / {impl}"] = fingerprint(fn, make_inputs)
            except Exception as e:  # noqa: BLE001 - recorded, as in timing mode
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        RESULTS.append(row)
        return
    try:
        inputs = make_inputs()
        out = fn(*inputs)
        g = torch.randn_like(out) if out.dim() > 0 else None

        def step():
            for t in inputs:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.grad = None
            o = fn(*inputs)
            o.backward(g) if g is not None else o.backward()

        step()
        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        ms = triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")
        gpu, launches = gpu_ms(step, kernels=kernels, count=True)
        row = dict(op=op, impl=impl, ms=round(ms, 4), host_us=round(host_us(step), 1), launches=launches,
                   gpu_ms=round(gpu, 4), peak_extra_MiB=round(peak, 1), floor_ms=round(floor_ms, 4),
                   floor_ratio=round(floor_ms / ms, 3), gpu_floor_ratio=round(floor_ms / gpu, 3), note=note)
    except Exception as e:  # record and go on: one broken peer must not hide the rest
        row = dict(op=op, impl=impl, error=f"{type(e).__name__}: {str(e)[:300]}")
    row["wall_s"] = round(time.time() - t0, 1)
    RESULTS.append(row)
    print(row, flush=True)


def host_us(step, calls: int = 30) -> float:
    """Median microseconds the CPU spends enqueueing one call of `step` with the GPU queue drained first."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def fingerprint(fn, make_inputs) -> dict:
    """sha256 of the output and of every input grad of one fwd + bwd call on seeded inputs (bitwise A/B)."""
    import hashlib

    def digest(t):
        # 2-D on the CPU before the byte view: torch 2.11 refused the view of a scalar loss on CUDA
        raw = t.detach().reshape(1, -1).cpu().contiguous().view(torch.uint8)
        return hashlib.sha256(raw.numpy().tobytes()).hexdigest()[:16]

    torch.manual_seed(0)
    inputs = make_inputs()
    out = fn(*inputs)
    g = torch.randn_like(out) if out.dim() > 0 else None
    out.backward(g) if g is not None else out.backward()
    grads = [digest(t.grad) for t in inputs if isinstance(t, torch.Tensor) and t.grad is not None]
    return dict(out=digest(out), grads=grads)


def round_robin_ms(steps: dict, rounds: int, warmup: int = 3) -> dict:
    """Median ms per call of each zero-argument callable in `steps` (name -> step), timed round-robin: `warmup` calls
    of each, then `rounds` rounds calling each once in turn, CUDA events around every call. Clock and power drift
    over the run hits every step alike, where one do_bench call per step times them one after the other."""
    if FINGERPRINT is not None:
        return {}
    for _ in range(warmup):
        for step in steps.values():
            step()
    events = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {name: statistics.median(s.elapsed_time(e) for s, e in pairs) for name, pairs in events.items()}


def wall_and_profile(step, steps: int, warmup: int):
    """(wall ms per step over `steps` calls after `warmup` ones, the torch.profiler of `steps` more calls): what a
    step costs on the clock next to what its kernels cost (profile_ops.py, probe_step_profile.py)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return wall, prof


def gpu_ms(step, steps: int = 10, kernels=None, count: bool = False):
    """Device time of one step: the sum of its kernels' (and copies') durations, from torch.profiler; with
    `count`, also the number of them per step.

    `do_bench` times the stream, so an op whose Python/launch overhead exceeds its GPU work is measured by
    the CPU; inside a model the CPU runs ahead and that overhead hides behind the GEMMs. Both are reported."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    device = [e for e in prof.key_averages()
              if e.device_type.name == "CUDA" and (kernels is None or any(n in e.key for n in kernels))]
    ms = sum(e.self_device_time_total for e in device) / steps / 1e3
    return (ms, round(sum(e.count for e in device) / steps, 1)) if count else ms


_LOADED = {}


def load_kernel(name: str):
    """The kernel package as `kernels` loads it from kernel_repos/<name> (built first)."""
    if name not in _LOADED:
        import kernels

        subprocess.run([sys.executable, str(KERNEL_ROOT / "scripts" / "build.py"), name], check=True,
                       cwd=KERNEL_ROOT, stdout=subprocess.DEVNULL)
        repo = KERNEL_ROOT if name == "hubfuse" else KERNEL_ROOT / "kernel_repos" / name
        _LOADED[name] = kernels.get_local_kernel(repo)
        if KERNEL_ROOT != ROOT:
            _alias_tuning(_LOADED[name])
    return _LOADED[name]


def _alias_tuning(module) -> None:
    """--root with a checkout from before the tuning tables shared one name: alias theirs as `TUNING`, which the
    case files set (A/B comparisons only)."""
    for sub in ("ops", "triton_kernels"):
        try:
            mod = importlib.import_module(f"{module.__name__}.{sub}")
        except ImportError:
            continue
        for old_name in ("GPU_CONFIGS", "CONFIG", "LBL_CONFIG", "KERNEL_CONFIG"):
            if not hasattr(mod, "TUNING") and hasattr(mod, old_name):
                mod.TUNING = getattr(mod, old_name)


def report(out_dir: Path):
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                liger=_version("liger-kernel") if liger else None,
                copy_TBps=round(COPY_BW / 1e12, 3), mm_TFLOPs=round(MM_RATE / 1e12, 1),
                command="python scripts/bench_ops.py " + " ".join(sys.argv[1:]))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_ops.json").write_text(json.dumps(dict(meta=meta, results=RESULTS), indent=1))
    lines = [f"Device: {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, liger {meta['liger']}; "
             f"measured copy {meta['copy_TBps']} TB/s, bf16 matmul {meta['mm_TFLOPs']} TFLOP/s.",
             f"Command: `{meta['command']}` (fwd+bwd, bf16, median of do_bench).", "",
             "ms = `do_bench` median (stream time: includes launch overhead when the CPU is the bottleneck); "
             "GPU ms = summed kernel time per step (torch.profiler); floor/x = floor over each.", "",
             "| op | impl | ms | host us | launches | GPU ms | floor ms | floor/ms | floor/GPU ms | peak extra MiB "
             "| note |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in RESULTS:
        if "error" in r:
            lines.append(f"| {r['op']} | {r['impl']} | error | | | | | | | | {r['error'][:120]} |")
        else:
            def cell(key, spec):  # case files may add rows of their own, without every column
                return format(r[key], spec) if key in r else ""
            lines.append(f"| {r['op']} | {r['impl']} | {cell('ms', '.3f')} | {cell('host_us', '.1f')} "
                         f"| {cell('launches', 'g')} | {cell('gpu_ms', '.3f')} | {cell('floor_ms', '.3f')} "
                         f"| {cell('floor_ratio', '.2f')} | {cell('gpu_floor_ratio', '.2f')} "
                         f"| {cell('peak_extra_MiB', '.0f')} | {r.get('note', '')} |")
    (out_dir / "bench_ops.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main():
    global FINGERPRINT, KERNEL_ROOT, COPY_BW, MM_RATE
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", help="bench cases (default: all in scripts/bench_cases/)")
    ap.add_argument("--fingerprint", help="write output/grad hashes of the hubfuse rows here instead of timing")
    ap.add_argument("--root", help="load the kernels from this tree (with --fingerprint: an older checkout)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two --fingerprint files and exit")
    args = ap.parse_args()
    if args.compare:
        a, b = (json.loads(Path(f).read_text()) for f in args.compare)
        common = sorted(set(a) & set(b))
        differ = [k for k in common if a[k] != b[k]]
        print(f"fingerprints: {len(common)} rows in both, {len(common) - len(differ)} bitwise equal, "
              f"{len(differ)} differ {differ}; only in {args.compare[0]}: {sorted(set(a) - set(b))}; only in "
              f"{args.compare[1]}: {sorted(set(b) - set(a))}", flush=True)
        sys.exit(1 if differ or not common else 0)
    if args.root:
        KERNEL_ROOT = Path(args.root).resolve()
    if args.fingerprint:
        FINGERPRINT, COPY_BW, MM_RATE = {}, 1.0, 1.0  # floors are not computed
    else:
        measure_ceilings()
    wanted = args.cases
    files = sorted(CASES.glob("*.py"))
    names = [f.stem for f in files]
    unknown = [w for w in wanted if w not in names]
    if unknown:
        sys.exit(f"unknown bench case(s) {unknown}; known: {names}")
    out_dir = Path(os.environ.get("OUT", ROOT / "out"))
    this = sys.modules[__name__]
    for f in files:
        if (wanted and f.stem not in wanted) or (FINGERPRINT is not None and f.stem == "launch"):
            continue
        print(f"\n=== {f.stem} ===", flush=True)
        spec = importlib.util.spec_from_file_location(f"bench_cases_{f.stem}", f)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
            module.run(this)
        except Exception as e:  # a broken case file must not lose the other results
            RESULTS.append(dict(op=f.stem, impl="(case file)", error=f"{type(e).__name__}: {str(e)[:300]}"))
            print(RESULTS[-1], flush=True)
        if FINGERPRINT is None:
            report(out_dir)  # keep partial results if a later case runs out of time
    if FINGERPRINT is not None:
        Path(args.fingerprint).parent.mkdir(parents=True, exist_ok=True)
        Path(args.fingerprint).write_text(json.dumps(FINGERPRINT, indent=1))
        print(f"fingerprints of {len(FINGERPRINT)} rows ({[r for r in RESULTS if 'error' in r] or 'no errors'}) "
              f"-> {args.fingerprint}", flush=True)
        return
    report(out_dir)


if __name__ == "__main__":
    main()
