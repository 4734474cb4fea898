"""The nine bad-input cases of issue 26 that once gave a silent wrong result (a wrong number or a missing
gradient), as regression tests: each now gives torch's float64 result, forward and backward, or a clear error.

Kernel cases run on both CPU paths: the torch reference ("ref", TRITON_INTERPRET=0) and the Triton kernels
under the interpreter ("interp"). The failed-load case runs whole kernelized `from_pretrained` loads.
"""
import pytest
import torch
import torch.nn.functional as F

import hubfuse.cross_entropy as cross_entropy
import hubfuse.moe as moe
import hubfuse.rmsnorm as rmsnorm
import hubfuse.rotary as rotary
import hubfuse.swiglu as swiglu

DOUBLE_BACKWARD = "double backward is not supported"


@pytest.fixture(params=["ref", "interp"])
def path(request, monkeypatch, triton_interpreter):
    if request.param == "interp":
        triton_interpreter()
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    return request.param


def _leaf(t):
    return t.detach().clone().requires_grad_()


def _close(actual, expected, what, tol=2e-5):
    assert actual is not None, f"{what}: no gradient"
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")


# ------------------------------------------------------------------ 1-3: cross-entropy layouts and shapes

def _ce_layer(logits, labels):
    return cross_entropy.layers.CrossEntropyLoss.forward(torch.nn.CrossEntropyLoss(), logits, labels)


@pytest.mark.parametrize("caller", ["function", "layer"])
@pytest.mark.parametrize("layout", ["transposed", "column_major"])
def test_case1_cross_entropy_logits_with_non_unit_column_stride(path, caller, layout):
    torch.manual_seed(1)
    storage = torch.randn(11, 5)
    leaf = _leaf(storage)  # the logits are a transposed view of it: (5, 11), or (11, 5) stored column-major
    view = (lambda s: s.t()) if layout == "transposed" else (lambda s: s.t().contiguous().t())
    labels = torch.randint(0, view(storage).shape[-1], (view(storage).shape[0],))
    fn = (lambda x, y: cross_entropy.cross_entropy(x, y, inplace=False)) if caller == "function" else _ce_layer
    loss = fn(view(leaf), labels)
    loss.backward()
    leaf64 = _leaf(storage.double())
    loss64 = F.cross_entropy(view(leaf64), labels)
    loss64.backward()
    _close(loss, loss64, "loss")
    _close(leaf.grad, leaf64.grad, "dlogits")


def test_case2_cross_entropy_expanded_logits(path):
    torch.manual_seed(2)
    column = torch.randn(5, 1)
    labels = torch.randint(0, 7, (5,))
    leaf, leaf64 = _leaf(column), _leaf(column.double())
    loss = cross_entropy.cross_entropy(leaf.expand(5, 7), labels, inplace=False)
    loss.backward()
    loss64 = F.cross_entropy(leaf64.expand(5, 7), labels)
    loss64.backward()
    _close(loss, loss64, "loss")
    _close(leaf.grad, leaf64.grad, "dlogits")
    # without a gradient (read only) the expanded rows are read in place
    with torch.no_grad():
        _close(cross_entropy.cross_entropy(column.expand(5, 7), labels), loss64, "loss (no grad)")


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("module", ["layer", "layout"])
def test_case3_cross_entropy_loss_classes_on_dim_1(path, module, reduction):
    torch.manual_seed(3)
    x = torch.randn(3, 4, 4)  # (N, C, d1) with C == d1: the class dim must be dim 1, as in torch
    target = torch.randint(0, 4, (3, 4))
    host = torch.nn.CrossEntropyLoss(reduction=reduction)
    leaf, leaf64 = _leaf(x), _leaf(x.double())
    if module == "layer":
        loss = cross_entropy.layers.CrossEntropyLoss.forward(host, leaf, target)
    else:
        loss = cross_entropy.layers.CrossEntropyLossLayout(reduction=reduction)(leaf, target)
    loss64 = host(leaf64, target)
    g = torch.randn(loss64.shape, dtype=torch.float64)
    (loss * g).sum().backward()
    (loss64 * g).sum().backward()
    _close(loss, loss64, "loss")
    _close(leaf.grad, leaf64.grad, "dinput")
    with pytest.raises(ValueError, match=r"target shape \(3, 4\) does not match input \(3, 5, 6\)"):
        cross_entropy.layers.CrossEntropyLoss.forward(host, torch.randn(3, 5, 6), target)


