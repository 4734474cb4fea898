"""Probe (GPU): the MoE weight grads as Triton K-grouped GEMMs with a TMA operand, against torch._grouped_mm
(CUTLASS) on gathered rows. Exploratory, not uploaded.

    python scripts/probe_moe_wgrad.py [T E K H I] [--rounds 30]
    TRITON_INTERPRET=1 python scripts/probe_moe_wgrad.py 40 6 2 64 32 --rounds 1   # CPU: checks only

dW[e] = A[rows_e]^T @ B[rows_e] over expert e's sorted rows (K-grouped). The shipped Triton kernel
(`_weight_grad_kernel`) reads both operands through pointers; here A (the expert-sorted rows: dgate_up_out for
dWgu, dout rows for dWd) comes through a tensor descriptor in (BLOCK_K, BLOCK_M) blocks. A block that runs past
the expert's last row brings the next expert's rows along: B's rows are loaded with a mask there (zeros), so those
products vanish. B is either expert-sorted rows or read by token (x for dWgu: no gathered copy of x at all).
"""
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "kernel_repos/moe/torch-ext"))
sys.path.insert(0, str(ROOT / "kernel_repos/moe/benchmarks"))
sys.path.insert(0, str(ROOT / "scripts"))
from moe import reference, triton_kernels as tk  # noqa: E402
from probe_moe_ws import first_launch, probe_args, time_round_robin  # noqa: E402
from tune_moe import make_inputs  # noqa: E402


@triton.jit
def wgrad_tma_kernel(A_DESC, B, SORTED_SLOT, OFFSETS, DW, M, N, TOP_K, stride_b, stride_dwe, stride_dwn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, B_BY_TOKEN: tl.constexpr):
    pid = tl.program_id(0)
    e = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    lo = tl.load(OFFSETS + e)
    hi = tl.load(OFFSETS + e + 1)
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(lo, hi, BLOCK_K):
        rows = r0 + ks
        r_mask = rows < hi
        a = A_DESC.load([r0, pid_m * BLOCK_M]).T  # rows past hi: the next expert's (times B's zero rows)
        if B_BY_TOKEN:
            b_rows = tl.load(SORTED_SLOT + rows, mask=r_mask, other=0) // TOP_K
        else:
            b_rows = rows.to(tl.int64)
        b = tl.load(B + b_rows[:, None] * stride_b + ns[None, :], mask=r_mask[:, None], other=0.0)
        acc = tl.dot(a, b, acc)
    tl.store(DW + e.to(tl.int64) * stride_dwe + ms[:, None].to(tl.int64) * stride_dwn + ns[None, :],
             acc.to(DW.dtype.element_ty))


VARIANTS = [  # label, BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps
    ("128x128/3", 128, 128, 64, 3, 8), ("128x128/4", 128, 128, 64, 4, 8),
    ("128x256/3", 128, 256, 64, 3, 8), ("128x256/4", 128, 256, 64, 4, 8),
    ("128x128/5 w4", 128, 128, 64, 5, 4),
]


def main():
    a = probe_args(30)
    T, E, K, H, I = a.shape
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    dev = torch.device("cpu" if interp else "cuda")
    dt = torch.float32 if interp else torch.bfloat16
    print(f"triton {triton.__version__}, torch {torch.__version__}, "
          f"{'interpreter' if interp else torch.cuda.get_device_name()}; T={T} E={E} K={K} H={H} I={I}", flush=True)
    x, idx, w, gu, dn, dout = make_inputs(T, E, K, H, I, dev, dt)
    S = T * K
    slot, offs = reference.route(idx, E)
    g = torch.Generator(device=dev).manual_seed(1)
    dgu = torch.randn(S, 2 * I, device=dev, dtype=dt, generator=g)
    act_w = torch.randn(S, I, device=dev, dtype=dt, generator=g)
    x_rows = x[slot // K]
    dout_rows = dout[slot // K]
    variants = [("16x16", 16, 16, 16, 1, 4), ("32x16", 32, 16, 16, 1, 4)] if interp else VARIANTS
    from triton.tools.tensor_descriptor import TensorDescriptor

    # name: (A rows, B by token, B rows, the weight-like output, shipped Triton call, CUTLASS call)
    cases = {
        "dWgu": (dgu, x, x_rows, gu,
                 lambda: tk._weight_grad_triton("gate_up_bwd_w", dgu, x, slot, K, offs, gu, a_by_token=False),
                 lambda: tk._k_grouped_mm(dgu, x_rows, offs)),
        "dWd": (dout_rows, act_w, act_w, dn, None, lambda: tk._k_grouped_mm(dout_rows, act_w, offs)),
    }
    for name, (a_rows, b_tok, b_rows, like, shipped, cutlass) in cases.items():
        Ed, Md, Nd = like.shape
        ref = torch.stack([a_rows[offs[e]:offs[e + 1]].double().T @ b_rows[offs[e]:offs[e + 1]].double()
                           for e in range(E)]) if interp else cutlass().float()
        steps = {}
        if not interp:
            steps["cutlass"] = cutlass
            if name == "dWgu":
                steps["gather x + cutlass"] = lambda: (tk._gather_rows(x, slot, K, torch.empty_like(x_rows)),
                                                       cutlass())
            if shipped is not None:
                steps["shipped triton"] = shipped
        for label, bm, bn, bk, stages, warps in variants:
            a_desc = TensorDescriptor(a_rows, list(a_rows.shape), [a_rows.stride(0), 1], [bk, bm])
            for by_token in ((True, False) if name == "dWgu" else (False,)):
                b = b_tok if by_token else b_rows
                out = torch.full_like(like, float("nan"))

                def launch(out=out, a_desc=a_desc, b=b, by_token=by_token, bm=bm, bn=bn, bk=bk, stages=stages,
                           warps=warps):
                    return wgrad_tma_kernel[(triton.cdiv(Md, bm) * triton.cdiv(Nd, bn), E)](
                        a_desc, b, slot, offs, out, Md, Nd, K, b.stride(0), out.stride(0), out.stride(1),
                        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, B_BY_TOKEN=by_token, num_warps=warps,
                        num_stages=stages)

                full = f"{label}{' B by token' if by_token else ''}"
                ok, k = first_launch(f"{name} {full}", launch)
                if not ok:
                    continue
                meta = "" if interp else f" (shared {k.metadata.shared}, regs {k.n_regs}, spills {k.n_spills})"
                err = ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()
                print(f"{name} {full}{meta}: max rel diff {err:.2e}, NaN {bool(torch.isnan(out).any())}",
                      flush=True)
                steps[full] = lambda launch=launch: launch(torch.empty_like(like))
        if interp:
            continue
        time_round_robin(name, steps, a.rounds, 2 * S * Md * Nd, "cutlass", width=24, base_label=" cutlass")


if __name__ == "__main__":
    main()
