"""Hooks and adapters on the submodules that hubfuse's fused ops read the parameters of.

The attention (one autograd node, or the per-op path's fused q/k/v projections and q/k norm + RoPE) and the SwiGLU
MLPs (1-to-1 Layout and the RMSNorm + MLP fusion) compute the projections from their weights. A hook on one of those
modules, or a wrapper in its place (a LoRA / PEFT layer computes `base(x) + delta(x)` and exposes the base weight as
`.weight`), must still take effect: a kernelized model with the hook or adapter equals the stock model with the same
hook or adapter, loss, logits and gradients, on the torch path and on the Triton path. Before these checks the MLP
ignored both (the logits did not change).
"""
import pytest
import torch
from torch import nn

from hubfuse import presets
from tests.utils import load, make_batch, register_local_kernels, save_tiny_model

FAMILIES = ["qwen3", "llama", "qwen2", "qwen3-unfused"]  # qwen3-unfused: the 1-to-1 SwiGLUMLP Layout


class Adapter(nn.Module):
    """A LoRA-like wrapper: `base(x) + x @ delta^T`, with the base layer's `weight` / `bias` exposed as PEFT does."""

    def __init__(self, base: nn.Linear, delta: torch.Tensor):
        super().__init__()
        self.base_layer = base
        self.delta = nn.Parameter(delta.clone())

    @property
    def weight(self):
        return self.base_layer.weight

    @property
    def bias(self):
        return self.base_layer.bias

    def forward(self, x):
        return self.base_layer(x) + x @ self.delta.t()


class _InstanceForward:
    """A handle that removes an instance-level `forward`."""

    def __init__(self, module):
        self.module = module

    def remove(self):
        del self.module.forward


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hooks")
    return {family: save_tiny_model(family, root) for family in ("qwen3", "llama", "qwen2")}


def _models(family, model_dirs):
    base = family.split("-")[0]
    register_local_kernels(*presets.kernel_repos(base))
    mapping = presets.kernel_mapping(base, revision="v1", fuse_norm_mlp=family != "qwen3-unfused")
    stock = load(model_dirs[base]).train()
    ours = load(model_dirs[base], mapping).train()
    return stock, ours


def _mlp_name(ours, i: int, proj: str) -> str:
    """Where a projection of layer i's MLP lives in the kernelized model (the fusion moves it under the norm)."""
    fused = f"model.layers.{i}.post_attention_layernorm.{proj}"
    return fused if hasattr(ours.get_submodule(f"model.layers.{i}.post_attention_layernorm"), proj) \
        else f"model.layers.{i}.mlp.{proj}"


def _swap(model, name: str, make):
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    setattr(parent, attr, make(getattr(parent, attr)))


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), out.logits.detach()


def _close(a, b, what):
    torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5, msg=lambda m: f"{what}: {m}")


