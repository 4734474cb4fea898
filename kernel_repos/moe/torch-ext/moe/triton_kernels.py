"""Triton kernels for the routed experts: grouped GEMMs over expert-sorted token copies.

Layout: the S = T*K token copies are sorted by expert (`reference.route`, on the device); expert `e` owns
sorted rows `expert_offsets[e]:expert_offsets[e + 1]`. Row tiles of BLOCK_M never straddle two experts: a
tile map (`_RowTiles`, one small kernel, no host sync) gives every M-program its expert and its first
row, and the grid has a static upper bound on the number of tiles (programs past the end exit at once), so
every launch is CUDA-graph capturable. Activations are gathered by token id inside the kernels (no permuted
copy of `hidden`), weights are read in the HF v5 layout: gate_up_proj (E, 2I, H), down_proj (E, H, I).

Forward:  gate_up GEMM with SwiGLU in the epilogue -> down GEMM -> weighted combine back to token order; only
          gate_up_out is kept for the backward (act is recomputed from it).
Backward: g_act = (dout @ Wd) with the routing-weight grad and the SwiGLU backward in the epilogue ->
          dx rows (dgate_up @ Wgu) -> combine; per-expert weight grads reduce over the expert's rows
          inside one program (fixed order, no atomics: deterministic). On sm_90/sm_100 bf16 (TUNING
          ["backward"], the default there) the weight grads and g_act are torch._grouped_mm (CUTLASS) GEMMs over
          gathered expert-sorted rows instead (deterministic too; g_act optionally the Triton row GEMM on those
          rows, TUNING["backward"]["g_act"]), g_act's epilogue a separate row pass. The
          grad of the gate_up output is written over gate_up_out when the caller allows it (the custom op does).
All products accumulate in fp32; operands are the input dtype (bf16/fp16 tensor cores, fp32 in IEEE).
This module imports triton: import it lazily.
"""
import torch
import triton
import triton.language as tl

from hubfuse._common.device import capability, sm_count
from hubfuse._common.launch import cdiv, next_power_of_2, launch


@triton.jit
def _in_bounds(offs, bound, EVEN: tl.constexpr):
    # EVEN (bound is a multiple of the block): an all-true constant mask, which keeps loads and stores along
    # a contiguous dimension vectorised (a data-dependent mask there would split them into scalar accesses)
    if EVEN:
        return tl.full(offs.shape, 1, tl.int1)
    else:
        return offs < bound


@triton.jit
def _swiglu(g, u):
    # act = silu(g) * u in fp32 from the rounded linear outputs; the forward and both backward paths evaluate
    # this one expression, so the act recomputed in the backward is bitwise the forward's
    return g * tl.sigmoid(g) * u


@triton.jit
def _swiglu_bwd(dact, g, u):
    sig = tl.sigmoid(g)
    return dact * u * sig * (1.0 + g * (1.0 - sig)), dact * g * sig


@triton.jit
def _tile_coords(t, TILES_N):
    # (column tile, row tile) of tile t, column tiles fastest: the programs of one row tile run together and share
    # its (gathered) activation rows in L2; consecutive row tiles mostly belong to the same expert.
    return t % TILES_N, t // TILES_N


@triton.jit
def _tile_count(TILE_START, E, TILES_N):
    # the routing's tiles (row tiles, counted by the tile map on the device, x column tiles): where a persistent
    # program's loop stops
    return (tl.load(TILE_START + E) * TILES_N).to(tl.int32)


@triton.jit
def _tile_rows(TILE_START, OFFSETS, e, pid_m, TILE_M: tl.constexpr, BM: tl.constexpr):
    # the first BM sorted rows of row tile pid_m (tiles of TILE_M rows) of expert e, and which are the expert's
    row0 = tl.load(OFFSETS + e) + (pid_m - tl.load(TILE_START + e)) * TILE_M
    rows = row0 + tl.arange(0, BM).to(tl.int64)
    return rows, rows < tl.load(OFFSETS + e + 1)


@triton.jit
def _half_tile(TILE_START, OFFSETS, e, pid_m, TILE_M: tl.constexpr, HALF_TILES: tl.constexpr):
    # HALF_TILES: whether row tile pid_m holds at most TILE_M / 2 of the expert's rows (the last tile of an
    # expert, typically); the caller then runs the tile body with half the rows. With ~512 rows per expert and
    # 128-row tiles, every other expert ends in a nearly empty tile: about a tenth of all the rows computed.
    if HALF_TILES:
        row0 = tl.load(OFFSETS + e) + (pid_m - tl.load(TILE_START + e)) * TILE_M
        return tl.load(OFFSETS + e + 1) - row0 <= TILE_M // 2
    else:
        return False


@triton.jit
def _gate_up_fwd_kernel(
    X, W, SORTED_SLOT, TILE_EXPERT, TILE_START, OFFSETS, GU, ACT,
    H, I, E, TOP_K, TILES_N, stride_x, stride_we, stride_wn, stride_gu, stride_act,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr, HALF_TILES: tl.constexpr,
    PERSISTENT: tl.constexpr,
):
    # gate = x @ Wg[e]^T, up = x @ Wu[e]^T for BLOCK_N intermediate columns; act = silu(gate) * up
    # TMA: W is a tensor descriptor over gate_up_proj viewed as (E * 2, I, H) (`_gate_up_operand`)
    if PERSISTENT:  # a program per SM walks the tiles, full-size bodies only (see _persistent_grid)
        for t in tl.range(tl.program_id(0), _tile_count(TILE_START, E, TILES_N), tl.num_programs(0), flatten=True):
            pid_n, pid_m = _tile_coords(t, TILES_N)
            _gate_up_fwd_tile(X, W, SORTED_SLOT, TILE_START, OFFSETS, GU, ACT,
                              tl.load(TILE_EXPERT + pid_m).to(tl.int64), pid_n, pid_m, H, I, TOP_K, stride_x,
                              stride_we, stride_wn, stride_gu, stride_act, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, PREC,
                              EVEN_N, EVEN_K, TMA)
        return
    pid_n, pid_m = _tile_coords(tl.program_id(0), TILES_N)
    e = tl.load(TILE_EXPERT + pid_m).to(tl.int64)
    if e >= E:
        return
    if _half_tile(TILE_START, OFFSETS, e, pid_m, BLOCK_M, HALF_TILES):
        _gate_up_fwd_tile(X, W, SORTED_SLOT, TILE_START, OFFSETS, GU, ACT, e, pid_n, pid_m, H, I, TOP_K, stride_x,
                          stride_we, stride_wn, stride_gu, stride_act, BLOCK_M, BLOCK_M // 2, BLOCK_N, BLOCK_K, PREC,
                          EVEN_N, EVEN_K, TMA)
    else:
        _gate_up_fwd_tile(X, W, SORTED_SLOT, TILE_START, OFFSETS, GU, ACT, e, pid_n, pid_m, H, I, TOP_K, stride_x,
                          stride_we, stride_wn, stride_gu, stride_act, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, PREC, EVEN_N,
                          EVEN_K, TMA)


