"""Probe (GPU): gate_up_fwd as one MMA of 2*BLOCK_N columns (gate and up together) instead of two of BLOCK_N.
Exploratory, not uploaded.

    python scripts/probe_moe_gate_up_one_dot.py [T E K H I] [--rounds 40]
    TRITON_INTERPRET=1 python scripts/probe_moe_gate_up_one_dot.py 40 6 2 64 48 --rounds 1   # CPU: checks only

The shipped kernel runs two (BLOCK_M, BLOCK_K) x (BLOCK_K, BLOCK_N) dots per K step, one over the gate rows of
gate_up_proj and one over the up rows, reading the same A tile from shared memory twice: with BLOCK_N = 64 the
warpgroup MMAs read as many shared-memory bytes as their tensor cores can use. Here one TMA copy brings both row
blocks at once, through a 3-D descriptor over gate_up_proj viewed as (E * 2, I, H) with (2, BLOCK_N, BLOCK_K)
blocks, and one dot of 2 * BLOCK_N columns computes gate and up; the epilogue splits the accumulator. Times the
variants against the shipped kernel call by call (round-robin, CUDA events, medians) and checks that they write
bitwise the same gate_up_out and act.

Run 18 compared these against the two-dot kernel of 8b02ee4 (docs/gpu_runs/run18/probes.log) and shipped the
first variant; "shipped" is now that one-dot kernel (`triton_kernels._gate_up_fwd`), so the probe sweeps tile
configs of the same form against it.
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
from probe_moe_ws import check_rows, first_launch, probe_args, time_round_robin  # noqa: E402
from tune_moe import make_inputs  # noqa: E402


@triton.jit
def _one_dot_tile(X, W3, SORTED_SLOT, TILE_START, OFFSETS, GU, ACT, e, pid_n, pid_m, H, I, TOP_K, stride_x,
                  stride_gu, stride_act, TILE_M: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    rows, row_mask = tk._tile_rows(TILE_START, OFFSETS, e, pid_m, TILE_M, BM)
    tok = tl.load(SORTED_SLOT + rows, mask=row_mask, other=0).to(tl.int64) // TOP_K
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = X + tok[:, None] * stride_x + ks[None, :]
    acc = tl.zeros((BM, 2 * BLOCK_N), dtype=tl.float32)
    w_row = (e * 2).to(tl.int32)
    for k0 in range(0, H, BLOCK_K):
        a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
        b = W3.load([w_row, pid_n * BLOCK_N, k0]).reshape(2 * BLOCK_N, BLOCK_K).T  # gate rows, then up rows
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
    gu = acc.to(GU.dtype.element_ty)
    g, u = gu.reshape(BM, 2, BLOCK_N).permute(0, 2, 1).split()
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    gu_ptrs = GU + rows[:, None] * stride_gu + cols[None, :]
    mask = row_mask[:, None]
    tl.store(gu_ptrs, g, mask=mask)
    tl.store(gu_ptrs + I, u, mask=mask)
    act = tk._swiglu(g.to(tl.float32), u.to(tl.float32))
    tl.store(ACT + rows[:, None] * stride_act + cols[None, :], act.to(ACT.dtype.element_ty), mask=mask)


@triton.jit
def gate_up_one_dot_kernel(X, W3, SORTED_SLOT, TILE_EXPERT, TILE_START, OFFSETS, GU, ACT, H, I, E, TOP_K, TILES_N,
                           stride_x, stride_gu, stride_act, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, HALF_TILES: tl.constexpr):
    pid_n, pid_m = tk._tile_coords(tl.program_id(0), TILES_N)
    e = tl.load(TILE_EXPERT + pid_m).to(tl.int64)
    if e >= E:
        return
    if tk._half_tile(TILE_START, OFFSETS, e, pid_m, BLOCK_M, HALF_TILES):
        _one_dot_tile(X, W3, SORTED_SLOT, TILE_START, OFFSETS, GU, ACT, e, pid_n, pid_m, H, I, TOP_K, stride_x,
                      stride_gu, stride_act, BLOCK_M, BLOCK_M // 2, BLOCK_N, BLOCK_K)
    else:
        _one_dot_tile(X, W3, SORTED_SLOT, TILE_START, OFFSETS, GU, ACT, e, pid_n, pid_m, H, I, TOP_K, stride_x,
                      stride_gu, stride_act, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K)


VARIANTS = [  # label, BLOCK_M, BLOCK_N (intermediate columns: the dot has twice as many), BLOCK_K, num_stages,
    # num_warps
    ("one dot 64/3", 128, 64, 64, 3, 8), ("one dot 64/2", 128, 64, 64, 2, 8),
    ("one dot 64 k32/5", 128, 64, 32, 5, 8), ("one dot 64 k32/6", 128, 64, 32, 6, 8),
    ("one dot 64 k128/2", 128, 64, 128, 2, 8), ("one dot 64/3 w4", 128, 64, 64, 3, 4),
    ("one dot 128/4", 128, 128, 64, 4, 8), ("one dot 32/4", 128, 32, 64, 4, 4),
]


def main():
    a = probe_args(40)
    T, E, K, H, I = a.shape
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    dev = torch.device("cpu" if interp else "cuda")
    dt = torch.float32 if interp else torch.bfloat16  # bf16 dots are unreliable in the interpreter
    print(f"triton {triton.__version__}, torch {torch.__version__}, "
          f"{'interpreter' if interp else torch.cuda.get_device_name()}; T={T} E={E} K={K} H={H} I={I}", flush=True)
    x, idx, w, gu, dn, dout = make_inputs(T, E, K, H, I, dev, dt)
    S = T * K
    sorted_slot, offsets = reference.route(idx, E)
    row_tiles = tk._RowTiles(offsets, S)
    lo, hi = int(offsets[0]), int(offsets[E])
    if interp:
        tk._INTERPRETER_CONFIG["TMA"] = True
        variants = [("one dot 16", 16, 16, 16, 1, 4), ("one dot 16/half", 32, 16, 16, 1, 4)]
    else:
        variants = VARIANTS

    def shipped(gu_out, act):
        tk._gate_up_fwd(x, gu, sorted_slot, K, row_tiles, offsets, gu_out, act)

    gu_ref = torch.full((S, 2 * I), float("nan"), device=dev, dtype=dt)
    act_ref = torch.full((S, I), float("nan"), device=dev, dtype=dt)
    shipped(gu_ref, act_ref)
    if interp:  # the shipped kernel against float64 too, so that the bitwise check below compares with a right one
        xr = x.double()[sorted_slot[lo:hi] // K]
        e_of = torch.repeat_interleave(torch.arange(E), (offsets[1:] - offsets[:-1]).long())
        ref = torch.einsum("sh,sih->si", xr, gu.double()[e_of]).to(dt)
        print(f"shipped vs float64: max diff {(gu_ref[lo:hi].float() - ref.float()).abs().max().item():.3g}")
    from triton.tools.tensor_descriptor import TensorDescriptor

    steps = {"shipped": lambda: shipped(torch.empty_like(gu_ref), torch.empty_like(act_ref))}
    for label, bm, bn, bk, stages, warps in variants:
        w3 = TensorDescriptor(gu, [E * 2, I, H], [I * H, H, 1], [2, bn, bk])
        te, ts, mt = row_tiles(bm)
        tiles_n = triton.cdiv(I, bn)
        gu_out = torch.full_like(gu_ref, float("nan"))
        act = torch.full_like(act_ref, float("nan"))

        def launch(gu_out=gu_out, act=act, bm=bm, bn=bn, bk=bk, stages=stages, warps=warps, w3=w3, te=te, ts=ts, mt=mt,
                   tiles_n=tiles_n):
            return gate_up_one_dot_kernel[(tiles_n * mt,)](
                x, w3, sorted_slot, te, ts, offsets, gu_out, act, H, I, E, K, tiles_n, x.stride(0),
                gu_out.stride(0), act.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                HALF_TILES=bm >= 32, num_warps=warps, num_stages=stages)

        ok, k = first_launch(label, launch)
        if not ok:
            continue
        meta = "" if interp else f" (warps {k.metadata.num_warps}, shared {k.metadata.shared}, regs {k.n_regs}, spills {k.n_spills})"
        check_rows(f"{label} gu{meta}", gu_out, gu_ref, lo, hi)
        check_rows(f"{label} act", act, act_ref, lo, hi)
        steps[label] = lambda launch=launch: launch(torch.empty_like(gu_ref), torch.empty_like(act_ref))
    if interp:
        return
    time_round_robin("gate_up_fwd", steps, a.rounds, 2 * S * 2 * I * H, "shipped", width=16)


if __name__ == "__main__":
    main()
