"""Custom ops and the functional API: fused linear + cross-entropy, and cross-entropy from logits.

`linear_cross_entropy` walks the tokens in chunks: logits of one chunk (cuBLAS, inputs' dtype) -> the
Triton row kernel (log-sum-exp, loss, z-loss, gradient written over the chunk's logits) -> dX chunk and the
dW / dbias accumulation (cuBLAS). The `(tokens, vocab)` logits never exist. For a scalar loss the gradients
are finished in the forward and the backward only multiplies them by the upstream scalar; for
`reduction="none"` the backward recomputes the chunks with the per-token upstream gradient folded in.

`cross_entropy` takes materialised logits and writes the gradient into the logits buffer itself
(`inplace=True`, the default) or into one same-dtype copy (`inplace=False`): never an fp32 copy.

Both are `torch.library.custom_op`s under this build's namespace (the shared `custom_op` helper) with fake
implementations, so `torch.compile(fullgraph=True)` sees opaque nodes; the linear one is a `differentiable_op`
(eager mode runs its implementation and backward without the custom-op dispatcher), the mutating one from logits
an autograd.Function over its op (torch has no autograd registration for ops that mutate an input). They dispatch on the tensor's device at run time: Triton
on CUDA/ROCm/XPU (and on CPU under `TRITON_INTERPRET=1`), the torch twin (`reference.ce_rows_reference`)
otherwise. Deterministic: no atomics; every reduction has a fixed order.
"""
from typing import NamedTuple, Optional

import torch

from hubfuse._common.checks import check_range, first_order
from hubfuse._common.custom_op import call, custom_op, differentiable_op
from hubfuse._common.device import use_triton
from .reference import REDUCTIONS, ce_rows_reference

NONE, MEAN, SUM = REDUCTIONS["none"], REDUCTIONS["mean"], REDUCTIONS["sum"]
GRAD_HIDDEN, GRAD_WEIGHT, GRAD_BIAS = 1, 2, 4
# memory for one chunk of logits (it becomes the chunk's dlogits in place): the budget is 300 MiB
# above the dX/dW buffers; 1024 tokens of a 151936 vocab in bf16 take 296.75 MiB
DEFAULT_CHUNK_BYTES = 300 * 2**20
# chunks are a multiple of this many tokens: cuBLAS tiles are 128 or 256 rows, and a chunk of 832 tokens
# (6.5 tiles) measured 9 % slower on H200 than 1024
CHUNK_ALIGN = 256

# Run-time choices of the GPU path, read at every call (a benchmark flips them to compare alternatives):
#   vector_lse   row kernel pass 1 with per-lane running max/sum (no block reductions) instead of a scalar
#   block_v      columns per block of the row kernel, 0 = automatic (see triton_kernels.GPU_MAX_BLOCK)
#   num_warps    warps per row program, 0 = automatic
#   skip_unit_scale  backward of a scalar loss scales the saved gradients by the upstream gradient with a
#                kernel that skips the work on the device when it is 1 (no sync); False: torch mul_
TUNING = dict(vector_lse=False, block_v=0, num_warps=0, skip_unit_scale=True)


def _ce_rows(logits, labels, scale, ignore_index, label_smoothing, z_loss_weight, softcap, compute_grad):
    if use_triton(logits):
        from .triton_kernels import ce_rows

        cfg = TUNING
        return ce_rows(logits, labels, scale, ignore_index, label_smoothing, z_loss_weight, softcap, compute_grad,
                       vector_lse=bool(cfg["vector_lse"]), block_v=int(cfg["block_v"]),
                       num_warps=int(cfg["num_warps"]))
    return ce_rows_reference(logits, labels, scale, ignore_index, label_smoothing, z_loss_weight, softcap,
                             compute_grad)


def _check_label_range(name: str, labels: torch.Tensor, vocab: int, ignore_index: int) -> None:
    # Called inside the custom ops, so eager mode and torch.compile check alike: a ValueError on CPU, a
    # device-side assert elsewhere (no host sync). The kernel masks its label load, so a bad label never reads
    # out of bounds before the assert fires.
    check_range(labels, 0, vocab, f"{name}: labels must be in [0, {vocab}) or equal ignore_index={ignore_index}",
                ignore=ignore_index)


