"""Presets (`hubfuse.presets`): every family's tiny model loaded with `kernel_mapping(family)` + `enable_losses`.

Against a plain eager load of the same checkpoint: logits, loss (MoE: with `output_router_logits=True`, the aux
loss too) and every gradient, fused parameters mapped back (`gate_up_proj` = cat(gate_proj, up_proj), the
RMSNorm+MLP fusion's MLP under `post_attention_layernorm`). Then a plain load in the same process is untouched,
and every preset binds per instance: a plain model of the same class loaded before and after a kernelized one, in
float64 and float32, runs stock transformers code.
On CPU the Triton kernels run under the interpreter (root conftest sets TRITON_INTERPRET=1).
"""
import pytest
import torch

from hubfuse import presets
from tests.utils import (REVISION, load, make_batch, rope_bound, save_tiny_model, sharpen_attention,
                         tiny_config)
from tests.utils import every_kernel_registered  # noqa: F401 (autouse: every kernel repo registered)

FAMILIES = ("qwen3", "qwen3_moe", "qwen3_5_moe_text", "llama", "qwen2")
OVERRIDES = {
    "qwen3_moe": dict(output_router_logits=True, mlp_only_layers=[1]),  # layer 0 sparse, layer 1 dense MLP
    "qwen3_5_moe_text": dict(output_router_logits=True),
}
# modules bound to each kernel layer in the tiny models (2 layers; Qwen3.5: 1 linear-attention + 1 full-attention)
EXPECTED_BOUND = {
    "qwen3": {"RMSNorm": 1, "DecoderLayer": 2},
    "qwen3_moe": {"RMSNorm": 5, "QKNormRopeAttention": 2, "GroupedGemmExperts": 1, "TopKRouter": 1,
                  "SwiGLUMLP": 1},
    "qwen3_5_moe_text": {"RMSNormZeroCentered": 5, "GatedDeltaNet": 1, "SoftmaxTopKRouter": 2,
                         "GatedQKNormRopeAttention": 1, "GroupedGemmExperts": 2, "SwiGLUMLP": 2},
    "llama": {"RMSNorm": 1, "DecoderLayer": 2},
    "qwen2": {"RMSNorm": 1, "DecoderLayer": 2},
}
ROPE_HUB_FAMILIES = ("qwen3", "qwen3_moe", "llama", "qwen2")  # `apply_rotary_pos_emb` carries the hub name


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    dirs = {fam: save_tiny_model(fam, d, **OVERRIDES.get(fam, {})) for fam in FAMILIES}
    for fam in ("llama", "qwen2"):
        sharpen_attention(dirs[fam])  # no q/k norm: RoPE would not show in the logits at init scale
    return dirs


def bound_layers(model) -> dict:
    """Kernel layer name -> number of submodules whose forward kernelize bound to it (the root's own per-instance
    forward is the loss hook, not a kernel layer)."""
    counts = {}
    for name, module in model.named_modules():
        if not name:
            continue
        func = getattr(module.__dict__.get("forward"), "__func__", None)
        # kernelize binds a Layer's `forward` method; a plain function is a per-instance hook (lm_head's fused loss)
        if func is not None and func is not type(module).forward and "." in func.__qualname__:
            name = func.__qualname__.split(".")[0]
            counts[name] = counts.get(name, 0) + 1
    return counts


def _kernelized(path, family, **options):
    model = load(path, presets.kernel_mapping(family, revision=REVISION, **options)).train()
    return presets.enable_losses(model, family, revision=REVISION)


def _step(model, batch):
    """(logits without labels, loss, aux loss or None, grads by name) of one training step."""
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
    out = model(**batch)
    out.loss.backward()
    aux = getattr(out, "aux_loss", None)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits, out.loss.detach(), None if aux is None else aux.detach(), grads


# decoder_layer=False: the attention Layout and the RMSNorm + MLP fusion
EXPECTED_BOUND_MODULES = {"qwen3": {"RMSNorm": 3, "QKNormRopeAttention": 2, "RMSNormSwiGLUMLP": 2},
                          "llama": {"RMSNorm": 3, "RopeAttention": 2, "RMSNormSwiGLUMLP": 2},
                          "qwen2": {"RMSNorm": 3, "RopeAttention": 2, "RMSNormSwiGLUMLP": 2}}
# fuse_norm_mlp=False: the 1-to-1 SwiGLUMLP Layout (decoder layer class kept) and RMSNorm on every norm
EXPECTED_BOUND_UNFUSED = {"qwen3": {"RMSNorm": 5, "QKNormRopeAttention": 2, "SwiGLUMLP": 2},
                          "llama": {"RMSNorm": 5, "RopeAttention": 2, "SwiGLUMLP": 2}}


@pytest.mark.parametrize("family", FAMILIES)
def test_preset_parity_with_eager(family, model_dirs):
    _check_parity(family, model_dirs[family], EXPECTED_BOUND[family])


