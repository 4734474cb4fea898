"""The dense decoder layer of Qwen3 / Llama / Qwen2 as one autograd node, for eager training.

`_DecoderLayerBlock` runs, with the implementations of the other families' ops and nothing between them:

    h   = x + attention(rms_norm(x))            rotary's attention block (q/k/v GEMM, q/k norm + RoPE, SDPA, o_proj)
    out = h + mlp(rms_norm(h))                  swiglu's RMSNorm + MLP block

The per-op path (rmsnorm's norm, rotary's `_attention_block`, swiglu's `rms_norm_swiglu_mlp`, two residual adds)
computes the same arithmetic in the same order: the outputs and every gradient are equal bit for bit. What one node
saves is host work: five autograd nodes a layer become one, and the module calls, views and checks between them go.
On the Triton path three of the residual stream's adds also run inside the norm kernels next to them, rounded as
torch's add rounds (`h = x + y` in the post-attention norm's forward; the two gradient sums in the two norms'
backwards): three launches and their passes over the stream fewer a layer.

Saved: the layer input and the input norm's rstd (the norm's output is written again in the backward, one norm
pass, as the per-op path does), what the attention block keeps (its q/k/v projections, SDPA's output and
log-sum-exp), and what the MLP block keeps (the residual `h`, its rstd and the gate/up projection): the per-op
path's saved set, one tensor for one.

Eager mode only: under torch.compile the Layer runs the per-op path, whose ops are custom ops. The caller checks
the preconditions (`layers._block_applies`).
"""
import torch

from hubfuse._common.checks import first_order
from hubfuse.rmsnorm.ops import rms_norm_backward, rms_norm_forward
from hubfuse.rotary.ops import _attention_block_backward, _attention_block_forward, _cos_sin
from hubfuse.rotary.reference import NONE, STANDARD
from hubfuse.swiglu.ops import _mlp_block_backward, _mlp_block_forward_add


class _DecoderLayerBlock(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, input_norm_weight, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, q_norm_weight,
                k_norm_weight, cos, sin, o_weight, o_bias, post_norm_weight, gate_up_weight, gate_up_bias,
                down_weight, down_bias, input_eps, qk_eps, post_eps, mode, head_dim, scale):
        shape = x.shape
        x2 = x.view(-1, shape[-1])
        normed, rstd = rms_norm_forward(x2, input_norm_weight, input_eps)
        y, attn_saved, ctx.attn_args = _attention_block_forward(
            normed.view(shape), q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, q_norm_weight, k_norm_weight,
            cos, sin, o_weight, o_bias, qk_eps, mode, head_dim, scale, any(ctx.needs_input_grad))
        del normed  # written again in the backward
        h, mlp_out, mlp_saved = _mlp_block_forward_add(x2, y.view(-1, shape[-1]), post_norm_weight, post_eps,
                                                       gate_up_weight, gate_up_bias, down_weight, down_bias)
        ctx.save_for_backward(x2, input_norm_weight, rstd, *attn_saved, *mlp_saved)
        ctx.n_attn = len(attn_saved)
        ctx.input_eps = input_eps
        ctx.mlp_biases = (gate_up_bias is not None, down_bias is not None)
        return (h + mlp_out).view(shape)

    @staticmethod
    @first_order("decoder layer block")
    def backward(ctx, dout):
        x2, input_norm_weight, rstd, *rest = ctx.saved_tensors
        attn_saved, mlp_saved = rest[:ctx.n_attn], rest[ctx.n_attn:]
        shape = dout.shape
        dout2 = dout.reshape(-1, shape[-1]).contiguous()
        # dh: the residual's gradient plus the MLP's, summed (by the norm's backward kernel) as autograd sums them
        # on the per-op path
        dh, d_post_norm_weight, d_gate_up_weight, d_gate_up_bias, d_down_weight, d_down_bias = \
            _mlp_block_backward(dout2, mlp_saved, *ctx.mlp_biases, dresidual=dout2)
        normed, _ = rms_norm_forward(x2, input_norm_weight, ctx.input_eps)
        dnormed, dwq, dwk, dwv, dbq, dbk, dbv, dwq_norm, dwk_norm, d_o_weight, d_o_bias = _attention_block_backward(
            dh.view(shape), normed.view(shape), attn_saved, ctx.attn_args)
        del normed
        dx, d_input_norm_weight = rms_norm_backward(dnormed.reshape(-1, shape[-1]).contiguous(), x2,
                                                    input_norm_weight, rstd, dresidual=dh)
        return (dx.view(shape), d_input_norm_weight, dwq, dwk, dwv, dbq, dbk, dbv, dwq_norm, dwk_norm, None, None,
                d_o_weight, d_o_bias, d_post_norm_weight, d_gate_up_weight, d_gate_up_bias, d_down_weight,
                d_down_bias, None, None, None, None, None, None)


def _decoder_layer_block(x, input_norm_weight, input_eps, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias,
                         q_norm_weight, k_norm_weight, qk_eps, cos, sin, o_weight, o_bias, head_dim, scale,
                         post_norm_weight, post_eps, gate_up_weight, gate_up_bias, down_weight, down_bias):
    """One dense decoder layer (no cache, no mask: causal; no dropout) from its input to its output, one autograd
    node. x: (B, S, hidden), contiguous; every weight of x's dtype; q/k norm weights None for Llama / Qwen2 (RoPE
    alone); cos / sin not requiring grad. The caller checks the preconditions (`layers._block_applies`)."""
    mode = NONE if q_norm_weight is None else STANDARD
    return _DecoderLayerBlock.apply(
        x, input_norm_weight, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, q_norm_weight, k_norm_weight,
        *_cos_sin(cos, sin), o_weight, o_bias, post_norm_weight, gate_up_weight, gate_up_bias, down_weight,
        down_bias, float(input_eps), float(qk_eps), float(post_eps), mode, head_dim, float(scale))
