"""Rotary kernels through transformers: tiny Qwen3 / Qwen3-MoE / Qwen3.5-MoE / Llama / Qwen2 loaded with
hubfuse.KernelConfig.

- hub function name `rotary_pos_emb` (stateless `RotaryPosEmb`) for Qwen3 / Qwen3-MoE / Llama / Qwen2;
- attention Layouts: `QKNormRopeAttention` for Qwen3 / Qwen3-MoE and `GatedQKNormRopeAttention` for Qwen3.5-MoE
  (q_norm + k_norm + RoPE in one kernel), `RopeAttention` for Llama / Qwen2 (RoPE on q and k in one launch;
  Qwen2's biased q/k/v projections).
Logits and every gradient against a plain eager load (eval and train), greedy generation with the KV cache
equal to eager for 16 new tokens, save_pretrained round trip, torch.compile(fullgraph=True).
On CPU the kernels run under the Triton interpreter (root conftest sets TRITON_INTERPRET=1).
"""
import pytest
import torch

from tests.utils import (assert_parity, assert_resave_keeps_checkpoint, hub, load, make_batch, modules_running,
                         register_local_kernels, restore_rope_functions, rope_bound, rope_function, save_tiny_model,
                         sharpen_attention, tiny_config)

ROPE_FAMILIES = ("qwen3", "qwen3_moe", "llama", "qwen2")  # `apply_rotary_pos_emb` decorated with the hub name
LAYOUT_MAPPINGS = {
    "qwen3": {"^Qwen3Attention$": hub("rotary", "QKNormRopeAttention")},
    "qwen3_moe": {"^Qwen3MoeAttention$": hub("rotary", "QKNormRopeAttention")},
    "qwen3_5_moe_text": {"^Qwen3_5MoeAttention$": hub("rotary", "GatedQKNormRopeAttention")},
    "llama": {"^LlamaAttention$": hub("rotary", "RopeAttention")},
    "qwen2": {"^Qwen2Attention$": hub("rotary", "RopeAttention")},
}
LAYOUT_LAYER = {"qwen3": "QKNormRopeAttention", "qwen3_moe": "QKNormRopeAttention",
                "qwen3_5_moe_text": "GatedQKNormRopeAttention", "llama": "RopeAttention", "qwen2": "RopeAttention"}
# tiny models: 2 layers (3.5: 1 full-attention layer)
EXPECTED_ATTENTION = {"qwen3": 2, "qwen3_moe": 2, "qwen3_5_moe_text": 1, "llama": 2, "qwen2": 2}


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    register_local_kernels("rotary", "hubfuse")


@pytest.fixture(autouse=True)
def _restore_rope_functions():
    """kernelize binds the kernel onto the module-global `apply_rotary_pos_emb` instance, which outlives the
    model (hubfuse.KernelConfig does not undo it yet): put the original forward back after each test so the
    eager references of later tests really are eager."""
    saved = {f: rope_function(f).__dict__.get("forward") for f in ROPE_FAMILIES}
    yield
    restore_rope_functions(saved)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    dirs = {fam: save_tiny_model(fam, d) for fam in (*ROPE_FAMILIES, "qwen3_5_moe_text")}
    for fam in ("llama", "qwen2"):
        sharpen_attention(dirs[fam])  # no q/k norm: RoPE would not show in the logits at init scale
    return dirs


def _load_eager(path, **kw):
    return load(path, **kw)


