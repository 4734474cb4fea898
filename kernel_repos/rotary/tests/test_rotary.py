"""Numerics of the rotary kernels: RoPE (full / partial) and fused q/k RMSNorm + RoPE, forward and backward.

CPU runs the Triton kernels under TRITON_INTERPRET=1 (root conftest) at small shapes, and also the torch
reference path (`path="torch"`); GPU tests (bf16, real shapes) are marked `gpu`.
"""

import pytest
import torch

import hubfuse.rotary as rotary
from hubfuse.rotary import ops
from hubfuse.rotary.reference import STANDARD, ZERO_CENTERED, apply_rotary_pos_emb_hf, qk_norm_rope_hf

TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=["triton", "triton_row_tile", "torch"])
def path(request, monkeypatch, use_kernel_path):
    """Run each CPU test through the Triton kernels (interpreter), through them with TUNING's row_tile flipped
    (partial RoPE: the row-tile kernels if the default runs the column groups, and vice versa), and through
    the torch reference path."""
    use_kernel_path(request.param)
    if request.param == "triton_row_tile":
        _flip_row_tile(monkeypatch)
    return request.param


def _flip_row_tile(monkeypatch):
    from hubfuse.rotary import triton_kernels as tk

    for kind, cfg in tk.TUNING.items():
        monkeypatch.setitem(tk.TUNING, kind, dict(cfg, row_tile=not cfg["row_tile"]))


def _maybe_flip_row_tile(flip: bool, R: int, D: int, monkeypatch) -> None:
    if flip:
        if R == D:
            pytest.skip("row_tile only changes partial RoPE")
        _flip_row_tile(monkeypatch)


