"""Custom ops and the functional API: RoPE (full / partial) and fused per-head RMSNorm + RoPE.

Every forward and backward is a custom op under this build's unique namespace, with a fake implementation and
autograd, so `torch.compile(fullgraph=True)` sees one opaque node per call (on NVIDIA GPUs it inlines them,
`_common.custom_op`'s `inline=True`: Inductor traces the implementations and launches the Triton kernels itself);
eager calls run the same implementations through an autograd.Function (`_custom_op.differentiable_op`: no
dispatcher cost). Each op dispatches on the tensor's device at run time: Triton on CUDA/ROCm/XPU (and on CPU
under `TRITON_INTERPRET=1`), the torch reference otherwise.

Output memory layout follows HF so that downstream attention kernels see the same strides as in eager:
full RoPE keeps the input's layout (`q * cos` does), partial RoPE is contiguous (`torch.cat` makes it so).
Input grads take the input's layout (as `torch.empty_like` lays it out): a grad laid out otherwise is copied
again by autograd (AccumulateGrad into a transposed leaf, `view`'s backward of a transposed projection).

The fused backwards give no gradient to cos / sin (in HF they come from the rotary embedding's buffers and need
none). When cos or sin require grad (with grad mode on), the out-of-place functions take the HF torch
expression instead, which autograd differentiates in every input; the in-place one raises.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from hubfuse._common.checks import first_order
from hubfuse._common.device import autocast_dtype, use_triton
from hubfuse._common.modules import plain_linear
from hubfuse._common.custom_op import call, custom_op, differentiable_op
from hubfuse._common.released import write_alias
from hubfuse._common.sdpa import sdpa_backend, sdpa_backward, sdpa_forward
from .reference import (
    NONE, STANDARD, ZERO_CENTERED, apply_rotary_pos_emb_hf, qk_norm_rope_bwd_reference, qk_norm_rope_hf,
    rope_bwd_reference,
)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _canon(t: torch.Tensor, head_pos: int) -> torch.Tensor:
    """(B, H, S, D) view of a tensor whose head dim is at `head_pos` (1: (B, H, S, D), 2: (B, S, H, D))."""
    return t if head_pos == 1 else t.transpose(1, 2)


def _dim_order(t: torch.Tensor) -> list[int]:
    """t's dims outermost first when t is dense (a permuted contiguous tensor), else (0, 1, 2, 3)."""
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))  # stable: size-1 dims keep their place
    size = 1
    for d in reversed(order):
        if t.shape[d] != 1 and t.stride(d) != size:
            return list(range(t.dim()))
        size *= t.shape[d]
    return order