def _loss_scale(labels, ignore_index, reduction, num_items_in_batch) -> torch.Tensor:
    """1-element fp32 tensor: the factor between sum_i loss_i and the reduced loss (no host sync)."""
    if num_items_in_batch is not None:
        return (1.0 / num_items_in_batch.to(device=labels.device, dtype=torch.float32)).reshape(1)
    if reduction == MEAN:
        return (1.0 / (labels != ignore_index).sum().to(torch.float32)).reshape(1)
    return torch.ones(1, dtype=torch.float32, device=labels.device)


def default_chunk_size(num_tokens: int, vocab: int, itemsize: int) -> int:
    """Tokens per chunk: the largest multiple of CHUNK_ALIGN (at least CHUNK_ALIGN) whose logits fit
    DEFAULT_CHUNK_BYTES; all tokens in one chunk when they fit. The last chunk takes the remainder."""
    cap = max(CHUNK_ALIGN, DEFAULT_CHUNK_BYTES // max(1, vocab * itemsize) // CHUNK_ALIGN * CHUNK_ALIGN)
    return max(1, min(num_tokens, cap))


def _linear_ce_chunks(
    hidden, weight, bias, labels, scale, per_row_scale: bool, ignore_index, label_smoothing, z_loss_weight,
    softcap, chunk_size, grad_flags: int, weight_grad_fp32: bool,
):
    """The chunk loop shared by the forward (scalar scale) and the reduction="none" backward (per-row)."""
    N, _ = hidden.shape
    V = weight.shape[0]
    loss_rows = torch.empty(N, dtype=torch.float32, device=hidden.device)
    z_rows = torch.empty_like(loss_rows)
    compute_grad = grad_flags != 0
    dh = torch.empty_like(hidden) if grad_flags & GRAD_HIDDEN else None
    dw = None
    db = torch.zeros(V, dtype=torch.float32, device=hidden.device) if grad_flags & GRAD_BIAS else None
    weight_t = weight.t()
    # one logits buffer for every chunk: allocating per chunk keeps two alive at once (the next chunk's
    # logits are made before the previous ones are released), which doubled the peak (594 MiB, not 297)
    chunk_buffer = hidden.new_empty(min(chunk_size, N), V)
    for start in range(0, N, chunk_size):
        end = min(start + chunk_size, N)
        h_chunk = hidden[start:end]
        logits = chunk_buffer[: end - start]
        if bias is None:
            torch.mm(h_chunk, weight_t, out=logits)
        else:
            torch.addmm(bias, h_chunk, weight_t, out=logits)
        chunk_scale = scale[start:end] if per_row_scale else scale
        loss_c, z_c = _ce_rows(logits, labels[start:end], chunk_scale, ignore_index, label_smoothing,
                               z_loss_weight, softcap, compute_grad)
        loss_rows[start:end] = loss_c
        z_rows[start:end] = z_c
        if not compute_grad:
            continue
        # `logits` now holds d(loss)/d(logits) of this chunk
        if dh is not None:
            torch.mm(logits, weight, out=dh[start:end])
        if grad_flags & GRAD_WEIGHT:
            dw = _accumulate_weight_grad(dw, logits.t(), h_chunk, weight_grad_fp32)
        if db is not None:
            db += logits.sum(dim=0, dtype=torch.float32)
    return loss_rows, z_rows, dh, dw, db


def _accumulate_weight_grad(dw, dlogits_t, h_chunk, fp32: bool):
    if not fp32 or h_chunk.dtype == torch.float32:
        # cuBLAS accumulates each chunk's product in fp32; the running sum lives in the weight's dtype
        if dw is None:
            return torch.mm(dlogits_t, h_chunk)
        return dw.addmm_(dlogits_t, h_chunk)
    if dw is None:
        dw = torch.zeros(dlogits_t.shape[0], h_chunk.shape[1], dtype=torch.float32, device=h_chunk.device)
    if h_chunk.is_cuda:
        try:
            return dw.add_(torch.mm(dlogits_t, h_chunk, out_dtype=torch.float32))
        except (RuntimeError, TypeError):
            pass
    return dw.addmm_(dlogits_t.float(), h_chunk.float())


# ----------------------------------------------------------------------------- linear + cross-entropy ops

@custom_op("linear_cross_entropy_fwd")
def _linear_ce_fwd(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
    num_items_in_batch: Optional[torch.Tensor], ignore_index: int, reduction: int, label_smoothing: float,
    z_loss_weight: float, softcap: float, chunk_size: int, grad_flags: int, weight_grad_fp32: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_label_range("linear_cross_entropy", labels, weight.shape[0], ignore_index)
    scale = _loss_scale(labels, ignore_index, reduction, num_items_in_batch)
    loss_rows, z_rows, dh, dw, db = _linear_ce_chunks(
        hidden, weight, bias, labels, scale, False, ignore_index, label_smoothing, z_loss_weight, softcap,
        chunk_size, grad_flags if reduction != NONE else 0, weight_grad_fp32)
    if reduction == NONE:
        loss, z = loss_rows, z_rows
    elif reduction == SUM and num_items_in_batch is None:
        loss, z = loss_rows.sum(), z_rows.sum()
    else:
        loss, z = loss_rows.sum() * scale[0], z_rows.sum() * scale[0]
    return (loss, z, dh if dh is not None else hidden.new_empty(0), dw if dw is not None else hidden.new_empty(0),
            db.to(bias.dtype) if db is not None else hidden.new_empty(0))


def _lce_grad_shapes(hidden, weight, bias, reduction, grad_flags, weight_grad_fp32):
    live = reduction != NONE
    dh = torch.empty_like(hidden) if live and grad_flags & GRAD_HIDDEN else hidden.new_empty(0)
    if live and grad_flags & GRAD_WEIGHT:
        dw_dtype = torch.float32 if weight_grad_fp32 else weight.dtype
        dw = weight.new_empty(weight.shape, dtype=dw_dtype)
    else:
        dw = hidden.new_empty(0)
    db = bias.new_empty(bias.shape) if live and bias is not None and grad_flags & GRAD_BIAS else hidden.new_empty(0)
    return dh, dw, db


@_linear_ce_fwd.register_fake
def _(hidden, weight, bias, labels, num_items_in_batch, ignore_index, reduction, label_smoothing,
      z_loss_weight, softcap, chunk_size, grad_flags, weight_grad_fp32):
    shape = (hidden.shape[0],) if reduction == NONE else ()
    loss = hidden.new_empty(shape, dtype=torch.float32)
    return (loss, torch.empty_like(loss)) + _lce_grad_shapes(hidden, weight, bias, reduction, grad_flags,
                                                             weight_grad_fp32)


@custom_op("linear_cross_entropy_bwd_rows")
def _linear_ce_bwd_rows(
    grad_rows: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
    labels: torch.Tensor, ignore_index: int, label_smoothing: float, z_loss_weight: float, softcap: float,
    chunk_size: int, grad_flags: int, weight_grad_fp32: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """reduction="none" backward: recompute every chunk with the per-token upstream gradient folded in."""
    _, _, dh, dw, db = _linear_ce_chunks(
        hidden, weight, bias, labels, grad_rows.float().contiguous(), True, ignore_index, label_smoothing,
        z_loss_weight, softcap, chunk_size, grad_flags, weight_grad_fp32)
    return (dh if dh is not None else hidden.new_empty(0), dw if dw is not None else hidden.new_empty(0),
            db.to(bias.dtype) if db is not None else hidden.new_empty(0))


@_linear_ce_bwd_rows.register_fake
def _(grad_rows, hidden, weight, bias, labels, ignore_index, label_smoothing, z_loss_weight, softcap,
      chunk_size, grad_flags, weight_grad_fp32):
    return _lce_grad_shapes(hidden, weight, bias, MEAN, grad_flags, weight_grad_fp32)


class _RowOptions(NamedTuple):
    """What the reduction="none" backward passes on to `_linear_ce_bwd_rows` besides tensors and grad_flags."""
    ignore_index: int
    label_smoothing: float
    z_loss_weight: float
    softcap: float
    chunk_size: int
    weight_grad_fp32: bool


# `_linear_ce_fwd`'s inputs after hidden, weight and bias (labels, num_items_in_batch, the options) get no grad
_NO_GRAD_AFTER_BIAS = (None,) * 10


def _lce_setup_context(ctx, inputs, output):
    (hidden, weight, bias, labels, _nib, ignore_index, reduction, label_smoothing, z_loss_weight, softcap,
     chunk_size, grad_flags, weight_grad_fp32) = inputs
    # The op also outputs dX/dW/db (computed in the forward); without this autograd would materialise zero
    # gradients for those unused outputs in the backward: a second dW-sized buffer (measured: +1.3 GiB).
    ctx.set_materialize_grads(False)
    ctx.reduction = reduction
    ctx.grad_flags = grad_flags
    ctx.has_bias = bias is not None
    ctx.dtypes = (hidden.dtype, weight.dtype)
    if reduction == NONE:
        ctx.save_for_backward(hidden, weight, bias, labels)
        ctx.options = _RowOptions(ignore_index, label_smoothing, z_loss_weight, softcap, chunk_size, weight_grad_fp32)
    else:
        ctx.save_for_backward(output[2], output[3], output[4])


def _scale_(ctx, t: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    # the gradients were built for an upstream gradient of 1: scale them in place (no second dW buffer).
    # On the Triton path a kernel does it that skips the work on the device when g == 1 (the usual case:
    # loss.backward()), which saves reading and writing dW (2 x 1.2 GB at V=151936, H=4096) without a sync.
    if TUNING["skip_unit_scale"] and use_triton(t) and t.is_contiguous() and g.numel() == 1:
        call(ctx, _scale_unless_one_op, t, g.detach().reshape(1))
        return t
    return t.mul_(g.to(t.dtype))


@custom_op("scale_unless_one_", mutates_args=("t",))
def _scale_unless_one_op(t: torch.Tensor, g: torch.Tensor) -> None:
    """t *= g[0] in place; a no-op decided on the device when g[0] == 1 (an opaque op for torch.compile)."""
    if use_triton(t):
        from .triton_kernels import scale_unless_one_

        scale_unless_one_(t, g)
    else:
        t.mul_(g.to(t.dtype))


@_scale_unless_one_op.register_fake
def _(t, g):
    return None


@first_order("linear_cross_entropy")
def _lce_backward(ctx, grad_loss, _grad_z, _gdh, _gdw, _gdb):
    flags = ctx.grad_flags
    if ctx.reduction == NONE:
        hidden, weight, bias, labels = ctx.saved_tensors
        o = ctx.options
        dh, dw, db = call(ctx, _linear_ce_bwd_rows, grad_loss, hidden, weight, bias, labels, o.ignore_index,
                          o.label_smoothing, o.z_loss_weight, o.softcap, o.chunk_size, flags, o.weight_grad_fp32)
    else:
        dh, dw, db = ctx.saved_tensors
        dh = _scale_(ctx, dh, grad_loss) if flags & GRAD_HIDDEN else None
        dw = _scale_(ctx, dw, grad_loss) if flags & GRAD_WEIGHT else None
        db = _scale_(ctx, db, grad_loss) if (flags & GRAD_BIAS and ctx.has_bias) else None
    dh = dh if flags & GRAD_HIDDEN else None
    dw = dw.to(ctx.dtypes[1]) if flags & GRAD_WEIGHT else None
    db = db if (flags & GRAD_BIAS and ctx.has_bias) else None
    return (dh, dw, db) + _NO_GRAD_AFTER_BIAS


_linear_ce = differentiable_op(_linear_ce_fwd, _lce_setup_context, _lce_backward)


# ----------------------------------------------------------------------------- cross-entropy from logits

@custom_op("cross_entropy_fwd_", mutates_args=("logits",))
def _ce_fwd_(
    logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: Optional[torch.Tensor], ignore_index: int,
    reduction: int, label_smoothing: float, z_loss_weight: float, softcap: float, compute_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and z-loss of (rows, V) logits; with `compute_grad` the logits are overwritten with the gradient
    of the reduced loss (for reduction="none": of the plain per-row sum)."""
    _check_label_range("cross_entropy", labels, logits.shape[1], ignore_index)
    scale = _loss_scale(labels, ignore_index, reduction, num_items_in_batch)
    loss_rows, z_rows = _ce_rows(logits, labels, scale, ignore_index, label_smoothing, z_loss_weight, softcap,
                                 compute_grad)
    if reduction == NONE:
        return loss_rows, z_rows
    if reduction == SUM and num_items_in_batch is None:
        return loss_rows.sum(), z_rows.sum()
    return loss_rows.sum() * scale[0], z_rows.sum() * scale[0]


@_ce_fwd_.register_fake
def _(logits, labels, num_items_in_batch, ignore_index, reduction, label_smoothing, z_loss_weight, softcap,
      compute_grad):
    shape = (logits.shape[0],) if reduction == NONE else ()
    loss = logits.new_empty(shape, dtype=torch.float32)
    return loss, torch.empty_like(loss)


class _CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, num_items_in_batch, ignore_index, reduction, label_smoothing,
                z_loss_weight, softcap, inplace):
        compute_grad = ctx.needs_input_grad[0]
        # the kernels need unit-stride rows, and rows that do not overlap where they write (`cross_entropy`
        # passes such logits for inplace=True with a gradient)
        buffer = logits if (inplace or not compute_grad) else logits.clone(memory_format=torch.contiguous_format)
        loss, z = _ce_fwd_(buffer, labels, num_items_in_batch, ignore_index, reduction, label_smoothing,
                           z_loss_weight, softcap, compute_grad)
        ctx.reduction = reduction
        if compute_grad:
            ctx.save_for_backward(buffer)  # now the gradient for an upstream gradient of 1 (per row for "none")
        ctx.mark_non_differentiable(z)
        ctx.set_materialize_grads(False)  # no zero gradient filled for z
        return loss, z

    @staticmethod
    @first_order("cross_entropy")
    def backward(ctx, grad_loss, _grad_z):
        (dlogits,) = ctx.saved_tensors
        if ctx.reduction == NONE:
            dlogits = dlogits.mul_(grad_loss.to(dlogits.dtype)[:, None])
        else:
            dlogits = _scale_(ctx, dlogits, grad_loss)
        return dlogits, None, None, None, None, None, None, None, None


# ----------------------------------------------------------------------------- validation and public API

def _check_options(name, reduction, label_smoothing, softcap, num_items_in_batch, ignore_index):
    if reduction not in REDUCTIONS:
        raise ValueError(f"{name}: reduction must be one of {sorted(REDUCTIONS)}, got {reduction!r}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"{name}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if softcap is not None and not float(softcap) > 0:
        raise ValueError(f"{name}: softcap must be None or > 0, got {softcap}")
    if num_items_in_batch is not None and reduction == "none":
        raise ValueError(f"{name}: num_items_in_batch needs a reduced loss, not reduction='none'")
    if not isinstance(ignore_index, int):
        raise TypeError(f"{name}: ignore_index must be an int, got {type(ignore_index).__name__}")


def _nib_tensor(num_items_in_batch, device):
    if num_items_in_batch is None or torch.is_tensor(num_items_in_batch):
        return num_items_in_batch
    return torch.tensor(float(num_items_in_batch), device=device)


def _flat_labels(labels):
    # int64, torch's index dtype: the torch path gathers with them, and an ignore_index below 0 keeps its value
    # (uint8 labels would compare it wrapped around)
    return labels.reshape(-1).to(torch.int64).contiguous()


def _check_labels(name, labels, lead_shape, device, input_name):
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"{name}: labels must be a tensor")
    if labels.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"{name}: labels must be an integer tensor, got {labels.dtype}")
    if tuple(labels.shape) != tuple(lead_shape):
        raise ValueError(f"{name}: labels shape {tuple(labels.shape)} does not match the token shape "
                         f"{tuple(lead_shape)}")
    if labels.device != device:
        raise ValueError(f"{name}: labels are on {labels.device} but {input_name} on {device}")


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
    ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0, z_loss_weight: float = 0.0,
    softcap: Optional[float] = None, num_items_in_batch=None, chunk_size: Optional[int] = None,
    weight_grad_fp32: bool = False, return_z_loss: bool = False,
):
    """`cross_entropy(hidden @ weight.T + bias, labels)` without materialising the logits.

    hidden (..., H), weight (V, H), labels (...) integer, bias (V,) or None. The loss is fp32: a scalar, or
    per token (shape of labels) for reduction="none". `z_loss_weight * logsumexp^2` is added to every
    token's loss; `return_z_loss=True` also returns that term (reduced like the loss, detached) for logging.
    `softcap`: logits -> softcap * tanh(logits / softcap). `num_items_in_batch`: the loss is
    sum / num_items_in_batch (HF gradient accumulation). `chunk_size`: tokens per chunk (default: the chunk's
    logits take <= 300 MiB, a multiple of 256 tokens). `weight_grad_fp32`: accumulate dW over chunks in fp32 (an extra fp32 V x H
    buffer; default: each chunk's product is accumulated in fp32 by the GEMM, the running sum is kept in the
    weight's dtype).
    """
    name = "linear_cross_entropy"
    if not all(isinstance(t, torch.Tensor) for t in (hidden, weight)):
        raise TypeError(f"{name}: hidden and weight must be tensors")
    if not hidden.is_floating_point() or not weight.is_floating_point():
        raise TypeError(f"{name}: hidden and weight must be floating point, got {hidden.dtype}, {weight.dtype}")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"{name}: hidden dtype {hidden.dtype} does not match weight dtype {weight.dtype}")
    if weight.dim() != 2 or hidden.dim() < 1:
        raise ValueError(f"{name}: expected hidden (..., H) and weight (V, H), got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"{name}: hidden size {hidden.shape[-1]} does not match weight {tuple(weight.shape)}")
    if weight.device != hidden.device:
        raise ValueError(f"{name}: weight is on {weight.device} but hidden on {hidden.device}")
    if hidden.numel() == 0 or weight.numel() == 0:
        raise ValueError(f"{name}: empty input, hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (weight.shape[0],):
            raise ValueError(f"{name}: bias must be a ({weight.shape[0]},) tensor")
        if bias.dtype != weight.dtype or bias.device != weight.device:
            raise TypeError(f"{name}: bias dtype/device {bias.dtype}/{bias.device} does not match weight")
    _check_labels(name, labels, hidden.shape[:-1], hidden.device, "hidden")
    _check_options(name, reduction, label_smoothing, softcap, num_items_in_batch, ignore_index)
    if chunk_size is not None and int(chunk_size) < 1:
        raise ValueError(f"{name}: chunk_size must be >= 1, got {chunk_size}")

    lead_shape = labels.shape
    h2 = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    l2 = _flat_labels(labels)
    chunk = int(chunk_size) if chunk_size else default_chunk_size(h2.shape[0], weight.shape[0], h2.element_size())
    grad_flags = 0
    if torch.is_grad_enabled():
        grad_flags = ((GRAD_HIDDEN if hidden.requires_grad else 0) | (GRAD_WEIGHT if weight.requires_grad else 0)
                      | (GRAD_BIAS if bias is not None and bias.requires_grad else 0))
    loss, z, _dh, _dw, _db = _linear_ce(
        h2, weight.contiguous(), bias, l2, _nib_tensor(num_items_in_batch, hidden.device), ignore_index,
        REDUCTIONS[reduction], float(label_smoothing), float(z_loss_weight), float(softcap or 0.0), chunk,
        grad_flags, bool(weight_grad_fp32))
    if reduction == "none":
        loss, z = loss.view(lead_shape), z.view(lead_shape)
    return (loss, z.detach()) if return_z_loss else loss


def cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100, reduction: str = "mean",
    label_smoothing: float = 0.0, z_loss_weight: float = 0.0, softcap: Optional[float] = None,
    num_items_in_batch=None, inplace: bool = True, return_z_loss: bool = False,
):
    """Cross-entropy of materialised logits (..., V) against labels (...), fp32 math on any float dtype.

    With gradients enabled the gradient is computed in the forward and written into the logits buffer
    (`inplace=True`: the caller's logits are overwritten and must not be used afterwards) or into one copy in
    the logits' dtype (`inplace=False`). Options as in `linear_cross_entropy`.
    """
    name = "cross_entropy"
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{name}: logits must be a tensor")
    if not logits.is_floating_point():
        raise TypeError(f"{name}: logits must be floating point, got {logits.dtype}")
    if logits.dim() < 1 or logits.numel() == 0:
        raise ValueError(f"{name}: expected non-empty logits (..., V), got {tuple(logits.shape)}")
    _check_labels(name, labels, logits.shape[:-1], logits.device, "logits")
    _check_options(name, reduction, label_smoothing, softcap, num_items_in_batch, ignore_index)
    if (inplace and logits.requires_grad and torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and logits._use_count() > 1):
        # another reference to the logits' storage object: an op that saved them for its backward (which would
        # fail in backward, "modified by an inplace operation") or a view the caller still holds
        raise ValueError(f"{name}: inplace=True (the default) writes the gradient into the logits, but another "
                         f"op saved them for its backward or a view of them is alive; pass inplace=False")
    V = logits.shape[-1]
    if logits.is_contiguous():
        flat = logits.view(-1, V)
    else:
        if inplace and logits.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{name}: inplace=True needs contiguous logits (the gradient is written into them), "
                             f"got strides {logits.stride()} for shape {tuple(logits.shape)}; pass inplace=False")
        # a view where possible; the kernels read rows of unit column stride (transposed or expanded logits
        # are copied once)
        flat = logits.reshape(-1, V)
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
    loss, z = _CrossEntropyFunction.apply(
        flat, _flat_labels(labels), _nib_tensor(num_items_in_batch, logits.device), ignore_index,
        REDUCTIONS[reduction], float(label_smoothing), float(z_loss_weight), float(softcap or 0.0), bool(inplace))
    if reduction == "none":
        loss, z = loss.view(labels.shape), z.view(labels.shape)
    return (loss, z) if return_z_loss else loss
