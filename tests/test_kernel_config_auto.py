"""The one-argument path, local builds in one call, errors that name the cause, quiet output.

`from_pretrained(ckpt, use_kernels=True, kernel_config=hubfuse.KernelConfig())` on tiny Qwen3 / Qwen3-MoE /
Qwen3.5-MoE: every kernel of the family's preset bound (read from `config.model_type` at load time), the fused
losses on, loss and every gradient equal to a plain load; `hubfuse.use_local_builds()` makes every repo loadable.
Each bad configuration raises a message that is read here; a kernelized load + training step logs no warning.
"""
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

import hubfuse
from hubfuse import presets
from tests.utils import load, make_batch, save_tiny_model, tiny_config

FAMILIES = ("qwen3", "qwen3_moe", "qwen3_5_moe_text")
OVERRIDES = {"qwen3_moe": dict(output_router_logits=True), "qwen3_5_moe_text": dict(output_router_logits=True)}
# kernel layer -> modules bound, tiny models (2 layers; Qwen3-MoE all sparse; Qwen3.5: 1 linear + 1 full attention)
EXPECTED_BOUND = {
    "qwen3": {"RMSNorm": 1, "DecoderLayer": 2},
    "qwen3_moe": {"RMSNorm": 5, "QKNormRopeAttention": 2, "GroupedGemmExperts": 2, "TopKRouter": 2},
    "qwen3_5_moe_text": {"RMSNormZeroCentered": 5, "GatedDeltaNet": 1, "SoftmaxTopKRouter": 2,
                         "GatedQKNormRopeAttention": 1, "GroupedGemmExperts": 2, "SwiGLUMLP": 2},
}


@pytest.fixture(scope="module", autouse=True)
def _local_builds():
    registered = hubfuse.use_local_builds()  # the one call: build every repo, LOCAL_KERNELS for each
    assert {"hubfuse/rmsnorm", "hubfuse/cross-entropy", "hubfuse/hubfuse"} <= set(registered)
    assert set(registered) <= set(hubfuse.local_builds())


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    dirs = {fam: save_tiny_model(fam, d, **OVERRIDES.get(fam, {})) for fam in FAMILIES}
    config = tiny_config("qwen3").to_dict()
    mistral = {k: config[k] for k in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                      "head_dim", "intermediate_size", "num_hidden_layers")}
    from transformers import AutoConfig

    AutoModelForCausalLM.from_config(AutoConfig.for_model("mistral", **mistral)).save_pretrained(d / "mistral")
    dirs["mistral"] = d / "mistral"
    return dirs


def bound_layers(model) -> dict:
    counts = {}
    for name, module in model.named_modules():
        func = getattr(module.__dict__.get("forward"), "__func__", None)
        # kernelize binds a Layer's `forward` method; a plain function is a per-instance hook (lm_head's fused loss)
        if name and func is not None and func is not type(module).forward and "." in func.__qualname__:
            layer = func.__qualname__.split(".")[0]
            counts[layer] = counts.get(layer, 0) + 1
    return counts


def one_argument(path, **kwargs):
    return AutoModelForCausalLM.from_pretrained(path, use_kernels=True, kernel_config=hubfuse.KernelConfig(**kwargs))


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", FAMILIES)
def test_one_argument_binds_the_family_preset_and_the_fused_losses(family, model_dirs):
    batch = make_batch(tiny_config(family).vocab_size, seq=9, seed=torch.randint(0, 2**16, ()).item())
    eager = load(model_dirs[family]).train()
    out_e, grads_e = _step(eager, batch)
    ours = one_argument(model_dirs[family]).train()
    assert bound_layers(ours) == EXPECTED_BOUND[family]
    out_o, grads_o = _step(ours, batch)
    assert out_o.logits is None  # the loss came from the hidden states: fused linear cross-entropy
    assert presets.bound_kernels(ours)["loss->linear_cross_entropy"] == 1
    if family != "qwen3":
        assert "load_balancing_loss" in type(out_o.aux_loss.grad_fn).__name__
        torch.testing.assert_close(out_o.aux_loss, out_e.aux_loss, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out_o.loss, out_e.loss, atol=2e-5, rtol=2e-5)
    want = presets.eager_to_kernelized(grads_e, list(grads_o))
    for name in grads_o:
        torch.testing.assert_close(grads_o[name], want[name], atol=2e-5, rtol=2e-5, msg=lambda m: f"{name}: {m}")
    ours.eval()  # eval/train keep the kernels
    assert bound_layers(ours.train()) == EXPECTED_BOUND[family]


def test_one_config_object_serves_several_loads_and_losses_can_stay_off(model_dirs):
    kc = hubfuse.KernelConfig(losses=False)
    for family in FAMILIES:
        model = AutoModelForCausalLM.from_pretrained(model_dirs[family], use_kernels=True, kernel_config=kc)
        assert bound_layers(model) == EXPECTED_BOUND[family]
        assert model(**make_batch(tiny_config(family).vocab_size)).logits is not None  # losses=False: HF's loss
    assert kc.kernel_mapping == {}  # the user's object is back to its (empty) mapping after each load
    plain = load(model_dirs["qwen3"])  # and a plain load after them is plain
    assert not any("forward" in m.__dict__ for m in plain.modules())