@triton.jit
def _gate_up_fwd_tile(
    X, W, SORTED_SLOT, TILE_START, OFFSETS, GU, ACT, e, pid_n, pid_m, H, I, TOP_K,
    stride_x, stride_we, stride_wn, stride_gu, stride_act,
    TILE_M: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
):
    # One dot of 2 * BLOCK_N columns per K step: the BLOCK_N gate rows and the BLOCK_N up rows of the weight side by
    # side. Two dots of BLOCK_N would read the x tile from shared memory twice, and with BLOCK_N = 64 Hopper's
    # warpgroup MMAs are then bound by shared-memory reads (this kernel 11 % faster, bitwise the same).
    rows, row_mask = _tile_rows(TILE_START, OFFSETS, e, pid_m, TILE_M, BM)
    tok = tl.load(SORTED_SLOT + rows, mask=row_mask, other=0).to(tl.int64) // TOP_K  # slot t * K + k: token t
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = _in_bounds(cols, I, EVEN_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = X + tok[:, None] * stride_x + ks[None, :]
    if TMA:  # W: a descriptor over gate_up_proj viewed as (E * 2, I, H), (2, BLOCK_N, BLOCK_K) blocks
        w_row = (e * 2).to(tl.int32)
    else:  # the weight rows of the dot's columns: gate rows cols, then up rows I + cols
        gate_up_cols = tl.arange(0, 2 * BLOCK_N)
        w_rows = (gate_up_cols // BLOCK_N) * I + pid_n * BLOCK_N + gate_up_cols % BLOCK_N
        w_col_mask = _in_bounds(pid_n * BLOCK_N + gate_up_cols % BLOCK_N, I, EVEN_N)
        w_ptrs = W + e * stride_we + w_rows[None, :].to(tl.int64) * stride_wn + ks[:, None]
    acc = tl.zeros((BM, 2 * BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_mask = _in_bounds(k0 + ks, H, EVEN_K)
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if TMA:  # rows past I and columns past H are zero-filled by the copy engine
            b = W.load([w_row, pid_n * BLOCK_N, k0]).reshape(2 * BLOCK_N, BLOCK_K).T
        else:
            b = tl.load(w_ptrs, mask=k_mask[:, None] & w_col_mask[None, :], other=0.0)
            w_ptrs += BLOCK_K
        acc = tl.dot(a, b, acc, input_precision=PREC)
        a_ptrs += BLOCK_K
    # HF rounds the linear output to the input dtype before the activation: do the same
    g, u = acc.to(GU.dtype.element_ty).reshape(BM, 2, BLOCK_N).permute(0, 2, 1).split()
    mask = row_mask[:, None] & col_mask[None, :]
    gu_ptrs = GU + rows[:, None] * stride_gu + cols[None, :]
    tl.store(gu_ptrs, g, mask=mask)
    tl.store(gu_ptrs + I, u, mask=mask)
    act = _swiglu(g.to(tl.float32), u.to(tl.float32))
    tl.store(ACT + rows[:, None] * stride_act + cols[None, :], act.to(ACT.dtype.element_ty), mask=mask)


@triton.jit
def _rows_gemm_kernel(
    A, A_ROWS, B, TILE_EXPERT, TILE_START, OFFSETS, C,
    N, K, E, TILES_N, stride_a, stride_be, stride_b, stride_c,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr, TMA_A: tl.constexpr, HALF_TILES: tl.constexpr,
    B_NK: tl.constexpr, PERSISTENT: tl.constexpr,
):
    # c_row = a_row @ B[e] for BLOCK_N output columns; a's rows are contiguous in sorted order:
    #   down_fwd:      y = act @ Wd[e]^T        B = down_proj (E, N=H, K=I), stride_b its N stride   (B_NK)
    #   gate_up_bwd_x: dx = dgate_up @ Wgu[e]   B = gate_up_proj (E, K=2I, N=H), stride_b its K stride
    #   down_bwd_g:    g_act = dout @ Wd[e]     B = down_proj (E, K=H, N=I), stride_b its K stride
    # TMA: B is a tensor descriptor over the weight viewed as (E * rows, cols); TMA_A: A_ROWS one over A with
    # (BLOCK_M, BLOCK_K) blocks (half tiles read A through pointers), else A_ROWS is A
    if PERSISTENT:  # a program per SM walks the tiles, full-size bodies only (see _persistent_grid)
        for t in tl.range(tl.program_id(0), _tile_count(TILE_START, E, TILES_N), tl.num_programs(0), flatten=True):
            pid_n, pid_m = _tile_coords(t, TILES_N)
            _rows_gemm_tile(A_ROWS, B, TILE_START, OFFSETS, C, tl.load(TILE_EXPERT + pid_m).to(tl.int64), pid_n,
                            pid_m, N, K, stride_a, stride_be, stride_b, stride_c, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K,
                            PREC, EVEN_N, EVEN_K, TMA, TMA_A, B_NK)
        return
    pid_n, pid_m = _tile_coords(tl.program_id(0), TILES_N)
    e = tl.load(TILE_EXPERT + pid_m).to(tl.int64)
    if e >= E:
        return
    if _half_tile(TILE_START, OFFSETS, e, pid_m, BLOCK_M, HALF_TILES):
        _rows_gemm_tile(A, B, TILE_START, OFFSETS, C, e, pid_n, pid_m, N, K, stride_a, stride_be, stride_b, stride_c,
                        BLOCK_M, BLOCK_M // 2, BLOCK_N, BLOCK_K, PREC, EVEN_N, EVEN_K, TMA, False, B_NK)
    else:
        _rows_gemm_tile(A_ROWS, B, TILE_START, OFFSETS, C, e, pid_n, pid_m, N, K, stride_a, stride_be, stride_b,
                        stride_c, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, PREC, EVEN_N, EVEN_K, TMA, TMA_A, B_NK)


@triton.jit
def _rows_gemm_tile(
    A, B, TILE_START, OFFSETS, C, e, pid_n, pid_m, N, K, stride_a, stride_be, stride_b, stride_c,
    TILE_M: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr, TMA_A: tl.constexpr, B_NK: tl.constexpr,
):
    rows, row_mask = _tile_rows(TILE_START, OFFSETS, e, pid_m, TILE_M, BM)
    acc = _rows_acc(A, B, e, rows, row_mask, pid_n, N, K, stride_a, stride_be, stride_b, BM, BLOCK_N, BLOCK_K, PREC,
                    EVEN_N, EVEN_K, TMA, TMA_A, B_NK)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(C + rows[:, None] * stride_c + cols[None, :], acc.to(C.dtype.element_ty),
             mask=row_mask[:, None] & _in_bounds(cols, N, EVEN_N)[None, :])


@triton.jit
def _rows_acc(
    A, B, e, a_rows, row_mask, pid_n, N, K, stride_a, stride_be, stride_b,
    BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr, TMA_A: tl.constexpr, B_NK: tl.constexpr,
):
    # fp32 (BM, BLOCK_N) = A[a_rows] @ B[e] for output columns tile pid_n, B[e] (K, N) or with B_NK (N, K)
    # TMA: B is a tensor descriptor over the weight viewed as (E * rows, cols); TMA_A: A is one over contiguous
    # rows with (BM, BLOCK_K) blocks, starting at the tile's first row (rows past the expert's end are the next
    # expert's, or zero-filled past the last: the caller masks them at the store)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = _in_bounds(cols, N, EVEN_N)
    ks = tl.arange(0, BLOCK_K)
    if TMA_A:
        a_row0 = tl.min(a_rows, axis=0).to(tl.int32)
    else:
        a_ptrs = A + a_rows[:, None] * stride_a + ks[None, :]
    if TMA:  # the copy engine zero-fills past the weight's last row / column
        if B_NK:
            b_row = (e * N + pid_n * BLOCK_N).to(tl.int32)
        else:
            b_row = (e * K).to(tl.int32)
            b_col = pid_n * BLOCK_N
    else:
        if B_NK:
            b_ptrs = B + e * stride_be + cols[None, :].to(tl.int64) * stride_b + ks[:, None]
        else:
            b_ptrs = B + e * stride_be + ks[:, None].to(tl.int64) * stride_b + cols[None, :]
    acc = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = _in_bounds(k0 + ks, K, EVEN_K)
        if TMA_A:
            a = A.load([a_row0, k0])
        else:
            a = tl.load(a_ptrs + k0, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if TMA:
            if B_NK:
                b = B.load([b_row, k0]).T
            else:
                b = B.load([b_row + k0, b_col])
        else:
            b = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            if B_NK:
                b_ptrs += BLOCK_K
            else:
                b_ptrs += BLOCK_K * stride_b
        acc = tl.dot(a, b, acc, input_precision=PREC)
    return acc


@triton.jit
def _combine_kernel(
    Y, POS, IDX, WT, OUT, SRC, T, H, E, stride_y, stride_out, stride_src,
    K: tl.constexpr, HAS_WEIGHT: tl.constexpr, REFILL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # out[t] = sum_k w[t, k] * y[pos[t, k]] in fp32, fixed k order; slots routed outside [0, E) add nothing.
    # K unrolled: the K row loads of a token are independent, so they are all in flight at once.
    # REFILL: then y[pos[t, k]] = src[t] for every slot (the rows just read, and those of the slots routed outside
    # [0, E)): y's rows become the expert-sorted gather of src, in the same pass (each program writes only the
    # elements it has read, so no other program's read is overtaken)
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tok_mask = toks < T
    col_mask = cols < H
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k in tl.static_range(K):
        slot = toks.to(tl.int64) * K + k
        e = tl.load(IDX + slot, mask=tok_mask, other=-1)
        valid = tok_mask & (e >= 0) & (e < E)
        p = tl.load(POS + slot, mask=valid, other=0).to(tl.int64)
        y = tl.load(Y + p[:, None] * stride_y + cols[None, :], mask=valid[:, None] & col_mask[None, :], other=0.0)
        y = y.to(tl.float32)
        if HAS_WEIGHT:
            w = tl.load(WT + slot, mask=valid, other=0.0).to(tl.float32)
            y = y * w[:, None]
        acc += y
    mask = tok_mask[:, None] & col_mask[None, :]
    tl.store(OUT + toks.to(tl.int64)[:, None] * stride_out + cols[None, :], acc.to(OUT.dtype.element_ty), mask=mask)
    if REFILL:  # after every load of y (a store between them would serialise them: it may alias the next load)
        src = tl.load(SRC + toks.to(tl.int64)[:, None] * stride_src + cols[None, :], mask=mask)
        for k in tl.static_range(K):
            p = tl.load(POS + toks.to(tl.int64) * K + k, mask=tok_mask, other=0).to(tl.int64)
            tl.store(Y + p[:, None] * stride_y + cols[None, :], src, mask=mask)


@triton.jit
def _down_bwd_act_kernel(
    DOUT, DOUT_OP, D, SORTED_SLOT, WT, TILE_EXPERT, TILE_START, OFFSETS, GU, DGU, ACT_W, DW_PART,
    H, I, E, TOP_K, TILES_N, stride_dout, stride_de, stride_dn, stride_gu, stride_dgu, stride_act_w, stride_part,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr, TMA_A: tl.constexpr, HALF_TILES: tl.constexpr,
    DOUT_SORTED: tl.constexpr, PERSISTENT: tl.constexpr,
):
    # g_act = dout_row @ Wd[e]   (unweighted grad of act, BLOCK_N intermediate columns; rounded to the input
    # dtype like the M-grouped GEMM of the grouped_mm path and F.linear's backward), the SwiGLU backward in the
    # epilogue (`_act_bwd_epilogue`). DOUT_SORTED: DOUT holds the expert-sorted rows (dout gathered once, also the
    # operand of the down-proj weight grad), else DOUT is (T, H), read by token. D = down_proj (E, K=H, N=I);
    # TMA: D is a descriptor over it viewed as (E * H, I); TMA_A (with DOUT_SORTED): DOUT_OP is one over DOUT.
    # WT: the routing weights (T * K,) in slot order.
    if PERSISTENT:  # a program per SM walks the tiles, full-size bodies only (see _persistent_grid)
        for t in tl.range(tl.program_id(0), _tile_count(TILE_START, E, TILES_N), tl.num_programs(0), flatten=True):
            pid_n, pid_m = _tile_coords(t, TILES_N)
            _down_bwd_act_tile(DOUT_OP, D, SORTED_SLOT, WT, TILE_START, OFFSETS, GU, DGU, ACT_W, DW_PART,
                               tl.load(TILE_EXPERT + pid_m).to(tl.int64), pid_n, pid_m, H, I, TOP_K, stride_dout,
                               stride_de, stride_dn, stride_gu, stride_dgu, stride_act_w, stride_part, BLOCK_M,
                               BLOCK_M, BLOCK_N, BLOCK_K, PREC, EVEN_N, EVEN_K, TMA, TMA_A, DOUT_SORTED)
        return
    pid_n, pid_m = _tile_coords(tl.program_id(0), TILES_N)
    e = tl.load(TILE_EXPERT + pid_m).to(tl.int64)
    if e >= E:
        return
    if _half_tile(TILE_START, OFFSETS, e, pid_m, BLOCK_M, HALF_TILES):
        _down_bwd_act_tile(DOUT, D, SORTED_SLOT, WT, TILE_START, OFFSETS, GU, DGU, ACT_W, DW_PART, e, pid_n, pid_m,
                           H, I, TOP_K, stride_dout, stride_de, stride_dn, stride_gu, stride_dgu, stride_act_w,
                           stride_part, BLOCK_M, BLOCK_M // 2, BLOCK_N, BLOCK_K, PREC, EVEN_N, EVEN_K, TMA, False,
                           DOUT_SORTED)
    else:
        _down_bwd_act_tile(DOUT_OP, D, SORTED_SLOT, WT, TILE_START, OFFSETS, GU, DGU, ACT_W, DW_PART, e, pid_n,
                           pid_m, H, I, TOP_K, stride_dout, stride_de, stride_dn, stride_gu, stride_dgu, stride_act_w,
                           stride_part, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, PREC, EVEN_N, EVEN_K, TMA, TMA_A,
                           DOUT_SORTED)


@triton.jit
def _down_bwd_act_tile(
    DOUT, D, SORTED_SLOT, WT, TILE_START, OFFSETS, GU, DGU, ACT_W, DW_PART, e, pid_n, pid_m, H, I, TOP_K,
    stride_dout, stride_de, stride_dn, stride_gu, stride_dgu, stride_act_w, stride_part,
    TILE_M: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr, TMA_A: tl.constexpr, DOUT_SORTED: tl.constexpr,
):
    rows, row_mask = _tile_rows(TILE_START, OFFSETS, e, pid_m, TILE_M, BM)
    slots = tl.load(SORTED_SLOT + rows, mask=row_mask, other=0)
    if DOUT_SORTED:
        a_rows = rows
    else:
        a_rows = slots.to(tl.int64) // TOP_K  # the row's token
    acc = _rows_acc(DOUT, D, e, a_rows, row_mask, pid_n, I, H, stride_dout, stride_de, stride_dn, BM, BLOCK_N,
                    BLOCK_K, PREC, EVEN_N, EVEN_K, TMA, TMA_A, False)
    w = tl.load(WT + slots, mask=row_mask, other=0.0).to(tl.float32)
    _act_bwd_epilogue(acc, rows, row_mask, w, pid_n, I, GU, DGU, ACT_W, DW_PART, stride_gu, stride_dgu,
                      stride_act_w, stride_part, BLOCK_N, EVEN_N)


@triton.jit
def _act_bwd_epilogue(
    acc, rows, row_mask, w, pid_n, I, GU, DGU, ACT_W, DW_PART, stride_gu, stride_dgu, stride_act_w, stride_part,
    BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr,
):
    # act recomputed from gate_up_out (not saved by the forward); dweight partial = sum_i g_act * act (one per
    # column tile, summed in order by the caller); dact = w * g_act (w: the rows' routing weights, fp32); SwiGLU
    # backward -> dgate, dup;
    # act_w = w * act (operand of the down-proj weight grad)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = row_mask[:, None] & _in_bounds(cols, I, EVEN_N)[None, :]
    g_act = acc.to(DGU.dtype.element_ty).to(tl.float32)
    gu_ptrs = GU + rows[:, None] * stride_gu + cols[None, :]
    g = tl.load(gu_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptrs + I, mask=mask, other=0.0).to(tl.float32)
    act = _swiglu(g, u).to(ACT_W.dtype.element_ty).to(tl.float32)
    tl.store(DW_PART + rows * stride_part + pid_n, tl.sum(g_act * act, axis=1), mask=row_mask)
    dg, du = _swiglu_bwd(g_act * w[:, None], g, u)
    dgu_ptrs = DGU + rows[:, None] * stride_dgu + cols[None, :]
    tl.store(dgu_ptrs, dg.to(DGU.dtype.element_ty), mask=mask)
    tl.store(dgu_ptrs + I, du.to(DGU.dtype.element_ty), mask=mask)
    tl.store(ACT_W + rows[:, None] * stride_act_w + cols[None, :], (act * w[:, None]).to(ACT_W.dtype.element_ty),
             mask=mask)


@triton.jit
def _swiglu_bwd_rows_kernel(
    G_ACT, GU, SORTED_SLOT, WT, OFFSETS, DGU, DWEIGHTS, S, I, E, stride_g, stride_gu, stride_dgu,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # the epilogue of _down_bwd_act_kernel as its own pass, after the GEMM g_act = dout_rows @ Wd[e] (grouped_mm
    # paths): act recomputed from gate_up_out; the routing-weight grad <g_act, act> (whole row: no partials) goes
    # straight to the row's slot of DWEIGHTS ((T * K,), slot order, the weights' dtype; WT: the weights, slot order);
    # dact = w * g_act -> dgate, dup; G_ACT overwritten in place with w * act. Rows outside the experts' range
    # [offsets[0], offsets[E]) (slots routed outside [0, E)) compute nothing: their slots get a zero grad.
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    slots = tl.load(SORTED_SLOT + rows, mask=rows < S, other=0)
    r_mask = (rows >= tl.load(OFFSETS)) & (rows < tl.load(OFFSETS + E))
    w = tl.load(WT + slots, mask=r_mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c0 in range(0, I, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        mask = r_mask[:, None] & (cols < I)[None, :]
        g_ptrs = G_ACT + rows[:, None] * stride_g + cols[None, :]
        g_act = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
        gu_ptrs = GU + rows[:, None] * stride_gu + cols[None, :]
        g = tl.load(gu_ptrs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptrs + I, mask=mask, other=0.0).to(tl.float32)
        act = _swiglu(g, u).to(G_ACT.dtype.element_ty).to(tl.float32)
        dw += tl.sum(g_act * act, axis=1)
        dg, du = _swiglu_bwd(g_act * w[:, None], g, u)
        dgu_ptrs = DGU + rows[:, None] * stride_dgu + cols[None, :]
        tl.store(dgu_ptrs, dg.to(DGU.dtype.element_ty), mask=mask)
        tl.store(dgu_ptrs + I, du.to(DGU.dtype.element_ty), mask=mask)
        tl.store(g_ptrs, (act * w[:, None]).to(G_ACT.dtype.element_ty), mask=mask)
    tl.store(DWEIGHTS + slots, dw.to(DWEIGHTS.dtype.element_ty), mask=rows < S)


@triton.jit
def _weight_grad_kernel(
    A, B, SORTED_SLOT, OFFSETS, DW,
    M, N, TOP_K, stride_a, stride_b, stride_dwe, stride_dwn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, A_BY_TOKEN: tl.constexpr,
):
    # dW[e][m, n] = sum over the expert's sorted rows r of a_r[m] * b_r[n]   (one program per (tile, expert), the
    # rows reduced in order: deterministic). The operand indexed by token is read from the token's row:
    #   gate_up: a_r = dgate_up_out[r], b_r = x[token_r]        (A_BY_TOKEN=False)
    #   down:    a_r = dout[token_r],   b_r = act_w[r]          (A_BY_TOKEN=True)
    pid = tl.program_id(0)
    e = tl.program_id(1).to(tl.int64)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    lo = tl.load(OFFSETS + e)
    hi = tl.load(OFFSETS + e + 1)
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = _in_bounds(ms, M, EVEN_M)
    n_mask = _in_bounds(ns, N, EVEN_N)
    ks = tl.arange(0, BLOCK_K).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(lo, hi, BLOCK_K):
        rows = r0 + ks
        r_mask = rows < hi
        tok = tl.load(SORTED_SLOT + rows, mask=r_mask, other=0).to(tl.int64) // TOP_K
        if A_BY_TOKEN:
            a_rows = tok
            b_rows = rows
        else:
            a_rows = rows
            b_rows = tok
        a = tl.load(A + a_rows[None, :] * stride_a + ms[:, None], mask=m_mask[:, None] & r_mask[None, :], other=0.0)
        b = tl.load(B + b_rows[:, None] * stride_b + ns[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PREC)
    tl.store(DW + e * stride_dwe + ms[:, None].to(tl.int64) * stride_dwn + ns[None, :], acc.to(DW.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _tile_map_kernel(OFFSETS, TILE_EXPERT, TILE_START, SORTED_SLOT, POS, E, MAX_TILES, S, MAP_PROGRAMS,
                     BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_P: tl.constexpr):
    # expert e owns ceil(rows_e / BLOCK_M) row tiles, numbered from TILE_START[e] (exclusive prefix sum), and
    # TILE_START[E] is the tile count (program 0 writes those); TILE_EXPERT[j] = the expert of tile j
    # = #{e : tiles of e end at or before j} (E past the last tile), BLOCK_J slots per program (each program
    # recomputes the E-long prefix sum: cheaper than a second launch). Programs past the first MAP_PROGRAMS (if
    # any) invert the routing's sort instead, BLOCK_P rows each: POS[SORTED_SLOT[r]] = r (saves two launches)
    if tl.program_id(0) >= MAP_PROGRAMS:
        rows = (tl.program_id(0) - MAP_PROGRAMS) * BLOCK_P + tl.arange(0, BLOCK_P)
        r_mask = rows < S
        slots = tl.load(SORTED_SLOT + rows, mask=r_mask, other=0)
        tl.store(POS + slots, rows.to(tl.int64), mask=r_mask)
        return
    es = tl.arange(0, BLOCK_E)
    e_mask = es < E
    lo = tl.load(OFFSETS + es, mask=e_mask, other=0)
    hi = tl.load(OFFSETS + es + 1, mask=e_mask, other=0)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, 0)
    if tl.program_id(0) == 0:
        tl.store(TILE_START + es, tile_end - tiles, mask=e_mask)
        tl.store(TILE_START + E, tl.sum(tiles, 0))  # the tile count (persistent launches loop up to it)
    js = tl.program_id(0) * BLOCK_J + tl.arange(0, BLOCK_J)
    ended = (tile_end[None, :] <= js[:, None]) & e_mask[None, :]
    tl.store(TILE_EXPERT + js, tl.sum(ended.to(tl.int32), axis=1), mask=js < MAX_TILES)


@triton.jit
def _gather_rows_kernel(
    SRC, SORTED_SLOT, DST, S, N, TOP_K, stride_src, stride_dst, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # dst[r] = src[token_r]: expert-sorted rows for torch._grouped_mm
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_mask = rows < S
    mask = r_mask[:, None] & (cols < N)[None, :]
    tok = tl.load(SORTED_SLOT + rows, mask=r_mask, other=0).to(tl.int64) // TOP_K
    v = tl.load(SRC + tok[:, None] * stride_src + cols[None, :], mask=mask, other=0.0)
    tl.store(DST + rows.to(tl.int64)[:, None] * stride_dst + cols[None, :], v, mask=mask)


# ----------------------------------------------------------------------------------------------- launch

# Tile configs for 16-bit inputs on CUDA (H100/H200 class), one entry per kernel, from H200 sweeps at the
# Qwen3-30B-A3B shape (benchmarks/tune_moe.py, T=8192 E=128 K=8 H=2048 I=768; each variant timed call by call,
# interleaved with the default). Row tiles (BLOCK_M) drop to 64 when experts get few rows (decode, many experts).
# TMA: read the (dense, per expert) weight operand through a Hopper tensor descriptor (sm_90+, when the tile fits
# the expert's slice; ignored otherwise): down_fwd 0.505 -> 0.404 ms, gate_up_bwd_x 0.798 -> 0.731 ms. TMA_A: the
# same for the contiguous sorted-row operand (-0.5 % / -1.1 % on the fwd / bwd phase). HALF_TILES: a row tile
# holding at most BLOCK_M / 2 of its expert's rows computes only those (`_half_tile`; not in persistent launches):
# -2.4 % gate_up_fwd, -1.0 % down_fwd. PERSISTENT: one program per SM loops over the tiles (`_persistent_grid`):
# -2.7 % down_fwd, -1.0 % gate_up_bwd_x, but +13 % on gate_up_fwd (off there); two programs per SM were slower on
# every row GEMM. gate_up_fwd: 64 gate + 64 up columns per tile, 3 stages (96 KB of shared memory: two CTAs per
# SM, one's epilogue overlapping the other's main loop), gate and up as ONE dot of 128 columns (1.11x over two).
# Module-level and read at call time, so that benchmarks/tune_moe.py can sweep them without editing code.
TUNING = {
    "gate_up_fwd": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3, TMA=True,
                        HALF_TILES=True, PERSISTENT=False),
    "down_fwd": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3, TMA=True, TMA_A=True,
                     HALF_TILES=True, PERSISTENT=True),
    # the fused g_act kernel (impls "triton", "grouped_mm_wgrad"): persistent -3.4 %, 256-column tiles -24..-33 %
    # (the epilogue's fp32 temporaries beside a 128x256 accumulator)
    "down_bwd_act": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4, TMA=True, TMA_A=True,
                         HALF_TILES=True, PERSISTENT=False),
    "gate_up_bwd_x": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4, TMA=True, TMA_A=True,
                          HALF_TILES=True, PERSISTENT=True),
    "gate_up_bwd_w": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
    "down_bwd_w": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
    "combine": dict(BLOCK_T=8, BLOCK_N=256, num_warps=4),
    # backward GEMMs (see moe_bwd): "triton" (all Triton kernels), "grouped_mm_wgrad" (the two weight grads
    # through torch._grouped_mm: CUTLASS K-grouped GEMMs over gathered expert-sorted rows), "grouped_mm" (those,
    # and g_act = dout_rows @ Wd[e] as a row GEMM on the gathered rows, its SwiGLU epilogue in
    # _swiglu_bwd_rows_kernel) or "grouped_mm_lean" (the same but the gate_up weight grad in Triton, which gathers
    # x rows itself: no (S, H) buffer of them at the backward's peak, ~3 % slower); falls back to "triton" where
    # _grouped_mm's fast path does not apply (`_grouped_mm_applies`). CUTLASS's weight grads reach ~80 % of the
    # matmul rate, Triton's ~55 % (bwd 3.675 -> 3.037 ms). g_act: "triton" (the row GEMM kernel, TUNING
    # ["down_bwd_g"]: persistent, no padding rows past half a tile) or "cutlass" (torch._grouped_mm, M-grouped,
    # 2.4 % slower on the bwd phase); the fused Triton g_act kernel of "grouped_mm_wgrad" stays 10-14 % slower (its
    # SwiGLU epilogue is not overlapped with the MMAs).
    "backward": dict(impl="grouped_mm", g_act="triton"),
    "down_bwd_g": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4, TMA=True, TMA_A=True,
                       HALF_TILES=True, PERSISTENT=True),
    "gather_rows": dict(BLOCK_R=8, BLOCK_N=512, num_warps=4),  # the row gathers of the grouped_mm paths
    "swiglu_bwd_rows": dict(BLOCK_R=4, BLOCK_N=256, num_warps=4),
}
_FP32_CONFIG = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=8, num_stages=3)  # IEEE fp32: no tensor cores
# interpreter: small tiles, so that the tests cover several row tiles per expert and several column tiles
_INTERPRETER_CONFIG = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, num_warps=4, num_stages=1, TMA=False, HALF_TILES=True,
                          PERSISTENT=False)
_INTERPRETER_W_CONFIG = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, num_warps=4, num_stages=1)


def _on_gpu(t: torch.Tensor) -> bool:
    return t.device.type != "cpu"


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit operands


def _config(name: str, t: torch.Tensor, S: int, E: int) -> dict:
    if not _on_gpu(t):
        return dict(_INTERPRETER_W_CONFIG if name.endswith("_w") else _INTERPRETER_CONFIG)
    if t.dtype == torch.float32:
        return dict(_FP32_CONFIG, TMA=False)
    cfg = dict(TUNING[name])
    if not name.endswith("_w") and S < 96 * E:  # few rows per expert: less padding waste per row tile
        cfg["BLOCK_M"] = min(cfg["BLOCK_M"], 64)
    if cfg["BLOCK_M"] < 128:  # half tiles of fewer than 64 rows would not fill a Hopper warpgroup MMA
        cfg["HALF_TILES"] = False
    if t.device.type != "cuda":  # persistent grids are sized from torch.cuda's SM count (CUDA and ROCm builds)
        cfg["PERSISTENT"] = False
    return cfg


_POSITIONS_BLOCK = 1024  # sorted rows per program of the sort's inversion in `_tile_map_kernel`


class _RowTiles:
    """Row-tile maps of the sorted rows, one per BLOCK_M in use, built on the device by `_tile_map_kernel` (one
    launch, no host sync). With sorted_slot, the first map's launch also inverts the sort (`positions`)."""

    def __init__(self, expert_offsets: torch.Tensor, S: int, sorted_slot: torch.Tensor | None = None):
        self.expert_offsets, self.S, self.sorted_slot, self._maps, self._pos = expert_offsets, S, sorted_slot, {}, None

    def __call__(self, block_m: int):
        if block_m not in self._maps:
            offsets = self.expert_offsets
            E = offsets.numel() - 1
            # static bound on the number of row tiles: the grid size never depends on the routing
            max_tiles = max(1, min(cdiv(self.S, block_m) + E, self.S))
            tile_expert = torch.empty(max_tiles, dtype=torch.int64, device=offsets.device)
            tile_start = torch.empty(E + 1, dtype=torch.int64, device=offsets.device)  # [E]: the tile count
            block_e = next_power_of_2(E)
            # a (BLOCK_J, BLOCK_E) comparison per program, <= 4096 elements (16384 took 7-10 us per launch, this 2)
            block_j = max(16, min(1024, 4096 // block_e))
            map_programs = cdiv(max_tiles, block_j)
            pos_programs = 0
            if self.sorted_slot is not None and self._pos is None:
                self._pos = torch.empty_like(self.sorted_slot)
                pos_programs = cdiv(self.S, _POSITIONS_BLOCK)
            launch(_tile_map_kernel, (map_programs + pos_programs,),
                offsets, tile_expert, tile_start, self.sorted_slot if pos_programs else tile_expert,
                self._pos if pos_programs else tile_expert, E, max_tiles, self.S, map_programs, BLOCK_M=block_m,
                BLOCK_E=block_e, BLOCK_J=block_j, BLOCK_P=_POSITIONS_BLOCK, num_warps=4)
            self._maps[block_m] = (tile_expert, tile_start, max_tiles)
        return self._maps[block_m]

    def positions(self) -> torch.Tensor:
        """pos (S,) int64: the sorted row of every slot, the inverse of the routing's sort (written by the first
        map's launch; by `_positions` if no map was built)."""
        if self._pos is None:
            self._pos = _positions(self.sorted_slot)
        return self._pos


def _persistent_grid(cfg: dict, n_programs: int, device: torch.device) -> int:
    """Programs of a row-tiled GEMM launch: one per tile slot (n_programs, those past the routing's tiles exit at
    once), or with cfg["PERSISTENT"] one per SM (more do not fit: the kernels take most of its shared memory),
    each looping over every num_programs-th tile up to the tile count the tile map wrote on the device. The loop is
    flattened (`tl.range(flatten=True)`): one software pipeline across the tiles, so a tile's first operand loads
    overlap the previous tile's epilogue."""
    if not cfg.get("PERSISTENT"):
        return n_programs
    if device.type == "cpu":  # interpreter: a few programs, so that each loops over several tiles
        return min(n_programs, 3)
    return min(n_programs, sm_count(device))


def _launch_opts(cfg: dict) -> dict:
    return dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _tma_ok(w: torch.Tensor, tile_in_expert: bool) -> bool:
    # Hopper+ copy engine (or the interpreter); a tile must not straddle two experts' slices of the 2-D view
    if not tile_in_expert or not w.is_contiguous() or w.shape[-1] * w.element_size() % 16 or w.data_ptr() % 16:
        return False
    if w.device.type == "cpu":
        return True
    return (w.device.type == "cuda" and torch.version.cuda is not None
            and capability(w.device)[0] >= 9)


def _weight_operand(w: torch.Tensor, cfg: dict, block_shape: list, tile_in_expert: bool):
    """(operand, TMA flag): a tensor descriptor over w (E, R, C) viewed as (E * R, C) when cfg asks for TMA and
    it applies, else w itself (pointer loads)."""
    if not (cfg["TMA"] and _tma_ok(w, tile_in_expert)):
        return w, False
    from triton.tools.tensor_descriptor import TensorDescriptor

    E, R, C = w.shape
    return TensorDescriptor(w, [E * R, C], [C, 1], block_shape), True


def _gate_up_operand(w: torch.Tensor, cfg: dict):
    """(operand, TMA flag) of gate_up_fwd: a tensor descriptor over gate_up_proj (E, 2I, H) viewed as (E * 2, I, H)
    with (2, BLOCK_N, BLOCK_K) blocks (a tile's gate rows and up rows in one copy; the copy engine zero-fills rows
    past I, so no tile reads another expert's) when cfg asks for TMA and it applies, else w (pointer loads)."""
    if not (cfg["TMA"] and _tma_ok(w, True)):
        return w, False
    from triton.tools.tensor_descriptor import TensorDescriptor

    E, two_i, H = w.shape
    return TensorDescriptor(w, [E * 2, two_i // 2, H], [two_i // 2 * H, H, 1],
                            [2, cfg["BLOCK_N"], cfg["BLOCK_K"]]), True


def _rows_operand(a: torch.Tensor, cfg: dict, block_shape: list):
    """(operand, TMA_A flag): a tensor descriptor over the expert-sorted rows a (S, C) when cfg asks for TMA_A and
    it applies, else a itself (pointer loads)."""
    if not (cfg.get("TMA_A") and _tma_ok(a, True)):
        return a, False
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(a, list(a.shape), [a.stride(0), 1], block_shape), True


def _positions(sorted_slot: torch.Tensor) -> torch.Tensor:
    pos = torch.empty_like(sorted_slot)
    pos.scatter_(0, sorted_slot, torch.arange(sorted_slot.numel(), device=sorted_slot.device))
    return pos


def _combine(y_rows, pos, top_k_index, weights, T, H, E, out_dtype, refill=None):
    """out[t] = sum_k weights[t, k] * y_rows[pos[t, k]] (weights None: 1). refill (T, H): afterwards y_rows holds
    the expert-sorted rows of refill (y_rows[r] = refill[token of row r], what `_gather_rows` writes), made in the
    same pass over y_rows."""
    K = top_k_index.shape[1]
    out = torch.empty((T, H), dtype=out_dtype, device=y_rows.device)
    cfg = TUNING["combine"] if _on_gpu(y_rows) else dict(BLOCK_T=16, BLOCK_N=32, num_warps=4)
    block_t, block_n = cfg["BLOCK_T"], min(cfg["BLOCK_N"], next_power_of_2(H))
    grid = (cdiv(T, block_t), cdiv(H, block_n))
    src = refill if refill is not None else y_rows
    launch(_combine_kernel, grid,
        y_rows, pos, top_k_index, weights if weights is not None else y_rows, out, src, T, H, E,
        y_rows.stride(0), out.stride(0), src.stride(0), K=K, HAS_WEIGHT=weights is not None,
        REFILL=refill is not None, BLOCK_T=block_t, BLOCK_N=block_n, num_warps=cfg["num_warps"],
    )
    return out


def _gather_rows(src, sorted_slot, top_k, dst):
    """dst[r] = src[token of row r] (token = sorted_slot[r] // top_k), dst (S, N) in src's dtype."""
    S, N = dst.shape
    cfg = TUNING["gather_rows"] if _on_gpu(src) else dict(BLOCK_R=8, BLOCK_N=32, num_warps=4)
    block_n = min(cfg["BLOCK_N"], next_power_of_2(N))
    grid = (cdiv(S, cfg["BLOCK_R"]), cdiv(N, block_n))
    launch(_gather_rows_kernel, grid, src, sorted_slot, dst, S, N, top_k, src.stride(0), dst.stride(0),
                              BLOCK_R=cfg["BLOCK_R"], BLOCK_N=block_n, num_warps=cfg["num_warps"])
    return dst


def _swiglu_bwd_rows(g_act, gate_up_out, sorted_slot, top_k_weights, expert_offsets, dgate_up_out):
    """The SwiGLU backward of g_act's rows (`_swiglu_bwd_rows_kernel`): writes dgate_up_out, overwrites g_act with
    act_w, returns the routing-weight grad (T, K) in the weights' dtype (zero for slots routed outside [0, E))."""
    S, inter = g_act.shape
    cfg = TUNING["swiglu_bwd_rows"] if _on_gpu(g_act) else dict(BLOCK_R=4, BLOCK_N=16, num_warps=4)
    block_n = min(cfg["BLOCK_N"], next_power_of_2(inter))
    dweights = torch.empty_like(top_k_weights)
    launch(_swiglu_bwd_rows_kernel, (cdiv(S, cfg["BLOCK_R"]),),
        g_act, gate_up_out, sorted_slot, top_k_weights, expert_offsets, dgate_up_out, dweights, S, inter,
        expert_offsets.numel() - 1, g_act.stride(0), gate_up_out.stride(0), dgate_up_out.stride(0),
        BLOCK_R=cfg["BLOCK_R"], BLOCK_N=block_n, num_warps=cfg["num_warps"],
    )
    return dweights


def _grouped_mm_applies(t: torch.Tensor, H: int, inter: int, E: int) -> bool:
    """Whether torch._grouped_mm runs its fast path for the weight grads: the CUTLASS sm90/sm100 kernel (bf16
    only; elsewhere torch falls back to a per-group mm loop that syncs the host), TMA-aligned row strides
    (H, I multiples of 8 elements), fewer than 1024 groups (E + 1 are used)."""
    if not hasattr(torch, "_grouped_mm") or t.dtype != torch.bfloat16:
        return False
    if t.device.type != "cuda" or torch.version.cuda is None:
        return False
    return capability(t.device)[0] in (9, 10) and H % 8 == 0 and inter % 8 == 0 and E + 1 < 1024


BACKWARD_IMPLS = ("triton", "grouped_mm", "grouped_mm_lean", "grouped_mm_wgrad")


def backward_impl(t: torch.Tensor, H: int, inter: int, E: int) -> str:
    """The backward implementation that runs for these inputs: TUNING["backward"]["impl"] (read at call time)
    where it applies (`_grouped_mm_applies`), else "triton"."""
    impl = TUNING.get("backward", {}).get("impl", "triton")
    if impl not in BACKWARD_IMPLS:
        raise ValueError(f"moe: unknown TUNING['backward'] impl {impl!r} (one of {BACKWARD_IMPLS})")
    if impl.startswith("grouped_mm"):
        return impl if _grouped_mm_applies(t, H, inter, E) else "triton"
    return impl


def _m_grouped_mm(a_sorted, w, expert_offsets):
    """out[rows_e] = a_sorted[rows_e] @ w[e] for every expert e, one torch._grouped_mm call ("M-grouped", 2d x 3d).

    a_sorted (S, K) in expert-sorted order, w (E, K, N), expert_offsets int32 (E + 1,); returns (S, N).
    offs = the E group ends, the first group starting at row 0: rows before offsets[0] (slots routed to negative
    ids) are computed with expert 0's weight
    and rows past offsets[E] (the sentinel E) are left unwritten; no consumer reads either (they fall outside
    every expert's range)."""
    return torch._grouped_mm(a_sorted, w, offs=expert_offsets[1:])


def _k_grouped_mm(a_sorted, b_sorted, expert_offsets):
    """out[e] = a_sorted[rows_e]^T @ b_sorted[rows_e] for every expert e, one torch._grouped_mm call.

    a_sorted (S, M), b_sorted (S, N): rows in expert-sorted order, expert_offsets int32 (E + 1,); returns
    (E, M, N). The "K-grouped" 2d x 2d
    form (what autograd of _grouped_mm uses for its weight grad): mat_a = a_sorted.t() (column-major), mat_b
    row-major, offs = int32 cumulative row ends, one per group, the first group starting at row 0.
    We pass E + 1 groups, offs = expert_offsets: group 0 = rows [0, offsets[0]) (slots routed to negative ids,
    usually none; its product is dropped, so unwritten rows there never reach a result), group e + 1 = expert
    e. Rows past offsets[E] (the expert-parallel sentinel E) are past the last offset: never read.
    Experts with no rows are zero-K groups: GroupMMCommon.cuh accepts them only in this layout (column-major A,
    row-major B; every other layout asserts K > 0) and they come out as zeros (test_backward_grouped_mm_gpu has
    empty experts).
    Determinism / capture, as far as the source shows (pytorch GroupMM.cu / GroupedBlas.cpp, the sm90/sm100
    bf16 fast path; it is CUTLASS, not cuBLAS, up to torch builds with CUDA < 13.3, where newer torch may pick
    cuBLASLt grouped GEMM instead): one CUTLASS ptr-array TMA warp-specialized kernel with a persistent tile
    scheduler, no split-K / stream-K (each output tile is reduced by one CTA in K order: deterministic);
    per-group problem sizes are built on the device from offs by a prepare kernel (no host sync) and scratch
    comes from the caching allocator, so it is CUDA-graph capturable (the gpu test captures it).
    """
    out = torch._grouped_mm(a_sorted.t(), b_sorted, offs=expert_offsets)
    return out[1:]  # (E + 1, M, N) contiguous -> the E expert groups, still contiguous


def _weight_grad_triton(name, rows_a, rows_b, sorted_slot, top_k, expert_offsets, like, a_by_token):
    """out[e] (M, N) = sum over expert e's rows r of a_r^T b_r with `_weight_grad_kernel` (its TUNING entry
    `name`); out has the shape of `like` (E, M, N); a_by_token: rows_a is indexed by token, else rows_b is."""
    E, M, N = like.shape
    cfg = _config(name, rows_a, sorted_slot.numel(), E)
    out = torch.empty_like(like)
    launch(_weight_grad_kernel, (cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]), E),
        rows_a, rows_b, sorted_slot, expert_offsets, out, M, N, top_k, rows_a.stride(0), rows_b.stride(0),
        out.stride(0),
        out.stride(1), PREC=_prec(rows_a.dtype), EVEN_M=M % cfg["BLOCK_M"] == 0, EVEN_N=N % cfg["BLOCK_N"] == 0,
        A_BY_TOKEN=a_by_token, **_launch_opts(cfg),
    )
    return out


def _down_bwd_act(dout, dout_sorted, down_proj, sorted_slot, top_k_weights, row_tiles, expert_offsets, gate_up_out,
                  dgate_up_out):
    """g_act = dout_r @ Wd[e] per sorted row r with the SwiGLU backward in its epilogue (`_down_bwd_act_kernel`):
    writes dgate_up_out, returns (act_w (S, I), dw_rows (S,) fp32). dout is (T, H), read by token, or with
    dout_sorted the gathered expert-sorted rows (S, H) (then readable through TMA, cfg["TMA_A"])."""
    S = sorted_slot.numel()
    E, H, inter = down_proj.shape
    cfg = _config("down_bwd_act", dout, S, E)
    tile_expert, tile_start, max_tiles = row_tiles(cfg["BLOCK_M"])
    tiles_i = cdiv(inter, cfg["BLOCK_N"])
    act_w = torch.empty((S, inter), dtype=dout.dtype, device=dout.device)
    dw_part = torch.empty((S, tiles_i), dtype=torch.float32, device=dout.device)
    even_k = H % cfg["BLOCK_K"] == 0
    w_down, tma = _weight_operand(down_proj, cfg, [cfg["BLOCK_K"], cfg["BLOCK_N"]], even_k)
    a_op, tma_a = _rows_operand(dout, cfg, [cfg["BLOCK_M"], cfg["BLOCK_K"]]) if dout_sorted else (dout, False)
    launch(_down_bwd_act_kernel, (_persistent_grid(cfg, tiles_i * max_tiles, dout.device),),
        dout, a_op, w_down, sorted_slot, top_k_weights, tile_expert, tile_start, expert_offsets, gate_up_out,
        dgate_up_out, act_w, dw_part, H, inter, E, top_k_weights.shape[1], tiles_i, dout.stride(0),
        down_proj.stride(0), down_proj.stride(1), gate_up_out.stride(0), dgate_up_out.stride(0), act_w.stride(0),
        dw_part.stride(0),
        PREC=_prec(dout.dtype), EVEN_N=inter % cfg["BLOCK_N"] == 0, EVEN_K=even_k, TMA=tma, TMA_A=tma_a,
        HALF_TILES=cfg.get("HALF_TILES", False), DOUT_SORTED=dout_sorted, PERSISTENT=cfg.get("PERSISTENT", False),
        **_launch_opts(cfg),
    )
    return act_w, dw_part.sum(1)  # fixed-order sum of the per-column-tile partials


def _rows_gemm(name, a, w, row_tiles, expert_offsets, out):
    """out[r] = a[r] @ W[e] over the expert-sorted rows with `_rows_gemm_kernel` (its TUNING entry `name`):
    "down_fwd" (w = down_proj (E, N, K), used transposed), "gate_up_bwd_x" (w = gate_up_proj (E, K, N)) or
    "down_bwd_g" (g_act: w = down_proj (E, K=H, N=I))."""
    b_nk = name == "down_fwd"
    E = w.shape[0]
    N, K = (w.shape[1], w.shape[2]) if b_nk else (w.shape[2], w.shape[1])
    cfg = _config(name, a, a.shape[0], E)
    tile_expert, tile_start, max_tiles = row_tiles(cfg["BLOCK_M"])
    tiles_n = cdiv(N, cfg["BLOCK_N"])
    # a TMA weight tile must not straddle two experts' slices of the 2-D view: along N for (E, N, K), along K else
    in_expert = (N if b_nk else K) % (cfg["BLOCK_N"] if b_nk else cfg["BLOCK_K"]) == 0
    block = [cfg["BLOCK_N"], cfg["BLOCK_K"]] if b_nk else [cfg["BLOCK_K"], cfg["BLOCK_N"]]
    w_op, tma = _weight_operand(w, cfg, block, in_expert)
    a_op, tma_a = _rows_operand(a, cfg, [cfg["BLOCK_M"], cfg["BLOCK_K"]])
    launch(_rows_gemm_kernel, (_persistent_grid(cfg, tiles_n * max_tiles, a.device),),
        a, a_op, w_op, tile_expert, tile_start, expert_offsets, out,
        N, K, E, tiles_n, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        PREC=_prec(a.dtype), EVEN_N=N % cfg["BLOCK_N"] == 0, EVEN_K=K % cfg["BLOCK_K"] == 0, TMA=tma, TMA_A=tma_a,
        HALF_TILES=cfg.get("HALF_TILES", False), B_NK=b_nk, PERSISTENT=cfg.get("PERSISTENT", False),
        **_launch_opts(cfg),
    )
    return out


def _gate_up_fwd(hidden, gate_up_proj, sorted_slot, top_k, row_tiles, expert_offsets, gate_up_out, act):
    """gate_up_out[r] = x[token_r] @ Wgu[e]^T (rounded), act[r] = SwiGLU of it, over the expert-sorted rows
    (`_gate_up_fwd_kernel`, TUNING["gate_up_fwd"])."""
    H = hidden.shape[1]
    E, two_i, _ = gate_up_proj.shape
    inter = two_i // 2
    cfg = _config("gate_up_fwd", hidden, gate_up_out.shape[0], E)
    tile_expert, tile_start, max_tiles = row_tiles(cfg["BLOCK_M"])
    tiles_n = cdiv(inter, cfg["BLOCK_N"])
    w_gu, tma = _gate_up_operand(gate_up_proj, cfg)
    launch(_gate_up_fwd_kernel, (_persistent_grid(cfg, tiles_n * max_tiles, hidden.device),),
        hidden, w_gu, sorted_slot, tile_expert, tile_start, expert_offsets, gate_up_out, act,
        H, inter, E, top_k, tiles_n, hidden.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1),
        gate_up_out.stride(0), act.stride(0), PREC=_prec(hidden.dtype), EVEN_N=inter % cfg["BLOCK_N"] == 0,
        EVEN_K=H % cfg["BLOCK_K"] == 0, TMA=tma, HALF_TILES=cfg.get("HALF_TILES", False),
        PERSISTENT=cfg.get("PERSISTENT", False), **_launch_opts(cfg),
    )
    return gate_up_out, act


def moe_fwd(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, sorted_slot, expert_offsets):
    """Returns (out, gate_up_out, pos): pos (S,) = the sorted row of every slot, kept for the backward."""
    T, H = hidden.shape
    K = top_k_index.shape[1]
    E, two_i, _ = gate_up_proj.shape
    S = T * K
    dtype = hidden.dtype
    row_tiles = _RowTiles(expert_offsets, S, sorted_slot)
    gate_up_out, act = _gate_up_fwd(hidden, gate_up_proj, sorted_slot, K, row_tiles, expert_offsets,
                                    torch.empty((S, two_i), dtype=dtype, device=hidden.device),
                                    torch.empty((S, two_i // 2), dtype=dtype, device=hidden.device))
    y_rows = _rows_gemm("down_fwd", act, down_proj, row_tiles, expert_offsets, torch.empty((S, H), dtype=dtype,
                                                                                       device=hidden.device))
    pos = row_tiles.positions()
    out = _combine(y_rows, pos, top_k_index, top_k_weights, T, H, E, dtype)
    return out, gate_up_out, pos  # act is not kept: the backward recomputes it from gate_up_out


def _dweights_from_rows(dw_rows, pos, top_k_index, E, dtype):
    """The routing-weight grad (T, K) in slot order from the per-row one (zero for slots routed outside [0, E))."""
    valid = (top_k_index >= 0) & (top_k_index < E)
    return torch.where(valid, dw_rows[pos].view(top_k_index.shape), 0.0).to(dtype)


def moe_bwd(dout, hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_out, sorted_slot,
            expert_offsets, pos, reuse_gate_up_out=False, on_input_grads=None):
    """Backward of moe_fwd (pos: its third output). act is not saved: it is recomputed from gate_up_out (bitwise the
    forward's). reuse_gate_up_out: write dgate_up_out over gate_up_out (each element is read before it is written,
    by the same program) instead of into a new (S, 2I) buffer; gate_up_out is garbage afterwards.
    on_input_grads(dhidden, dweights): called once both are enqueued, before the gate_up weight grad (the largest
    weight-grad GEMM), so that work the caller issues on another stream overlaps it.

    With g_act = dout[token_r] @ Wd[e] per sorted row r (rounded to the dtype), act_w = w_r * act:
    dweights = <g_act, act>, dgate_up_out = SwiGLU backward of w_r * g_act, dx_r = dgate_up_out_r @ Wgu[e]
    (dhidden sums each token's K rows), dWgu[e] = dgate_up_out^T x_rows, dWd[e] = dout_rows^T act_w.
    """
    T, H = hidden.shape
    K = top_k_index.shape[1]
    E, two_i, _ = gate_up_proj.shape
    inter = two_i // 2
    S = T * K
    dtype = hidden.dtype
    row_tiles = _RowTiles(expert_offsets, S)
    impl = backward_impl(hidden, H, inter, E)
    dgate_up_out = gate_up_out if reuse_gate_up_out else torch.empty((S, two_i), dtype=dtype, device=hidden.device)
    rows_buf = torch.empty((S, H), dtype=dtype, device=hidden.device)  # dout rows, then dx rows, then x rows

    # 1. g_act, its SwiGLU backward and the routing-weight grad; act_w for the down-proj weight grad
    dout_rows = None
    if impl in ("grouped_mm", "grouped_mm_lean"):
        dout_rows = _gather_rows(dout, sorted_slot, K, rows_buf)
        if TUNING["backward"].get("g_act", "triton") == "triton":
            act_w = _rows_gemm("down_bwd_g", dout_rows, down_proj, row_tiles, expert_offsets,
                               torch.empty((S, inter), dtype=dtype, device=hidden.device))
        else:
            act_w = _m_grouped_mm(dout_rows, down_proj, expert_offsets)  # g_act, overwritten with act_w
        dweights = _swiglu_bwd_rows(act_w, gate_up_out, sorted_slot, top_k_weights, expert_offsets, dgate_up_out)
        ddown_proj = _k_grouped_mm(dout_rows, act_w, expert_offsets)
        del act_w
    else:  # g_act and its SwiGLU backward in one Triton kernel, reading the gathered dout rows where they exist
        if impl == "grouped_mm_wgrad":
            dout_rows = _gather_rows(dout, sorted_slot, K, rows_buf)
        act_w, dw_rows = _down_bwd_act(dout if dout_rows is None else dout_rows, dout_rows is not None, down_proj,
                                       sorted_slot, top_k_weights, row_tiles, expert_offsets, gate_up_out,
                                       dgate_up_out)
        if impl == "grouped_mm_wgrad":
            ddown_proj = _k_grouped_mm(dout_rows, act_w, expert_offsets)
        else:
            ddown_proj = _weight_grad_triton("down_bwd_w", dout, act_w, sorted_slot, K, expert_offsets, down_proj,
                                             a_by_token=True)
        del act_w
        dweights = _dweights_from_rows(dw_rows, pos, top_k_index, E, top_k_weights.dtype)

    # 2. grad of hidden: per-row dx (stream order: after the last reader of rows_buf), then each token's K copies;
    # on the grouped_mm paths the same pass refills rows_buf with the expert-sorted x rows for the weight grad
    dx_rows = _rows_gemm("gate_up_bwd_x", dgate_up_out, gate_up_proj, row_tiles, expert_offsets, rows_buf)
    x_rows_next = impl in ("grouped_mm", "grouped_mm_wgrad")
    dhidden = _combine(dx_rows, pos, top_k_index, None, T, H, E, dtype, refill=hidden if x_rows_next else None)
    if on_input_grads is not None:
        on_input_grads(dhidden, dweights)

    # 3. gate_up weight grad
    if x_rows_next:
        dgate_up_proj = _k_grouped_mm(dgate_up_out, rows_buf, expert_offsets)  # rows_buf: the x rows now
    else:
        # every name of the (S, H) buffer dropped first: the allocator can hand it to this grad (the peak of a
        # training step is usually here, in the backward of the first MoE layer, with all the other grads live)
        rows_buf = dx_rows = dout_rows = None  # noqa: F841
        dgate_up_proj = _weight_grad_triton("gate_up_bwd_w", dgate_up_out, hidden, sorted_slot, K, expert_offsets,
                                            gate_up_proj, a_by_token=False)
    return dhidden, dweights, dgate_up_proj, ddown_proj