def make_cos_sin(B, S, R, dtype, device=DEV, batch_broadcast=False, shifted=True):
    """HF-style cos/sin (Bc, S, R) = cat(freqs, freqs), with packed / shifted (not 0..S-1) positions."""
    Bc = 1 if batch_broadcast else B
    if shifted:
        pos = torch.randint(0, 4096, (Bc, S), device=device).float()
    else:
        pos = torch.arange(S, device=device).float().expand(Bc, S)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, R, 2, device=device).float() / R))
    freqs = pos[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _close(a, b, dtype, what):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(a.double(), b.double(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


# (B, Hq, Hk, S, D, R, unsqueeze_dim, cos batch broadcast)
ROPE_CASES = [
    (2, 4, 2, 5, 16, 16, 1, False),   # full, GQA, odd seq
    (1, 3, 1, 7, 24, 8, 1, False),    # partial, batch 1, odd head count
    (2, 4, 2, 3, 32, 8, 2, False),    # partial, (B, S, H, D) layout
    (3, 2, 2, 1, 8, 8, 2, True),      # single token (decode), cos broadcast over batch
    (2, 2, 1, 9, 12, 4, 1, True),     # head_dim not a power of 2, partial
]


@pytest.mark.parametrize("case", ROPE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_vs_float64(case, dtype, path):
    torch.manual_seed(hash((case, str(dtype))) % 2**31)
    B, Hq, Hk, S, D, R, ud, bb = case
    shape = (lambda H: (B, H, S, D)) if ud == 1 else (lambda H: (B, S, H, D))
    q = torch.randn(shape(Hq), dtype=dtype, requires_grad=True, device=DEV)
    k = torch.randn(shape(Hk), dtype=dtype, requires_grad=True, device=DEV)
    cos, sin = make_cos_sin(B, S, R, dtype, batch_broadcast=bb)
    qo, ko = rotary.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=ud)
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    qr, kr = apply_rotary_pos_emb_hf(q64, k64, cos.double(), sin.double(), ud)
    assert qo.dtype == dtype and qo.shape == q.shape and ko.shape == k.shape
    _close(qo, qr, dtype, "q_embed")
    _close(ko, kr, dtype, "k_embed")
    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    dq, dk = torch.autograd.grad((qo, ko), (q, k), (gq, gk))
    dq64, dk64 = torch.autograd.grad((qr, kr), (q64, k64), (gq.double(), gk.double()))
    _close(dq, dq64, dtype, "dq")
    _close(dk, dk64, dtype, "dk")
    # the pass-through part is carried unchanged, forward and backward
    assert torch.equal(qo[..., R:], q.detach()[..., R:])
    assert torch.equal(dq[..., R:], gq[..., R:])


@pytest.mark.parametrize("case", ROPE_CASES[:3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_bitwise_equal_to_hf_eager(case, dtype, path):
    """Same dtype as eager: the kernel reproduces HF's roundings, forward and backward, and its strides."""
    torch.manual_seed(1)
    B, Hq, Hk, S, D, R, ud, bb = case
    shape = (lambda H: (B, H, S, D)) if ud == 1 else (lambda H: (B, S, H, D))
    # q as the attention produces it: a transposed view of a (B, S, H, D) projection
    if ud == 1:
        q = torch.randn(B, S, Hq, D, dtype=dtype, device=DEV).transpose(1, 2)
    else:
        q = torch.randn(shape(Hq), dtype=dtype, device=DEV)
    q.requires_grad_()
    k = torch.randn(shape(Hk), dtype=dtype, requires_grad=True, device=DEV)
    cos, sin = make_cos_sin(B, S, R, dtype, batch_broadcast=bb)
    qo, ko = rotary.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=ud)
    qr, kr = apply_rotary_pos_emb_hf(q, k, cos, sin, ud)
    assert torch.equal(qo, qr) and torch.equal(ko, kr)
    assert qo.stride() == qr.stride() and ko.stride() == kr.stride()
    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    a = torch.autograd.grad((qo, ko), (q, k), (gq, gk))
    b = torch.autograd.grad((qr, kr), (q, k), (gq, gk))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_rope_flat_matches_cat(path):
    torch.manual_seed(2)
    q = torch.randn(2, 3, 5, 16, requires_grad=True, device=DEV)
    k = torch.randn(2, 1, 5, 16, requires_grad=True, device=DEV)
    cos, sin = make_cos_sin(2, 5, 8, torch.float32)
    flat = rotary.apply_rotary_pos_emb_flat(q, k, cos, sin)
    qr, kr = apply_rotary_pos_emb_hf(q, k, cos, sin)
    ref = torch.cat([qr.flatten(), kr.flatten()])
    assert torch.equal(flat, ref)
    g = torch.randn_like(flat)
    assert all(torch.equal(u, v) for u, v in zip(torch.autograd.grad(flat, (q, k), g),
                                                  torch.autograd.grad(ref, (q, k), g)))


def test_rope_one_output_used():
    q = torch.randn(1, 2, 3, 8, requires_grad=True, device=DEV)
    k = torch.randn(1, 1, 3, 8, requires_grad=True, device=DEV)
    cos, sin = make_cos_sin(1, 3, 8, torch.float32)
    qo, _ = rotary.apply_rotary_pos_emb(q, k, cos, sin)
    qo.sum().backward()
    qr, _ = apply_rotary_pos_emb_hf(q.detach().double().requires_grad_(), k.double(), cos.double(), sin.double())
    assert k.grad is not None and torch.count_nonzero(k.grad) == 0
    assert q.grad.abs().sum() > 0


def test_rope_mixed_dtype_promotes_like_hf():
    """bf16 q with fp32 cos (autocast): HF returns fp32; so do we."""
    q = torch.randn(1, 2, 4, 8, dtype=torch.float16, requires_grad=True, device=DEV)
    k = torch.randn(1, 2, 4, 8, dtype=torch.float16, requires_grad=True, device=DEV)
    cos, sin = make_cos_sin(1, 4, 8, torch.float32)
    qo, ko = rotary.apply_rotary_pos_emb(q, k, cos, sin)
    qr, kr = apply_rotary_pos_emb_hf(q, k, cos, sin)
    assert qo.dtype == qr.dtype == torch.float32
    torch.testing.assert_close(qo, qr, atol=1e-6, rtol=1e-6)
    dq, = torch.autograd.grad(qo.sum() + ko.sum(), q)
    assert dq.dtype == torch.float16


@pytest.mark.parametrize("R", [16, 8])
def test_rope_grads_take_the_input_layout(R, path):
    """q/k as HF hands them over (transposed (B, S, H, D) tensors): the grads come back in that layout, so
    autograd does not copy them again (AccumulateGrad into the leaf, or `view`'s backward in a model)."""
    torch.manual_seed(12)
    q = torch.randn(2, 5, 4, 16, device=DEV).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 5, 2, 16, device=DEV).transpose(1, 2).requires_grad_()
    cos, sin = make_cos_sin(2, 5, R, torch.float32)
    for fn in (lambda: sum(t.sum() for t in rotary.apply_rotary_pos_emb(q, k, cos, sin)),
               lambda: rotary.apply_rotary_pos_emb_flat(q, k, cos, sin).sum()):
        dq, dk = torch.autograd.grad(fn(), (q, k))
        assert dq.stride() == q.stride() and dk.stride() == k.stride()


# ------------------------------------------------------------------ in-place RoPE


@pytest.mark.parametrize("case", ROPE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_inplace_vs_float64(case, dtype, path):
    """q/k as non-leaf tensors (views, as in HF): rotated in place, forward and backward as the float64
    reference, and bitwise equal to the out-of-place op."""
    torch.manual_seed(hash((case, str(dtype), "inplace")) % 2**31)
    B, Hq, Hk, S, D, R, ud, bb = case
    shape = (lambda H: (B, S, H, D))  # projections; unsqueeze_dim=1 takes their transposed views
    q0 = torch.randn(shape(Hq), dtype=dtype, requires_grad=True, device=DEV)
    k0 = torch.randn(shape(Hk), dtype=dtype, requires_grad=True, device=DEV)
    view = (lambda t: t.transpose(1, 2)) if ud == 1 else (lambda t: t)
    cos, sin = make_cos_sin(B, S, R, dtype, batch_broadcast=bb)
    q, k = view(q0 * 1), view(k0 * 1)
    ptrs = (q.data_ptr(), k.data_ptr())
    qo, ko = rotary.apply_rotary_pos_emb_(q, k, cos, sin, unsqueeze_dim=ud)
    assert qo is q and ko is k and (q.data_ptr(), k.data_ptr()) == ptrs
    qe, ke = rotary.apply_rotary_pos_emb(view(q0), view(k0), cos, sin, unsqueeze_dim=ud)
    assert torch.equal(qo, qe) and torch.equal(ko, ke)
    q64, k64 = q0.detach().double().requires_grad_(), k0.detach().double().requires_grad_()
    qr, kr = apply_rotary_pos_emb_hf(view(q64), view(k64), cos.double(), sin.double(), ud)
    _close(qo, qr, dtype, "q_embed")
    _close(ko, kr, dtype, "k_embed")
    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    gq_copy = gq.clone()
    dq, dk = torch.autograd.grad((qo, ko), (q0, k0), (gq, gk))
    assert torch.equal(gq, gq_copy)  # the backward is out of place: the caller's grad is left alone
    dq64, dk64 = torch.autograd.grad((qr, kr), (q64, k64), (gq.double(), gk.double()))
    _close(dq, dq64, dtype, "dq")
    _close(dk, dk64, dtype, "dk")
    eq, ek = torch.autograd.grad((qe, ke), (q0, k0), (gq, gk))
    assert torch.equal(dq, eq) and torch.equal(dk, ek)


def test_rope_inplace_misuse_raises():
    cos, sin = make_cos_sin(1, 3, 8, torch.float32)
    q = torch.randn(1, 2, 3, 8, requires_grad=True, device=DEV)
    k = torch.randn(1, 1, 3, 8, requires_grad=True, device=DEV)
    with pytest.raises(RuntimeError, match="leaf"):
        rotary.apply_rotary_pos_emb_(q, k, cos, sin)
    with pytest.raises(RuntimeError, match="leaf"):
        rotary.apply_rotary_pos_emb_(q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2)
    qe, ke = q.exp(), k.exp()  # exp saves its output for the backward: rotating it in place invalidates that
    qo, ko = rotary.apply_rotary_pos_emb_(qe, ke, cos, sin)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (qo.sum() + ko.sum()).backward()
    with pytest.raises(TypeError, match="would promote"):
        rotary.apply_rotary_pos_emb_(q.half() * 1, k.half() * 1, cos, sin)


def test_rope_inplace_torch_compile_fullgraph(path):
    # under compile the in-place op rotates out of place and copies back (no autograd.Function marking an input
    # dirty), so it needs no Dynamo fix of mark_dirty: every torch the project runs
    torch._dynamo.reset()
    torch.manual_seed(13)
    q0 = torch.randn(2, 5, 4, 16, requires_grad=True, device=DEV)
    k0 = torch.randn(2, 5, 2, 16, requires_grad=True, device=DEV)
    cos, sin = make_cos_sin(2, 5, 8, torch.float32)

    def f(q0, k0, cos, sin):
        qo, ko = rotary.apply_rotary_pos_emb_((q0 * 2).transpose(1, 2), (k0 * 2).transpose(1, 2), cos, sin)
        return (qo * qo).sum() + (ko * 3).sum()

    out = torch.compile(f, fullgraph=True, backend="inductor")(q0, k0, cos, sin)
    ref = f(q0, k0, cos, sin)
    torch.testing.assert_close(out, ref)
    for a, b in zip(torch.autograd.grad(out, (q0, k0)), torch.autograd.grad(ref, (q0, k0))):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------------ fused q/k RMSNorm + RoPE

# (B, Hq, Hk, S, D, R, strided q rows (Qwen3.5 chunk view), cos batch broadcast)
NORM_CASES = [
    (2, 4, 2, 5, 16, 16, False, False),  # full (Qwen3)
    (1, 2, 1, 7, 32, 8, True, False),    # partial, q rows strided like Qwen3.5's chunk of q_proj
    (2, 3, 3, 3, 24, 12, False, True),   # head_dim not a power of 2, cos broadcast
]


def _norm_inputs(case, dtype, wdtype=None):
    B, Hq, Hk, S, D, R, strided, bb = case
    wdtype = wdtype or dtype
    q = torch.randn(B, S, Hq, 2 * D if strided else D, dtype=dtype, device=DEV) * 3 + 0.5  # not unit-scale
    if strided:
        q = q.chunk(2, dim=-1)[0]
        assert not q.is_contiguous()
    q = q.requires_grad_()
    k = (torch.randn(B, S, Hk, D, dtype=dtype, device=DEV) * 0.5).requires_grad_()
    wq = (torch.randn(D, dtype=wdtype, device=DEV) * 0.5 + 1).requires_grad_()
    wk = (torch.randn(D, dtype=wdtype, device=DEV) * 0.5).requires_grad_()
    cos, sin = make_cos_sin(B, S, R, dtype, batch_broadcast=bb)
    return q, k, wq, wk, cos, sin


FUSED = {STANDARD: rotary.qk_norm_rope, ZERO_CENTERED: rotary.qk_norm_rope_zero_centered}
MODES_AND_DTYPES = pytest.mark.parametrize("mode, dtype", [(m, d) for m in (STANDARD, ZERO_CENTERED)
                                                           for d in (torch.float32, torch.float16)])


def _fused_outputs(case, mode, dtype, seed):
    """Fresh inputs (q, k, wq, wk, cos, sin) of a norm + RoPE case and the fused op's (q_out, k_out) on them."""
    torch.manual_seed(seed)
    inputs = _norm_inputs(case, dtype)
    return inputs, FUSED[mode](*inputs, 1e-6)


@pytest.mark.parametrize("case", NORM_CASES)
@MODES_AND_DTYPES
def test_qk_norm_rope_vs_float64(case, mode, dtype, path):
    (q, k, wq, wk, cos, sin), (qo, ko) = _fused_outputs(case, mode, dtype, seed=3)
    leaves = (q, k, wq, wk)
    l64 = [t.detach().double().requires_grad_() for t in leaves]
    qr, kr = qk_norm_rope_hf(*l64, cos.double(), sin.double(), 1e-6, mode)
    assert qo.shape == qr.shape and ko.shape == kr.shape and qo.dtype == dtype
    _close(qo, qr, dtype, "q")
    _close(ko, kr, dtype, "k")
    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    got = torch.autograd.grad((qo, ko), leaves, (gq, gk))
    ref = torch.autograd.grad((qr, kr), l64, (gq.double(), gk.double()))
    for name, a, b in zip(("dq", "dk", "dq_weight", "dk_weight"), got, ref):
        atol, rtol = TOL[dtype]
        scale = 1.0 if name in ("dq", "dk") else max(1.0, b.abs().max().item())  # weight grads sum many rows
        torch.testing.assert_close(a.double(), b, atol=atol * scale, rtol=rtol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("case", NORM_CASES[:2])
@MODES_AND_DTYPES
def test_qk_norm_rope_forward_matches_hf_eager(case, mode, dtype, path):
    """Same dtype as eager: HF's cast order is reproduced (fp16: bitwise; fp32: to rounding), and its strides."""
    (q, k, wq, wk, cos, sin), (qo, ko) = _fused_outputs(case, mode, dtype, seed=4)
    qr, kr = qk_norm_rope_hf(q, k, wq, wk, cos, sin, 1e-6, mode)
    assert qo.stride() == qr.stride() and ko.stride() == kr.stride()
    if dtype == torch.float16:
        # fp16 rounding hides fp32 differences (rsqrt vs 1/sqrt): equal but for rare 1-ulp ties
        assert (qo != qr).float().mean() < 0.01 and (ko != kr).float().mean() < 0.01
        torch.testing.assert_close(qo, qr, atol=2e-3, rtol=1e-3)
    else:
        torch.testing.assert_close(qo, qr, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("mode", [STANDARD, ZERO_CENTERED])
def test_qk_norm_rope_flat_matches_cat(mode, path):
    torch.manual_seed(11)
    q, k, wq, wk, cos, sin = _norm_inputs(NORM_CASES[1], torch.float32)
    flat = rotary.qk_norm_rope_flat(q, k, wq, wk, cos, sin, 1e-6, zero_centered=mode == ZERO_CENTERED)
    qo, ko = FUSED[mode](q, k, wq, wk, cos, sin, 1e-6)
    ref = torch.cat([qo.flatten(), ko.flatten()])
    assert torch.equal(flat, ref)
    g = torch.randn_like(flat)
    for a, b in zip(torch.autograd.grad(flat, (q, k, wq, wk), g), torch.autograd.grad(ref, (q, k, wq, wk), g)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_qk_norm_rope_weight_dtype_promotion():
    """fp16 activations with fp32 weights (autocast): HF's standard norm returns fp32; so do we."""
    torch.manual_seed(5)
    q, k, wq, wk, cos, sin = _norm_inputs(NORM_CASES[0], torch.float16, wdtype=torch.float32)
    qo, _ = rotary.qk_norm_rope(q, k, wq, wk, cos, sin)
    qr, _ = qk_norm_rope_hf(q, k, wq, wk, cos, sin, 1e-6, STANDARD)
    assert qo.dtype == qr.dtype == torch.float32
    torch.testing.assert_close(qo, qr, atol=1e-5, rtol=1e-5)


def test_qk_norm_rope_backward_deterministic():
    torch.manual_seed(6)
    q, k, wq, wk, cos, sin = _norm_inputs((2, 4, 2, 9, 16, 8, False, False), torch.float32)
    qo, ko = rotary.qk_norm_rope_zero_centered(q, k, wq, wk, cos, sin)
    g = (torch.randn_like(qo), torch.randn_like(ko))
    a = torch.autograd.grad((qo, ko), (q, k, wq, wk), g, retain_graph=True)
    b = torch.autograd.grad((qo, ko), (q, k, wq, wk), g)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# ------------------------------------------------------------------ bad input


def _good(dtype=torch.float32):
    q = torch.randn(2, 4, 5, 16, dtype=dtype, device=DEV)
    k = torch.randn(2, 2, 5, 16, dtype=dtype, device=DEV)
    cos, sin = make_cos_sin(2, 5, 8, dtype)
    return q, k, cos, sin


@pytest.mark.parametrize("mutate, exc, match", [
    (lambda q, k, c, s: (q, k, torch.randn(2, 5, 32, device=DEV), torch.randn(2, 5, 32, device=DEV)), ValueError,
     "rotary dim"),
    (lambda q, k, c, s: (q, k, c[..., :7], s[..., :7]), ValueError, "rotary dim"),
    (lambda q, k, c, s: (q, k, c[:, :4], s[:, :4]), ValueError, "do not match"),
    (lambda q, k, c, s: (q, k, torch.randn(3, 5, 8, device=DEV), torch.randn(3, 5, 8, device=DEV)), ValueError,
     "do not match"),
    (lambda q, k, c, s: (q, k, c, s[..., :6]), ValueError, "cos and sin"),
    (lambda q, k, c, s: (q, k, c[0], s[0]), ValueError, "cos and sin"),
    (lambda q, k, c, s: (q, k.half(), c, s), TypeError, "dtypes differ"),
    (lambda q, k, c, s: (q, k, c, s.half()), TypeError, "dtypes differ"),
    (lambda q, k, c, s: (q.double(), k.double(), c, s), TypeError, "float32, float16 or bfloat16"),
    (lambda q, k, c, s: (q.long(), k, c, s), TypeError, "float32"),
    (lambda q, k, c, s: (q[0], k, c, s), ValueError, "4-D"),
    (lambda q, k, c, s: (q, k[..., :8], c, s), ValueError, "does not match q"),
    (lambda q, k, c, s: (q, k[:, :, :4], c, s), ValueError, "does not match q"),
    (lambda q, k, c, s: (q[:, :, :0], k[:, :, :0], c[:, :0], s[:, :0]), ValueError, "empty"),
    (lambda q, k, c, s: (q, k, c.to("meta"), s.to("meta")), ValueError, "is on"),
    (lambda q, k, c, s: (q, [1.0], c, s), TypeError, "must be a tensor"),
])
def test_rope_bad_input(mutate, exc, match):
    with pytest.raises(exc, match=match):
        rotary.apply_rotary_pos_emb(*mutate(*_good()))


def test_rope_bad_unsqueeze_dim():
    with pytest.raises(ValueError, match="unsqueeze_dim"):
        rotary.apply_rotary_pos_emb(*_good(), unsqueeze_dim=3)
    with pytest.raises(ValueError, match="unsqueeze_dim"):
        rotary.apply_rotary_pos_emb(*_good(), unsqueeze_dim=0)


def test_qk_norm_rope_bad_input():
    q, k, wq, wk, cos, sin = _norm_inputs(NORM_CASES[0], torch.float32)
    with pytest.raises(ValueError, match="head_dim"):
        rotary.qk_norm_rope(q, k, wq[:8], wk, cos, sin)
    with pytest.raises(TypeError, match="dtypes differ"):
        rotary.qk_norm_rope(q, k, wq, wk.half(), cos, sin)
    with pytest.raises(ValueError, match="does not match"):
        rotary.qk_norm_rope(q.transpose(1, 2), k, wq, wk, cos, sin)  # (B, H, S, D) given: seq mismatch


# ------------------------------------------------------------------ torch.compile


def test_torch_compile_fullgraph_no_graph_break(path):
    """Both ops inside one compiled function, forward and backward, no graph break, same result as eager."""
    torch._dynamo.reset()
    torch.manual_seed(7)
    q, k, wq, wk, cos, sin = _norm_inputs((1, 2, 1, 3, 16, 8, True, False), torch.float32)

    def f(q, k, wq, wk, cos, sin):
        qn, kn = rotary.qk_norm_rope_zero_centered(q, k, wq, wk, cos, sin)
        qr, kr = rotary.apply_rotary_pos_emb(qn, kn, cos, sin)
        return (qr * 2).sum() + kr.sum() + rotary.apply_rotary_pos_emb_flat(qn, kn, cos, sin).sum()

    explain = torch._dynamo.explain(f)(q, k, wq, wk, cos, sin)
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    compiled = torch.compile(f, fullgraph=True, backend="inductor")
    out = compiled(q, k, wq, wk, cos, sin)
    got = torch.autograd.grad(out, (q, k, wq, wk))
    ref_out = f(q, k, wq, wk, cos, sin)
    ref = torch.autograd.grad(ref_out, (q, k, wq, wk))
    torch.testing.assert_close(out, ref_out)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


def test_custom_ops_pass_opcheck():
    torch.manual_seed(8)
    q, k, cos, sin = _good()
    torch.library.opcheck(ops._rope_fwd, (q.requires_grad_(), k.requires_grad_(), cos, sin, 1),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    qn, kn, wq, wk, c2, s2 = _norm_inputs(NORM_CASES[1], torch.float32)
    torch.library.opcheck(ops._qk_norm_rope_fwd, (qn, kn, wq, wk, c2, s2, 1e-6, ZERO_CENTERED),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


# ------------------------------------------------------------------ GPU, bf16, real shapes

BF16_UNIT_ROUNDOFF = 2.0 ** -8  # 8 significant bits: one round-to-nearest is off by at most 2^-8 relative


def _close_bf16(got, ref64, what, roundings):
    """bf16 result vs a float64 reference: the error is at most `roundings` bf16 roundings of the largest
    reference magnitude (the rotation's cancellations make an elementwise relative bound meaningless)."""
    err = (got.double() - ref64).abs().max().item()
    bound = roundings * BF16_UNIT_ROUNDOFF * ref64.abs().max().item()
    assert err <= bound, f"{what}: max |err| {err:.3g} > {roundings} bf16 roundings of max |ref| ({bound:.3g})"


def _assert_bitwise(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if not torch.equal(got, want):
        frac = (got != want).float().mean().item()
        raise AssertionError(f"{what}: {frac:.3%} of elements differ from HF eager (expected bit-identical)")


@pytest.mark.gpu
@pytest.mark.parametrize("Hq, Hk, D, R", [(32, 8, 128, 128), (16, 2, 256, 64)])
@pytest.mark.parametrize("ud", [1, 2])
@pytest.mark.parametrize("flip_row_tile", [False, True])
def test_rope_gpu_bf16(Hq, Hk, D, R, ud, flip_row_tile, monkeypatch):
    """Plain RoPE has no reduction: with HF's roundings reproduced (and no fma contraction) it is bitwise
    equal to eager, forward and backward, also in bf16 on the GPU (both partial-RoPE kernel variants)."""
    _maybe_flip_row_tile(flip_row_tile, R, D, monkeypatch)
    torch.manual_seed(9)
    B, S, dt = 8, 2048, torch.bfloat16
    if ud == 1:  # as the attention produces it: transposed (B, S, H, D)
        q = torch.randn(B, S, Hq, D, device="cuda", dtype=dt).transpose(1, 2).requires_grad_()
        k = torch.randn(B, S, Hk, D, device="cuda", dtype=dt).transpose(1, 2).requires_grad_()
    else:
        q = torch.randn(B, S, Hq, D, device="cuda", dtype=dt, requires_grad=True)
        k = torch.randn(B, S, Hk, D, device="cuda", dtype=dt, requires_grad=True)
    cos, sin = make_cos_sin(B, S, R, dt, device="cuda")
    qo, ko = rotary.apply_rotary_pos_emb(q, k, cos, sin, ud)
    qr, kr = apply_rotary_pos_emb_hf(q, k, cos, sin, ud)
    _assert_bitwise(qo, qr, "q_embed")
    _assert_bitwise(ko, kr, "k_embed")
    assert qo.stride() == qr.stride() and ko.stride() == kr.stride()
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    q6, k6 = apply_rotary_pos_emb_hf(q64, k64, cos.double(), sin.double(), ud)
    _close_bf16(qo, q6, "q_embed", 4)  # two rounded products and a rounded sum
    _close_bf16(ko, k6, "k_embed", 4)
    g = (torch.randn_like(qo), torch.randn_like(ko))
    a = torch.autograd.grad((qo, ko), (q, k), g)
    b = torch.autograd.grad((qr, kr), (q, k), g)
    _assert_bitwise(a[0], b[0], "dq")
    _assert_bitwise(a[1], b[1], "dk")
    c = torch.autograd.grad((q6, k6), (q64, k64), tuple(t.double() for t in g))
    _close_bf16(a[0], c[0], "dq", 4)
    _close_bf16(a[1], c[1], "dk", 4)


@pytest.mark.gpu
@pytest.mark.parametrize("Hq, Hk, D, R, mode, strided", [(32, 8, 128, 128, STANDARD, False),
                                                         (16, 2, 256, 64, ZERO_CENTERED, True)])
@pytest.mark.parametrize("flip_row_tile", [False, True])
def test_qk_norm_rope_gpu_bf16(Hq, Hk, D, R, mode, strided, flip_row_tile, monkeypatch):
    _maybe_flip_row_tile(flip_row_tile, R, D, monkeypatch)
    torch.manual_seed(10)
    B, S, dt = 8, 2048, torch.bfloat16
    q = torch.randn(B, S, Hq, 2 * D if strided else D, device="cuda", dtype=dt)[..., :D].requires_grad_()
    k = torch.randn(B, S, Hk, D, device="cuda", dtype=dt, requires_grad=True)
    wq = (torch.randn(D, device="cuda", dtype=dt) * 0.3 + (1 if mode == STANDARD else 0)).requires_grad_()
    wk = (torch.randn(D, device="cuda", dtype=dt) * 0.3 + (1 if mode == STANDARD else 0)).requires_grad_()
    cos, sin = make_cos_sin(B, S, R, dt, device="cuda")
    qo, ko = FUSED[mode](q, k, wq, wk, cos, sin, 1e-6)
    qr, kr = qk_norm_rope_hf(q, k, wq, wk, cos, sin, 1e-6, mode)
    assert qo.stride() == qr.stride() and ko.stride() == kr.stride()
    # HF's cast order is reproduced: equal to eager but for the rare last bit flipped by a different fp32
    # reduction order of the sum of squares (as in rmsnorm's test_same_dtype_output_equals_hf_eager)
    for what, got, want in (("q", qo, qr), ("k", ko, kr)):
        frac = (got != want).float().mean().item()
        assert frac < 5e-3, f"{what}: {frac:.3%} of elements differ from HF eager"
    leaves = (q, k, wq, wk)
    l64 = [t.detach().double().requires_grad_() for t in leaves]
    q6, k6 = qk_norm_rope_hf(*l64, cos.double(), sin.double(), 1e-6, mode)
    _close_bf16(qo, q6, "q", 8)  # norm (+ weight) rounding, rounded products, rounded sum
    _close_bf16(ko, k6, "k", 8)
    g = (torch.randn_like(qo), torch.randn_like(ko))
    got = torch.autograd.grad((qo, ko), leaves, g)
    ref = torch.autograd.grad((q6, k6), l64, tuple(t.double() for t in g))
    for name, a, b in zip(("dq", "dk"), got, ref):  # fp32 math, one rounding at the store
        _close_bf16(a, b, name, 4)
    for name, a, b in zip(("dwq", "dwk"), got[2:], ref[2:]):  # sums over 2.6e5 / 3.3e4 rows, bf16 output
        torch.testing.assert_close(a.double(), b, atol=1e-2 * b.abs().max().item(), rtol=1e-2)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_qkv_projections_vs_float64(dtype, bias):
    # the attention Layers' q/k/v op: outputs and every gradient against float64 nn.Linear math
    torch.manual_seed(11)
    hidden, outs = 24, (32, 16, 16)
    x = torch.randn(2, 5, hidden, dtype=dtype, device=DEV)
    mods = [torch.nn.Linear(hidden, n, bias=bias, dtype=dtype, device=DEV) for n in outs]
    grads_out = [torch.randn(2, 5, n, dtype=dtype, device=DEV) for n in outs]
    x_leaf = x.clone().requires_grad_()
    got = ops._qkv_projections(x_leaf, *mods)
    torch.autograd.backward(got, grads_out)
    ref_mods = [torch.nn.Linear(hidden, n, bias=bias, dtype=torch.float64, device=DEV) for n in outs]
    with torch.no_grad():
        for m, r in zip(mods, ref_mods):
            r.load_state_dict({k: v.double() for k, v in m.state_dict().items()})
    x64 = x.double().requires_grad_()
    ref = [m(x64) for m in ref_mods]
    torch.autograd.backward(ref, [g.double() for g in grads_out])
    atol, rtol = TOL[dtype]
    pairs = [(x_leaf.grad, x64.grad)] + list(zip(got, ref))
    for m, r in zip(mods, ref_mods):
        pairs += [(m.weight.grad, r.weight.grad)] + ([(m.bias.grad, r.bias.grad)] if bias else [])
    for a, b in pairs:
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), b, atol=atol * b.abs().max().item(), rtol=rtol)


def test_qkv_projections_calls_modules_with_hooks():
    # a forward hook (an adapter, a profiler) on one projection keeps the modules' own calls
    mods = [torch.nn.Linear(8, 8, device=DEV) for _ in range(3)]
    seen = []
    mods[1].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    ops._qkv_projections(torch.randn(3, 8, device=DEV), *mods)
    assert seen == [torch.Size([3, 8])]
