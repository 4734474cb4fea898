"""Scaled dot-product attention as a forward call and a backward call (vendored into every hub variant).

For ops that run the attention inside their own autograd node (`rotary`'s attention block): the forward keeps
what the attention's backward needs, and the backward runs it, as `F.scaled_dot_product_attention`'s autograd
node would, with the same kernels.

- `sdpa_backend(q, k, v, is_causal, scale, needs_grad)`: the backend `F.scaled_dot_product_attention(q, k, v,
  is_causal=..., scale=..., enable_gqa=True)` chooses for these inputs (`torch.nn.attention.sdpa_kernel`
  respected).
- `sdpa_forward(backend, q, k, v, is_causal, scale)`: that backend's forward, called directly when it is flash
  (CUDA), cuDNN (CUDA) or the CPU flash kernel; `F.scaled_dot_product_attention` itself for any other.
- `sdpa_backward(backend, dout, q, k, v, output, saved, sizes, is_causal, scale)` -> (dq, dk, dv): that
  backend's backward; for the other backends the attention's forward runs again under autograd and is
  differentiated (same kernel, so the same gradients as SDPA's own node, at the cost of one more forward).

q: (B, Hq, S, D), k / v: (B, Hk, S, D) with Hq a multiple of Hk (grouped-query attention runs natively).

torch-private: the aten ops behind SDPA and `torch._fused_sdp_choice` (its backend choice). They live here only;
tests/test_sdpa_private.py fails when torch changes them.
"""
import torch
import torch.nn.functional as F

FLASH, CUDNN = 1, 3  # torch.nn.attention.SDPBackend values
RECOMPUTE, CPU_FLASH = -1, -2  # this module's own: SDPA again under autograd, the CPU flash kernel
_aten = torch.ops.aten


def sdpa_backend(q, k, v, is_causal: bool, scale: float, needs_grad: bool) -> int:
    """The backend SDPA picks for these inputs (with `needs_grad`: as if they required grad, since some backends
    have no backward at some shapes), as FLASH, CUDNN or CPU_FLASH where this module calls it directly, else
    RECOMPUTE."""
    if q.device.type == "cpu":
        choice = int(torch._fused_sdp_choice(q, k, v, None, 0.0, is_causal, scale=scale, enable_gqa=True))
        return CPU_FLASH if choice == FLASH else RECOMPUTE
    if q.device.type != "cuda" or q.shape[-1] % 8:  # the public path pads other head dims before flash
        return RECOMPUTE
    if needs_grad and not q.requires_grad:
        q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    choice = int(torch._fused_sdp_choice(q, k, v, None, 0.0, is_causal, scale=scale, enable_gqa=True))
    return choice if choice in (FLASH, CUDNN) else RECOMPUTE


def sdpa_forward(backend: int, q, k, v, is_causal: bool, scale: float):
    """(output (B, Hq, S, D), saved, sizes) of attention without a mask or dropout on `backend`
    (`sdpa_backend`'s): `saved` are the tensors its backward reads besides q, k, v and the output, `sizes` its
    integer arguments."""
    if backend == FLASH:
        out, lse, cum_q, cum_k, max_q, max_k, rng_state, unused, _ = _aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, is_causal, False, scale=scale)
        return out, (lse, cum_q, cum_k, rng_state, unused), (max_q, max_k)
    if backend == CUDNN:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = _aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, is_causal, False, scale=scale)
        return out, (lse, cum_q, cum_k, seed, offset), (max_q, max_k)
    if backend == CPU_FLASH:
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
        return out, (lse,), ()
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=True), (), ()


def sdpa_backward(backend: int, dout, q, k, v, out, saved, sizes, is_causal: bool, scale: float):
    """(dq, dk, dv) of `sdpa_forward`'s output for the output gradient `dout`."""
    if backend == FLASH:
        lse, cum_q, cum_k, rng_state, unused = saved
        return _aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, *sizes, 0.0, is_causal, rng_state, unused, scale=scale)
    if backend == CUDNN:
        lse, cum_q, cum_k, seed, offset = saved
        return _aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, *sizes, 0.0, is_causal, scale=scale)
    if backend == CPU_FLASH:
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, saved[0], 0.0, is_causal, scale=scale)
    with torch.enable_grad():
        inputs = [t.detach().requires_grad_(True) for t in (q, k, v)]
        again = F.scaled_dot_product_attention(*inputs, is_causal=is_causal, scale=scale, enable_gqa=True)
        return torch.autograd.grad(again, inputs, dout)
