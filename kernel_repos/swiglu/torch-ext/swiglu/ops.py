"""Custom ops and the functional API of the SwiGLU MLP.

Custom-op pairs under this build's unique namespace, with fake implementations and autograd, so
`torch.compile(fullgraph=True)` sees one opaque node per call (on NVIDIA GPUs it inlines them, `_common.custom_op`'s
`inline=True`; eager calls run the same implementations through an autograd.Function,
`_custom_op.differentiable_op`: no dispatcher cost):

- `swiglu_fwd` / `swiglu_bwd`: the activation alone, `[..., 2I] -> [..., I]`, functional backward.
- `swiglu_down_fwd` / `swiglu_down_bwd`: the activation followed by `down_proj`, the tail of the MLP. Only
  `gate_up` is saved; the backward recomputes `h = silu(gate) * up` (for the down weight's gradient) into the
  buffer of `dh`, and writes `dgate_up` over `gate_up` in place, so the backward allocates no activation-sized
  buffer beyond `dh`. `gate_up` is an internal of `swiglu_mlp` (never exposed), and autograd's version counter
  turns a second backward over the same graph (`retain_graph=True`) into an error rather than a wrong result.
  Traced (torch.compile), the backward takes `swiglu_down_bwd_functional`, which writes `dgate_up` to a new
  buffer: there the compiler plans the buffers, and an in-place write into a saved tensor costs a copy.

- `rms_norm_gate_up_fwd` / `rms_norm_gate_up_bwd`: the RMSNorm followed by the gate/up GEMM, the head of the
  fused `rms_norm_swiglu_mlp`. It saves the norm's input and rstd but not its output (the GEMM's input): the
  backward's RMSNorm kernel rebuilds that output bit for bit while it reads the same rows for dx, so the fusion
  keeps one hidden-sized activation per token instead of two.

`swiglu_mlp(x, ...)` = `F.linear(x, gate_up_weight)` (one GEMM instead of two) + `swiglu_down`.
Each op dispatches on the tensor's device at run time: Triton on CUDA/ROCm/XPU (and on CPU under
`TRITON_INTERPRET=1`), the torch reference otherwise.
"""
from typing import Optional

import torch
import torch.nn.functional as F

from hubfuse._common.checks import first_order
from hubfuse._common.device import autocast_dtype, use_triton
from hubfuse._common.custom_op import call, custom_op, differentiable_op
from hubfuse.rmsnorm.ops import check_rms_norm_inputs, rms_norm, rms_norm_add_forward, rms_norm_backward_recompute, \
    rms_norm_forward
from .reference import swiglu_bwd_reference, swiglu_fwd_reference

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------- activation alone
@custom_op("swiglu_fwd", inline=True)
def _swiglu_fwd(gate_up: torch.Tensor) -> torch.Tensor:
    if use_triton(gate_up):
        from .triton_kernels import swiglu_fwd

        return swiglu_fwd(gate_up)
    return swiglu_fwd_reference(gate_up)


@_swiglu_fwd.register_fake
def _(gate_up):
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


