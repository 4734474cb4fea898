"""Differentiable ops with two front doors (vendored into every hub variant).

torch.compile needs a `torch.library.custom_op` per direction (one opaque node with a fake implementation, and
its autograd registration). In eager mode the custom-op dispatcher costs 10-30 us of host time per call, more
than many of our kernels take on the GPU. So every differentiable op is defined once, with its forward
implementation, `setup_context` and `backward`, and gets:

- the custom op with `register_autograd(backward, setup_context)`: what torch.compile traces;
- an `autograd.Function` running the same implementation, `setup_context` and `backward` directly: what eager
  calls (`differentiable_op(...)` returns a function that picks one or the other).

A backward calls other ops through `call(ctx, op, *args)`: their implementation when the forward ran eagerly
(`ctx` then carries `eager = True`), the op itself when it is being traced.
"""
import inspect

import torch

from ._ops import add_op_namespace_prefix


def custom_op(name: str, mutates_args=()):
    """`torch.library.custom_op` under this build's namespace; the op keeps its plain function as `eager_impl`
    and the positions of the arguments it mutates."""

    def register(fn):
        op = torch.library.custom_op(add_op_namespace_prefix(name), mutates_args=mutates_args)(fn)
        op.eager_impl = fn
        op.mutated_positions = [i for i, arg in enumerate(inspect.signature(fn).parameters) if arg in mutates_args]
        return op

    return register


def call(ctx, op, *args):
    """`op(*args)` from inside a backward: its implementation directly when the forward ran eagerly (then the
    version counters of the arguments it mutates are bumped, as the op would: autograd refuses to reuse them)."""
    if not getattr(ctx, "eager", False):
        return op(*args)
    out = op.eager_impl(*args)
    for i in op.mutated_positions:
        torch.autograd.graph.increment_version(args[i])
    return out


def differentiable_op(op, setup_context, backward):
    """Registers autograd on the custom op `op`; returns `apply(*inputs)`: the op under torch.compile, an
    autograd.Function over `op.eager_impl` with the same setup_context and backward otherwise."""
    op.register_autograd(backward, setup_context=setup_context)

    class Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            output = op.eager_impl(*inputs)
            ctx.eager = True
            setup_context(ctx, inputs, output)
            return output

        @staticmethod
        def backward(ctx, *grads):
            return backward(ctx, *grads)

    Eager.__name__ = Eager.__qualname__ = f"{op._name}_eager"

    def apply(*inputs):
        if torch.compiler.is_compiling():
            return op(*inputs)
        return Eager.apply(*inputs)

    return apply