def test_family_argument_and_explicit_preset_that_bind_nothing_raise(model_dirs):
    path = model_dirs["qwen3"]
    for kwargs in (dict(family="qwen3_moe"), dict(kernel_mapping=presets.kernel_mapping("qwen3_moe"))):
        with pytest.raises(ValueError) as e:
            one_argument(path, **kwargs)
        msg = str(e.value)
        assert "binds no kernel on Qwen3ForCausalLM (model_type 'qwen3')" in msg
        assert "'^Qwen3MoeAttention$'" in msg and "hubfuse.KernelConfig() (the 'qwen3' preset)" in msg
    plain = load(path).train()  # nothing was left half-registered
    assert not any("forward" in m.__dict__ for m in plain.modules())
    assert not any(type(m).__name__.endswith("Layout") for m in plain.modules())


def test_unsupported_family_lists_the_supported_ones(model_dirs):
    with pytest.raises(ValueError) as e:
        one_argument(model_dirs["mistral"])
    assert str(e.value).startswith("hubfuse has no kernels for MistralForCausalLM (model_type 'mistral'); "
                                   "supported model types: qwen3, qwen3_moe, qwen3_5_moe, llama, qwen2")
    with pytest.raises(ValueError, match="supported model types: qwen3, qwen3_moe"):
        hubfuse.KernelConfig(family="mistral")


def test_repo_not_found_names_the_existing_repos(model_dirs):
    with pytest.raises(ValueError) as e:
        one_argument(model_dirs["qwen3"], kernel_mapping={"RMSNorm": "hubfuse/rmsnom:RMSNorm"})
    msg = str(e.value)
    assert "kernel repo 'hubfuse/rmsnom' not found (did you mean 'hubfuse/rmsnorm'?)" in msg
    assert "local builds (LOCAL_KERNELS): hubfuse/cross-entropy, hubfuse/decoder-layer, hubfuse/gated-delta-net, " \
           "hubfuse/hubfuse" in msg
    assert "hubfuse repos known here (the presets and this clone): hubfuse/cross-entropy, hubfuse/decoder-layer, " \
           "hubfuse/gated-delta-net, hubfuse/hubfuse" in msg
    assert "trust_remote_code" not in msg


