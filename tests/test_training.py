"""hubfuse.training.apply_training_defaults: no KV cache in training unless `use_cache=True` is passed, and SDPA's
causal path when transformers cannot check the batch for packing (torch.compile, CUDA-graph capture).

- A model loaded with hubfuse.KernelConfig (Qwen3, Qwen3-MoE, Qwen3.5-MoE presets, fused losses on), in training
  mode with labels and `use_cache` left at its default (the config's True): no `DynamicCache` is constructed,
  the output's `past_key_values` is None, and loss and every gradient equal those of `use_cache=False`.
- `use_cache=True` passed explicitly still builds the cache (to the causal LM or to its decoder model).
- In eval mode the default still builds it, and greedy generation uses it (one cache per `generate`).
- Llama / Qwen2 (HF classes, the function called by hand) behave the same; other model instances are untouched.
- With transformers seeing a trace (`is_tracing` answered True, as under compile or capture), an unpadded,
  unpacked training batch reaches attention with no mask (a plain HF model gets a 4D mask there), and the loss and
  gradients equal the plain model's; a mask passed in, the eager attention implementation, eval mode and model
  classes without a prepared-mask path keep transformers' mask.
- Qwen3-MoE and Llama (no prepared-mask path) with hubfuse's attention Layouts get the causal marker instead:
  transformers builds no mask (traced or not: no host read of the positions either), attention gets none, and
  loss and gradients equal the plain model's; the same classes with HF's attention keep transformers' mask.
"""
import os

import pytest
import torch

from hubfuse import presets
from hubfuse.training import CAUSAL_MARKER_MODELS, MASK_MAPPING_MODELS, apply_training_defaults
from tests.utils import (REVISION, forward_backward, load, make_batch, register_local_kernels, save_tiny_model,
                         tiny_config)

KERNELIZED = ("qwen3", "qwen3_moe", "qwen3_5_moe_text")
OVERRIDES = {"qwen3_moe": dict(output_router_logits=True), "qwen3_5_moe_text": dict(output_router_logits=True)}


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    register_local_kernels("rmsnorm", "rotary", "swiglu", "moe", "load-balancing-loss", "cross-entropy",
                           "gated-delta-net", "decoder-layer")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    return {fam: save_tiny_model(fam, d, **OVERRIDES.get(fam, {})) for fam in (*KERNELIZED, "llama", "qwen2")}


@pytest.fixture
def caches_built(monkeypatch):
    """A list that gets one entry per DynamicCache constructed while the test runs."""
    from transformers.cache_utils import DynamicCache

    built = []
    init = DynamicCache.__init__

    def counting_init(self, *args, **kwargs):
        built.append(type(self).__name__)
        init(self, *args, **kwargs)

    monkeypatch.setattr(DynamicCache, "__init__", counting_init)
    return built


def _kernelized(path, family):
    model = load(path, presets.kernel_mapping(family, revision=REVISION))
    presets.enable_losses(model, family, revision=REVISION)
    return model


