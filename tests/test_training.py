"""hubfuse.training.skip_cache_in_training: no KV cache in training unless `use_cache=True` is passed.

- A model loaded with hubfuse.KernelConfig (Qwen3, Qwen3-MoE, Qwen3.5-MoE presets, fused losses on), in training
  mode with labels and `use_cache` left at its default (the config's True): no `DynamicCache` is constructed,
  the output's `past_key_values` is None, and loss and every gradient equal those of `use_cache=False`.
- `use_cache=True` passed explicitly still builds the cache (to the causal LM or to its decoder model).
- In eval mode the default still builds it, and greedy generation uses it (one cache per `generate`).
- Llama / Qwen2 (HF classes, the function called by hand) behave the same; other model instances are untouched.
"""
import pytest
import torch

from hubfuse import presets
from hubfuse.training import skip_cache_in_training
from tests.utils import REVISION, load, make_batch, register_local_kernels, save_tiny_model, tiny_config

KERNELIZED = ("qwen3", "qwen3_moe", "qwen3_5_moe_text")
OVERRIDES = {"qwen3_moe": dict(output_router_logits=True), "qwen3_5_moe_text": dict(output_router_logits=True)}


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    register_local_kernels("rmsnorm", "rotary", "swiglu", "moe", "load-balancing-loss", "cross-entropy",
                           "gated-delta-net")


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


def _loss_and_grads(model, batch, **kw):
    model.zero_grad(set_to_none=True)
    out = model(**batch, **kw)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", KERNELIZED)
def test_kernelized_training_builds_no_cache(family, model_dirs, caches_built):
    model = _kernelized(model_dirs[family], family).train()
    assert model.config.use_cache  # the default the forward would otherwise read
    batch = make_batch(tiny_config(family).vocab_size, seq=9)

    out, grads = _loss_and_grads(model, batch)
    assert caches_built == [] and out.past_key_values is None

    ref, ref_grads = _loss_and_grads(model, batch, use_cache=False)
    torch.testing.assert_close(out.loss, ref.loss, atol=0, rtol=0)
    assert grads.keys() == ref_grads.keys() and grads
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=0, rtol=0, msg=lambda m: f"{name}: {m}")

    out = model(**batch, use_cache=True)  # asked for: honoured
    assert len(caches_built) == 1 and out.past_key_values is not None
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-6, rtol=1e-6)


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
    model = skip_cache_in_training(load(model_dirs[family])).train()
    other = load(model_dirs[family]).train()  # not passed to the function: HF's behaviour
    batch = make_batch(tiny_config(family).vocab_size)
    assert model(**batch).past_key_values is None and caches_built == []
    assert other(**batch).past_key_values is not None and len(caches_built) == 1
    assert model.model(input_ids=batch["input_ids"]).past_key_values is None and len(caches_built) == 1
    assert model.model(input_ids=batch["input_ids"], use_cache=True).past_key_values is not None
    assert len(caches_built) == 2
    assert skip_cache_in_training(model) is model  # idempotent: still one hook per module
    assert len(model.model._forward_pre_hooks) == 1
