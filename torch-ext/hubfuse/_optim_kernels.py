"""hubfuse.optim.AdamW's kernel: the AdamW update of one tensor in one pass (imports triton; loaded on the first
kernel step).

Every element reads param, grad, exp_avg and exp_avg_sq once and writes param, exp_avg and exp_avg_sq once, in
the tensors' own dtype, with the math in fp32. The step count and the learning rate can live on the device, so
the launch is the same on every step (CUDA-graph capturable).
"""
import triton
import triton.language as tl

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
def _adamw_kernel(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, step_ptr, lr_ptr, numel, lr, beta1, beta2,
                  one_minus_beta1, one_minus_beta2, ln_beta1, ln_beta2, eps, weight_decay,
                  LR_ON_DEVICE: tl.constexpr, MAXIMIZE: tl.constexpr, BLOCK: tl.constexpr):
    # torch's AdamW, element by element (the step count already incremented):
    #   p -= lr * wd * p;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g g
    #   p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    t = tl.load(step_ptr).to(tl.float32)
    if LR_ON_DEVICE:
        lr = tl.load(lr_ptr).to(tl.float32)
    step_size = tl.div_rn(lr, _one_minus_pow(ln_beta1, t))
    bias_correction2_sqrt = tl.sqrt_rn(_one_minus_pow(ln_beta2, t))
    decay = lr * weight_decay

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


def adamw_update(param, grad, exp_avg, exp_avg_sq, step, lr, beta1: float, beta2: float, eps: float,
                 weight_decay: float, maximize: bool) -> None:
    """One AdamW update of contiguous same-dtype tensors, in place; `step` (a 0-dim tensor on their device) is
    the step count after this step; `lr` a float or a 0-dim tensor on their device."""
    import math

    numel = param.numel()
    lr_on_device = not isinstance(lr, float)
    # 1 - beta in double, then rounded once: 1 - fp32(0.999) is 1.3e-5 off 0.001 in relative terms
    # ln(0) = -inf: beta**t = exp(-inf) = 0 for every t >= 1
    ln_beta1, ln_beta2 = (math.log(b) if b > 0 else -math.inf for b in (beta1, beta2))
    launch(_adamw_kernel, (cdiv(numel, BLOCK),), param, grad, exp_avg, exp_avg_sq, step,
           lr if lr_on_device else step, numel, 0.0 if lr_on_device else lr, beta1, beta2, 1.0 - beta1, 1.0 - beta2,
           ln_beta1, ln_beta2, eps, weight_decay, LR_ON_DEVICE=lr_on_device, MAXIMIZE=maximize, BLOCK=BLOCK,
           num_warps=NUM_WARPS)
