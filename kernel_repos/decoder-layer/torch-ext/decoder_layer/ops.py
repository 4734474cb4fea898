"""The dense decoder layer of Qwen3 / Llama / Qwen2 as one autograd node, for eager training.

`_DecoderLayerBlock` runs, with the implementations of the other families' ops and nothing between them:

    h   = x + attention(rms_norm(x))            rotary's attention block (q/k/v GEMM, q/k norm + RoPE, SDPA, o_proj)
    out = h + mlp(rms_norm(h))                  swiglu's RMSNorm + MLP block

The per-op path (rmsnorm's norm, rotary's `_attention_block`, swiglu's `rms_norm_swiglu_mlp`, two residual adds)
computes the same kernels in the same order: the outputs and every gradient are equal bit for bit. What one node
saves is host work: five autograd nodes a layer become one, and the module calls, views and checks between them go.

Saved: the layer input and the input norm's rstd (the norm's output is written again in the backward, one norm
pass, as the per-op path does), what the attention block keeps (its q/k/v projections, SDPA's output and
log-sum-exp), and what the MLP block keeps (the residual `h`, its rstd and the gate/up projection): the per-op
path's saved set, one tensor for one.

Under torch.compile the same forward and backward are two custom ops (`decoder_layer_fwd` / `decoder_layer_bwd`):
one opaque node a layer in each compiled graph, where the per-op path would be five custom ops and the glue between
them. The forward op returns its saved set as tensors (the stacked q/k/v projection as one tensor, SDPA's
log-sum-exp alone), and its fake implementation is the forward itself, run through the inner ops' fakes
(`_common.custom_op.run`). The caller checks the preconditions (`layers._block_applies`).
"""
from typing import Optional

import torch

from hubfuse._common.checks import first_order
from hubfuse._common.custom_op import custom_op
from hubfuse._common.device import use_triton
from hubfuse._common.sdpa import RECOMPUTE, enabled_backends, sdpa_saved_from, sdpa_saved_tensors
from hubfuse.rmsnorm.ops import _rms_norm_bwd, rms_norm_forward
from hubfuse.rmsnorm.reference import STANDARD as NORM_STANDARD
from hubfuse.rotary.ops import _attention_block_backward, _attention_block_forward, _cos_sin, _split_heads
from hubfuse.rotary.reference import NONE, STANDARD
from hubfuse.swiglu.ops import _mlp_block_backward, _mlp_block_forward


def _forward(x, input_norm_weight, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, q_norm_weight,
             k_norm_weight, cos, sin, o_weight, o_bias, post_norm_weight, gate_up_weight, gate_up_bias, down_weight,
             down_bias, input_eps, qk_eps, post_eps, mode, head_dim, scale, needs_grad):
    """The layer's forward, no autograd: (out, input norm's rstd, the attention block's saved and args, the MLP
    block's saved)."""
    shape = x.shape
    x2 = x.view(-1, shape[-1])
    normed, rstd = rms_norm_forward(x2, input_norm_weight, input_eps)
    y, attn_saved, attn_args = _attention_block_forward(
        normed.view(shape), q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, q_norm_weight, k_norm_weight,
        cos, sin, o_weight, o_bias, qk_eps, mode, head_dim, scale, needs_grad)
    del normed  # written again in the backward
    h = x + y
    mlp_out, mlp_saved = _mlp_block_forward(h.view(-1, shape[-1]), post_norm_weight, post_eps, gate_up_weight,
                                            gate_up_bias, down_weight, down_bias)
    return h + mlp_out.view(shape), rstd, attn_saved, attn_args, mlp_saved


def _backward(dout, x2, input_norm_weight, rstd, attn_saved, attn_args, mlp_saved, input_eps, mlp_biases):
    """The layer's backward from `_forward`'s saved set: (dx, d_input_norm_weight, the attention block's 10 and
    the MLP block's 5 weight gradients (None where there is no bias or q/k norm))."""
    shape = dout.shape
    dout2 = dout.reshape(-1, shape[-1]).contiguous()
    dh_mlp, d_post_norm_weight, d_gate_up_weight, d_gate_up_bias, d_down_weight, d_down_bias = \
        _mlp_block_backward(dout2, mlp_saved, *mlp_biases)
    dh = dout2 + dh_mlp  # the residual's gradient and the MLP's, as autograd sums them on the per-op path
    del dh_mlp
    normed, _ = rms_norm_forward(x2, input_norm_weight, input_eps)
    attn_grads = _attention_block_backward(dh.view(shape), normed.view(shape), attn_saved, attn_args)
    del normed
    dx_norm, d_input_norm_weight, _ = _rms_norm_bwd.eager_impl(
        attn_grads[0].reshape(-1, shape[-1]).contiguous(), x2, input_norm_weight, None, rstd, NORM_STANDARD)
    dx = dh + dx_norm
    return (dx.view(shape), d_input_norm_weight, *attn_grads[1:], d_post_norm_weight, d_gate_up_weight,
            d_gate_up_bias, d_down_weight, d_down_bias)


