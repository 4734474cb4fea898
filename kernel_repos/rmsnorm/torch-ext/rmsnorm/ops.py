"""Custom ops and the functional API of the RMSNorm family.

The fused forward and backward are custom ops under this build's unique namespace, with fake implementations
and autograd, so that `torch.compile(fullgraph=True)` sees one opaque node per call (on NVIDIA GPUs it inlines
them, `_common.custom_op`'s `inline=True`: Inductor traces the implementations and launches the kernels itself). In eager mode the same
implementations run through an autograd.Function (`_custom_op.differentiable_op`), which costs far less Python
per call than the custom-op dispatcher (the ops are small enough for that overhead to show). Both dispatch on the tensor's device at run time:
Triton on CUDA/ROCm/XPU (and on CPU under `TRITON_INTERPRET=1`), the torch reference otherwise.
"""
import functools
from typing import Optional

import torch

from hubfuse._common.checks import first_order
from hubfuse._common.released import can_release, mark_rebuildable, write_alias
from hubfuse._common.device import use_triton
from hubfuse._common.custom_op import call, custom_op, differentiable_op
from .reference import GATED, STANDARD, ZERO_CENTERED, rms_norm_bwd_reference, rms_norm_fwd_reference


def _fwd_impl(x, weight, gate, eps, mode):
    if use_triton(x):
        from .triton_kernels import rms_norm_fwd

        return rms_norm_fwd(x, weight, gate, eps, mode, _out_dtype(x, weight, mode))
    y, rstd = rms_norm_fwd_reference(x, weight, gate, eps, mode)
    return y.contiguous(), rstd


