"""RMSNorm family through transformers: tiny Qwen3 / Qwen3-MoE / Qwen3.5-MoE loaded with hubfuse.KernelConfig.

Hub-name keys (stateless layers) and anchored class keys (Layouts); logits and every gradient against a
plain eager load, in eval and after `model.train()`; the kernels stay bound after `train()`; save_pretrained
writes the original keys and values; a later plain load is untouched; no regex over-matching.
"""
import pytest
import torch

from tests.utils import (assert_parity, assert_resave_keeps_checkpoint, hub, load, make_batch, modules_running,
                         register_local_kernels, save_tiny_model, tiny_config)

HUB_NAME_MAPPINGS = {
    "qwen3": {"RMSNorm": hub("rmsnorm", "RMSNorm")},
    "qwen3_moe": {"RMSNorm": hub("rmsnorm", "RMSNorm")},
    "qwen3_5_moe_text": {"RMSNormZeroCentered": hub("rmsnorm", "RMSNormZeroCentered"),
                         "RMSNormGated": hub("rmsnorm", "RMSNormGated")},
}
LAYOUT_MAPPINGS = {
    "qwen3": {"^Qwen3RMSNorm$": hub("rmsnorm", "RMSNorm")},
    "qwen3_moe": {"^Qwen3MoeRMSNorm$": hub("rmsnorm", "RMSNorm")},
    "qwen3_5_moe_text": {"^Qwen3_5MoeRMSNorm$": hub("rmsnorm", "RMSNormZeroCentered"),
                         "^Qwen3_5MoeRMSNormGated$": hub("rmsnorm", "RMSNormGated")},
}
# modules per tiny model (2 layers): 2 per layer + 2 q/k norms per attention layer + the final norm
EXPECTED_BOUND = {
    "qwen3": {"RMSNorm": 9},
    "qwen3_moe": {"RMSNorm": 9},
    "qwen3_5_moe_text": {"RMSNormZeroCentered": 7, "RMSNormGated": 1},
}


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    register_local_kernels("rmsnorm", "hubfuse")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    return {fam: save_tiny_model(fam, d) for fam in HUB_NAME_MAPPINGS}


def _bound(model):
    return {name: n for name in ("RMSNorm", "RMSNormZeroCentered", "RMSNormGated")
            if (n := len(modules_running(model, name)))}


@pytest.mark.parametrize("style", ["hub_name", "layout"])
@pytest.mark.parametrize("family", list(HUB_NAME_MAPPINGS))
def test_parity_eval_and_train(family, style, model_dirs):
    mapping = (HUB_NAME_MAPPINGS if style == "hub_name" else LAYOUT_MAPPINGS)[family]
    path = model_dirs[family]
    eager, ours = load(path), load(path, mapping)
    batch = make_batch(tiny_config(family).vocab_size)
    assert not ours.training
    assert _bound(ours) == EXPECTED_BOUND[family]
    assert_parity(eager, ours, batch)
    ours.train(), eager.train()
    # stock transformers drops every kernel here; hubfuse.KernelConfig keeps them
    assert _bound(ours) == EXPECTED_BOUND[family]
    assert_parity(eager, ours, batch)
    ours.eval()
    assert _bound(ours) == EXPECTED_BOUND[family]


def test_layout_classes_replace_only_anchored_names(model_dirs):
    ours = load(model_dirs["qwen3_5_moe_text"], {"^Qwen3_5MoeRMSNorm$": hub("rmsnorm", "RMSNormZeroCentered")})
    types = {type(m).__name__ for m in ours.modules()}
    assert "RMSNormZeroCenteredLayout" in types
    assert "Qwen3_5MoeRMSNormGated" in types  # not over-matched by ^Qwen3_5MoeRMSNorm$
    assert "Qwen3_5MoeRMSNorm" not in types


@pytest.mark.parametrize("family", list(HUB_NAME_MAPPINGS))
def test_save_pretrained_writes_original_keys_and_values(family, model_dirs, tmp_path):
    assert_resave_keeps_checkpoint(model_dirs[family], LAYOUT_MAPPINGS[family], tmp_path)


def test_later_plain_load_is_untouched(model_dirs):
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.monkey_patching import get_patch_mapping

    before_patches = get_patch_mapping()
    before_conv = repr(get_checkpoint_conversion_mapping("qwen3_5_moe_text"))  # transforms lack __eq__
    path = model_dirs["qwen3_5_moe_text"]
    ours = load(path, LAYOUT_MAPPINGS["qwen3_5_moe_text"])
    assert any(type(m).__name__ == "RMSNormZeroCenteredLayout" for m in ours.modules())
    assert get_patch_mapping() == before_patches
    assert repr(get_checkpoint_conversion_mapping("qwen3_5_moe_text")) == before_conv
    plain = load(path)
    types = {type(m).__name__ for m in plain.modules()}
    assert "Qwen3_5MoeRMSNorm" in types and not any(t.endswith("Layout") for t in types)
    assert not _bound(plain)


