"""Layers (stateless, for the hub names) and Layouts (stateful, replace HF classes by class-name regex).

`SwiGLUMLP` / `SwiGLUMLPLayout` (1-to-1): replaces `Qwen3MLP`, `Qwen3MoeMLP`, `Qwen3_5MoeMLP` (the Qwen3.5 shared
expert), `LlamaMLP`, `Qwen2MLP`. The Layout holds one `gate_up_proj` (`[2I, H]`, the rows of `gate_proj` then
those of `up_proj`) instead of `gate_proj` + `up_proj`, so the forward runs one GEMM; its `conversion_mapping`
concatenates the two checkpoint tensors on load, and transformers splits them back on save (checkpoints keep
the original keys, bit-exact).

`RMSNormSwiGLUMLP` / `RMSNormSwiGLUMLPLayout` (n-to-1 fusion of `(post_attention_layernorm, mlp)`): transformers
builds `Layout(norm, mlp)` in place of `post_attention_layernorm` and an `nn.Identity` in place of `mlp`. The
fused module keeps the norm weight as its own `weight` (so `post_attention_layernorm.weight` does not move) and
takes `gate_up_proj` / `down_proj`: the conversion mapping moves `mlp.{gate,up}_proj` (concatenated) and
`mlp.down_proj` under `post_attention_layernorm`, and back on save.

The two cannot be combined over the same modules (the fusion would receive the already-swapped MLP, and the two
conversion mappings claim the same checkpoint keys): `RMSNormSwiGLUMLPLayout.__init__` raises a ValueError saying
so when it receives a swapped MLP. The fusion needs a gate/up/down MLP under every matched layer: in MoE layers
(`*SparseMoeBlock`) its `__init__` raises and points at the 1-to-1 Layout. (An exception inside model
construction leaves transformers' module classes patched: transformers' `apply_patches` has no try/finally.
`hubfuse.KernelConfig` builds the model once on the meta device while registering and puts them back before the
exception reaches the caller; with stock transformers' `KernelConfig`, start a fresh process after such a
failure.)

A Layer has no `__init__` and no state: `kernelize` binds its `forward` to the Layout instance.

The fused forwards read `gate_up_proj` / `down_proj`'s parameters only while both are plain hook-free
`nn.Linear`s (`_common.modules.plain_linear`). A hook, a LoRA / PEFT wrapper or another Linear class on either
makes the forward call the two modules around the fused activation (and the norm), so that what they add runs.
"""
import torch
from torch import nn

from hubfuse._common.modules import plain_linear
from hubfuse.rmsnorm.ops import rms_norm
from hubfuse.rmsnorm.reference import rms_norm_hf
from .ops import rms_norm_swiglu_mlp, swiglu, swiglu_mlp
from .reference import swiglu_hf, swiglu_mlp_hf

_SILU_NAMES = ("silu", "swish")


def _check_hidden_act(cls_name: str, hidden_act) -> None:
    if hidden_act not in _SILU_NAMES:
        raise ValueError(f"{cls_name}: the SwiGLU kernel computes silu(gate) * up; config.hidden_act is "
                         f"{hidden_act!r}. Do not map this kernel onto a model with another activation.")


_COMBINED_MESSAGE = (
    "A 1-to-1 MLP Layout (e.g. 'SwiGLUMLP' on '^Qwen3MLP$') and the (post_attention_layernorm, mlp) fusion "
    "('RMSNormSwiGLUMLP') cannot be combined over the same modules: keep only one of the two entries in the "
    "KernelConfig.")


class _ConversionMapping:
    """Class attribute built on access: transformers' transform objects are imported lazily (the kernel has no
    dependency on transformers) and are fresh on every load (they carry per-load state)."""

    def __init__(self, build):
        self.build = build

    def __get__(self, obj, owner=None):
        return self.build()


