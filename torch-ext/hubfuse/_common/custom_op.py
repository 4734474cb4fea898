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

Inlined under torch.compile on NVIDIA GPUs (as `torch.library.triton_op` does): when AOTAutograd functionalizes
the graph, an op whose tensors are on a CUDA device is replaced by its implementation, traced: its torch ops
enter the graph and its Triton launches become `wrap_triton` nodes (`_common.launch`), so Inductor launches the
kernels from its own generated code, plans their buffers with the rest and fuses the torch ops around them;
nothing of the op's Python runs per step. Elsewhere (CPU, the interpreter, ROCm), in a graph compiled for
dynamic shapes, with `inline=False`, or with `HUBFUSE_INLINE_OPS=0` in the environment at compile time, the op
stays one opaque node.
"""
import inspect
import os

import torch

from ._ops import add_op_namespace_prefix

INLINE_SWITCH = "HUBFUSE_INLINE_OPS"  # "0": every op stays an opaque node under torch.compile


def custom_op(name: str, mutates_args=(), inline: bool = False):
    """`torch.library.custom_op` under this build's namespace; the op keeps its plain function as `eager_impl`
    and the positions of the arguments it mutates. `inline`: replaced by its traced implementation when
    torch.compile functionalizes a graph with it on CUDA (the implementation must then launch Triton through
    `_common.launch.launch` and run on fake tensors)."""

    def register(fn):
        op = torch.library.custom_op(add_op_namespace_prefix(name), mutates_args=mutates_args)(fn)
        op.eager_impl = fn
        op.mutated_positions = [i for i, arg in enumerate(inspect.signature(fn).parameters) if arg in mutates_args]
        if inline:
            from torch._subclasses.functional_tensor import FunctionalTensorMode  # torch-private, as triton_op

            op.register_torch_dispatch(FunctionalTensorMode, _inlined(fn))
        return op

    return register


def _inlined(fn):
    def functional_rule(mode, op, types, args, kwargs):
        if _inline_on(args):
            with mode:
                return fn(*args, **kwargs)
        return mode.__torch_dispatch__(op, types, args, kwargs)

    return functional_rule


def _inline_on(args) -> bool:
    """Whether an op call being functionalized is replaced by its implementation: its first tensor on an NVIDIA
    GPU (the Triton path with compiled kernels; ROCm, also "cuda" to torch, keeps the opaque op), every tensor's
    shape static (a graph compiled for dynamic shapes keeps the op opaque: the launch-shape heuristics take
    integers), and the switch not set to "0"."""
    value = os.environ.get(INLINE_SWITCH, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{INLINE_SWITCH} must be 0 or 1, got {value!r}")
    if value == "0":
        return False
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors or tensors[0].device.type != "cuda" or torch.version.hip is not None:  # NVIDIA (as measured)
        return False
    return all(type(n) is int for t in tensors for n in t.shape)


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
