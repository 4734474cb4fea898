"""Torch reference path: the transformers functions verbatim, and the fused ops' math in torch.

`load_balancing_loss_hf` and `topk_router_hf` are the transformers code (Qwen3-MoE / Qwen3.5-MoE, 5.22.2),
numerics and cast order included; Layout forwards use them. The `*_reference` functions are the fused ops'
forward and analytic backward written in torch: the CPU path of the custom ops, mirroring the Triton kernels.

Selection rule shared by the kernels and these references: the top-k experts of a row are the k largest
probabilities, ties broken towards the lower expert index (what `torch.topk` does on CUDA). For the aux loss
the probabilities are first rounded to the logits dtype, as HF's `softmax(bf16 logits)` returns bf16.
"""
import torch
import torch.nn.functional as F

MAX_EXPERTS = 8192  # 16 bits of the selection key hold the column; the Triton tile holds one row of E


def load_balancing_loss_hf(gate_logits, num_experts=None, top_k=2, attention_mask=None):
    """transformers' `load_balancing_loss_func` (identical in qwen3_moe and qwen3_5_moe, 5.22.2)."""
    if gate_logits is None or not isinstance(gate_logits, tuple):
        return 0
    compute_device = gate_logits[0].device
    tokens_per_expert_sum = torch.zeros(num_experts, dtype=torch.float32, device=compute_device)
    router_prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=compute_device)
    total_rows = 0.0
    if attention_mask is not None:
        flat_mask = attention_mask.reshape(-1).to(device=compute_device, dtype=torch.float32)
    for layer_gate in gate_logits:
        routing_weights = torch.nn.functional.softmax(layer_gate.to(compute_device), dim=-1)
        _, selected_experts = torch.topk(routing_weights, top_k, dim=-1)
        if attention_mask is None:
            tokens_per_expert_sum = (
                tokens_per_expert_sum + torch.bincount(selected_experts.reshape(-1), minlength=num_experts).float()
            )
            router_prob_sum = router_prob_sum + routing_weights.float().sum(dim=0)
            total_rows = total_rows + routing_weights.shape[0]
        else:
            tokens_per_expert_sum = tokens_per_expert_sum + torch.zeros(
                num_experts, dtype=torch.float32, device=compute_device
            ).scatter_add_(0, selected_experts.reshape(-1), flat_mask.repeat_interleave(top_k))
            router_prob_sum = router_prob_sum + (routing_weights.float() * flat_mask.unsqueeze(-1)).sum(dim=0)
            total_rows = total_rows + flat_mask.sum()
    tokens_per_expert = tokens_per_expert_sum / total_rows
    router_prob_per_expert = router_prob_sum / total_rows
    overall_loss = torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0))
    return overall_loss * num_experts


def topk_router_hf(hidden_states, weight, top_k: int, normalize: bool):
    """`Qwen3MoeTopKRouter.forward` (normalize = config.norm_topk_prob) and `Qwen3_5MoeTopKRouter.forward`
    (always normalizes): returns (router_logits, router_scores, router_indices)."""
    hidden_states = hidden_states.reshape(-1, weight.shape[1])
    router_logits = F.linear(hidden_states, weight)
    router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, top_k, dim=-1)
    if normalize:
        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    router_top_value = router_top_value.to(router_logits.dtype)
    return router_logits, router_top_value, router_indices


