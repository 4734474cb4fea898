"""Whole-model tests of hubfuse/load-balancing-loss through transformers (tiny Qwen3-MoE and Qwen3.5-MoE):

- the fused router via KernelConfig (`TopKRouter` + Layout for `^Qwen3MoeTopKRouter$`, the hub name
  `SoftmaxTopKRouter` for Qwen3.5-MoE): training-mode logits, loss with the aux loss, every grad vs eager;
- the per-instance fused aux loss (`enable_fused_aux_loss`): aux loss, loss and grads vs eager, with padding;
  other instances, the class and the modeling module untouched; disable restores;
- composition with the fused cross-entropy hook when that repo is present;
- save/load round trip and torch.compile(fullgraph=True).
On CPU the kernels run under TRITON_INTERPRET=1 (root conftest).
"""
import threading

import pytest
import torch

from tests.utils import assert_compiled_parity, assert_parity, assert_same_weights_and_logits, hub, load, make_batch, \
    modules_running, register_local_kernels, save_tiny_model, ROOT

REPO = "load-balancing-loss"
ROUTER = {"qwen3_moe": ("^Qwen3MoeTopKRouter$", "TopKRouter"),
          "qwen3_5_moe_text": ("SoftmaxTopKRouter", "SoftmaxTopKRouter")}


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    register_local_kernels(REPO)


def _kernel():
    from kernels import get_kernel

    return get_kernel(f"hubfuse/{REPO}", revision="v1")


def _router_mapping(family):
    key, layer = ROUTER[family]
    return {key: hub(REPO, layer)}


def _batch(model, device="cpu", padded=True):
    batch = make_batch(model.config.vocab_size, device=device)
    batch["output_router_logits"] = True
    if padded:  # left padding on the first row: the aux loss's attention-mask weighting is exercised
        mask = torch.ones_like(batch["input_ids"])
        mask[0, :3] = 0
        batch["attention_mask"] = mask
        batch["labels"] = batch["labels"].masked_fill(mask == 0, -100)
    return batch


def _modeling_module(model):
    import sys

    return sys.modules[type(model).__module__]


@pytest.mark.parametrize("family", list(ROUTER))
def test_router_kernel_parity_training(family, tmp_path):
    path = save_tiny_model(family, tmp_path)
    eager = load(path).train()
    ours = load(path, _router_mapping(family)).train()
    running = modules_running(ours, ROUTER[family][1])
    assert len(running) == ours.config.num_hidden_layers, running
    batch = _batch(eager)
    out = ours(**batch)
    assert out.aux_loss is not None and len(out.router_logits) == ours.config.num_hidden_layers
    torch.testing.assert_close(out.aux_loss, eager(**batch).aux_loss, rtol=1e-6, atol=1e-7)
    assert_parity(eager, ours, batch)
    plain = load(path)  # a later plain load is unaffected
    assert not modules_running(plain, ROUTER[family][1])


@pytest.mark.parametrize("family", list(ROUTER))
@pytest.mark.parametrize("padded", [False, True])
def test_fused_aux_loss_parity(family, padded, tmp_path):
    lbl = _kernel()
    path = save_tiny_model(family, tmp_path)
    eager = load(path).train()
    ours = load(path).train()
    module = _modeling_module(ours)
    hf_fn, class_forward = module.load_balancing_loss_func, type(ours).forward
    lbl.enable_fused_aux_loss(ours)
    assert lbl.fused_aux_loss_enabled(ours) and not lbl.fused_aux_loss_enabled(eager)
    # nothing global changed: the modeling module, the class, the other instance
    assert module.load_balancing_loss_func is hf_fn and type(ours).forward is class_forward
    assert "forward" not in eager.__dict__
    batch = _batch(eager, padded=padded)
    out = ours(**batch)
    ref = eager(**batch)
    assert out.aux_loss is not None and out.aux_loss.dtype == torch.float32
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=1e-6, atol=1e-7)
    assert_parity(eager, ours, batch)
    # the aux loss really comes from the fused op: its grad_fn is the custom op's backward
    assert "load_balancing_loss_fwd" in type(out.aux_loss.grad_fn).__name__ or \
        "Generated" in type(out.aux_loss.grad_fn).__name__, type(out.aux_loss.grad_fn)
    assert type(ref.aux_loss.grad_fn).__name__ == "MulBackward0"
    # tuple outputs still work (HF's can_return_tuple decorator)
    assert isinstance(ours(**batch, return_dict=False), tuple)
    lbl.disable_fused_aux_loss(ours)
    assert "forward" not in ours.__dict__ and not lbl.fused_aux_loss_enabled(ours)
    assert type(ours(**batch).aux_loss.grad_fn).__name__ == "MulBackward0"


def test_fused_aux_loss_threads(tmp_path):
    """Two instances of one architecture, one fused, one not, running concurrently: each keeps its own."""
    lbl = _kernel()
    path = save_tiny_model("qwen3_moe", tmp_path)
    plain, fused = load(path), lbl.enable_fused_aux_loss(load(path))
    batch = _batch(plain)
    kinds = {}

    def run(name, model):
        for _ in range(3):
            kinds.setdefault(name, set()).add(type(model(**batch).aux_loss.grad_fn).__name__)

    threads = [threading.Thread(target=run, args=("plain", plain)), threading.Thread(target=run, args=("fused", fused))]
    with torch.enable_grad():
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert kinds["plain"] == {"MulBackward0"}
    assert "MulBackward0" not in kinds["fused"]