@pytest.mark.parametrize("family", KERNELIZED)
def test_kernelized_training_builds_no_cache(family, model_dirs, caches_built):
    model = _kernelized(model_dirs[family], family).train()
    assert model.config.use_cache  # the default the forward would otherwise read
    batch = make_batch(tiny_config(family).vocab_size, seq=9)

    assert model(**batch).past_key_values is None
    loss, _, grads = forward_backward(model, batch)
    assert caches_built == []

    ref, _, ref_grads = forward_backward(model, batch, use_cache=False)
    torch.testing.assert_close(loss, ref, atol=0, rtol=0)
    assert grads.keys() == ref_grads.keys() and grads
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=0, rtol=0, msg=lambda m: f"{name}: {m}")

    out = model(**batch, use_cache=True)  # asked for: honoured
    assert len(caches_built) == 1 and out.past_key_values is not None
    torch.testing.assert_close(out.loss, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("family", (*KERNELIZED, "llama", "qwen2"))
def test_training_step_fills_no_zero_tensors(family, model_dirs, zero_fills):
    """A kernelized training step (the kernels' GPU path: the Triton interpreter here) fills no tensor with zeros,
    in particular no zero gradient that autograd would materialise for an op's non-differentiable outputs (router
    indices and stats, the Gated DeltaNet's saved WY matrices): each such fill is a launch and a memset nothing
    reads."""
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("the kernels' GPU path: TRITON_INTERPRET=1 on CPU")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load(model_dirs[family], presets.kernel_mapping(family, revision=REVISION), device=device).train()
    presets.enable_losses(model, family, revision=REVISION)
    batch = make_batch(tiny_config(family).vocab_size, seq=9, device=device)
    with zero_fills() as fills:
        model(**batch).loss.backward()
    assert fills == []


@pytest.mark.parametrize("family", KERNELIZED)
def test_eval_default_and_generation_keep_the_cache(family, model_dirs, caches_built):
    model = _kernelized(model_dirs[family], family).eval()
    ids = make_batch(tiny_config(family).vocab_size, batch=1, seq=5)["input_ids"]
    with torch.no_grad():
        assert model(input_ids=ids).past_key_values is not None
        assert len(caches_built) == 1
        cached = model.generate(ids, max_new_tokens=4, do_sample=False)
        assert len(caches_built) == 2  # generate built one cache and decoded through it
        uncached = model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("family", ("llama", "qwen2"))
def test_hf_model_by_hand(family, model_dirs, caches_built):
    model = apply_training_defaults(load(model_dirs[family])).train()
    other = load(model_dirs[family]).train()  # not passed to the function: HF's behaviour
    batch = make_batch(tiny_config(family).vocab_size)
    assert model(**batch).past_key_values is None and caches_built == []
    assert other(**batch).past_key_values is not None and len(caches_built) == 1
    assert model.model(input_ids=batch["input_ids"]).past_key_values is None and len(caches_built) == 1
    assert model.model(input_ids=batch["input_ids"], use_cache=True).past_key_values is not None
    assert len(caches_built) == 2
    assert apply_training_defaults(model) is model  # idempotent: still one hook per module
    assert len(model.model._forward_pre_hooks) == 1
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        apply_training_defaults(model.state_dict())


@pytest.fixture
def masks_seen(monkeypatch):
    """Every attention call's mask (None or its shape), with transformers believing it is being traced."""
    import transformers.masking_utils as masking_utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    seen = []
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def spy(module, query, key, value, attention_mask, *args, **kwargs):
        seen.append(None if attention_mask is None else tuple(attention_mask.shape))
        return sdpa(module, query, key, value, attention_mask, *args, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", spy)
    monkeypatch.setattr(masking_utils, "is_tracing", lambda *args, **kwargs: True)
    return seen


def _assert_loss_and_grads_close(loss, grads, ref, ref_grads):
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-6)
    assert grads.keys() >= ref_grads.keys() and ref_grads
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def _masks_kept_for_a_padded_batch_and_in_eval(model, batch, masks_seen, n_masked):
    """A mask passed in is honoured, and eval mode takes transformers' own path: a mask at each attention call."""
    masks_seen.clear()
    padded = dict(batch, attention_mask=torch.ones_like(batch["input_ids"]))
    padded["attention_mask"][0, :3] = 0
    model(**padded)
    model.eval()(**batch, use_cache=False)
    assert masks_seen[:n_masked] == [(2, 1, 9, 9)] * n_masked and len(masks_seen) == 2 * n_masked


@pytest.mark.parametrize("family", ("qwen3", "qwen3_5_moe_text", "qwen2"))
def test_traced_training_takes_the_causal_path(family, model_dirs, masks_seen):
    plain = load(model_dirs[family]).train()
    ours = apply_training_defaults(load(model_dirs[family])).train()
    assert type(ours.model).__name__ in MASK_MAPPING_MODELS
    batch = make_batch(tiny_config(family).vocab_size, seq=9)
    n_attention = sum(t == "full_attention" for t in ours.config.layer_types)
    ref, _, ref_grads = forward_backward(plain, batch, use_cache=False)
    assert masks_seen == [(2, 1, 9, 9)] * n_attention  # transformers' mask when it cannot check for packing
    masks_seen.clear()
    loss, _, grads = forward_backward(ours, batch)
    assert masks_seen == [None] * n_attention
    _assert_loss_and_grads_close(loss, grads, ref, ref_grads)
    _masks_kept_for_a_padded_batch_and_in_eval(ours, batch, masks_seen, n_attention)


@pytest.mark.parametrize("family", ("qwen3_moe", "llama"))
def test_models_without_a_mask_mapping_keep_their_mask(family, model_dirs, masks_seen):
    """HF's own attention modules: the causal marker would not be read, so transformers' mask stays."""
    model = apply_training_defaults(load(model_dirs[family])).train()
    assert type(model.model).__name__ not in MASK_MAPPING_MODELS
    model(**make_batch(tiny_config(family).vocab_size, seq=9))
    assert masks_seen and all(m == (2, 1, 9, 9) for m in masks_seen)


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "eager"])
@pytest.mark.parametrize("family", ("qwen3_moe", "llama"))
def test_kernelized_models_take_the_causal_marker(family, traced, model_dirs, masks_seen, monkeypatch):
    import transformers.masking_utils as masking_utils

    if not traced:
        monkeypatch.setattr(masking_utils, "is_tracing", lambda *args, **kwargs: False)
    packing_checks = []
    find_packed = masking_utils.find_packed_sequence_indices
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices",
                        lambda *a, **k: packing_checks.append(1) or find_packed(*a, **k))
    ours = _kernelized(model_dirs[family], family).train()
    assert type(ours.model).__name__ in CAUSAL_MARKER_MODELS
    batch = make_batch(tiny_config(family).vocab_size, seq=9)
    n_layers = ours.config.num_hidden_layers
    # the reference: the same model given an all-ones mask, which transformers turns into its causal mask
    ref, _, ref_grads = forward_backward(ours, dict(batch, attention_mask=torch.ones_like(batch["input_ids"])))
    assert masks_seen == [(2, 1, 9, 9) if traced else None] * n_layers
    masks_seen.clear()
    packing_checks.clear()
    loss, _, grads = forward_backward(ours, batch)
    assert masks_seen == [None] * n_layers and packing_checks == []  # no mask built, positions not read
    assert grads.keys() == ref_grads.keys()
    _assert_loss_and_grads_close(loss, grads, ref, ref_grads)
    _masks_kept_for_a_padded_batch_and_in_eval(ours, batch, masks_seen, n_layers)


def test_eager_attention_keeps_its_mask(model_dirs, masks_seen):
    """The eager implementation reads a None mask as no mask at all: it must keep transformers' causal mask."""
    plain = load(model_dirs["qwen3"], attn_implementation="eager").train()
    ours = apply_training_defaults(load(model_dirs["qwen3"], attn_implementation="eager")).train()
    batch = make_batch(tiny_config("qwen3").vocab_size, seq=9)
    torch.testing.assert_close(ours(**batch).loss, plain(**batch, use_cache=False).loss, atol=0, rtol=0)


@pytest.mark.parametrize("name", MASK_MAPPING_MODELS)
def test_mask_mapping_models_take_a_prepared_mapping(name):
    """The models listed take `attention_mask` as a prepared {layer type: mask} dict (transformers' code)."""
    import importlib
    import inspect

    module = {"Qwen3Model": "qwen3", "Qwen2Model": "qwen2", "Qwen3_5MoeTextModel": "qwen3_5_moe"}[name]
    cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)
    source = inspect.getsource(inspect.unwrap(cls.forward))
    assert "isinstance(causal_mask_mapping := attention_mask, dict)" in source
    assert "causal_mask_mapping[self.config.layer_types[i]]" in source
