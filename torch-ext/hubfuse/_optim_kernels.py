"""hubfuse.optim.AdamW's kernels (imports triton; loaded on the first kernel step): the AdamW update of one tensor
in one pass (`adamw_update`), and of many tensors of one dtype in one launch (`adamw_update_many`: a table of
their addresses on the device, each program one chunk of one tensor).

Every element reads param, grad, exp_avg and exp_avg_sq once and writes param, exp_avg and exp_avg_sq once, in
the tensors' own dtype, with the math in fp32. The step counts and the learning rate can live on the device, so
the launches are the same on every step (CUDA-graph capturable).
"""
import math

import torch
import triton
import triton.language as tl

from ._common.device import capturing, int64_table
from ._common.launch import cdiv, launch

# elements a program and warps; module settings read at every launch. `scripts/bench_adamw.py` sweeps them: on an
# H200, 1024 x 4 warps moves 4.12 TB/s of the 4.24 a copy gets, 4096 x 8 3.64, 8192 x 8 2.77
BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _one_minus_pow(ln_beta, t):
    """1 - beta**t = -expm1(t * ln(beta)) in fp32 without the cancellation of 1 - exp(x) at small t:
    expm1(x) = (exp(x) - 1) * x / log(exp(x)) (Kahan), exact where exp(x) rounds to 1 or to 0."""
    x = t * ln_beta
    u = tl.exp(x)
    expm1 = tl.where(u == 1.0, x, (u - 1.0) * x / tl.log(u))
    expm1 = tl.where(u == 0.0, -1.0, expm1)
    return -expm1


@triton.jit
def _adamw_factors(step_ptr, lr_ptr, lr, ln_beta1, ln_beta2, weight_decay, LR_ON_DEVICE: tl.constexpr):
    """(step size lr / (1 - b1^t), sqrt(1 - b2^t), lr * wd) from the step count t (already incremented)."""
    t = tl.load(step_ptr).to(tl.float32)
    if LR_ON_DEVICE:
        lr = tl.load(lr_ptr).to(tl.float32)
    step_size = tl.div_rn(lr, _one_minus_pow(ln_beta1, t))
    bias_correction2_sqrt = tl.sqrt_rn(_one_minus_pow(ln_beta2, t))
    return step_size, bias_correction2_sqrt, lr * weight_decay