@custom_op("swiglu_bwd", inline=True)
def _swiglu_bwd(dh: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    if use_triton(gate_up):
        from .triton_kernels import swiglu_bwd

        dgate_up = torch.empty_like(gate_up)
        swiglu_bwd(dh, gate_up, dgate_up)
        return dgate_up
    return swiglu_bwd_reference(dh, gate_up)[0]


@_swiglu_bwd.register_fake
def _(dh, gate_up):
    return torch.empty_like(gate_up)


def _swiglu_setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


@first_order("swiglu")
def _swiglu_backward(ctx, dh):
    (gate_up,) = ctx.saved_tensors
    return call(ctx, _swiglu_bwd, dh.contiguous(), gate_up)


_swiglu = differentiable_op(_swiglu_fwd, _swiglu_setup_context, _swiglu_backward)


# ---------------------------------------------------------------- activation + down_proj
@custom_op("swiglu_down_fwd", inline=True)
def _swiglu_down_fwd(
    gate_up: torch.Tensor, down_weight: torch.Tensor, down_bias: Optional[torch.Tensor]
) -> torch.Tensor:
    h = _swiglu_fwd.eager_impl(gate_up)  # inside an op: the implementation, not a nested op call
    return F.linear(h, down_weight, down_bias)


@_swiglu_down_fwd.register_fake
def _(gate_up, down_weight, down_bias):
    return gate_up.new_empty((gate_up.shape[0], down_weight.shape[0]))


def _down_grads(dout, gate_up, down_weight, has_down_bias: bool, in_place: bool):
    """(dgate_up, d down_weight, d down_bias or an empty tensor) of the MLP tail; `in_place`: dgate_up is written
    over `gate_up` (and returned as it), else into a new buffer. The recomputed h goes over dh either way."""
    dh = dout @ down_weight  # [M, I]
    if use_triton(gate_up):
        from .triton_kernels import swiglu_bwd

        dgate_up = gate_up if in_place else torch.empty_like(gate_up)
        swiglu_bwd(dh, gate_up, dgate_up, h=dh)
        h = dh
    else:
        dgate_up, h = swiglu_bwd_reference(dh, gate_up)
        if in_place:
            dgate_up = gate_up.copy_(dgate_up)
    d_down_weight = dout.t() @ h
    d_down_bias = dout.sum(0) if has_down_bias else dout.new_empty(0)
    return dgate_up, d_down_weight, d_down_bias


def _fake_down_bias_grad(dout, has_down_bias: bool):
    return dout.new_empty(dout.shape[1]) if has_down_bias else dout.new_empty(0)


@custom_op("swiglu_down_bwd", mutates_args=("gate_up",), inline=True)
def _swiglu_down_bwd(
    dout: torch.Tensor, gate_up: torch.Tensor, down_weight: torch.Tensor, has_down_bias: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (d down_weight, d down_bias or an empty tensor); overwrites `gate_up` with `dgate_up`."""
    return _down_grads(dout, gate_up, down_weight, has_down_bias, in_place=True)[1:]


@_swiglu_down_bwd.register_fake
def _(dout, gate_up, down_weight, has_down_bias):
    return torch.empty_like(down_weight), _fake_down_bias_grad(dout, has_down_bias)


@custom_op("swiglu_down_bwd_functional", inline=True)
def _swiglu_down_bwd_functional(
    dout: torch.Tensor, gate_up: torch.Tensor, down_weight: torch.Tensor, has_down_bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`swiglu_down_bwd` without the in-place write, for traced graphs: (dgate_up, d down_weight, d down_bias or an
    empty tensor). Traced, an in-place write into the saved `gate_up` costs functionalization a copy of it; a new
    `dgate_up` costs nothing, and the compiler plans the buffers."""
    return _down_grads(dout, gate_up, down_weight, has_down_bias, in_place=False)


@_swiglu_down_bwd_functional.register_fake
def _(dout, gate_up, down_weight, has_down_bias):
    return torch.empty_like(gate_up), torch.empty_like(down_weight), _fake_down_bias_grad(dout, has_down_bias)


def _swiglu_down_setup_context(ctx, inputs, output):
    gate_up, down_weight, down_bias = inputs
    ctx.save_for_backward(gate_up, down_weight)
    ctx.has_down_bias = down_bias is not None


@first_order("swiglu_mlp")
def _swiglu_down_backward(ctx, dout):
    gate_up, down_weight = ctx.saved_tensors
    if not getattr(ctx, "eager", False):  # traced (torch.compile): no in-place write into a saved tensor
        dgate_up, d_down_weight, d_down_bias = _swiglu_down_bwd_functional(dout.contiguous(), gate_up, down_weight,
                                                                           ctx.has_down_bias)
        return dgate_up, d_down_weight, (d_down_bias if ctx.has_down_bias else None)
    d_down_weight, d_down_bias = call(ctx, _swiglu_down_bwd, dout.contiguous(), gate_up, down_weight,
                                      ctx.has_down_bias)
    # `gate_up` now holds its own gradient
    return gate_up, d_down_weight, (d_down_bias if ctx.has_down_bias else None)


_swiglu_down = differentiable_op(_swiglu_down_fwd, _swiglu_down_setup_context, _swiglu_down_backward)


# ---------------------------------------------------------------- RMSNorm + gate/up GEMM
@custom_op("rms_norm_gate_up_fwd", inline=True)
def _rms_norm_gate_up_fwd(
    x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_up_weight: torch.Tensor,
    gate_up_bias: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    normed, rstd = rms_norm_forward(x, norm_weight, eps)
    return F.linear(normed, gate_up_weight, gate_up_bias), rstd


@_rms_norm_gate_up_fwd.register_fake
def _(x, norm_weight, eps, gate_up_weight, gate_up_bias):
    return x.new_empty((x.shape[0], gate_up_weight.shape[0])), x.new_empty(x.shape[0], dtype=torch.float32)


@custom_op("rms_norm_gate_up_bwd", inline=True)
def _rms_norm_gate_up_bwd(
    dgate_up: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor, rstd: torch.Tensor,
    gate_up_weight: torch.Tensor, has_gate_up_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, d norm_weight, d gate_up_weight, d gate_up_bias or an empty tensor)."""
    return _norm_gate_up_grads(dgate_up, x, norm_weight, rstd, gate_up_weight, has_gate_up_bias)


def _norm_gate_up_grads(dgate_up, x, norm_weight, rstd, gate_up_weight, has_gate_up_bias: bool, dresidual=None):
    """`rms_norm_gate_up_bwd`'s gradients; `dresidual` (another gradient of x, the residual stream's) is added to dx
    by the norm's backward kernel."""
    dnormed = dgate_up @ gate_up_weight
    dx, d_norm_weight, normed = rms_norm_backward_recompute(dnormed, x, norm_weight, rstd, dresidual)
    d_gate_up_weight = dgate_up.t() @ normed
    d_gate_up_bias = dgate_up.sum(0) if has_gate_up_bias else dgate_up.new_empty(0)
    return dx, d_norm_weight, d_gate_up_weight, d_gate_up_bias


@_rms_norm_gate_up_bwd.register_fake
def _(dgate_up, x, norm_weight, rstd, gate_up_weight, has_gate_up_bias):
    d_bias = dgate_up.new_empty(dgate_up.shape[1]) if has_gate_up_bias else dgate_up.new_empty(0)
    return torch.empty_like(x), torch.empty_like(norm_weight), torch.empty_like(gate_up_weight), d_bias


def _rms_norm_gate_up_setup_context(ctx, inputs, output):
    x, norm_weight, _eps, gate_up_weight, gate_up_bias = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # no zero gradient filled for rstd
    ctx.save_for_backward(x, norm_weight, output[1], gate_up_weight)
    ctx.has_gate_up_bias = gate_up_bias is not None


@first_order("rms_norm_swiglu_mlp")
def _rms_norm_gate_up_backward(ctx, dgate_up, _drstd):
    x, norm_weight, rstd, gate_up_weight = ctx.saved_tensors
    dx, d_norm_weight, d_gate_up_weight, d_gate_up_bias = call(
        ctx, _rms_norm_gate_up_bwd, dgate_up.contiguous(), x, norm_weight, rstd, gate_up_weight,
        ctx.has_gate_up_bias)
    return dx, d_norm_weight, None, d_gate_up_weight, (d_gate_up_bias if ctx.has_gate_up_bias else None)


_rms_norm_gate_up = differentiable_op(_rms_norm_gate_up_fwd, _rms_norm_gate_up_setup_context,
                                      _rms_norm_gate_up_backward)


# ---------------------------------------------------------------- the whole fused MLP, one node (eager)
def _mlp_block_forward(x, norm_weight, eps, gate_up_weight, gate_up_bias, down_weight, down_bias):
    """`rms_norm_gate_up` then `swiglu_down` on 2-D x, no autograd (for nodes that run it): (out, saved)."""
    normed, rstd = rms_norm_forward(x, norm_weight, eps)
    return _mlp_from_normed(x, normed, rstd, norm_weight, gate_up_weight, gate_up_bias, down_weight, down_bias)


def _mlp_block_forward_add(x, residual, norm_weight, eps, gate_up_weight, gate_up_bias, down_weight, down_bias):
    """`_mlp_block_forward` of h = x + residual (2-D, one shape), the add in the norm's kernel: (h, out, saved)."""
    h, normed, rstd = rms_norm_add_forward(x, residual, norm_weight, eps)
    return (h, *_mlp_from_normed(h, normed, rstd, norm_weight, gate_up_weight, gate_up_bias, down_weight,
                                 down_bias))


def _mlp_from_normed(x, normed, rstd, norm_weight, gate_up_weight, gate_up_bias, down_weight, down_bias):
    """The MLP block's gate/up GEMM and SwiGLU + down on the norm's output: (out, saved). `normed` is not saved:
    the backward's norm kernel writes it again from x and rstd."""
    gate_up = F.linear(normed, gate_up_weight, gate_up_bias)
    del normed
    out = _swiglu_down_fwd.eager_impl(gate_up, down_weight, down_bias)
    return out, (x, norm_weight, rstd, gate_up_weight, gate_up, down_weight)


def _mlp_block_backward(dout, saved, has_gate_up_bias: bool, has_down_bias: bool, dresidual=None):
    """The backward of `_mlp_block_forward` (2-D, contiguous dout): (dx, d_norm_weight, d_gate_up_weight,
    d_gate_up_bias, d_down_weight, d_down_bias), a bias gradient None where there is no bias. Writes the
    gradient of gate_up over the saved gate_up (its version is bumped: a second backward raises). `dresidual`
    (another gradient of x) is added to dx by the norm's backward kernel."""
    x, norm_weight, rstd, gate_up_weight, gate_up, down_weight = saved
    d_down_weight, d_down_bias = _swiglu_down_bwd.eager_impl(dout, gate_up, down_weight, has_down_bias)
    torch.autograd.graph.increment_version(gate_up)  # it now holds its gradient: a second backward raises
    dx, d_norm_weight, d_gate_up_weight, d_gate_up_bias = _norm_gate_up_grads(
        gate_up, x, norm_weight, rstd, gate_up_weight, has_gate_up_bias, dresidual)
    return (dx, d_norm_weight, d_gate_up_weight, d_gate_up_bias if has_gate_up_bias else None, d_down_weight,
            d_down_bias if has_down_bias else None)


class _RMSNormSwiGLUMLPBlock(torch.autograd.Function):
    """`rms_norm_gate_up` then `swiglu_down` as one autograd node, for eager mode (torch.compile traces the two
    ops): the same implementations and saved tensors, one node instead of two and their views."""

    @staticmethod
    def forward(ctx, x, norm_weight, eps, gate_up_weight, gate_up_bias, down_weight, down_bias):
        shape = x.shape
        out, saved = _mlp_block_forward(x.reshape(-1, shape[-1]), norm_weight, eps, gate_up_weight, gate_up_bias,
                                        down_weight, down_bias)
        ctx.save_for_backward(*saved)
        ctx.biases = (gate_up_bias is not None, down_bias is not None)
        ctx.shape = shape
        return out.view(*shape[:-1], down_weight.shape[0])

    @staticmethod
    @first_order("rms_norm_swiglu_mlp")
    def backward(ctx, dout):
        dout = dout.reshape(-1, dout.shape[-1]).contiguous()
        dx, d_norm_weight, d_gate_up_weight, d_gate_up_bias, d_down_weight, d_down_bias = _mlp_block_backward(
            dout, ctx.saved_tensors, *ctx.biases)
        return dx.view(ctx.shape), d_norm_weight, None, d_gate_up_weight, d_gate_up_bias, d_down_weight, d_down_bias


# ---------------------------------------------------------------- input checks
def _check_tensor(name: str, what: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: {what} must be a tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}: {what} must be float32, float16 or bfloat16, got {t.dtype}")


def _check_gate_up(name: str, gate_up: torch.Tensor) -> None:
    _check_tensor(name, "gate_up", gate_up)
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2 != 0:
        raise ValueError(f"{name}: expected gate_up (..., 2 * intermediate) with an even last dimension, got "
                         f"{tuple(gate_up.shape)}")
    if gate_up.numel() == 0:
        raise ValueError(f"{name}: gate_up is empty, shape {tuple(gate_up.shape)}")


def _check_mlp(name, x, gate_up_weight, down_weight, gate_up_bias, down_bias) -> None:
    for what, t in (("hidden_states", x), ("gate_up_weight", gate_up_weight), ("down_weight", down_weight)):
        _check_tensor(name, what, t)
    if x.dim() == 0 or x.numel() == 0:
        raise ValueError(f"{name}: expected non-empty hidden_states (..., hidden), got {tuple(x.shape)}")
    if gate_up_weight.dim() != 2 or down_weight.dim() != 2:
        raise ValueError(f"{name}: gate_up_weight and down_weight must be 2-D, got {tuple(gate_up_weight.shape)} "
                         f"and {tuple(down_weight.shape)}")
    hidden, two_i = x.shape[-1], gate_up_weight.shape[0]
    if gate_up_weight.shape[1] != hidden or two_i % 2 != 0:
        raise ValueError(f"{name}: gate_up_weight must be (2 * intermediate, hidden={hidden}), got "
                         f"{tuple(gate_up_weight.shape)}")
    if down_weight.shape[1] != two_i // 2:
        raise ValueError(f"{name}: down_weight must be (out, intermediate={two_i // 2}), got "
                         f"{tuple(down_weight.shape)}")
    for what, t in (("gate_up_weight", gate_up_weight), ("down_weight", down_weight),
                    ("gate_up_bias", gate_up_bias), ("down_bias", down_bias)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {what} must be a tensor or None")
        if t.dtype != x.dtype:
            raise TypeError(f"{name}: {what} dtype {t.dtype} does not match hidden_states dtype {x.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name}: {what} is on {t.device} but hidden_states on {x.device}")
    if gate_up_bias is not None and tuple(gate_up_bias.shape) != (two_i,):
        raise ValueError(f"{name}: gate_up_bias must be ({two_i},), got {tuple(gate_up_bias.shape)}")
    if down_bias is not None and tuple(down_bias.shape) != (down_weight.shape[0],):
        raise ValueError(f"{name}: down_bias must be ({down_weight.shape[0]},), got {tuple(down_bias.shape)}")


# ---------------------------------------------------------------- public API
def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `gate_up = [gate | up]` on the last dimension: `[..., 2I] -> [..., I]`."""
    _check_gate_up("swiglu", gate_up)
    shape = gate_up.shape
    h = _swiglu(gate_up.reshape(-1, shape[-1]).contiguous())
    return h.view(*shape[:-1], shape[-1] // 2)


def swiglu_mlp(
    hidden_states: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    gate_up_bias: Optional[torch.Tensor] = None,
    down_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """SwiGLU MLP `down(silu(x W_g^T) * (x W_u^T))` with the fused `[2I, H]` weight `cat([W_g, W_u])`.

    Under `torch.autocast` the inputs are cast to the autocast dtype first (as autocast casts `F.linear`'s inputs
    in the HF module; the gradients flow back to the fp32 master weights through the casts), and the MLP runs
    with autocast off, in that dtype, forward and backward.
    """
    cast = autocast_dtype(hidden_states) if isinstance(hidden_states, torch.Tensor) else None
    if cast is not None:
        args = [t.to(cast) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                for t in (hidden_states, gate_up_weight, down_weight, gate_up_bias, down_bias)]
        with torch.autocast(device_type=hidden_states.device.type, enabled=False):
            return swiglu_mlp(*args)
    _check_mlp("swiglu_mlp", hidden_states, gate_up_weight, down_weight, gate_up_bias, down_bias)
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    gate_up = F.linear(x, gate_up_weight, gate_up_bias)
    out = _swiglu_down(gate_up, down_weight, down_bias)
    return out.view(*shape[:-1], down_weight.shape[0])


def rms_norm_swiglu_mlp(
    hidden_states: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    gate_up_bias: Optional[torch.Tensor] = None,
    down_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """`swiglu_mlp(rms_norm(x, norm_weight, eps), ...)`: Llama/Qwen RMSNorm (hubfuse rmsnorm kernel), then the MLP.

    When the norm's output has the MLP's dtype and autocast is off (a bf16 or fp32 model), the norm and the
    gate/up GEMM run as one op that does not keep the norm's output for the backward (see the module docstring);
    otherwise (autocast, mixed dtypes) the two calls above, with the same results.
    """
    fused = (isinstance(hidden_states, torch.Tensor) and isinstance(norm_weight, torch.Tensor)
             and autocast_dtype(hidden_states) is None and hidden_states.dtype == norm_weight.dtype)
    if not fused:
        normed = rms_norm(hidden_states, norm_weight, eps)
        return swiglu_mlp(normed, gate_up_weight, down_weight, gate_up_bias, down_bias)
    check_rms_norm_inputs("rms_norm_swiglu_mlp", hidden_states, norm_weight, None)
    _check_mlp("rms_norm_swiglu_mlp", hidden_states, gate_up_weight, down_weight, gate_up_bias, down_bias)
    if not torch.compiler.is_compiling():
        return _RMSNormSwiGLUMLPBlock.apply(hidden_states.contiguous(), norm_weight.contiguous(), float(eps),
                                            gate_up_weight, gate_up_bias, down_weight, down_bias)
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1]).contiguous()
    gate_up, _ = _rms_norm_gate_up(x, norm_weight.contiguous(), float(eps), gate_up_weight, gate_up_bias)
    out = _swiglu_down(gate_up, down_weight, down_bias)
    return out.view(*shape[:-1], down_weight.shape[0])