def _input_grads(grads, extra=0):
    """`_backward`'s gradients in the order of the layer's inputs (cos, sin and the scalars get none; `extra`
    more inputs after them, none either)."""
    dx, d_in, dwq, dwk, dwv, dbq, dbk, dbv, dwq_norm, dwk_norm, d_o, d_o_b, d_post, d_gu, d_gu_b, d_down, \
        d_down_b = grads
    return (dx, d_in, dwq, dwk, dwv, dbq, dbk, dbv, dwq_norm, dwk_norm, None, None, d_o, d_o_b, d_post, d_gu,
            d_gu_b, d_down, d_down_b, None, None, None, None, None, None) + (None,) * extra


class _DecoderLayerBlock(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, input_norm_weight, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, q_norm_weight,
                k_norm_weight, cos, sin, o_weight, o_bias, post_norm_weight, gate_up_weight, gate_up_bias,
                down_weight, down_bias, input_eps, qk_eps, post_eps, mode, head_dim, scale):
        out, rstd, attn_saved, ctx.attn_args, mlp_saved = _forward(
            x, input_norm_weight, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, q_norm_weight,
            k_norm_weight, cos, sin, o_weight, o_bias, post_norm_weight, gate_up_weight, gate_up_bias, down_weight,
            down_bias, input_eps, qk_eps, post_eps, mode, head_dim, scale, any(ctx.needs_input_grad))
        ctx.save_for_backward(x.view(-1, x.shape[-1]), input_norm_weight, rstd, *attn_saved, *mlp_saved)
        ctx.n_attn = len(attn_saved)
        ctx.input_eps = input_eps
        ctx.mlp_biases = (gate_up_bias is not None, down_bias is not None)
        return out

    @staticmethod
    @first_order("decoder layer block")
    def backward(ctx, dout):
        x2, input_norm_weight, rstd, *rest = ctx.saved_tensors
        return _input_grads(_backward(dout, x2, input_norm_weight, rstd, rest[:ctx.n_attn], ctx.attn_args,
                                      rest[ctx.n_attn:], ctx.input_eps, ctx.mlp_biases))


# ------------------------------------------------------------------------- the same node under torch.compile
# decoder_layer_fwd returns [out, rstd, *projections, sdpa_out, *lse, h, post_rstd, gate_up]: the projections are
# the stacked q/k/v GEMM's output (Triton path; q, k, v are column views of it) or q, k, v (torch path); lse is
# SDPA's log-sum-exp. The fake implementation picks SDPA's backend as the real one does (`sdpa_backend` on
# FakeTensors); the caller takes the op only where that backend is one `_common.sdpa` calls directly
# (`layers._block_applies`): SDPA differentiated again inside the op's backward would need autograd there.

def _stacked(q, width: int):
    """The stacked q/k/v GEMM output (B, S, width) that q (B, S, Hq, D), its first columns, is a view of."""
    return q.as_strided((q.shape[0], q.shape[1], width), (q.stride(0), q.stride(1), 1), q.storage_offset())


@custom_op("decoder_layer_fwd")
def _decoder_layer_fwd(
    x: torch.Tensor, input_norm_weight: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
    v_weight: torch.Tensor, q_bias: Optional[torch.Tensor], k_bias: Optional[torch.Tensor],
    v_bias: Optional[torch.Tensor], q_norm_weight: Optional[torch.Tensor], k_norm_weight: Optional[torch.Tensor],
    cos: torch.Tensor, sin: torch.Tensor, o_weight: torch.Tensor, o_bias: Optional[torch.Tensor],
    post_norm_weight: torch.Tensor, gate_up_weight: torch.Tensor, gate_up_bias: Optional[torch.Tensor],
    down_weight: torch.Tensor, down_bias: Optional[torch.Tensor], input_eps: float, qk_eps: float,
    post_eps: float, mode: int, head_dim: int, scale: float, sdpa_backends: int,
) -> list[torch.Tensor]:
    # sdpa_backends (`_common.sdpa.enabled_backends()` when traced) keys the compiled graph on them: the output
    # layout depends on SDPA's choice
    out, rstd, attn_saved, attn_args, mlp_saved = _forward(
        x, input_norm_weight, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, q_norm_weight, k_norm_weight,
        cos, sin, o_weight, o_bias, post_norm_weight, gate_up_weight, gate_up_bias, down_weight, down_bias,
        input_eps, qk_eps, post_eps, mode, head_dim, scale, True)
    q, k, v, sdpa_out = attn_saved[:4]
    backend, stacked = attn_args[4], attn_args[8]
    if backend == RECOMPUTE:
        raise RuntimeError(
            "decoder_layer_fwd: SDPA chose a backend other than flash / cuDNN (CUDA) or the CPU flash kernel for these "
            f"inputs (q {tuple(q.shape)}, {q.dtype}, {q.device}); the compiled decoder-layer node calls those "
            "directly. Enable them (torch.nn.attention.sdpa_kernel) or load with kernel_mapping(..., "
            "decoder_layer=False).")
    projections = [_stacked(q, q_weight.shape[0] + k_weight.shape[0] + v_weight.shape[0])] if stacked else [q, k, v]
    h, _, post_rstd, _, gate_up, _ = mlp_saved
    return [out, rstd, *projections, sdpa_out, *sdpa_saved_tensors(backend, attn_saved[12:]), h, post_rstd, gate_up]


