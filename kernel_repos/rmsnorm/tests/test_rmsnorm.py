"""RMSNorm family numerics: the fused op (Triton under TRITON_INTERPRET on CPU, or on CUDA) against a
float64 reference, forward and backward; the reference path against the HF modules; bad input; compile."""
import os

import pytest
import torch

import hubfuse.rmsnorm as rmsnorm
from hubfuse.rmsnorm import reference as R

EPS = 1e-6
VARIANTS = {
    "standard": (lambda x, g, w: rmsnorm.rms_norm(x, w, EPS), lambda x, g, w: R.rms_norm_hf(x, w, EPS)),
    "zero_centered": (lambda x, g, w: rmsnorm.rms_norm_zero_centered(x, w, EPS),
                      lambda x, g, w: R.rms_norm_zero_centered_hf(x, w, EPS)),
    "gated": (lambda x, g, w: rmsnorm.rms_norm_gated(x, g, w, EPS),
              lambda x, g, w: R.rms_norm_gated_hf(x, g, w, EPS)),
}
# Tolerances relative to the largest reference value: a few output roundings of the dtype
TOL = {torch.float32: 2e-6, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}


def _inputs(shape, dtype, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(device, dtype)
    gate = torch.randn(shape, generator=g).to(device, dtype)
    w = (torch.randn(shape[-1], generator=g) * 0.5 + 1).to(device, dtype)
    dy = torch.randn(shape, generator=g).to(device, dtype)
    return x, gate, w, dy


def _check_against_float64(variant, shape, dtype, device, seed=0):
    fused, ref = VARIANTS[variant]
    x, gate, w, dy = _inputs(shape, dtype, device, seed)
    xs = [t.clone().requires_grad_() for t in (x, gate, w)]
    y = fused(*xs)
    grads = torch.autograd.grad(y, xs if variant == "gated" else [xs[0], xs[2]], dy)
    x64 = [t.double().requires_grad_() for t in (x, gate, w)]
    y64 = ref(*x64)
    grads64 = torch.autograd.grad(y64, x64 if variant == "gated" else [x64[0], x64[2]], dy.double())
    assert y.dtype == x.dtype and y.shape == x.shape
    for name, got, want in [("y", y, y64), *zip(["dx", "dgate", "dw"] if variant == "gated" else ["dx", "dw"],
                                                grads, grads64)]:
        scale = want.abs().max().item() + 1e-6
        err = (got.double() - want).abs().max().item()
        # dweight sums over rows: its error grows with sqrt(rows)
        tol = TOL[dtype] * (max(1.0, x.numel() // shape[-1]) ** 0.5 if name == "dw" else 1.0)
        assert err <= tol * scale, f"{variant} {name} {shape} {dtype}: max err {err:.3g} > {tol * scale:.3g}"


# (70, 1025): the 1024-2048-feature launch settings (4-row tiles), two tiles per program on 4 "SMs"
CPU_SHAPES = [(1, 33), (5, 64), (3, 7, 100), (37, 128), (2, 257), (70, 1025)]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", CPU_SHAPES)
def test_triton_kernel_matches_float64(variant, dtype, shape):
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1", "CPU tests must exercise the Triton kernels"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _check_against_float64(variant, shape, dtype, device, seed=hash((variant, shape)) % 1000)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reference_path_matches_float64(variant, dtype, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU dispatch -> torch reference path
    _check_against_float64(variant, (9, 48), dtype, "cpu", seed=7)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_many_rows_exercise_backward_partials(variant):
    # more rows than programs: several row blocks per program in the dweight reduction
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _check_against_float64(variant, (300, 16), torch.float32, device, seed=3)


def test_matches_hf_modules_exactly():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm, Qwen3_5MoeRMSNormGated

    torch.manual_seed(0)
    x, gate = torch.randn(4, 6, 40), torch.randn(4, 6, 40)
    for hf, ours, args in [(Qwen3RMSNorm(40), rmsnorm.layers.RMSNormLayout(40), (x,)),
                           (Qwen3_5MoeRMSNorm(40), rmsnorm.layers.RMSNormZeroCenteredLayout(40), (x,)),
                           (Qwen3_5MoeRMSNormGated(40), rmsnorm.layers.RMSNormGatedLayout(40), (x, gate))]:
        with torch.no_grad():
            hf.weight.normal_()
        ours.load_state_dict(hf.state_dict())
        torch.testing.assert_close(ours(*args), hf(*args), atol=0, rtol=0)
        layer_cls = getattr(rmsnorm.layers, type(ours).__name__.removesuffix("Layout"))
        torch.testing.assert_close(layer_cls.forward(hf, *args), hf(*args), atol=2e-6, rtol=2e-6)


def test_mixed_weight_dtype_follows_hf_promotion():
    x = torch.randn(3, 32, dtype=torch.float16)
    w = torch.randn(32, dtype=torch.float32)
    y = rmsnorm.rms_norm(x, w, EPS)
    assert y.dtype == torch.float32  # HF: fp32 weight * fp16 normalised -> fp32
    torch.testing.assert_close(y, R.rms_norm_hf(x, w, EPS), atol=2e-6, rtol=2e-6)
    assert rmsnorm.rms_norm_zero_centered(x, w, EPS).dtype == torch.float16


@pytest.mark.parametrize("call, exc, match", [
    (lambda: rmsnorm.rms_norm(torch.randn(4, 8), torch.ones(9)), ValueError, "hidden size 8"),
    (lambda: rmsnorm.rms_norm(torch.randint(0, 3, (4, 8)), torch.ones(8)), TypeError, "floating-point"),
    (lambda: rmsnorm.rms_norm(torch.randn(0, 8), torch.ones(8)), ValueError, "empty"),
    (lambda: rmsnorm.rms_norm(torch.randn(4, 8), torch.ones(8, 1)), ValueError, "1-D weight"),
    (lambda: rmsnorm.rms_norm_gated(torch.randn(4, 8), torch.randn(4, 9), torch.ones(8)), ValueError, "gate shape"),
    (lambda: rmsnorm.rms_norm_gated(torch.randn(4, 8), torch.randn(4, 8).half(), torch.ones(8)), TypeError,
     "gate dtype"),
    (lambda: rmsnorm.rms_norm(torch.randn(4, 8), torch.ones(8, device="meta")), ValueError, "on meta"),
])
def test_bad_input_raises_clear_error(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_non_contiguous_input():
    x = torch.randn(16, 64)[:, ::2]
    w = torch.randn(32)
    torch.testing.assert_close(rmsnorm.rms_norm(x, w), R.rms_norm_hf(x, w, EPS), atol=2e-6, rtol=2e-6)


def test_torch_compile_fullgraph_no_graph_break():
    torch._dynamo.reset()
    x = torch.randn(6, 48, requires_grad=True)
    gate = torch.randn(6, 48, requires_grad=True)
    w = torch.randn(48, requires_grad=True)

    def f(x, gate, w):
        return (rmsnorm.rms_norm(x, w) + rmsnorm.rms_norm_zero_centered(x, w)
                + rmsnorm.rms_norm_gated(x, gate, w)).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = compiled(x, gate, w)
    grads = torch.autograd.grad(got, (x, gate, w))
    want = f(x, gate, w)
    want_grads = torch.autograd.grad(want, (x, gate, w))
    torch.testing.assert_close(got, want)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b)


def test_ops_registered_under_unique_namespace():
    from hubfuse._common._ops import add_op_namespace_prefix

    name = add_op_namespace_prefix("rms_norm_fwd")
    assert name == "_hubfuse__common::rms_norm_fwd"  # the source form; every build variant writes its own


@pytest.mark.gpu
@pytest.mark.parametrize("variant, shape", [("standard", (16384, 4096)), ("zero_centered", (4096, 4096)),
                                            ("gated", (65536, 128)), ("standard", (1000, 16384)),
                                            ("zero_centered", (3, 5, 1025))])
def test_gpu_bf16_real_sizes(variant, shape):
    _check_against_float64(variant, shape, torch.bfloat16, "cuda", seed=11)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpu_deterministic(variant):
    fused, _ = VARIANTS[variant]
    x, gate, w, dy = _inputs((8192, 1024), torch.bfloat16, "cuda", 5)
    results = []
    for _ in range(2):
        xs = [t.clone().requires_grad_() for t in (x, gate, w)]
        results.append(torch.autograd.grad(fused(*xs), [xs[0], xs[2]], dy))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_same_dtype_output_equals_hf_eager(variant):
    # HF's cast order is part of the contract: in fp16 nearly every element must be bit-identical to eager
    # (only fp32 reduction-order ties may flip the last bit); a kernel that skips HF's cast fails this.
    fused, ref = VARIANTS[variant]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, gate, w, _ = _inputs((64, 96), torch.float16, device, seed=21)
    got, want = fused(x, gate, w), ref(x, gate, w)
    mismatched = (got != want).float().mean().item()
    assert mismatched < 0.01, f"{variant}: {mismatched:.1%} of elements differ from HF eager"
    torch.testing.assert_close(got, want, atol=0, rtol=2e-3)


@pytest.mark.parametrize("triton_path", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_recompute_rebuilds_the_forward_output_bitwise(triton_path, dtype, monkeypatch):
    # rms_norm_backward_recompute: the same dx / dweight as the plain backward, and y equal to the forward's
    from hubfuse.rmsnorm import ops

    if not triton_path:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, _, w, dy = _inputs((37, 48), dtype, "cuda" if torch.cuda.is_available() else "cpu", seed=3)
    y, rstd = ops.rms_norm_forward(x, w, EPS)
    dx, dw, _ = ops._bwd_impl(dy, x, w, None, rstd, R.STANDARD)
    dx2, dw2, y2 = ops.rms_norm_backward_recompute(dy.clone(), x, w, rstd)
    for a, b in ((y2, y), (dx2, dx), (dw2, dw)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("triton_path", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 33), (37, 48), (70, 1025)])
def test_residual_add_in_the_kernels_equals_torch_add(triton_path, dtype, shape, monkeypatch):
    # rms_norm_add_forward / rms_norm_backward(dresidual=) / rms_norm_backward_recompute(dresidual=): the residual
    # stream's add inside the norm kernels, bit for bit what torch's add then the plain norm give (h, y, rstd; dx,
    # dweight, y), the add rounded as torch rounds it. Both orders of the add are torch's (IEEE addition commutes).
    from hubfuse.rmsnorm import ops

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not triton_path:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    elif dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("Triton's interpreter casts fp32 to bf16 by truncation, torch and GPUs round to nearest")
    x, r, w, dy = _inputs(shape, dtype, device, seed=shape[0])
    dr = torch.randn(shape, generator=torch.Generator().manual_seed(5)).to(device, dtype)
    in_kernel = []  # whether each kernel launch took the residual (the add inside the kernel)
    if ops.use_triton(x):
        from hubfuse.rmsnorm import triton_kernels

        for name, key in (("rms_norm_fwd", "residual"), ("rms_norm_bwd", "dresidual")):
            def spy(*args, _fn=getattr(triton_kernels, name), _key=key, **kwargs):
                in_kernel.append(kwargs.get(_key) is not None)
                return _fn(*args, **kwargs)

            monkeypatch.setattr(triton_kernels, name, spy)
    h, y, rstd = ops.rms_norm_add_forward(x, r, w, EPS)
    y_ref, rstd_ref = ops.rms_norm_forward(x + r, w, EPS)
    for a, b in ((h, x + r), (y, y_ref), (rstd, rstd_ref)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    dx_plain, dw_plain, _ = ops._bwd_impl(dy, h, w, None, rstd, R.STANDARD)
    dx, dw = ops.rms_norm_backward(dy, h, w, rstd, dresidual=dr)
    dx2, dw2, y2 = ops.rms_norm_backward_recompute(dy.clone(), h, w, rstd, dresidual=dr)
    for a, b in ((dx, dr + dx_plain), (dw, dw_plain), (dx2, dr + dx_plain), (dw2, dw_plain), (y2, y_ref)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    # launches in order: the fused forward, the plain forward and backward (the references), the two fused backwards
    fused = ops.use_triton(x) and dtype != torch.float32
    assert in_kernel == ([fused, False, False, fused, fused] if ops.use_triton(x) else [])
    # a gradient of another dtype or layout is added by torch (the kernel adds in x's dtype, at dx's strides)
    dr_t = torch.randn(shape[::-1], generator=torch.Generator().manual_seed(6)).to(device, dtype).t()
    torch.testing.assert_close(ops.rms_norm_backward(dy, h, w, rstd, dresidual=dr_t)[0], dr_t + dx_plain,
                               atol=0, rtol=0)


@pytest.mark.parametrize("rows, split, n", [(1, 1, 5), (70, 70, 1024), (77, 33, 130), (5, 4, 300), (600, 257, 130),
                                           (300, 300, 1030)])
def test_sum_partials_matches_torch_column_sums(rows, split, n):
    # the one-launch reduction of the backward's per-program dweight partials, one or two groups of rows
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 on CPU")
    from hubfuse.rmsnorm.triton_kernels import sum_partials

    device = "cuda" if torch.cuda.is_available() else "cpu"
    partials = torch.randn(rows, n, generator=torch.Generator().manual_seed(rows)).to(device)
    def assert_column_sums(out, part, ulp):
        # fp32 summation of n terms: |error| <= n * 2^-24 * sum |x| per column; then one rounding to the dtype
        exact = part.double().sum(0)
        bound = part.shape[0] * 2**-24 * part.double().abs().sum(0) + ulp * exact.abs()
        assert (out.double() - exact).abs().le(bound).all(), ((out.double() - exact).abs() / bound).max()

    for dtype, ulp in ((torch.float32, 0.0), (torch.bfloat16, 2**-7)):  # bf16: one ulp (the interpreter truncates)
        a, b = sum_partials(partials, split, dtype)
        assert a.dtype == dtype
        assert_column_sums(a, partials[:split], ulp)
        if split == rows:
            assert b is None
        else:
            assert_column_sums(b, partials[split:], ulp)
