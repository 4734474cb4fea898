"""Torch reference path: HF-exact forward, and the analytic backward used on devices without Triton.

`*_hf` functions are the transformers modules' forward code, verbatim in numerics (cast order included);
the Layouts' `forward` and the CPU path of the custom ops use them. `rms_norm_bwd_reference` is the
backward of the fused op written in fp32 torch math; it mirrors the Triton backward.
"""
import torch
import torch.nn.functional as F

STANDARD, ZERO_CENTERED, GATED = 0, 1, 2


def rms_rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's `torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)`: 1 / RMS over the last dim, in x's dtype."""
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm normalisation `x * rsqrt(mean(x^2) + eps)` in x's dtype (the HF modules pass fp32): the one
    source of the formula for every reference, benchmark and test."""
    return x * rms_rstd(x, eps)


def rms_norm_hf(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama / Qwen2 / Qwen3 / Qwen3-MoE RMSNorm: normalise in fp32, cast, then `* weight`."""
    input_dtype = x.dtype
    h = rms_normalize(x.to(torch.float32), eps)
    return weight * h.to(input_dtype)


def rms_norm_zero_centered_hf(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5 / Qwen3-Next RMSNorm: `(1 + weight)` applied in fp32 before the cast."""
    h = rms_normalize(x.float(), eps)
    return (h * (1.0 + weight.float())).type_as(x)


def rms_norm_gated_hf(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5 / Qwen3-Next RMSNormGated: norm, cast, `* weight`, then `* silu(gate)` in fp32, cast."""
    input_dtype = x.dtype
    h = rms_normalize(x.to(torch.float32), eps)
    h = weight * h.to(input_dtype)
    h = h * F.silu(gate.to(torch.float32))
    return h.to(input_dtype)


def rms_norm_fwd_reference(x, weight, gate, eps: float, mode: int):
    """Forward of the fused op on 2-D `x`: returns (y, rstd) with rstd in fp32, like the Triton kernel."""
    rstd = rms_rstd(x.float(), eps).squeeze(-1)
    if mode == STANDARD:
        y = rms_norm_hf(x, weight, eps)
    elif mode == ZERO_CENTERED:
        y = rms_norm_zero_centered_hf(x, weight, eps)
    else:
        y = rms_norm_gated_hf(x, gate, weight, eps)
    return y, rstd


def rms_norm_bwd_reference(dy, x, weight, gate, rstd, mode: int):
    """Backward of the fused op in fp32: returns (dx, dweight, dgate or an empty tensor)."""
    dy32, x32, w32 = dy.float(), x.float(), weight.float()
    n = x32 * rstd[:, None]
    dgate = x.new_empty(0)
    if mode == STANDARD:
        n_cast = n.to(x.dtype).float()
        dn = dy32 * w32
        dw = (dy32 * n_cast).sum(0)
    elif mode == ZERO_CENTERED:
        dn = dy32 * (1.0 + w32)
        dw = (dy32 * n).sum(0)
    else:
        n_cast = n.to(x.dtype).float()
        t = w32 * n_cast
        t = t.to(torch.promote_types(weight.dtype, x.dtype)).float()  # HF rounds `weight * h` to its dtype
        g = gate.float()
        sig = torch.sigmoid(g)
        silu = g * sig
        dt = dy32 * silu
        dgate = (dy32 * t * sig * (1.0 + g * (1.0 - sig))).to(gate.dtype)
        dn = dt * w32
        dw = (dt * n_cast).sum(0)
    # d/dx of x * rstd(x): rstd * (dn - n * mean(dn * n))
    dx = rstd[:, None] * (dn - n * (dn * n).mean(-1, keepdim=True))
    return dx.to(x.dtype), dw.to(weight.dtype), dgate
