"""`_common.sdpa`: SDPA's forward and backward called directly (torch-private: the aten ops behind
`F.scaled_dot_product_attention` and its backend choice). Fails when torch changes them."""
import pytest
import torch
import torch.nn.functional as F

from hubfuse._common import sdpa

# the schemas `_common.sdpa` calls positionally (torch 2.11 on the GPU machines and 2.13 here agree)
SCHEMAS = {
    "_scaled_dot_product_flash_attention": (
        "aten::_scaled_dot_product_flash_attention(Tensor query, Tensor key, Tensor value, float dropout_p=0., "
        "bool is_causal=False, bool return_debug_mask=False, *, float? scale=None) -> (Tensor output, Tensor "
        "logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, Tensor rng_state, Tensor "
        "unused, Tensor debug_attn_mask)"),
    "_scaled_dot_product_flash_attention_backward": (
        "aten::_scaled_dot_product_flash_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor "
        "value, Tensor out, Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, "
        "float dropout_p, bool is_causal, Tensor philox_seed, Tensor philox_offset, *, float? scale=None) -> "
        "(Tensor grad_query, Tensor grad_key, Tensor grad_value)"),
    "_scaled_dot_product_cudnn_attention": (
        "aten::_scaled_dot_product_cudnn_attention(Tensor query, Tensor key, Tensor value, Tensor? attn_bias, "
        "bool compute_log_sumexp, float dropout_p=0., bool is_causal=False, bool return_debug_mask=False, *, "
        "float? scale=None) -> (Tensor output, Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt "
        "max_q, SymInt max_k, Tensor philox_seed, Tensor philox_offset, Tensor debug_attn_mask)"),
    "_scaled_dot_product_cudnn_attention_backward": (
        "aten::_scaled_dot_product_cudnn_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor "
        "value, Tensor out, Tensor logsumexp, Tensor philox_seed, Tensor philox_offset, Tensor attn_bias, Tensor "
        "cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, *, float? "
        "scale=None) -> (Tensor, Tensor, Tensor)"),
    "_scaled_dot_product_flash_attention_for_cpu": (
        "aten::_scaled_dot_product_flash_attention_for_cpu(Tensor query, Tensor key, Tensor value, float "
        "dropout_p=0., bool is_causal=False, *, Tensor? attn_mask=None, float? scale=None) -> (Tensor output, "
        "Tensor logsumexp)"),
    "_scaled_dot_product_flash_attention_for_cpu_backward": (
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward(Tensor grad_out, Tensor query, Tensor key, "
        "Tensor value, Tensor out, Tensor logsumexp, float dropout_p, bool is_causal, *, Tensor? attn_mask=None, "
        "float? scale=None) -> (Tensor grad_query, Tensor grad_key, Tensor grad_value)"),
}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_aten_schemas_unchanged(name):
    assert str(getattr(torch.ops.aten, name).default._schema) == SCHEMAS[name]


def test_backend_choice_and_enum():
    from torch.nn.attention import SDPBackend

    assert (SDPBackend.FLASH_ATTENTION.value, SDPBackend.CUDNN_ATTENTION.value) == (sdpa.FLASH, sdpa.CUDNN)
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    assert sdpa.sdpa_backend(q, k, k, True, 0.3, True) == sdpa.CPU_FLASH
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):  # the choice follows the user's backend selection
        assert sdpa.sdpa_backend(q, k, k, True, 0.3, True) == sdpa.RECOMPUTE


@pytest.mark.parametrize("backend", ["chosen", "recompute"])
@pytest.mark.parametrize("shape", [(2, 4, 2, 7, 8), (1, 3, 3, 1, 16), (3, 2, 1, 33, 4)])
@pytest.mark.parametrize("is_causal", [True, False])
def test_forward_backward_match_sdpa_autograd_float64(backend, shape, is_causal):
    """Forward and backward against F.scaled_dot_product_attention + autograd, float64, fresh random inputs
    (grouped-query, odd lengths, one token)."""
    B, Hq, Hk, S, D = shape
    torch.manual_seed(sum(shape) + is_causal)
    q, k, v = (torch.randn(B, h, S, D, dtype=torch.float64, requires_grad=True) for h in (Hq, Hk, Hk))
    dout = torch.randn(B, Hq, S, D, dtype=torch.float64)
    scale = D ** -0.5 * 1.3
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    which = sdpa.sdpa_backend(q, k, v, is_causal, scale, True) if backend == "chosen" else sdpa.RECOMPUTE
    with torch.no_grad():
        out, saved, sizes = sdpa.sdpa_forward(which, q, k, v, is_causal, scale)
        grads = sdpa.sdpa_backward(which, dout, q, k, v, out, saved, sizes, is_causal, scale)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
