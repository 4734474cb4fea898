"""Torch reference path: HF-exact forward, and the analytic backward used on devices without Triton.

`*_hf` functions are the transformers code, verbatim in numerics (cast order and output memory layout
included); the Layouts' `forward` and the CPU path of the custom ops use them. The `*_bwd_reference`
functions are the backward of the fused ops in torch math; they mirror the Triton backward.

Conventions shared with the kernels: q / k are 4-D, the rotary dim R = cos.shape[-1] (even, <= head_dim)
rotates the first R features with HF's `rotate_half` convention, the remaining `head_dim - R` pass through.
"""
import torch

# the HF-exact norms (rms_norm_hf, rms_norm_zero_centered_hf re-exported)
from hubfuse.rmsnorm.reference import rms_norm_hf, rms_norm_zero_centered_hf, rms_rstd  # noqa: F401

NONE, STANDARD, ZERO_CENTERED = 0, 1, 2  # norm applied before the rotation (fused op)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb_hf(q, k, cos, sin, unsqueeze_dim: int = 1):
    """HF `apply_rotary_pos_emb`: Llama/Qwen3 form when R == head_dim, the partial (Qwen3.5/GLM) form else."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    if rotary_dim == q.shape[-1]:
        return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
    k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)
    return torch.cat([q_embed, q_pass], dim=-1), torch.cat([k_embed, k_pass], dim=-1)


def qk_norm_rope_hf(q, k, q_weight, k_weight, cos, sin, eps: float, mode: int):
    """HF attention's `q_norm(q)`, `k_norm(k)`, transpose, `apply_rotary_pos_emb` on (B, S, H, D) inputs.

    Returns (B, H, S, D) tensors, laid out in memory as HF lays them out.
    """
    norm = rms_norm_hf if mode == STANDARD else rms_norm_zero_centered_hf
    qn = norm(q, q_weight, eps).transpose(1, 2)
    kn = norm(k, k_weight, eps).transpose(1, 2)
    return apply_rotary_pos_emb_hf(qn, kn, cos, sin)


# ---------------------------------------------------------------------------------------------------------
# Reference forward / backward of the custom ops, on canonical (B, H, S, D) views. The rotation of the
# backward is the inverse rotation: dx1 = dy1 * c1 + dy2 * s2, dx2 = dy2 * c2 - dy1 * s1.
# ---------------------------------------------------------------------------------------------------------


def _rope_bwd_one(dy, cos, sin, out_dtype):
    # Each product and the sum rounded to the grad dtype, as autograd through the HF code rounds them.
    R = cos.shape[-1]
    half = R // 2
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    dyc = dy.to(out_dtype)
    c = c.to(torch.promote_types(c.dtype, out_dtype))
    s = s.to(c.dtype)
    dy1, dy2 = dyc[..., :half], dyc[..., half:R]
    dx1 = (dy1 * c[..., :half]).to(out_dtype) + (dy2 * s[..., half:]).to(out_dtype)
    dx2 = (dy2 * c[..., half:]).to(out_dtype) - (dy1 * s[..., :half]).to(out_dtype)
    return torch.cat([dx1, dx2, dyc[..., R:]], dim=-1).to(out_dtype)


def rope_bwd_reference(dq_out, dk_out, cos, sin, q_dtype):
    """Backward of the RoPE op on (B, H, S, D) grads: (dq, dk) contiguous, in the inputs' dtype."""
    dq = _rope_bwd_one(dq_out, cos, sin, dq_out.dtype).to(q_dtype).contiguous()
    dk = _rope_bwd_one(dk_out, cos, sin, dk_out.dtype).to(q_dtype).contiguous()
    return dq, dk


def _norm_rope_bwd_one(dy, x, weight, cos, sin, eps, mode):
    # dy: (B, H, S, D) grad of the rotated output; x: (B, S, H, D) raw input. fp32 math.
    R = cos.shape[-1]
    half = R // 2
    c, s = cos.float().unsqueeze(1), sin.float().unsqueeze(1)
    dy = dy.float()
    dy1, dy2 = dy[..., :half], dy[..., half:R]
    dn = torch.cat([dy1 * c[..., :half] + dy2 * s[..., half:],
                    dy2 * c[..., half:] - dy1 * s[..., :half], dy[..., R:]], dim=-1).transpose(1, 2)
    x32, w32 = x.float(), weight.float()
    rstd = rms_rstd(x32, eps)
    n = x32 * rstd
    if mode == STANDARD:
        dw = (dn * n.to(x.dtype).float()).sum((0, 1, 2))
        g = dn * w32
    else:
        dw = (dn * n).sum((0, 1, 2))
        g = dn * (1.0 + w32)
    dx = rstd * (g - n * (g * n).mean(-1, keepdim=True))
    return dx.to(x.dtype).contiguous(), dw.to(weight.dtype)


def qk_norm_rope_bwd_reference(dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, eps, mode):
    """Backward of the fused q/k norm + RoPE op: (dq, dk, dq_weight, dk_weight), dq/dk shaped like q/k."""
    dq, dwq = _norm_rope_bwd_one(dq_out, q, q_weight, cos, sin, eps, mode)
    dk, dwk = _norm_rope_bwd_one(dk_out, k, k_weight, cos, sin, eps, mode)
    return dq, dk, dwq, dwk
