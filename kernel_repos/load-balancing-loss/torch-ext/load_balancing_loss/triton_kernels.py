"""Triton kernels: the fused load-balancing loss (all layers in one launch) and the fused softmax-top-k router.

Load-balancing loss. The layers' router logits stay where the model left them (no stacking copy): a small
int64 table of each layer's offset from the first layer's pointer (in 16-byte units when aligned, so the
loads keep their vectorisation) is passed and each program finds its layer's base. Program (i, l)
owns a contiguous slab of rows of layer l; per tile it computes the softmax in fp32, rounds it to the logits
dtype (HF's routing weights), selects the top-k with packed (value, column) keys — one `tl.max` per k, ties
to the lower index, no (tokens, K, E) one-hot — and accumulates per-expert selection counts and probability
sums (mask-weighted) in fp32. Each program writes one partial row; a one-program finalize kernel sums the
partials in a fixed order (deterministic, no atomics) and writes the loss and dloss/dprob_sum. The backward
re-reads the logits, recomputes p and writes mask_t * p * (w - <p, w>) into one (layers, T, E) gradient
buffer whose per-layer views are handed to autograd (one allocation, not one per layer).
Traffic: one read forward, one read + one write backward, plus O(programs x E) partials.

Router. One kernel per direction: softmax (fp32), top-k by the same packed keys, renormalisation, cast;
the row max and row sum of exp are kept (8 bytes per token) so the backward recomputes p exactly.

This module imports triton: import it lazily.
"""
import torch
import triton
import triton.language as tl

_TL_DTYPE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
_TARGET_PROGRAMS = 1024  # ~8 per SM on H100/H200: enough to hide latency, few partial rows to reduce


