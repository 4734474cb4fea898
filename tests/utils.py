"""Shared helpers for whole-model tests: build + register local kernel repos, tiny models, parity checks.

Typical use::

    from tests.utils import register_local_kernels, save_tiny_model, load, assert_parity
    register_local_kernels("rmsnorm")                      # builds it and points LOCAL_KERNELS at it
    path = save_tiny_model("qwen3", tmp_path)
    eager = load(path)
    ours = load(path, {"RMSNorm": hub("rmsnorm", "RMSNorm")})
    assert_parity(eager, ours, batch)
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ORG = "hubfuse"
REVISION = "v1"
_BUILT: set[str] = set()


def build(*names: str) -> None:
    """Build kernel repos once per test process (scripts/build.py, with its load + layer-rule checks)."""
    todo = [n for n in names if n not in _BUILT]
    if todo:
        subprocess.run([sys.executable, str(ROOT / "scripts" / "build.py"), *todo], check=True, cwd=ROOT)
        _BUILT.update(todo)


def repo_dir(name: str) -> Path:
    return ROOT if name == "hubfuse" else ROOT / "kernel_repos" / name


def register_local_kernels(*names: str) -> None:
    """Build `names` and make `hubfuse/<name>` resolve to the local build through LOCAL_KERNELS."""
    build(*names)
    entries = dict(e.split("=", 1) for e in os.environ.get("LOCAL_KERNELS", "").split(":") if "=" in e)
    for name in names:
        entries[f"{ORG}/{name}"] = str(repo_dir(name))
    os.environ["LOCAL_KERNELS"] = ":".join(f"{k}={v}" for k, v in entries.items())


@pytest.fixture(scope="module", autouse=True)
def every_kernel_registered():
    """Every kernel repo of this clone built and in LOCAL_KERNELS, for the module that imports this fixture."""
    from hubfuse.build import families

    register_local_kernels(*families())


def hub(repo: str, layer: str):
    """A KernelConfig value for a local build: ("hubfuse/<repo>:<layer>", {"revision": "v1"})."""
    return (f"{ORG}/{repo}:{layer}", {"revision": REVISION})


def tiny_config(family: str, **overrides):
    """Tiny but complete text configs (fp32, 2-3 layers) for qwen3, qwen3_moe, qwen3_5_moe, llama, qwen2."""
    from transformers import AutoConfig

    common = dict(vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)
    if family == "qwen3":
        kw = dict(common, intermediate_size=96, num_hidden_layers=2)
    elif family == "qwen3_moe":
        kw = dict(common, intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                  num_hidden_layers=2, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                  router_aux_loss_coef=0.01)
    elif family == "qwen3_5_moe_text":
        kw = dict(common, head_dim=32, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                  num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                  layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
                  linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                  linear_num_value_heads=4, router_aux_loss_coef=0.01, partial_rotary_factor=0.25)
    elif family in ("llama", "qwen2"):
        kw = dict(common, intermediate_size=96, num_hidden_layers=2)
    else:
        raise ValueError(f"unknown family {family}")
    kw.update(overrides)
    return AutoConfig.for_model(family, **kw)


FAMILIES = ("qwen3", "qwen3_moe", "qwen3_5_moe_text")


def save_tiny_model(family: str, directory: Path, seed: int = 0, **overrides) -> Path:
    """Random-initialised tiny causal LM saved with save_pretrained; weights perturbed away from init values
    (norm weights are ones/zeros at init, which would hide cast-order and (1+w) mistakes)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    path = Path(directory) / family
    model.save_pretrained(path)
    return path


def load(path, mapping=None, dtype=torch.float32, device="cpu", **kwargs):
    """Plain eager load, or a kernelized one through hubfuse.KernelConfig when `mapping` is given."""
    from transformers import AutoModelForCausalLM

    if str(device) != "cpu":
        kwargs["device_map"] = device  # kernelize sees the final device (needs accelerate)
    if mapping is None:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    from hubfuse import KernelConfig

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_kernels=True,
                                                kernel_config=KernelConfig(mapping), **kwargs)


def make_batch(vocab_size: int, batch: int = 2, seq: int = 7, device="cpu", seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=g)
    return {"input_ids": ids.to(device), "labels": ids.clone().to(device)}


def forward_backward(model, batch, **kwargs):
    """Loss, logits (None where the fused loss computed none) and every parameter gradient (by name) of one
    training step; `kwargs` go to the model's forward with the batch."""
    model.zero_grad(set_to_none=True)
    out = model(**batch, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), None if out.logits is None else out.logits.detach(), grads