def test_enable_refuses_foreign_forward_and_non_moe(tmp_path):
    lbl = _kernel()
    path = save_tiny_model("qwen3_moe", tmp_path)
    model = load(path)
    model.forward = lambda *a, **k: None
    with pytest.raises(ValueError, match="own forward"):
        lbl.enable_fused_aux_loss(model)
    dense = load(save_tiny_model("qwen3", tmp_path))
    with pytest.raises(ValueError, match="Qwen3ForCausalLM is not a transformers MoE causal LM"):
        lbl.enable_fused_aux_loss(dense)
    with pytest.raises(TypeError):
        lbl.enable_fused_aux_loss("model")


def test_fused_aux_loss_under_accelerate_style_hook(tmp_path):
    """accelerate's add_hook_to_module pattern: instance forward = partial(new_forward) calling _old_forward."""
    import functools

    lbl = _kernel()
    path = save_tiny_model("qwen3_moe", tmp_path)
    eager, ours = load(path), load(path)
    calls = []

    def new_forward(module, *args, **kwargs):
        calls.append(1)
        return module._old_forward(*args, **kwargs)

    ours._hf_hook = object()
    ours._old_forward = ours.forward
    ours.forward = functools.update_wrapper(functools.partial(new_forward, ours), ours._old_forward)
    hooked_forward = ours.forward
    lbl.enable_fused_aux_loss(ours)
    assert ours.forward is hooked_forward  # the hook stays in place
    batch = _batch(eager)
    out, ref = ours(**batch), eager(**batch)
    assert calls and type(out.aux_loss.grad_fn).__name__ != "MulBackward0"
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=1e-6, atol=1e-7)
    lbl.disable_fused_aux_loss(ours)
    assert type(ours(**batch).aux_loss.grad_fn).__name__ == "MulBackward0"


@pytest.mark.parametrize("family", ["qwen3_moe"])  # plain HF Qwen3.5-MoE fails its compiled backward on CPU
def test_router_and_aux_loss_together_compile(family, tmp_path):
    lbl = _kernel()
    path = save_tiny_model(family, tmp_path)
    # HF's CPU experts: grouped_mm fallback and eager do not compile fullgraph with backward; batched_mm does
    eager = load(path, experts_implementation="batched_mm").train()
    ours = lbl.enable_fused_aux_loss(load(path, _router_mapping(family), experts_implementation="batched_mm").train())
    batch = _batch(eager)
    assert_parity(eager, ours, batch)
    assert_compiled_parity(eager, torch.compile(ours, fullgraph=True, backend="aot_eager"), batch)


def test_save_load_round_trip(tmp_path):
    path = save_tiny_model("qwen3_moe", tmp_path)
    ours = load(path, _router_mapping("qwen3_moe"))
    assert "Layout" in type(ours.model.layers[0].mlp.gate).__name__
    ours.save_pretrained(tmp_path / "resaved")
    plain, again = load(path), load(tmp_path / "resaved")
    assert_same_weights_and_logits(plain, again, _batch(plain))


@pytest.mark.skipif(not (ROOT / "kernel_repos" / "cross-entropy" / "CARD.md").is_file(),
                    reason="hubfuse/cross-entropy repo not present")
def test_with_fused_cross_entropy_hook(tmp_path):
    register_local_kernels("cross-entropy")
    from kernels import get_kernel

    ce = get_kernel("hubfuse/cross-entropy", revision="v1")
    lbl = _kernel()
    path = save_tiny_model("qwen3_moe", tmp_path)
    eager = load(path).train()
    ours = load(path).train()
    ce.enable_fused_loss(ours, return_logits=True, aux_loss_fn=lbl.load_balancing_loss_func)
    assert ce.fused_loss_options(ours)["aux_loss_fn"] is lbl.load_balancing_loss_func
    with pytest.raises(ValueError, match="aux_loss_fn=load_balancing_loss_func"):
        lbl.enable_fused_aux_loss(ours)  # the CE hook owns the forward: the aux loss goes through its option
    batch = _batch(eager)
    out, ref = ours(**batch), eager(**batch)
    assert "MulBackward0" != type(out.aux_loss.grad_fn).__name__
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out.loss, ref.loss, rtol=2e-5, atol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(ROUTER))
def test_router_and_aux_loss_gpu(family, tmp_path):
    lbl = _kernel()
    path = save_tiny_model(family, tmp_path)
    eager = load(path, device="cuda").train()
    ours = lbl.enable_fused_aux_loss(load(path, _router_mapping(family), device="cuda").train())
    assert modules_running(ours, ROUTER[family][1])
    batch = _batch(eager, "cuda")
    assert_parity(eager, ours, batch, atol=1e-4, rtol=1e-4)
    eager16 = load(path, dtype=torch.bfloat16, device="cuda").train()
    ours16 = lbl.enable_fused_aux_loss(load(path, _router_mapping(family), dtype=torch.bfloat16, device="cuda").train())
    out16, ref16 = ours16(**batch), eager16(**batch)
    torch.testing.assert_close(out16.aux_loss, ref16.aux_loss, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(out16.loss.float(), ref16.loss.float(), rtol=2e-2, atol=5e-2)
