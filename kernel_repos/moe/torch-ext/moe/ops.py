"""Custom ops and the functional API of the routed experts (grouped GEMM, SwiGLU, weighted combine).

`moe_experts_fwd` / `moe_experts_bwd` are custom ops under this build's namespace, with fake implementations and
autograd, so `torch.compile(fullgraph=True)` sees one opaque node per direction; eager calls run the same
implementations through an autograd.Function (`_custom_op.differentiable_op`: less host time). Each
dispatches on the tensor's device at run time: Triton on CUDA/ROCm/XPU (and on CPU under
`TRITON_INTERPRET=1`), the torch reference otherwise. Routing (sort by expert) runs on the device with no
host sync, so the CUDA path is graph-capturable.
"""

import torch

from hubfuse._common.checks import check_range, first_order
from hubfuse._common.device import autocast_dtype, use_triton
from hubfuse._common.custom_op import call, custom_op, differentiable_op
from .reference import moe_bwd_reference, moe_fwd_reference, route

MAX_EXPERTS = 512
MAX_TOP_K = 16
MAX_SLOTS = 2**31 - 1  # tokens x top_k


def _experts_fwd(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, check_ids: bool = True):
    """Returns (out, gate_up_out, sorted_slot, expert_offsets, pos); the last four are saved for backward (the
    activation is recomputed there from gate_up_out; pos[slot] = the slot's row in expert-sorted order).
    check_ids=False: the caller made top_k_index itself, in range (expert parallelism's local ids)."""
    E = gate_up_proj.shape[0]
    # here, in the op's implementation, so that torch.compile (which runs it as an opaque op) checks too
    if check_ids:
        check_range(top_k_index, 0, E + 1, f"moe_experts: top_k_index values must be in [0, {E}) or equal {E} "
                    "(the expert-parallel skip sentinel)")
    if use_triton(hidden):
        from .triton_kernels import moe_fwd

        sorted_slot, expert_offsets = route(top_k_index, gate_up_proj.shape[0])
        out, gate_up_out, pos = moe_fwd(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, sorted_slot,
                                        expert_offsets)
        return out, gate_up_out, sorted_slot, expert_offsets, pos
    with torch.autocast(hidden.device.type, enabled=False):  # the reference keeps the op's own precision
        return moe_fwd_reference(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)


def _experts_bwd(dout, hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_out, sorted_slot,
                 expert_offsets, pos, on_input_grads=None):
    """Returns (dhidden, dtop_k_weights, dgate_up_proj, ddown_proj). On the Triton path gate_up_out (saved by the
    forward, dead once the SwiGLU backward has read it) is overwritten in place with the grad of the gate_up GEMM's
    output: one (T*K, 2I) buffer less at the backward's peak. on_input_grads(dhidden, dtop_k_weights), if given,
    is called as soon as both exist: on the Triton path before the gate_up weight-grad GEMM is enqueued, so that
    what the caller issues there (expert parallelism: the gradients' all-to-all) runs under that GEMM."""
    args = (dout, hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_out, sorted_slot,
            expert_offsets, pos)
    if use_triton(hidden):
        from .triton_kernels import moe_bwd

        return moe_bwd(*args, reuse_gate_up_out=True, on_input_grads=on_input_grads)
    with torch.autocast(hidden.device.type, enabled=False):
        grads = moe_bwd_reference(*args)
    if on_input_grads is not None:
        on_input_grads(grads[0], grads[1])
    return grads


