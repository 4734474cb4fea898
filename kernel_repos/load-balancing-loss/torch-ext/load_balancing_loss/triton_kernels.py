"""Triton kernels: the fused load-balancing loss (all layers in one launch) and the fused softmax-top-k router.

Load-balancing loss. The layers' router logits stay where the model left them (no stacking copy): a small
int64 table of each layer's offset from the first layer's pointer (in 16-byte units when aligned, so the
loads keep their vectorisation) is passed and each program finds its layer's base. Program (i, l) owns a
contiguous slab of rows of layer l; per tile it computes the softmax in fp32, rounds it to the logits dtype
(HF's routing weights) and accumulates per-expert probability sums and top-k selection counts (both
mask-weighted, fp32). The top-k set needs no sorting: with keys ordered like (p, -column), distinct within a
row, it is {key >= k-th largest key}, and the k-th largest takes k passes of one unsigned min reduction each
(`_kth_largest`). The keys are 32-bit: exact for 16-bit logits; fp32 p is truncated to fit, and a program
that met a (near-)tie at the k-th place counts its rows again with exact 64-bit keys. Each program writes one partial row (counts and prob sums, 2 x E fp32; ~1 MB in all at 48 x 8192 x 128);
`_lbl_reduce_parts_kernel` sums them in parallel over expert slices in a fixed order (deterministic, no
atomics) and the one-program `_lbl_loss_kernel` writes the loss and dloss/dprob_sum. Launches per fwd+bwd:
forward, reduce, loss, backward (no fills, casts or stacks; autograd's ones() for grad_loss is the caller's). The backward needs only the
softmax (the counts are constants of the loss): it re-reads the logits and writes mask_t * p * (w - <p, w>)
into one (layers, T, E) gradient buffer whose per-layer views are handed to autograd.
Traffic: one read forward, one read + one write backward, plus O(programs x E) partials.

Router. One kernel per direction: softmax (fp32), top-k by packed (value, column) keys, renormalisation,
cast; the row max and row sum of exp are kept (8 bytes per token) so the backward recomputes p exactly.

This module imports triton: import it lazily.
"""
import torch
import triton
import triton.language as tl

from hubfuse._common.device import capturing, int64_table
from hubfuse._common.launch import cdiv, next_power_of_2, launch

_TL_DTYPE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
_TARGET_PROGRAMS = 1024  # router: ~8 per SM on H100/H200, enough to hide latency

# Launch settings of the load-balancing-loss kernels, read at every call (benchmarks/tune_lbl.py sweeps
# them). "fwd"/"bwd" serve 16-bit logits, "fwd_fp32"/"bwd_fp32" fp32 logits (twice the bytes per row, and the
# fp32 forward's truncated keys cost an extra selection pass: different winners). tile: elements per tile
# (rows x experts); lanes: threads sharing a row (fewer = more experts per thread, fewer shuffle rounds per
# row reduction); programs: grid size aimed at (each program owns whole tiles of one layer and writes one
# partial row); num_stages > 1 asks Triton to pipeline the row loop (never in the backward: 15x slower on
# H200). Defaults: the H200 sweep winners at 48 layers x 8192 tokens x 128 experts, top-8.
TUNING = {
    "fwd": dict(tile=4096, lanes=4, num_warps=4, programs=528, num_stages=1),
    "bwd": dict(tile=4096, lanes=4, num_warps=4, programs=2112, num_stages=1),
    "fwd_fp32": dict(tile=4096, lanes=4, num_warps=4, programs=1024, num_stages=1),
    "bwd_fp32": dict(tile=8192, lanes=4, num_warps=8, programs=1024, num_stages=1),
}


FINALIZE_EXPERTS = 8  # experts per program of the partials' reduction (8 fp32 = one 32-byte sector per row)


def tuning(kind: str, elem_bytes: int) -> dict:
    """The `TUNING` entry of kernel `kind` ("fwd"/"bwd") for logits of elem_bytes bytes."""
    return TUNING.get(f"{kind}_fp32", TUNING[kind]) if elem_bytes == 4 else TUNING[kind]


