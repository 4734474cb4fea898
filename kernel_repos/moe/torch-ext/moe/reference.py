"""Torch reference path for the routed experts.

`experts_hf` is the transformers v5 eager experts loop (Qwen3-MoE / Qwen3.5-MoE), used by the Layouts'
`forward`. `route` is the on-device routing shared by every path (a stable sort, no host sync).
`moe_fwd_reference` / `moe_bwd_reference` compute exactly what the fused custom ops return, in fp32 torch
math on the sorted token copies, and mirror the Triton kernels step for step (cast points included).
"""
import torch
import torch.nn.functional as F


def experts_hf(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, act_fn=F.silu):
    """HF `Qwen3MoeExperts.forward` (eager loop), verbatim in numerics. Index `num_experts` is skipped."""
    num_experts = gate_up_proj.shape[0]
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = F.one_hot(top_k_index.long(), num_classes=num_experts + 1)  # (int32: the EP exchange's ids)
        expert_mask = expert_mask.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        current_state = hidden_states[token_idx]
        gate, up = F.linear(current_state, gate_up_proj[expert_idx]).chunk(2, dim=-1)
        current_hidden_states = act_fn(gate) * up
        current_hidden_states = F.linear(current_hidden_states, down_proj[expert_idx])
        current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
    return final_hidden_states


def route(top_k_index: torch.Tensor, num_experts: int):
    """Sort the T*K token copies by expert, on the device, without a host sync.

    Returns `sorted_slot` (S,) int64: flat slot `t * K + k` of each sorted row (stable: ties keep token
    order, so the result is deterministic), and `expert_offsets` (E + 1,) int32 (torch._grouped_mm's `offs`
    dtype, so the grouped_mm backward uses it as it is): rows of expert `e` are
    `expert_offsets[e]:expert_offsets[e + 1]`. Slots with an index outside [0, E) fall outside every range
    (negative ones sort first, `E` and above last) and contribute nothing.
    """
    # narrow keys: the radix sort takes one pass per key byte (8 for int64). key = id + 1, the id clamped to
    # [-1, E], keeps every id on its side of [0, E) (so the order and the offsets are those of the original ids)
    # and fits in 8 bits up to E = 254
    key_dtype = torch.uint8 if num_experts <= 254 else torch.int16 if num_experts < 2 ** 15 - 1 else torch.int32
    keys = (top_k_index.reshape(-1).clamp(-1, num_experts) + 1).to(key_dtype)
    sorted_keys, sorted_slot = torch.sort(keys, stable=True)
    bounds = torch.arange(1, num_experts + 2, device=keys.device, dtype=key_dtype)  # the key of expert e is e + 1
    expert_offsets = torch.searchsorted(sorted_keys, bounds, out_int32=True)
    return sorted_slot, expert_offsets


def _swiglu(gate_up, dtype):
    """act = silu(gate) * up in fp32 from the rounded gate_up rows, rounded to dtype (returned as fp32)."""
    g, u = gate_up.float().chunk(2, dim=-1)
    return (g * torch.sigmoid(g) * u).to(dtype).float()


def _valid_slots(top_k_index, num_experts):
    return (top_k_index >= 0) & (top_k_index < num_experts)


