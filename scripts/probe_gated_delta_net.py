#!/usr/bin/env python
"""Gated delta rule on one GPU: timings (fwd, fwd+bwd), per-kernel times, host time and launches per call,
accuracy against a float64 run of transformers' code, a sweep of our launch settings, and the peers
(transformers' torch path; flash-linear-attention 0.6.0 with its Hopper guard bypassed, timing anchor only).

    python scripts/probe_gated_delta_net.py [--budget SECONDS]
        [--sections timing,eager,fla,bench_ops,accuracy,sweep,layer]

Shapes: transformers' Qwen3_5MoeTextConfig defaults (16 key / 32 value heads, head dims 128, bf16), batch
8 x 1024 and 2 x 8192, use_qk_l2norm_in_kernel=True. Sections run in the given order while the budget lasts;
results go to $OUT/probe_gated_delta_net.json and a table is printed last.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_case_gated_delta_net",
                                               ROOT / "scripts" / "bench_cases" / "gated_delta_net.py")
_case = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_case)
HK, HV, D, SHAPES, _fla, make = _case.HK, _case.HV, _case.D, _case.SHAPES, _case._fla, _case.make

DEV, DT = "cuda", torch.bfloat16
RESULTS: dict = {"meta": {}, "timing": [], "kernels": {}, "host": [], "accuracy": [], "sweep": [], "notes": []}
T_START = time.time()


def left(budget):
    return budget - (time.time() - T_START)


def load():
    import kernels

    subprocess.run([sys.executable, str(ROOT / "scripts" / "build.py"), "gated-delta-net"], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL)
    kg = kernels.get_local_kernel(ROOT / "kernel_repos" / "gated-delta-net")
    return kg, importlib.import_module(kg.__name__ + ".triton_kernels")


def ours_fn(kg):
    return lambda q, k, v, g, b: kg.chunk_gated_delta_rule(q, k, v, g, b, use_qk_l2norm_in_kernel=True)[0]


def eager_fn(kg):
    return lambda q, k, v, g, b: kg.chunk_gated_delta_rule_hf(q, k, v, g, b, use_qk_l2norm_in_kernel=True)[0]


def fla_fn(fla):
    return lambda q, k, v, g, b: fla(q, k, v, g, b, use_qk_l2norm_in_kernel=True)[0]


def bench_pair(fn, inputs, rep=100):
    """(fwd ms, fwd+bwd ms) medians of do_bench."""
    out = fn(*inputs)
    grad = torch.randn_like(out)

    def fwd():
        with torch.no_grad():
            fn(*inputs)

    def step():
        for t in inputs:
            t.grad = None
        fn(*inputs).backward(grad)

    step()
    torch.cuda.synchronize()
    return (triton.testing.do_bench(fwd, warmup=10, rep=rep, return_mode="median"),
            triton.testing.do_bench(step, warmup=10, rep=rep, return_mode="median"))


def kernel_times(fn, inputs, steps=5):
    """{kernel name: ms per fwd+bwd step} and launches per step, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    out = fn(*inputs)
    grad = torch.randn_like(out)

    def step():
        for t in inputs:
            t.grad = None
        fn(*inputs).backward(grad)

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    table, launches = {}, 0
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.self_device_time_total > 0:
            table[e.key[:60]] = round(e.self_device_time_total / steps / 1e3, 4)
            launches += e.count
    return dict(sorted(table.items(), key=lambda kv: -kv[1])), launches / steps


def host_ms(fn, inputs, calls=20):
    """Median host time of one fwd+bwd call with an idle GPU queue (launch overhead, no waiting)."""
    out = fn(*inputs)
    grad = torch.randn_like(out)
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for t in inputs:
            t.grad = None
        fn(*inputs).backward(grad)
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def section_timing(kg, tk, budget):
    for B, T in SHAPES:
        for label, heads in (("native", HK), ("repeated", HV)):
            if left(budget) < 30:
                return
            inputs = make(B, T, heads, DEV, DT)
            fwd, fb = bench_pair(ours_fn(kg), inputs)
            RESULTS["timing"].append(dict(shape=f"{B}x{T}", impl=f"hubfuse ({label})", fwd_ms=round(fwd, 4),
                                          fwd_bwd_ms=round(fb, 4)))
            print(RESULTS["timing"][-1], flush=True)
            if label == "native":
                table, launches = kernel_times(ours_fn(kg), inputs)
                RESULTS["kernels"][f"{B}x{T}"] = table
                RESULTS["host"].append(dict(shape=f"{B}x{T}", host_ms=round(host_ms(ours_fn(kg), inputs), 3),
                                            launches=launches))
                print(table, RESULTS["host"][-1], flush=True)
            del inputs
            torch.cuda.empty_cache()


def section_eager(kg, budget):
    for B, T in SHAPES:
        if left(budget) < 40:
            return
        fwd, fb = bench_pair(eager_fn(kg), make(B, T, HV, DEV, DT), rep=200)
        RESULTS["timing"].append(dict(shape=f"{B}x{T}", impl="transformers torch path (repeated)",
                                      fwd_ms=round(fwd, 3), fwd_bwd_ms=round(fb, 3)))
        print(RESULTS["timing"][-1], flush=True)
        torch.cuda.empty_cache()