@triton.jit
def _adamw_elements(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, offs, mask, step_size, bias_correction2_sqrt,
                    decay, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, MAXIMIZE: tl.constexpr):
    # torch's AdamW, element by element:
    #   p -= lr * wd * p;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g g
    #   p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    param = tl.load(param_ptr + offs, mask=mask).to(tl.float32)
    grad = tl.load(grad_ptr + offs, mask=mask).to(tl.float32)
    exp_avg = tl.load(exp_avg_ptr + offs, mask=mask).to(tl.float32)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offs, mask=mask).to(tl.float32)
    if MAXIMIZE:
        grad = -grad
    param = param - decay * param
    exp_avg = beta1 * exp_avg + one_minus_beta1 * grad
    exp_avg_sq = beta2 * exp_avg_sq + one_minus_beta2 * grad * grad
    denom = tl.div_rn(tl.sqrt_rn(exp_avg_sq), bias_correction2_sqrt) + eps
    param = param - tl.div_rn(step_size * exp_avg, denom)
    tl.store(param_ptr + offs, param.to(param_ptr.dtype.element_ty), mask=mask)
    tl.store(exp_avg_ptr + offs, exp_avg.to(exp_avg_ptr.dtype.element_ty), mask=mask)
    tl.store(exp_avg_sq_ptr + offs, exp_avg_sq.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _adamw_kernel(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, step_ptr, lr_ptr, numel, lr, beta1, beta2,
                  one_minus_beta1, one_minus_beta2, ln_beta1, ln_beta2, eps, weight_decay,
                  LR_ON_DEVICE: tl.constexpr, MAXIMIZE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    step_size, bias_correction2_sqrt, decay = _adamw_factors(step_ptr, lr_ptr, lr, ln_beta1, ln_beta2, weight_decay,
                                                             LR_ON_DEVICE)
    _adamw_elements(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, offs, offs < numel, step_size,
                    bias_correction2_sqrt, decay, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, MAXIMIZE)


@triton.jit
def _adamw_many_kernel(TABLE, n_tensors, lr_ptr, lr, beta1, beta2, one_minus_beta1, one_minus_beta2, ln_beta1,
                       ln_beta2, eps, weight_decay, DTYPE: tl.constexpr, LR_ON_DEVICE: tl.constexpr,
                       MAXIMIZE: tl.constexpr, BLOCK: tl.constexpr, BLOCKS: tl.constexpr,
                       SEARCH_STEPS: tl.constexpr, COLUMNS: tl.constexpr):
    # TABLE: a row of COLUMNS (TABLE_COLUMNS) int64 a tensor (addresses of param, grad, exp_avg, exp_avg_sq and the fp32 step
    # count, numel, first program); program i updates BLOCKS * BLOCK elements of the tensor whose programs hold i
    pid = tl.program_id(0)
    lo = 0
    hi = n_tensors
    for _ in tl.static_range(SEARCH_STEPS):  # the last row whose first program is <= pid (rows sorted by it)
        mid = (lo + hi) // 2
        below = tl.load(TABLE + mid * COLUMNS + 6) <= pid
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    row = TABLE + lo * COLUMNS
    param_ptr = tl.load(row).to(tl.pointer_type(DTYPE))
    grad_ptr = tl.load(row + 1).to(tl.pointer_type(DTYPE))
    exp_avg_ptr = tl.load(row + 2).to(tl.pointer_type(DTYPE))
    exp_avg_sq_ptr = tl.load(row + 3).to(tl.pointer_type(DTYPE))
    step_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    numel = tl.load(row + 5)
    start = (pid - tl.load(row + 6)) * (BLOCKS * BLOCK)
    step_size, bias_correction2_sqrt, decay = _adamw_factors(step_ptr, lr_ptr, lr, ln_beta1, ln_beta2, weight_decay,
                                                             LR_ON_DEVICE)
    for b in tl.static_range(BLOCKS):
        offs = start + b * BLOCK + tl.arange(0, BLOCK)
        _adamw_elements(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, offs, offs < numel, step_size,
                        bias_correction2_sqrt, decay, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, MAXIMIZE)


def _beta_args(beta1: float, beta2: float) -> tuple:
    """The kernels' (beta1, beta2, 1 - beta1, 1 - beta2, ln beta1, ln beta2)."""
    # 1 - beta in double, then rounded once: 1 - fp32(0.999) is 1.3e-5 off 0.001 in relative terms
    # ln(0) = -inf: beta**t = exp(-inf) = 0 for every t >= 1
    ln_beta1, ln_beta2 = (math.log(b) if b > 0 else -math.inf for b in (beta1, beta2))
    return beta1, beta2, 1.0 - beta1, 1.0 - beta2, ln_beta1, ln_beta2


def adamw_update(param, grad, exp_avg, exp_avg_sq, step, lr, beta1: float, beta2: float, eps: float,
                 weight_decay: float, maximize: bool) -> None:
    """One AdamW update of contiguous same-dtype tensors, in place; `step` (a 0-dim tensor on their device) is
    the step count after this step; `lr` a float or a 0-dim tensor on their device."""
    numel = param.numel()
    lr_on_device = not isinstance(lr, float)
    launch(_adamw_kernel, (cdiv(numel, BLOCK),), param, grad, exp_avg, exp_avg_sq, step,
           lr if lr_on_device else step, numel, 0.0 if lr_on_device else lr, *_beta_args(beta1, beta2), eps,
           weight_decay, LR_ON_DEVICE=lr_on_device, MAXIMIZE=maximize, BLOCK=BLOCK,
           num_warps=NUM_WARPS)


# the many-tensor launch: each program updates BLOCKS * BLOCK elements of one tensor
BLOCKS = 4
TABLE_COLUMNS = 8  # param, grad, exp_avg, exp_avg_sq and step addresses, numel, first program, (padding)
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


class AddressTables:
    """The tables `adamw_update_many` reads, on the device, kept by their contents: a step whose tensors sit where
    the last one's did (the caching allocator's usual case) launches with no copy. One slot a (param group index,
    device, dtype) of an optimizer.

    CUDA graphs: a table made while a graph is captured is copied from a pinned host buffer that an earlier eager
    step reserved for its param group (`reserve`; a replay copies that buffer again, so it is never written
    after), and kept for the optimizer's life. Without one (a group's first step captured), `table` returns None
    and the caller takes another path."""

    def __init__(self):
        self.latest = {}  # slot -> (values, device table) of the last eager step
        self.captured = {}  # (slot, values) -> (host buffer, device table): read by captured graphs' replays
        self.spare = {}  # param group index -> [pinned host buffer, first free element] for captures

    def reserve(self, group_index: int, n_params: int) -> None:
        """Eager, on CUDA: a pinned host buffer big enough for the group's tables in a later capture."""
        spare = self.spare.get(group_index)
        # a fresh one where a capture took part of it (its slices are that graph's), so that every capture (one
        # graph per batch shape) finds room
        if spare is None or spare[1] > 0 or spare[0].numel() < TABLE_COLUMNS * n_params:
            self.spare[group_index] = [torch.empty(TABLE_COLUMNS * n_params, dtype=torch.int64, pin_memory=True), 0]

    def table(self, slot, values: tuple, device: torch.device):
        entry = self.latest.get(slot)
        if entry is not None and entry[0] == values:
            return entry[1]
        captured = self.captured.get((slot, values))
        if captured is not None:
            return captured[1]
        if not capturing(device):
            table = int64_table(values, device)  # the interpreter (CPU tests) reads a CPU table
            self.latest[slot] = (values, table)
            return table
        spare = self.spare.get(slot[0])
        if spare is None or spare[0].numel() - spare[1] < len(values):
            return None
        host = spare[0][spare[1]:spare[1] + len(values)]
        spare[1] += len(values)  # this slice is the graph's from now on
        host.copy_(torch.tensor(values, dtype=torch.int64))
        table = torch.empty(len(values), dtype=torch.int64, device=device)
        table.copy_(host, non_blocking=True)
        self.captured[(slot, values)] = (host, table)
        return table


def many_table(tables: AddressTables, slot, entries) -> tuple | None:
    """(device table, tensors, programs) for `adamw_update_many` over `entries` [((param, grad, exp_avg,
    exp_avg_sq), step)] of one device and dtype, or None (`AddressTables.table`)."""
    values = []
    programs = 0
    chunk = BLOCKS * BLOCK
    for (param, grad, exp_avg, exp_avg_sq), step in entries:
        numel = param.numel()
        values += (param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), step.data_ptr(),
                   numel, programs, 0)
        programs += cdiv(numel, chunk)
    table = tables.table(slot, tuple(values), entries[0][0][0].device)
    return None if table is None else (table, len(entries), programs)


def adamw_update_many(table_info, dtype, lr, beta1: float, beta2: float, eps: float, weight_decay: float,
                      maximize: bool) -> None:
    """One AdamW update of every tensor of a `many_table` (contiguous tensors of one dtype, their step counts
    already incremented), in one launch; the same arithmetic per element as `adamw_update`."""
    table, n_tensors, programs = table_info
    lr_on_device = not isinstance(lr, float)
    launch(_adamw_many_kernel, (programs,), table, n_tensors, lr if lr_on_device else table,
           0.0 if lr_on_device else lr, *_beta_args(beta1, beta2), eps, weight_decay,
           DTYPE=_TL_DTYPES[dtype], LR_ON_DEVICE=lr_on_device, MAXIMIZE=maximize, BLOCK=BLOCK, BLOCKS=BLOCKS,
           SEARCH_STEPS=max(n_tensors - 1, 1).bit_length(), COLUMNS=TABLE_COLUMNS, num_warps=NUM_WARPS)