def moe_fwd_reference(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj):
    """Returns (out (T, H), gate_up_out (S, 2I) pre-activation, sorted_slot, expert_offsets, pos); the S rows are
    in sorted (by expert) order, pos[slot] = its sorted row. Same cast points as the Triton path."""
    T, H = hidden.shape
    K = top_k_index.shape[1]
    E, two_i, _ = gate_up_proj.shape
    dtype = hidden.dtype
    sorted_slot, expert_offsets = route(top_k_index, E)
    rows_token = sorted_slot // K
    x_sorted = hidden[rows_token].float()
    gate_up_out = hidden.new_zeros((T * K, two_i))
    y_sorted = torch.zeros((T * K, H), dtype=dtype, device=hidden.device)
    bounds = expert_offsets.tolist()  # reference path: a host sync is fine here
    for e in range(E):
        lo, hi = bounds[e], bounds[e + 1]
        if lo == hi:
            continue
        gu = (x_sorted[lo:hi] @ gate_up_proj[e].float().t()).to(dtype)
        gate_up_out[lo:hi] = gu
        a = _swiglu(gu, dtype)
        y_sorted[lo:hi] = (a @ down_proj[e].float().t()).to(dtype)
    valid = _valid_slots(top_k_index, E).reshape(-1, 1)
    pos = torch.empty_like(sorted_slot)
    pos[sorted_slot] = torch.arange(sorted_slot.numel(), device=hidden.device)
    y_slot = torch.where(valid, y_sorted[pos].float(), 0.0)  # (S, H) in slot order
    w = torch.where(valid, top_k_weights.reshape(-1, 1).float(), 0.0)
    out = (y_slot * w).view(T, K, H).sum(1).to(dtype)
    return out, gate_up_out, sorted_slot, expert_offsets, pos


def moe_bwd_reference(dout, hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_out, sorted_slot,
                      expert_offsets, pos):
    """Returns (dhidden, dtop_k_weights, dgate_up_proj, ddown_proj) in fp32 math, cast to the input dtypes.
    act is recomputed from gate_up_out, as the kernels do."""
    T, H = hidden.shape
    K = top_k_index.shape[1]
    E = gate_up_proj.shape[0]
    dtype = hidden.dtype
    valid = _valid_slots(top_k_index, E).reshape(-1)[sorted_slot]
    rows_token = sorted_slot // K
    w_rows = torch.where(valid, top_k_weights.reshape(-1)[sorted_slot].float(), 0.0)
    dout_rows = dout[rows_token].float()  # (S, H) upstream grad of each sorted row's token
    x_rows = hidden[rows_token].float()
    dgate_up_proj = torch.zeros_like(gate_up_proj, dtype=torch.float32)
    ddown_proj = torch.zeros_like(down_proj, dtype=torch.float32)
    dx_rows = torch.zeros((T * K, H), dtype=torch.float32, device=hidden.device)
    dw_rows = torch.zeros(T * K, dtype=torch.float32, device=hidden.device)
    bounds = expert_offsets.tolist()
    for e in range(E):
        lo, hi = bounds[e], bounds[e + 1]
        if lo == hi:
            continue
        a = _swiglu(gate_up_out[lo:hi], dtype)
        # unweighted grad of act, rounded to the dtype (as F.linear's backward and the kernels round it)
        dact_unweighted = (dout_rows[lo:hi] @ down_proj[e].float()).to(dtype).float()  # (n, I)
        dw_rows[lo:hi] = (dact_unweighted * a).sum(1)  # d out / d w = <dout, y> = <dout @ Wd, act>
        dact = dact_unweighted * w_rows[lo:hi, None]
        g, u = gate_up_out[lo:hi].float().chunk(2, dim=-1)
        sig = torch.sigmoid(g)
        dg = dact * u * sig * (1.0 + g * (1.0 - sig))
        du = dact * g * sig
        dgu = torch.cat([dg, du], dim=1).to(dtype).float()
        dx_rows[lo:hi] = (dgu @ gate_up_proj[e].float()).to(dtype).float()
        dgate_up_proj[e] = dgu.t() @ x_rows[lo:hi]
        act_w = (a * w_rows[lo:hi, None]).to(dtype).float()
        ddown_proj[e] = dout_rows[lo:hi].t() @ act_w
    valid_slot = _valid_slots(top_k_index, E).reshape(-1, 1)
    dhidden = torch.where(valid_slot, dx_rows[pos], 0.0).view(T, K, H).sum(1).to(dtype)
    dweights = torch.where(valid_slot[:, 0], dw_rows[pos], 0.0).view(T, K).to(top_k_weights.dtype)
    return dhidden, dweights, dgate_up_proj.to(gate_up_proj.dtype), ddown_proj.to(down_proj.dtype)
