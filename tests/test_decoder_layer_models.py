"""hubfuse/decoder-layer through transformers: tiny Qwen3 / Llama / Qwen2 loaded with hubfuse.KernelConfig and
the `DecoderLayer` Layout (the dense presets' default).

In training (no mask, no cache) every decoder layer is one autograd node: loss, logits and every gradient match
a plain eager load, on the torch path and on the Triton path (interpreter), and equal the per-module preset
(`decoder_layer=False`) bit for bit. A padding mask, cached generation, torch.compile, output_hidden_states,
gradient checkpointing through transformers' API and a save_pretrained round trip work as on the stock model.
"""
import pytest
import torch

from hubfuse import presets
from tests.utils import (assert_resave_keeps_checkpoint, forward_backward, load, make_batch, register_local_kernels,
                         save_tiny_model, sharpen_attention, tiny_config)

FAMILIES = ("qwen3", "llama", "qwen2")
REVISION = "v1"
LAYERS = 2  # tiny models


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    register_local_kernels(*sorted({r for f in FAMILIES for r in presets.kernel_repos(f)}))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    dirs = {fam: save_tiny_model(fam, d) for fam in FAMILIES}
    for fam in ("llama", "qwen2"):
        sharpen_attention(dirs[fam])  # no q/k norm: RoPE would not show in the logits at init scale
    return dirs


def _ours(path, family, **options):
    return load(path, presets.kernel_mapping(family, revision=REVISION, **options))


def _blocks(t: torch.Tensor) -> int:
    seen, stack, count = set(), [t.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += type(node).__name__ == "_DecoderLayerBlockBackward"
        stack += [n for n, _ in node.next_functions]
    return count


def assert_parity(eager, ours, batch, tol=2e-5):
    """Loss, logits and every gradient of `ours` (a compiled model's `_orig_mod.` prefix stripped) against the
    eager model's, `gate_up_proj` against cat(gate_proj, up_proj)."""
    loss_e, logits_e, grads_e = forward_backward(eager, batch)
    loss_o, logits_o, grads_o = forward_backward(ours, batch)
    torch.testing.assert_close(logits_o, logits_e, atol=tol, rtol=tol)
    torch.testing.assert_close(loss_o, loss_e, atol=tol, rtol=tol)
    grads_o = {k.removeprefix("_orig_mod."): v for k, v in grads_o.items()}
    want = presets.eager_to_kernelized(grads_e, list(grads_o))
    for name in grads_o:
        torch.testing.assert_close(grads_o[name], want[name], atol=tol, rtol=tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("family", FAMILIES)
def test_one_node_per_layer_parity(family, path, model_dirs, monkeypatch, triton_interpreter):
    if path == "triton":
        triton_interpreter()
    else:  # the tests run the interpreter by default (conftest.py)
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model_path = model_dirs[family]
    eager, ours = load(model_path).train(), _ours(model_path, family).train()
    assert [type(layer).__name__ for layer in ours.model.layers] == ["DecoderLayerLayout"] * LAYERS
    batch = make_batch(tiny_config(family).vocab_size, seq=9)
    assert _blocks(ours(**batch).loss) == LAYERS
    assert_parity(eager, ours, batch)
    per_module = _ours(model_path, family, decoder_layer=False).train()
    assert _blocks(per_module(**batch).loss) == 0
    loss, logits, grads = forward_backward(ours, batch)
    loss_m, logits_m, grads_m = forward_backward(per_module, batch)
    # the RMSNorm + MLP fusion holds the MLP under post_attention_layernorm
    grads_m = {n.replace("post_attention_layernorm.gate_up_proj", "mlp.gate_up_proj")
               .replace("post_attention_layernorm.down_proj", "mlp.down_proj"): g for n, g in grads_m.items()}
    assert torch.equal(loss, loss_m) and torch.equal(logits, logits_m)
    assert grads.keys() == grads_m.keys()
    for name in grads:
        assert torch.equal(grads[name], grads_m[name]), name


@pytest.mark.parametrize("family", FAMILIES)
def test_mask_cache_and_eval_take_the_per_op_path(family, model_dirs):
    """A padding mask: no node, eager's results. Greedy generation with the KV cache: eager's tokens."""
    model_path = model_dirs[family]
    eager, ours = load(model_path).train(), _ours(model_path, family).train()
    batch = make_batch(tiny_config(family).vocab_size, seq=9)
    padded = dict(batch, attention_mask=torch.ones_like(batch["input_ids"]))
    padded["attention_mask"][0, :3] = 0
    assert _blocks(ours(**padded).loss) == 0
    assert_parity(eager, ours, padded)
    eager.eval(), ours.eval()
    prompt = batch["input_ids"][:, :5]
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, **kw), eager.generate(prompt, **kw))