def test_hub_load_without_local_builds_says_so(model_dirs, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("LOCAL_KERNELS")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # deterministic: no network call, an empty cache
    with pytest.raises(ValueError) as e:
        one_argument(model_dirs["qwen3"])
    msg = str(e.value)
    assert "kernel repo 'hubfuse/rmsnorm' could not be loaded from the hub: ValueError: Version 1 of " \
           "'hubfuse/rmsnorm' is not available in the local cache" in msg
    assert "It is not a local build; local builds (LOCAL_KERNELS): none" in msg
    assert msg.endswith("For this clone's builds call hubfuse.use_local_builds() first, or use "
                        "hubfuse.KernelConfig(local=True)")


def test_unreachable_hub_says_so_and_what_to_do_offline(model_dirs, monkeypatch):
    """Without a network kernels cannot check the publisher and advises trust_remote_code=True, which does not
    help offline: the message says the hub could not be reached and points at the local builds."""
    from huggingface_hub import constants

    monkeypatch.delenv("LOCAL_KERNELS")
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: connection refused
    with pytest.raises(ValueError) as e:
        one_argument(model_dirs["qwen3"])
    msg = str(e.value)
    assert "kernel repo 'hubfuse/rmsnorm' could not be loaded from the hub: the hub could not be reached (or has " \
           "no org 'hubfuse') to check the publisher. It is not a local build; local builds (LOCAL_KERNELS): none" in msg
    assert msg.endswith("Offline, use this clone's builds: call hubfuse.use_local_builds() first, or use "
                        "hubfuse.KernelConfig(local=True); a kernel already in the hub cache loads with HF_HUB_OFFLINE=1")
    assert "trust_remote_code" not in msg


def test_local_argument_builds_and_registers_every_repo(model_dirs, monkeypatch):
    monkeypatch.delenv("LOCAL_KERNELS")
    model = one_argument(model_dirs["qwen3"], local=True)
    assert {"hubfuse/rmsnorm", "hubfuse/rotary", "hubfuse/swiglu", "hubfuse/cross-entropy"} <= set(hubfuse.local_builds())
    assert bound_layers(model) == EXPECTED_BOUND["qwen3"]


def test_version_on_a_local_build_points_to_revision(model_dirs):
    with pytest.raises(ValueError) as e:
        one_argument(model_dirs["qwen3"], kernel_mapping={"RMSNorm": ("hubfuse/rmsnorm:RMSNorm", {"version": 1})})
    msg = str(e.value)
    assert "'hubfuse/rmsnorm' is a local build (LOCAL_KERNELS -> " in msg
    assert "asks for version=1" in msg and "Use {'revision': 'v1'} instead" in msg
    with pytest.raises(ValueError, match="hubfuse.presets.enable_losses: 'hubfuse/cross-entropy' is a local build"):
        presets.enable_losses(load(model_dirs["qwen3"]), "qwen3", version=1)


def test_layer_not_found_lists_the_layers(model_dirs):
    with pytest.raises(ValueError) as e:
        one_argument(model_dirs["qwen3"], kernel_mapping={"RMSNorm": "hubfuse/rmsnorm:RMSNorn"})
    assert str(e.value).endswith("kernel repo 'hubfuse/rmsnorm' has no layer 'RMSNorn' (did you mean 'RMSNorm'?); "
                                 "its layers: RMSNorm, RMSNormGated, RMSNormZeroCentered")


def test_plain_values_and_local_builds_pick_revision(model_dirs):
    # no revision / version: the local build is used (revision "v1"), the same mapping serves the hub (version 1)
    mapping = {"RMSNorm": "hubfuse/rmsnorm:RMSNorm", "^Qwen3Attention$": "hubfuse/rotary:QKNormRopeAttention"}
    model = one_argument(model_dirs["qwen3"], kernel_mapping=mapping).train()
    assert bound_layers(model) == {"RMSNorm": 5, "QKNormRopeAttention": 2}
    assert model(**make_batch(96)).logits is not None  # an explicit mapping leaves the loss alone ...
    model = one_argument(model_dirs["qwen3"], kernel_mapping=mapping, losses=True)
    assert model(**make_batch(96)).logits is None  # ... unless asked


def test_an_entry_that_matches_nothing_is_said_once(model_dirs, caplog):
    mapping = {"RMSNorm": "hubfuse/rmsnorm:RMSNorm", "^Qwen3Atention$": "hubfuse/rotary:QKNormRopeAttention",
               "^Qwen3MoeRMSNorm$": "hubfuse/rmsnorm:RMSNorm"}
    with caplog.at_level(logging.WARNING):
        model = one_argument(model_dirs["qwen3"], kernel_mapping=mapping)
    records = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.getMessage() for r in records] == [
        "hubfuse.KernelConfig: 2 mapping entries match no module of Qwen3ForCausalLM and are ignored: "
        "'^Qwen3Atention$', '^Qwen3MoeRMSNorm$'"]
    assert bound_layers(model) == {"RMSNorm": 9}  # no attention Layout: q_norm / k_norm are Qwen3RMSNorm too


@pytest.mark.parametrize("family", FAMILIES)
def test_kernelized_load_and_training_are_quiet(family, model_dirs, caplog, capfd):
    """No warning from a load with the default preset (Qwen3-MoE without dense layers leaves its optional
    `^Qwen3MoeMLP$` entry unbound; SiLU and the gated-delta-rule hub layers stay deliberately unmapped), a
    train/eval switch and a training step."""
    with caplog.at_level(logging.INFO):
        model = one_argument(model_dirs[family]).train()
        model(**make_batch(tiny_config(family).vocab_size)).loss.backward()
        model.eval()
        model.train()
        kc = hubfuse.KernelConfig(presets.kernel_mapping(family))
        AutoModelForCausalLM.from_pretrained(model_dirs[family], use_kernels=True, kernel_config=kc)
    warnings = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == []
    out, err = capfd.readouterr()
    assert "WARNING" not in out + err and "No kernel mapping found" not in out + err


def test_qwen3_5_load_gives_no_advice_to_install_what_hubfuse_replaces(model_dirs):
    """transformers advises installing flash-linear-attention / causal-conv1d when its own Gated DeltaNet torch
    path runs; with hubfuse's GatedDeltaNet Layout bound that path does not run: no such advice on load, train,
    eval or generation. The plain load shows the advice, so the check can see it."""
    from transformers.utils import logging as hf_logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    hf_root = logging.getLogger("transformers")
    hf_root.addHandler(handler)
    batch = make_batch(tiny_config("qwen3_5_moe_text").vocab_size, seq=5)

    def advice(model):
        hf_logging.get_logger("transformers").warning_once.cache_clear()  # shown once per process otherwise
        records.clear()
        model.train()
        model(**batch).loss.backward()
        model.eval().generate(batch["input_ids"][:1, :3], max_new_tokens=2, do_sample=False)
        return [r.getMessage() for r in records if "is not installed" in r.getMessage()]

    try:
        assert any("flash-linear-attention" in m for m in advice(load(model_dirs["qwen3_5_moe_text"])))
        assert advice(one_argument(model_dirs["qwen3_5_moe_text"])) == []
    finally:
        hf_root.removeHandler(handler)