# ------------------------------------------------------------------ 4-6: double backward raises

def _double_backward(fn, *inputs):
    """create_graph=True through fn, then the gradient of the gradient."""
    out = fn(*inputs)
    (g,) = torch.autograd.grad(out.sum(), inputs[0], create_graph=True)
    return torch.autograd.grad(g.pow(2).sum(), inputs, allow_unused=True)


def test_case4_swiglu_mlp_double_backward_raises(path):
    torch.manual_seed(4)
    x, wgu, wd = _leaf(torch.randn(3, 8)), _leaf(torch.randn(10, 8)), _leaf(torch.randn(8, 5))
    with pytest.raises(RuntimeError, match=f"swiglu_mlp: {DOUBLE_BACKWARD}"):
        _double_backward(swiglu.swiglu_mlp, x, wgu, wd)
    with pytest.raises(RuntimeError, match=f"swiglu: {DOUBLE_BACKWARD}"):
        _double_backward(swiglu.swiglu, _leaf(torch.randn(3, 10)))


def test_case5_rms_norm_double_backward_raises(path):
    torch.manual_seed(5)
    for fn in (rmsnorm.rms_norm, rmsnorm.rms_norm_zero_centered):
        with pytest.raises(RuntimeError, match=f"rms_norm: {DOUBLE_BACKWARD}"):
            _double_backward(fn, _leaf(torch.randn(3, 8)), _leaf(torch.randn(8)))
    with pytest.raises(RuntimeError, match=f"rms_norm: {DOUBLE_BACKWARD}"):
        _double_backward(lambda x, g, w: rmsnorm.rms_norm_gated(x, g, w), _leaf(torch.randn(3, 8)),
                         _leaf(torch.randn(3, 8)), _leaf(torch.randn(8)))


def test_case6_cross_entropy_double_backward_raises(path):
    torch.manual_seed(6)
    labels = torch.tensor([1, 2, 3])
    with pytest.raises(RuntimeError, match=f"cross_entropy: {DOUBLE_BACKWARD}"):
        _double_backward(lambda x: cross_entropy.cross_entropy(torch.tanh(x), labels, inplace=False),
                         _leaf(torch.randn(3, 8)))
    with pytest.raises(RuntimeError, match=f"linear_cross_entropy: {DOUBLE_BACKWARD}"):
        _double_backward(lambda h, w: cross_entropy.linear_cross_entropy(h, w, labels), _leaf(torch.randn(3, 8)),
                         _leaf(torch.randn(6, 8)))
    with pytest.raises(RuntimeError, match=f"linear_cross_entropy: {DOUBLE_BACKWARD}"):
        _double_backward(lambda h, w: cross_entropy.linear_cross_entropy(h, w, labels, reduction="none"),
                         _leaf(torch.randn(3, 8)), _leaf(torch.randn(6, 8)))


def _other_first_order_ops():
    import hubfuse.load_balancing_loss as lbl

    q, k, cos, sin = (torch.randn(2, 3, 5, 8), torch.randn(2, 1, 5, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 8))
    E = 4
    moe_args = (torch.randn(5, 8), torch.randint(0, E, (5, 2)), torch.rand(5, 2), torch.randn(E, 12, 8),
                torch.randn(E, 8, 6))
    return {
        "moe_experts": (lambda h: moe.moe_experts(h, *moe_args[1:]), moe_args[0]),
        "apply_rotary_pos_emb": (lambda x: rotary.apply_rotary_pos_emb(x, k, cos, sin)[0], q),
        "apply_rotary_pos_emb_flat": (lambda x: rotary.apply_rotary_pos_emb_flat(x, k, cos, sin), q),
        "apply_rotary_pos_emb_": (lambda x: rotary.apply_rotary_pos_emb_(x * 1, k.clone(), cos, sin)[0], q),
        "qk_norm_rope": (lambda x: rotary.qk_norm_rope(x, k.transpose(1, 2), torch.randn(8), torch.randn(8), cos,
                                                      sin)[0], q.transpose(1, 2)),
        "load_balancing_loss": (lambda x: lbl.load_balancing_loss([x, x * 2], 6, 2), torch.randn(7, 6)),
        "softmax_topk": (lambda x: lbl.softmax_topk(x, 2)[0], torch.randn(7, 6)),
    }