def test_hidden_states_checkpointing_and_resave(model_dirs, tmp_path):
    """output_hidden_states records every layer's output; `gradient_checkpointing_enable()` reaches the Layout
    (same loss and gradients); a re-saved checkpoint keeps the original keys bit for bit."""
    family = "qwen3"
    model_path = model_dirs[family]
    eager, ours = load(model_path).train(), _ours(model_path, family).train()
    batch = make_batch(tiny_config(family).vocab_size, seq=9)
    hidden = ours(**batch, output_hidden_states=True).hidden_states
    hidden_e = eager(**batch, output_hidden_states=True).hidden_states
    assert len(hidden) == len(hidden_e) == LAYERS + 1
    for h, h_e in zip(hidden, hidden_e):
        torch.testing.assert_close(h, h_e, atol=2e-5, rtol=2e-5)
    loss, logits, grads = forward_backward(ours, batch)
    ours.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert all(layer.gradient_checkpointing for layer in ours.model.layers)
    checkpointed = []
    for layer in ours.model.layers:
        def spy(fn, *args, checkpoint=layer._gradient_checkpointing_func):
            checkpointed.append(1)
            return checkpoint(fn, *args)
        layer._gradient_checkpointing_func = spy
    loss_c, logits_c, grads_c = forward_backward(ours, batch)
    assert len(checkpointed) == LAYERS  # each layer's call went through transformers' checkpoint function
    assert torch.equal(loss, loss_c)
    for name in grads:
        assert torch.equal(grads[name], grads_c[name]), name
    assert_resave_keeps_checkpoint(model_path, presets.kernel_mapping(family, revision=REVISION), tmp_path)


def test_torch_compile_fullgraph(model_dirs):
    family = "qwen3"
    model_path = model_dirs[family]
    eager, ours = load(model_path).train(), _ours(model_path, family).train()
    batch = make_batch(tiny_config(family).vocab_size, seq=9)
    assert_parity(eager, torch.compile(ours, fullgraph=True), batch)


def test_no_split_modules_name_the_layout(model_dirs):
    """The instance's `_no_split_modules` names the Layout class (wrap policies find the layers by these names); the
    class's list and a plain model's are unchanged."""
    model_path = model_dirs["qwen3"]
    ours, plain = _ours(model_path, "qwen3"), load(model_path)
    assert set(ours._no_split_modules) == {"Qwen3DecoderLayer", "DecoderLayerLayout"}
    assert set(plain._no_split_modules) == {"Qwen3DecoderLayer"} == set(type(ours)._no_split_modules)
    per_module = _ours(model_path, "qwen3", decoder_layer=False)
    assert set(per_module._no_split_modules) == {"Qwen3DecoderLayer", "FusedQwen3DecoderLayer"}


@pytest.mark.parametrize("family", FAMILIES)
def test_output_attentions_recorded(family, model_dirs):
    """`output_attentions=True` with the eager attention returns the attention weights, one per layer, as the
    stock model's (transformers records them from its own attention class: hubfuse.KernelConfig hooks the
    Layout's attention that stands in for it); with sdpa the layers still run as one node each."""
    model_path = model_dirs[family]
    batch = make_batch(tiny_config(family).vocab_size, seq=9)
    plain = load(model_path, attn_implementation="eager")
    ours = load(model_path, presets.kernel_mapping(family, revision=REVISION), attn_implementation="eager")
    want = plain(input_ids=batch["input_ids"], output_attentions=True).attentions
    got = ours(input_ids=batch["input_ids"], output_attentions=True).attentions
    assert len(got) == len(want) == LAYERS
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)
    sdpa = _ours(model_path, family).train()
    assert _blocks(sdpa(**batch).loss) == LAYERS
    assert sdpa(**batch, output_attentions=True).attentions == ()  # sdpa returns no weights, as the stock model
    assert load(model_path)(**batch, output_attentions=True).attentions == ()