@pytest.mark.parametrize("family", ROPE_FAMILIES)
def test_hub_name_rotary_pos_emb_parity_eval_and_train(family, model_dirs):
    path = model_dirs[family]
    eager = _load_eager(path)
    assert not rope_bound(family)
    ours = load(path, {"rotary_pos_emb": hub("rotary", "RotaryPosEmb")})
    assert rope_bound(family)
    batch = make_batch(tiny_config(family).vocab_size)
    # eager and ours share the module-global function: run eager with the original forward
    fwd = rope_function(family).__dict__.pop("forward")
    loss_e, logits_e, grads_e = _step(eager, batch)
    rope_function(family).forward = fwd
    for train in (False, True):
        ours.train(train)
        assert rope_bound(family)  # hubfuse.KernelConfig keeps the kernel in training mode
        loss_o, logits_o, grads_o = _step(ours, batch)
        torch.testing.assert_close(logits_o, logits_e, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(loss_o, loss_e, atol=2e-5, rtol=2e-5)
        assert grads_o.keys() == grads_e.keys()
        for name in grads_e:
            torch.testing.assert_close(grads_o[name], grads_e[name], atol=2e-5, rtol=2e-5, msg=lambda m: f"{name}: {m}")


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                    if p.grad is not None}


@pytest.mark.parametrize("family", list(LAYOUT_MAPPINGS))
def test_attention_layout_parity_eval_and_train(family, model_dirs):
    path = model_dirs[family]
    eager, ours = load(path), load(path, LAYOUT_MAPPINGS[family])
    layer = LAYOUT_LAYER[family]
    assert len(modules_running(ours, layer)) == EXPECTED_ATTENTION[family]
    assert {type(m).__name__ for m in ours.modules()} >= {f"{layer}Layout"}
    batch = make_batch(tiny_config(family).vocab_size)
    assert_parity(eager, ours, batch)
    ours.train(), eager.train()
    assert len(modules_running(ours, layer)) == EXPECTED_ATTENTION[family]
    assert_parity(eager, ours, batch)


@pytest.mark.parametrize("family", list(LAYOUT_MAPPINGS))
def test_layout_reference_forward_matches_eager(family, model_dirs):
    """The Layouts' own forward (the HF reference path, used where the kernel is not bound) equals eager."""
    path = model_dirs[family]
    eager = load(path)
    ours = load(path, LAYOUT_MAPPINGS[family])
    for m in ours.modules():  # unbind the kernels: Layout.forward runs
        if type(m).__name__.endswith("AttentionLayout"):
            m.__dict__.pop("forward", None)
    assert not modules_running(ours, LAYOUT_LAYER[family])
    batch = make_batch(tiny_config(family).vocab_size)
    assert_parity(eager, ours, batch, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("style", ["hub_name", "layout"])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "qwen3_5_moe_text", "qwen2"])
def test_greedy_generation_with_kv_cache_matches_eager(family, style, model_dirs):
    if style == "hub_name" and family not in ROPE_FAMILIES:
        pytest.skip("Qwen3.5-MoE's apply_rotary_pos_emb has no hub name: only the Layout reaches it")
    path = model_dirs[family]
    mapping = {"rotary_pos_emb": hub("rotary", "RotaryPosEmb")} if style == "hub_name" else LAYOUT_MAPPINGS[family]
    eager = load(path)
    prompt = make_batch(tiny_config(family).vocab_size, batch=2, seq=6, seed=3)["input_ids"]
    # row 1 left-padded by 2: its positions are shifted (not 0..S-1), as batched generation makes them
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0
    kw = dict(attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False, use_cache=True,
              pad_token_id=0)
    with torch.no_grad():
        want = eager.generate(prompt, **kw)
        ours = load(path, mapping)
        if style == "hub_name":
            assert rope_bound(family)
        else:
            assert len(modules_running(ours, LAYOUT_LAYER[family])) == EXPECTED_ATTENTION[family]
        got = ours.generate(prompt, **kw)
    assert got.shape == (2, 6 + 16)
    assert torch.equal(got, want), (got, want)


