"""The decoder-layer node against HF's decoder layer in float64 (forward and every gradient), against hubfuse's
per-op path (bit for bit), its fallbacks, gradient checkpointing and bad configs.

CPU runs the Triton kernels under TRITON_INTERPRET=1 (set by the root conftest) and the torch path without it;
the GPU test (bf16, Qwen3-0.6B widths) is marked `gpu`.
"""
import copy

import pytest
import torch

from hubfuse.decoder_layer import layers
from hubfuse.decoder_layer.layers import DecoderLayer, DecoderLayerLayout

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FAMILIES = ("qwen3", "llama", "qwen2")
TOL = {torch.float32: 3e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}  # max |err| / max |ref|
# the dtype the node runs in here: on CUDA it calls SDPA's flash / cuDNN kernels, which take 16-bit inputs (fp32
# takes the per-op path there)
NODE_DTYPE = torch.float16 if DEV == "cuda" else torch.float32


def _config(family, hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=48):
    import transformers

    cls = {"qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig,
           "qwen2": transformers.Qwen2Config}[family]
    extra = {"llama": dict(attention_bias=True, mlp_bias=True)}.get(family, {})  # Qwen2: biased q/k/v by class
    config = cls(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                 intermediate_size=intermediate, num_hidden_layers=1, vocab_size=16, rms_norm_eps=1e-6, **extra)
    config._attn_implementation = "sdpa"
    return config


def _hf_layer(family, config):
    import transformers

    cls = {"qwen3": transformers.models.qwen3.modeling_qwen3.Qwen3DecoderLayer,
           "llama": transformers.models.llama.modeling_llama.LlamaDecoderLayer,
           "qwen2": transformers.models.qwen2.modeling_qwen2.Qwen2DecoderLayer}[family]
    return cls(config, 0)


def _rope(family, config, B, S, dtype):
    import transformers

    cls = {"qwen3": transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding,
           "llama": transformers.models.llama.modeling_llama.LlamaRotaryEmbedding,
           "qwen2": transformers.models.qwen2.modeling_qwen2.Qwen2RotaryEmbedding}[family]
    x = torch.empty(B, S, config.hidden_size, dtype=dtype, device=DEV)
    position_ids = torch.arange(S, device=DEV).expand(B, S)
    return cls(config).to(DEV)(x, position_ids)


def _ours(family, config, dtype, seed=0):
    """A DecoderLayerLayout with random weights (norm weights around 1, biases non-zero)."""
    torch.manual_seed(seed)
    layer = DecoderLayerLayout(config, 0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.3 * torch.randn_like(p))
    return layer.to(device=DEV, dtype=dtype)


def _hf_from_ours(family, config, ours):
    """HF's decoder layer in float64 with our weights (gate_up_proj split into gate_proj / up_proj)."""
    hf = _hf_layer(family, config).to(device=DEV, dtype=torch.float64)
    state = {}
    for name, p in ours.state_dict().items():
        if "gate_up_proj" in name:
            gate, up = p.double().chunk(2, dim=0)
            state[name.replace("gate_up_proj", "gate_proj")] = gate
            state[name.replace("gate_up_proj", "up_proj")] = up
        else:
            state[name] = p.double()
    hf.load_state_dict(state, strict=True)
    return hf


def _run(forward, module, x, position_embeddings, dout, **kwargs):
    """Output and the gradients of x and every parameter."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = forward(module, x, position_embeddings=position_embeddings, **kwargs)
    out.backward(dout)
    grads = {"x": x.grad, **{n: p.grad for n, p in module.named_parameters()}}
    return out.detach(), grads


def _hf_grads(hf, grads):
    """HF's gradients under our parameter names (gate / up concatenated)."""
    out = {}
    for name, g in grads.items():
        if "gate_proj" in name:
            up = grads[name.replace("gate_proj", "up_proj")]
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat([g, up])
        elif "up_proj" not in name:
            out[name] = g
    return out


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _is_block_node(t):
    return type(t.grad_fn).__name__ == "_DecoderLayerBlockBackward"


def _assert_equal(out, grads, out_other, grads_other):
    """Output and every gradient equal bit for bit."""
    assert torch.equal(out, out_other)
    assert grads.keys() == grads_other.keys()
    for name in grads:
        assert torch.equal(grads[name], grads_other[name]), name