def section_fla(budget, layouts=(("repeated", HV),)):
    fla = _fla()
    if fla is None:
        RESULTS["notes"].append("flash-linear-attention not importable")
        return
    for B, T in SHAPES:
        for label, heads in layouts:
            if left(budget) < 40:
                return
            t0 = time.time()
            try:
                fwd, fb = bench_pair(fla_fn(fla), make(B, T, heads, DEV, DT))
            except Exception as e:  # noqa: BLE001 - a peer failing must not lose our results
                RESULTS["notes"].append(f"FLA {B}x{T} {label}: {type(e).__name__}: {str(e)[:200]}")
                continue
            RESULTS["timing"].append(dict(shape=f"{B}x{T}", impl=f"FLA 0.6.0 ({label}, guard bypassed)",
                                          fwd_ms=round(fwd, 4), fwd_bwd_ms=round(fb, 4),
                                          wall_s=round(time.time() - t0, 1)))
            print(RESULTS["timing"][-1], flush=True)
            torch.cuda.empty_cache()


def section_bench_ops(kg, budget):
    """scripts/bench_ops.py's gated_delta_net case in this process (FLA's autotuning is shared with the fla
    section): fwd+bwd do_bench, GPU kernel time, peak extra memory, I/O floor. Writes $OUT/bench_ops.md."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_ops as h

    h.measure_ceilings()
    h._LOADED["gated-delta-net"] = kg
    _case.run(h)
    h.report(Path(os.environ.get("OUT", ROOT / "out")))


def _errors(out, grads, ref_out, ref_grads):
    rows = {}
    for name, a, r in zip(["o", "dq", "dk", "dv", "dg", "dbeta"], [out, *grads], [ref_out, *ref_grads]):
        a, r = a.double(), r.double()
        rows[name] = dict(rel_l2=float((a - r).norm() / r.norm()),
                          rel_max=float((a - r).abs().max() / r.abs().max()))
    return rows


def section_accuracy(kg, budget, shapes=((1, 300), (2, 1024)), with_fla=True):
    """bf16 inputs; float64 oracle = transformers' chunked code in float64 on the same inputs (key heads repeated
    in the graph, so every impl's dq/dk are per key head)."""
    fla = _fla()
    for B, T in shapes:
        if left(budget) < 40:
            return
        base = make(B, T, HK, DEV, DT, seed=1)
        upstream = torch.randn(B, T, HV, D, device=DEV, dtype=DT)
        rep = lambda x: x.repeat_interleave(HV // HK, 2)  # noqa: E731

        def run(fn, dtype=None, repeat=True):
            leaves = [t.detach().clone().to(dtype or t.dtype).requires_grad_() for t in base]
            q, k, v, g, b = leaves
            o = fn(rep(q) if repeat else q, rep(k) if repeat else k, v, g, b)
            grads = torch.autograd.grad(o, leaves, upstream.to(o.dtype))
            return o, grads

        ref = run(lambda q, k, v, g, b: kg.chunk_gated_delta_rule_hf(q, k, v, g, b, use_qk_l2norm_in_kernel=True,
                                                                     compute_dtype=torch.float64)[0],
                  dtype=torch.float64)
        impls = [("transformers torch path, bf16 in (eager)", eager_fn(kg), True),
                 ("hubfuse (native)", ours_fn(kg), False), ("hubfuse (repeated)", ours_fn(kg), True)]
        if fla is not None and with_fla:
            impls.append(("FLA 0.6.0 (repeated, guard bypassed)", fla_fn(fla), True))
        for name, fn, repeat in impls:
            try:
                errs = _errors(*run(fn, repeat=repeat), *ref)
            except Exception as e:  # noqa: BLE001
                RESULTS["notes"].append(f"accuracy {name}: {type(e).__name__}: {str(e)[:200]}")
                continue
            RESULTS["accuracy"].append(dict(shape=f"{B}x{T}", impl=name, **{k: v for k, v in errs.items()}))
            print(name, B, T, {k: f"{v['rel_l2']:.2e}/{v['rel_max']:.2e}" for k, v in errs.items()}, flush=True)
        torch.cuda.empty_cache()


SWEEP = [
    ("grads nw8", {"grads": dict(num_warps=8, num_stages=2)}),
    ("solve nw2 bk32", {"solve": dict(num_warps=2, num_stages=2, block_k=32)}),
    ("recurrence nw4 ns2 bv32", {"recurrence": dict(num_warps=4, num_stages=2, block_v=32)}),
    ("wu nw8", {"wu": dict(num_warps=8, num_stages=2, block_v=64)}),
]


def section_sweep(kg, tk, budget):
    default = {k: dict(v) for k, v in tk.CONFIG.items()}
    for label, change in SWEEP:
        if left(budget) < 45:
            return
        for key, cfg in change.items():
            tk.CONFIG[key] = dict(cfg)
        try:
            row = dict(config=label)
            for B, T in SHAPES:
                inputs = make(B, T, HK, DEV, DT)
                fwd, fb = bench_pair(ours_fn(kg), inputs, rep=60)
                row[f"{B}x{T} fwd"], row[f"{B}x{T} fwd+bwd"] = round(fwd, 4), round(fb, 4)
            RESULTS["sweep"].append(row)
            print(row, flush=True)
        except Exception as e:  # noqa: BLE001
            RESULTS["sweep"].append(dict(config=label, error=f"{type(e).__name__}: {str(e)[:200]}"))
        finally:
            for key, cfg in default.items():
                tk.CONFIG[key] = dict(cfg)
            torch.cuda.empty_cache()


def section_layer(kg, budget):
    """The whole GatedDeltaNet module (projections, conv, rule, gated norm, out_proj), fwd+bwd, B=8 x 1024,
    Qwen3.5-MoE dims: our Layer vs transformers' module (whose rule is FLA here, guard bypassed)."""
    if left(budget) < 60:
        return
    import types

    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as M
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    _fla()  # bypass FLA's guard: transformers' module picks FLA's rule when it is installed
    cfg = Qwen3_5MoeTextConfig(layer_types=["linear_attention"] * 40)
    hf = M.Qwen3_5MoeGatedDeltaNet(cfg, 0).to(DEV, DT)
    ours = kg.layers.GatedDeltaNetLayout(cfg, 0).to(DEV, DT)
    ours.load_state_dict(hf.state_dict())
    ours.forward = types.MethodType(kg.layers.GatedDeltaNet.forward, ours)
    x = torch.randn(8, 1024, cfg.hidden_size, device=DEV, dtype=DT, requires_grad=True)
    for name, mod in (("transformers GatedDeltaNet (FLA rule)", hf), ("hubfuse GatedDeltaNet", ours)):
        try:
            fwd, fb = bench_pair(lambda x, m=mod: m(x), [x])
            RESULTS["timing"].append(dict(shape="layer 8x1024", impl=name, fwd_ms=round(fwd, 4),
                                          fwd_bwd_ms=round(fb, 4)))
            print(RESULTS["timing"][-1], flush=True)
        except Exception as e:  # noqa: BLE001
            RESULTS["notes"].append(f"layer {name}: {type(e).__name__}: {str(e)[:200]}")


def report(out_dir: Path):
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "probe_gated_delta_net.json").write_text(json.dumps(RESULTS, indent=1))
    lines = [f"{RESULTS['meta']}", "", "| shape | impl | fwd ms | fwd+bwd ms |", "| --- | --- | ---: | ---: |"]
    for r in RESULTS["timing"]:
        lines.append(f"| {r['shape']} | {r['impl']} | {r['fwd_ms']} | {r['fwd_bwd_ms']} |")
    lines += ["", "| shape | impl | " + " | ".join(["o", "dq", "dk", "dv", "dg", "dbeta"]) + " |",
              "| --- | --- |" + " ---: |" * 6]
    for r in RESULTS["accuracy"]:
        cells = [f"{r[k]['rel_l2']:.1e} / {r[k]['rel_max']:.1e}" for k in ["o", "dq", "dk", "dv", "dg", "dbeta"]]
        lines.append(f"| {r['shape']} | {r['impl']} | " + " | ".join(cells) + " |")
    lines += ["", f"host/launches: {RESULTS['host']}", "", "sweep:"] + [json.dumps(r) for r in RESULTS["sweep"]]
    lines += ["", "notes:"] + RESULTS["notes"]
    (out_dir / "probe_gated_delta_net.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=480)
    ap.add_argument("--sections", default="timing,eager,fla,bench_ops,accuracy,sweep,layer")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", ROOT / "out"))
    RESULTS["meta"] = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           command="python scripts/probe_gated_delta_net.py " + " ".join(sys.argv[1:]))
    kg, tk = load()
    RESULTS["meta"]["config"] = {k: dict(v) for k, v in tk.CONFIG.items()}
    for name in args.sections.split(","):
        if left(args.budget) < 30:
            RESULTS["notes"].append(f"section {name} skipped: budget")
            continue
        t0 = time.time()
        try:
            {"timing": lambda: section_timing(kg, tk, args.budget),
             "accuracy": lambda: section_accuracy(kg, args.budget),
             "eager": lambda: section_eager(kg, args.budget),
             "sweep": lambda: section_sweep(kg, tk, args.budget),
             "fla": lambda: section_fla(args.budget),
             "bench_ops": lambda: section_bench_ops(kg, args.budget),
             "layer": lambda: section_layer(kg, args.budget)}[name]()
        except Exception as e:  # noqa: BLE001 - keep what was measured
            RESULTS["notes"].append(f"section {name}: {type(e).__name__}: {str(e)[:300]}")
        RESULTS["notes"].append(f"section {name}: {time.time() - t0:.0f} s")
        report(out_dir)
    report(out_dir)


if __name__ == "__main__":
    main()