def test_layout_with_eager_attention_and_attention_weights(model_dirs):
    """Attention goes through transformers' interface: `attn_implementation="eager"` and
    `output_attentions=True` work and match."""
    path = model_dirs["qwen3_5_moe_text"]
    eager = load(path, attn_implementation="eager")
    ours = load(path, LAYOUT_MAPPINGS["qwen3_5_moe_text"], attn_implementation="eager")
    assert len(modules_running(ours, "GatedQKNormRopeAttention")) == 1
    batch = make_batch(tiny_config("qwen3_5_moe_text").vocab_size)
    a = eager(input_ids=batch["input_ids"], output_attentions=True)
    b = ours(input_ids=batch["input_ids"], output_attentions=True)
    torch.testing.assert_close(b.logits, a.logits, atol=2e-5, rtol=2e-5)
    got = [t for t in b.attentions if t is not None]
    want = [t for t in a.attentions if t is not None]
    assert len(got) == len(want) >= 1
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", list(LAYOUT_MAPPINGS))
def test_save_pretrained_round_trip(family, model_dirs, tmp_path):
    path = model_dirs[family]
    resaved = assert_resave_keeps_checkpoint(path, LAYOUT_MAPPINGS[family], tmp_path)
    again = load(resaved, LAYOUT_MAPPINGS[family])
    batch = make_batch(tiny_config(family).vocab_size)
    torch.testing.assert_close(again(**batch).logits, load(path)(**batch).logits, atol=2e-5, rtol=2e-5)


def test_later_plain_load_is_untouched(model_dirs):
    path = model_dirs["qwen3_5_moe_text"]
    ours = load(path, LAYOUT_MAPPINGS["qwen3_5_moe_text"])
    assert any(type(m).__name__ == "GatedQKNormRopeAttentionLayout" for m in ours.modules())
    plain = load(path)
    types = {type(m).__name__ for m in plain.modules()}
    assert "Qwen3_5MoeAttention" in types and not any(t.endswith("Layout") for t in types)


def test_umbrella_kernel_serves_the_same_layers(model_dirs):
    path = model_dirs["qwen3_5_moe_text"]
    ours = load(path, {"^Qwen3_5MoeAttention$": ("hubfuse/hubfuse:GatedQKNormRopeAttention", {"revision": "v1"})})
    ours.train()
    assert len(modules_running(ours, "GatedQKNormRopeAttention")) == 1
    assert_parity(load(path).train(), ours, make_batch(tiny_config("qwen3_5_moe_text").vocab_size))


@pytest.mark.parametrize("family, style", [("qwen3", "layout"), ("qwen3_5_moe_text", "layout"), ("qwen2", "layout"),
                                           ("qwen3", "hub_name")])
def test_torch_compile_fullgraph_over_kernelized_model(family, style, model_dirs):
    torch._dynamo.reset()
    path = model_dirs[family]
    mapping = {"rotary_pos_emb": hub("rotary", "RotaryPosEmb")} if style == "hub_name" else LAYOUT_MAPPINGS[family]
    ours = load(path, mapping)
    batch = make_batch(tiny_config(family).vocab_size)
    # Qwen3.5-MoE: transformers' own grouped_mm experts backward does not trace on CPU (data-dependent guard
    # in `_grouped_mm_fallback_backward`, also without our kernels), so that model is compiled forward-only
    train = family != "qwen3_5_moe_text"
    with torch.set_grad_enabled(train):
        want = ours(**batch)
        compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
        got = compiled(**batch)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    if train:
        got.loss.backward()  # the compiled graph's backward runs the kernels' backward ops
        assert all(p.grad is not None for n, p in ours.named_parameters() if "self_attn" in n)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_gpu_bf16_hub_name_parity(family, model_dirs):
    path = model_dirs[family]
    eager = load(path, dtype=torch.bfloat16, device="cuda").train()
    batch = make_batch(tiny_config(family).vocab_size, device="cuda")
    loss_e, logits_e, grads_e = _step(eager, batch)
    ours = load(path, {"rotary_pos_emb": hub("rotary", "RotaryPosEmb")}, dtype=torch.bfloat16, device="cuda").train()
    assert rope_bound(family)
    loss_o, logits_o, grads_o = _step(ours, batch)
    torch.testing.assert_close(logits_o, logits_e, atol=3e-2, rtol=3e-2)
    for name in grads_e:
        torch.testing.assert_close(grads_o[name], grads_e[name], atol=3e-2, rtol=3e-2, msg=lambda m: f"{name}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(LAYOUT_MAPPINGS))
def test_gpu_bf16_parity_and_generation(family, model_dirs):
    path = model_dirs[family]
    eager = load(path, dtype=torch.bfloat16, device="cuda")
    ours = load(path, LAYOUT_MAPPINGS[family], dtype=torch.bfloat16, device="cuda")
    assert len(modules_running(ours, LAYOUT_LAYER[family])) == EXPECTED_ATTENTION[family]
    batch = make_batch(tiny_config(family).vocab_size, device="cuda")
    assert_parity(eager.train(), ours.train(), batch, atol=3e-2, rtol=3e-2)
    eager.eval(), ours.eval()
    prompt = batch["input_ids"][:, :5]
    kw = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, use_cache=True, pad_token_id=0)
    with torch.no_grad():
        got = ours.generate(prompt, **kw)
        want = eager.generate(prompt, output_scores=True, return_dict_in_generate=True, **kw)
    _assert_same_greedy_tokens(got, want, prompt.shape[1])


