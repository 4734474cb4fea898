"""Custom ops and the functional API: fused load-balancing loss and fused softmax-top-k router.

Each fused forward/backward is a `torch.library.custom_op` under this build's namespace
(`_ops.add_op_namespace_prefix`) with a fake implementation and autograd, so `torch.compile(fullgraph=True)`
sees one opaque node. In eager mode the same implementations run through a plain `autograd.Function`, which
costs far less Python per call than the custom-op dispatcher (with 48 layer tensors in and out, several
times the kernels' own time). Both dispatch on the tensor's device at run time: Triton on CUDA/ROCm/XPU
(and on CPU under `TRITON_INTERPRET=1`), the torch reference otherwise.
"""
from typing import List, Optional, Sequence, Union

import torch

from hubfuse._common.checks import first_order
from hubfuse._common.device import use_triton
from hubfuse._common.custom_op import call, custom_op, differentiable_op
from hubfuse._common._ops import add_op_namespace_prefix
from .reference import (
    MAX_EXPERTS,
    load_balancing_loss_bwd_reference,
    load_balancing_loss_fwd_reference,
    router_statistics_reference,
    softmax_topk_bwd_reference,
    softmax_topk_fwd_reference,
)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_logits(name: str, what: str, logits) -> None:
    """A 2-D (tokens, experts) float tensor, or a TypeError / ValueError naming `what`."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{name}: {what} is a {type(logits).__name__}, not a tensor")
    if logits.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name}: {what} has dtype {logits.dtype}; expected float32/float16/bfloat16")
    if logits.dim() != 2:
        raise ValueError(f"{name}: {what} must be 2-D (tokens, experts), got {tuple(logits.shape)}")


def _check_routing_shape(name: str, what: str, shape, top_k: int) -> None:
    """Non-empty (tokens, experts) logits, at most MAX_EXPERTS experts, 1 <= top_k <= experts."""
    tokens, experts = shape
    if tokens == 0 or experts == 0:
        raise ValueError(f"{name}: {what} is empty, shape {tuple(shape)}")
    if experts > MAX_EXPERTS:
        raise ValueError(f"{name}: {what} has {experts} experts, more than the supported maximum {MAX_EXPERTS}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"{name}: top_k={top_k} must be in [1, num_experts={experts}]")


# ---------------------------------------------------------------- load-balancing loss

def _lbl_fwd_impl(gate_logits, mask, num_experts, top_k, layers=None):
    if use_triton(gate_logits[0]):
        from .triton_kernels import load_balancing_loss_fwd

        return load_balancing_loss_fwd(gate_logits, mask, top_k, layers)
    return load_balancing_loss_fwd_reference(gate_logits, mask, num_experts, top_k)


def _lbl_bwd_impl(grad_loss, gate_logits, mask, dloss_dprobsum, layers=None):
    if use_triton(gate_logits[0]):
        from .triton_kernels import load_balancing_loss_bwd

        return load_balancing_loss_bwd(grad_loss, gate_logits, mask, dloss_dprobsum, layers)
    return load_balancing_loss_bwd_reference(grad_loss, gate_logits, mask, dloss_dprobsum)


@torch.library.custom_op(add_op_namespace_prefix("load_balancing_loss_fwd"), mutates_args=())
def _lbl_fwd(
    gate_logits: List[torch.Tensor], mask: Optional[torch.Tensor], num_experts: int, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return _lbl_fwd_impl(gate_logits, mask, num_experts, top_k)


@_lbl_fwd.register_fake
def _(gate_logits, mask, num_experts, top_k):
    first = gate_logits[0]
    return first.new_empty((), dtype=torch.float32), first.new_empty(num_experts, dtype=torch.float32)


@torch.library.custom_op(add_op_namespace_prefix("load_balancing_loss_bwd"), mutates_args=())
def _lbl_bwd(
    grad_loss: torch.Tensor, gate_logits: List[torch.Tensor], mask: Optional[torch.Tensor],
    dloss_dprobsum: torch.Tensor,
) -> torch.Tensor:
    return _lbl_bwd_impl(grad_loss, gate_logits, mask, dloss_dprobsum)


@_lbl_bwd.register_fake
def _(grad_loss, gate_logits, mask, dloss_dprobsum):
    first = gate_logits[0]
    return first.new_empty(len(gate_logits), *first.shape)


def _lbl_setup_context(ctx, inputs, output):
    gate_logits, mask, _num_experts, _top_k = inputs
    ctx.num_layers = len(gate_logits)
    ctx.has_mask = mask is not None
    ctx.save_for_backward(*gate_logits, *([mask] if mask is not None else []), output[1])


@first_order("load_balancing_loss")
def _lbl_backward(ctx, grad_loss, _grad_dloss):
    saved = ctx.saved_tensors
    gate_logits = list(saved[:ctx.num_layers])
    mask = saved[ctx.num_layers] if ctx.has_mask else None
    grads = _lbl_bwd(grad_loss.contiguous(), gate_logits, mask, saved[-1])  # (layers, T, E), one buffer
    return list(grads.unbind(0)), None, None, None


_lbl_fwd.register_autograd(_lbl_backward, setup_context=_lbl_setup_context)


class _load_balancing_loss_fwd(torch.autograd.Function):
    """Eager twin of the custom op of the same name (same kernels; the layer table is built once)."""

    @staticmethod
    def forward(ctx, mask, num_experts, top_k, *gate_logits):
        layers = None
        if use_triton(gate_logits[0]):
            from .triton_kernels import layer_table

            layers = layer_table(gate_logits)
        loss, dloss_dprobsum = _lbl_fwd_impl(gate_logits, mask, num_experts, top_k, layers)
        ctx.save_for_backward(mask, dloss_dprobsum, *gate_logits)
        ctx.layers = layers
        return loss

    @staticmethod
    @first_order("load_balancing_loss")
    def backward(ctx, grad_loss):
        mask, dloss_dprobsum, *gate_logits = ctx.saved_tensors
        grads = _lbl_bwd_impl(grad_loss.contiguous(), gate_logits, mask, dloss_dprobsum, ctx.layers)
        return None, None, None, *grads.unbind(0)  # views of one (layers, T, E) buffer


def _router_statistics_impl(gate_logits, mask, num_experts, top_k, layers=None):
    if use_triton(gate_logits[0]):
        from .triton_kernels import router_statistics

        return router_statistics(gate_logits, mask, top_k, layers)
    return router_statistics_reference(gate_logits, mask, num_experts, top_k)


class _RouterStatistics(torch.autograd.Function):
    """(2, E) fp32 over all layers' rows: top-k selection counts (piecewise constant: no gradient) and
    routing-probability sums (differentiable; the backward is the loss's backward kernel with d/dprob_sum given)."""

    @staticmethod
    def forward(ctx, mask, num_experts, top_k, *gate_logits):
        layers = None
        if use_triton(gate_logits[0]):
            from .triton_kernels import layer_table

            layers = layer_table(gate_logits)
        totals = _router_statistics_impl(gate_logits, mask, num_experts, top_k, layers)
        ctx.save_for_backward(mask, *gate_logits)
        ctx.layers = layers
        return totals

    @staticmethod
    @first_order("load_balancing_loss")
    def backward(ctx, grad_totals):
        mask, *gate_logits = ctx.saved_tensors
        one = torch.ones((), dtype=torch.float32, device=grad_totals.device)
        grads = _lbl_bwd_impl(one, gate_logits, mask, grad_totals[1].float().contiguous(), ctx.layers)
        return None, None, None, *grads.unbind(0)


def _group_load_balancing_loss(gate_logits, mask, num_experts, top_k, group):
    """The aux loss of the whole group's batch: counts and probability sums all-reduced over `group` (one
    all_reduce of 2 x E floats, no host sync). Every rank gets the same value; the gradient reaching this rank's
    logits is the group size times its share, so that averaging gradients over the data-parallel ranks (FSDP /
    DDP) yields the gradient of the group-batch loss. No collective in the backward."""
    import torch.distributed as dist

    local = _RouterStatistics.apply(mask, num_experts, top_k, *gate_logits)
    total = local.detach().clone()
    dist.all_reduce(total, group=group)
    size = dist.get_world_size(group)
    counts, prob_sum = total[0], total[1] + size * (local[1] - local[1].detach())
    rows = counts.sum() / top_k  # every (layer, token) row picks top_k experts (mask-weighted)
    return (counts / rows * (prob_sum / rows)).sum() * num_experts


def _check_int(name: str, what: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: {what} must be an int, got {type(value).__name__}")


def load_balancing_loss(
    gate_logits: Union[Sequence[torch.Tensor], torch.Tensor, None],
    num_experts: int,
    top_k: int,
    attention_mask: Optional[torch.Tensor] = None,
    group=None,
):
    """Switch-Transformer auxiliary loss over all layers, as transformers' `load_balancing_loss_func`.

    gate_logits: a tuple/list of per-layer router logits, each (tokens, num_experts), all the same shape
    and dtype, or a stacked (layers, tokens, num_experts) tensor; None returns 0 (as HF does).
    attention_mask: optional, any shape with `tokens` elements (HF: (batch, seq)), 0 marks padding.
    Returns a fp32 scalar tensor: num_experts * sum_e f_e * P_e, with f_e the (mask-weighted) fraction of
    top-k assignments to e and P_e the mean routing probability of e over all layers' unmasked tokens.
    Gradient flows to every layer's logits through P_e (the top-k selection is piecewise constant).
    group: a torch.distributed process group (data parallel, e.g. the world): f_e and P_e are then those of
    every rank's tokens together (global-batch load balancing; the single-process loss of the concatenated
    batch), the same value on every rank, with the gradient scaled so that averaging gradients over the
    data-parallel ranks gives that loss's gradient (see `_group_load_balancing_loss`). None: this rank's tokens."""
    name = "load_balancing_loss"
    if gate_logits is None:
        return 0
    if isinstance(gate_logits, torch.Tensor):
        if gate_logits.dim() != 3:
            raise ValueError(f"{name}: a tensor gate_logits must be (layers, tokens, experts), got "
                             f"{tuple(gate_logits.shape)}")
        gate_logits = list(gate_logits.unbind(0))
    elif isinstance(gate_logits, (tuple, list)):
        gate_logits = list(gate_logits)
    else:
        raise TypeError(f"{name}: gate_logits must be a tuple/list of tensors or a 3-D tensor, got "
                        f"{type(gate_logits).__name__}")
    if len(gate_logits) == 0:
        raise ValueError(f"{name}: gate_logits is empty (no layers)")
    _check_int(name, "num_experts", num_experts)
    _check_int(name, "top_k", top_k)
    first = gate_logits[0]
    _check_logits(name, "gate_logits[0]", first)
    shape, dtype, device = first.shape, first.dtype, first.device
    # one cheap pass over the layers (this runs every step with ~50 layers); details only on failure
    if not all(isinstance(z, torch.Tensor) and z.dtype is dtype and z.shape == shape for z in gate_logits):
        for i, z in enumerate(gate_logits):
            if not isinstance(z, torch.Tensor):
                raise TypeError(f"{name}: gate_logits[{i}] is a {type(z).__name__}, not a tensor")
            if z.dtype != dtype:
                raise TypeError(f"{name}: gate_logits[{i}] dtype {z.dtype} differs from gate_logits[0] {dtype}")
            if z.shape != shape:
                raise ValueError(f"{name}: gate_logits[{i}] has shape {tuple(z.shape)} but gate_logits[0] has "
                                 f"{tuple(shape)}; every layer must route the same tokens")
    tokens, experts = shape
    if experts != num_experts:
        raise ValueError(f"{name}: num_experts={num_experts} does not match the logits' last dim {experts}")
    _check_routing_shape(name, "gate_logits", shape, top_k)
    # HF computes on the first layer's device; the kernels need contiguous rows
    if not all(z.device == device and z.is_contiguous() for z in gate_logits):
        gate_logits = [z.to(device).contiguous() for z in gate_logits]
    mask = None
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"{name}: attention_mask must be a tensor, got {type(attention_mask).__name__}")
        if attention_mask.numel() != tokens:
            raise ValueError(f"{name}: attention_mask has {attention_mask.numel()} elements "
                             f"{tuple(attention_mask.shape)} but the router logits have {tokens} tokens")
        # read in its own dtype by the kernels (no cast launch); bool as bytes
        mask = attention_mask.detach().reshape(-1)
        mask = (mask.view(torch.uint8) if mask.dtype == torch.bool else mask).to(device).contiguous()
    if group is not None and _group_size(group) > 1:
        return _group_load_balancing_loss(gate_logits, mask, num_experts, top_k, group)
    if torch.compiler.is_compiling():
        return _lbl_fwd(gate_logits, mask, num_experts, top_k)[0]
    return _load_balancing_loss_fwd.apply(mask, num_experts, top_k, *gate_logits)


def _group_size(group) -> int:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("load_balancing_loss: group= needs torch.distributed initialized")
    return dist.get_world_size(group)


def load_balancing_loss_func(gate_logits, num_experts=None, top_k=2, attention_mask=None):
    """Drop-in for transformers' `load_balancing_loss_func`, same signature and the same 0 for a
    non-tuple input, computed by the fused kernel. (Keep the signature: torch.compile guards on its defaults
    under the name of the function it replaces.)"""
    if gate_logits is None or not isinstance(gate_logits, tuple):
        return 0
    return load_balancing_loss(gate_logits, num_experts, top_k, attention_mask)


def group_load_balancing_loss_func(group):
    """`load_balancing_loss_func` with the load-balancing statistics reduced over the process group `group`
    (see `load_balancing_loss`): what `enable_fused_aux_loss(model, group=...)` installs."""

    def load_balancing_loss_func(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        if gate_logits is None or not isinstance(gate_logits, tuple):
            return 0
        return load_balancing_loss(gate_logits, num_experts, top_k, attention_mask, group=group)

    return load_balancing_loss_func


# ---------------------------------------------------------------- softmax + top-k router

def _router_fwd_impl(router_logits, top_k, normalize):
    if use_triton(router_logits):
        from .triton_kernels import softmax_topk_fwd

        return softmax_topk_fwd(router_logits, top_k, normalize)
    return softmax_topk_fwd_reference(router_logits, top_k, normalize)


def _router_bwd_impl(d_scores, router_logits, stats, indices, normalize):
    if use_triton(router_logits):
        from .triton_kernels import softmax_topk_bwd

        return softmax_topk_bwd(d_scores, router_logits, stats, indices, normalize)
    return softmax_topk_bwd_reference(d_scores, router_logits, stats, indices, normalize)


@custom_op("softmax_topk_fwd")
def _router_fwd(
    router_logits: torch.Tensor, top_k: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _router_fwd_impl(router_logits, top_k, normalize)


@_router_fwd.register_fake
def _(router_logits, top_k, normalize):
    T = router_logits.shape[0]
    return (router_logits.new_empty(T, top_k), router_logits.new_empty(T, top_k, dtype=torch.int64),
            router_logits.new_empty(T, 2, dtype=torch.float32))


@custom_op("softmax_topk_bwd")
def _router_bwd(
    d_scores: torch.Tensor, router_logits: torch.Tensor, stats: torch.Tensor, indices: torch.Tensor,
    normalize: bool,
) -> torch.Tensor:
    return _router_bwd_impl(d_scores, router_logits, stats, indices, normalize)


@_router_bwd.register_fake
def _(d_scores, router_logits, stats, indices, normalize):
    return torch.empty_like(router_logits)


def _router_setup_context(ctx, inputs, output):
    router_logits, _top_k, normalize = inputs
    _scores, indices, stats = output
    ctx.mark_non_differentiable(indices, stats)
    ctx.set_materialize_grads(False)  # no zero gradients filled for indices and stats (launches nothing reads)
    ctx.save_for_backward(router_logits, stats, indices)
    ctx.normalize = normalize


@first_order("softmax_topk")
def _router_backward(ctx, d_scores, _d_indices, _d_stats):
    if d_scores is None:  # the scores were not used
        return None, None, None
    router_logits, stats, indices = ctx.saved_tensors
    return call(ctx, _router_bwd, d_scores.contiguous(), router_logits, stats, indices, ctx.normalize), None, None


_router = differentiable_op(_router_fwd, _router_setup_context, _router_backward)


def softmax_topk(router_logits: torch.Tensor, top_k: int, normalize: bool = True):
    """Fused `softmax(logits, fp32) -> top-k -> (renormalise) -> cast` of HF's MoE routers.

    router_logits: (tokens, experts). Returns (scores (tokens, top_k) in the logits dtype, indices int64),
    exactly what `Qwen3MoeTopKRouter` / `Qwen3_5MoeTopKRouter` return after the linear. Ties go to the
    lower expert index (torch.topk's CUDA behaviour)."""
    name = "softmax_topk"
    _check_logits(name, "router_logits", router_logits)
    _check_int(name, "top_k", top_k)
    _check_routing_shape(name, "router_logits", router_logits.shape, top_k)
    if top_k > 64:
        raise ValueError(f"{name}: top_k={top_k} exceeds the supported maximum 64")
    scores, indices, _ = _router(router_logits.contiguous(), top_k, bool(normalize))
    return scores, indices


def topk_router(hidden_states: torch.Tensor, weight: torch.Tensor, top_k: int, normalize: bool = True):
    """HF MoE router: `logits = hidden @ weight.T` (cuBLAS), then the fused softmax-top-k.
    Returns (router_logits, scores, indices) like `Qwen3MoeTopKRouter.forward`."""
    name = "topk_router"
    if not isinstance(hidden_states, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"{name}: hidden_states and weight must be tensors")
    if hidden_states.dtype not in _FLOAT_DTYPES or weight.dtype != hidden_states.dtype:
        raise TypeError(f"{name}: hidden_states and weight must share one dtype of float32/float16/bfloat16, got "
                        f"{hidden_states.dtype} and {weight.dtype}")
    if weight.device != hidden_states.device:
        raise ValueError(f"{name}: weight is on {weight.device} but hidden_states on {hidden_states.device}")
    if weight.dim() != 2 or hidden_states.dim() == 0 or hidden_states.shape[-1] != weight.shape[1]:
        raise ValueError(f"{name}: the hidden size of hidden_states {tuple(hidden_states.shape)} does not match the "
                         f"router weight {tuple(weight.shape)}: expected (..., hidden) and (experts, hidden)")
    if not 1 <= weight.shape[0] <= MAX_EXPERTS:
        raise ValueError(f"{name}: weight has {weight.shape[0]} experts (rows); expected 1 to {MAX_EXPERTS}")
    if hidden_states.numel() == 0:
        raise ValueError(f"{name}: hidden_states is empty, shape {tuple(hidden_states.shape)}")
    router_logits = torch.nn.functional.linear(hidden_states.reshape(-1, weight.shape[1]), weight)
    scores, indices = softmax_topk(router_logits, top_k, normalize)
    return router_logits, scores, indices
