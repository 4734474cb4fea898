"""SwiGLU: the activation, the whole MLP block and the RMSNorm + MLP fusion; ours vs HF eager, torch.compile of
the HF code, Liger (`LigerSiLUMulFunction`, `LigerSwiGLUMLP`, `LigerRMSNorm`) and the floor.

Shapes from issue 4: activation 16384 x 12288; MLP 16384 tokens, hidden 4096, intermediate 12288; bf16,
forward + backward (weights require grad in the MLP cases). The HF / Liger / ours modules are the real classes
(`Qwen3MLP`, `Qwen3RMSNorm`, `LigerSwiGLUMLP`, `LigerRMSNorm`, our Layouts with the Layer's forward bound as
`kernels.kernelize` binds it); their parameters are passed as inputs so the harness clears their grads each step.
"""
import types

import torch
import torch.nn.functional as F

N, H, I = 16384, 4096, 12288


def _cfg():
    return types.SimpleNamespace(hidden_size=H, intermediate_size=I, hidden_act="silu", rms_norm_eps=1e-6,
                                 mlp_bias=False)


def _bind(module, layer_cls):
    module.forward = types.MethodType(layer_cls.forward, module)  # what kernels.kernelize does
    return module


def _hf_mlp(h):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

    return Qwen3MLP(_cfg()).to(h.dev, h.dt)


def _hf_norm(h):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    norm = Qwen3RMSNorm(H, eps=1e-6).to(h.dev, h.dt)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn_like(norm.weight))
    return norm


def _module_inputs(h, build):
    """make_inputs for a module: (x, *its parameters, module); fn calls module(x)."""
    def make():
        module = build()
        x = torch.randn(N, H, dtype=h.dt, device=h.dev, requires_grad=True)
        return (x, *module.parameters(), module)
    return make


def _call(*inputs):
    return inputs[-1](inputs[0])


def _act_eager(a, b):
    return F.silu(a) * b


def _act_eager_fused_input(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def run(h):
    k = h.load_kernel("swiglu")

    # --- the activation alone: 16384 x 12288 ---
    floor = 8 * N * I * 2 / h.COPY_BW * 1e3  # fwd: read g, u, write h; bwd: read dh, g, u, write dg, du
    mk_pair = lambda: (torch.randn(N, I, dtype=h.dt, device=h.dev, requires_grad=True),
                       torch.randn(N, I, dtype=h.dt, device=h.dev, requires_grad=True))
    mk_cat = lambda: (torch.randn(N, 2 * I, dtype=h.dt, device=h.dev, requires_grad=True),)
    h.bench("swiglu_act", "eager", _act_eager, mk_pair, floor, note="gate, up separate (anchor form)")
    h.bench("swiglu_act", "torch.compile", h.comp(_act_eager), mk_pair, floor, note="gate, up separate")
    h.bench("swiglu_act", "torch.compile [gate|up]", h.comp(_act_eager_fused_input), mk_cat, floor,
            note="on the concatenated projection")
    if h.liger is not None:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        h.bench("swiglu_act", "liger", lambda a, b: LigerSiLUMulFunction.apply(a, b), mk_pair, floor)
    h.bench("swiglu_act", "hubfuse", k.swiglu, mk_cat, floor, note="on the concatenated [tokens, 2I] projection")

    # --- the whole MLP block: 16384 tokens, hidden 4096, intermediate 12288 ---
    mm_floor = 18 * N * H * I / h.MM_RATE * 1e3  # 3 GEMMs forward (6NHI FLOPs), twice that backward
    mk_hf = _module_inputs(h, lambda: _hf_mlp(h))
    h.bench("swiglu_mlp", "eager", _call, mk_hf, mm_floor, note="Qwen3MLP; floor = 3 fwd + 6 bwd GEMMs")
    compiled_mlp = h.comp(lambda x, m: m(x))
    h.bench("swiglu_mlp", "torch.compile", lambda *a: compiled_mlp(a[0], a[-1]), mk_hf, mm_floor)
    if h.liger is not None:
        from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

        mk_liger = _module_inputs(h, lambda: LigerSwiGLUMLP(_cfg()).to(h.dev, h.dt))
        h.bench("swiglu_mlp", "liger", _call, mk_liger, mm_floor, note="LigerSwiGLUMLP")
    mk_ours = _module_inputs(h, lambda: _bind(k.layers.SwiGLUMLPLayout(_cfg()).to(h.dev, h.dt), k.layers.SwiGLUMLP))
    h.bench("swiglu_mlp", "hubfuse", _call, mk_ours, mm_floor, note="SwiGLUMLPLayout + SwiGLUMLP (one gate/up GEMM)")

    # --- post-attention RMSNorm + MLP ---
    fused_floor = mm_floor + 5 * N * H * 2 / h.COPY_BW * 1e3  # + the norm's bytes
    norm_mlp = lambda: torch.nn.Sequential(_hf_norm(h), _hf_mlp(h))
    mk_hf = _module_inputs(h, norm_mlp)
    h.bench("rmsnorm_swiglu_mlp", "eager", _call, mk_hf, fused_floor, note="Qwen3RMSNorm + Qwen3MLP")
    compiled_block = h.comp(lambda x, m: m(x))
    h.bench("rmsnorm_swiglu_mlp", "torch.compile", lambda *a: compiled_block(a[0], a[-1]), mk_hf, fused_floor)
    if h.liger is not None:
        from liger_kernel.transformers.rms_norm import LigerRMSNorm
        from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

        mk_liger = _module_inputs(h, lambda: torch.nn.Sequential(
            LigerRMSNorm(H, eps=1e-6).to(h.dev, h.dt), LigerSwiGLUMLP(_cfg()).to(h.dev, h.dt)))
        h.bench("rmsnorm_swiglu_mlp", "liger", _call, mk_liger, fused_floor, note="LigerRMSNorm + LigerSwiGLUMLP")
    mk_ours = _module_inputs(h, lambda: _bind(k.layers.RMSNormSwiGLUMLPLayout(_hf_norm(h), _hf_mlp(h)),
                                              k.layers.RMSNormSwiGLUMLP))
    h.bench("rmsnorm_swiglu_mlp", "hubfuse", _call, mk_ours, fused_floor,
            note="RMSNormSwiGLUMLPLayout + RMSNormSwiGLUMLP")