def _tile(num_experts: int):
    block_e = next_power_of_2(num_experts)
    block_t = max(1, min(128, 4096 // block_e))
    num_warps = 4 if block_t * block_e <= 4096 else 8
    return block_t, block_e, num_warps


def _rows_per_program(rows: int, layers: int, block_t: int, programs: int = _TARGET_PROGRAMS) -> int:
    per = cdiv(rows * layers, programs)
    return cdiv(max(per, block_t), block_t) * block_t


# Load-balancing-loss tiles are (BLOCK_T, CHUNKS, CHUNK): expert chunk * CHUNK + c of each row. Triton lays
# the last axis over `lanes` threads (16 bytes each), then the rows over the other lanes and the warps, and
# leaves the chunks in each thread: a row reduction is mostly in-thread, then log2(lanes) shuffle rounds (a
# plain (rows, experts) tile spreads 128 experts over 16 lanes in bf16, over 32 in fp32).

@triton.jit
def _row_max(x):  # (BLOCK_T, 1, 1): in-thread over the chunks, then across the lanes
    return tl.max(tl.max(x, axis=1, keep_dims=True), axis=2, keep_dims=True)


@triton.jit
def _row_min(x):
    return tl.min(tl.min(x, axis=1, keep_dims=True), axis=2, keep_dims=True)


@triton.jit
def _row_sum(x):
    return tl.sum(tl.sum(x, axis=1, keep_dims=True), axis=2, keep_dims=True)


@triton.jit
def _routing_probs(z_ptr, rows, cols, col_ok, E: tl.constexpr, BLOCK_E: tl.constexpr, DT: tl.constexpr):
    """fp32 softmax of a tile, rounded to the logits dtype (HF routing weights). rows: in range (callers
    clamp rows past the end to a valid row and give it no weight), so only padded experts are masked."""
    ptrs = z_ptr + rows.to(tl.int64) * E + cols
    if E == BLOCK_E:
        z = tl.load(ptrs).to(tl.float32)
    else:
        z = tl.load(ptrs, mask=col_ok, other=float("-inf")).to(tl.float32)
    e = tl.exp(z - _row_max(z))
    p = e / _row_sum(e)
    return p.to(DT).to(tl.float32)


@triton.jit
def _kth_largest(key, K: tl.constexpr):
    """Per row, the K-th largest of the row's distinct unsigned keys. Each pass finds the largest key below
    the last one with one min reduction: kth - 1 - key wraps around to huge values for every key >= kth."""
    kth = _row_max(key)
    for _ in tl.static_range(1, K):
        kth = kth - 1 - _row_min(kth - 1 - key)
    return kth


@triton.jit
def _tile_probs(z_ptr, MASK, start, row_end, cols, col_ok, E: tl.constexpr, BLOCK_E: tl.constexpr,
                DT: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_T: tl.constexpr):
    """(routing probs, token weights) of the rows start.. of a tile; rows past row_end get weight 0."""
    rows = start + tl.arange(0, BLOCK_T)[:, None, None]
    row_ok = rows < row_end
    p = _routing_probs(z_ptr, tl.minimum(rows, row_end - 1), cols, col_ok, E, BLOCK_E, DT)
    if HAS_MASK:
        wt = tl.load(MASK + rows, mask=row_ok, other=0).to(tl.float32)
    else:
        wt = tl.where(row_ok, 1.0, 0.0)
    return p, wt


@triton.jit
def _lbl_fwd_kernel(
    Z0, OFFS, MASK, PARTS, T, rows_per_program, num_parts,
    E: tl.constexpr, DT: tl.constexpr, UNIT: tl.constexpr, HAS_MASK: tl.constexpr, TOP_K: tl.constexpr,
    COL_BITS: tl.constexpr, EXACT_KEYS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    layer = tl.program_id(1)
    # layer base = first layer's pointer + a multiple of UNIT elements: keeps the 16-byte alignment that
    # Triton knows for Z0 (so loads vectorise), unlike a raw int->pointer cast
    z_ptr = Z0 + tl.load(OFFS + layer) * UNIT
    cols = tl.arange(0, BLOCK_E // CHUNK)[None, :, None] * CHUNK + tl.arange(0, CHUNK)[None, None, :]
    col_ok = cols < E
    rev_cols = ((1 << COL_BITS) - 1 - cols).to(tl.uint32)
    # selection keys: p >= 0, so its bits order like p; the reversed column in the low COL_BITS bits makes
    # the keys distinct and breaks ties towards the lower column. A 16-bit dtype's p has >= 13 zero low
    # bits in fp32 (EXACT_KEYS); fp32 p (bits < 2^30 as p <= 1) drops its low COL_BITS - 2 bits (see below).
    SHIFT: tl.constexpr = COL_BITS if EXACT_KEYS else COL_BITS - 2
    # accumulators, reduced over rows once at the end (a per-tile reduction over rows would cross warps)
    count_acc = tl.zeros([BLOCK_T, BLOCK_E // CHUNK, CHUNK], dtype=tl.float32)
    prob_acc = tl.zeros([BLOCK_T, BLOCK_E // CHUNK, CHUNK], dtype=tl.float32)
    # (near-)ties at the k-th place seen by each thread: reduced once after the loop (a per-tile reduction
    # over the whole tile would cross warps: a shared-memory round trip and a barrier every tile)
    unsure_acc = tl.zeros([BLOCK_T, 1, CHUNK], dtype=tl.int32)
    row_begin = pid * rows_per_program
    row_end = tl.minimum(row_begin + rows_per_program, T)
    for start in tl.range(row_begin, row_end, BLOCK_T, num_stages=NUM_STAGES):
        p, wt = _tile_probs(z_ptr, MASK, start, row_end, cols, col_ok, E, BLOCK_E, DT, HAS_MASK, BLOCK_T)
        prob_acc += p * wt
        key = ((p.to(tl.uint32, bitcast=True) >> SHIFT) << COL_BITS) | rev_cols
        if E != BLOCK_E:
            key = tl.where(col_ok, key, 0)
        kth = _kth_largest(key, TOP_K)
        count_acc += tl.where(key >= kth, wt, 0.0)
        if not EXACT_KEYS:
            # the truncated keys chose exactly unless another key of the row has the k-th's truncated p (a
            # tie or near-tie at the k-th place; conservatively also one among the selected, or in a
            # padding row: those only cost a needless redo). key ^ kth < 2^COL_BITS for such keys, and
            # (key ^ kth) - 1 wraps around for the k-th itself. Per element, no row reduction (no shuffles):
            # OR-ed over the thread's chunks and kept per thread until after the loop.
            near = ((key ^ kth) - 1) < ((1 << COL_BITS) - 1)
            unsure_acc |= tl.max(near.to(tl.int32), axis=1, keep_dims=True)
    part = layer * tl.num_programs(0) + pid
    out = part * E + cols
    tl.store(PARTS + num_parts * E + out, tl.sum(prob_acc, axis=0, keep_dims=True), mask=col_ok)
    if not EXACT_KEYS:
        if tl.max(unsure_acc) != 0:  # rare: count this program's rows again with exact 64-bit keys
            count_acc = tl.zeros([BLOCK_T, BLOCK_E // CHUNK, CHUNK], dtype=tl.float32)
            for start in range(row_begin, row_end, BLOCK_T):
                p, wt = _tile_probs(z_ptr, MASK, start, row_end, cols, col_ok, E, BLOCK_E, DT, HAS_MASK,
                                    BLOCK_T)
                key = (p.to(tl.uint32, bitcast=True).to(tl.uint64) << COL_BITS) | rev_cols
                if E != BLOCK_E:
                    key = tl.where(col_ok, key, 0)
                count_acc += tl.where(key >= _kth_largest(key, TOP_K), wt, 0.0)
    tl.store(PARTS + out, tl.sum(count_acc, axis=0, keep_dims=True), mask=col_ok)


@triton.jit
def _lbl_reduce_parts_kernel(PARTS, TOTALS, num_parts, E, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    """TOTALS[s, e] = sum over the parts of PARTS[s, part, e]; program (j, s) owns experts j*BLOCK_E.. of
    statistic s (counts, prob sums). Fixed order (a (BLOCK_P, BLOCK_E) accumulator, reduced over the parts
    once at the end): deterministic, no atomics."""
    cols = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)[None, :]
    col_ok = cols < E
    src = PARTS + tl.program_id(1).to(tl.int64) * num_parts * E
    acc = tl.zeros([BLOCK_P, BLOCK_E], dtype=tl.float32)
    for start in range(0, num_parts, BLOCK_P):
        parts = start + tl.arange(0, BLOCK_P)[:, None]
        acc += tl.load(src + parts.to(tl.int64) * E + cols, mask=(parts < num_parts) & col_ok, other=0.0)
    tl.store(TOTALS + tl.program_id(1) * E + cols, tl.sum(acc, axis=0, keep_dims=True), mask=col_ok)


@triton.jit
def _lbl_loss_kernel(TOTALS, LOSS, DLOSS, E, top_k_f, num_experts_f, BLOCK_E: tl.constexpr):
    """loss and dloss/dprob_sum from the (counts, prob sums) totals: one program, E elements."""
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    counts = tl.load(TOTALS + cols, mask=col_ok, other=0.0)
    probs = tl.load(TOTALS + E + cols, mask=col_ok, other=0.0)
    # every (layer, token) picks top_k experts: the weighted row total is sum(counts) / top_k
    rows_total = tl.sum(counts, axis=0) / top_k_f
    tokens_per_expert = counts / rows_total
    loss = tl.sum(tokens_per_expert * (probs / rows_total), axis=0) * num_experts_f
    tl.store(LOSS, loss)
    tl.store(DLOSS + cols, tokens_per_expert * num_experts_f / rows_total, mask=col_ok)


@triton.jit
def _lbl_bwd_kernel(
    Z0, OFFS, GRAD, MASK, DLOSS, GRAD_OUT, T, rows_per_program,
    E: tl.constexpr, DT: tl.constexpr, UNIT: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    layer = tl.program_id(1)
    z_ptr = Z0 + tl.load(OFFS + layer) * UNIT
    g_ptr = GRAD + layer.to(tl.int64) * T * E  # one (layers, T, E) gradient buffer
    cols = tl.arange(0, BLOCK_E // CHUNK)[None, :, None] * CHUNK + tl.arange(0, CHUNK)[None, None, :]
    col_ok = cols < E
    w = tl.load(DLOSS + cols, mask=col_ok, other=0.0) * tl.load(GRAD_OUT).to(tl.float32)
    row_begin = pid * rows_per_program
    row_end = tl.minimum(row_begin + rows_per_program, T)
    for start in tl.range(row_begin, row_end, BLOCK_T, num_stages=NUM_STAGES):
        rows = start + tl.arange(0, BLOCK_T)[:, None, None]
        row_ok = rows < row_end
        p = _routing_probs(z_ptr, tl.minimum(rows, row_end - 1), cols, col_ok, E, BLOCK_E, DT)
        dz = p * (w - _row_sum(p * w))
        if HAS_MASK:
            dz = dz * tl.load(MASK + rows, mask=row_ok, other=0).to(tl.float32)
        tl.store(g_ptr + rows.to(tl.int64) * E + cols, dz.to(GRAD.dtype.element_ty), mask=row_ok & col_ok)


# (device, unit, offsets) -> device tensor. Entries are never evicted: a captured CUDA graph may keep using
# one. Past the cap, new layouts get a fresh table per call instead (the allocator usually repeats layouts).
_OFFSET_TABLES = {}
_OFFSET_TABLES_CAP = 4096
_TABLE_SLOTS = 16  # offsets written per launch of `_offset_table_kernel`
_SLOTS = [f"v{i}" for i in range(_TABLE_SLOTS)]


@triton.jit(do_not_specialize=["start", "n"] + _SLOTS)
def _offset_table_kernel(TABLE, start, n, v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15):
    """TABLE[start + i] = v_i for i < n. Under CUDA-graph capture the values are the launch's arguments, recorded
    in the graph: a table of constants with no host-to-device copy."""
    i = tl.arange(0, 16)
    values = tl.zeros([16], dtype=tl.int64)
    values = tl.where(i == 0, v0, values)
    values = tl.where(i == 1, v1, values)
    values = tl.where(i == 2, v2, values)
    values = tl.where(i == 3, v3, values)
    values = tl.where(i == 4, v4, values)
    values = tl.where(i == 5, v5, values)
    values = tl.where(i == 6, v6, values)
    values = tl.where(i == 7, v7, values)
    values = tl.where(i == 8, v8, values)
    values = tl.where(i == 9, v9, values)
    values = tl.where(i == 10, v10, values)
    values = tl.where(i == 11, v11, values)
    values = tl.where(i == 12, v12, values)
    values = tl.where(i == 13, v13, values)
    values = tl.where(i == 14, v14, values)
    values = tl.where(i == 15, v15, values)
    tl.store(TABLE + start + i, values, mask=i < n)


def layer_table(tensors):
    """(base tensor, int64 offset table on the device, UNIT): layer l starts at base + table[l] * UNIT elements.

    Offsets are relative to tensors[0], in units of 16 bytes when every start is 16-byte aligned relative to
    the first (fresh allocations always are; it keeps the loads vectorised), else one element. Tables are
    cached by content: no host->device copy when the layout repeats, as it does step after step (a new one is
    copied asynchronously from pinned memory). Under CUDA-graph capture a new layout cannot be copied from the
    host: its offsets are written by `_offset_table_kernel` launches that carry them as arguments (the graph
    replays them; the table is not cached, it holds no values before the first replay)."""
    elem = tensors[0].element_size()
    base = tensors[0].data_ptr()
    deltas = [t.data_ptr() - base for t in tensors]
    unit_bytes = 16 if all(d % 16 == 0 for d in deltas) else elem
    device = tensors[0].device
    key = (device, unit_bytes, tuple(d // unit_bytes for d in deltas))
    table = _OFFSET_TABLES.get(key)
    if table is not None:
        return tensors[0], table, unit_bytes // elem
    if capturing(device):
        table = torch.empty(len(tensors), dtype=torch.int64, device=device)
        for start in range(0, len(tensors), _TABLE_SLOTS):
            values = key[2][start:start + _TABLE_SLOTS]
            launch(_offset_table_kernel, (1,), table, start, len(values), *values,
                   *([0] * (_TABLE_SLOTS - len(values))))
        return tensors[0], table, unit_bytes // elem
    table = int64_table(key[2], device)
    if len(_OFFSET_TABLES) < _OFFSET_TABLES_CAP:
        _OFFSET_TABLES[key] = table
    return tensors[0], table, unit_bytes // elem


def _lbl_launch(T: int, E: int, L: int, elem_bytes: int, cfg: dict):
    block_e = next_power_of_2(E)
    block_t = max(1, min(256, cfg["tile"] // block_e))
    vec = 16 // elem_bytes
    # enough lanes per row that the warps' rows fill BLOCK_T (else Triton spreads rows over warps), at
    # most one 16-byte piece each
    lanes = min(32, max(cfg["lanes"], 32 * cfg["num_warps"] // block_t), max(1, block_e // vec))
    rows_per_program = _rows_per_program(T, L, block_t, cfg["programs"])
    grid = (cdiv(T, rows_per_program), L)
    meta = dict(E=E, BLOCK_T=block_t, BLOCK_E=block_e, CHUNK=min(block_e, lanes * vec),
                NUM_STAGES=cfg["num_stages"], num_warps=cfg["num_warps"])
    return grid, rows_per_program, meta


def router_statistics(gate_logits, mask, top_k: int, layers=None):
    """(2, E) fp32: the mask-weighted top-k selection counts and routing-probability sums over every layer's
    rows (the loss's sufficient statistics). mask: None or (T,) of any dtype (0 = padding); layers: `layer_table`
    result."""
    first = gate_logits[0]
    L, (T, E) = len(gate_logits), first.shape
    base, offsets, unit = layers or layer_table(gate_logits)
    grid, rows_per_program, meta = _lbl_launch(T, E, L, first.element_size(), tuning("fwd", first.element_size()))
    num_parts = grid[0] * L
    # per-program partials (counts, prob sums) and their totals in one allocation (no launch: torch.empty)
    buf = torch.empty(2 * (num_parts + 1) * E, dtype=torch.float32, device=first.device)
    parts, totals = buf[:2 * num_parts * E], buf[2 * num_parts * E:]
    launch(_lbl_fwd_kernel, grid,
        base, offsets, mask if mask is not None else parts, parts, T, rows_per_program, num_parts,
        DT=_TL_DTYPE[first.dtype], UNIT=unit, HAS_MASK=mask is not None, TOP_K=top_k,
        COL_BITS=max(2, (meta["BLOCK_E"] - 1).bit_length()), EXACT_KEYS=first.dtype != torch.float32, **meta,
    )
    # the partials are reduced in parallel over expert slices (it was one program serial over all parts:
    # latency bound at ~1 MB); the loss is then one tiny program (load_balancing_loss_fwd)
    block_e = next_power_of_2(E)
    reduce_e = min(block_e, FINALIZE_EXPERTS)
    launch(_lbl_reduce_parts_kernel, (cdiv(E, reduce_e), 2),
        parts, totals, num_parts, E, BLOCK_P=max(1, min(1024, 4096 // reduce_e)), BLOCK_E=reduce_e, num_warps=4,
    )
    return totals.view(2, E)


def load_balancing_loss_fwd(gate_logits, mask, top_k: int, layers=None):
    """(loss, dloss/dprob_sum). mask: None or (T,) of any dtype (0 = padding); layers: `layer_table` result."""
    totals = router_statistics(gate_logits, mask, top_k, layers)
    E = totals.shape[1]
    block_e = next_power_of_2(E)
    # loss and dloss are separate (custom-op outputs may not alias each other)
    loss = torch.empty((), dtype=torch.float32, device=totals.device)
    dloss = torch.empty(E, dtype=torch.float32, device=totals.device)
    launch(_lbl_loss_kernel, (1,), totals, loss, dloss, E, float(top_k), float(E), BLOCK_E=block_e,
           num_warps=4 if block_e <= 1024 else 8)
    return loss, dloss


def load_balancing_loss_bwd(grad_loss, gate_logits, mask, dloss, layers=None):
    first = gate_logits[0]
    L, (T, E) = len(gate_logits), first.shape
    base, offsets, unit = layers or layer_table(gate_logits)
    grid, rows_per_program, meta = _lbl_launch(T, E, L, first.element_size(), tuning("bwd", first.element_size()))
    grads = torch.empty(L, T, E, dtype=first.dtype, device=first.device)
    launch(_lbl_bwd_kernel, grid,
        base, offsets, grads, mask if mask is not None else dloss, dloss, grad_loss, T, rows_per_program,
        DT=_TL_DTYPE[first.dtype], UNIT=unit, HAS_MASK=mask is not None, **meta,
    )
    return grads


@triton.jit
def _router_fwd_kernel(
    Z, SCORES, INDICES, STATS, T, E, stride_z, rows_per_program,
    TOP_K: tl.constexpr, NORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    kcols = tl.arange(0, BLOCK_K)[None, :]
    row_begin = pid * rows_per_program
    row_end = tl.minimum(row_begin + rows_per_program, T)
    for start in range(row_begin, row_end, BLOCK_T):
        rows = start + tl.arange(0, BLOCK_T)
        row_ok = rows < row_end
        rows64 = rows.to(tl.int64)
        z = tl.load(Z + rows64[:, None] * stride_z + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                    other=float("-inf")).to(tl.float32)
        z = tl.where(row_ok[:, None], z, 0.0)
        z = tl.where(col_ok[None, :], z, float("-inf"))
        z_max = tl.max(z, axis=1)
        e = tl.exp(z - z_max[:, None])
        e_sum = tl.sum(e, axis=1)
        p = e / e_sum[:, None]
        key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 16) | (65535 - cols)[None, :]
        key = tl.where(col_ok[None, :], key, -1)
        top_vals = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
        top_idx = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int64)
        for j in tl.static_range(TOP_K):
            best = tl.max(key, axis=1)
            val = (best >> 16).to(tl.int32).to(tl.float32, bitcast=True)
            idx = 65535 - (best & 65535)
            top_vals = tl.where(kcols == j, val[:, None], top_vals)
            top_idx = tl.where(kcols == j, idx[:, None], top_idx)
            key = tl.where(key == best[:, None], -1, key)
        if NORMALIZE:
            top_vals = top_vals / tl.sum(top_vals, axis=1)[:, None]
        out_mask = row_ok[:, None] & (kcols < TOP_K)
        out_offs = rows64[:, None] * TOP_K + kcols
        tl.store(SCORES + out_offs, top_vals.to(SCORES.dtype.element_ty), mask=out_mask)
        tl.store(INDICES + out_offs, top_idx, mask=out_mask)
        tl.store(STATS + rows64 * 2, z_max, mask=row_ok)
        tl.store(STATS + rows64 * 2 + 1, e_sum, mask=row_ok)


@triton.jit
def _router_bwd_kernel(
    DS, Z, STATS, INDICES, DZ, T, E, stride_z, rows_per_program,
    TOP_K: tl.constexpr, NORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    kcols = tl.arange(0, BLOCK_K)[None, :]
    row_begin = pid * rows_per_program
    row_end = tl.minimum(row_begin + rows_per_program, T)
    for start in range(row_begin, row_end, BLOCK_T):
        rows = start + tl.arange(0, BLOCK_T)
        row_ok = rows < row_end
        rows64 = rows.to(tl.int64)
        tile_mask = row_ok[:, None] & col_ok[None, :]
        k_mask = row_ok[:, None] & (kcols < TOP_K)
        z = tl.load(Z + rows64[:, None] * stride_z + cols[None, :], mask=tile_mask, other=0.0).to(tl.float32)
        z_max = tl.load(STATS + rows64 * 2, mask=row_ok, other=0.0)
        e_sum = tl.load(STATS + rows64 * 2 + 1, mask=row_ok, other=1.0)
        p = tl.exp(z - z_max[:, None]) / e_sum[:, None]
        k_offs = rows64[:, None] * TOP_K + kcols
        idx = tl.load(INDICES + k_offs, mask=k_mask, other=0)
        ds = tl.load(DS + k_offs, mask=k_mask, other=0.0).to(tl.float32)
        zk = tl.load(Z + rows64[:, None] * stride_z + idx, mask=k_mask, other=float("-inf")).to(tl.float32)
        v = tl.exp(zk - z_max[:, None]) / e_sum[:, None]  # chosen probabilities (0 in padded slots)
        if NORMALIZE:
            total = tl.where(row_ok, tl.sum(v, axis=1), 1.0)[:, None]  # rows past the end: v == 0
            dv = (ds - tl.sum(ds * v / total, axis=1)[:, None]) / total
        else:
            dv = ds
        dv = tl.where(k_mask, dv, 0.0)
        dp = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            idx_j = tl.sum(tl.where(kcols == j, idx, 0), axis=1)
            dv_j = tl.sum(tl.where(kcols == j, dv, 0.0), axis=1)
            dp = tl.where(cols[None, :] == idx_j[:, None], dv_j[:, None], dp)
        dz = p * (dp - tl.sum(v * dv, axis=1)[:, None])
        tl.store(DZ + rows64[:, None] * E + cols[None, :], dz.to(DZ.dtype.element_ty), mask=tile_mask)


def _router_launch_params(T: int, E: int, top_k: int):
    block_t, block_e, num_warps = _tile(E)
    while block_t > 1 and block_t * (block_e + 2 * next_power_of_2(top_k)) > 4096:
        block_t //= 2
    rows_per_program = _rows_per_program(T, 1, block_t)
    return block_t, block_e, num_warps, rows_per_program


def softmax_topk_fwd(router_logits, top_k: int, normalize: bool):
    T, E = router_logits.shape
    block_t, block_e, num_warps, rows_per_program = _router_launch_params(T, E, top_k)
    scores = torch.empty(T, top_k, dtype=router_logits.dtype, device=router_logits.device)
    indices = torch.empty(T, top_k, dtype=torch.int64, device=router_logits.device)
    stats = torch.empty(T, 2, dtype=torch.float32, device=router_logits.device)
    launch(_router_fwd_kernel, (cdiv(T, rows_per_program),),
        router_logits, scores, indices, stats, T, E, router_logits.stride(0), rows_per_program,
        TOP_K=top_k, NORMALIZE=normalize, BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=next_power_of_2(top_k), num_warps=num_warps,
    )
    return scores, indices, stats


def softmax_topk_bwd(d_scores, router_logits, stats, indices, normalize: bool):
    T, E = router_logits.shape
    top_k = indices.shape[1]
    block_t, block_e, num_warps, rows_per_program = _router_launch_params(T, E, top_k)
    dz = torch.empty(T, E, dtype=router_logits.dtype, device=router_logits.device)
    launch(_router_bwd_kernel, (cdiv(T, rows_per_program),),
        d_scores, router_logits, stats, indices, dz, T, E, router_logits.stride(0), rows_per_program,
        TOP_K=top_k, NORMALIZE=normalize, BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=next_power_of_2(top_k), num_warps=num_warps,
    )
    return dz
