"""Packed sequences (cu_seqlens) of the chunked gated delta rule: the chunk metadata, built on the device.
This module imports triton: import it lazily."""
import torch
import triton
import triton.language as tl

from hubfuse._common.launch import launch

from .triton_common import CHUNK


@triton.jit
def _varlen_meta_kernel(CU, CHUNK_INFO, CHUNK_OFFSETS, SEQ_IDX, VALID, N, N_SLOTS, TOTAL,
                        BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, CHECK: tl.constexpr):
    """From cu_seqlens: for each chunk slot its (sequence, chunk in it) or (-1, 0), the first chunk of each
    sequence, and each token's sequence. No host round trip: the slot count is a static bound. CHECK: VALID[0] =
    whether cu_seqlens starts at 0, never decreases and ends at TOTAL (every store here is in bounds whatever the
    values; the caller asserts VALID before any kernel reads the metadata)."""
    pid = tl.program_id(0)
    items = pid * BLOCK + tl.arange(0, BLOCK)
    slot_seq = tl.zeros([BLOCK], dtype=tl.int32)
    slot_first = tl.zeros([BLOCK], dtype=tl.int32)
    slot_found = tl.zeros([BLOCK], dtype=tl.int32)
    tok_seq = tl.zeros([BLOCK], dtype=tl.int32)
    carry = tl.sum(tl.zeros([BLOCK_N], dtype=tl.int32), 0)  # chunks of the sequences before this block
    decreasing = carry  # sequences with end < start
    for n0 in range(0, N, BLOCK_N):
        ns = n0 + tl.arange(0, BLOCK_N)
        mn = ns < N
        start = tl.load(CU + ns, mask=mn, other=0).to(tl.int32)
        end = tl.load(CU + ns + 1, mask=mn, other=0).to(tl.int32)
        count = tl.where(mn, (end - start + 63) // 64, 0)
        incl = tl.cumsum(count, 0) + carry
        excl = incl - count
        if pid == 0:
            tl.store(CHUNK_OFFSETS + ns, excl, mask=mn)
        hit = (items[:, None] >= excl[None, :]) & (items[:, None] < incl[None, :]) & mn[None, :]
        slot_seq += tl.sum(tl.where(hit, ns[None, :], 0), 1)
        slot_first += tl.sum(tl.where(hit, excl[None, :], 0), 1)
        slot_found += tl.sum(hit.to(tl.int32), 1)
        hit_t = (items[:, None] >= start[None, :]) & (items[:, None] < end[None, :]) & mn[None, :]
        tok_seq += tl.sum(tl.where(hit_t, ns[None, :], 0), 1)
        carry += tl.sum(count, 0)
        if CHECK:
            decreasing += tl.sum((mn & (end < start)).to(tl.int32), 0)
    if pid == 0:
        tl.store(CHUNK_OFFSETS + N, carry)
        if CHECK:
            valid = (decreasing == 0) & (tl.load(CU) == 0) & (tl.load(CU + N) == TOTAL)
            tl.store(VALID, valid.to(tl.int32))
    m_slot = items < N_SLOTS
    tl.store(CHUNK_INFO + items * 2, tl.where(slot_found > 0, slot_seq, -1), mask=m_slot)
    tl.store(CHUNK_INFO + items * 2 + 1, items - slot_first, mask=m_slot)
    tl.store(SEQ_IDX + items, tok_seq, mask=items < TOTAL)


def n_chunk_slots(total: int, n_seqs: int) -> int:
    """Static upper bound of sum(ceil(len_i / 64)) over n_seqs sequences of total tokens."""
    return (total + n_seqs * (CHUNK - 1)) // CHUNK


def varlen_meta(cu_seqlens: torch.Tensor, total: int, message=None):
    """(chunk_info (slots, 2) int32, chunk_offsets (N + 1,) int32, seq_idx (total,) int32). `message`: also check
    cu_seqlens' values in the same launch (start 0, non-decreasing, end `total`), a device-side assert with that
    message (no host sync)."""
    n_seqs = cu_seqlens.numel() - 1
    slots = n_chunk_slots(total, n_seqs)
    dev = cu_seqlens.device
    chunk_info = torch.empty(max(slots, 1), 2, dtype=torch.int32, device=dev)
    chunk_offsets = torch.empty(n_seqs + 1, dtype=torch.int32, device=dev)
    seq_idx = torch.empty(max(total, 1), dtype=torch.int32, device=dev)
    valid = torch.empty(1, dtype=torch.int32, device=dev) if message is not None else chunk_offsets
    block = 64
    launch(_varlen_meta_kernel, (triton.cdiv(max(slots, total, 1), block),), cu_seqlens, chunk_info, chunk_offsets,
           seq_idx, valid, n_seqs, slots, total, BLOCK=block, BLOCK_N=64, CHECK=message is not None)
    if message is not None:
        torch._assert_async(valid, message)
    return chunk_info, chunk_offsets, seq_idx
