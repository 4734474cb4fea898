"""Triton kernels for the fused SwiGLU activation on the concatenated `[M, 2I]` gate/up projection.

Forward: `h = silu(gate) * up`, one read of `gate_up`, one write of `h`. Backward: reads `dh` and `gate_up`,
recomputes silu (nothing but `gate_up` is saved), writes `dgate_up`; optionally also writes the recomputed `h`
(for the down projection's weight gradient). The stores may alias the loads element for element
(`dgate_up` over `gate_up`, `h` over `dh`): every element is loaded before it is stored by the same program,
so the MLP backward runs in place with no new activation-sized buffer.

All arithmetic is fp32; the roundings eager autograd performs in half precision are reproduced (silu rounded
to the input dtype before the product, `dh * up` rounded before silu's derivative), so results match HF eager.
This module imports triton: import it lazily.
"""
import torch
import triton
import triton.language as tl

from hubfuse._common.launch import cdiv, next_power_of_2, launch


@triton.jit
def _swiglu_fwd_kernel(
    GU, H, M, I, stride_gu, stride_h,
    ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < I)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    gate_ptr = GU + rows64 * stride_gu + cols[None, :]
    g = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_ptr + I, mask=mask, other=0.0).to(tl.float32)
    s = g / (1.0 + tl.exp(-g))  # torch's silu formula
    if ROUND:
        s = s.to(H.dtype.element_ty).to(tl.float32)
    tl.store(H + rows64 * stride_h + cols[None, :], (s * u).to(H.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    DH, GU, DGU, H, M, I, stride_dh, stride_gu, stride_dgu, stride_h,
    STORE_H: tl.constexpr, ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < I)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    gate_ptr = GU + rows64 * stride_gu + cols[None, :]
    dh_ptr = DH + rows64 * stride_dh + cols[None, :]
    g = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_ptr + I, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr, mask=mask, other=0.0).to(tl.float32)
    one_plus_exp = 1.0 + tl.exp(-g)
    sig = 1.0 / one_plus_exp
    s = g / one_plus_exp  # torch's silu formula (matches the forward)
    ds = dh * u
    if ROUND:
        s = s.to(DGU.dtype.element_ty).to(tl.float32)
        ds = ds.to(DGU.dtype.element_ty).to(tl.float32)
    du = dh * s
    dg = ds * sig * (1.0 + g * (1.0 - sig))  # d silu(g) / dg = sig * (1 + g * (1 - sig))
    dgate_ptr = DGU + rows64 * stride_dgu + cols[None, :]
    tl.store(dgate_ptr, dg.to(DGU.dtype.element_ty), mask=mask)
    tl.store(dgate_ptr + I, du.to(DGU.dtype.element_ty), mask=mask)
    if STORE_H:
        tl.store(H + rows64 * stride_h + cols[None, :], (s * u).to(H.dtype.element_ty), mask=mask)


def _launch_shape(M: int, I: int, config=None):
    """(grid, BLOCK_M, BLOCK_N, num_warps). Default: ~4096 elements per program (16 per thread at 8 warps: two
    16-byte vectors per bf16 tensor); rows of small I are packed several per program. Row blocks on grid axis 0
    (no 65535 limit), columns on axis 1. `config=(BLOCK_M, BLOCK_N, num_warps)` overrides (tuning)."""
    if config is not None:
        block_m, block_n, num_warps = config
    else:
        block_n = min(next_power_of_2(I), 2048)
        block_m = max(1, min(64, 4096 // block_n))
        num_warps = 8 if block_m * block_n >= 4096 else 4
    grid = (cdiv(M, block_m), cdiv(I, block_n))
    return grid, block_m, block_n, num_warps


def swiglu_fwd(gate_up: torch.Tensor, config=None) -> torch.Tensor:
    M, two_i = gate_up.shape
    I = two_i // 2
    h = torch.empty((M, I), dtype=gate_up.dtype, device=gate_up.device)
    grid, block_m, block_n, num_warps = _launch_shape(M, I, config)
    launch(_swiglu_fwd_kernel, grid,
        gate_up, h, M, I, gate_up.stride(0), h.stride(0),
        ROUND=gate_up.dtype != torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    return h


def swiglu_bwd(dh: torch.Tensor, gate_up: torch.Tensor, dgate_up: torch.Tensor, h=None, config=None) -> None:
    """Writes `dgate_up` (may be `gate_up` itself) and, if given, the recomputed `h` (may be `dh` itself)."""
    M, two_i = gate_up.shape
    I = two_i // 2
    grid, block_m, block_n, num_warps = _launch_shape(M, I, config)
    h_out = h if h is not None else dh
    launch(_swiglu_bwd_kernel, grid,
        dh, gate_up, dgate_up, h_out, M, I, dh.stride(0), gate_up.stride(0), dgate_up.stride(0), h_out.stride(0),
        STORE_H=h is not None, ROUND=gate_up.dtype != torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