def _bwd_impl(dy, x, weight, gate, rstd, mode):
    if use_triton(x):
        from .triton_kernels import rms_norm_bwd

        return rms_norm_bwd(dy, x, weight, gate, rstd, mode)
    return rms_norm_bwd_reference(dy, x, weight, gate, rstd, mode)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Implementation of the Llama/Qwen RMSNorm forward on 2-D `x` (no autograd, for other ops' implementations):
    (y, rstd) with rstd in fp32."""
    return _fwd_impl(x, weight, None, eps, STANDARD)


# dtypes whose residual adds run inside the norm kernels: the norm's fp32 gradient is rounded to the dtype before the
# add, as torch's add gets it. Not fp32: there that rounding is no operation, and a GPU compiler contracts the
# gradient's last product and the add into one FMA (one rounding fewer than torch's separate add)
_ADD_IN_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def rms_norm_add_forward(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """Implementation of the Llama/Qwen RMSNorm forward of `h = x + residual` (a residual stream's add and the norm
    after it) on 2-D tensors of one shape (no autograd, for other ops' implementations): (h, y, rstd), h rounded
    as torch's add rounds it. On the Triton path (16-bit dtypes) one kernel writes h and y, where torch would run
    two."""
    if use_triton(x) and residual.dtype == x.dtype and x.dtype in _ADD_IN_KERNEL_DTYPES:
        from .triton_kernels import rms_norm_fwd

        x, residual = x.contiguous(), residual.contiguous()
        h = torch.empty_like(x)
        y, rstd = rms_norm_fwd(x, weight, None, eps, STANDARD, _out_dtype(x, weight, STANDARD), residual=residual,
                               h=h)
        return h, y, rstd
    h = x + residual
    return (h, *_fwd_impl(h, weight, None, eps, STANDARD))


def _standard_bwd(dy, x, weight, rstd, dresidual, rebuild_y: bool):
    """The Llama/Qwen RMSNorm backward on 2-D tensors: (dx, dweight, y or None). `dresidual` (a gradient that
    reaches x by another path) is added to dx, inside the kernel where it can be (16-bit, contiguous, x's dtype:
    the kernel adds at dx's strides), else by torch. `rebuild_y`: also the forward's output, from x and rstd."""
    if use_triton(x):
        from .triton_kernels import rms_norm_bwd

        fused = (dresidual is not None and dresidual.dtype == x.dtype and x.dtype in _ADD_IN_KERNEL_DTYPES
                 and x.is_contiguous() and dresidual.is_contiguous())
        dx, dw, _ = rms_norm_bwd(dy, x, weight, None, rstd, STANDARD, y=dy if rebuild_y else None,
                                 dresidual=dresidual if fused else None)
        y = dy if rebuild_y else None  # the kernel wrote y over dy
    else:
        fused = False
        dx, dw, _ = rms_norm_bwd_reference(dy, x, weight, None, rstd, STANDARD)
        y = weight * (x.float() * rstd[:, None]).to(x.dtype) if rebuild_y else None  # rms_norm_hf's y
    if dresidual is not None and not fused:
        dx = dresidual + dx
    return dx, dw, y


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                      dresidual: Optional[torch.Tensor] = None):
    """Implementation of the Llama/Qwen RMSNorm backward on 2-D tensors (no autograd): (dx, dweight). With
    `dresidual`, a gradient that reaches x by another path (the residual stream), dx is the norm's gradient plus
    it, as torch adds the two: in the same kernel on the Triton path."""
    return _standard_bwd(dy, x, weight, rstd, dresidual, rebuild_y=False)[:2]


def rms_norm_backward_recompute(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                                dresidual: Optional[torch.Tensor] = None):
    """Implementation of the Llama/Qwen RMSNorm backward on 2-D tensors that also rebuilds the forward's output
    bit for bit from (x, weight, rstd), for an op that saved x but not y: (dx, dweight, y). On the Triton path the
    same kernel writes y (over `dy`, which it no longer needs), so keeping y costs one store, not a pass.
    `dresidual`: added to dx as in `rms_norm_backward`."""
    return _standard_bwd(dy, x, weight, rstd, dresidual, rebuild_y=True)


def _out_dtype(x: torch.Tensor, weight: torch.Tensor, mode: int) -> torch.dtype:
    # HF: standard returns `weight * h.to(x.dtype)` (type promotion); the others cast back to x.dtype
    return torch.promote_types(weight.dtype, x.dtype) if mode == STANDARD else x.dtype


@custom_op("rms_norm_fwd", inline=True)
def _rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, gate: Optional[torch.Tensor], eps: float, mode: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd_impl(x, weight, gate, eps, mode)


@_rms_norm_fwd.register_fake
def _(x, weight, gate, eps, mode):
    return x.new_empty(x.shape, dtype=_out_dtype(x, weight, mode)), x.new_empty(x.shape[0], dtype=torch.float32)


@custom_op("rms_norm_bwd", inline=True)
def _rms_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, gate: Optional[torch.Tensor], rstd: torch.Tensor,
    mode: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd_impl(dy, x, weight, gate, rstd, mode)


@_rms_norm_bwd.register_fake
def _(dy, x, weight, gate, rstd, mode):
    dgate = torch.empty_like(gate) if gate is not None else x.new_empty(0)
    return torch.empty_like(x), torch.empty_like(weight), dgate


def _setup_context(ctx, inputs, output):
    x, weight, gate, eps, mode = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # else autograd fills a zero gradient for rstd (a launch) that nothing reads
    ctx.save_for_backward(x, weight, gate, output[1])
    ctx.mode = mode


@first_order("rms_norm")
def _backward(ctx, dy, _drstd):
    x, weight, gate, rstd = ctx.saved_tensors
    dx, dw, dgate = call(ctx, _rms_norm_bwd, dy.contiguous(), x, weight, gate, rstd, ctx.mode)
    return dx, dw, (dgate if gate is not None else None), None, None


_rms_norm = differentiable_op(_rms_norm_fwd, _setup_context, _backward)


def check_rms_norm_inputs(name: str, x: torch.Tensor, weight: torch.Tensor, gate: Optional[torch.Tensor]) -> None:
    """The RMSNorm family's argument checks (also run by ops that fuse an RMSNorm)."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"{name}: hidden_states and weight must be tensors")
    if not x.is_floating_point():
        raise TypeError(f"{name}: hidden_states must be a floating-point tensor, got {x.dtype}")
    if not weight.is_floating_point():
        raise TypeError(f"{name}: weight must be a floating-point tensor, got {weight.dtype}")
    if x.dim() == 0 or weight.dim() != 1:
        raise ValueError(f"{name}: expected hidden_states (..., hidden) and a 1-D weight, got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"{name}: hidden size {x.shape[-1]} of hidden_states does not match weight size "
                         f"{weight.shape[0]}")
    if x.numel() == 0:
        raise ValueError(f"{name}: hidden_states is empty, shape {tuple(x.shape)}")
    if weight.device != x.device:
        raise ValueError(f"{name}: weight is on {weight.device} but hidden_states on {x.device}")
    if x.shape[-1] > 65536:
        raise ValueError(f"{name}: hidden size {x.shape[-1]} of hidden_states exceeds the supported maximum 65536")
    if gate is not None:
        if gate.shape != x.shape:
            raise ValueError(f"{name}: gate shape {tuple(gate.shape)} does not match hidden_states "
                             f"{tuple(x.shape)}")
        if gate.dtype != x.dtype:
            raise TypeError(f"{name}: gate dtype {gate.dtype} does not match hidden_states dtype {x.dtype}")
        if gate.device != x.device:
            raise ValueError(f"{name}: gate is on {gate.device} but hidden_states on {x.device}")


def _apply(name, x, weight, gate, eps, mode, rebuildable: bool = False):
    check_rms_norm_inputs(name, x, weight, gate)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    g2 = gate.reshape(-1, shape[-1]).contiguous() if gate is not None else None
    weight = weight.contiguous()
    y, _ = _rms_norm(x2, weight, g2, float(eps), mode)
    y = y.view(shape)
    if rebuildable and can_release() and y.grad_fn is not None:
        # the op saves x2 and weight: a consumer that alone reads y may release it until the backward
        mark_rebuildable(y, functools.partial(_rebuild_output, eps=float(eps), mode=mode), x2, weight)
    return y


def _module_forward(module, hidden_states, weight, eps, mode):
    """A kernelized RMSNorm module's forward (standard or zero-centred): its output marked rebuildable
    (`_common.released`: the attention it feeds may free it until the backward), unless forward hooks on the
    module see the output (they could keep it and read it later)."""
    name = "rms_norm" if mode == STANDARD else "rms_norm_zero_centered"
    return _apply(name, hidden_states, weight, None, eps, mode, rebuildable=not module._forward_hooks)


def _rebuild_output(out, x2, weight, *, eps, mode):
    """The forward's output of (x2, weight), bit for bit, into `out` (its version counter left as it is)."""
    if use_triton(x2):
        from .triton_kernels import rms_norm_fwd

        rms_norm_fwd(x2, weight, None, eps, mode, out.dtype, y=out.view(x2.shape))
    else:
        write_alias(out).view(x2.shape).copy_(_fwd_impl(x2, weight, None, eps, mode)[0])


def rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Llama/Qwen RMSNorm: `weight * (x * rstd).to(x.dtype)`, fp32 statistics."""
    return _apply("rms_norm", hidden_states, weight, None, eps, STANDARD)


def rms_norm_zero_centered(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Qwen3.5/Qwen3-Next RMSNorm: `(x * rstd * (1 + weight))` in fp32, cast to x.dtype."""
    return _apply("rms_norm_zero_centered", hidden_states, weight, None, eps, ZERO_CENTERED)


def rms_norm_gated(
    hidden_states: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """Qwen3.5/Qwen3-Next RMSNormGated: `(weight * (x * rstd).to(x.dtype)) * silu(gate)` in fp32, cast."""
    if not isinstance(gate, torch.Tensor):
        raise TypeError("rms_norm_gated: gate must be a tensor")
    return _apply("rms_norm_gated", hidden_states, weight, gate, eps, GATED)