# The custom ops: what torch.compile sees (one opaque node per direction).
@custom_op("moe_experts_fwd")
def moe_experts_fwd(
    hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_experts_fwd` as a custom op."""
    return _experts_fwd(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)


@moe_experts_fwd.register_fake
def _(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj):
    S = top_k_index.shape[0] * top_k_index.shape[1]
    E, two_i, _ = gate_up_proj.shape
    return (
        hidden.new_empty(hidden.shape),
        hidden.new_empty((S, two_i)),
        hidden.new_empty((S,), dtype=torch.int64),
        hidden.new_empty((E + 1,), dtype=torch.int32),
        hidden.new_empty((S,), dtype=torch.int64),
    )


@custom_op("moe_experts_bwd", mutates_args=("gate_up_out",))
def moe_experts_bwd(
    dout: torch.Tensor, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor, down_proj: torch.Tensor, gate_up_out: torch.Tensor, sorted_slot: torch.Tensor,
    expert_offsets: torch.Tensor, pos: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_experts_bwd` as a custom op. It declares the mutation of gate_up_out, so autograd refuses a second backward
    through the same graph (retain_graph=True) with its "modified by an inplace operation" error instead of reading
    garbage."""
    return _experts_bwd(dout, hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_out, sorted_slot,
                        expert_offsets, pos)


@moe_experts_bwd.register_fake
def _(dout, hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_out, sorted_slot, expert_offsets,
      pos):
    return (torch.empty_like(hidden), torch.empty_like(top_k_weights), torch.empty_like(gate_up_proj),
            torch.empty_like(down_proj))


def _setup_context(ctx, inputs, output):
    # the four saved outputs get no grad: None in the backward, instead of zeros that autograd would otherwise
    # allocate and fill every step (a (T*K, 2I) memset among them: 0.2 GB at T=8192)
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)
    # the five inputs and the forward's four saved outputs: the argument list of the backward after dout
    ctx.save_for_backward(*inputs, *output[1:])


@first_order("moe_experts")
def _backward(ctx, dout, *_unused):
    saved = ctx.saved_tensors
    dhidden, dweights, dgate_up, ddown = call(ctx, moe_experts_bwd, dout.to(saved[0].dtype).contiguous(), *saved)
    return dhidden, None, dweights, dgate_up, ddown


_moe_experts = differentiable_op(moe_experts_fwd, _setup_context, _backward)


def _check_inputs(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj) -> None:
    name = "moe_experts"
    for arg, what in ((hidden, "hidden_states"), (top_k_index, "top_k_index"), (top_k_weights, "top_k_weights"),
                      (gate_up_proj, "gate_up_proj"), (down_proj, "down_proj")):
        if not isinstance(arg, torch.Tensor):
            raise TypeError(f"{name}: {what} must be a tensor, got {type(arg).__name__}")
    if hidden.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{name}: hidden_states must be float32, float16 or bfloat16, got {hidden.dtype}")
    if gate_up_proj.dtype != hidden.dtype or down_proj.dtype != hidden.dtype:
        raise TypeError(f"{name}: gate_up_proj ({gate_up_proj.dtype}) and down_proj ({down_proj.dtype}) must have "
                        f"the dtype of hidden_states ({hidden.dtype})")
    if not top_k_weights.is_floating_point():
        raise TypeError(f"{name}: top_k_weights must be floating point, got {top_k_weights.dtype}")
    if top_k_index.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: top_k_index must be int32 or int64, got {top_k_index.dtype}")
    if hidden.dim() != 2:
        raise ValueError(f"{name}: hidden_states must be (tokens, hidden), got {tuple(hidden.shape)}")
    T, H = hidden.shape
    if T == 0 or H == 0:
        raise ValueError(f"{name}: empty hidden_states {tuple(hidden.shape)}")
    if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError(f"{name}: expected gate_up_proj (E, 2I, H) and down_proj (E, H, I), got "
                         f"{tuple(gate_up_proj.shape)} and {tuple(down_proj.shape)}")
    E, two_i, h_w = gate_up_proj.shape
    if two_i % 2 != 0 or two_i == 0 or E == 0:
        raise ValueError(f"{name}: gate_up_proj must be (E, 2I, H) with E, I > 0, got {tuple(gate_up_proj.shape)}")
    if h_w != H:
        raise ValueError(f"{name}: gate_up_proj hidden size {h_w} does not match hidden_states hidden size {H}")
    if tuple(down_proj.shape) != (E, H, two_i // 2):
        raise ValueError(f"{name}: down_proj must be (E, H, I) = {(E, H, two_i // 2)} to match gate_up_proj "
                         f"{tuple(gate_up_proj.shape)}, got {tuple(down_proj.shape)}")
    if E > MAX_EXPERTS:
        raise ValueError(f"{name}: {E} experts exceed the supported maximum {MAX_EXPERTS}")
    if top_k_index.dim() != 2 or top_k_index.shape[0] != T:
        raise ValueError(f"{name}: top_k_index must be (tokens, top_k) = ({T}, K), got {tuple(top_k_index.shape)}")
    K = top_k_index.shape[1]
    if K == 0 or K > MAX_TOP_K:
        raise ValueError(f"{name}: top_k {K} must be in [1, {MAX_TOP_K}]")
    if T * K > MAX_SLOTS:  # the routing's expert offsets and the kernels' sorted-row indices are int32
        raise ValueError(f"{name}: {T} tokens x top_k {K} = {T * K} routed slots exceed the supported {MAX_SLOTS}")
    if tuple(top_k_weights.shape) != (T, K):
        raise ValueError(f"{name}: top_k_weights shape {tuple(top_k_weights.shape)} does not match top_k_index "
                         f"{tuple(top_k_index.shape)}")
    for arg, what in ((top_k_index, "top_k_index"), (top_k_weights, "top_k_weights"),
                      (gate_up_proj, "gate_up_proj"), (down_proj, "down_proj")):
        if arg.device != hidden.device:
            raise ValueError(f"{name}: {what} is on {arg.device} but hidden_states on {hidden.device}")
    # the values of top_k_index are checked in the op itself (`_experts_fwd`): no host sync on a GPU


def _autocast_inputs(hidden_states: torch.Tensor, gate_up_proj, down_proj) -> tuple:
    """Mixed-precision training (fp32 master weights under autocast): the GEMMs' operands in the autocast dtype, as
    F.linear runs in HF's eager path (differentiable casts); unchanged without autocast."""
    dtype = autocast_dtype(hidden_states)
    if dtype is None:
        return hidden_states, gate_up_proj, down_proj
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) else t for t in (hidden_states, gate_up_proj, down_proj))


