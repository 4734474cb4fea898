"""The transformers internals hubfuse relies on (`hubfuse/_transformers_private.py`) are still there, with the
names, types and signatures read from transformers 5.22.2; and nothing else of transformers is wrapped.

A failure here means transformers changed one of them: re-read that part of transformers and update
`_transformers_private.py` (and its TRANSFORMERS_VERSION) rather than loosening the test.
"""
import inspect
import re
import subprocess
import sys
import threading

import transformers

from hubfuse import _transformers_private as private
from tests.utils import ROOT


def test_version_read_from():
    assert private.TRANSFORMERS_VERSION == "5.22.2"
    assert transformers.__version__ == private.TRANSFORMERS_VERSION, (
        f"transformers {transformers.__version__}: re-check every access in hubfuse/_transformers_private.py")


def test_registration_call_is_imported_at_call_time_with_its_signature():
    from transformers.integrations import hub_kernels
    from transformers.modeling_utils import PreTrainedModel

    stock = hub_kernels.register_kernel_replacements_and_fusions
    stock = getattr(stock, "__wrapped__", stock)
    assert list(inspect.signature(stock).parameters) == ["cls", "config", "kernel_config"]
    source = inspect.getsource(PreTrainedModel.from_pretrained.__func__)
    # imported inside from_pretrained (so the module attribute is what runs), then called with (cls, config, ...)
    assert "from .integrations.hub_kernels import register_kernel_replacements_and_fusions" in source
    assert "register_kernel_replacements_and_fusions(cls, config, kernel_config)" in source
    # the mapping is read by the registration, and rewritten by it: resolving it before is in time
    reg_source = inspect.getsource(stock)
    assert "kernel_config.kernel_mapping.items()" in reg_source and "kernel_config.kernel_mapping = " in reg_source


def test_global_registries_have_the_expected_types():
    from transformers import conversion_mapping, monkey_patching
    from transformers.utils import output_capturing

    assert isinstance(monkey_patching._monkey_patch_mapping_cache, dict)
    assert isinstance(monkey_patching._monkey_patch_lock, type(threading.Lock()))
    for name in ("get_patch_mapping", "register_patch_mapping", "apply_patches", "patch_output_recorders"):
        assert callable(getattr(monkey_patching, name)), name
    conversion_mapping.get_checkpoint_conversion_mapping("llama")
    assert isinstance(conversion_mapping._checkpoint_conversion_mapping_cache, dict)
    assert isinstance(conversion_mapping.USER_REGISTERED_MAPPINGS, set)
    assert "target_class" in output_capturing.OutputRecorder.__annotations__
    assert list(inspect.signature(output_capturing.install_all_output_capturing_hooks).parameters)[0] == "model"
    assert "_output_capturing_hooks_installed" in inspect.getsource(output_capturing.install_all_output_capturing_hooks)
    # the stand-in recorders (the decoder-layer Layout's attention): the registry, one hook's installer, and
    # transformers' default index of a class spec
    assert isinstance(output_capturing._CAN_RECORD_REGISTRY, dict)
    assert list(inspect.signature(output_capturing.install_output_capuring_hook).parameters)[:3] == \
        ["module", "key", "index"]
    assert 'index = 0 if "hidden_states" in key else 1' in \
        inspect.getsource(output_capturing.install_all_output_capturing_hooks)
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    assert isinstance(modeling_qwen3_moe.Qwen3MoePreTrainedModel.__dict__["_can_record_outputs"], dict)


def test_global_state_restores_what_a_registration_changes():
    import torch
    from transformers import conversion_mapping, monkey_patching
    from transformers.core_model_loading import WeightRenaming
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    class Replacement(torch.nn.Module):
        pass

    cls = modeling_qwen3_moe.Qwen3MoePreTrainedModel
    recorders = {k: list(v) if isinstance(v, list) else v for k, v in cls.__dict__["_can_record_outputs"].items()}
    state = private.GlobalState()
    monkey_patching.register_patch_mapping({"^Qwen3MoeExperts$": Replacement}, overwrite=True)
    conversion_mapping.register_checkpoint_conversion_mapping(
        "qwen3_moe", [WeightRenaming(source_patterns="a", target_patterns="b")], overwrite=True)
    modeling_qwen3_moe.Qwen3MoeMLP = Replacement  # what apply_patches leaves behind when a build raises
    cls.__dict__["_can_record_outputs"]["router_logits"] = Replacement
    state.restore()
    assert "^Qwen3MoeExperts$" not in monkey_patching.get_patch_mapping()
    assert "qwen3_moe" not in conversion_mapping.USER_REGISTERED_MAPPINGS
    assert modeling_qwen3_moe.Qwen3MoeMLP is not Replacement and modeling_qwen3_moe.Qwen3MoeMLP.__name__ == "Qwen3MoeMLP"
    assert cls.__dict__["_can_record_outputs"] == recorders


def test_from_pretrained_is_stock_after_import_and_a_kernelized_load(tmp_path):
    """In a fresh process: `import hubfuse`, a hubfuse-kernelized load, then `PreTrainedModel.from_pretrained` is
    the object transformers defined (nothing wraps it), and only the registration call is hooked."""
    script = f"""
import sys
from transformers.modeling_utils import PreTrainedModel
stock = PreTrainedModel.__dict__["from_pretrained"]
import hubfuse
from tests.utils import load, register_local_kernels, save_tiny_model
register_local_kernels("rmsnorm")
path = save_tiny_model("qwen3", __import__("pathlib").Path({str(tmp_path)!r}))
model = load(path, {{"^Qwen3RMSNorm$": ("hubfuse/rmsnorm:RMSNorm", {{"revision": "v1"}})}})
assert any(type(m).__name__ == "RMSNormLayout" for m in model.modules())
assert PreTrainedModel.__dict__["from_pretrained"] is stock
assert PreTrainedModel.from_pretrained.__func__.__module__ == "transformers.modeling_utils"
assert not hasattr(PreTrainedModel.from_pretrained.__func__, "__wrapped__")
from transformers.integrations import hub_kernels
assert hub_kernels.register_kernel_replacements_and_fusions.__wrapped__.__module__ == hub_kernels.__name__
print("stock")
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("stock")


def test_no_frame_inspection_in_the_sources():
    pattern = re.compile(r"_getframe|f_locals|f_back")
    hits = [f"{p.relative_to(ROOT)}:{i}" for base in ("torch-ext", "kernel_repos") for p in (ROOT / base).rglob("*.py")
            if "build" not in p.relative_to(ROOT).parts
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []


def test_private_accesses_live_in_one_module():
    """Only `_transformers_private.py` touches transformers' underscore names (the attribute reads that would break
    silently)."""
    pattern = re.compile(r"(monkey_patching|conversion_mapping|output_capturing|hub_kernels)\._[a-z]")
    hits = [str(p.relative_to(ROOT)) for p in (ROOT / "torch-ext" / "hubfuse").glob("*.py")
            if p.name != "_transformers_private.py" and pattern.search(p.read_text())]
    assert hits == []