@pytest.mark.parametrize("family", list(EXPECTED_BOUND_MODULES))
def test_per_module_preset_parity_with_eager(family, model_dirs):
    ours = _check_parity(family, model_dirs[family], EXPECTED_BOUND_MODULES[family], decoder_layer=False)
    assert not any(type(m).__name__ == "DecoderLayerLayout" for m in ours.modules())


@pytest.mark.parametrize("family", list(EXPECTED_BOUND_UNFUSED))
def test_unfused_mlp_preset_parity_with_eager(family, model_dirs):
    ours = _check_parity(family, model_dirs[family], EXPECTED_BOUND_UNFUSED[family], fuse_norm_mlp=False)
    assert not any(type(m).__name__.startswith("Fused") for m in ours.modules())


def _check_parity(family, path, expected_bound, **options):
    batch = make_batch(tiny_config(family).vocab_size, seq=9)
    eager = load(path).train()
    logits_e, loss_e, aux_e, grads_e = _step(eager, batch)
    ours = _kernelized(path, family, **options)
    assert bound_layers(ours) == expected_bound
    if family in ROPE_HUB_FAMILIES:  # attention Layouts: the module-global RoPE function is left alone
        assert not rope_bound(family)
    logits_o, loss_o, aux_o, grads_o = _step(ours, batch)
    tol = dict(atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(logits_o, logits_e, **tol)
    torch.testing.assert_close(loss_o, loss_e, **tol)
    if family in ("qwen3_moe", "qwen3_5_moe_text"):
        assert aux_e is not None and aux_o is not None
        torch.testing.assert_close(aux_o, aux_e, **tol)
    else:
        assert aux_e is None and aux_o is None
    # every parameter has a grad in both, and each kernelized grad equals the mapped eager one
    assert len(grads_e) == sum(1 for _ in eager.parameters())
    assert len(grads_o) == sum(1 for _ in ours.parameters())
    want = presets.eager_to_kernelized(grads_e, list(grads_o))
    for name in grads_o:
        torch.testing.assert_close(grads_o[name], want[name], **tol, msg=lambda m: f"{name}: {m}")
    return ours


def test_fused_losses_are_on(model_dirs):
    ours = _kernelized(model_dirs["qwen3_moe"], "qwen3_moe")
    out = ours(**make_batch(tiny_config("qwen3_moe").vocab_size))
    assert out.logits is None  # the loss came from the hidden states (fused linear cross-entropy)
    assert "load_balancing_loss" in type(out.aux_loss.grad_fn).__name__
    presets.disable_losses(ours, "qwen3_moe", revision=REVISION)
    assert "forward" not in ours.__dict__
    assert ours(**make_batch(tiny_config("qwen3_moe").vocab_size)).logits is not None


def test_later_plain_load_is_untouched(model_dirs):
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.monkey_patching import get_patch_mapping

    before_patches = get_patch_mapping()
    before_conv = {f: repr(get_checkpoint_conversion_mapping(f)) for f in FAMILIES}
    plain_types = {f: {type(m).__name__ for m in load(model_dirs[f]).modules()} for f in FAMILIES}
    kernelized = {}
    for family in FAMILIES:
        kernelized[family] = _kernelized(model_dirs[family], family)
        kernelized[family](**make_batch(tiny_config(family).vocab_size))
    assert get_patch_mapping() == before_patches
    assert {f: repr(get_checkpoint_conversion_mapping(f)) for f in FAMILIES} == before_conv
    assert not any(rope_bound(f) for f in ROPE_HUB_FAMILIES)  # Layouts are per instance
    for family in FAMILIES:
        plain = load(model_dirs[family]).train()
        types = {type(m).__name__ for m in plain.modules()}
        assert types == plain_types[family], types ^ plain_types[family]
        assert not any(t.endswith("Layout") or t.startswith("Fused") for t in types)
        assert not any("forward" in m.__dict__ for m in plain.modules()), family  # nothing kernel-bound
        out = plain(**make_batch(tiny_config(family).vocab_size))
        assert out.logits is not None  # HF's loss path, not the fused one
        if family in ("qwen3_moe", "qwen3_5_moe_text"):
            assert out.aux_loss is not None and out.aux_loss.grad_fn is not None
            assert "load_balancing_loss" not in type(out.aux_loss.grad_fn).__name__
    # the kernelized instances still run their kernels
    for family, model in kernelized.items():
        assert bound_layers(model) == EXPECTED_BOUND[family]


def _stock_step(model, batch):
    """Logits, loss and every gradient of one forward + backward."""
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return [out.logits.detach(), out.loss.detach()] + [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_models_beside_a_kernelized_one_run_stock_code(family, model_dirs):
    """Every preset binds per instance: plain models of the same class, loaded before and after a kernelized one in
    the same process, in float64 and float32, run stock transformers code: logits, loss and gradients bitwise equal
    to those of the plain model run before anything was kernelized. (The Llama / Qwen2 presets used to bind the
    RoPE kernel to the family's module-global `apply_rotary_pos_emb`: a later plain Llama in float64 raised.)"""
    path, dtypes = model_dirs[family], (torch.float64, torch.float32)
    # HF's default experts (torch grouped_mm) take no float64 on CPU: its eager experts do
    stock = dict(experts_implementation="eager") if family in ("qwen3_moe", "qwen3_5_moe_text") else {}
    batch = make_batch(tiny_config(family).vocab_size, seq=9)
    before = {dtype: load(path, dtype=dtype, **stock) for dtype in dtypes}
    reference = {dtype: _stock_step(before[dtype], batch) for dtype in dtypes}
    ours = _kernelized(path, family)
    ours(**batch).loss.backward()
    assert bound_layers(ours) == EXPECTED_BOUND[family]
    after = {dtype: load(path, dtype=dtype, **stock) for dtype in dtypes}
    for dtype in dtypes:
        for when, plain in (("before", before[dtype]), ("after", after[dtype])):
            assert not any("forward" in m.__dict__ for m in plain.modules()), (when, dtype)
            assert not any(type(m).__name__.endswith("Layout") for m in plain.modules()), (when, dtype)
            for got, want in zip(_stock_step(plain, batch), reference[dtype], strict=True):
                torch.testing.assert_close(got, want, atol=0, rtol=0, msg=lambda m: f"{when} {dtype}: {m}")


def test_preset_names_and_options(monkeypatch):
    # local builds (LOCAL_KERNELS, set by the module fixture) get revision "v1", the hub version 1
    assert presets.kernel_mapping("qwen3")["^Qwen3DecoderLayer$"] == \
        ("hubfuse/decoder-layer:DecoderLayer", {"revision": "v1"})
    assert presets.kernel_mapping("qwen3", version=1)["^Qwen3DecoderLayer$"][1] == {"version": 1}
    monkeypatch.delenv("LOCAL_KERNELS")
    m = presets.kernel_mapping("qwen3")
    assert m["^Qwen3DecoderLayer$"] == ("hubfuse/decoder-layer:DecoderLayer", {"version": 1})
    assert set(m) == {"^Qwen3RMSNorm$", "^Qwen3DecoderLayer$"}
    assert presets.kernel_mapping("qwen3", trust_remote_code=True)["^Qwen3DecoderLayer$"][1] == \
        {"version": 1, "trust_remote_code": True}
    modules = presets.kernel_mapping("qwen3", decoder_layer=False)
    assert modules["^Qwen3Attention$"] == ("hubfuse/rotary:QKNormRopeAttention", {"version": 1})
    assert presets.FUSION_KEY in modules and "^Qwen3DecoderLayer$" not in modules
    assert presets.kernel_mapping("qwen3_5_moe") == presets.kernel_mapping("qwen3_5_moe_text")
    assert presets.kernel_mapping("llama")["^LlamaDecoderLayer$"][0] == "hubfuse/decoder-layer:DecoderLayer"
    assert presets.kernel_mapping("llama", decoder_layer=False)["^LlamaAttention$"][0] == \
        "hubfuse/rotary:RopeAttention"
    assert not any("rotary_pos_emb" in presets.kernel_mapping(f) for f in FAMILIES)  # nothing process-wide
    assert presets.FUSION_KEY in presets.kernel_mapping("qwen2", decoder_layer=False)
    assert presets.kernel_mapping("qwen3_5_moe")["^Qwen3_5MoeGatedDeltaNet$"] == \
        ("hubfuse/gated-delta-net:GatedDeltaNet", {"version": 1})
    assert "gated-delta-net" in presets.kernel_repos("qwen3_5_moe")
    assert "gated-delta-net" not in presets.kernel_repos("qwen3_moe")
    assert {"decoder-layer", "rotary", "swiglu", "rmsnorm"} <= set(presets.kernel_repos("qwen3"))
    unfused = presets.kernel_mapping("qwen2", fuse_norm_mlp=False)
    assert presets.FUSION_KEY not in unfused and unfused["^Qwen2MLP$"][0] == "hubfuse/swiglu:SwiGLUMLP"
    assert "^Qwen2DecoderLayer$" not in unfused
    assert presets.kernel_mapping("qwen2", org="me", revision="main")["^Qwen2RMSNorm$"] == \
        ("me/rmsnorm:RMSNorm", {"revision": "main"})
    for family in FAMILIES:  # anchored class regexes, or hub names of kernels without a Layout
        for options in ({}, {"decoder_layer": False}):
            for key in presets.kernel_mapping(family, **options):
                assert isinstance(key, tuple) or key.startswith("^") and key.endswith("$") or \
                    key == "SoftmaxTopKRouter", key
    with pytest.raises(ValueError, match="hubfuse has no kernels for model family 'mistral'; supported model "
                                         "types: qwen3, qwen3_moe, qwen3_5_moe, llama, qwen2"):
        presets.kernel_mapping("mistral")
