#!/usr/bin/env python
"""Launch-setting sweep of the Gated DeltaNet kernels (GPU): per-kernel GPU time for each setting, one at a time.

    python scripts/sweep_gated_delta_net.py                       # the default variants, both workloads
    python scripts/sweep_gated_delta_net.py --variants conv_bwd:block_t=32 solve:num_warps=2
    python scripts/sweep_gated_delta_net.py --variants base grads:split=0 grads_dk:num_warps=4
    python scripts/sweep_gated_delta_net.py --root OTHER_TREE     # another checkout's kernels
    python scripts/sweep_gated_delta_net.py --workloads long mid --variants base --fla   # per kernel against FLA

Workloads (bf16, Qwen3.5-MoE's 16 key / 32 value heads, head dims 128):
- `layer`: `gated_delta_net_core` (conv1d + SiLU + the chunked rule with the gate from a, b) fwd+bwd at the
  step's 8 x 2048 tokens (scripts/bench.py's qwen3_5_moe slice);
- `long`: `chunk_gated_delta_rule` fwd+bwd at 1 x 32768 tokens, q/k l2norm in the kernel;
- `mid` (not by default): the rule at 2 x 8192 tokens;
- `dense` / `packed` (not by default): the rule at 8 x 1024 tokens, and the same tokens as one row split into the 8
  sequences by `cu_seqlens` (where packed input loses time).
A variant `family:key=value,...` overrides the launch settings of one kernel family (`conv_fwd`, `conv_bwd` in
triton_conv1d.CONV_CONFIG; `solve`, `wu`, `recurrence`, `output`, `grads`, `grads_dq`, `grads_dk` in
triton_chunk.CONFIG) on top of the tree's own, several families joined by `+` (`grads:split=0` runs the gradient
kernel as one kernel, with the `grads` settings, instead of its two halves `_grads_dq_kernel` and `_grads_dk_kernel`,
whose settings are `grads_dq`, `grads_dk`);
`maxnreg=N` caps a family's registers a thread (`triton_chunk._options`; not the serial recurrences);
`base` is the tree's settings. Each (variant, workload): 3 warm-up steps, then torch.profiler over --steps steps
(each step's gradients written afresh, no accumulation); the line gives the summed GPU ms per step and each
kernel's. `--fla`: then flash-linear-attention's chunk_gated_delta_rule on each rule workload's inputs (q, k
repeated to the 32 value heads, as transformers calls it; FLA from $HUBFUSE_FLA_SITE, its Hopper guard bypassed: a
timing anchor, scripts/bench_cases/gated_delta_net.py), each of its kernels, and the first variant's total over
FLA's. Output: stdout and $OUT/sweep_gated_delta_net.txt.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_ops as h  # noqa: E402

HK, HV, D, W = 16, 32, 128, 4
FAMILIES = ("conv_fwd", "conv_bwd", "solve", "wu", "recurrence", "output", "grads", "grads_dq", "grads_dk")
DEFAULT_VARIANTS = [
    "base",
    "conv_fwd:block_t=32,block_c=64", "conv_fwd:block_t=16,block_c=256",
    "conv_bwd:block_t=32", "conv_bwd:block_t=128,num_warps=8", "conv_bwd:block_t=32,block_c=128",
    "conv_bwd:block_c=32", "conv_bwd:num_warps=8",
    "solve:num_warps=1", "solve:num_warps=2", "solve:block_k=64", "solve:num_warps=2,block_k=64", "solve:num_stages=1",
    "wu:num_warps=8", "wu:block_v=64", "wu:num_stages=2",
    "recurrence:block_v=32", "recurrence:num_warps=4", "recurrence:num_stages=2", "recurrence:num_warps_few=8",
    "output:block_v=64", "output:num_warps=8",
    "grads:split=0", "grads:split=0,num_warps=16", "grads:split=0,block_v=16",
    "grads_dq:num_warps=8", "grads_dq:num_stages=3", "grads_dq:block_v=32",
    "grads_dk:num_warps=4", "grads_dk:num_stages=2", "grads_dk:block_v=32", "grads_dk:block_v=16",
]


def layer_workload(kg, dev, dt):
    B, S = 8, 2048
    C = 2 * HK * D + HV * D
    torch.manual_seed(0)
    mixed = torch.randn(B, S, C, device=dev, dtype=dt, requires_grad=True)
    conv_w = (torch.randn(C, W, device=dev) / W ** 0.5).to(dt).requires_grad_()
    a = torch.randn(B, S, HV, device=dev, dtype=dt, requires_grad=True)
    b = torch.randn(B, S, HV, device=dev, dtype=dt, requires_grad=True)
    A_log = torch.log(torch.empty(HV, device=dev).uniform_(1, 16)).to(dt).requires_grad_()
    dt_bias = torch.rand(HV, device=dev).to(dt).requires_grad_()
    grad = torch.randn(B, S, HV, D, device=dev, dtype=dt)

    def step():
        _clear_grads(mixed, conv_w, a, b, A_log, dt_bias)
        out = kg.gated_delta_net_core(mixed, conv_w, None, a, b, A_log, dt_bias, HK, D, D)
        out.backward(grad)
    return step


def _clear_grads(*leaves):
    """Each step's backward writes the leaves' gradients afresh (no accumulation kernels in its GPU time)."""
    for t in leaves:
        t.grad = None


def rule_workload(kg, dev, dt, B, T, packed=False, fla=None):
    """fwd+bwd of the rule on B x T tokens, or (packed) the same tokens as one row split by cu_seqlens; `fla`:
    FLA's rule in place of ours, q and k given with the key heads repeated to the value heads."""
    cu = torch.arange(0, B * T + 1, T, device=dev, dtype=torch.int32) if packed else None
    if packed:
        B, T = 1, B * T
    torch.manual_seed(0)
    key_heads = HV if fla is not None else HK
    q = torch.randn(B, T, key_heads, D, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(B, T, key_heads, D, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(B, T, HV, D, device=dev, dtype=dt, requires_grad=True)
    g = F.logsigmoid(torch.randn(B, T, HV, device=dev) + 3.0).requires_grad_()
    beta = torch.sigmoid(torch.randn(B, T, HV, device=dev)).to(dt).requires_grad_()
    grad = torch.randn(B, T, HV, D, device=dev, dtype=dt)

    rule = fla if fla is not None else kg.chunk_gated_delta_rule

    def step():
        _clear_grads(q, k, v, g, beta)
        out = rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)[0]
        out.backward(grad)
    step.leaves = (q, k, v, g, beta)
    return step


def load_fla():
    """FLA's chunk_gated_delta_rule as scripts/bench_cases/gated_delta_net.py loads it (its own site dir, the Hopper
    guard of its gated backward bypassed)."""
    spec = importlib.util.spec_from_file_location("bench_cases_gated_delta_net", h.CASES / "gated_delta_net.py")
    case = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(case)
    fla = case._fla()
    if fla is None:
        raise SystemExit("--fla: flash-linear-attention is not importable (set HUBFUSE_FLA_SITE to its site dir)")
    return fla


def parse_variant(text: str) -> dict:
    """{family: {setting: value}} of a variant (base: none)."""
    if text == "base":
        return {}
    overrides = {}
    for part in text.split("+"):
        family, _, settings = part.partition(":")
        if family not in FAMILIES or not settings:
            raise SystemExit(f"--variants: {text!r}: expected base or FAMILY:key=value,... joined by + "
                             f"(FAMILY: {', '.join(FAMILIES)})")
        overrides[family] = {k: int(v) for k, v in (item.split("=") for item in settings.split(","))}
    return overrides


def kernel_times(step, steps: int, every_kernel: bool = False) -> dict:
    """GPU ms per step of each of our kernels (names starting with "_"), the rest as "other"; `every_kernel`: of
    every kernel by name."""
    _, prof = h.wall_and_profile(step, steps, warmup=3)
    times = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.self_device_time_total > 0:
            name = e.key if every_kernel or e.key.startswith("_") else "other"
            times[name] = times.get(name, 0.0) + e.self_device_time_total / steps / 1e3
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    p.add_argument("--workloads", nargs="+", default=["layer", "long"], choices=["layer", "long", "mid", "dense", "packed"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--root", help="another checkout whose kernels to load")
    p.add_argument("--budget-s", type=float, default=1e9, help="stop starting variants after this many seconds")
    p.add_argument("--fla", action="store_true", help="then FLA on each rule workload (long, mid, dense, packed)")
    args = p.parse_args(argv)
    variants = [(v, parse_variant(v)) for v in args.variants]
    fla = load_fla() if args.fla else None
    if args.root:
        h.KERNEL_ROOT = Path(args.root).resolve()
    kg = h.load_kernel("gated-delta-net")
    dev, dt = "cuda", torch.bfloat16
    rules = {"long": dict(B=1, T=32768), "mid": dict(B=2, T=8192), "dense": dict(B=8, T=1024),
             "packed": dict(B=8, T=1024, packed=True)}
    steps = {name: layer_workload(kg, dev, dt) if name == "layer" else rule_workload(kg, dev, dt, **rules[name])
             for name in args.workloads}
    for step in steps.values():  # imports the Triton modules (lazily imported by the ops)
        step()
    pkg = kg.__name__
    # the workloads that ran may not have imported both (the conv runs in `layer` only)
    conv_config = importlib.import_module(f"{pkg}.triton_conv1d").CONV_CONFIG
    chunk_config = importlib.import_module(f"{pkg}.triton_chunk").CONFIG
    tables = {f"conv_{name}": conv_config[name] for name in conv_config} | dict(chunk_config)
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, base settings: "
             + ", ".join(f"{k} {v}" for k, v in tables.items())]
    print(lines[0], flush=True)
    t0 = time.time()
    first_totals = {}
    for text, overrides in variants:
        if time.time() - t0 > args.budget_s:
            lines.append(f"{text}: not run (budget)")
            print(lines[-1], flush=True)
            continue
        saved = {family: dict(tables[family]) for family in overrides}
        for family, settings in overrides.items():
            tables[family].update(settings)
        try:
            for name, step in steps.items():
                times = kernel_times(step, args.steps)
                ours = {k: v for k, v in sorted(times.items(), key=lambda kv: -kv[1]) if k != "other"}
                line = (f"{text:45s} {name:5s} gpu {sum(times.values()):7.3f} ms | "
                        + " ".join(f"{k} {v:.3f}" for k, v in ours.items()) + f" other {times.get('other', 0):.3f}")
                lines.append(line)
                print(line, flush=True)
                first_totals.setdefault(name, (text, sum(times.values())))
        except Exception as e:  # noqa: BLE001 - a setting that does not compile or fit is a result too
            lines.append(f"{text:45s} error {type(e).__name__}: {str(e)[:200]}")
            print(lines[-1], flush=True)
        finally:
            for family, settings in saved.items():
                tables[family].clear()
                tables[family].update(settings)
    for name in (n for n in args.workloads if fla is not None and n in rules):
        times = kernel_times(rule_workload(kg, dev, dt, **rules[name], fla=fla), args.steps, every_kernel=True)
        total = sum(times.values())
        ratio = ""
        if name in first_totals:  # the first variant that ran
            ratio = f" | {first_totals[name][0]} / FLA {first_totals[name][1] / total:.3f}x"
        lines.append(f"{'FLA (q, k repeated to the value heads)':45s} {name:5s} gpu {total:7.3f} ms{ratio} | "
                     + " | ".join(f"{k[:60]} {v:.3f}" for k, v in sorted(times.items(), key=lambda kv: -kv[1])))
        print(lines[-1], flush=True)
    (out_dir / "sweep_gated_delta_net.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
