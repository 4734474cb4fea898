"""Probe (GPU): the backward's dx combine and x-row gather as two passes or one (`_combine(..., refill=x)`).
Exploratory, not uploaded.

    python scripts/probe_moe_refill.py [T E K H I] [--rounds 40]
"""
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "kernel_repos/moe/torch-ext"))
sys.path.insert(0, str(ROOT / "kernel_repos/moe/benchmarks"))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_ops import round_robin_ms  # noqa: E402
from moe import reference, triton_kernels as tk  # noqa: E402
from probe_moe_ws import probe_args  # noqa: E402
from tune_moe import make_inputs  # noqa: E402


def main():
    a = probe_args(40)
    T, E, K, H, I = a.shape
    x, idx, w, gu, dn, dout = make_inputs(T, E, K, H, I, "cuda", torch.bfloat16)
    S = T * K
    slot, offs = reference.route(idx, E)
    pos = tk._positions(slot)
    rows = torch.randn(S, H, device="cuda", dtype=torch.bfloat16)
    ref_out = tk._combine(rows, pos, idx, None, T, H, E, rows.dtype)
    buf = rows.clone()
    out = tk._combine(buf, pos, idx, None, T, H, E, rows.dtype, refill=x)
    print(f"combine with refill: out bitwise equal {torch.equal(out, ref_out)}, "
          f"rows == gathered x {torch.equal(buf, x[slot // K])}", flush=True)
    scratch = rows.clone()
    steps = {
        "combine": lambda: tk._combine(scratch, pos, idx, None, T, H, E, rows.dtype),
        "gather": lambda: tk._gather_rows(x, slot, K, scratch),
        "combine + gather": lambda: (tk._combine(scratch, pos, idx, None, T, H, E, rows.dtype),
                                     tk._gather_rows(x, slot, K, scratch)),
        "combine with refill": lambda: tk._combine(scratch, pos, idx, None, T, H, E, rows.dtype, refill=x),
    }
    for name, ms in round_robin_ms(steps, a.rounds).items():
        print(f"  {name:>20}: {ms * 1e3:.1f} us", flush=True)


if __name__ == "__main__":
    main()
