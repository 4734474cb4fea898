"""Probe (GPU): where the MoE op's host time goes, call by call. Exploratory, not uploaded.

    python scripts/probe_moe_host.py [T E K H I]

Each line: the CPU time to enqueue one call while the GPU is held busy (probe_moe_overhead.host_ms), so no launch
waits on the device. Then a cProfile of public fwd + bwd steps, by own time.
"""
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "kernel_repos/moe/torch-ext"))
sys.path.insert(0, str(ROOT / "kernel_repos/moe/benchmarks"))
sys.path.insert(0, str(ROOT / "scripts"))
from probe_moe_overhead import SLEEP_CYCLES, cprofile_calls, host_ms  # noqa: E402
from tune_moe import make_inputs  # noqa: E402

import moe  # noqa: E402
from moe import ops, reference, triton_kernels as tk  # noqa: E402


def main():
    T, E, K, H, I = [int(v) for v in sys.argv[1:6]] if len(sys.argv) > 5 else (2048, 128, 8, 2048, 768)
    x, idx, w, gu, dn, dout = make_inputs(T, E, K, H, I, "cuda", torch.bfloat16)
    S = T * K
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; T={T} E={E} K={K} H={H} I={I}", flush=True)
    with torch.no_grad():
        s, o = reference.route(idx, E)
        out, gout, pos = tk.moe_fwd(x, idx, w, gu, dn, s, o)
    rt = tk._RowTiles(o, S)
    rt(128)
    rows = torch.randn(S, H, device="cuda", dtype=torch.bfloat16)
    act = torch.randn(S, I, device="cuda", dtype=torch.bfloat16)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, gu, dn)]
    xl, wl, gul, dnl = leaves

    def step():
        for t in leaves:
            t.grad = None
        moe.moe_experts(xl, idx, wl, gul, dnl).backward(dout)

    def fwd_grad():
        return ops.moe_experts_fwd(xl, idx, wl, gul, dnl)

    parts = {
        "route (sort + searchsorted)": lambda: reference.route(idx, E),
        "_RowTiles(...)(128) (tile map launch)": lambda: tk._RowTiles(o, S)(128),
        "_positions": lambda: tk._positions(s),
        "_combine": lambda: tk._combine(rows, pos, idx, w, T, H, E, x.dtype),
        "_gather_rows": lambda: tk._gather_rows(x, s, K, rows),
        "_rows_gemm down_fwd": lambda: tk._rows_gemm("down_fwd", act, dn, rt, o, rows),
        "_k_grouped_mm (down wgrad)": lambda: tk._k_grouped_mm(rows, act, o),
        "_swiglu_bwd_rows": lambda: tk._swiglu_bwd_rows(act, gout, s, w, o, gout),
        "_check_inputs": lambda: ops._check_inputs(x, idx, w, gu, dn),
        "moe_fwd (direct, routing outside)": lambda: tk.moe_fwd(x, idx, w, gu, dn, s, o),
        "moe_bwd (direct)": lambda: tk.moe_bwd(dout, x, idx, w, gu, dn, gout, s, o, pos, reuse_gate_up_out=True),
        "custom op fwd, no grad": lambda: ops.moe_experts_fwd(x, idx, w, gu, dn),
        "custom op fwd, grad recorded": fwd_grad,
        "custom op bwd": lambda: ops.moe_experts_bwd(dout, x, idx, w, gu, dn, gout, s, o, pos),
        "public fwd + bwd step": step,
    }
    for name, fn in parts.items():
        print(f"host ms {name}: {host_ms(fn, steps=20):.3f}", flush=True)
    # the torch profiler's CPU view (ATen ops and CUDA runtime / driver calls, self time) of the custom op's forward
    # and of the direct forward: what the op's own dispatch adds
    from torch.profiler import ProfilerActivity, profile

    for name, fn in (("custom op fwd, no grad", parts["custom op fwd, no grad"]),
                     ("route + moe_fwd (direct)", lambda: tk.moe_fwd(x, idx, w, gu, dn, *reference.route(idx, E)))):
        fn()
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                fn()
        torch.cuda.synchronize()
        print(f"--- torch profiler, 10 calls of {name}, by self CPU time", flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60),
              flush=True)
    cprofile_calls(step, 10).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