def _per_op(monkeypatch):
    monkeypatch.setattr(layers, "_block_applies", lambda *a, **k: False)


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("B,S", [(1, 1), (2, 5), (3, 7)])
@pytest.mark.parametrize("family", FAMILIES)
def test_block_vs_float64(family, B, S, path, use_kernel_path):
    """The node (one autograd node: the output's grad_fn) against HF's decoder layer in float64: output and every
    gradient (x, norms, projections, biases, q/k norms) within the node's dtype's roundings (fp32 on CPU, fp16 on
    CUDA), or within twice HF's own layer's error in that dtype where that is larger (fp16 sums over tokens: the
    bias gradients). One token: q and k get no gradient in exact arithmetic, and the node's q/k gradients must be
    that small against the layer's largest gradient."""
    use_kernel_path(path)
    dtype = NODE_DTYPE
    config = _config(family)
    ours = _ours(family, config, dtype)
    hf = _hf_from_ours(family, config, ours)
    hf_lo = copy.deepcopy(hf).to(dtype)
    torch.manual_seed(1)
    x = torch.randn(B, S, config.hidden_size, device=DEV, dtype=dtype)
    dout = torch.randn_like(x)
    pe = _rope(family, config, B, S, dtype)
    xs = x.detach().clone().requires_grad_(True)
    assert _is_block_node(DecoderLayer.forward(ours, xs, position_embeddings=pe))
    out, grads = _run(DecoderLayer.forward, ours, x, pe, dout)
    hf_call = lambda m, x, **kw: m(x, **kw)  # noqa: E731
    pe64 = tuple(t.double() for t in pe)
    out_ref, grads_ref = _run(hf_call, hf, x.double(), pe64, dout.double())
    grads_ref = _hf_grads(hf, grads_ref)
    out_lo, grads_lo = _run(hf_call, hf_lo, x, pe, dout)
    grads_lo = _hf_grads(hf_lo, grads_lo)
    assert grads.keys() == grads_ref.keys() == grads_lo.keys()
    assert _rel(out, out_ref) <= max(TOL[dtype], 2 * _rel(out_lo, out_ref))
    largest = max(g.abs().max().item() for g in grads_ref.values())
    for name in grads:
        assert grads[name] is not None, name
        if grads_ref[name].abs().max() == 0:
            assert grads[name].abs().max().item() <= TOL[dtype] * largest, name
            continue
        err, err_hf = _rel(grads[name], grads_ref[name]), _rel(grads_lo[name], grads_ref[name])
        assert err <= max(TOL[dtype], 2 * err_hf), (name, err, err_hf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("family", FAMILIES)
def test_block_equals_per_op_path(family, path, dtype, use_kernel_path, monkeypatch):
    """The node computes the per-op path's arithmetic in its order: output and gradients equal bit for bit, in
    16-bit dtypes too, where the residual adds that the node runs inside the norm kernels must round as torch's
    adds do."""
    if path == "triton" and dtype == torch.bfloat16 and DEV == "cpu":
        pytest.skip("Triton's interpreter casts fp32 to bf16 by truncation, torch and GPUs round to nearest: bf16 on "
                    "CUDA (fp16 covers the rounding here)")
    if DEV == "cuda" and dtype == torch.float32:
        pytest.skip("on CUDA the node takes 16-bit inputs (fp32 runs the per-op path)")
    use_kernel_path(path)
    config = _config(family)
    ours = _ours(family, config, dtype)
    torch.manual_seed(2)
    x = torch.randn(2, 9, config.hidden_size, device=DEV, dtype=dtype)
    dout, pe = torch.randn_like(x), _rope(family, config, 2, 9, dtype)
    assert _is_block_node(DecoderLayer.forward(ours, x.detach().requires_grad_(), position_embeddings=pe))
    out, grads = _run(DecoderLayer.forward, ours, x, pe, dout)
    _per_op(monkeypatch)
    out_op, grads_op = _run(DecoderLayer.forward, ours, x, pe, dout)
    assert not _is_block_node(DecoderLayer.forward(ours, x, position_embeddings=pe))
    _assert_equal(out, grads, out_op, grads_op)


def test_layout_forward_is_hf_reference():
    """The Layout's own forward (the kernel not bound) is HF's decoder layer."""
    config = _config("qwen3")
    ours = _ours("qwen3", config, torch.float64)
    hf = _hf_from_ours("qwen3", config, ours)
    x = torch.randn(2, 5, config.hidden_size, device=DEV, dtype=torch.float64)
    pe = _rope("qwen3", config, 2, 5, torch.float64)
    torch.testing.assert_close(ours(x, position_embeddings=pe), hf(x, position_embeddings=pe), rtol=1e-12,
                               atol=1e-12)


def test_fallbacks_take_the_per_op_path(monkeypatch):
    """A mask, a hook on a submodule, or another attention implementation: no node, the per-op path (the hook
    runs), with the reference's results."""
    config = _config("qwen3")
    ours = _ours("qwen3", config, NODE_DTYPE)
    hf = _hf_from_ours("qwen3", config, ours)
    B, S = 2, 5
    x = torch.randn(B, S, config.hidden_size, device=DEV, dtype=NODE_DTYPE)
    pe = _rope("qwen3", config, B, S, NODE_DTYPE)
    pe64 = tuple(t.double() for t in pe)
    tol = TOL[NODE_DTYPE]
    mask = torch.zeros(B, 1, S, S, device=DEV, dtype=NODE_DTYPE).masked_fill(torch.ones(S, S, dtype=torch.bool, device=DEV).triu(1),
                                                          float("-inf"))
    out = DecoderLayer.forward(ours, x, attention_mask=mask, position_embeddings=pe)
    assert not _is_block_node(out)
    assert _rel(out, hf(x.double(), attention_mask=mask.double(), position_embeddings=pe64)) <= tol
    calls = []
    hook = ours.mlp.down_proj.register_forward_hook(lambda *_: calls.append(1))
    out = DecoderLayer.forward(ours, x.requires_grad_(), position_embeddings=pe)
    assert not _is_block_node(out) and calls == [1]
    assert _rel(out, hf(x.double(), position_embeddings=pe64)) <= tol
    hook.remove()
    ours.self_attn.config._attn_implementation = "eager"
    out = DecoderLayer.forward(ours, x, position_embeddings=pe)
    assert not _is_block_node(out)
    ours.self_attn.config._attn_implementation = "sdpa"
    assert _is_block_node(DecoderLayer.forward(ours, x, position_embeddings=pe))


def test_gradient_checkpointing_recomputes_the_node():
    """`gradient_checkpointing` (set as transformers' `gradient_checkpointing_enable` sets it): same output and
    gradients, the cache arguments dropped."""
    from torch.utils.checkpoint import checkpoint

    config = _config("qwen3")
    ours = _ours("qwen3", config, NODE_DTYPE).train()
    x = torch.randn(2, 5, config.hidden_size, device=DEV, dtype=NODE_DTYPE)
    dout, pe = torch.randn_like(x), _rope("qwen3", config, 2, 5, NODE_DTYPE)
    ours.forward = DecoderLayer.forward.__get__(ours)
    call = lambda m, x, **kw: m(x, **kw)  # noqa: E731
    out, grads = _run(call, ours, x, pe, dout)
    ours.gradient_checkpointing = True
    ours._gradient_checkpointing_func = lambda fn, *args: checkpoint(fn, *args, use_reentrant=False)
    out_ckpt, grads_ckpt = _run(call, ours, x, pe, dout, use_cache=True)
    _assert_equal(out, grads, out_ckpt, grads_ckpt)


def test_double_backward_raises():
    config = _config("qwen3")
    ours = _ours("qwen3", config, NODE_DTYPE)
    x = torch.randn(2, 5, config.hidden_size, device=DEV, dtype=NODE_DTYPE, requires_grad=True)
    out = DecoderLayer.forward(ours, x, position_embeddings=_rope("qwen3", config, 2, 5, NODE_DTYPE))
    assert _is_block_node(out)
    with pytest.raises(RuntimeError, match="decoder layer block: double backward"):
        torch.autograd.grad(out.square().sum(), x, create_graph=True)


def test_rejects_unsupported_model_type():
    import transformers

    config = transformers.Qwen3MoeConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         num_hidden_layers=1, vocab_size=16)
    with pytest.raises(ValueError, match="dense decoder layers of Qwen3, Llama and Qwen2"):
        DecoderLayerLayout(config, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", FAMILIES)
def test_block_gpu_bf16(family, monkeypatch):
    """bf16 at Qwen3-0.6B's widths (2 x 1000 tokens): the node equals the per-op path bit for bit (the gradients
    that follow SDPA's dq within a rounding: its order of additions is not fixed), and is within bf16 roundings of
    HF's layer in float64."""
    config = _config(family, hidden=1024, heads=16, kv_heads=8, head_dim=128, intermediate=3072)
    ours = _ours(family, config, torch.bfloat16)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(0.1)
    hf = _hf_from_ours(family, config, ours)
    B, S = 2, 1000
    x = torch.randn(B, S, config.hidden_size, device=DEV, dtype=torch.bfloat16)
    dout, pe = torch.randn_like(x), _rope(family, config, B, S, torch.bfloat16)
    out, grads = _run(DecoderLayer.forward, ours, x, pe, dout)
    out_ref, grads_ref = _run(lambda m, x, **kw: m(x, **kw), hf, x.double(), tuple(t.double() for t in pe),
                              dout.double())
    grads_ref = _hf_grads(hf, grads_ref)
    assert _rel(out, out_ref) <= TOL[torch.bfloat16]
    for name in grads:
        assert _rel(grads[name], grads_ref[name]) <= TOL[torch.bfloat16], (name, _rel(grads[name], grads_ref[name]))
    _per_op(monkeypatch)
    out_op, grads_op = _run(DecoderLayer.forward, ours, x, pe, dout)
    # SDPA's backward (cuDNN, flash) sums dq's fp32 partials with atomics, in an order that changes from run to run:
    # what depends on dq may differ by roundings between any two runs, of the node or of the per-op path
    after_dq = {"x", "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.q_proj.bias",
                "self_attn.q_norm.weight"}
    assert torch.equal(out, out_op)
    for name in grads:
        if name in after_dq:
            assert _rel(grads[name], grads_op[name]) <= 2**-8, (name, _rel(grads[name], grads_op[name]))
        else:
            assert torch.equal(grads[name], grads_op[name]), name