@pytest.fixture(params=["torch", "triton"])
def path(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return request.param


@pytest.mark.parametrize("kind", ["forward", "backward", "instance-forward"])
@pytest.mark.parametrize("family", FAMILIES)
def test_hooks_take_effect(family, kind, path, model_dirs):
    """Forward hooks that scale q_proj's, down_proj's (and Qwen3's q_norm's) outputs, the same scaling as an
    instance-level `forward` of the two Linears (as accelerate installs its hooks), or full backward hooks alone
    that scale q_proj's and down_proj's input gradients: the kernelized model equals the stock one with the same
    hooks (loss, logits, the embedding's gradient, which every backward hook scales), and differs from itself
    without them (the hooks do act)."""
    stock, ours = _models(family, model_dirs)
    batch = make_batch(stock.config.vocab_size)
    _, plain_logits = _step(ours, batch)
    plain_embed = ours.model.embed_tokens.weight.grad.clone()
    counts = {"stock": 0, "ours": 0}

    def forward_hook(module, args, output):
        return output * 0.5

    def backward_hook(key):
        def hook(module, grad_input, grad_output):
            counts[key] += 1
            return tuple(g * 0.25 if g is not None else None for g in grad_input)
        return hook

    handles = []
    for key, model in (("stock", stock), ("ours", ours)):
        for i in range(model.config.num_hidden_layers):
            down = f"model.layers.{i}.mlp.down_proj" if model is stock else _mlp_name(ours, i, "down_proj")
            targets = [f"model.layers.{i}.self_attn.q_proj", down]
            if kind == "forward":
                if family.startswith("qwen3"):
                    targets.append(f"model.layers.{i}.self_attn.q_norm")
                handles += [model.get_submodule(name).register_forward_hook(forward_hook) for name in targets]
            elif kind == "instance-forward":  # what accelerate's hooks do: the instance's own forward
                for name in targets:
                    linear = model.get_submodule(name)
                    linear.forward = lambda x, m=linear: forward_hook(m, (x,), nn.Linear.forward(m, x))
                    handles.append(_InstanceForward(linear))
            else:
                handles += [model.get_submodule(name).register_full_backward_hook(backward_hook(key))
                            for name in targets]
    try:
        loss_s, logits_s = _step(stock, batch)
        embed_s = stock.model.embed_tokens.weight.grad.clone()
        loss_o, logits_o = _step(ours, batch)
        embed_o = ours.model.embed_tokens.weight.grad.clone()
    finally:
        for h in handles:
            h.remove()
    if kind != "backward":
        assert not torch.allclose(logits_o, plain_logits), "the forward hooks changed nothing"
    else:
        assert not torch.allclose(embed_o, plain_embed), "the backward hooks changed nothing"
        assert counts["ours"] == counts["stock"] == 2 * stock.config.num_hidden_layers, counts
    _close(logits_o, logits_s, "logits")
    _close(loss_o, loss_s, "loss")
    _close(embed_o, embed_s, "embedding gradient")


@pytest.mark.parametrize("family", FAMILIES)
def test_adapters_take_effect(family, path, model_dirs):
    """LoRA-like wrappers on q_proj, o_proj, down_proj and the MLP's fused gate/up projection (on the stock model:
    the matching halves on gate_proj and up_proj): loss, logits and the adapters' gradients equal the stock
    model's."""
    stock, ours = _models(family, model_dirs)
    batch = make_batch(stock.config.vocab_size)
    plain_loss, plain_logits = _step(ours, batch)
    gen = torch.Generator().manual_seed(0)
    deltas = {}
    for i in range(stock.config.num_hidden_layers):
        for proj in ("q_proj", "o_proj"):
            name = f"model.layers.{i}.self_attn.{proj}"
            base = stock.get_submodule(name)
            deltas[(name, name)] = torch.randn(base.out_features, base.in_features, generator=gen) * 0.05
        down = stock.get_submodule(f"model.layers.{i}.mlp.down_proj")
        deltas[(f"model.layers.{i}.mlp.down_proj", _mlp_name(ours, i, "down_proj"))] = \
            torch.randn(down.out_features, down.in_features, generator=gen) * 0.05
        gate = stock.get_submodule(f"model.layers.{i}.mlp.gate_proj")
        gate_up = torch.randn(2 * gate.out_features, gate.in_features, generator=gen) * 0.05
        deltas[(f"model.layers.{i}.mlp.gate_proj", _mlp_name(ours, i, "gate_up_proj"))] = gate_up
        deltas[(f"model.layers.{i}.mlp.up_proj", None)] = gate_up[gate.out_features:]
    for (stock_name, ours_name), delta in deltas.items():
        rows = delta[:delta.shape[0] // 2] if stock_name.endswith("gate_proj") else delta
        _swap(stock, stock_name, lambda m, d=rows: Adapter(m, d))
        if ours_name is not None:
            _swap(ours, ours_name, lambda m, d=delta: Adapter(m, d))
    loss_s, logits_s = _step(stock, batch)
    loss_o, logits_o = _step(ours, batch)
    assert not torch.allclose(logits_o, plain_logits), "the adapters changed nothing"
    _close(logits_o, logits_s, "logits")
    _close(loss_o, loss_s, "loss")
    for (stock_name, ours_name), _ in deltas.items():
        if ours_name is None or stock_name.endswith("gate_proj"):
            continue
        _close(ours.get_submodule(ours_name).delta.grad, stock.get_submodule(stock_name).delta.grad,
               f"{ours_name}.delta gradient")
    for i in range(stock.config.num_hidden_layers):  # the fused gate/up adapter's gradient: gate rows, then up rows
        ours_grad = ours.get_submodule(_mlp_name(ours, i, "gate_up_proj")).delta.grad
        stock_grad = torch.cat([stock.get_submodule(f"model.layers.{i}.mlp.{p}").delta.grad
                                for p in ("gate_proj", "up_proj")])
        _close(ours_grad, stock_grad, f"layer {i} gate/up adapter gradient")


def test_qwen3_5_moe_hooks_take_effect(path, tmp_path):
    """Qwen3.5-MoE: forward hooks on the Gated DeltaNet's gated norm, the gated attention's q_norm, the shared
    expert's down_proj (the 1-to-1 SwiGLUMLP Layout) and q_proj: the kernelized model equals the stock one with the
    same hooks."""
    register_local_kernels(*presets.kernel_repos("qwen3_5_moe"))
    directory = save_tiny_model("qwen3_5_moe_text", tmp_path)
    stock = load(directory).train()
    ours = load(directory, presets.kernel_mapping("qwen3_5_moe", revision="v1")).train()
    batch = make_batch(stock.config.vocab_size)
    _, plain_logits = _step(ours, batch)
    suffixes = ("linear_attn.norm", "self_attn.q_norm", "self_attn.q_proj", "mlp.shared_expert.down_proj")
    handles = []
    for model in (stock, ours):
        names = [n for n, _ in model.named_modules() if n.endswith(suffixes)]
        assert {s for s in suffixes if any(n.endswith(s) for n in names)} == set(suffixes), names
        handles += [model.get_submodule(n).register_forward_hook(lambda m, a, o: o * 0.5) for n in names]
    try:
        loss_s, logits_s = _step(stock, batch)
        loss_o, logits_o = _step(ours, batch)
    finally:
        for h in handles:
            h.remove()
    assert not torch.allclose(logits_o, plain_logits), "the forward hooks changed nothing"
    _close(logits_o, logits_s, "logits")
    _close(loss_o, loss_s, "loss")
