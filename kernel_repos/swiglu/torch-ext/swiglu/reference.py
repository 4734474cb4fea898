"""Torch reference path: HF-exact SwiGLU MLP forward, and the analytic backward used without Triton.

`swiglu_mlp_hf` is the transformers MLP forward (`down_proj(act_fn(gate_proj(x)) * up_proj(x))`) written on
the concatenated `gate_up` projection; the Layouts' `forward` uses it. `swiglu_fwd_reference` /
`swiglu_bwd_reference` are the fused activation and its backward with the roundings eager autograd performs
in half precision (silu rounded to the input dtype before the product, `dh * up` rounded before silu's
derivative); they mirror the Triton kernels and are the CPU path of the custom ops.
"""
from typing import Optional

import torch
import torch.nn.functional as F


def swiglu_hf(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` on the last dimension `[gate | up]`, in the input dtype, as HF eager computes it."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_mlp_hf(x: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor,
                  gate_up_bias: Optional[torch.Tensor] = None, down_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """HF MLP forward on the fused `[2I, H]` gate/up weight: one GEMM, `silu(gate) * up`, `down_proj`."""
    return F.linear(swiglu_hf(F.linear(x, gate_up_weight, gate_up_bias)), down_weight, down_bias)


def _round(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # round an fp32 intermediate to the storage dtype and back (no-op for fp32)
    return t.to(dtype).float()


def swiglu_fwd_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """2-D `[M, 2I]` -> `[M, I]`; fp32 math, silu rounded to the input dtype first (as eager does)."""
    dtype = gate_up.dtype
    g, u = gate_up.float().chunk(2, dim=-1)
    s = _round(F.silu(g), dtype)
    return (s * u).to(dtype)


def swiglu_bwd_reference(dh: torch.Tensor, gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of `silu(gate) * up`: returns (`dgate_up` `[M, 2I]`, recomputed `h` `[M, I]`)."""
    dtype = gate_up.dtype
    g, u = gate_up.float().chunk(2, dim=-1)
    dh32 = dh.float()
    sig = torch.sigmoid(g)
    s = _round(F.silu(g), dtype)
    du = dh32 * s
    ds = _round(dh32 * u, dtype)
    dg = ds * sig * (1.0 + g * (1.0 - sig))  # d silu(g) / dg = sig * (1 + g * (1 - sig))
    return torch.cat([dg, du], dim=-1).to(dtype), (s * u).to(dtype)