def _empty_in_order(like: torch.Tensor, order: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Uninitialised tensor shaped like `like`, laid out in memory with its dims in `order` (outermost first)."""
    out = like.new_empty([like.shape[d] for d in order], dtype=dtype)
    return out.permute([order.index(d) for d in range(len(order))])


def _rope_out(x: torch.Tensor, dtype: torch.dtype, full: bool) -> torch.Tensor:
    if full:  # preserve_format: keeps x's strides when x is dense, as `q * cos` does
        return torch.empty_like(x, dtype=dtype)
    return x.new_empty(x.shape, dtype=dtype)


# ------------------------------------------------------------------ RoPE


def _rope_into(q, k, cos, sin, head_pos, q_out, k_out) -> None:
    """RoPE of q and k written into q_out / k_out: Triton where it runs, else HF's torch expression."""
    if use_triton(q):
        from .triton_kernels import qk_rope_fwd

        qk_rope_fwd(_canon(q, head_pos), _canon(k, head_pos), cos, sin, _canon(q_out, head_pos),
                    _canon(k_out, head_pos))
    else:
        qr, kr = apply_rotary_pos_emb_hf(q, k, cos, sin, head_pos)
        q_out.copy_(qr)
        k_out.copy_(kr)


@custom_op("rope_fwd", inline=True)
def _rope_fwd(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_pos: int
) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = torch.promote_types(q.dtype, cos.dtype)
    full = cos.shape[-1] == q.shape[-1]
    q_out, k_out = _rope_out(q, dtype, full), _rope_out(k, dtype, full)
    _rope_into(q, k, cos, sin, head_pos, q_out, k_out)
    return q_out, k_out


@_rope_fwd.register_fake
def _(q, k, cos, sin, head_pos):
    dtype = torch.promote_types(q.dtype, cos.dtype)
    full = cos.shape[-1] == q.shape[-1]
    return _rope_out(q, dtype, full), _rope_out(k, dtype, full)


@custom_op("rope_fwd_flat", inline=True)
def _rope_fwd_flat(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_pos: int) -> torch.Tensor:
    dtype = torch.promote_types(q.dtype, cos.dtype)
    flat = q.new_empty(q.numel() + k.numel(), dtype=dtype)
    q_out, k_out = flat.narrow(0, 0, q.numel()).view(q.shape), flat.narrow(0, q.numel(), k.numel()).view(k.shape)
    _rope_into(q, k, cos, sin, head_pos, q_out, k_out)
    return flat


@_rope_fwd_flat.register_fake
def _(q, k, cos, sin, head_pos):
    return q.new_empty(q.numel() + k.numel(), dtype=torch.promote_types(q.dtype, cos.dtype))


@custom_op("rope_bwd", inline=True)
def _rope_bwd(
    dq_out: torch.Tensor, dk_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_pos: int,
    q_order: list[int], k_order: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq, dk) in the layouts `q_order` / `k_order` of the forward's inputs."""
    dq, dk = _empty_in_order(dq_out, q_order, dq_out.dtype), _empty_in_order(dk_out, k_order, dk_out.dtype)
    if use_triton(dq_out):
        from .triton_kernels import qk_rope_bwd

        qk_rope_bwd(_canon(dq_out, head_pos), _canon(dk_out, head_pos), cos, sin, _canon(dq, head_pos),
                    _canon(dk, head_pos))
    else:
        rq, rk = rope_bwd_reference(_canon(dq_out, head_pos), _canon(dk_out, head_pos), cos, sin, dq_out.dtype)
        _canon(dq, head_pos).copy_(rq)
        _canon(dk, head_pos).copy_(rk)
    return dq, dk


@_rope_bwd.register_fake
def _(dq_out, dk_out, cos, sin, head_pos, q_order, k_order):
    return _empty_in_order(dq_out, q_order, dq_out.dtype), _empty_in_order(dk_out, k_order, dk_out.dtype)


def _rope_setup_context(ctx, inputs, output):
    q, k, cos, sin, head_pos = inputs
    ctx.save_for_backward(cos, sin)
    ctx.head_pos = head_pos
    ctx.dtypes = (q.dtype, k.dtype)
    ctx.shapes = (q.shape, k.shape)
    ctx.orders = (_dim_order(q), _dim_order(k))


@first_order("apply_rotary_pos_emb")
def _rope_backward(ctx, dq_out, dk_out):
    cos, sin = ctx.saved_tensors
    dq_out = dq_out if dq_out is not None and dq_out.stride(-1) == 1 else _grad_or_zeros(dq_out, ctx, 0)
    dk_out = dk_out if dk_out is not None and dk_out.stride(-1) == 1 else _grad_or_zeros(dk_out, ctx, 1)
    dq, dk = call(ctx, _rope_bwd, dq_out, dk_out, cos, sin, ctx.head_pos, *ctx.orders)
    return dq.to(ctx.dtypes[0]), dk.to(ctx.dtypes[1]), None, None, None


def _grad_or_zeros(g, ctx, i):
    if g is None:  # only one of the two outputs was used
        return torch.zeros(ctx.shapes[i], dtype=torch.promote_types(ctx.dtypes[i], ctx.saved_tensors[0].dtype),
                           device=ctx.saved_tensors[0].device)
    return g.contiguous()


_rope = differentiable_op(_rope_fwd, _rope_setup_context, _rope_backward)


@first_order("apply_rotary_pos_emb_flat")
def _rope_flat_backward(ctx, dflat):
    cos, sin = ctx.saved_tensors
    dflat = dflat.contiguous()
    (qs, ks), nq = ctx.shapes, ctx.shapes[0].numel()
    dq, dk = call(ctx, _rope_bwd, dflat[:nq].view(qs), dflat[nq:].view(ks), cos, sin, ctx.head_pos, *ctx.orders)
    return dq.to(ctx.dtypes[0]), dk.to(ctx.dtypes[1]), None, None, None


_rope_flat = differentiable_op(_rope_fwd_flat, _rope_setup_context, _rope_flat_backward)


def _check_tensor(name, what, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: {what} must be a tensor, got {type(t).__name__}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name}: {what} must be float32, float16 or bfloat16, got {t.dtype}")


def _check_rope(name, q, k, cos, sin, unsqueeze_dim):
    for what, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        _check_tensor(name, what, t)
    if q.dtype != k.dtype:
        raise TypeError(f"{name}: q and k dtypes differ ({q.dtype} vs {k.dtype})")
    if cos.dtype != sin.dtype:
        raise TypeError(f"{name}: cos and sin dtypes differ ({cos.dtype} vs {sin.dtype})")
    for what, t in (("k", k), ("cos", cos), ("sin", sin)):
        if t.device != q.device:
            raise ValueError(f"{name}: {what} is on {t.device} but q on {q.device}")
    if isinstance(unsqueeze_dim, bool) or unsqueeze_dim not in (1, 2, -3, -2):
        raise ValueError(f"{name}: unsqueeze_dim must be 1 ((B, H, S, D) inputs) or 2 ((B, S, H, D) inputs), "
                         f"got {unsqueeze_dim}")
    head_pos = unsqueeze_dim + 4 if unsqueeze_dim < 0 else unsqueeze_dim  # cos is 3-D: -3 -> 1, -2 -> 2
    seq_pos = 3 - head_pos
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"{name}: q and k must be 4-D, got {tuple(q.shape)} and {tuple(k.shape)}")
    if cos.dim() != 3 or cos.shape != sin.shape:
        raise ValueError(f"{name}: cos and sin must both be (batch, seq, rotary_dim), got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    B, S, D = q.shape[0], q.shape[seq_pos], q.shape[3]
    if k.shape[0] != B or k.shape[seq_pos] != S or k.shape[3] != D:
        raise ValueError(f"{name}: k {tuple(k.shape)} does not match q {tuple(q.shape)} in batch, sequence or "
                         f"head_dim (unsqueeze_dim={unsqueeze_dim})")
    R = cos.shape[-1]
    if R <= 0 or R % 2 or R > D:
        raise ValueError(f"{name}: rotary dim (cos.shape[-1]) must be even and in [2, head_dim={D}], got {R}")
    if cos.shape[1] != S or cos.shape[0] not in (1, B):
        raise ValueError(f"{name}: cos/sin {tuple(cos.shape)} do not match q {tuple(q.shape)}: expected "
                         f"({B} or 1, {S}, rotary_dim) for unsqueeze_dim={unsqueeze_dim}")
    if q.numel() == 0 or k.numel() == 0:
        raise ValueError(f"{name}: q and k must not be empty, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    return head_pos


def _last_contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _cos_sin(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin with a unit-stride last dim and one layout: the kernels read both with cos's strides."""
    cos, sin = _last_contig(cos), _last_contig(sin)
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin


def _cos_sin_need_grad(cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """The fused backwards give cos / sin no gradient: True when one is needed (the torch path runs then)."""
    return torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim: int = 1):
    """HF `apply_rotary_pos_emb`, full or partial (rotary dim = `cos.shape[-1]` <= head_dim), q and k in one
    launch. q: (B, Hq, S, D) and k: (B, Hk, S, D) for unsqueeze_dim=1, (B, S, H, D) for 2; cos/sin (B or 1, S, R).
    Returns (q_embed, k_embed) in `promote(q.dtype, cos.dtype)`."""
    head_pos = _check_rope("apply_rotary_pos_emb", q, k, cos, sin, unsqueeze_dim)
    if _cos_sin_need_grad(cos, sin):
        return apply_rotary_pos_emb_hf(q, k, cos, sin, head_pos)
    return _rope(_last_contig(q), _last_contig(k), *_cos_sin(cos, sin), head_pos)


def apply_rotary_pos_emb_flat(q, k, cos, sin, unsqueeze_dim: int = 1):
    """`torch.cat([q_embed.flatten(), k_embed.flatten()])` written directly by the kernel (one 1-D output)."""
    head_pos = _check_rope("apply_rotary_pos_emb_flat", q, k, cos, sin, unsqueeze_dim)
    if _cos_sin_need_grad(cos, sin):
        q_embed, k_embed = apply_rotary_pos_emb_hf(q, k, cos, sin, head_pos)
        return torch.cat([q_embed.reshape(-1), k_embed.reshape(-1)])
    return _rope_flat(_last_contig(q), _last_contig(k), *_cos_sin(cos, sin), head_pos)


# ------------------------------------------------------------------ in-place RoPE


def _no_heads(x: torch.Tensor, head_pos: int) -> torch.Tensor:
    """Zero-head slice of x: as the k of a q/k launch it makes the launch (and the op) work on x alone."""
    return x.narrow(head_pos, 0, 0)


@custom_op("rope_fwd_", mutates_args=("x",), inline=True)
def _rope_fwd_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_pos: int) -> None:
    if use_triton(x):
        from .triton_kernels import qk_rope_fwd

        xc = _canon(x, head_pos)
        qk_rope_fwd(xc, _no_heads(xc, 1), cos, sin, xc, _no_heads(xc, 1), inplace=True)
    else:
        x_rot = x[..., : cos.shape[-1]]
        x_rot.copy_(apply_rotary_pos_emb_hf(x_rot, _no_heads(x_rot, head_pos), cos, sin, head_pos)[0])


class _RopeInplace(torch.autograd.Function):
    """Rotates x[..., :R] in place (marked dirty: autograd checks the version counters). One tensor per
    Function: autograd allows an in-place Function on a view (q and k are transposed views in HF) only
    with a single output. The backward is out of place: the incoming grad may be shared with another
    consumer (an add passes one grad tensor to both of its inputs) or be the caller's `grad_outputs`."""

    @staticmethod
    def forward(ctx, x, cos, sin, head_pos):
        ctx.eager = not torch.compiler.is_compiling()
        call(ctx, _rope_fwd_, x, cos, sin, head_pos)
        ctx.mark_dirty(x)
        ctx.save_for_backward(cos, sin)
        ctx.head_pos, ctx.order = head_pos, _dim_order(x)
        return x

    @staticmethod
    @first_order("apply_rotary_pos_emb_")
    def backward(ctx, dx_out):
        cos, sin = ctx.saved_tensors
        dx_out = _last_contig(dx_out)
        dx, _ = call(ctx, _rope_bwd, dx_out, _no_heads(dx_out, ctx.head_pos), cos, sin, ctx.head_pos, ctx.order,
                     ctx.order)
        return dx, None, None, None


def apply_rotary_pos_emb_(q, k, cos, sin, unsqueeze_dim: int = 1):
    """In-place `apply_rotary_pos_emb`: rotates the first R = cos.shape[-1] features of q and k in place (the
    forward reads and writes only those; the backward writes a new grad) and returns (q, k). Needs
    `promote(q.dtype, cos.dtype) == q.dtype`. q and k must not be leaves that require grad, nor tensors an op
    saved for its backward (autograd raises), nor read again by the caller expecting the unrotated values."""
    name = "apply_rotary_pos_emb_"
    head_pos = _check_rope(name, q, k, cos, sin, unsqueeze_dim)
    if torch.promote_types(q.dtype, cos.dtype) != q.dtype:
        raise TypeError(f"{name}: cos/sin {cos.dtype} would promote q {q.dtype}: in place needs cos.dtype <= q.dtype")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(f"{name}: q and k need a contiguous last dim to be rotated in place")
    for what, t in (("q", q), ("k", k)):
        if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
            raise ValueError(f"{name}: {what} is expanded (stride 0 on a dim of size > 1, strides {t.stride()}): "
                             "its elements share memory and cannot be rotated in place; use apply_rotary_pos_emb")
    if _cos_sin_need_grad(cos, sin):
        raise ValueError(f"{name}: cos and sin require grad, and their gradient needs the unrotated q and k, which "
                         "the in-place rotation overwrites: use apply_rotary_pos_emb, or detach cos and sin")
    cos, sin = _cos_sin(cos, sin)
    if torch.compiler.is_compiling():
        # AOTAutograd loses the backward of an autograd.Function that marks a graph input dirty (torch 2.13: q / k
        # passed into the compiled region got the identity as gradient): under compile rotate out of place and
        # copy back, an input mutation that functionalization handles (one temporary of the rotated part)
        R = cos.shape[-1]
        q_rot, k_rot = q[..., :R], k[..., :R]
        q_new, k_new = _rope(q_rot, k_rot, cos, sin, head_pos)
        q_rot.copy_(q_new)
        k_rot.copy_(k_new)
        return q, k
    return _RopeInplace.apply(q, cos, sin, head_pos), _RopeInplace.apply(k, cos, sin, head_pos)


# ------------------------------------------------------------------ fused q/k RMSNorm + RoPE


def _norm_dtypes(x, w, cos, mode):
    norm_dtype = torch.promote_types(w.dtype, x.dtype) if mode == STANDARD else x.dtype
    return norm_dtype, torch.promote_types(norm_dtype, cos.dtype)


def _norm_rope_out(x, dtype, full):
    B, S, H, D = x.shape
    if full:  # HF: contiguous (B, S, H, D) norm output, transposed
        return torch.empty_strided((B, H, S, D), (S * H * D, D, H * D, 1), dtype=dtype, device=x.device)
    return x.new_empty((B, H, S, D), dtype=dtype)  # HF: `torch.cat` output, contiguous (B, H, S, D)


def _qk_norm_rope_into(q, k, q_weight, k_weight, cos, sin, eps, mode, norm_dtype, q_out, k_out) -> None:
    """The fused q/k norm + RoPE forward into preallocated (B, H, S, D) outputs: Triton on GPU / interpreter,
    else the HF-exact torch path. q, k: the (B, S, H, D) projections."""
    if use_triton(q):
        from .triton_kernels import qk_rope_fwd

        qk_rope_fwd(q.transpose(1, 2), k.transpose(1, 2), cos, sin, q_out, k_out, q_weight, k_weight, eps, mode,
                    round_norm=(norm_dtype == q.dtype and q.dtype != torch.float32))
    else:
        qr, kr = qk_norm_rope_hf(q, k, q_weight, k_weight, cos, sin, eps, mode)
        q_out.copy_(qr)
        k_out.copy_(kr)


@custom_op("qk_norm_rope_fwd", inline=True)
def _qk_norm_rope_fwd(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, eps: float, mode: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    norm_dtype, dtype = _norm_dtypes(q, q_weight, cos, mode)
    full = cos.shape[-1] == q.shape[-1]
    q_out, k_out = _norm_rope_out(q, dtype, full), _norm_rope_out(k, dtype, full)
    _qk_norm_rope_into(q, k, q_weight, k_weight, cos, sin, eps, mode, norm_dtype, q_out, k_out)
    return q_out, k_out


@_qk_norm_rope_fwd.register_fake
def _(q, k, q_weight, k_weight, cos, sin, eps, mode):
    _, dtype = _norm_dtypes(q, q_weight, cos, mode)
    full = cos.shape[-1] == q.shape[-1]
    return _norm_rope_out(q, dtype, full), _norm_rope_out(k, dtype, full)


@custom_op("qk_norm_rope_bwd", inline=True)
def _qk_norm_rope_bwd(
    dq_out: torch.Tensor, dk_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
    k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float, mode: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if use_triton(q):
        from .triton_kernels import qk_rope_bwd

        dq, dk = torch.empty_like(q), torch.empty_like(k)  # q's layout when q is dense
        dwq, dwk = qk_rope_bwd(dq_out, dk_out, cos, sin, dq.transpose(1, 2), dk.transpose(1, 2),
                               q.transpose(1, 2), k.transpose(1, 2), q_weight, k_weight, eps, mode)
        return dq, dk, dwq, dwk
    rq, rk, dwq, dwk = qk_norm_rope_bwd_reference(dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, eps, mode)
    return torch.empty_like(q).copy_(rq), torch.empty_like(k).copy_(rk), dwq, dwk


@_qk_norm_rope_bwd.register_fake
def _(dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, eps, mode):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(q_weight), torch.empty_like(k_weight)


def _norm_rope_setup_context(ctx, inputs, output):
    q, k, q_weight, k_weight, cos, sin, eps, mode = inputs
    ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin)
    ctx.eps, ctx.mode = eps, mode


@first_order("qk_norm_rope")
def _norm_rope_backward(ctx, dq_out, dk_out):
    q, k, q_weight, k_weight, cos, sin = ctx.saved_tensors
    B, S, Hq, D = q.shape
    dtype = _norm_dtypes(q, q_weight, cos, ctx.mode)[1]
    dq_out = _last_contig(dq_out) if dq_out is not None else q.new_zeros((B, Hq, S, D), dtype=dtype)
    dk_out = _last_contig(dk_out) if dk_out is not None else k.new_zeros((B, k.shape[2], S, D), dtype=dtype)
    dq, dk, dwq, dwk = call(ctx, _qk_norm_rope_bwd, dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, ctx.eps,
                            ctx.mode)
    return dq, dk, dwq, dwk, None, None, None, None


_qk_norm_rope_op = differentiable_op(_qk_norm_rope_fwd, _norm_rope_setup_context, _norm_rope_backward)


@custom_op("qk_norm_rope_fwd_flat", inline=True)
def _qk_norm_rope_fwd_flat(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, eps: float, mode: int,
) -> torch.Tensor:
    norm_dtype, dtype = _norm_dtypes(q, q_weight, cos, mode)
    B, S, Hq, D = q.shape
    Hk = k.shape[2]
    flat = q.new_empty(q.numel() + k.numel(), dtype=dtype)
    q_out = flat.narrow(0, 0, q.numel()).view(B, Hq, S, D)  # narrow: no device guard, unlike indexing
    k_out = flat.narrow(0, q.numel(), k.numel()).view(B, Hk, S, D)
    _qk_norm_rope_into(q, k, q_weight, k_weight, cos, sin, eps, mode, norm_dtype, q_out, k_out)
    return flat


@_qk_norm_rope_fwd_flat.register_fake
def _(q, k, q_weight, k_weight, cos, sin, eps, mode):
    return q.new_empty(q.numel() + k.numel(), dtype=_norm_dtypes(q, q_weight, cos, mode)[1])


@first_order("qk_norm_rope_flat")
def _norm_rope_flat_backward(ctx, dflat):
    q, k, q_weight, k_weight, cos, sin = ctx.saved_tensors
    B, S, Hq, D = q.shape
    dflat = dflat.contiguous()
    dq_out = dflat[: q.numel()].view(B, Hq, S, D)
    dk_out = dflat[q.numel():].view(B, k.shape[2], S, D)
    dq, dk, dwq, dwk = call(ctx, _qk_norm_rope_bwd, dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, ctx.eps,
                            ctx.mode)
    return dq, dk, dwq, dwk, None, None, None, None


_qk_norm_rope_flat_op = differentiable_op(_qk_norm_rope_fwd_flat, _norm_rope_setup_context, _norm_rope_flat_backward)


def _check_norm_rope(name, q, k, q_weight, k_weight, cos, sin):
    _check_rope(name, q, k, cos, sin, 2)
    for what, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        _check_tensor(name, what, w)
        if w.dim() != 1 or w.shape[0] != q.shape[-1]:
            raise ValueError(f"{name}: {what} must be 1-D of size head_dim={q.shape[-1]}, got {tuple(w.shape)}")
        if w.device != q.device:
            raise ValueError(f"{name}: {what} is on {w.device} but q on {q.device}")
    if q_weight.dtype != k_weight.dtype:
        raise TypeError(f"{name}: q_weight and k_weight dtypes differ ({q_weight.dtype} vs {k_weight.dtype})")


def _qk_norm_rope(name, q, k, q_weight, k_weight, cos, sin, eps, mode):
    _check_norm_rope(name, q, k, q_weight, k_weight, cos, sin)
    if _cos_sin_need_grad(cos, sin):
        return qk_norm_rope_hf(q, k, q_weight, k_weight, cos, sin, float(eps), mode)
    return _qk_norm_rope_op(_last_contig(q), _last_contig(k), q_weight.contiguous(), k_weight.contiguous(),
                            *_cos_sin(cos, sin), float(eps), mode)


def _qk_norm_rope_rebuild(q, k, q_weight, k_weight, cos, sin, eps, zero_centered: bool, q_out, k_out) -> None:
    """The forward of `qk_norm_rope` (`zero_centered`: `qk_norm_rope_zero_centered`), no autograd, written into
    (B, H, S, D) outputs of the op's layout: its outputs bit for bit (rebuilding them after a release)."""
    mode = ZERO_CENTERED if zero_centered else STANDARD
    q, k, (cos, sin) = _last_contig(q), _last_contig(k), _cos_sin(cos, sin)
    q_weight = q_weight.contiguous()
    if not use_triton(q):  # the torch path copies into the outputs: through aliases (see _common.released)
        q_out, k_out = write_alias(q_out), write_alias(k_out)
    _qk_norm_rope_into(q, k, q_weight, k_weight.contiguous(), cos, sin, float(eps), mode,
                       _norm_dtypes(q, q_weight, cos, mode)[0], q_out, k_out)


def qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps: float = 1e-6):
    """Qwen3 / Qwen3-MoE `q_norm`, `k_norm` (standard RMSNorm over head_dim), transpose, RoPE — one kernel.

    q: (B, S, Hq, D), k: (B, S, Hk, D) (rows may be strided views); cos/sin (B or 1, S, R), R <= D.
    Returns (B, Hq, S, D) and (B, Hk, S, D), as the HF attention has them before the KV cache."""
    return _qk_norm_rope("qk_norm_rope", q, k, q_weight, k_weight, cos, sin, eps, STANDARD)


def qk_norm_rope_zero_centered(q, k, q_weight, k_weight, cos, sin, eps: float = 1e-6):
    """Qwen3.5 form of `qk_norm_rope`: zero-centred RMSNorm `(1 + w)` in fp32, then (partial) RoPE."""
    return _qk_norm_rope("qk_norm_rope_zero_centered", q, k, q_weight, k_weight, cos, sin, eps, ZERO_CENTERED)


def qk_norm_rope_flat(q, k, q_weight, k_weight, cos, sin, eps: float = 1e-6, zero_centered: bool = False):
    """`torch.cat([q_out.flatten(), k_out.flatten()])` of `qk_norm_rope` (or `_zero_centered`), written directly."""
    name = "qk_norm_rope_flat"
    _check_norm_rope(name, q, k, q_weight, k_weight, cos, sin)
    mode = ZERO_CENTERED if zero_centered else STANDARD
    if _cos_sin_need_grad(cos, sin):
        q_out, k_out = qk_norm_rope_hf(q, k, q_weight, k_weight, cos, sin, float(eps), mode)
        return torch.cat([q_out.reshape(-1), k_out.reshape(-1)])
    return _qk_norm_rope_flat_op(_last_contig(q), _last_contig(k), q_weight.contiguous(), k_weight.contiguous(),
                                 *_cos_sin(cos, sin), float(eps), mode)


# ----------------------------------------------------------------------------- q/k/v projections

@custom_op("qkv_proj_fwd", inline=True)
def _qkv_proj_fwd(
    x: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, v_weight: torch.Tensor,
    q_bias: Optional[torch.Tensor], k_bias: Optional[torch.Tensor], v_bias: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return F.linear(x, q_weight, q_bias), F.linear(x, k_weight, k_bias), F.linear(x, v_weight, v_bias)


@_qkv_proj_fwd.register_fake
def _(x, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias):
    return tuple(x.new_empty((*x.shape[:-1], w.shape[0])) for w in (q_weight, k_weight, v_weight))


@custom_op("qkv_proj_bwd", inline=True)
def _qkv_proj_bwd(
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, x: torch.Tensor, q_weight: torch.Tensor,
    k_weight: torch.Tensor, v_weight: torch.Tensor, has_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dq_weight, dk_weight, dv_weight, dq_bias, dk_bias, dv_bias; the biases' empty without biases)."""
    x2 = x.reshape(-1, x.shape[-1])
    grads = [g.reshape(-1, g.shape[-1]) for g in (dq, dk, dv)]
    dx = grads[0] @ q_weight
    dx.addmm_(grads[1], k_weight).addmm_(grads[2], v_weight)  # accumulated in the GEMMs: no add kernels
    dws = [g.t() @ x2 for g in grads]
    dbs = [g.sum(0) if has_bias else x.new_empty(0) for g in grads]
    return (dx.view(x.shape), *dws, *dbs)


@_qkv_proj_bwd.register_fake
def _(dq, dk, dv, x, q_weight, k_weight, v_weight, has_bias):
    dbs = [x.new_empty(w.shape[0]) if has_bias else x.new_empty(0) for w in (q_weight, k_weight, v_weight)]
    return (torch.empty_like(x), torch.empty_like(q_weight), torch.empty_like(k_weight), torch.empty_like(v_weight),
            *dbs)


def _qkv_proj_setup_context(ctx, inputs, output):
    x, q_weight, k_weight, v_weight, q_bias, _, _ = inputs
    ctx.save_for_backward(x, q_weight, k_weight, v_weight)
    ctx.has_bias = q_bias is not None


@first_order("qkv_projections")
def _qkv_proj_backward(ctx, dq, dk, dv):
    x, q_weight, k_weight, v_weight = ctx.saved_tensors
    dx, dwq, dwk, dwv, dbq, dbk, dbv = call(ctx, _qkv_proj_bwd, dq, dk, dv, x, q_weight, k_weight, v_weight,
                                            ctx.has_bias)
    biases = (dbq, dbk, dbv) if ctx.has_bias else (None, None, None)
    return (dx, dwq, dwk, dwv, *biases)


_qkv_proj_op = differentiable_op(_qkv_proj_fwd, _qkv_proj_setup_context, _qkv_proj_backward)


def _qkv_projections(x: torch.Tensor, q_proj, k_proj, v_proj) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`q_proj(x), k_proj(x), v_proj(x)` of three `nn.Linear`s as one op whose backward accumulates the three
    input gradients in its GEMMs (two add kernels fewer). The modules themselves are called (hooks, adapters,
    other Linear classes, autocast, mixed dtypes or biases kept) unless all three are plain hook-free
    `nn.Linear`s of x's dtype, all biased or none."""
    mods = (q_proj, k_proj, v_proj)
    plain = (all(plain_linear(m, x.dtype) for m in mods) and len({m.bias is None for m in mods}) == 1
             and autocast_dtype(x) is None)
    if not plain:
        return q_proj(x), k_proj(x), v_proj(x)
    return _qkv_proj_op(x, q_proj.weight, k_proj.weight, v_proj.weight, q_proj.bias, k_proj.bias, v_proj.bias)


# ----------------------------------------------------------------------------- the attention block, one node

def _qkv_weight(q_weight, k_weight, v_weight, q_bias, k_bias, v_bias):
    """The three projections stacked: one GEMM instead of three (forward and both backward products)."""
    bias = torch.cat((q_bias, k_bias, v_bias)) if q_bias is not None else None
    return torch.cat((q_weight, k_weight, v_weight)), bias


def _split_heads(qkv, sizes, head_dim):
    """(B, S, Hq, D), (B, S, Hk, D), (B, S, Hk, D) column views of the stacked projections (B, S, W)."""
    B, S = qkv.shape[:2]
    return [part.view(B, S, -1, head_dim) for part in torch.split(qkv, sizes, dim=-1)]


def _block_rotate(q, k, q_norm_weight, k_norm_weight, cos, sin, eps, mode):
    """The (B, H, S, D) q / k the attention reads, from the (B, S, H, D) projections: q/k norm + RoPE, or RoPE
    alone (mode NONE: Llama, Qwen2), in the layouts of the per-op path."""
    if mode == NONE:
        return _rope_fwd.eager_impl(q.transpose(1, 2), k.transpose(1, 2), cos, sin, 1)
    return _qk_norm_rope_fwd.eager_impl(q, k, q_norm_weight, k_norm_weight, cos, sin, eps, mode)


def _attention_block_forward(x, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, q_norm_weight, k_norm_weight,
                             cos, sin, o_weight, o_bias, eps, mode, head_dim, scale, needs_grad: bool):
    """The forward of `_QKNormRopeAttentionBlock` (no autograd, for nodes that run it): (y, saved, args), where
    `saved` are the tensors the backward reads besides x and `args` its other arguments."""
    B, S = x.shape[:2]
    stacked = use_triton(x)
    if stacked:
        weight, bias = _qkv_weight(q_weight, k_weight, v_weight, q_bias, k_bias, v_bias)
        sizes = (q_weight.shape[0], k_weight.shape[0], v_weight.shape[0])
        q, k, v = _split_heads(F.linear(x, weight, bias), sizes, head_dim)
    else:
        q, k, v = (F.linear(x, w, b).view(B, S, -1, head_dim)
                   for w, b in ((q_weight, q_bias), (k_weight, k_bias), (v_weight, v_bias)))
    q_rot, k_rot = _block_rotate(q, k, q_norm_weight, k_norm_weight, cos, sin, eps, mode)
    is_causal = S > 1  # as transformers' sdpa_attention_forward: one query attends to every key
    v_heads = v.transpose(1, 2)
    backend = sdpa_backend(q_rot, k_rot, v_heads, is_causal, scale, needs_grad)
    out, sdpa_saved, sdpa_sizes = sdpa_forward(backend, q_rot, k_rot, v_heads, is_causal, scale)
    y = F.linear(out.transpose(1, 2).reshape(B, S, -1), o_weight, o_bias)
    saved = (q, k, v, out, q_weight, k_weight, v_weight, q_norm_weight, k_norm_weight, cos, sin, o_weight,
             *sdpa_saved)
    args = (eps, mode, scale, is_causal, backend, sdpa_sizes, q_bias is not None, o_bias is not None, stacked)
    return y, saved, args


def _attention_block_backward(dy, x, saved, args):
    """The backward of `_QKNormRopeAttentionBlock` from `_attention_block_forward`'s `saved` / `args` and x:
    (dx, dwq, dwk, dwv, dbq, dbk, dbv, dwq_norm, dwk_norm, d_o_weight, d_o_bias)."""
    q, k, v, out, q_weight, k_weight, v_weight, q_norm_weight, k_norm_weight, cos, sin, o_weight, *sdpa_saved = saved
    eps, mode, scale, is_causal, backend, sdpa_sizes, has_bias, has_o_bias, stacked = args
    B, S = x.shape[:2]
    dy2 = dy.reshape(B * S, -1)
    d_attn = (dy2 @ o_weight).view(B, S, -1, q.shape[-1])
    d_o_weight = dy2.t() @ out.transpose(1, 2).reshape(B * S, -1)
    d_o_bias = dy2.sum(0) if has_o_bias else None
    q_rot, k_rot = _block_rotate(q, k, q_norm_weight, k_norm_weight, cos, sin, eps, mode)
    dq_rot, dk_rot, dv = sdpa_backward(backend, d_attn.transpose(1, 2), q_rot, k_rot, v.transpose(1, 2), out,
                                       sdpa_saved, sdpa_sizes, is_causal, scale)
    del q_rot, k_rot, d_attn
    dq_rot, dk_rot = _last_contig(dq_rot), _last_contig(dk_rot)
    if not stacked:
        if mode == NONE:
            dq, dk = (t.transpose(1, 2) for t in rope_bwd_reference(dq_rot, dk_rot, cos, sin, q.dtype))
            dwq_norm = dwk_norm = None
        else:
            dq, dk, dwq_norm, dwk_norm = _qk_norm_rope_bwd.eager_impl(
                dq_rot, dk_rot, q, k, q_norm_weight, k_norm_weight, cos, sin, eps, mode)
        dx, dwq, dwk, dwv, dbq, dbk, dbv = _qkv_proj_bwd.eager_impl(
            dq.reshape(B, S, -1), dk.reshape(B, S, -1), dv.transpose(1, 2).reshape(B, S, -1), x, q_weight,
            k_weight, v_weight, has_bias)
    else:
        from .triton_kernels import qk_rope_bwd

        sizes = (q_weight.shape[0], k_weight.shape[0], v_weight.shape[0])
        d_qkv = x.new_empty((B, S, sum(sizes)))
        dq, dk, d_v = _split_heads(d_qkv, sizes, q.shape[-1])
        if mode == NONE:
            qk_rope_bwd(dq_rot, dk_rot, cos, sin, dq.transpose(1, 2), dk.transpose(1, 2))
            dwq_norm = dwk_norm = None
        else:
            dwq_norm, dwk_norm = qk_rope_bwd(dq_rot, dk_rot, cos, sin, dq.transpose(1, 2), dk.transpose(1, 2),
                                             q.transpose(1, 2), k.transpose(1, 2), q_norm_weight,
                                             k_norm_weight, eps, mode)
        d_v.copy_(dv.transpose(1, 2))
        weight, _ = _qkv_weight(q_weight, k_weight, v_weight, None, None, None)
        d_qkv2 = d_qkv.view(B * S, -1)
        dx = (d_qkv2 @ weight).view(x.shape)
        dwq, dwk, dwv = torch.split(d_qkv2.t() @ x.reshape(B * S, -1), sizes)
        dbq, dbk, dbv = torch.split(d_qkv2.sum(0), sizes) if has_bias else (None, None, None)
    biases = (dbq, dbk, dbv) if has_bias else (None, None, None)
    return dx, dwq, dwk, dwv, *biases, dwq_norm, dwk_norm, d_o_weight, d_o_bias


class _QKNormRopeAttentionBlock(torch.autograd.Function):
    """`o_proj(SDPA(rope(q_norm(q_proj x)), rope(k_norm(k_proj x)), v_proj x))` (mode NONE: no q/k norm) as one
    autograd node, for eager mode: the kernels of `_qkv_projections`, `qk_norm_rope` (or `apply_rotary_pos_emb`),
    SDPA (causal, no mask, no dropout) and `o_proj` without the host work of ~14 autograd nodes a layer (views,
    transposes, four ops). On the Triton path the q/k/v projections run as one GEMM over the stacked weights
    (forward, and each of the two backward products: six GEMM calls fewer a layer); the torch path keeps HF's
    three.

    Saved: x (or, where x is the input norm's output, the norm's input and weight: x is rebuilt in the backward,
    one norm pass), the q/k/v projections, the attention output and what SDPA's backward reads (its
    log-sum-exp). The rotated q and k SDPA reads are not kept: the backward rebuilds them from the projections
    (one norm + RoPE pass). Both rebuilds are bit for bit."""

    @staticmethod
    def forward(ctx, x, x_rebuild, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, q_norm_weight,
                k_norm_weight, cos, sin, o_weight, o_bias, eps, mode, head_dim, scale):
        y, saved, ctx.args = _attention_block_forward(
            x, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, q_norm_weight, k_norm_weight, cos, sin,
            o_weight, o_bias, eps, mode, head_dim, scale, any(ctx.needs_input_grad))
        # x itself, or (x_rebuild) the sources it is rebuilt from in the backward: x need not outlive the forward
        x_saved = (x,) if x_rebuild is None else x_rebuild.sources
        ctx.save_for_backward(*x_saved, *saved)
        ctx.x_rebuild = None if x_rebuild is None else (x_rebuild.write, len(x_saved), x.shape, x.dtype)
        return y

    @staticmethod
    @first_order("attention block")
    def backward(ctx, dy):
        n_x = 1 if ctx.x_rebuild is None else ctx.x_rebuild[1]
        tensors = ctx.saved_tensors
        saved = tensors[n_x:]
        if ctx.x_rebuild is None:
            x = tensors[0]
        else:
            write, _, shape, dtype = ctx.x_rebuild
            x = saved[0].new_empty(shape, dtype=dtype)
            write(x, *tensors[:n_x])
        dx, dwq, dwk, dwv, dbq, dbk, dbv, dwq_norm, dwk_norm, d_o_weight, d_o_bias = _attention_block_backward(
            dy, x, saved, ctx.args)
        return (dx, None, dwq, dwk, dwv, dbq, dbk, dbv, dwq_norm, dwk_norm, None, None, d_o_weight, d_o_bias,
                None, None, None, None)


def _attention_block(x, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, q_norm_weight, k_norm_weight, cos,
                     sin, o_weight, o_bias, eps: float, head_dim: int, scale: float, x_rebuild=None):
    """The attention of Qwen3 / Qwen3-MoE (q/k norm weights given) or Llama / Qwen2 (None: RoPE alone) from the
    input norm's output to `o_proj`'s output (no cache, no mask: causal; no dropout), in one autograd node: the
    q/k/v projections, q/k RMSNorm + RoPE (one kernel), SDPA on the backend SDPA itself would choose (grouped-query
    natively), `o_proj`. Eager mode only (torch.compile traces the ops one by one); the caller checks the
    preconditions (`rotary.layers._attention_block_applies`).

    x: (B, S, hidden); q/k/v/o weights and biases as the `nn.Linear`s' (all of x's dtype; q/k/v biased or
    not together); q/k norm weights (head_dim,) or None; cos / sin (B or 1, S, R) not requiring grad.
    x_rebuild: x's `_common.released.Rebuild` (its sources are kept instead of x, which the backward rebuilds), or
    None (x is kept)."""
    mode = NONE if q_norm_weight is None else STANDARD
    return _QKNormRopeAttentionBlock.apply(
        x, x_rebuild, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, q_norm_weight, k_norm_weight,
        *_cos_sin(cos, sin),
        o_weight, o_bias, float(eps), mode, head_dim, float(scale))


__all__ = ["apply_rotary_pos_emb", "apply_rotary_pos_emb_flat", "apply_rotary_pos_emb_", "qk_norm_rope",
           "qk_norm_rope_zero_centered", "qk_norm_rope_flat",
           "NONE", "STANDARD", "ZERO_CENTERED"]
