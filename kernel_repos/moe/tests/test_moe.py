"""Kernel numerics of the routed experts vs a float64 HF eager reference, forward and backward.

CPU runs the Triton kernels under TRITON_INTERPRET=1 (set by the root conftest when there is no CUDA) at tiny
shapes; GPU tests (marked) run bf16 at the Qwen3-MoE sizes.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hubfuse.moe as moe
from hubfuse.moe import layers, ops
from hubfuse.moe.reference import experts_hf

TOL = {torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 4e-2}


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _make(T, H, I, E, K, dtype, device="cpu", skew=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(device, dtype)
    if skew is None:
        idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    else:  # every token to the experts in `skew` (the others get nothing)
        idx = torch.tensor(skew[:K]).expand(T, K).clone()
    w = torch.rand(T, K, generator=gen) + 0.1
    w = (w / w.sum(-1, keepdim=True)).to(device, dtype)
    gu = (torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5).to(device, dtype)
    dn = (torch.randn(E, H, I, generator=gen) / I ** 0.5).to(device, dtype)
    dout = torch.randn(T, H, generator=gen).to(device, dtype)
    return x, idx.to(device), w, gu, dn, dout


def _run(fn, x, idx, w, gu, dn, dout):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, gu, dn)]
    out = fn(leaves[0], idx, leaves[1], leaves[2], leaves[3])
    grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
    return out.detach(), grads


def _reference(x, idx, w, gu, dn, dout):
    return _run(experts_hf, *(t.double() if t.is_floating_point() else t for t in (x, idx, w, gu, dn, dout)))


def _assert_close(name, got, ref, dtype):
    assert got.dtype == dtype or name == "dtop_k_weights", (name, got.dtype)
    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    assert torch.isfinite(got).all(), name
    err = (got.double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= TOL[dtype] * max(scale, 1.0), f"{name}: max error {err:.3e} vs scale {scale:.3e}"


def _check(T, H, I, E, K, dtype, device="cpu", skew=None, seed=0):
    args = _make(T, H, I, E, K, dtype, device, skew, seed)
    out, grads = _run(moe.moe_experts, *args)
    ref_out, ref_grads = _reference(*args)
    _assert_close("out", out, ref_out, dtype)
    for name, g, r in zip(("dhidden", "dtop_k_weights", "dgate_up_proj", "ddown_proj"), grads, ref_grads):
        _assert_close(name, g, r, dtype)
    return out, grads


SHAPES = [  # T, H, I, E, K
    (13, 48, 40, 6, 3),
    (1, 32, 32, 4, 1),
    (37, 64, 48, 8, 2),
]


@pytest.mark.parametrize("shape", SHAPES)
def test_fwd_bwd_fp32(shape):
    _check(*shape, torch.float32)


def test_fwd_bwd_fp16():
    _check(21, 64, 32, 5, 2, torch.float16)


def _record_tma_flags(monkeypatch, tk, operand_fn):
    """Wraps tk.<operand_fn> (which returns (operand, uses_tma)) and returns the list of flags its calls return."""
    used, original = [], getattr(tk, operand_fn)

    def spy(*args):
        operand, tma = original(*args)
        used.append(tma)
        return operand, tma

    monkeypatch.setattr(tk, operand_fn, spy)
    return used


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU tensors reach the Triton kernels only under the interpreter (on a GPU machine they "
                           "take the torch path); the GPU runs TMA through TUNING in the gpu-marked tests")
@pytest.mark.parametrize("shape", [(37, 64, 64, 8, 2), (13, 48, 40, 6, 3)])
def test_tma_weight_operand(shape, monkeypatch):
    # weights through tensor descriptors (the interpreter emulates the copy engine); at (48, 40) the down_fwd
    # tiles straddle experts and fall back to pointer loads, the backward ones read past H / I (zero-filled), and
    # gate_up_fwd's 3-D blocks (gate and up rows together) read past I, zero-filled too (no straddling in 3-D)
    from hubfuse.moe import triton_kernels as tk

    monkeypatch.setitem(tk._INTERPRETER_CONFIG, "TMA", True)
    used = _record_tma_flags(monkeypatch, tk, "_weight_operand")
    used_gate_up = _record_tma_flags(monkeypatch, tk, "_gate_up_operand")
    _check(*shape, torch.float32)
    assert used == ([True] * 3 if shape[2] == 64 else [False, True, True]), used
    assert used_gate_up == [True], used_gate_up


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU tensors reach the Triton kernels only under the interpreter")
@pytest.mark.parametrize("shape", [(37, 64, 64, 8, 2), (13, 48, 40, 6, 3)])
def test_tma_row_operand(shape, monkeypatch):
    # the sorted-row operand of down_fwd / gate_up_bwd_x through tensor descriptors: 16-row tiles over experts of
    # a few rows each read the next expert's rows (and zero-filled rows past the last): the store masks them
    from hubfuse.moe import triton_kernels as tk

    monkeypatch.setitem(tk._INTERPRETER_CONFIG, "TMA_A", True)
    used = _record_tma_flags(monkeypatch, tk, "_rows_operand")
    _check(*shape, torch.float32)
    assert used == [True, True], used


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU tensors reach the Triton kernels only under the interpreter")
@pytest.mark.parametrize("tma_a", [False, True])
@pytest.mark.parametrize("shape", [(37, 64, 64, 8, 2), (35, 32, 32, 4, 1), (5, 32, 48, 8, 1)])
def test_persistent_row_gemms(shape, tma_a, monkeypatch):
    # the row-tiled GEMMs as persistent launches: 3 programs loop over every tile (many per program at 16-row
    # tiles), stopping at the tile count from the tile map; with skewed routing and mostly empty experts
    from hubfuse.moe import triton_kernels as tk

    monkeypatch.setitem(tk._INTERPRETER_CONFIG, "PERSISTENT", True)
    monkeypatch.setitem(tk._INTERPRETER_CONFIG, "TMA_A", tma_a)
    grids = []
    original = tk._persistent_grid
    monkeypatch.setattr(tk, "_persistent_grid", lambda *a: grids.append(original(*a)) or grids[-1])
    _check(*shape, torch.float32, skew=[2] if shape[4] == 1 and shape[0] == 35 else None)
    assert grids and all(g == 3 for g in grids), grids  # gate_up fwd, down fwd, g_act, gate_up dX


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="the tile map is a Triton kernel")
@pytest.mark.parametrize("E, S, block_m, first", [(6, 39, 16, 0), (8, 300, 16, 5), (1, 17, 16, 0), (128, 4096, 128, 0),
                                                  (512, 9000, 64, 3)])
def test_row_tile_map(E, S, block_m, first):
    # _tile_map_kernel against the torch formulation: tiles per expert, their start, the expert of every tile slot
    # (E past the last), with empty experts and rows before offsets[0] (slots routed to negative ids); the same
    # launch inverts the sort (the positions), the second map's launch does not write them again
    from hubfuse.moe import triton_kernels as tk

    gen = torch.Generator().manual_seed(E + S)
    cuts = torch.sort(torch.randint(first, S + 1, (E - 1,), generator=gen)).values
    if E >= 4:
        cuts[: E // 4] = cuts[0]  # a run of empty experts
    offsets = torch.cat([torch.tensor([first]), cuts, torch.tensor([S])]).to(_device(), torch.int32)  # as route's
    sorted_slot = torch.randperm(S, generator=gen).to(offsets.device)
    row_tiles = tk._RowTiles(offsets, S, sorted_slot)
    tile_expert, tile_start, max_tiles = row_tiles(block_m)
    pos = row_tiles.positions()
    assert torch.equal(sorted_slot[pos], torch.arange(S, device=offsets.device))
    row_tiles(block_m // 2)  # another map: pos is written once
    assert row_tiles.positions() is pos and torch.equal(sorted_slot[pos], torch.arange(S, device=offsets.device))
    tiles = (offsets[1:] - offsets[:-1] + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    assert max_tiles == max(1, min(-(-S // block_m) + E, S))
    assert torch.equal(tile_start[:E], tile_end - tiles)
    assert tile_start[E].item() == tiles.sum().item()  # the tile count, where persistent launches stop
    assert torch.equal(tile_expert, torch.searchsorted(tile_end, torch.arange(max_tiles, device=offsets.device),
                                                       right=True))


def test_route_offsets_and_positions():
    # route: a stable sort of the slots by expert, int32 offsets (torch._grouped_mm's offs as they are), ids outside
    # [0, E) before / after every expert's rows; the forward's positions invert the sort (the backward reuses them)
    from hubfuse.moe import reference, triton_kernels as tk

    E, K = 5, 3
    idx = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t))[:K] for t in range(17)])
    idx[::4, 0] = -1
    idx[1::5, 2] = E
    slot, offs = reference.route(idx, E)
    flat = idx.reshape(-1)
    assert offs.dtype == torch.int32 and offs.tolist() == [int((flat < e).sum()) for e in range(E + 1)]
    keys = flat.clamp(-1, E)[slot]
    assert torch.equal(keys, torch.sort(keys).values)
    for e in range(-1, E + 1):  # stable: each expert's slots (so its tokens) in increasing order
        run = slot[keys == e]
        assert torch.equal(run, torch.sort(run).values)
    assert torch.equal(slot[tk._positions(slot)], torch.arange(flat.numel()))


@pytest.mark.parametrize("E", [1, 254, 255, 300])
def test_route_key_widths(E):
    # route sorts 8-bit keys up to E = 254 and 16-bit ones above: either way the stable sort of the raw ids (ids
    # outside [0, E) included: -1 first, E and above last) and the offsets counted directly
    from hubfuse.moe import reference

    gen = torch.Generator().manual_seed(E)
    idx = torch.randint(-1, E + 2, (257, 4), generator=gen)
    slot, offs = reference.route(idx, E)
    flat = idx.reshape(-1)
    assert torch.equal(slot, torch.sort(flat.clamp(-1, E), stable=True).indices)
    assert offs.dtype == torch.int32 and offs.tolist() == [int((flat < e).sum()) for e in range(E + 1)]


def test_skewed_routing_all_tokens_one_expert():
    # K=1, every token to expert 2: one expert gets all rows (several row tiles), the others none
    _check(35, 32, 32, 4, 1, torch.float32, skew=[2])


def test_empty_experts_and_top1():
    _check(5, 32, 48, 8, 1, torch.float32, seed=3)  # 5 tokens over 8 experts: most experts empty


def test_int32_index_noncontiguous_inputs():
    x, idx, w, gu, dn, dout = _make(11, 32, 32, 4, 2, torch.float32)
    ref_out, ref_grads = _reference(x, idx, w, gu, dn, dout)
    # transposed storage for the weights and hidden states, int32 indices
    x_nc = x.t().contiguous().t()
    gu_nc = gu.transpose(1, 2).contiguous().transpose(1, 2)
    out, grads = _run(moe.moe_experts, x_nc, idx.int(), w, gu_nc, dn, dout)
    _assert_close("out", out, ref_out, torch.float32)
    for name, g, r in zip(("dhidden", "dtop_k_weights", "dgate_up_proj", "ddown_proj"), grads, ref_grads):
        _assert_close(name, g, r, torch.float32)


def test_reference_path_matches():
    # the torch path of the custom ops (used on devices without Triton) against the same float64 reference
    orig = ops.use_triton
    ops.use_triton = lambda t: False
    try:
        _check(13, 48, 40, 6, 3, torch.float32)
    finally:
        ops.use_triton = orig


def test_sentinel_index_is_skipped():
    # index == E (expert-parallel sentinel) contributes nothing, like HF's eager loop; its weight grad is 0
    x, idx, w, gu, dn, dout = _make(9, 32, 32, 4, 2, torch.float32)
    idx[::3, 1] = 4
    out, grads = _run(moe.moe_experts, x, idx, w, gu, dn, dout)
    ref_out, ref_grads = _reference(x, idx, w, gu, dn, dout)
    _assert_close("out", out, ref_out, torch.float32)
    _assert_close("dhidden", grads[0], ref_grads[0], torch.float32)
    assert (grads[1][::3, 1] == 0).all()


def test_deterministic():
    args = _make(13, 32, 32, 4, 2, torch.float32)
    out1, g1 = _run(moe.moe_experts, *args)
    out2, g2 = _run(moe.moe_experts, *args)
    assert torch.equal(out1, out2) and all(torch.equal(a, b) for a, b in zip(g1, g2))


def _grouped_mm_loop(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    # stand-in for torch._grouped_mm, the two forms we use; the groups' row ranges end at offs (int32), the first
    # starting at 0. K-grouped 2d x 2d: out[g] = mat_a[:, lo:hi] @ mat_b[lo:hi]; M-grouped 2d x 3d:
    # out[lo:hi] = mat_a[lo:hi] @ mat_b[g] (rows past the last group: NaN, as unwritten memory might be)
    assert mat_a.dim() == 2 and offs.dtype == torch.int32 and bias is None
    out, lo = [], 0
    if mat_b.dim() == 3:
        out = torch.full((mat_a.shape[0], mat_b.shape[2]), float("nan"), dtype=mat_a.dtype)
        for g, hi in enumerate(offs.tolist()):
            out[lo:hi] = mat_a[lo:hi] @ mat_b[g]
            lo = hi
        return out
    for hi in offs.tolist():
        out.append(mat_a[:, lo:hi] @ mat_b[lo:hi])
        lo = hi
    return torch.stack(out)


def _bwd_direct(x, idx, w, gu, dn, dout):
    # the Triton fwd/bwd entry points without input validation (so negative ids can be routed too)
    from hubfuse.moe import reference, triton_kernels as tk

    slot, offs = reference.route(idx, gu.shape[0])
    _, gate_up_out, pos = tk.moe_fwd(x, idx, w, gu, dn, slot, offs)
    return tk.moe_bwd(dout, x, idx, w, gu, dn, gate_up_out, slot, offs, pos)


def _poison_allocations(monkeypatch):
    # torch.empty / torch.empty_like return NaN-filled (floating) or -1-filled (integer) tensors
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan") if t.is_floating_point() else -1)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU glue test under the interpreter")
@pytest.mark.parametrize("standin", ["torch_cpu", "loop"])
@pytest.mark.parametrize("impl, g_act", [("grouped_mm", "cutlass"), ("grouped_mm", "triton"),
                                         ("grouped_mm_lean", "cutlass"), ("grouped_mm_wgrad", "cutlass")])
def test_backward_grouped_mm_glue(standin, impl, g_act, monkeypatch):
    # the torch._grouped_mm backward paths (TUNING["backward"]) against the Triton one, on CPU: with
    # torch's own CPU _grouped_mm (same offs semantics as CUDA) or a python loop over experts. Routing with
    # empty experts (first and last), negative ids (rows before expert 0) and the sentinel E (rows at the end).
    from hubfuse.moe import triton_kernels as tk

    if standin == "torch_cpu" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    T, H, I, E, K = 23, 48, 40, 7, 2
    x, _, w, gu, dn, dout = _make(T, H, I, E, K, torch.float32)
    gen = torch.Generator().manual_seed(1)
    idx = torch.stack([torch.randperm(E - 2, generator=gen)[:K] + 1 for _ in range(T)])  # experts 0, E-1 empty
    idx[::5, 0] = -1
    idx[1::4, 1] = E
    ref = _bwd_direct(x, idx, w, gu, dn, dout)

    calls = []
    real = torch._grouped_mm if standin == "torch_cpu" else _grouped_mm_loop

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", spy, raising=False)
    monkeypatch.setattr(tk, "_grouped_mm_applies", lambda *a: True)
    monkeypatch.setitem(tk.TUNING, "backward", dict(impl=impl, g_act=g_act))
    _poison_allocations(monkeypatch)  # an output element nobody writes shows up as NaN / -1, not as a lucky 0
    got = _bwd_direct(x, idx, w, gu, dn, dout)
    # the two K-grouped weight grads (lean: only ddown) and, unless in Triton, the M-grouped g_act
    m_grouped = g_act == "cutlass" and impl != "grouped_mm_wgrad"
    assert len(calls) == (1 if impl == "grouped_mm_lean" else 2) + m_grouped, calls
    for name, g, r in zip(("dhidden", "dtop_k_weights", "dgate_up_proj", "ddown_proj"), got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype and g.is_contiguous(), name
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, msg=name)
    for e in (0, E - 1):  # empty experts: zero weight grads
        assert not got[2][e].any() and not got[3][e].any()

    # and through the public op against the float64 reference
    _check(13, 48, 40, 6, 3, torch.float32)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU glue test under the interpreter")
@pytest.mark.parametrize("tma_a, persistent", [(False, False), (True, False), (True, True), (False, True)])
def test_fused_act_on_gathered_rows(tma_a, persistent, monkeypatch):
    # grouped_mm_wgrad: the fused g_act kernel reads the gathered (expert-sorted, contiguous) dout rows, through
    # TMA_A (16-row tiles read the next expert's rows: masked) and/or as a persistent launch (3 programs), half
    # tiles otherwise; against the float64 reference through the public op, with skewed routing and empty experts
    from hubfuse.moe import triton_kernels as tk

    monkeypatch.setattr(torch, "_grouped_mm", _grouped_mm_loop, raising=False)
    monkeypatch.setattr(tk, "_grouped_mm_applies", lambda *a: True)
    monkeypatch.setitem(tk.TUNING, "backward", dict(impl="grouped_mm_wgrad"))
    monkeypatch.setitem(tk._INTERPRETER_CONFIG, "TMA_A", tma_a)
    monkeypatch.setitem(tk._INTERPRETER_CONFIG, "PERSISTENT", persistent)
    sorted_rows = []
    original = tk._down_bwd_act
    monkeypatch.setattr(tk, "_down_bwd_act", lambda dout, dout_sorted, *a: sorted_rows.append(dout_sorted) or
                        original(dout, dout_sorted, *a))
    used = _record_tma_flags(monkeypatch, tk, "_rows_operand")
    _check(37, 64, 64, 8, 2, torch.float32)
    _check(35, 32, 32, 4, 1, torch.float32, skew=[2])
    _check(13, 48, 40, 6, 3, torch.float32)
    assert sorted_rows == [True] * 3
    assert used == [tma_a] * 9, used  # per call: down fwd, g_act, gate_up dX


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors take the torch path")
def test_backward_grouped_mm_falls_back(monkeypatch):
    # asked for grouped_mm where it does not apply (CPU, fp32): the Triton backward runs, no error
    from hubfuse.moe import triton_kernels as tk

    calls = []
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1), raising=False)
    monkeypatch.setitem(tk.TUNING, "backward", dict(impl="grouped_mm"))
    x = torch.zeros(4, 16)
    assert tk.backward_impl(x, 16, 16, 4) == "triton"
    assert tk.backward_impl(x.bfloat16(), 16, 16, 4) == "triton"  # CPU: never the CUTLASS fast path
    _check(13, 48, 40, 6, 3, torch.float32)
    assert not calls
    monkeypatch.setitem(tk.TUNING, "backward", dict(impl="cublas"))
    with pytest.raises(ValueError, match="backward"):
        tk.backward_impl(x, 16, 16, 4)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU tensors reach Triton only under the interpreter")
def test_check_can_fail():
    # the comparison is sensitive: a perturbed down_proj must be caught
    x, idx, w, gu, dn, dout = _make(7, 32, 32, 4, 2, torch.float32)
    out, _ = _run(moe.moe_experts, x, idx, w, gu, dn, dout)
    ref_out, _ = _reference(x, idx, w, gu, dn * 1.001, dout)
    with pytest.raises(AssertionError):
        _assert_close("out", out, ref_out, torch.float32)


def test_bad_inputs():
    x, idx, w, gu, dn, _ = _make(4, 32, 32, 4, 2, torch.float32)
    f = moe.moe_experts
    with pytest.raises(ValueError, match="top_k_index values"):
        f(x, torch.full_like(idx, 5), w, gu, dn)
    with pytest.raises(ValueError, match="top_k_index values"):
        f(x, -idx - 1, w, gu, dn)
    with pytest.raises(ValueError, match="down_proj"):
        f(x, idx, w, gu, dn[:, :, :16])
    with pytest.raises(ValueError, match="hidden size"):
        f(x[:, :16], idx, w, gu, dn)
    with pytest.raises(ValueError, match="top_k_weights shape"):
        f(x, idx, w[:, :1], gu, dn)
    with pytest.raises(ValueError, match="top_k_index must be"):
        f(x, idx[:2], w, gu, dn)
    with pytest.raises(TypeError, match="dtype"):
        f(x.half(), idx, w, gu, dn)
    with pytest.raises(TypeError, match="top_k_index must be int"):
        f(x, idx.float(), w, gu, dn)
    with pytest.raises(TypeError, match="must be a tensor"):
        f(x, idx.tolist(), w, gu, dn)
    with pytest.raises(ValueError, match="empty"):
        f(x[:0], idx[:0], w[:0], gu, dn)
    with pytest.raises(ValueError, match="top_k"):
        f(x, torch.zeros(4, 17, dtype=torch.long), torch.zeros(4, 17), gu, dn)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="is on"):
            f(x.cuda(), idx, w.cuda(), gu.cuda(), dn.cuda())
    # 2**31 routed slots (int32 offsets): checked on the shapes alone, so meta tensors (no memory) suffice
    T = 2**28
    meta = dict(device="meta")
    with pytest.raises(ValueError, match="routed slots"):
        ops._check_inputs(torch.empty(T, 32, **meta), torch.empty(T, 8, dtype=torch.long, **meta),
                          torch.empty(T, 8, **meta), gu.to("meta"), dn.to("meta"))
    ops._check_inputs(torch.empty(T, 32, **meta), torch.empty(T, 7, dtype=torch.long, **meta),  # just under: fine
                      torch.empty(T, 7, **meta), gu.to("meta"), dn.to("meta"))


def test_second_backward_through_the_graph_is_refused():
    # the backward writes the grad of the gate_up output over the saved gate_up_out (Triton path): a second
    # backward through the same graph must fail loudly, not read the overwritten buffer
    args = _make(13, 48, 40, 6, 3, torch.float32, _device())
    x, idx, w, gu, dn, dout = args
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, gu, dn)]
    out = moe.moe_experts(leaves[0], idx, leaves[1], leaves[2], leaves[3])
    first = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    _, ref_grads = _reference(*args)
    for g, r in zip(first, ref_grads):
        _assert_close("grad", g, r, torch.float32)
    if ops.use_triton(x):
        with pytest.raises(RuntimeError, match="inplace operation"):
            torch.autograd.grad(out, leaves, dout)
    else:  # the reference path keeps gate_up_out: a second backward gives the same grads
        second = torch.autograd.grad(out, leaves, dout)
        assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_eager_path_is_the_custom_op_without_its_dispatch(monkeypatch):
    # eager calls run the custom ops' implementations through an autograd.Function (no dispatcher host time);
    # torch.compile traces the custom ops. Same kernels, so the same bits.
    args = _make(13, 48, 40, 6, 3, torch.float32, _device())
    op_out, op_grads = _run(lambda x, idx, w, gu, dn: ops.moe_experts_fwd(x, idx, w, gu, dn)[0], *args)
    direct = []
    for op in (ops.moe_experts_fwd, ops.moe_experts_bwd):
        monkeypatch.setattr(op, "eager_impl", lambda *a, impl=op.eager_impl: direct.append(impl) or impl(*a))
    eager_out, eager_grads = _run(moe.moe_experts, *args)
    assert len(direct) == 2, "the eager path went through the custom-op dispatcher"
    assert torch.equal(eager_out, op_out)
    for name, a, b in zip(("dhidden", "dtop_k_weights", "dgate_up_proj", "ddown_proj"), eager_grads, op_grads):
        assert torch.equal(a, b), name
    _, ref_grads = _reference(*args)
    _assert_close("dgate_up_proj", eager_grads[2], ref_grads[2], torch.float32)


def test_custom_op_backward_gets_no_zero_grads_for_the_saved_outputs():
    # the forward op's four extra outputs (saved for the backward) are not differentiable and their grads are not
    # materialised: autograd would otherwise allocate and fill a zero (T*K, 2I) grad for gate_up_out every step
    args = _make(7, 16, 8, 3, 2, torch.float32, _device())
    x, idx, w, gu, dn, dout = args
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, gu, dn)]
    outs = ops.moe_experts_fwd(leaves[0], idx, leaves[1], leaves[2], leaves[3])
    assert outs[0].requires_grad and not any(t.requires_grad for t in outs[1:])
    seen = []

    def spy(ctx, dout, *rest):
        seen.append(rest)
        return ops._backward(ctx, dout, *rest)

    ops.moe_experts_fwd.register_autograd(spy, setup_context=ops._setup_context)
    try:
        out = ops.moe_experts_fwd(leaves[0], idx, leaves[1], leaves[2], leaves[3])[0]
        torch.autograd.grad(out, leaves, dout)
    finally:
        ops.moe_experts_fwd.register_autograd(ops._backward, setup_context=ops._setup_context)
    assert seen == [(None, None, None, None)]


def test_torch_compile_fullgraph():
    args = _make(11, 32, 32, 4, 2, torch.float32)
    ref_out, ref_grads = _run(moe.moe_experts, *args)
    # inductor, with pointwise work around the op so that it generates code around the opaque node
    compiled = torch.compile(lambda *a: moe.moe_experts(*a) * 2.0, fullgraph=True)
    out, grads = _run(compiled, *args)
    out = out / 2.0
    grads = [g / 2.0 for g in grads]
    assert torch.allclose(out, ref_out, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads, ref_grads))


def test_kernels_compile_for_sm90():
    # lower every kernel for Hopper with the shipped GPU configs (no GPU needed): wgmma, cp.async, smem fits
    import triton.backends

    import hubfuse

    if "nvidia" not in triton.backends.backends:
        pytest.skip("triton has no nvidia backend here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(hubfuse.__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    script = Path(__file__).with_name("aot_sm90.py")
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr[-3000:]


def _tiny_config(arch="qwen3_moe", E=4, K=2, H=32, I=32):
    from transformers import AutoConfig

    return AutoConfig.for_model(arch, hidden_size=H, moe_intermediate_size=I, num_experts=E,
                                num_experts_per_tok=K, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=1, intermediate_size=64, vocab_size=64)


def _hf_experts(config):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(0)
    m = Qwen3MoeExperts(config)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return m


def test_layer_and_layout_match_hf_module():
    cfg = _tiny_config()
    hf = _hf_experts(cfg)
    layout = layers.GroupedGemmExpertsLayout(cfg)
    layout.load_state_dict(hf.state_dict())
    assert set(dict(layout.named_parameters())) == set(dict(hf.named_parameters()))
    x, idx, w, *_ = _make(9, 32, 32, 4, 2, torch.float32)
    ref = hf(x, idx, w)
    assert torch.allclose(layout(x, idx, w), ref, atol=1e-6)
    kernel_out = layers.GroupedGemmExperts.forward(layout, x, idx, w)  # how kernelize binds it
    assert torch.allclose(kernel_out, ref, atol=1e-5)


def test_register_experts_implementation():
    name = moe.register_experts_implementation()
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert name in ALL_EXPERTS_FUNCTIONS
    cfg = _tiny_config()
    hf = _hf_experts(cfg)
    x, idx, w, *_ = _make(9, 32, 32, 4, 2, torch.float32)
    cfg._experts_implementation = "eager"
    ref = hf(x, idx, w)
    cfg._experts_implementation = name
    out = hf(x, idx, w)
    assert torch.allclose(out, ref, atol=1e-5)


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 2048, 768, 128, 8), (1023, 1024, 512, 512, 16), (333, 2048, 768, 128, 1)])
def test_bf16_real_sizes_gpu(shape):
    T, H, I, E, K = shape
    args = _make(T, H, I, E, K, torch.bfloat16, "cuda")
    out, grads = _run(moe.moe_experts, *args)
    # fp32 reference on the GPU through the torch path of the same op (float64 at these sizes is too slow)
    orig = ops.use_triton
    ops.use_triton = lambda t: False
    try:
        ref_out, ref_grads = _run(moe.moe_experts, *(t.float() if t.is_floating_point() else t for t in args))
    finally:
        ops.use_triton = orig
    for name, g, r in zip(("out", "dhidden", "dtop_k_weights", "dgate_up_proj", "ddown_proj"),
                          (out, *grads), (ref_out, *ref_grads)):
        err = (g.float() - r).abs().max().item()
        scale = r.abs().max().item()
        assert err <= 3e-2 * max(scale, 1e-3), f"{name}: max error {err:.3e} vs scale {scale:.3e}"


@pytest.mark.gpu
def test_bf16_vs_float64_gpu():
    _check(257, 256, 128, 16, 4, torch.bfloat16, "cuda")


@pytest.mark.gpu
def test_skewed_gpu():
    _check(1000, 256, 128, 16, 1, torch.bfloat16, "cuda", skew=[7])


@pytest.mark.gpu
def test_deterministic_and_cuda_graph_gpu():
    args = _make(2048, 1024, 512, 64, 8, torch.bfloat16, "cuda")
    out1, g1 = _run(moe.moe_experts, *args)
    out2, g2 = _run(moe.moe_experts, *args)
    assert torch.equal(out1, out2) and all(torch.equal(a, b) for a, b in zip(g1, g2))
    x, idx, w, gu, dn, dout = args
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, gu, dn)]
    static_idx = idx.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles the kernels) outside the capture
        o = moe.moe_experts(leaves[0], static_idx, leaves[1], leaves[2], leaves[3])
        torch.autograd.grad(o, leaves, dout)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = moe.moe_experts(leaves[0], static_idx, leaves[1], leaves[2], leaves[3])
        gs = torch.autograd.grad(o, leaves, dout)
    # new routing: the captured graph must follow the data (no host-side routing baked in)
    gen = torch.Generator().manual_seed(5)
    new_idx = torch.stack([torch.randperm(64, generator=gen)[:8] for _ in range(2048)]).cuda()
    static_idx.copy_(new_idx)
    graph.replay()
    torch.cuda.synchronize()
    ref_out, ref_g = _run(moe.moe_experts, x, new_idx, w, gu, dn, dout)
    assert torch.equal(o, ref_out) and all(torch.equal(a, b) for a, b in zip(gs, ref_g))


@pytest.mark.gpu
def test_backward_grouped_mm_gpu(monkeypatch):
    # TUNING["backward"] = grouped_mm (the default; CUTLASS torch._grouped_mm) and grouped_mm_wgrad vs the
    # Triton backward, bf16 at a mid shape with empty experts (first and last: zero-K groups), sentinel slots and
    # negative ids (rows before expert 0); then the default's determinism and CUDA-graph capture with new routing
    # at replay
    from hubfuse.moe import triton_kernels as tk

    T, H, I, E, K = 2048, 1024, 512, 64, 8
    x, _, w, gu, dn, dout = _make(T, H, I, E, K, torch.bfloat16, "cuda")
    if not tk._grouped_mm_applies(x, H, I, E):
        pytest.skip("torch._grouped_mm fast path unavailable here (needs sm90/sm100 and torch with _grouped_mm)")
    gen = torch.Generator().manual_seed(2)
    idx = torch.stack([torch.randperm(E - 2, generator=gen)[:K] + 1 for _ in range(T)])
    idx[::7, 3] = E
    idx[1::9, 2] = -1
    idx = idx.cuda()
    args = (x, idx, w, gu, dn, dout)
    monkeypatch.setitem(tk.TUNING, "backward", dict(impl="triton"))
    ref = _bwd_direct(*args)
    for impl, g_act in (("grouped_mm", "cutlass"), ("grouped_mm", "triton"), ("grouped_mm_lean", "cutlass"),
                        ("grouped_mm_wgrad", "cutlass")):
        impl_name = impl + ("" if g_act == "cutlass" else " g_act=triton")
        monkeypatch.setitem(tk.TUNING, "backward", dict(impl=impl, g_act=g_act))
        got = _bwd_direct(*args)
        for name, g, r in zip(("dhidden", "dtop_k_weights", "dgate_up_proj", "ddown_proj"), got, ref):
            assert g.shape == r.shape and g.dtype == r.dtype and g.is_contiguous(), (impl_name, name)
            assert torch.isfinite(g).all(), (impl_name, name)
            err = (g.float() - r.float()).abs().max().item()
            scale = r.float().abs().max().item()
            assert err <= 1e-2 * scale, f"{impl_name} {name}: max error {err:.3e} vs scale {scale:.3e}"
        assert not got[2][0].any() and not got[2][E - 1].any() and not got[3][0].any() and not got[3][E - 1].any()
    # the public op with both CUTLASS backwards (grouped_mm: the default) vs the fp32 torch path, and for
    # determinism + graph capture
    for impl, g_act in (("grouped_mm", "cutlass"), ("grouped_mm", "triton"), ("grouped_mm_lean", "cutlass")):
        monkeypatch.setitem(tk.TUNING, "backward", dict(impl=impl, g_act=g_act))
        test_bf16_real_sizes_gpu((1023, 1024, 512, 128, 8))
        test_deterministic_and_cuda_graph_gpu()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 2048, 768, 128, 8), (1023, 1024, 512, 512, 16), (333, 2048, 768, 128, 1)])
def test_persistent_row_gemms_gpu(shape, monkeypatch):
    # the persistent launches of the three row-tiled GEMMs (one program per SM looping over the tiles) run the same
    # tile body in the same K order as one program per tile: bitwise equal outputs and grads, also under a CUDA
    # graph with new routing at replay
    from hubfuse.moe import triton_kernels as tk

    T, H, I, E, K = shape
    args = _make(T, H, I, E, K, torch.bfloat16, "cuda", seed=4)
    names = ("gate_up_fwd", "down_fwd", "gate_up_bwd_x")
    results = {}
    for persistent in (False, True):
        for name in names:
            monkeypatch.setitem(tk.TUNING, name, dict(tk.TUNING[name], PERSISTENT=persistent))
        results[persistent] = _run(moe.moe_experts, *args)
    (out0, g0), (out1, g1) = results[False], results[True]
    assert torch.isfinite(out1).all() and out1.abs().max() > 0
    assert torch.equal(out0, out1), (out0.float() - out1.float()).abs().max()
    for name, a, b in zip(("dhidden", "dtop_k_weights", "dgate_up_proj", "ddown_proj"), g0, g1):
        assert torch.equal(a, b), (name, (a.float() - b.float()).abs().max())
    if shape[0] == 4096:  # PERSISTENT still on: capture + replay with new routing, vs the fp32 torch path
        test_deterministic_and_cuda_graph_gpu()
        test_bf16_real_sizes_gpu((1023, 1024, 512, 128, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 2048, 768, 128, 8), (1023, 1024, 512, 512, 16)])
def test_fused_act_backward_gpu(shape, monkeypatch):
    # grouped_mm_wgrad: the fused Triton g_act kernel on the gathered dout rows (TMA_A), as tuned, vs the default
    # CUTLASS backward (close: the same products, fp32 sums in another order); its persistent launch vs one program
    # per tile of the same tile config (bitwise); then capture + replay with new routing
    from hubfuse.moe import triton_kernels as tk

    T, H, I, E, K = shape
    args = _make(T, H, I, E, K, torch.bfloat16, "cuda", seed=5)
    if not tk._grouped_mm_applies(args[0], H, I, E):
        pytest.skip("torch._grouped_mm fast path unavailable here")
    ref = _bwd_direct(*args)  # the default backward
    monkeypatch.setitem(tk.TUNING, "backward", dict(impl="grouped_mm_wgrad"))
    shipped = dict(tk.TUNING["down_bwd_act"])
    got = {}
    for persistent in (False, True):
        monkeypatch.setitem(tk.TUNING, "down_bwd_act", dict(shipped, TMA=True, TMA_A=True, BLOCK_N=256,
                                                                 num_stages=3, HALF_TILES=False, PERSISTENT=persistent))
        got[persistent] = _bwd_direct(*args)
    for name, a, b, r in zip(("dhidden", "dtop_k_weights", "dgate_up_proj", "ddown_proj"), got[False], got[True], ref):
        assert torch.equal(a, b), (name, (a.float() - b.float()).abs().max())
        assert torch.isfinite(a).all() and a.abs().max() > 0, name
        err = (a.float() - r.float()).abs().max().item()
        assert err <= 1e-2 * r.float().abs().max().item(), f"{name}: max error {err:.3e}"
    if shape[3] == 128:
        monkeypatch.setitem(tk.TUNING, "down_bwd_act", dict(shipped, TMA=True, TMA_A=True, HALF_TILES=True))
        for name, a, r in zip(("dhidden", "dtop_k_weights", "dgate_up_proj", "ddown_proj"), _bwd_direct(*args), ref):
            err = (a.float() - r.float()).abs().max().item()
            assert err <= 1e-2 * r.float().abs().max().item(), f"half tiles {name}: max error {err:.3e}"
        monkeypatch.setitem(tk.TUNING, "down_bwd_act", dict(shipped, TMA=True, TMA_A=True, BLOCK_N=256,
                                                                 num_stages=3, PERSISTENT=True))
        test_deterministic_and_cuda_graph_gpu()
        test_bf16_real_sizes_gpu((1023, 1024, 512, 128, 8))


def test_autocast_fp32_weights():
    # fp32 parameters under autocast (mixed-precision training): GEMMs run in the autocast dtype, grads reach
    # the fp32 leaves in fp32
    x, idx, w, gu, dn, dout = _make(9, 32, 32, 4, 2, torch.float32)
    leaves = [t.clone().requires_grad_() for t in (x, w, gu, dn)]
    with torch.autocast("cpu", dtype=torch.float16):
        out = moe.moe_experts(leaves[0], idx, leaves[1], leaves[2], leaves[3])
    assert out.dtype == torch.float16
    grads = torch.autograd.grad(out, leaves, dout.half())
    assert [g.dtype for g in grads] == [torch.float32] * 4
    ref_out, ref_grads = _reference(x, idx, w, gu, dn, dout)
    assert (out.double() - ref_out).abs().max() < 2e-2 * ref_out.abs().max()
    for g, r in zip(grads, ref_grads):
        assert (g.double() - r).abs().max() < 2e-2 * r.abs().max()
