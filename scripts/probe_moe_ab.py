"""Probe (GPU): the public MoE op of two source trees side by side, timed call by call. Exploratory, not uploaded.

    python scripts/probe_moe_ab.py OTHER_PARENT OTHER_NAME [T E K H I] [--rounds 60] [--impl grouped_mm_lean]

OTHER_PARENT/OTHER_NAME is another copy of the `moe` package under another name, e.g. an older commit's:

    git archive HEAD~1 kernel_repos/moe/torch-ext/moe | tar -x -C /tmp && mkdir -p out/ab &&
    mv /tmp/kernel_repos/moe/torch-ext/moe out/ab/moe_old       # then: OTHER_PARENT=out/ab OTHER_NAME=moe_old

Both are imported side by side (each registers its custom ops under a namespace derived from its package name),
fed the same inputs, and one fwd + bwd step (`moe_experts` through autograd, routing included) of each is timed
alternately with CUDA events, `--rounds` times (medians), so that clock and power drift hit both alike. Prints
both medians, their ratio and the largest difference between the two trees' outputs and grads.
"""
import argparse
import importlib
import sys
from pathlib import Path

import torch

from bench_ops import round_robin_ms  # scripts/ is on the path when run as a script

ROOT = Path(__file__).resolve().parents[1]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("other_parent")
    p.add_argument("other_name")
    p.add_argument("shape", nargs="*", type=int, default=[8192, 128, 8, 2048, 768])
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--impl", default=None, help="GPU_CONFIGS['backward']['impl'] for both trees")
    a = p.parse_args()
    T, E, K, H, I = a.shape
    sys.path.insert(0, str(ROOT / "kernel_repos/moe/torch-ext"))
    sys.path.insert(0, str(Path(a.other_parent).resolve()))
    sys.path.insert(0, str(ROOT / "kernel_repos/moe/benchmarks"))
    from tune_moe import make_inputs
    trees = {"this tree": importlib.import_module("moe"), a.other_name: importlib.import_module(a.other_name)}
    if a.impl:
        for pkg in trees.values():
            tk = importlib.import_module(pkg.__name__ + ".triton_kernels")
            tk.GPU_CONFIGS["backward"] = dict(tk.GPU_CONFIGS["backward"], impl=a.impl)

    dev, dt = "cuda", torch.bfloat16
    x, idx, w, gu, dn, dout = make_inputs(T, E, K, H, I, dev, dt)
    leaves = tuple(t.requires_grad_() for t in (x, w, gu, dn))

    def step(pkg):
        for t in leaves:
            t.grad = None
        out = pkg.moe_experts(x, idx, w, gu, dn)
        out.backward(dout)
        return out

    results = {}
    for name, pkg in trees.items():
        out = step(pkg)
        results[name] = [out.detach().float()] + [t.grad.float() for t in leaves]
    (ra, rb) = results.values()
    diffs = [(u - v).abs().max().item() / max(v.abs().max().item(), 1e-30) for u, v in zip(ra, rb)]
    print(f"T={T} E={E} K={K} H={H} I={I}; max |this - other| / max |other| (out, dx, dw, dgu, ddn): "
          + " ".join(f"{d:.1e}" for d in diffs), flush=True)

    med = round_robin_ms({name: (lambda pkg=pkg: step(pkg)) for name, pkg in trees.items()}, a.rounds, warmup=5)
    flops = 3 * T * K * (2 * H * 2 * I + 2 * I * H)
    for name, ms in med.items():
        print(f"  {name:12s} {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s)", flush=True)
    this, other = med.values()
    print(f"  this tree vs {a.other_name}: {100 * (other / this - 1):+.1f} % ({a.rounds} alternating rounds)",
          flush=True)


if __name__ == "__main__":
    main()