_decoder_layer_fwd.register_fake(_decoder_layer_fwd.eager_impl)  # run through the inner ops' fakes


@custom_op("decoder_layer_bwd", mutates_args=("gate_up",))
def _decoder_layer_bwd(
    dout: torch.Tensor, x: torch.Tensor, input_norm_weight: torch.Tensor, q_weight: torch.Tensor,
    k_weight: torch.Tensor, v_weight: torch.Tensor, q_norm_weight: Optional[torch.Tensor],
    k_norm_weight: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, o_weight: torch.Tensor,
    post_norm_weight: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor, rstd: torch.Tensor,
    projections: list[torch.Tensor], sdpa_out: torch.Tensor, lse: list[torch.Tensor], h: torch.Tensor,
    post_rstd: torch.Tensor, gate_up: torch.Tensor, input_eps: float, qk_eps: float, rope_mode: int, head_dim: int,
    scale: float, has_qkv_bias: bool, has_o_bias: bool, has_gate_up_bias: bool, has_down_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_backward`'s gradients with q/k/v's weights (and biases) stacked ([Q + K + V, hidden]: outputs may not
    alias each other, and the Triton path's three are views of one GEMM output), an empty tensor for each None (a
    mutating op cannot return a list). Writes gate_up's gradient over it. (No argument is named `mode`:
    auto_functionalized_v2 takes that keyword.)"""
    stacked = use_triton(x)
    sizes = (q_weight.shape[0], k_weight.shape[0], v_weight.shape[0])
    if stacked:
        q, k, v = _split_heads(projections[0], sizes, head_dim)
    else:
        q, k, v = projections
    backend, sdpa_saved, sdpa_sizes = sdpa_saved_from(lse, q.transpose(1, 2))
    attn_saved = (q, k, v, sdpa_out, q_weight, k_weight, v_weight, q_norm_weight, k_norm_weight, cos, sin, o_weight,
                  *sdpa_saved)
    attn_args = (qk_eps, rope_mode, scale, q.shape[1] > 1, backend, sdpa_sizes, has_qkv_bias, has_o_bias, stacked)
    mlp_saved = (h.view(-1, h.shape[-1]), post_norm_weight, post_rstd, gate_up_weight, gate_up, down_weight)
    dx, d_in, dwq, dwk, dwv, dbq, dbk, dbv, *rest = _backward(
        dout, x.view(-1, x.shape[-1]), input_norm_weight, rstd, attn_saved, attn_args, mlp_saved, input_eps,
        (has_gate_up_bias, has_down_bias))
    width = sum(sizes)
    if stacked:  # row blocks of one tensor: that tensor
        d_qkv = dwq.as_strided((width, dwq.shape[1]), dwq.stride(), dwq.storage_offset())
        d_qkv_bias = dbq.as_strided((width,), dbq.stride(), dbq.storage_offset()) if has_qkv_bias else None
    else:
        d_qkv = torch.cat((dwq, dwk, dwv))
        d_qkv_bias = torch.cat((dbq, dbk, dbv)) if has_qkv_bias else None
    return tuple(x.new_empty(0) if g is None else g.contiguous() for g in (dx, d_in, d_qkv, d_qkv_bias, *rest))


@_decoder_layer_bwd.register_fake
def _(dout, x, input_norm_weight, q_weight, k_weight, v_weight, q_norm_weight, k_norm_weight, cos, sin, o_weight,
      post_norm_weight, gate_up_weight, down_weight, rstd, projections, sdpa_out, lse, h, post_rstd, gate_up,
      input_eps, qk_eps, rope_mode, head_dim, scale, has_qkv_bias, has_o_bias, has_gate_up_bias, has_down_bias):
    def like(shape, dtype, present=True):
        return torch.empty(shape if present else 0, dtype=dtype if present else x.dtype, device=x.device)

    width = q_weight.shape[0] + k_weight.shape[0] + v_weight.shape[0]
    qk_norm = [like(0, x.dtype, False) if w is None else like(w.shape, w.dtype) for w in (q_norm_weight, k_norm_weight)]
    return (like(x.shape, x.dtype), like(input_norm_weight.shape, input_norm_weight.dtype),
            like((width, q_weight.shape[1]), q_weight.dtype), like(width, q_weight.dtype, has_qkv_bias), *qk_norm,
            like(o_weight.shape, o_weight.dtype), like(o_weight.shape[0], o_weight.dtype, has_o_bias),
            like(post_norm_weight.shape, post_norm_weight.dtype), like(gate_up_weight.shape, gate_up_weight.dtype),
            like(gate_up_weight.shape[0], gate_up_weight.dtype, has_gate_up_bias),
            like(down_weight.shape, down_weight.dtype), like(down_weight.shape[0], down_weight.dtype, has_down_bias))


def _setup_context(ctx, inputs, output):
    (x, input_norm_weight, q_weight, k_weight, v_weight, q_bias, _, _, q_norm_weight, k_norm_weight, cos, sin,
     o_weight, o_bias, post_norm_weight, gate_up_weight, gate_up_bias, down_weight, down_bias, input_eps, qk_eps,
     _, mode, head_dim, scale, _) = inputs
    n_projections = 1 if use_triton(x) else 3
    ctx.n_projections, ctx.n_lse = n_projections, len(output) - 6 - n_projections
    ctx.save_for_backward(x, input_norm_weight, q_weight, k_weight, v_weight, q_norm_weight, k_norm_weight, cos, sin,
                          o_weight, post_norm_weight, gate_up_weight, down_weight, *output[1:])
    ctx.args = (input_eps, qk_eps, mode, head_dim, scale, q_bias is not None, o_bias is not None,
                gate_up_bias is not None, down_bias is not None)
    ctx.sizes = (q_weight.shape[0], k_weight.shape[0], v_weight.shape[0])


@first_order("decoder layer block")
def _compiled_backward(ctx, grads):
    saved = ctx.saved_tensors
    weights, (rstd, *rest) = saved[:13], saved[13:]
    projections, rest = rest[:ctx.n_projections], rest[ctx.n_projections:]
    sdpa_out, lse, (h, post_rstd, gate_up) = rest[0], rest[1:1 + ctx.n_lse], rest[1 + ctx.n_lse:]
    dx, d_in, d_qkv, d_qkv_bias, dwq_norm, dwk_norm, d_o, d_o_b, d_post, d_gu, d_gu_b, d_down, d_down_b = \
        _decoder_layer_bwd(grads[0], *weights, rstd, list(projections), sdpa_out, list(lse), h, post_rstd, gate_up,
                           *ctx.args)
    has_qkv_bias, has_o_bias, has_gate_up_bias, has_down_bias = ctx.args[5:]
    qkv_bias = torch.split(d_qkv_bias, ctx.sizes) if has_qkv_bias else (None, None, None)
    qk_norm = (dwq_norm, dwk_norm) if saved[5] is not None else (None, None)
    return _input_grads((dx, d_in, *torch.split(d_qkv, ctx.sizes), *qkv_bias, *qk_norm, d_o,
                         d_o_b if has_o_bias else None, d_post, d_gu, d_gu_b if has_gate_up_bias else None, d_down,
                         d_down_b if has_down_bias else None), extra=1)


_decoder_layer_fwd.register_autograd(_compiled_backward, setup_context=_setup_context)


def _decoder_layer_block(x, input_norm_weight, input_eps, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias,
                         q_norm_weight, k_norm_weight, qk_eps, cos, sin, o_weight, o_bias, head_dim, scale,
                         post_norm_weight, post_eps, gate_up_weight, gate_up_bias, down_weight, down_bias):
    """One dense decoder layer (no cache, no mask: causal; no dropout) from its input to its output, one autograd
    node (under torch.compile: the `decoder_layer_fwd` custom op). x: (B, S, hidden), contiguous; every weight of x's dtype; q/k norm weights None for Llama / Qwen2 (RoPE
    alone); cos / sin not requiring grad. The caller checks the preconditions (`layers._block_applies`)."""
    mode = NONE if q_norm_weight is None else STANDARD
    args = (x, input_norm_weight, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, q_norm_weight, k_norm_weight,
            *_cos_sin(cos, sin), o_weight, o_bias, post_norm_weight, gate_up_weight, gate_up_bias, down_weight,
            down_bias, float(input_eps), float(qk_eps), float(post_eps), mode, head_dim, float(scale))
    if torch.compiler.is_compiling():
        return _decoder_layer_fwd(*args, enabled_backends())[0]
    return _DecoderLayerBlock.apply(*args)