def _tile(num_experts: int):
    block_e = triton.next_power_of_2(num_experts)
    block_t = max(1, min(128, 4096 // block_e))
    num_warps = 4 if block_t * block_e <= 4096 else 8
    return block_t, block_e, num_warps


def _rows_per_program(rows: int, layers: int, block_t: int) -> int:
    per = triton.cdiv(rows * layers, _TARGET_PROGRAMS)
    return triton.cdiv(max(per, block_t), block_t) * block_t


@triton.jit
def _routing_probs(z_ptr, rows, row_ok, cols, col_ok, E, DT: tl.constexpr):
    """fp32 softmax of a (BLOCK_T, BLOCK_E) tile, rounded to the logits dtype (HF routing weights)."""
    ptrs = z_ptr + rows.to(tl.int64)[:, None] * E + cols[None, :]
    z = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=float("-inf")).to(tl.float32)
    z = tl.where(row_ok[:, None], z, 0.0)  # rows past the end: harmless finite values, weighted by 0
    z = tl.where(col_ok[None, :], z, float("-inf"))
    z_max = tl.max(z, axis=1)
    e = tl.exp(z - z_max[:, None])
    p = e / tl.sum(e, axis=1)[:, None]
    return p.to(DT).to(tl.float32)


@triton.jit
def _lbl_fwd_kernel(
    Z0, OFFS, MASK, PART_COUNT, PART_PROB, T, E, rows_per_program,
    DT: tl.constexpr, UNIT: tl.constexpr, HAS_MASK: tl.constexpr, TOP_K: tl.constexpr, UNROLL_K: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    layer = tl.program_id(1)
    # layer base = first layer's pointer + a multiple of UNIT elements: keeps the 16-byte alignment that
    # Triton knows for Z0 (so loads vectorise), unlike a raw int->pointer cast
    z_ptr = Z0 + tl.load(OFFS + layer) * UNIT
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    rev_cols = (65535 - cols)[None, :]
    # 2-D accumulators, reduced over rows once at the end (a per-tile column reduction would cross warps)
    count_acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    prob_acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    row_begin = pid * rows_per_program
    row_end = tl.minimum(row_begin + rows_per_program, T)
    for start in range(row_begin, row_end, BLOCK_T):
        rows = start + tl.arange(0, BLOCK_T)
        row_ok = rows < row_end
        p = _routing_probs(z_ptr, rows, row_ok, cols, col_ok, E, DT)
        if HAS_MASK:
            wt = tl.load(MASK + rows, mask=row_ok, other=0.0)
        else:
            wt = tl.where(row_ok, 1.0, 0.0)
        prob_acc += p * wt[:, None]
        # key = (bits of p) << 16 | (65535 - col): distinct per row, ordered by p then by lower column
        if DT == tl.float32:
            key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 16) | rev_cols
        else:
            key = (p.to(DT).to(tl.int16, bitcast=True).to(tl.int32) << 16) | rev_cols
        key = tl.where(col_ok[None, :], key, -1)
        # take the row maximum TOP_K times; taken keys become -1 (valid keys are >= 0)
        if UNROLL_K:
            for _ in tl.static_range(TOP_K):
                key = tl.where(key == tl.max(key, axis=1)[:, None], -1, key)
        else:
            for _ in range(TOP_K):
                key = tl.where(key == tl.max(key, axis=1)[:, None], -1, key)
        selected = (key < 0) & col_ok[None, :]
        count_acc += tl.where(selected, wt[:, None], 0.0)
    part = layer * tl.num_programs(0) + pid
    tl.store(PART_COUNT + part * E + cols, tl.sum(count_acc, axis=0), mask=col_ok)
    tl.store(PART_PROB + part * E + cols, tl.sum(prob_acc, axis=0), mask=col_ok)


@triton.jit
def _lbl_finalize_kernel(
    PART_COUNT, PART_PROB, MASK, LOSS, DLOSS, num_parts, T, E, num_layers_f, num_rows_f, num_experts_f,
    HAS_MASK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    counts = tl.zeros([BLOCK_E], dtype=tl.float32)
    probs = tl.zeros([BLOCK_E], dtype=tl.float32)
    for start in range(0, num_parts, BLOCK_P):
        parts = start + tl.arange(0, BLOCK_P)
        m = (parts < num_parts)[:, None] & col_ok[None, :]
        offs = parts.to(tl.int64)[:, None] * E + cols[None, :]
        counts += tl.sum(tl.load(PART_COUNT + offs, mask=m, other=0.0), axis=0)
        probs += tl.sum(tl.load(PART_PROB + offs, mask=m, other=0.0), axis=0)
    if HAS_MASK:
        acc = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, T, BLOCK_M):
            r = start + tl.arange(0, BLOCK_M)
            acc += tl.load(MASK + r, mask=r < T, other=0.0)
        rows_total = tl.sum(acc, axis=0) * num_layers_f
    else:
        rows_total = num_rows_f * num_layers_f
    tokens_per_expert = counts / rows_total
    loss = tl.sum(tokens_per_expert * (probs / rows_total), axis=0) * num_experts_f
    tl.store(LOSS, loss)
    tl.store(DLOSS + cols, tokens_per_expert * num_experts_f / rows_total, mask=col_ok)


@triton.jit
def _lbl_bwd_kernel(
    Z0, OFFS, GRAD, MASK, DLOSS, GRAD_OUT, T, E, rows_per_program,
    DT: tl.constexpr, UNIT: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    layer = tl.program_id(1)
    z_ptr = Z0 + tl.load(OFFS + layer) * UNIT
    g_ptr = GRAD + layer.to(tl.int64) * T * E  # one (layers, T, E) gradient buffer
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    w = (tl.load(DLOSS + cols, mask=col_ok, other=0.0) * tl.load(GRAD_OUT))[None, :]
    row_begin = pid * rows_per_program
    row_end = tl.minimum(row_begin + rows_per_program, T)
    for start in range(row_begin, row_end, BLOCK_T):
        rows = start + tl.arange(0, BLOCK_T)
        row_ok = rows < row_end
        p = _routing_probs(z_ptr, rows, row_ok, cols, col_ok, E, DT)
        dz = p * (w - tl.sum(p * w, axis=1)[:, None])
        if HAS_MASK:
            dz = dz * tl.load(MASK + rows, mask=row_ok, other=0.0)[:, None]
        ptrs = g_ptr + rows.to(tl.int64)[:, None] * E + cols[None, :]
        tl.store(ptrs, dz.to(GRAD.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# (device, unit, offsets) -> device tensor. Entries are never evicted: a captured CUDA graph may keep using
# one. Past the cap, new layouts get a fresh table per call instead (the allocator usually repeats layouts).
_OFFSET_TABLES = {}
_OFFSET_TABLES_CAP = 4096


def _capturing(device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _layer_table(tensors):
    """(base tensor, int64 offset table on the device, UNIT): layer l starts at base + table[l] * UNIT elements.

    Offsets are relative to tensors[0], in units of 16 bytes when every start is 16-byte aligned relative to
    the first (fresh allocations always are; it keeps the loads vectorised), else one element. Tables are
    cached by content: no host->device copy when the layout repeats, as it does step after step. Under
    CUDA-graph capture a new layout cannot be copied from the host: the layers are then stacked (one
    capturable copy) and the table is built on the device."""
    elem = tensors[0].element_size()
    base = tensors[0].data_ptr()
    deltas = [t.data_ptr() - base for t in tensors]
    unit_bytes = 16 if all(d % 16 == 0 for d in deltas) else elem
    device = tensors[0].device
    key = (str(device), unit_bytes, tuple(d // unit_bytes for d in deltas))
    table = _OFFSET_TABLES.get(key)
    if table is not None:
        return tensors[0], table, unit_bytes // elem
    if _capturing(device):
        stacked = torch.stack(tensors)
        layer_bytes = tensors[0].numel() * elem
        unit_bytes = 16 if layer_bytes % 16 == 0 else elem
        table = torch.arange(len(tensors), device=device, dtype=torch.int64) * (layer_bytes // unit_bytes)
        return stacked, table, unit_bytes // elem
    table = torch.tensor(key[2], dtype=torch.int64).to(device)
    if len(_OFFSET_TABLES) < _OFFSET_TABLES_CAP:
        _OFFSET_TABLES[key] = table
    return tensors[0], table, unit_bytes // elem


def load_balancing_loss_fwd(gate_logits, mask, num_experts: int, top_k: int):
    first = gate_logits[0]
    L, (T, E) = len(gate_logits), first.shape
    block_t, block_e, num_warps = _tile(E)
    rows_per_program = _rows_per_program(T, L, block_t)
    grid = (triton.cdiv(T, rows_per_program), L)
    num_parts = grid[0] * L
    part_count = torch.empty(num_parts, E, dtype=torch.float32, device=first.device)
    part_prob = torch.empty_like(part_count)
    base, offsets, unit = _layer_table(gate_logits)
    mask_arg = mask if mask is not None else part_count
    _lbl_fwd_kernel[grid](
        base, offsets, mask_arg, part_count, part_prob, T, E, rows_per_program,
        DT=_TL_DTYPE[first.dtype], UNIT=unit, HAS_MASK=mask is not None, TOP_K=top_k, UNROLL_K=top_k <= 16,
        BLOCK_T=block_t, BLOCK_E=block_e, num_warps=num_warps,
    )
    loss = torch.empty((), dtype=torch.float32, device=first.device)
    dloss = torch.empty(E, dtype=torch.float32, device=first.device)
    _lbl_finalize_kernel[(1,)](
        part_count, part_prob, mask_arg, loss, dloss, num_parts, T, E, float(L), float(T), float(num_experts),
        HAS_MASK=mask is not None, BLOCK_P=max(1, min(64, 8192 // block_e)), BLOCK_E=block_e, BLOCK_M=1024,
        num_warps=8,
    )
    return loss, dloss


def load_balancing_loss_bwd(grad_loss, gate_logits, mask, dloss):
    first = gate_logits[0]
    L, (T, E) = len(gate_logits), first.shape
    block_t, block_e, num_warps = _tile(E)
    rows_per_program = _rows_per_program(T, L, block_t)
    grid = (triton.cdiv(T, rows_per_program), L)
    grads = torch.empty(L, T, E, dtype=first.dtype, device=first.device)
    base, offsets, unit = _layer_table(gate_logits)
    _lbl_bwd_kernel[grid](
        base, offsets, grads, mask if mask is not None else dloss, dloss,
        grad_loss.float().reshape(1), T, E, rows_per_program,
        DT=_TL_DTYPE[first.dtype], UNIT=unit, HAS_MASK=mask is not None,
        BLOCK_T=block_t, BLOCK_E=block_e, num_warps=num_warps,
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
    while block_t > 1 and block_t * (block_e + 2 * triton.next_power_of_2(top_k)) > 4096:
        block_t //= 2
    rows_per_program = _rows_per_program(T, 1, block_t)
    return block_t, block_e, num_warps, rows_per_program


def softmax_topk_fwd(router_logits, top_k: int, normalize: bool):
    T, E = router_logits.shape
    block_t, block_e, num_warps, rows_per_program = _router_launch_params(T, E, top_k)
    scores = torch.empty(T, top_k, dtype=router_logits.dtype, device=router_logits.device)
    indices = torch.empty(T, top_k, dtype=torch.int64, device=router_logits.device)
    stats = torch.empty(T, 2, dtype=torch.float32, device=router_logits.device)
    _router_fwd_kernel[(triton.cdiv(T, rows_per_program),)](
        router_logits, scores, indices, stats, T, E, router_logits.stride(0), rows_per_program,
        TOP_K=top_k, NORMALIZE=normalize, BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k), num_warps=num_warps,
    )
    return scores, indices, stats


def softmax_topk_bwd(d_scores, router_logits, stats, indices, normalize: bool):
    T, E = router_logits.shape
    top_k = indices.shape[1]
    block_t, block_e, num_warps, rows_per_program = _router_launch_params(T, E, top_k)
    dz = torch.empty(T, E, dtype=router_logits.dtype, device=router_logits.device)
    _router_bwd_kernel[(triton.cdiv(T, rows_per_program),)](
        d_scores, router_logits, stats, indices, dz, T, E, router_logits.stride(0), rows_per_program,
        TOP_K=top_k, NORMALIZE=normalize, BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k), num_warps=num_warps,
    )
    return dz