def _gate_up_converters(src_prefix: str, dst_prefix: str) -> list:
    from transformers.core_model_loading import Concatenate, WeightConverter

    return [
        WeightConverter(
            source_patterns=[f"{src_prefix}.gate_proj.{p}", f"{src_prefix}.up_proj.{p}"],
            target_patterns=f"{dst_prefix}.gate_up_proj.{p}",
            operations=[Concatenate(dim=0)],
        )
        for p in ("weight", "bias")
    ]


def _swiglu_mlp_conversions() -> list:
    # `mlp.*` for dense MLPs (Llama, Qwen2, Qwen3, Qwen3-MoE dense layers), `shared_expert.*` for Qwen3.5-MoE
    return _gate_up_converters("mlp", "mlp") + _gate_up_converters("shared_expert", "shared_expert")


def _rms_norm_swiglu_mlp_conversions() -> list:
    from transformers.core_model_loading import WeightRenaming

    fused = "post_attention_layernorm"
    return _gate_up_converters("mlp", fused) + [
        WeightRenaming(source_patterns=f"mlp.down_proj.{p}", target_patterns=f"{fused}.down_proj.{p}")
        for p in ("weight", "bias")
    ]


def _fused_projections(mlp: nn.Module) -> bool:
    """Whether the fused op may read the two projections' parameters instead of calling them."""
    return plain_linear(mlp.gate_up_proj) and plain_linear(mlp.down_proj)


def _called_projections(mlp: nn.Module, x: torch.Tensor, activation) -> torch.Tensor:
    """`down_proj(activation(gate_up_proj(x)))` with the two modules called (their hooks and wrappers run)."""
    return mlp.down_proj(activation(mlp.gate_up_proj(x)))


def _mlp_forward(mlp: nn.Module, x: torch.Tensor, activation, fused_mlp) -> torch.Tensor:
    """`down_proj(activation(gate_up_proj(x)))`: `fused_mlp` on the projections' parameters where it may read them,
    else the two modules called."""
    if not _fused_projections(mlp):
        return _called_projections(mlp, x, activation)
    return fused_mlp(x, mlp.gate_up_proj.weight, mlp.down_proj.weight, mlp.gate_up_proj.bias, mlp.down_proj.bias)


# ---------------------------------------------------------------- 1-to-1: the MLP
class SwiGLUMLP(nn.Module):
    """SwiGLU MLP on a `SwiGLUMLPLayout`: one gate/up GEMM, fused activation, down_proj. Hub name `SwiGLUMLP`."""

    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _mlp_forward(self, x, swiglu, swiglu_mlp)


class SwiGLUMLPLayout(nn.Module):
    """`Qwen3MLP(config)`, `Qwen3MoeMLP(config, intermediate_size=None)`, `Qwen3_5MoeMLP(config, intermediate_size)`,
    `LlamaMLP(config)` (`mlp_bias`), `Qwen2MLP(config)` with `gate_proj` + `up_proj` fused into `gate_up_proj`."""

    conversion_mapping = _ConversionMapping(_swiglu_mlp_conversions)

    def __init__(self, config, intermediate_size=None):
        super().__init__()
        _check_hidden_act(type(self).__name__, config.hidden_act)
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = nn.Linear(self.hidden_size, 2 * self.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=bias)
        self.hidden_act = config.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _mlp_forward(self, x, swiglu_hf, swiglu_mlp_hf)