def assert_parity(reference, candidate, batch, atol=2e-5, rtol=2e-5):
    """Loss, logits and all grads of `candidate` match `reference` (same weights) within tolerance."""
    loss_r, logits_r, grads_r = forward_backward(reference, batch)
    loss_c, logits_c, grads_c = forward_backward(candidate, batch)
    torch.testing.assert_close(logits_c, logits_r, atol=atol, rtol=rtol)
    torch.testing.assert_close(loss_c, loss_r, atol=atol, rtol=rtol)
    assert grads_c.keys() == grads_r.keys(), set(grads_c) ^ set(grads_r)
    for name in grads_r:
        torch.testing.assert_close(grads_c[name], grads_r[name], atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
    return loss_r


def modules_running(model, layer_name: str) -> list[str]:
    """Names of modules whose forward is bound to the kernel layer `layer_name` (what kernelize did)."""
    names = []
    for name, module in model.named_modules():
        fwd = module.__dict__.get("forward")
        func = getattr(fwd, "__func__", None)
        if func is not None and func.__qualname__.split(".")[0] == layer_name:
            names.append(name)
    return names


def assert_compiled_parity(reference, compiled, batch, atol=2e-5, rtol=2e-5):
    """Loss, logits and every grad of a `torch.compile`d model equal the reference's (compile's
    `_orig_mod.` prefix stripped from parameter names)."""
    loss_r, logits_r, grads_r = forward_backward(reference, batch)
    loss_c, logits_c, grads_c = forward_backward(compiled, batch)
    torch.testing.assert_close(logits_c, logits_r, atol=atol, rtol=rtol)
    torch.testing.assert_close(loss_c, loss_r, atol=atol, rtol=rtol)
    grads_c = {k.removeprefix("_orig_mod."): v for k, v in grads_c.items()}
    assert grads_c.keys() == grads_r.keys()
    for k in grads_r:
        torch.testing.assert_close(grads_c[k], grads_r[k], atol=atol, rtol=rtol)


def sharpen_attention(path, factor: float = 10.0) -> None:
    """Scale q_proj / k_proj of a saved model in place. Models without q/k norm (Llama, Qwen2) at init scale
    have near-uniform attention, so RoPE would not show in the logits; this makes positions matter."""
    model = load(path)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(factor)
    model.save_pretrained(path)


def assert_resave_keeps_checkpoint(path, mapping, tmp_path) -> Path:
    """A kernelized load of `path` saved again writes the original keys with bit-identical values. Returns the
    re-saved directory."""
    resaved = Path(tmp_path) / "resaved"
    load(path, mapping).save_pretrained(resaved)
    assert_saved_checkpoints_equal(path, resaved)
    return resaved


def assert_saved_checkpoints_equal(original_dir, resaved_dir) -> None:
    """Two save_pretrained directories hold the same keys with bit-identical values."""
    from safetensors.torch import load_file

    original = load_file(Path(original_dir) / "model.safetensors")
    resaved = load_file(Path(resaved_dir) / "model.safetensors")
    assert original.keys() == resaved.keys()
    for key in original:
        assert torch.equal(original[key], resaved[key]), key


def rope_function(family: str):
    """The module-global `apply_rotary_pos_emb` of a model family (a kernels function-layer instance where the
    family's modeling file carries the hub name)."""
    import importlib

    return importlib.import_module(f"transformers.models.{family}.modeling_{family}").apply_rotary_pos_emb


def rope_bound(family: str) -> bool:
    """Whether kernelize bound our `RotaryPosEmb` to the family's `apply_rotary_pos_emb`."""
    fwd = rope_function(family).__dict__.get("forward")
    return getattr(getattr(fwd, "__func__", None), "__qualname__", "").startswith("RotaryPosEmb.")


def restore_rope_functions(saved: dict) -> None:
    """Put back the forwards saved as {family: rope_function(family).__dict__.get("forward")}: kernelize binds
    the kernel onto the module-global instance, which outlives the model."""
    for family, fwd in saved.items():
        fn = rope_function(family)
        if fwd is None:
            fn.__dict__.pop("forward", None)
        else:
            fn.forward = fwd


def assert_same_weights_and_logits(a, b, batch) -> None:
    """Two loaded models hold bitwise-equal state dicts (same keys) and give bitwise-equal logits."""
    sd_a, sd_b = a.state_dict(), b.state_dict()
    assert sd_a.keys() == sd_b.keys()
    for k in sd_a:
        assert torch.equal(sd_a[k], sd_b[k]), k
    torch.testing.assert_close(b(**batch).logits, a(**batch).logits, atol=0, rtol=0)
