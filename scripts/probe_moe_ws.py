"""Probe (GPU): Triton's automatic warp specialisation for Hopper on the MoE row GEMMs. Exploratory, not uploaded.

    python scripts/probe_moe_ws.py [T E K H I] [--rounds 40]

Also: TMA stores of the output tiles (STORE 1: for the tiles wholly inside their expert; 2: through a descriptor
clipped at the expert's last row), and gate_up_fwd as a row GEMM over x rows gathered first.

Triton (3.5+) warp-specialises a persistent loop `tl.range(..., warp_specialize=True)` on sm_90 when its operands
come from device-side tensor descriptors and the kernel has 4 warps: one producer warp group issues the TMA loads,
two consumer warp groups (64 rows each) run the MMAs and the epilogue, so the next tile's loads overlap this
tile's epilogue. This probe times such kernels against the shipped ones on the same inputs, call by call
(round-robin, CUDA events, medians), and checks that they write bitwise the same rows:
  - the three row GEMMs (down_fwd, gate_up_bwd_x, down_bwd_g) against `_rows_gemm`;
  - gate_up_fwd over x rows gathered first (gather + WS GEMM with the SwiGLU epilogue) against `_gate_up_fwd_kernel`.
"""
import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "kernel_repos/moe/torch-ext"))
sys.path.insert(0, str(ROOT / "kernel_repos/moe/benchmarks"))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_ops import round_robin_ms  # noqa: E402
from moe import reference, triton_kernels as tk  # noqa: E402
from tune_moe import make_inputs  # noqa: E402


@triton.jit
def _tile_of(t, TILE_EXPERT, TILE_START, OFFSETS, TILES_N, BLOCK_M: tl.constexpr):
    pid_n = t % TILES_N
    pid_m = t // TILES_N
    e = tl.load(TILE_EXPERT + pid_m).to(tl.int32)
    row0 = tl.load(OFFSETS + e) + (pid_m - tl.load(TILE_START + e).to(tl.int32)) * BLOCK_M
    return e, pid_n, row0, tl.load(OFFSETS + e + 1)


@triton.jit
def _store_tile(C, v, row0, row_end, col0, S, N, stride_c, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                STORE: tl.constexpr):
    # STORE 0: masked pointer stores; 1: a TMA store for the tiles wholly inside their expert, masked pointer
    # stores for the expert's last (partial) tile; 2: a TMA store through a descriptor clipped at the expert's end
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    if STORE == 2:
        tl.make_tensor_descriptor(C, shape=[row_end, N], strides=[stride_c, 1],
                                  block_shape=[BLOCK_M, BLOCK_N]).store([row0, col0], v)
    elif STORE == 1:
        if row0 + BLOCK_M <= row_end:
            tl.make_tensor_descriptor(C, shape=[S, N], strides=[stride_c, 1],
                                      block_shape=[BLOCK_M, BLOCK_N]).store([row0, col0], v)
        else:
            tl.store(C + rows.to(tl.int64)[:, None] * stride_c + cols[None, :], v,
                     mask=(rows < row_end)[:, None] & (cols < N)[None, :])
    else:
        tl.store(C + rows.to(tl.int64)[:, None] * stride_c + cols[None, :], v,
                 mask=(rows < row_end)[:, None] & (cols < N)[None, :])


