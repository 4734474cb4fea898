"""SwiGLU kernels vs a float64 reference (fwd + bwd), HF-eager parity, Layers/Layouts, bad input, torch.compile.

CPU runs the Triton kernels under TRITON_INTERPRET=1 (set by the root conftest), so shapes are small; the GPU
tests (bf16, real sizes) are marked `gpu`.
"""
import os
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import hubfuse.swiglu as swiglu
from hubfuse.swiglu import layers, ops
from hubfuse.swiglu.reference import swiglu_bwd_reference, swiglu_fwd_reference, swiglu_hf, swiglu_mlp_hf

DEV = "cuda" if torch.cuda.is_available() else "cpu"
REPO = Path(__file__).resolve().parents[1]
# max |err| / max |ref| allowed, per dtype (fp16: a few roundings of 2^-11 each; GEMM outputs add accumulation)
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return ((actual.double() - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def _assert_close(actual, expected, dtype, what=""):
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert torch.isfinite(actual).all(), what
    err = _rel_err(actual, expected)
    assert err <= TOL[dtype], f"{what}: relative error {err:.3e} > {TOL[dtype]:.1e}"


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _grads_f64(fn, inputs, dout):
    """Forward and input grads of `fn` evaluated in float64 on upcast copies of `inputs`."""
    leaves = [None if t is None else _leaf(t.double()) for t in inputs]
    out = fn(*leaves)
    out.backward(dout.double())
    return out, [None if t is None else t.grad for t in leaves]


def _grads(fn, inputs, dout):
    leaves = [None if t is None else _leaf(t) for t in inputs]
    out = fn(*leaves)
    out.backward(dout)
    return out, [None if t is None else t.grad for t in leaves]


# ---------------------------------------------------------------- activation
ACT_SHAPES = [(1, 2), (1, 8), (7, 66), (64, 100), (3, 5, 258)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", ACT_SHAPES)
def test_swiglu_activation_vs_float64(shape, dtype):
    torch.manual_seed(hash(shape) % 1000)
    gate_up = torch.randn(shape, dtype=dtype, device=DEV) * 2
    dh = torch.randn(*shape[:-1], shape[-1] // 2, dtype=dtype, device=DEV)
    out, (dgu,) = _grads(swiglu.swiglu, [gate_up], dh)
    ref, (dgu_ref,) = _grads_f64(swiglu_hf, [gate_up], dh)
    assert out.dtype == dtype
    _assert_close(out, ref, dtype, "h")
    _assert_close(dgu, dgu_ref, dtype, "dgate_up")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_swiglu_activation_matches_hf_eager(dtype):
    # same roundings as eager autograd in the input dtype: within one ulp of HF (exp may differ in the last bit)
    gate_up = torch.randn(33, 2 * 77, dtype=dtype, device=DEV) * 3
    dh = torch.randn(33, 77, dtype=dtype, device=DEV)
    out, (dgu,) = _grads(swiglu.swiglu, [gate_up], dh)
    ref, (dgu_ref,) = _grads(swiglu_hf, [gate_up], dh)
    ulp = 2.0 ** -10 if dtype == torch.float16 else 1e-6  # fp32: a few ulp (GPU exp is approximate)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=ulp)
    if dtype == torch.float16:
        assert (out != ref).float().mean() < 0.01  # almost all bit-exact
    torch.testing.assert_close(dgu, dgu_ref, atol=2e-5, rtol=2e-3)


def test_triton_path_matches_torch_reference_path():
    if not ops.use_triton(torch.empty(0, device=DEV)):
        pytest.skip("Triton path not active")
    gate_up = torch.randn(9, 2 * 50, dtype=torch.float16, device=DEV)
    dh = torch.randn(9, 50, dtype=torch.float16, device=DEV)
    from hubfuse.swiglu.triton_kernels import swiglu_bwd, swiglu_fwd

    one_ulp = dict(atol=1e-6, rtol=2.0 ** -10)  # exp may differ in its last bit between backends
    torch.testing.assert_close(swiglu_fwd(gate_up), swiglu_fwd_reference(gate_up), **one_ulp)
    dgu_ref, h_ref = swiglu_bwd_reference(dh, gate_up)
    dgu, h = torch.empty_like(gate_up), torch.empty_like(dh)
    swiglu_bwd(dh, gate_up, dgu, h=h)
    torch.testing.assert_close(dgu, dgu_ref, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(h, h_ref, **one_ulp)
    # in place (dgate_up over gate_up, h over dh) gives the same result
    gu2, dh2 = gate_up.clone(), dh.clone()
    swiglu_bwd(dh2, gu2, gu2, h=dh2)
    torch.testing.assert_close(gu2, dgu, atol=0, rtol=0)
    torch.testing.assert_close(dh2, h, atol=0, rtol=0)


# ---------------------------------------------------------------- MLP and RMSNorm + MLP
MLP_SHAPES = [((1, 16), 8), ((37, 24), 40), ((2, 5, 32), 33)]


def _mlp_inputs(x_shape, inter, dtype, bias):
    hidden = x_shape[-1]
    x = torch.randn(x_shape, dtype=dtype, device=DEV)
    w_gu = torch.randn(2 * inter, hidden, dtype=dtype, device=DEV) / hidden**0.5
    w_d = torch.randn(hidden + 3, inter, dtype=dtype, device=DEV) / inter**0.5  # out != hidden: catches swaps
    b_gu = torch.randn(2 * inter, dtype=dtype, device=DEV) * 0.1 if bias else None
    b_d = torch.randn(hidden + 3, dtype=dtype, device=DEV) * 0.1 if bias else None
    return x, w_gu, w_d, b_gu, b_d


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("x_shape,inter", MLP_SHAPES)
def test_swiglu_mlp_vs_float64(x_shape, inter, dtype, bias):
    torch.manual_seed(inter)
    inputs = _mlp_inputs(x_shape, inter, dtype, bias)
    dout = torch.randn(*x_shape[:-1], x_shape[-1] + 3, dtype=dtype, device=DEV)
    out, grads = _grads(swiglu.swiglu_mlp, inputs, dout)
    ref, ref_grads = _grads_f64(swiglu_mlp_hf, inputs, dout)
    _assert_close(out, ref, dtype, "out")
    for name, g, r in zip(["x", "gate_up_weight", "down_weight", "gate_up_bias", "down_bias"], grads, ref_grads):
        if r is not None:
            _assert_close(g, r, dtype, f"d{name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("x_shape,inter", MLP_SHAPES[1:])
def test_rms_norm_swiglu_mlp_vs_float64(x_shape, inter, dtype):
    from hubfuse.rmsnorm.reference import rms_norm_hf

    torch.manual_seed(inter + 1)
    x, w_gu, w_d, _, _ = _mlp_inputs(x_shape, inter, dtype, False)
    w_norm = 1.0 + 0.3 * torch.randn(x_shape[-1], dtype=dtype, device=DEV)
    dout = torch.randn(*x_shape[:-1], x_shape[-1] + 3, dtype=dtype, device=DEV)
    eps = 1e-6

    def fused(x, wn, a, b):
        return swiglu.rms_norm_swiglu_mlp(x, wn, eps, a, b)

    def reference(x, wn, a, b):
        return swiglu_mlp_hf(rms_norm_hf(x, wn, eps), a, b)

    out, grads = _grads(fused, [x, w_norm, w_gu, w_d], dout)
    ref, ref_grads = _grads_f64(reference, [x, w_norm, w_gu, w_d], dout)
    _assert_close(out, ref, dtype, "out")
    for name, g, r in zip(["x", "norm_weight", "gate_up_weight", "down_weight"], grads, ref_grads):
        _assert_close(g, r, dtype, f"d{name}")


def test_rms_norm_swiglu_mlp_keeps_no_norm_output_for_backward():
    # the fusion saves x, rstd and gate_up (and parameters), not the norm's output (the gate/up GEMM's input)
    torch.manual_seed(4)
    x, w_gu, w_d, _, _ = _mlp_inputs((3, 7, 32), 24, torch.float32, False)
    leaves = [_leaf(t) for t in (x, 1.0 + 0.3 * torch.randn(32, device=DEV), w_gu, w_d)]
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = swiglu.rms_norm_swiglu_mlp(leaves[0], leaves[1], 1e-6, leaves[2], leaves[3])
    params = {t.untyped_storage().data_ptr() for t in leaves[1:]}
    activations = sum(n for ptr, n in saved.items() if ptr not in params)
    tokens = 21
    assert activations == tokens * 4 * (32 + 2 * 24 + 1)  # x, gate_up, rstd (fp32)
    out.sum().backward()


def test_swiglu_mlp_matches_hf_two_gemm_eager():
    # the HF module computes gate_proj and up_proj separately: same result as one GEMM on the fused weight
    torch.manual_seed(3)
    x, w_gu, w_d, _, _ = _mlp_inputs((11, 24), 20, torch.float32, False)
    gate, up = w_gu.chunk(2)
    hf = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), w_d)
    torch.testing.assert_close(swiglu.swiglu_mlp(x, w_gu, w_d), hf, atol=1e-5, rtol=1e-5)


def test_swiglu_mlp_second_backward_raises_instead_of_wrong_grads():
    # the backward overwrites the saved gate_up with its gradient: a retained graph must refuse a second pass
    x, w_gu, w_d, _, _ = _mlp_inputs((5, 16), 8, torch.float32, False)
    x.requires_grad_(True)
    out = swiglu.swiglu_mlp(x, w_gu, w_d)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        out.sum().backward()


def test_rms_norm_swiglu_mlp_second_backward_raises_instead_of_wrong_grads():
    # the same for the fused norm + MLP (one autograd node in eager mode), whose backward also reuses gate_up
    x, w_gu, w_d, _, _ = _mlp_inputs((5, 16), 8, torch.float32, False)
    x.requires_grad_(True)
    w = torch.randn(16, device=x.device, requires_grad=True)
    out = swiglu.rms_norm_swiglu_mlp(x, w, 1e-6, w_gu, w_d)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        out.sum().backward()


def test_swiglu_mlp_deterministic():
    inputs = _mlp_inputs((40, 32), 24, torch.float32, True)
    dout = torch.randn(40, 35, device=DEV)
    _, g1 = _grads(swiglu.swiglu_mlp, inputs, dout)
    _, g2 = _grads(swiglu.swiglu_mlp, inputs, dout)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- bad input
def test_bad_inputs():
    with pytest.raises(ValueError, match="even"):
        swiglu.swiglu(torch.randn(4, 7))
    with pytest.raises(ValueError, match="empty"):
        swiglu.swiglu(torch.randn(0, 8))
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        swiglu.swiglu(torch.ones(4, 8, dtype=torch.int32))
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        swiglu.swiglu(torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match="tensor"):
        swiglu.swiglu([1.0, 2.0])
    x, w_gu, w_d, _, _ = _mlp_inputs((3, 16), 8, torch.float32, False)
    with pytest.raises(ValueError, match="gate_up_weight must be"):
        swiglu.swiglu_mlp(x, w_gu[:, :15], w_d)
    with pytest.raises(ValueError, match="gate_up_weight must be"):
        swiglu.swiglu_mlp(x, w_gu[:15], w_d)
    with pytest.raises(ValueError, match="down_weight must be"):
        swiglu.swiglu_mlp(x, w_gu, w_d[:, :7])
    with pytest.raises(TypeError, match="dtype"):
        swiglu.swiglu_mlp(x, w_gu.half(), w_d)
    with pytest.raises(ValueError, match="gate_up_bias"):
        swiglu.swiglu_mlp(x, w_gu, w_d, gate_up_bias=torch.zeros(5))
    with pytest.raises(ValueError, match="non-empty"):
        swiglu.swiglu_mlp(x[:0], w_gu, w_d)
    with pytest.raises(ValueError):
        swiglu.rms_norm_swiglu_mlp(x, torch.ones(15), 1e-6, w_gu, w_d)


# ---------------------------------------------------------------- torch.compile
def test_torch_compile_fullgraph_no_graph_break():
    torch._dynamo.reset()
    x, w_gu, w_d, b_gu, b_d = _mlp_inputs((2, 3, 16), 12, torch.float32, True)
    w_norm = 1.0 + 0.1 * torch.randn(16, device=DEV)

    def block(x, wn, w_gu, w_d, b_gu, b_d, gate_up):
        y = swiglu.rms_norm_swiglu_mlp(x, wn, 1e-6, w_gu, w_d, b_gu, b_d)
        y = swiglu.swiglu_mlp(y[..., :16], w_gu, w_d)
        return y.sum() + swiglu.swiglu(gate_up).sum()

    gate_up = torch.randn(6, 24, device=DEV)
    inputs = [x, w_norm, w_gu, w_d, b_gu, b_d, gate_up]
    counts = torch._dynamo.utils.counters
    counts.clear()
    compiled = torch.compile(block, fullgraph=True)
    eager_leaves = [_leaf(t) for t in inputs]
    comp_leaves = [_leaf(t) for t in inputs]
    block(*eager_leaves).backward()
    compiled(*comp_leaves).backward()
    assert not counts["graph_break"], dict(counts["graph_break"])
    for e, c in zip(eager_leaves, comp_leaves):
        torch.testing.assert_close(c.grad, e.grad, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- Layers and Layouts
def _qwen3_config(**kw):
    from transformers import Qwen3Config

    return Qwen3Config(hidden_size=32, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, vocab_size=64, **kw)


def _bind(module, layer_cls):
    module.forward = types.MethodType(layer_cls.forward, module)  # what kernels.kernelize does
    return module


def test_layers_follow_kernels_rules():
    from kernels.layer.layer import _validate_layer

    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

    _validate_layer(check_cls=Qwen3MLP, cls=layers.SwiGLUMLP, repo="swiglu")
    _validate_layer(check_cls=Qwen3RMSNorm, cls=layers.RMSNormSwiGLUMLP, repo="swiglu")
    for cls in (layers.SwiGLUMLP, layers.RMSNormSwiGLUMLP):
        assert cls.has_backward and cls.can_torch_compile
    for layout in (layers.SwiGLUMLPLayout, layers.RMSNormSwiGLUMLPLayout):
        assert "forward" in layout.__dict__ and isinstance(layout.conversion_mapping, list)


def test_build_toml_parses():
    from kernels._rust import Build

    Build.open(REPO)


def _copy_mlp_into_layout(mlp, layout):
    with torch.no_grad():
        layout.gate_up_proj.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        layout.down_proj.weight.copy_(mlp.down_proj.weight)


def test_swiglu_mlp_layout_and_layer_match_hf_module():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeMLP

    torch.manual_seed(0)
    config = _qwen3_config()
    hf = Qwen3MLP(config)
    layout = layers.SwiGLUMLPLayout(config)
    assert {n for n, _ in layout.named_parameters()} == {"gate_up_proj.weight", "down_proj.weight"}
    _copy_mlp_into_layout(hf, layout)
    x = torch.randn(2, 5, 32)
    ref = hf(x)
    torch.testing.assert_close(layout(x), ref, atol=1e-5, rtol=1e-5)  # reference path
    x_k, x_r = _leaf(x), _leaf(x)
    out = _bind(layout, layers.SwiGLUMLP)(x_k)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    out.square().sum().backward()
    hf(x_r).square().sum().backward()
    torch.testing.assert_close(x_k.grad, x_r.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layout.gate_up_proj.weight.grad,
                               torch.cat([hf.gate_proj.weight.grad, hf.up_proj.weight.grad]), atol=1e-5, rtol=1e-5)
    # Qwen3MoeMLP / Qwen3_5MoeMLP signature: (config, intermediate_size)
    moe_layout = layers.SwiGLUMLPLayout(config, 12)
    assert moe_layout.gate_up_proj.weight.shape == (2 * Qwen3MoeMLP(config, 12).gate_proj.out_features, 32)


def test_llama_mlp_bias_layout():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(1)
    config = LlamaConfig(hidden_size=16, intermediate_size=20, num_attention_heads=2, mlp_bias=True)
    hf, layout = LlamaMLP(config), layers.SwiGLUMLPLayout(config)
    _copy_mlp_into_layout(hf, layout)
    with torch.no_grad():
        layout.gate_up_proj.bias.copy_(torch.cat([hf.gate_proj.bias, hf.up_proj.bias]))
        layout.down_proj.bias.copy_(hf.down_proj.bias)
    x = torch.randn(7, 16)
    torch.testing.assert_close(_bind(layout, layers.SwiGLUMLP)(x), hf(x), atol=1e-5, rtol=1e-5)


def test_fusion_layout_and_layer_match_hf_modules():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

    torch.manual_seed(2)
    config = _qwen3_config()
    norm, mlp = Qwen3RMSNorm(32, eps=1e-6), Qwen3MLP(config)
    with torch.no_grad():
        norm.weight.add_(0.2 * torch.randn(32))
    x = torch.randn(3, 4, 32)
    ref = mlp(norm(x))
    fused = layers.RMSNormSwiGLUMLPLayout(norm, mlp)  # takes over the norm weight and down_proj
    assert {n for n, _ in fused.named_parameters()} == {"weight", "gate_up_proj.weight", "down_proj.weight"}
    torch.testing.assert_close(fused(x), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_bind(fused, layers.RMSNormSwiGLUMLP)(x), ref, atol=1e-5, rtol=1e-5)


def test_fusion_refuses_a_one_to_one_mlp_layout():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    config = _qwen3_config()
    with pytest.raises(ValueError, match="cannot be combined"):
        layers.RMSNormSwiGLUMLPLayout(Qwen3RMSNorm(32), layers.SwiGLUMLPLayout(config))


def test_fusion_refuses_sparse_moe_and_other_norms():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    moe_config = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="SparseMoeBlock"):
        layers.RMSNormSwiGLUMLPLayout(Qwen3RMSNorm(32), Qwen3MoeSparseMoeBlock(moe_config))
    with pytest.raises(ValueError, match="RMSNorm"):
        layers.RMSNormSwiGLUMLPLayout(torch.nn.LayerNorm(32), Qwen3MLP(_qwen3_config()))


def test_layout_refuses_non_silu_activation():
    with pytest.raises(ValueError, match="hidden_act"):
        layers.SwiGLUMLPLayout(_qwen3_config(hidden_act="gelu"))


# ---------------------------------------------------------------- GPU, bf16, real sizes
@pytest.mark.gpu
def test_gpu_activation_bf16_real_size():
    torch.manual_seed(0)
    gate_up = torch.randn(4096, 2 * 12288, dtype=torch.bfloat16, device="cuda")
    dh = torch.randn(4096, 12288, dtype=torch.bfloat16, device="cuda")
    out, (dgu,) = _grads(swiglu.swiglu, [gate_up], dh)
    ref, (dgu_ref,) = _grads(lambda t: swiglu_hf(t.float()), [gate_up], dh.float())
    _assert_close(out, ref, torch.bfloat16, "h")
    _assert_close(dgu, dgu_ref, torch.bfloat16, "dgate_up")
    eager, (dgu_eager,) = _grads(swiglu_hf, [gate_up], dh)
    torch.testing.assert_close(out, eager, atol=1e-6, rtol=2.0 ** -7)  # same roundings as HF eager: <= 1 ulp
    assert (out != eager).float().mean() < 0.01
    torch.testing.assert_close(dgu, dgu_eager, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
def test_gpu_mlp_and_fusion_bf16_real_size():
    from hubfuse.rmsnorm.reference import rms_norm_hf

    torch.manual_seed(0)
    M, H, I = 4096, 4096, 12288
    x = torch.randn(M, H, dtype=torch.bfloat16, device="cuda")
    w_gu = torch.randn(2 * I, H, dtype=torch.bfloat16, device="cuda") * H**-0.5
    w_d = torch.randn(H, I, dtype=torch.bfloat16, device="cuda") * I**-0.5
    w_n = 1.0 + 0.1 * torch.randn(H, dtype=torch.bfloat16, device="cuda")
    dout = torch.randn(M, H, dtype=torch.bfloat16, device="cuda")
    out, grads = _grads(swiglu.swiglu_mlp, [x, w_gu, w_d], dout)
    ref, ref_grads = _grads(lambda *t: swiglu_mlp_hf(*[a.float() for a in t]), [x, w_gu, w_d], dout.float())
    _assert_close(out, ref, torch.bfloat16, "out")
    for g, r in zip(grads, ref_grads):
        _assert_close(g, r, torch.bfloat16, "grad")
    f = lambda x, wn, a, b: swiglu.rms_norm_swiglu_mlp(x, wn, 1e-6, a, b)
    r = lambda x, wn, a, b: swiglu_mlp_hf(rms_norm_hf(x.float(), wn.float(), 1e-6), a.float(), b.float())
    out, grads = _grads(f, [x, w_n, w_gu, w_d], dout)
    ref, ref_grads = _grads(r, [x, w_n, w_gu, w_d], dout.float())
    _assert_close(out, ref, torch.bfloat16, "fused out")
    for g, r_ in zip(grads, ref_grads):
        _assert_close(g, r_, torch.bfloat16, "fused grad")
    # deterministic
    _, grads2 = _grads(f, [x, w_n, w_gu, w_d], dout)
    for a, b in zip(grads, grads2):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fused_norm", [False, True])
def test_autocast_fp32_master_weights(fused_norm):
    # HF Trainer's bf16 mode: fp32 parameters, autocast casts F.linear's inputs; ours must match and give fp32
    # grads to the masters (autocast is off in the backward, where the dtypes would otherwise mismatch)
    from hubfuse.rmsnorm.reference import rms_norm_hf

    dtype = torch.bfloat16 if DEV == "cuda" else torch.float16  # bf16 math is unreliable in the interpreter
    torch.manual_seed(5)
    x, w_gu, w_d, b_gu, b_d = _mlp_inputs((2, 9, 32), 24, torch.float32, True)
    w_n = 1.0 + 0.2 * torch.randn(32, device=DEV)
    dout = torch.randn(2, 9, 35, device=DEV)

    def ours(x, wn, *mlp):
        return (swiglu.rms_norm_swiglu_mlp(x, wn, 1e-6, *mlp) if fused_norm else swiglu.swiglu_mlp(x, *mlp))

    def hf(x, wn, a, b, c, d):
        h = rms_norm_hf(x, wn, 1e-6) if fused_norm else x
        gate, up = F.linear(h, a, c).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, b, d)

    results = []
    for fn in (ours, hf):
        leaves = [_leaf(t) for t in (x, w_n, w_gu, w_d, b_gu, b_d)]
        with torch.autocast(DEV, dtype=dtype):
            out = fn(*leaves)
        out.backward(dout.to(out.dtype))
        results.append((out, [t.grad for t in leaves]))
    (out, grads), (ref, ref_grads) = results
    assert out.dtype == ref.dtype == dtype
    torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)
    for g, r in zip(grads, ref_grads):
        if r is None:
            assert g is None
            continue
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, r, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing(use_reentrant):
    # the in-place backward must be safe when the forward is recomputed (HF gradient checkpointing)
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(6)
    x, w_gu, w_d, _, _ = _mlp_inputs((2, 8, 16), 24, torch.float32, False)
    w_n = torch.rand(16, device=DEV) + 0.5

    def block(x, a, b, wn):
        return swiglu.rms_norm_swiglu_mlp(x, wn, 1e-6, a, b)

    grads = []
    for use_ckpt in (False, True):
        leaves = [_leaf(t) for t in (x, w_gu, w_d, w_n)]
        out = checkpoint(block, *leaves, use_reentrant=use_reentrant) if use_ckpt else block(*leaves)
        out.square().sum().backward()
        grads.append([t.grad for t in leaves])
    for g, r in zip(*grads):
        torch.testing.assert_close(g, r, atol=0, rtol=0)