def _assert_same_greedy_tokens(got, want, prompt_len, tie_tol=3e-2):
    """Greedy generations equal; in bf16 the fused norm may flip a last bit (fp32 reduction order), which can
    only change a greedy step where eager's two best logits (nearly) tie: allowed there, nowhere else."""
    if torch.equal(got, want.sequences):
        return
    assert got.shape == want.sequences.shape
    for row in range(got.shape[0]):
        differ = (got[row, prompt_len:] != want.sequences[row, prompt_len:]).nonzero()
        if len(differ) == 0:
            continue
        step = differ[0].item()  # first divergence: before it both saw the same tokens
        scores = want.scores[step][row].float()
        ours_token = got[row, prompt_len + step]
        gap = (scores.max() - scores[ours_token]).item()
        assert gap <= tie_tol * max(1.0, scores.max().abs().item()), (
            f"row {row}: generation diverges at step {step} where eager's logit gap is {gap:.3g} (not a tie)")


def _graph_nodes(t: torch.Tensor) -> list:
    seen, stack = {}, [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and id(node) not in seen:
            seen[id(node)] = node
            stack += [n for n, _ in node.next_functions]
    return list(seen.values())


def _assert_relative_parity(reference, candidate, batch, rtol=1e-5):
    """Loss, logits and every gradient within rtol of the reference, relative to each tensor's largest entry (the
    q/k projections' gradients are small at these widths: an absolute tolerance would not see them)."""
    from tests.utils import forward_backward

    loss_r, logits_r, grads_r = forward_backward(reference, batch)
    loss_c, logits_c, grads_c = forward_backward(candidate, batch)
    assert grads_c.keys() == grads_r.keys()
    for name, (c, r) in {"loss": (loss_c, loss_r), "logits": (logits_c, logits_r),
                         **{n: (grads_c[n], grads_r[n]) for n in grads_r}}.items():
        scale = r.abs().max()
        assert scale > 0 and (c - r).abs().max() <= rtol * scale, (name, float((c - r).abs().max()), float(scale))


def _attention_blocks(t: torch.Tensor) -> list:
    return [n for n in _graph_nodes(t) if type(n).__name__ == "_QKNormRopeAttentionBlockBackward"]


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "llama", "qwen2"])
def test_attention_block_one_node_no_rotated_qk_saved(family, path, model_dirs, monkeypatch, triton_interpreter):
    """In training with no mask and no cache the Qwen3 / Llama / Qwen2 attention runs as one autograd node
    (projections, q/k norm + RoPE or RoPE alone, SDPA and o_proj): loss, logits and every gradient match eager on
    the torch path and on the Triton path (interpreter: q/k/v as one GEMM), and with SDPA held to its math backend
    (SDPA run again in the node's backward); the node keeps the attention output but no rotated q / k (the
    backward rebuilds them); a padding mask or a hook on q_proj take the per-op path, with the same results."""
    if path == "triton":
        triton_interpreter()
    else:  # the tests run the interpreter by default (conftest.py)
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = tiny_config(family)
    model_path = model_dirs[family]
    eager, ours = load(model_path).train(), load(model_path, LAYOUT_MAPPINGS[family]).train()
    batch = make_batch(cfg.vocab_size, seq=9)
    blocks = _attention_blocks(ours(**batch).loss)
    assert len(blocks) == EXPECTED_ATTENTION[family]
    B, S, D = 2, 9, cfg.head_dim
    for node in blocks:
        per_head = [tuple(t.shape) for t in node.saved_tensors if t is not None and t.dim() == 4 and t.shape[2] == S]
        assert per_head == [(B, cfg.num_attention_heads, S, D)], per_head  # the attention output alone
    _assert_relative_parity(eager, ours, batch)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):  # no kernel the node calls directly: SDPA again under autograd
        assert len(_attention_blocks(ours(**batch).loss)) == EXPECTED_ATTENTION[family]
        _assert_relative_parity(eager, ours, batch)
    padded = dict(batch, attention_mask=torch.ones_like(batch["input_ids"]))
    padded["attention_mask"][0, :3] = 0
    assert not _attention_blocks(ours(**padded).loss)
    _assert_relative_parity(eager, ours, padded)
    hooks = [m.q_proj.register_forward_hook(lambda *_: None) for m in ours.modules() if hasattr(m, "q_proj")]
    assert not _attention_blocks(ours(**batch).loss)
    _assert_relative_parity(eager, ours, batch)
    for hook in hooks:
        hook.remove()