@triton.jit
def rows_gemm_ws_kernel(A, B, TILE_EXPERT, TILE_START, OFFSETS, C, S, N, K, E, TILES_N, stride_c,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, B_NK: tl.constexpr,
                        WS: tl.constexpr, STORE: tl.constexpr = 0):
    a_desc = tl.make_tensor_descriptor(A, shape=[S, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    if B_NK:
        b_desc = tl.make_tensor_descriptor(B, shape=[E * N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(B, shape=[E * K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N])
    n_tiles = (tl.load(TILE_START + E) * TILES_N).to(tl.int32)
    for t in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), warp_specialize=WS):
        e, pid_n, row0, row_end = _tile_of(t, TILE_EXPERT, TILE_START, OFFSETS, TILES_N, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([row0, k0])
            if B_NK:
                b = b_desc.load([e * N + pid_n * BLOCK_N, k0]).T
            else:
                b = b_desc.load([e * K + k0, pid_n * BLOCK_N])
            acc = tl.dot(a, b, acc)
        _store_tile(C, acc.to(C.dtype.element_ty), row0, row_end, pid_n * BLOCK_N, S, N, stride_c, BLOCK_M, BLOCK_N,
                    STORE)


@triton.jit
def gate_up_ws_kernel(X, W, TILE_EXPERT, TILE_START, OFFSETS, GU, ACT, S, H, I, E, TILES_N, stride_gu, stride_act,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WS: tl.constexpr,
                      STORE: tl.constexpr = 0):
    x_desc = tl.make_tensor_descriptor(X, shape=[S, H], strides=[H, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(W, shape=[E * 2 * I, H], strides=[H, 1], block_shape=[BLOCK_N, BLOCK_K])
    n_tiles = (tl.load(TILE_START + E) * TILES_N).to(tl.int32)
    for t in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), warp_specialize=WS):
        e, pid_n, row0, row_end = _tile_of(t, TILE_EXPERT, TILE_START, OFFSETS, TILES_N, BLOCK_M)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        wg = e * 2 * I + pid_n * BLOCK_N
        for k0 in range(0, H, BLOCK_K):
            a = x_desc.load([row0, k0])
            acc_g = tl.dot(a, w_desc.load([wg, k0]).T, acc_g)
            acc_u = tl.dot(a, w_desc.load([wg + I, k0]).T, acc_u)
        g = acc_g.to(GU.dtype.element_ty)
        u = acc_u.to(GU.dtype.element_ty)
        act = g.to(tl.float32) * tl.sigmoid(g.to(tl.float32)) * u.to(tl.float32)
        _store_tile(GU, g, row0, row_end, pid_n * BLOCK_N, S, 2 * I, stride_gu, BLOCK_M, BLOCK_N, STORE)
        _store_tile(GU, u, row0, row_end, I + pid_n * BLOCK_N, S, 2 * I, stride_gu, BLOCK_M, BLOCK_N, STORE)
        _store_tile(ACT, act.to(ACT.dtype.element_ty), row0, row_end, pid_n * BLOCK_N, S, I, stride_act, BLOCK_M,
                    BLOCK_N, STORE)


def first_launch(label, launch):
    """(ok, the compiled kernel of launch()'s first run (None under the interpreter)); ok False (printed) when it does
    not compile or run (shared by the MoE kernel probes)."""
    try:
        k = launch()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return True, k
    except Exception as e:  # noqa: BLE001
        print(f"{label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        return False, None


def probe_args(rounds: int):
    """The probes' command line: the shape T E K H I (Qwen3-30B-A3B by default) and --rounds of round-robin timing."""
    p = argparse.ArgumentParser()
    p.add_argument("shape", nargs="*", type=int, default=[8192, 128, 8, 2048, 768])
    p.add_argument("--rounds", type=int, default=rounds)
    return p.parse_args()


def time_round_robin(name, steps, rounds, flops, base, width=20, base_label=""):
    """Times steps round-robin (`bench_ops.round_robin_ms`) and prints each one's ms, TFLOP/s and speed relative to
    steps[base]."""
    ms = round_robin_ms(steps, rounds)
    for label, v in ms.items():
        print(f"  {name} {label:>{width}}: {v:.4f} ms  {flops / v / 1e9:.0f} TFLOP/s  ({ms[base] / v:.3f}x{base_label})",
              flush=True)


def check_rows(label, out, ref, lo, hi):
    """Prints whether rows lo:hi of out are bitwise those of ref, how many hold NaN, and the largest difference."""
    o, r = out[lo:hi], ref[lo:hi]
    nan_rows = int(torch.isnan(o).any(1).sum())
    same = torch.equal(o, r)
    diff = (o.float() - r.float()).nan_to_num(0).abs().max().item()
    print(f"{label}: bitwise equal {same}, rows with NaN {nan_rows} of {hi - lo}, max diff elsewhere {diff:.3g}",
          flush=True)


ROW_VARIANTS = [  # label, WS, STORE, BLOCK_N, num_stages, num_warps
    ("desc", False, 0, 256, 4, 8), ("desc+tma-store", False, 1, 256, 4, 8),
    ("desc+clip-store", False, 2, 256, 4, 8), ("desc+tma-store/3", False, 1, 256, 3, 8),
    ("WS 256/4", True, 0, 256, 4, 4), ("WS+tma-store 256/3", True, 1, 256, 3, 4),
]
GATE_UP_VARIANTS = [  # label, WS, STORE, BLOCK_N, num_stages, num_warps, persistent
    ("rows 128/4 persistent", False, 0, 128, 4, 8, True),
    ("rows 128/4 persistent tma-store", False, 1, 128, 4, 8, True),
    ("rows 64/3 grid", False, 0, 64, 3, 8, False), ("rows 64/3 grid tma-store", False, 1, 64, 3, 8, False),
    ("rows 128/3 persistent tma-store", False, 1, 128, 3, 8, True),
]


def main():
    a = probe_args(40)
    T, E, K, H, I = a.shape
    dev, dt = torch.device("cuda"), torch.bfloat16
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    print(f"triton {triton.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}; "
          f"T={T} E={E} K={K} H={H} I={I}", flush=True)
    x, idx, w, gu, dn, dout = make_inputs(T, E, K, H, I, dev, dt)
    S = T * K
    sorted_slot, offsets = reference.route(idx, E)
    row_tiles = tk._RowTiles(offsets, S)
    tile_expert, tile_start, max_tiles = row_tiles(128)
    lo, hi = int(offsets[0]), int(offsets[E])
    nsm = torch.cuda.get_device_properties(dev).multi_processor_count
    g = torch.Generator(device=dev).manual_seed(1)
    rows_in = {"down_fwd": torch.randn(S, I, device=dev, dtype=dt, generator=g),
               "gate_up_bwd_x": torch.randn(S, 2 * I, device=dev, dtype=dt, generator=g),
               "down_bwd_g": torch.randn(S, H, device=dev, dtype=dt, generator=g)}
    weights = {"down_fwd": dn, "gate_up_bwd_x": gu, "down_bwd_g": dn}

    for name in ("down_fwd", "gate_up_bwd_x", "down_bwd_g"):
        A, W = rows_in[name], weights[name]
        b_nk = name == "down_fwd"
        N, Kd = (W.shape[1], W.shape[2]) if b_nk else (W.shape[2], W.shape[1])
        ref_out = torch.full((S, N), float("nan"), device=dev, dtype=dt)
        tk._rows_gemm(name, A, W, row_tiles, offsets, ref_out)
        def shipped(A=A, W=W, name=name, N=N):
            return tk._rows_gemm(name, A, W, row_tiles, offsets, torch.empty((S, N), device=dev, dtype=dt))

        steps = {"shipped": shipped}
        for label, ws, store, bn, stages, warps in ROW_VARIANTS:
            tiles_n = triton.cdiv(N, bn)
            out = torch.full((S, N), float("nan"), device=dev, dtype=dt)

            def launch(out=out, ws=ws, store=store, bn=bn, stages=stages, warps=warps, tiles_n=tiles_n, A=A, W=W,
                       N=N, Kd=Kd, b_nk=b_nk):
                return rows_gemm_ws_kernel[(min(nsm, tiles_n * max_tiles),)](
                    A, W, tile_expert, tile_start, offsets, out, S, N, Kd, E, tiles_n, out.stride(0),
                    BLOCK_M=128, BLOCK_N=bn, BLOCK_K=64, B_NK=b_nk, WS=ws, STORE=store, num_warps=warps,
                    num_stages=stages)

            ok, k = first_launch(f"{name} {label}", launch)
            if not ok:
                continue
            check_rows(f"{name} {label} (warps {k.metadata.num_warps}, shared {k.metadata.shared})", out, ref_out, lo, hi)
            steps[label] = launch
        time_round_robin(name, steps, a.rounds, 2 * S * N * Kd, "shipped")

    # gate_up forward: x rows gathered first + a TMA row GEMM with the SwiGLU epilogue, vs the shipped gathered kernel
    gu_ref = torch.full((S, 2 * I), float("nan"), device=dev, dtype=dt)
    act_ref = torch.full((S, I), float("nan"), device=dev, dtype=dt)

    def shipped_gate_up(gu_out=gu_ref, act=act_ref):
        tk._gate_up_fwd(x, gu, sorted_slot, K, row_tiles, offsets, gu_out, act)

    shipped_gate_up()
    x_rows = torch.empty((S, H), device=dev, dtype=dt)
    steps = {"shipped": lambda: shipped_gate_up(torch.empty_like(gu_ref), torch.empty_like(act_ref)),
             "gather only": lambda: tk._gather_rows(x, sorted_slot, K, x_rows)}
    for label, ws, store, bn, stages, warps, persistent in GATE_UP_VARIANTS:
        tiles_n = triton.cdiv(I, bn)
        gu_out = torch.full_like(gu_ref, float("nan"))
        act = torch.full_like(act_ref, float("nan"))

        def launch(ws=ws, store=store, bn=bn, stages=stages, warps=warps, tiles_n=tiles_n, gu_out=gu_out, act=act,
                   persistent=persistent, gather=True):
            if gather:
                tk._gather_rows(x, sorted_slot, K, x_rows)
            grid = min(nsm, tiles_n * max_tiles) if persistent else tiles_n * max_tiles
            return gate_up_ws_kernel[(grid,)](
                x_rows, gu, tile_expert, tile_start, offsets, gu_out, act, S, H, I, E, tiles_n, gu_out.stride(0),
                act.stride(0), BLOCK_M=128, BLOCK_N=bn, BLOCK_K=64, WS=ws, STORE=store, num_warps=warps,
                num_stages=stages)

        ok, k = first_launch(f"gate_up_fwd {label}", launch)
        if not ok:
            continue
        check_rows(f"gate_up_fwd {label} gu (warps {k.metadata.num_warps}, shared {k.metadata.shared})", gu_out, gu_ref,
               lo, hi)
        check_rows(f"gate_up_fwd {label} act", act, act_ref, lo, hi)
        steps[f"gather+{label}"] = launch
        steps[f"{label} only"] = lambda launch=launch: launch(gather=False)
    time_round_robin("gate_up_fwd", steps, a.rounds, 2 * S * 2 * I * H, "shipped", width=38)


if __name__ == "__main__":
    main()