def moe_experts(
    hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
) -> torch.Tensor:
    """Routed SwiGLU experts, HF v5 layout: `sum_k w[t,k] * down[e](silu(gate[e] x) * up[e] x)`, e = index[t,k].

    hidden_states (T, H); top_k_index (T, K) int; top_k_weights (T, K) float; gate_up_proj (E, 2I, H) with the
    gate rows first; down_proj (E, H, I). Returns (T, H) in the dtype of hidden_states. Differentiable in
    hidden_states, top_k_weights, gate_up_proj and down_proj (first order only: a double backward raises);
    deterministic (no atomics).

    Expert ids: `top_k_index` values are in [0, E), or equal E: the expert-parallel "skip" sentinel (a slot
    routed to an expert on another rank), which contributes nothing to the output and gets a zero weight
    gradient, as in HF's eager loop. Any other value (negative, or > E) is an error, in eager mode and under
    torch.compile alike: a ValueError on CPU; on a GPU a device-side assert (no host sync), which fails the
    next synchronising call and leaves the CUDA context unusable (as PyTorch's own index checks do).
    """
    if isinstance(hidden_states, torch.Tensor):
        hidden_states, gate_up_proj, down_proj = _autocast_inputs(hidden_states, gate_up_proj, down_proj)
    _check_inputs(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj)
    args = (hidden_states.contiguous(), top_k_index.contiguous(), top_k_weights.contiguous(),
            gate_up_proj.contiguous(), down_proj.contiguous())
    return _moe_experts(*args)[0]