# ---------------------------------------------------------------- n-to-1: RMSNorm + MLP
class RMSNormSwiGLUMLP(nn.Module):
    """`post_attention_layernorm` + `mlp` fused (hubfuse RMSNorm kernel, gate/up GEMM, fused activation, down_proj).
    Hub name `RMSNormSwiGLUMLP`, for the fusion key
    `(("RMSNorm", "model.layers.*.post_attention_layernorm"), ("MLP", "model.layers.*.mlp"))`."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not _fused_projections(self):
            return _called_projections(self, rms_norm(hidden_states, self.weight, self.variance_epsilon), swiglu)
        return rms_norm_swiglu_mlp(hidden_states, self.weight, self.variance_epsilon, self.gate_up_proj.weight,
                                   self.down_proj.weight, self.gate_up_proj.bias, self.down_proj.bias)


def _check_fusion_children(cls_name: str, norm: nn.Module, mlp: nn.Module) -> None:
    if isinstance(mlp, SwiGLUMLPLayout) or (hasattr(mlp, "gate_up_proj") and not hasattr(mlp, "gate_proj")):
        raise ValueError(
            f"{cls_name}: the mlp given to the fusion is already a {type(mlp).__name__} (a 1-to-1 MLP Layout). "
            + _COMBINED_MESSAGE)
    missing = [n for n in ("gate_proj", "up_proj", "down_proj") if not isinstance(getattr(mlp, n, None), nn.Linear)]
    if missing:
        raise ValueError(
            f"{cls_name}: the fusion needs a gate/up/down SwiGLU MLP under every matched layer, got "
            f"{type(mlp).__name__} (no {', '.join(missing)}). For MoE models whose layers are sparse, use the "
            "1-to-1 'SwiGLUMLP' Layout on the dense MLP / shared-expert class instead of the fusion.")
    if not isinstance(getattr(norm, "weight", None), torch.Tensor) or not hasattr(norm, "variance_epsilon"):
        raise ValueError(
            f"{cls_name}: the fusion needs a Llama/Qwen RMSNorm (`weight`, `variance_epsilon`: weight * x_normed) as "
            f"its first child, got {type(norm).__name__}. Zero-centred (1 + weight) norms are not supported here.")
    if getattr(norm, "weight").dim() != 1 or norm.weight.shape[0] != mlp.gate_proj.in_features:
        raise ValueError(f"{cls_name}: norm weight {tuple(norm.weight.shape)} does not match the MLP hidden size "
                         f"{mlp.gate_proj.in_features}")


class RMSNormSwiGLUMLPLayout(nn.Module):
    """Built by transformers as `RMSNormSwiGLUMLPLayout(post_attention_layernorm, mlp)`. Reuses the norm weight and
    `down_proj`, and concatenates `gate_proj` / `up_proj` into `gate_up_proj` (so a model built from a config keeps
    the same initial weights)."""

    conversion_mapping = _ConversionMapping(_rms_norm_swiglu_mlp_conversions)

    def __init__(self, norm: nn.Module, mlp: nn.Module):
        super().__init__()
        cls_name = type(self).__name__
        _check_fusion_children(cls_name, norm, mlp)
        hidden_act = getattr(getattr(mlp, "config", None), "hidden_act", "silu")
        _check_hidden_act(cls_name, hidden_act)
        self.hidden_act = hidden_act
        self.weight = norm.weight
        self.variance_epsilon = norm.variance_epsilon
        gate, up = mlp.gate_proj, mlp.up_proj
        has_bias = gate.bias is not None
        self.gate_up_proj = nn.Linear(gate.in_features, 2 * gate.out_features, bias=has_bias,
                                      device=gate.weight.device, dtype=gate.weight.dtype)
        with torch.no_grad():
            self.gate_up_proj.weight.copy_(torch.cat([gate.weight, up.weight], dim=0))
            if has_bias:
                self.gate_up_proj.bias.copy_(torch.cat([gate.bias, up.bias], dim=0))
        self.down_proj = mlp.down_proj

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _mlp_forward(self, rms_norm_hf(hidden_states, self.weight, self.variance_epsilon), swiglu_hf,
                            swiglu_mlp_hf)

    def extra_repr(self):
        return f"norm={tuple(self.weight.shape)}, eps={self.variance_epsilon}"


__all__ = ["SwiGLUMLP", "SwiGLUMLPLayout", "RMSNormSwiGLUMLP", "RMSNormSwiGLUMLPLayout"]