def topk_lowest_index(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest non-negative `values` per row, ties -> lower index, largest first.

    Packs (value bits, reversed column) into one int64 key, so every key in a row is distinct and a plain
    top-k on the keys is exact and tie-free (the same packing the Triton kernels reduce with `tl.max`)."""
    bits = values.float().contiguous().view(torch.int32).to(torch.int64)
    cols = torch.arange(values.shape[-1], device=values.device, dtype=torch.int64)
    keys = (bits << 16) | (65535 - cols)
    return 65535 - (torch.topk(keys, k, dim=-1).values & 65535)


def _routing_probs(z: torch.Tensor) -> torch.Tensor:
    """HF's routing weights: softmax computed in fp32, rounded to the logits dtype, back in fp32."""
    return torch.softmax(z.float(), dim=-1).to(z.dtype).float()


def router_statistics_reference(gate_logits, mask, num_experts: int, top_k: int):
    """(2, E) fp32: mask-weighted top-k selection counts and routing-probability sums over all layers' rows."""
    dev = gate_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=dev)
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=dev)
    T = gate_logits[0].shape[0]
    weight = mask.float() if mask is not None else torch.ones(T, dtype=torch.float32, device=dev)
    for z in gate_logits:
        p = _routing_probs(z)
        sel = topk_lowest_index(p, top_k)
        counts += torch.zeros(num_experts, dtype=torch.float32, device=dev).scatter_add_(
            0, sel.reshape(-1), weight.repeat_interleave(top_k))
        prob_sum += (p * weight[:, None]).sum(0)
    return torch.stack([counts, prob_sum])


def load_balancing_loss_fwd_reference(gate_logits, mask, num_experts: int, top_k: int):
    """Forward of the fused op. gate_logits: list of (T, E); mask: (T,) of any dtype (0 = padding) or None.
    Returns (loss: fp32 0-d, dloss_dprobsum: fp32 (E,) = E * tokens_per_expert / total_rows)."""
    counts, prob_sum = router_statistics_reference(gate_logits, mask, num_experts, top_k)
    T = gate_logits[0].shape[0]
    weight = mask.float() if mask is not None else torch.ones(T, dtype=torch.float32, device=counts.device)
    total_rows = weight.sum() * len(gate_logits)
    tokens_per_expert = counts / total_rows
    loss = (tokens_per_expert * (prob_sum / total_rows)).sum() * num_experts
    return loss, tokens_per_expert * num_experts / total_rows


def load_balancing_loss_bwd_reference(grad_loss, gate_logits, mask, dloss_dprobsum):
    """d loss / d logits of every layer, stacked (layers, T, E): mask_t * p * (w - <p, w>),
    w = grad * dloss/dprob_sum."""
    w = (grad_loss.float() * dloss_dprobsum)[None, :]
    grads = []
    for z in gate_logits:
        p = _routing_probs(z)
        dz = p * (w - (p * w).sum(-1, keepdim=True))
        if mask is not None:
            dz = dz * mask.float()[:, None]
        grads.append(dz.to(z.dtype))
    return torch.stack(grads)


def softmax_topk_fwd_reference(router_logits, top_k: int, normalize: bool):
    """Forward of the fused router op on (T, E) logits: (scores in logits dtype, int64 indices, fp32 stats
    (T, 2) = row max and row sum of exp, for the backward)."""
    z = router_logits.float()
    row_max = z.amax(-1)
    row_sum = torch.exp(z - row_max[:, None]).sum(-1)
    probs = torch.softmax(z, dim=-1)
    indices = topk_lowest_index(probs, top_k)
    top = probs.gather(1, indices)
    if normalize:
        top = top / top.sum(-1, keepdim=True)
    return top.to(router_logits.dtype), indices, torch.stack([row_max, row_sum], 1)


def softmax_topk_bwd_reference(d_scores, router_logits, stats, indices, normalize: bool):
    """d logits of the fused router: dz = p * (dp - sum_j v_j dv_j), dp = dv scattered to the chosen experts."""
    z = router_logits.float()
    p = torch.exp(z - stats[:, :1]) / stats[:, 1:]
    v = p.gather(1, indices)
    ds = d_scores.float()
    if normalize:
        total = v.sum(-1, keepdim=True)
        dv = (ds - (ds * v / total).sum(-1, keepdim=True)) / total
    else:
        dv = ds
    dp = torch.zeros_like(p).scatter_add_(1, indices, dv)
    dz = p * (dp - (v * dv).sum(-1, keepdim=True))
    return dz.to(router_logits.dtype)
