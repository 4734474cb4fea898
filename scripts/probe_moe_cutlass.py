"""Probe (GPU): torch._grouped_mm (CUTLASS M-grouped) for each of the MoE row GEMMs vs our Triton kernels,
and the launch-gap share of route+fwd+bwd (stream time vs CUDA-graph replay). Exploratory, not uploaded.

    python scripts/probe_moe_cutlass.py
"""
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernel_repos/moe/torch-ext"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernel_repos/moe/benchmarks"))
from moe import reference, triton_kernels as tk  # noqa: E402
from tune_moe import make_inputs  # noqa: E402

from probe_moe_overhead import graph_ms  # noqa: E402


def bench(fn, rep=100):
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def main():
    T, E, K, H, I = 8192, 128, 8, 2048, 768
    S = T * K
    x, idx, w, gu, dn, dout = make_inputs(T, E, K, H, I, "cuda", torch.bfloat16)
    slot, offs = reference.route(idx, E)
    offs32 = offs[1:]  # group ends (int32); offsets[0] == 0 here (no negative ids)
    row_token = slot // K
    x_rows = x[row_token]
    dy_rows = dout[row_token]
    act = torch.randn(S, I, device="cuda", dtype=torch.bfloat16)
    dgu = torch.randn(S, 2 * I, device="cuda", dtype=torch.bfloat16)

    def tf(ms, flop):
        return f"{ms:.3f} ms ({flop / ms / 1e9:.0f} TFLOP/s)"

    f_gu, f_dn = 2 * S * H * 2 * I, 2 * S * H * I
    cases = [
        ("down_bwd_act mainloop: dy_rows @ Wd[e]   (S,H)x(E,H,I)", lambda: torch._grouped_mm(dy_rows, dn, offs=offs32), f_dn),
        ("gate_up_bwd_x: dgu @ Wgu[e]              (S,2I)x(E,2I,H)", lambda: torch._grouped_mm(dgu, gu, offs=offs32), f_gu),
        ("gate_up_fwd: x_rows @ Wgu[e]^T  (view)   (S,H)x(E,H,2I)^T", lambda: torch._grouped_mm(x_rows, gu.transpose(1, 2), offs=offs32), f_gu),
        ("down_fwd: act @ Wd[e]^T  (view)          (S,I)x(E,I,H)^T", lambda: torch._grouped_mm(act, dn.transpose(1, 2), offs=offs32), f_dn),
    ]
    gu_t, dn_t = gu.transpose(1, 2).contiguous(), dn.transpose(1, 2).contiguous()
    cases += [
        ("gate_up_fwd, weight pre-transposed (E,H,2I) row-major", lambda: torch._grouped_mm(x_rows, gu_t, offs=offs32), f_gu),
        ("down_fwd, weight pre-transposed (E,I,H) row-major", lambda: torch._grouped_mm(act, dn_t, offs=offs32), f_dn),
        ("gather dout rows (S,H)", lambda: tk._gather_rows(dout, slot, K, torch.empty_like(dy_rows)), 0),
    ]
    for name, fn, flop in cases:
        ms = bench(fn)
        print(f"  {name:58s} {tf(ms, flop) if flop else f'{ms:.3f} ms'}", flush=True)

    # launch gaps: route+fwd+bwd on the stream vs the same captured in one CUDA graph
    def step():
        s, o = reference.route(idx, E)
        out, gout, pos = tk.moe_fwd(x, idx, w, gu, dn, s, o)
        return tk.moe_bwd(dout, x, idx, w, gu, dn, gout, s, o, pos)

    eager = bench(step)
    graph = graph_ms(step)
    flops = 3 * (f_gu + f_dn)
    print(f"  route+fwd+bwd stream {tf(eager, flops)}; CUDA graph replay {tf(graph, flops)}", flush=True)


if __name__ == "__main__":
    main()