def test_output_recorders_restored_after_patching(model_dirs):
    # patch_output_recorders edits class-level recorders in place; restore_global_state must undo it so
    # that a later plain model still records router logits (and so still gets its aux loss)
    from hubfuse import restore_global_state
    from transformers.models.qwen3_moe import modeling_qwen3_moe as M
    from transformers.monkey_patching import patch_output_recorders, register_patch_mapping

    class StandInRouter(M.Qwen3MoeTopKRouter):
        pass

    path = model_dirs["qwen3_moe"]
    with restore_global_state():
        register_patch_mapping({"^Qwen3MoeTopKRouter$": StandInRouter}, overwrite=True)
        patch_output_recorders(load(path))
        recorder = M.Qwen3MoeModel._can_record_outputs["router_logits"]
        assert recorder.target_class is StandInRouter  # the leak this guards against
    assert M.Qwen3MoeModel._can_record_outputs["router_logits"].target_class is M.Qwen3MoeTopKRouter
    plain = load(path)
    out = plain(**make_batch(tiny_config("qwen3_moe").vocab_size), output_router_logits=True)
    assert out.router_logits is not None and len(out.router_logits) == 2 and out.aux_loss is not None


def test_config_object_reusable_for_two_loads(model_dirs):
    from hubfuse import KernelConfig

    from transformers import AutoModelForCausalLM

    kc = KernelConfig(HUB_NAME_MAPPINGS["qwen3"])
    a = AutoModelForCausalLM.from_pretrained(model_dirs["qwen3"], use_kernels=True, kernel_config=kc)
    b = AutoModelForCausalLM.from_pretrained(model_dirs["qwen3"], use_kernels=True, kernel_config=kc)
    assert _bound(a) == _bound(b) == EXPECTED_BOUND["qwen3"]
    assert kc.kernel_mapping == HUB_NAME_MAPPINGS["qwen3"]
    a.train()
    assert _bound(a) == EXPECTED_BOUND["qwen3"]


def test_umbrella_kernel_serves_the_same_layers(model_dirs):
    path = model_dirs["qwen3_5_moe_text"]
    mapping = {"RMSNormZeroCentered": ("hubfuse/hubfuse:RMSNormZeroCentered", {"revision": "v1"}),
               "RMSNormGated": ("hubfuse/hubfuse:RMSNormGated", {"revision": "v1"})}
    ours = load(path, mapping)
    ours.train()
    assert _bound(ours) == EXPECTED_BOUND["qwen3_5_moe_text"]
    assert_parity(load(path).train(), ours, make_batch(tiny_config("qwen3_5_moe_text").vocab_size))


def test_torch_compile_fullgraph_over_kernelized_model(model_dirs):
    torch._dynamo.reset()
    path = model_dirs["qwen3"]
    ours = load(path, HUB_NAME_MAPPINGS["qwen3"])
    ids = make_batch(tiny_config("qwen3").vocab_size)["input_ids"]
    want = ours(input_ids=ids).logits
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(HUB_NAME_MAPPINGS))
def test_gpu_bf16_parity(family, model_dirs):
    path = model_dirs[family]
    eager = load(path, dtype=torch.bfloat16, device="cuda").train()
    ours = load(path, HUB_NAME_MAPPINGS[family], dtype=torch.bfloat16, device="cuda").train()
    assert _bound(ours) == EXPECTED_BOUND[family]
    batch = make_batch(tiny_config(family).vocab_size, device="cuda")
    assert_parity(eager, ours, batch, atol=3e-2, rtol=3e-2)


def test_failed_load_is_undone_by_the_next_load(model_dirs):
    # A Layout whose __init__ cannot take the replaced class's arguments makes the model build raise inside
    # transformers' apply_patches (no try/finally): its class swaps and patch mappings stay behind.
    from transformers.models.qwen3 import modeling_qwen3 as M
    from transformers.monkey_patching import get_patch_mapping

    path = model_dirs["qwen3"]
    with pytest.raises(Exception):
        load(path, {"^Qwen3MLP$": hub("rmsnorm", "RMSNorm")})
    assert M.Qwen3MLP.__name__ == "RMSNormLayout"  # the leak, as stock transformers leaves it
    ours = load(path, HUB_NAME_MAPPINGS["qwen3"])  # the next hubfuse load cleans up first
    assert M.Qwen3MLP.__name__ == "Qwen3MLP" and get_patch_mapping() == {}
    assert_parity(load(path), ours, make_batch(tiny_config("qwen3").vocab_size))
    plain = load(path)
    assert not any(type(m).__name__.endswith("Layout") for m in plain.modules())


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_moe_text"])
def test_one_mapping_for_every_family_selects_exact_classes(family, model_dirs):
    # The mapping: all three hub names at once. Stock transformers treats "RMSNorm" as a regex
    # (the kernel ships a Layout) and swaps Qwen3.5's zero-centred and gated norms for the standard one.
    mapping = {"RMSNorm": hub("rmsnorm", "RMSNorm"),
               "RMSNormZeroCentered": hub("rmsnorm", "RMSNormZeroCentered"),
               "RMSNormGated": hub("rmsnorm", "RMSNormGated")}
    path = model_dirs[family]
    ours = load(path, mapping).train()
    types = {type(m).__name__ for m in ours.modules() if "Norm" in type(m).__name__}
    want = ({"RMSNormLayout"} if family == "qwen3" else {"RMSNormZeroCenteredLayout", "RMSNormGatedLayout"})
    assert types == want
    assert _bound(ours) == EXPECTED_BOUND[family]
    assert_parity(load(path).train(), ours, make_batch(tiny_config(family).vocab_size))