def test_rotated_qk_released_until_backward(model_dirs, monkeypatch):
    """In training the gated q/k norm + RoPE attention (Qwen3.5) frees the rotated q / k the attention saved and
    rebuilds them in the backward: gradients bit for bit those without the release, storage empty between forward
    and backward, and no release with HUBFUSE_RELEASE_ACTIVATIONS=0, under activation checkpointing (which
    recomputes the forward itself) or without gradients. (Qwen3's attention saves no rotated q / k at all: the
    test above.)"""
    from tests.utils import forward_backward

    family = "qwen3_5_moe_text"
    model = load(model_dirs[family], LAYOUT_MAPPINGS[family])
    model.train()
    layers = __import__("sys").modules[type(modules_running_layouts(model)[0]).__module__]
    released = []

    def spy(anchors, tensors, rebuild):
        layers_release(anchors, tensors, rebuild)
        released.append([t.untyped_storage().nbytes() for t in tensors])

    layers_release = layers.release_until_backward
    monkeypatch.setattr(layers, "release_until_backward", spy)
    batch = make_batch(tiny_config(family).vocab_size, seq=9)
    loss, logits, grads = forward_backward(model, batch)
    assert len(released) == EXPECTED_ATTENTION[family] and all(n == [0, 0] for n in released), released
    monkeypatch.setenv("HUBFUSE_RELEASE_ACTIVATIONS", "0")  # the user's switch: keep what the ops saved
    loss_kept, logits_kept, grads_kept = forward_backward(model, batch)
    assert len(released) == EXPECTED_ATTENTION[family]
    assert torch.equal(loss, loss_kept) and torch.equal(logits, logits_kept)
    assert grads.keys() == grads_kept.keys()
    for name in grads:
        assert torch.equal(grads[name], grads_kept[name]), name
    monkeypatch.undo()
    monkeypatch.setattr(layers, "release_until_backward", spy)
    released.clear()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _, _, grads_ckpt = forward_backward(model, batch)
    assert not released
    for name in grads:
        assert torch.equal(grads[name], grads_ckpt[name]), name
    with torch.no_grad():
        model(**batch)
    assert not released


def modules_running_layouts(model):
    return [m for m in model.modules() if type(m).__name__.endswith("AttentionLayout")]
