"""A checkpoint that lacks some weights, loaded with hubfuse.KernelConfig: the Layouts' missing parameters get the
initialisation transformers gives the classes they replace (not uninitialised memory, not the generic "*RMSNorm*"
ones for zero-centred norms), and every loaded parameter keeps the checkpoint's value."""
import glob
import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from hubfuse import presets
from tests.utils import REVISION, load, register_local_kernels, save_tiny_model

CASES = {  # tiny config -> preset
    "qwen3_moe": "qwen3_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
}
DROPPED = ("experts", "A_log", "dt_bias", "norm", "mlp.gate.weight")


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    register_local_kernels("rmsnorm", "rotary", "swiglu", "moe", "load-balancing-loss", "cross-entropy",
                           "gated-delta-net")


@pytest.mark.parametrize("family", CASES)
def test_missing_layout_parameters_get_transformers_init(family, tmp_path):
    path = save_tiny_model(family, tmp_path)
    (shard,) = glob.glob(os.path.join(path, "*.safetensors"))
    saved = load_file(shard)
    kept = {k: v for k, v in saved.items() if not any(d in k for d in DROPPED)}
    assert len(kept) < len(saved)
    save_file(kept, shard, metadata={"format": "pt"})
    model = load(path, presets.kernel_mapping(CASES[family], revision=REVISION))
    std = model.config.initializer_range
    params = dict(model.named_parameters())
    for name, p in params.items():
        assert torch.isfinite(p).all(), f"{name}: not finite"
        if name in kept:
            torch.testing.assert_close(p, kept[name].to(p.dtype), atol=0, rtol=0, msg=lambda m: f"{name}: {m}")
    zero_centred = family == "qwen3_5_moe_text"
    for name, p in params.items():
        if name in kept:
            continue
        if ".experts." in name or name.endswith("mlp.gate.weight"):
            assert abs(p.float().std().item() - std) < 0.25 * std, f"{name}: std {p.float().std().item()}"
        elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith("A_log"):
            assert ((p >= math.log(0.01) - 1e-6) & (p <= math.log(16) + 1e-6)).all(), name
        elif "norm" in name:
            assert torch.equal(p, torch.zeros_like(p) if zero_centred else torch.ones_like(p)), name