@pytest.mark.parametrize("op", ["moe_experts", "apply_rotary_pos_emb", "apply_rotary_pos_emb_flat",
                                "apply_rotary_pos_emb_", "qk_norm_rope", "load_balancing_loss", "softmax_topk"])
def test_double_backward_raises_in_every_fused_backward(path, op):
    torch.manual_seed(9)
    fn, x = _other_first_order_ops()[op]
    with pytest.raises(RuntimeError, match=f"{op.rstrip('_')}_?: {DOUBLE_BACKWARD}"):
        _double_backward(fn, _leaf(x))


def test_double_backward_under_compile_raises():
    # torch.compile's autograd refuses double backward with its own clear error
    torch._dynamo.reset()
    x, w = _leaf(torch.randn(3, 8)), _leaf(torch.randn(8))
    fn = torch.compile(rmsnorm.rms_norm, backend="aot_eager", fullgraph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        _double_backward(fn, x, w)


# ------------------------------------------------------------------ 7: RoPE cos / sin gradients

def _rope_case(head_dim=8, rotary_dim=8):
    torch.manual_seed(7)
    q, k = torch.randn(2, 3, 5, head_dim), torch.randn(2, 1, 5, head_dim)
    cos, sin = torch.randn(2, 5, rotary_dim), torch.randn(2, 5, rotary_dim)
    return q, k, cos, sin


def _check_rope_grads(fn, reference, inputs):
    ours = [_leaf(t) for t in inputs]
    ref = [_leaf(t.double()) for t in inputs]
    out, out64 = fn(*ours), reference(*ref)
    out, out64 = (out if isinstance(out, tuple) else (out,)), (out64 if isinstance(out64, tuple) else (out64,))
    gs = [torch.randn(o.shape, dtype=torch.float64) for o in out64]
    sum((o * g).sum() for o, g in zip(out, gs)).backward()
    sum((o * g).sum() for o, g in zip(out64, gs)).backward()
    for o, o64 in zip(out, out64):
        _close(o, o64, "output")
    for name, a, b in zip(("q", "k", "cos", "sin", "x5", "x6"), ours, ref):
        _close(a.grad, b.grad, f"d{name}", tol=5e-5)


@pytest.mark.parametrize("rotary_dim", [8, 4])
@pytest.mark.parametrize("variant", ["apply_rotary_pos_emb", "apply_rotary_pos_emb_flat", "RotaryPosEmb"])
def test_case7_rope_cos_sin_grads(path, variant, rotary_dim):
    hf = rotary.apply_rotary_pos_emb_hf
    if variant == "apply_rotary_pos_emb":
        fn, ref = rotary.apply_rotary_pos_emb, hf
    elif variant == "apply_rotary_pos_emb_flat":
        fn = rotary.apply_rotary_pos_emb_flat
        ref = lambda *a: torch.cat([t.reshape(-1) for t in hf(*a)])  # noqa: E731
    else:
        fn, ref = (lambda *a: rotary.layers.RotaryPosEmb()(*a)), hf
    _check_rope_grads(fn, ref, _rope_case(8, rotary_dim))


@pytest.mark.parametrize("variant", ["qk_norm_rope", "qk_norm_rope_zero_centered", "qk_norm_rope_flat"])
def test_case7_qk_norm_rope_cos_sin_grads(path, variant):
    from hubfuse.rotary.reference import STANDARD, ZERO_CENTERED

    torch.manual_seed(7)
    q, k = torch.randn(2, 5, 3, 8), torch.randn(2, 5, 1, 8)
    qw, kw = torch.randn(8), torch.randn(8)
    cos, sin = torch.randn(1, 5, 4), torch.randn(1, 5, 4)
    mode = ZERO_CENTERED if variant == "qk_norm_rope_zero_centered" else STANDARD
    ref = lambda *a: rotary.qk_norm_rope_hf(*a, 1e-6, mode)  # noqa: E731
    if variant == "qk_norm_rope_flat":
        fn = rotary.qk_norm_rope_flat
        ref = lambda *a: torch.cat([t.reshape(-1) for t in rotary.qk_norm_rope_hf(*a, 1e-6, mode)])  # noqa: E731
    else:
        fn = getattr(rotary, variant)
    _check_rope_grads(fn, ref, (q, k, qw, kw, cos, sin))


def test_case7_inplace_rope_refuses_cos_sin_grads(path):
    q, k, cos, sin = _rope_case()
    with pytest.raises(ValueError, match="apply_rotary_pos_emb_: cos and sin require grad"):
        rotary.apply_rotary_pos_emb_(q.clone(), k.clone(), _leaf(cos), sin)
    with torch.no_grad():  # no gradient needed: in place as before
        q2, k2 = rotary.apply_rotary_pos_emb_(q.clone(), k.clone(), _leaf(cos), _leaf(sin))
    for a, b in zip((q2, k2), rotary.apply_rotary_pos_emb_hf(q, k, cos, sin)):
        _close(a, b, "rotated")


# ------------------------------------------------------------------ 8: MoE expert ids under torch.compile

@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("bad_id", [-1, 5])
def test_case8_moe_expert_ids_out_of_range_under_compile(path, backend, bad_id):
    torch.manual_seed(8)
    E = 4
    hidden, weights = torch.randn(5, 8), torch.rand(5, 2)
    gate_up, down = torch.randn(E, 12, 8), torch.randn(E, 8, 6)
    index = torch.randint(0, E, (5, 2))
    torch._dynamo.reset()
    fn = torch.compile(moe.moe_experts, backend=backend, fullgraph=True)
    torch.testing.assert_close(fn(hidden, index, weights, gate_up, down),
                               moe.experts_hf(hidden, index, weights, gate_up, down), atol=1e-4, rtol=1e-4)
    bad = index.clone()
    bad[3, 1] = bad_id
    for call in (fn, moe.moe_experts):
        with pytest.raises(ValueError, match=rf"top_k_index values must be in \[0, 4\) or equal 4.*found {bad_id}"):
            call(hidden, bad, weights, gate_up, down)
    # the expert-parallel sentinel E is valid: that slot contributes nothing, as in HF's loop
    skip = index.clone()
    skip[3, 1] = E
    torch.testing.assert_close(fn(hidden, skip, weights, gate_up, down),
                               moe.experts_hf(hidden, skip, weights, gate_up, down), atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------ 9: a failed kernelized load


def _global_state():
    """Everything a kernelized load changes in transformers, in comparable form."""
    import sys

    from transformers import conversion_mapping
    from transformers.monkey_patching import get_patch_mapping
    from transformers.utils.output_capturing import OutputRecorder

    recorders = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("transformers.models.") or module is None:
            continue
        for attr, obj in list(vars(module).items()):
            rec = obj.__dict__.get("_can_record_outputs") if isinstance(obj, type) else None
            if isinstance(rec, dict):
                recorders[f"{name}.{attr}"] = {
                    key: [(r.target_class, r.index, r.layer_name) if isinstance(r, OutputRecorder) else r
                          for r in (value if isinstance(value, list) else [value])]
                    for key, value in rec.items()}
    classes = {(name, attr): obj for name, module in list(sys.modules.items())
               if name.startswith("transformers.models.") and module is not None
               for attr, obj in list(vars(module).items()) if isinstance(obj, type)}
    conversions = {k: repr(v) for k, v in conversion_mapping._checkpoint_conversion_mapping_cache.items()}
    return dict(patches=dict(get_patch_mapping()), conversions=conversions,
                user=set(conversion_mapping.USER_REGISTERED_MAPPINGS), recorders=recorders, classes=classes)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tests.utils import register_local_kernels, save_tiny_model

    register_local_kernels("rmsnorm", "swiglu", "load-balancing-loss")
    d = tmp_path_factory.mktemp("bad_loads")
    return {
        "qwen3": save_tiny_model("qwen3", d / "ok"),
        "qwen3_big": save_tiny_model("qwen3", d / "big", intermediate_size=100),
        "qwen3_moe": save_tiny_model("qwen3_moe", d / "ok"),
        "qwen3_moe_big": save_tiny_model("qwen3_moe", d / "big", hidden_size=72),
    }


def _failing_load(trigger, checkpoints):
    """(mapping, checkpoint, config or None) of a kernelized load that raises half-way."""
    from transformers import AutoConfig

    from tests.utils import hub

    if trigger == "unbuildable_layout":  # an RMSNorm Layout cannot be built from Qwen3MLP's arguments
        return {"^Qwen3MLP$": hub("rmsnorm", "RMSNorm")}, checkpoints["qwen3"], None
    if trigger == "missing_layer":  # a valid Layout entry registered first, then a layer the repo lacks
        return ({"^Qwen3RMSNorm$": hub("rmsnorm", "RMSNorm"), "^Qwen3MLP$": hub("swiglu", "NoSuchLayer")},
                checkpoints["qwen3"], None)
    if trigger == "size_mismatch":  # the model is built (Layouts, conversions), then the checkpoint does not fit
        return ({"^Qwen3MLP$": hub("swiglu", "SwiGLUMLP")}, checkpoints["qwen3_big"],
                AutoConfig.from_pretrained(checkpoints["qwen3"]))
    # a size mismatch after the router Layout patched the model's output recorders
    return ({"^Qwen3MoeTopKRouter$": hub("load-balancing-loss", "TopKRouter")}, checkpoints["qwen3_moe_big"],
            AutoConfig.from_pretrained(checkpoints["qwen3_moe"]))


@pytest.mark.parametrize("trigger", ["unbuildable_layout", "missing_layer", "size_mismatch",
                                     "size_mismatch_after_recorders"])
def test_case9_failed_load_restores_global_state(trigger, checkpoints):
    """A load that fails while registering or building the model is undone before the exception reaches the caller.
    One that fails later, reading the checkpoint, is undone when the next kernelized load starts (transformers
    gives no control back after a failure), or at once inside `hubfuse.restore_global_state()`."""
    from transformers import AutoModelForCausalLM

    from hubfuse import KernelConfig
    from tests.utils import modules_running

    mapping, path, config = _failing_load(trigger, checkpoints)
    kernel_config = KernelConfig(mapping)
    kwargs = {} if config is None else {"config": config}
    family = "qwen3_moe" if trigger == "size_mismatch_after_recorders" else "qwen3"
    before = _global_state()
    with pytest.raises((TypeError, ValueError, RuntimeError)):
        AutoModelForCausalLM.from_pretrained(path, use_kernels=True, kernel_config=kernel_config, **kwargs)
    if trigger.startswith("size_mismatch"):
        # the next kernelized load (here: the same config object, on a checkpoint that fits) restores first
        ours = AutoModelForCausalLM.from_pretrained(checkpoints[family], use_kernels=True, kernel_config=kernel_config)
        assert len(modules_running(ours, "SwiGLUMLP" if family == "qwen3" else "TopKRouter")) == 2
    after = _global_state()
    for key in before:
        assert after[key] == before[key], f"{trigger}: {key} left changed"
    plain = AutoModelForCausalLM.from_pretrained(checkpoints[family])
    assert not any(type(m).__name__.endswith("Layout") for m in plain.modules())


@pytest.mark.parametrize("trigger", ["size_mismatch", "size_mismatch_after_recorders"])
def test_case9_checkpoint_failure_inside_restore_global_state(trigger, checkpoints):
    from transformers import AutoModelForCausalLM

    from hubfuse import KernelConfig, restore_global_state

    mapping, path, config = _failing_load(trigger, checkpoints)
    before = _global_state()
    with restore_global_state(), pytest.raises((TypeError, ValueError, RuntimeError)):
        AutoModelForCausalLM.from_pretrained(path, use_kernels=True, kernel_config=KernelConfig(mapping), config=config)
    after = _global_state()
    for key in before:
        assert after[key] == before[key], f"{trigger}: {key} left changed"
    family = "qwen3_moe" if trigger == "size_mismatch_after_recorders" else "qwen3"
    plain = AutoModelForCausalLM.from_pretrained(checkpoints[family])
    assert not any(type(m).__name__.endswith("Layout") for m in plain.modules())
