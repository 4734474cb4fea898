"""Expert parallelism (EP) for the routed experts: each rank of an EP group holds E/ep of the experts, tokens
travel to their experts' ranks and back with all-to-all, and the grouped GEMM runs on the local experts.

    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cuda", (dp, ep), mesh_dim_names=("dp", "ep"))
    moe.expert_parallel.shard_experts(model, mesh["ep"])   # after the (kernelized) load, before fully_shard

`shard_experts` keeps rows [r*E/ep, (r+1)*E/ep) of `gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I) on EP
rank r, as DTensor parameters `Shard(0)` over the EP mesh (the layout of transformers' `"grouped_gemm"` EP
style): `state_dict()` keys and global shapes stay those of the HF checkpoint, so distributed checkpoints and
full-state-dict gathers see the original tensors. It binds `GroupedGemmExperts.forward` on each experts module
(where `kernelize` has not already). That forward is expert-parallel whenever the parameters are sharded so,
whoever sharded them: `shard_experts`, or transformers' `from_pretrained(distributed_config=DistributedConfig(
ep_size=...))`, whose own dispatch forward `kernelize` replaces with ours.

One forward of an expert-parallel experts module:

1. route: token t goes to EP rank r once if any of its top-k experts lives on r (one row per (token, rank),
   not per (token, expert): at most min(top_k, ep) rows per token on the wire). Two ways to size the exchange:
   - sized (default): the per-rank row counts go through one `all_to_all_single` and then to the host: **one
     host sync per MoE layer forward** (variable split sizes must be host integers);
   - fixed capacity (`shard_experts(..., capacity=C)` or `set_capacity(model, C)`): no host sync. Every rank
     sends every one of its tokens to every rank, padded to C rows per destination (C >= the tokens of any
     call, the same C on every rank of the EP group), with the expert ids of other ranks as the sentinel:
     static split sizes, nothing dropped, ep x C rows per rank into the grouped GEMM (whose skipped slots cost
     no GEMM work). The wire carries ep x C rows instead of the ~ep x T x P(a token has an expert on a rank)
     of the sized exchange: 1.1x at 128 experts top-8 over 4 ranks (P = 0.90), 1.5x over 8 ranks (P = 0.66).
     Around the fused experts (`_PipelinedExperts`, below) every rank getting the same rows makes the dispatch
     an all-gather; the backward sends the input gradients under the gate_up weight-grad GEMM; with `chunks=N`
     (N > 1) the call's tokens go in N pieces of ceil(C / N) rows, pipelined with the local experts, forward
     and backward, so that one piece's exchanges overlap another's GEMMs.
2. dispatch: one all-to-all of the packed rows (hidden state, the token's top-k weights, its expert ids local to
   the receiving rank, where the experts of other ranks become the sentinel E/ep that the kernel skips).
3. `moe_experts` (grouped GEMM, SwiGLU, weighted sum over this rank's slots) on the received rows.
4. combine: one all-to-all back; each token sums its partial outputs in fp32, in rank order (deterministic, no
   atomics; a transient (T, min(top_k, ep), H) gather).

Backward runs the two exchanges in reverse with the same split sizes (no further host sync), from
autograd.Functions over `torch.distributed.all_to_all_single`. The gradient of a sharded expert parameter is the
**sum** over the EP group's ranks (every rank's loss sends its tokens' gradients to the experts' owners), as in
torchtitan and transformers: data-parallel averaging must divide it by the number of data-parallel ranks (all
dp x ep of them), not by the number of copies of the expert (`hubfuse.distributed.fully_shard_model` sets
FSDP2's gradient divide factor so). The exchange is eager code: under `torch.compile` it is a graph break.
"""
from types import MethodType
from typing import NamedTuple

import torch
from torch import nn

from hubfuse._common.checks import check_range, first_order
from hubfuse._common.device import capturing
from .ops import _autocast_inputs, _check_inputs, _experts_bwd, _experts_fwd

DISTRIBUTED = torch.distributed.is_available()
if DISTRIBUTED:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from hubfuse._common.collectives import all_gather_single as _all_gather

EXPERT_PARAMS = ("gate_up_proj", "down_proj")
_ALIGN = 16  # bytes: each packed field starts aligned, so it can be viewed back as its dtype
_CAPACITY_ATTR = "_hubfuse_ep_capacity"  # on an experts module: the fixed per-rank token capacity, or None (sized)
_CHUNKS_ATTR = "_hubfuse_ep_chunks"  # on an experts module: pieces of the fixed-capacity exchange's pipeline


# ----------------------------------------------------------------------------------------------- which modules

def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every routed-experts module in the transformers v5 layout: 3-D `gate_up_proj` (E, 2I, H)
    and `down_proj` (E, H, I) parameters with the same E (Qwen3-MoE / Qwen3.5-MoE experts, our Layout)."""
    found = []
    for name, module in model.named_modules():
        gate_up, down = (module._parameters.get(p) for p in EXPERT_PARAMS)
        if gate_up is not None and down is not None and gate_up.dim() == 3 and down.dim() == 3 \
                and gate_up.shape[0] == down.shape[0]:
            found.append((name, module))
    return found


def is_expert_parallel(module: nn.Module) -> bool:
    """Whether this experts module's parameters are DTensors (sharded over an EP mesh; checked in the forward)."""
    return DISTRIBUTED and isinstance(module._parameters.get("gate_up_proj"), DTensor)


def _ep_layout(module: nn.Module):
    """(process group, number of local experts) of an expert-parallel experts module, validated."""
    gate_up, down = module.gate_up_proj, module.down_proj
    for name, p in (("gate_up_proj", gate_up), ("down_proj", down)):
        if not isinstance(p, DTensor) or p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
            where = f"DTensor {tuple(p.placements)} over a {p.device_mesh.ndim}-D mesh" if isinstance(p, DTensor) \
                else "a plain tensor"
            raise ValueError(f"expert parallelism: {type(module).__name__}.{name} is {where}; both expert parameters "
                             "must be DTensors Shard(0) over the same 1-D expert-parallel mesh (shard_experts)")
    if down.device_mesh != gate_up.device_mesh:
        raise ValueError(f"expert parallelism: {type(module).__name__}.gate_up_proj and down_proj are sharded over "
                         "different meshes")
    mesh = gate_up.device_mesh
    if mesh.mesh_dim_names == ("tp",):
        # transformers' router-masking EP ("ep_router" + "moe_tp_experts"): every rank has every token and the
        # router already remapped the ids to local ones; exchanging tokens on top of that would be wrong
        raise NotImplementedError(f"expert parallelism: {type(module).__name__} is sharded over a 'tp' mesh "
                                  "(transformers' router-masking EP plan); this kernel supports token dispatch: "
                                  "the default ep_plan ('ep_dispatch_experts') or moe.shard_experts")
    num_experts, ep_size = gate_up.shape[0], mesh.size()
    if num_experts % ep_size:
        raise ValueError(f"expert parallelism: {num_experts} experts are not divisible by the expert-parallel size "
                         f"{ep_size}")
    return mesh.get_group(), num_experts // ep_size


# ----------------------------------------------------------------------------------------------- sharding

def _as_mesh(ep_mesh, device_type: str):
    if isinstance(ep_mesh, DeviceMesh):
        if ep_mesh.ndim != 1:
            raise ValueError(f"shard_experts: ep_mesh must be a 1-D DeviceMesh (e.g. mesh['ep'] of a (dp, ep) mesh), "
                             f"got {ep_mesh.ndim} dimensions {ep_mesh.mesh_dim_names}")
        if ep_mesh.device_type != device_type:
            raise ValueError(f"shard_experts: ep_mesh is a {ep_mesh.device_type!r} mesh but the experts are on "
                             f"{device_type!r}")
        return ep_mesh
    if isinstance(ep_mesh, dist.ProcessGroup):
        return DeviceMesh.from_group(ep_mesh, device_type)
    raise TypeError(f"shard_experts: ep_mesh must be a 1-D DeviceMesh or a ProcessGroup, got {type(ep_mesh).__name__}")


def _check_layout(name: str, module: nn.Module) -> None:
    gate_up, down = module.gate_up_proj, module.down_proj
    E, two_i, H = gate_up.shape
    others = [n for n, _ in module.named_parameters(recurse=False) if n not in EXPERT_PARAMS]
    if others or getattr(module, "is_transposed", False) or tuple(down.shape) != (E, H, two_i // 2) or two_i % 2:
        raise ValueError(f"shard_experts: {name} ({type(module).__name__}) is not in the supported layout: "
                         f"gate_up_proj (E, 2I, H), down_proj (E, H, I), no other parameters (got {tuple(gate_up.shape)}, "
                         f"{tuple(down.shape)}, extra {others})")


def _bind_forward(name: str, module: nn.Module) -> None:
    """Run our experts forward (expert-parallel aware) on this module, unless kernelize already bound it."""
    from .layers import GroupedGemmExperts

    current = module.__dict__.get("forward")
    func = getattr(current, "__func__", None)
    if current is None:
        module.forward = MethodType(GroupedGemmExperts.forward, module)
    elif func is not GroupedGemmExperts.forward and getattr(func, "__qualname__", "") != "GroupedGemmExperts.forward":
        # (a qualname match: bound by another loaded copy of this kernel, e.g. the umbrella's `hubfuse.moe`)
        raise ValueError(f"shard_experts: {name} ({type(module).__name__}) already has its own forward "
                         f"({getattr(current, '__qualname__', current)!r}); expert parallelism needs this kernel's "
                         "GroupedGemmExperts forward")


def shard_experts(model: nn.Module, ep_mesh, *, capacity: int | None = None, chunks: int = 1) -> nn.Module:
    """Make every routed-experts module of `model` expert-parallel over `ep_mesh`; returns the model.

    ep_mesh: a 1-D DeviceMesh (for FSDP2 on top, the EP dimension of the 2-D (dp, ep) mesh passed to
    `fully_shard`: `mesh["ep"]`), or a ProcessGroup. Every rank must hold the same full expert weights (as after
    every rank loaded the checkpoint); each keeps its own slice, the rest is freed. Call it before `fully_shard`
    and before building the optimizer (the parameters are replaced). The experts then run
    `GroupedGemmExperts.forward` (bound here if kernelize has not). Idempotent for the same mesh.
    capacity: None (sized exchange, one host sync per MoE layer) or the fixed per-rank token capacity of the
    sync-free exchange; chunks: its pipeline's pieces (`set_capacity`).
    """
    if not DISTRIBUTED:
        raise RuntimeError("shard_experts: torch.distributed is not available in this build of torch")
    if not dist.is_initialized():
        raise RuntimeError("shard_experts: torch.distributed is not initialized (init_process_group first)")
    _check_exchange("shard_experts", capacity, chunks)  # before any parameter is replaced
    experts = expert_modules(model)
    if not experts:
        raise ValueError(f"shard_experts: no routed-experts module (3-D gate_up_proj and down_proj parameters) in "
                         f"{type(model).__name__}")
    mesh = _as_mesh(ep_mesh, experts[0][1].gate_up_proj.device.type)
    ep_size, ep_rank = mesh.size(), mesh.get_local_rank()
    for name, module in experts:
        _check_layout(name, module)
        for pname in EXPERT_PARAMS:
            p = module._parameters[pname]
            if isinstance(p, DTensor):
                if p.device_mesh == mesh and tuple(p.placements) == (Shard(0),):
                    continue  # sharded by an earlier call
                raise ValueError(f"shard_experts: {name}.{pname} is already a DTensor {tuple(p.placements)} over "
                                 f"{p.device_mesh}; call shard_experts once, before fully_shard")
            if p.device.type not in (mesh.device_type, "meta"):
                raise ValueError(f"shard_experts: {name}.{pname} is on {p.device} but ep_mesh is a "
                                 f"{mesh.device_type!r} mesh")
            num_experts = p.shape[0]
            if num_experts % ep_size:
                raise ValueError(f"shard_experts: {name} has {num_experts} experts, not divisible by the "
                                 f"expert-parallel size {ep_size} (ep_mesh)")
            n = num_experts // ep_size
            local = p.detach()[ep_rank * n:(ep_rank + 1) * n].clone()  # a copy: the full tensor is freed
            sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
            setattr(module, pname, nn.Parameter(sharded, requires_grad=p.requires_grad))
        _bind_forward(name, module)
    return set_capacity(model, capacity, chunks=chunks)


def _check_exchange(caller: str, capacity, chunks) -> None:
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)):
        raise TypeError(f"{caller}: capacity must be None or an int, got {type(capacity).__name__}")
    if capacity is not None and capacity < 1:
        raise ValueError(f"{caller}: capacity must be >= 1 token, got {capacity}")
    if isinstance(chunks, bool) or not isinstance(chunks, int):
        raise TypeError(f"{caller}: chunks must be an int, got {type(chunks).__name__}")
    if chunks < 1:
        raise ValueError(f"{caller}: chunks must be >= 1, got {chunks}")
    if chunks > 1 and capacity is None:
        raise ValueError(f"{caller}: chunks={chunks} needs a fixed capacity (the sized exchange is not chunked)")


def set_capacity(model: nn.Module, capacity: int | None, *, chunks: int = 1) -> nn.Module:
    """Choose the token exchange of every expert-parallel experts module of `model` (sharded by `shard_experts` or by
    transformers' EP plan); returns the model. capacity=None: sized exchange (one host sync per MoE layer
    forward). capacity=C: sync-free fixed-capacity exchange; every call on every rank of the EP group must pass at
    most C tokens (e.g. C = micro-batch x sequence length) and every rank must use the same C.
    chunks (fixed capacity only, the same on every rank): 1 = one exchange each way around the local experts;
    N > 1 = the call's tokens in N pieces of ceil(C / N) rows per destination, pipelined, so that the all-to-alls
    of one piece run under the expert GEMMs of another (forward and backward). Same result up to summation order."""
    _check_exchange("set_capacity", capacity, chunks)
    experts = [(n, m) for n, m in expert_modules(model) if is_expert_parallel(m)]
    if not experts:
        raise ValueError(f"set_capacity: no expert-parallel experts module in {type(model).__name__} "
                         "(shard_experts first)")
    for _, module in experts:
        module.__dict__[_CAPACITY_ATTR] = capacity
        module.__dict__[_CHUNKS_ATTR] = chunks
    return model


# ----------------------------------------------------------------------------------------------- routing

class _Route(NamedTuple):
    send_token: torch.Tensor  # (S,) int64: the token of each sent row (rows grouped by destination rank)
    table: torch.Tensor       # (T, D) int64: the sent rows of each token in rank order, -1 = none
    local_ids: torch.Tensor   # (S, K) int32: top-k expert ids local to the row's destination (sentinel E/ep)
    send_sizes: list          # rows sent to each rank
    recv_sizes: list          # rows received from each rank


def _route(top_k_index: torch.Tensor, num_local: int, group) -> _Route:
    ep_size = dist.get_world_size(group)
    T, K = top_k_index.shape
    dev = top_k_index.device
    index = top_k_index.long()
    valid = (index >= 0) & (index < num_local * ep_size)  # an index outside [0, E) is skipped, as by the kernel
    dest = torch.where(valid, torch.div(index, num_local, rounding_mode="floor"), ep_size)
    member = torch.zeros(T, ep_size + 1, dtype=torch.bool, device=dev).scatter_(1, dest, True)[:, :ep_size]
    m = member.long()
    send_counts = m.sum(0)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    sizes = torch.cat([send_counts, recv_counts]).tolist()  # the host sync: split sizes for the all-to-alls
    send_sizes, recv_sizes = sizes[:ep_size], sizes[ep_size:]
    S = sum(send_sizes)
    # the send row of (t, r): rows grouped by rank r, tokens in order within a rank
    row = (torch.cumsum(send_counts, 0) - send_counts) + (torch.cumsum(m, 0) - m)
    send_token = torch.empty(S + 1, dtype=torch.long, device=dev)  # slot S collects the non-members
    tokens = torch.arange(T, device=dev)[:, None].expand(T, ep_size)
    send_token.scatter_(0, torch.where(member, row, S).reshape(-1), tokens.reshape(-1))
    send_token = send_token[:S]
    width = min(K, ep_size)  # a token has at most this many rows
    table = torch.full((T, width + 1), -1, dtype=torch.long, device=dev)  # column `width` collects non-members
    table.scatter_(1, torch.where(member, torch.cumsum(m, 1) - 1, width), torch.where(member, row, -1))
    send_rank = torch.repeat_interleave(torch.arange(ep_size, device=dev), send_counts, output_size=S)
    ids = index.index_select(0, send_token) - send_rank[:, None] * num_local
    local_ids = torch.where((ids >= 0) & (ids < num_local), ids, num_local).to(torch.int32)
    return _Route(send_token, table[:, :width].contiguous(), local_ids, send_sizes, recv_sizes)


def _sum_rows(rows: torch.Tensor, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """out[t] = sum of rows[table[t, s]] over the entries >= 0: one gather into (T, D, H), the empty entries
    zeroed, a sum over D accumulated in fp32 (fixed order: deterministic, unlike index_add_'s atomics)."""
    (T, D), H = table.shape, rows.shape[1]
    if rows.shape[0] == 0:
        return rows.new_zeros((T, H), dtype=dtype)
    gathered = rows.index_select(0, table.clamp(min=0).reshape(-1)).view(T, D, H)
    gathered.masked_fill_((table < 0)[:, :, None], 0)
    return torch.sum(gathered, dim=1, dtype=torch.float32).to(dtype)


class _GatherRows(torch.autograd.Function):
    """rows = x[send_token]; the backward sums each token's row gradients (fp32, rank order: deterministic)."""

    @staticmethod
    def forward(ctx, x, send_token, table):
        ctx.save_for_backward(table)
        ctx.dtype = x.dtype
        return x.index_select(0, send_token)

    @staticmethod
    def backward(ctx, grad):
        (table,) = ctx.saved_tensors
        return _sum_rows(grad, table, ctx.dtype), None, None


class _SumRows(torch.autograd.Function):
    """out[t] = sum of the token's rows (fp32, rank order); the backward hands each row its token's gradient."""

    @staticmethod
    def forward(ctx, rows, send_token, table, dtype):
        ctx.save_for_backward(send_token)
        ctx.rows_dtype = rows.dtype
        return _sum_rows(rows, table, dtype)

    @staticmethod
    def backward(ctx, grad):
        (send_token,) = ctx.saved_tensors
        return grad.index_select(0, send_token).to(ctx.rows_dtype), None, None, None


# ----------------------------------------------------------------------------------------------- exchanges

class _RowFormat(NamedTuple):
    """Several row-aligned fields side by side in one uint8 row (each starts _ALIGN-aligned, so that its bytes can
    be viewed back as its dtype): one all-to-all moves them all."""
    starts: tuple     # byte offset of each field in a row
    widths: tuple     # bytes of each field
    dtypes: tuple
    row_bytes: int

    @staticmethod
    def of(parts) -> "_RowFormat":
        """The format of tensors whose last dimension is the field (the leading dimensions are the rows)."""
        starts, widths, row_bytes = [], [], 0
        for p in parts:
            starts.append(row_bytes)
            widths.append(p.shape[-1] * p.element_size())
            row_bytes += -(-widths[-1] // _ALIGN) * _ALIGN
        return _RowFormat(tuple(starts), tuple(widths), tuple(p.dtype for p in parts), row_bytes)

    def pack(self, rows: torch.Tensor, parts) -> None:
        """Write the fields into `rows` (..., row_bytes); each part broadcasts to rows' leading dimensions."""
        if rows.numel():  # (an empty gradient may come as a stride-0 expansion, which has no byte view)
            for p, start, width in zip(parts, self.starts, self.widths):
                rows[..., start:start + width] = p.contiguous().view(torch.uint8)

    def unpack(self, rows: torch.Tensor) -> list:
        """Views of the fields of `rows` (..., row_bytes)."""
        return [rows[..., start:start + width].view(dtype)
                for start, width, dtype in zip(self.starts, self.widths, self.dtypes)]


def _exchange(parts, send_sizes, recv_sizes, group):
    """One all_to_all_single of several (rows, field) tensors packed side by side as bytes; returns views."""
    fmt = _RowFormat.of(parts)
    send = parts[0].new_empty((parts[0].shape[0], fmt.row_bytes), dtype=torch.uint8)
    fmt.pack(send, parts)
    recv = send.new_empty((sum(recv_sizes), fmt.row_bytes))
    dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
    return fmt.unpack(recv)


class _Dispatch(torch.autograd.Function):
    """Rows to their destination ranks: hidden states, top-k weights and local expert ids in one all-to-all;
    the backward returns the hidden-state and weight gradients in one all-to-all."""

    @staticmethod
    def forward(ctx, hidden_rows, weight_rows, local_ids, send_sizes, recv_sizes, group):
        ctx.sizes, ctx.group = (send_sizes, recv_sizes), group
        hidden, weights, ids = _exchange([hidden_rows, weight_rows, local_ids], send_sizes, recv_sizes, group)
        ctx.mark_non_differentiable(ids)
        ctx.set_materialize_grads(False)  # no zero gradient filled for the expert ids
        ctx.outputs = [(x.shape, x.dtype, x.device) for x in (hidden, weights)]  # for an unused output's zeros
        return hidden, weights, ids

    @staticmethod
    def backward(ctx, d_hidden, d_weights, _d_ids):
        send_sizes, recv_sizes = ctx.sizes
        d_hidden, d_weights = (d if d is not None else torch.zeros(shape, dtype=dtype, device=device)
                               for d, (shape, dtype, device) in zip((d_hidden, d_weights), ctx.outputs))
        d_hidden_rows, d_weight_rows = _exchange([d_hidden, d_weights], recv_sizes, send_sizes, ctx.group)
        return d_hidden_rows, d_weight_rows, None, None, None, None


class _Return(torch.autograd.Function):
    """The experts' output rows back to the tokens' ranks (the backward: their gradients out again)."""

    @staticmethod
    def forward(ctx, rows, send_sizes, recv_sizes, group):
        ctx.sizes, ctx.group = (send_sizes, recv_sizes), group
        out = rows.new_empty((sum(recv_sizes), rows.shape[1]))
        dist.all_to_all_single(out, rows.contiguous(), recv_sizes, send_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        send_sizes, recv_sizes = ctx.sizes
        out = grad.new_empty((sum(send_sizes), grad.shape[1]))
        dist.all_to_all_single(out, grad.contiguous(), send_sizes, recv_sizes, group=ctx.group)
        return out, None, None, None


def _connected(out_rows, hidden, weights, gate_up_proj, down_proj):
    """The local experts' output rows, connected to the received tensors and the local experts where the experts
    left them out of the graph (a rank that received no rows; HF's loop when no row reached a local expert), so
    that this rank's backward runs the reverse all-to-all like the others and its experts get a (zero) gradient
    like on every data-parallel peer."""
    if out_rows.requires_grad or not torch.is_grad_enabled():
        return out_rows
    zero = hidden.sum() + weights.sum() + gate_up_proj.sum() + down_proj.sum()
    return out_rows + (zero * 0).to(out_rows.dtype)


def experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor, local_experts, fused: bool = False) -> torch.Tensor:
    """The expert-parallel forward of one experts module (see the module docstring). `local_experts(hidden,
    top_k_index, top_k_weights, gate_up_proj, down_proj)` computes this rank's experts on the received rows;
    fused: it is `moe_experts` (the chunked pipeline calls that op's implementations itself; any other local
    experts, e.g. HF's loop, run the one-chunk exchange)."""
    group, num_local = _ep_layout(module)
    gate_up_proj, down_proj = module.gate_up_proj.to_local(), module.down_proj.to_local()
    if gate_up_proj.shape[0] != num_local:
        raise ValueError(f"expert parallelism: {type(module).__name__} holds {gate_up_proj.shape[0]} local experts, "
                         f"expected {num_local} (uneven sharding)")
    if hidden_states.dim() != 2 or top_k_index.dim() != 2 or top_k_index.shape != top_k_weights.shape \
            or top_k_index.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"expert parallelism: expected hidden_states (T, H), top_k_index and top_k_weights (T, K), "
                         f"got {tuple(hidden_states.shape)}, {tuple(top_k_index.shape)}, {tuple(top_k_weights.shape)}")
    E = num_local * dist.get_world_size(group)
    check_range(top_k_index, 0, E + 1, f"expert parallelism: top_k_index values must be in [0, {E}) or equal {E} "
                "(the expert-parallel skip sentinel)")
    capacity, chunks = module.__dict__.get(_CAPACITY_ATTR), module.__dict__.get(_CHUNKS_ATTR, 1)
    if capacity is not None and fused:
        return _fused_fixed_capacity_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
                                             num_local, capacity, chunks, group)
    if capacity is not None:
        return _fixed_capacity_forward(hidden_states, top_k_index, top_k_weights, num_local, capacity, group,
                                       lambda h, i, w: _connected(local_experts(h, i, w, gate_up_proj, down_proj),
                                                                  h, w, gate_up_proj, down_proj))
    route = _route(top_k_index, num_local, group)
    hidden_rows = _GatherRows.apply(hidden_states, route.send_token, route.table)
    weight_rows = _GatherRows.apply(top_k_weights, route.send_token, route.table)
    hidden, weights, ids = _Dispatch.apply(hidden_rows, weight_rows, route.local_ids, route.send_sizes,
                                           route.recv_sizes, group)
    if hidden.shape[0]:
        out_rows = local_experts(hidden, ids, weights, gate_up_proj, down_proj)
    else:
        out_rows = hidden.new_zeros((0, hidden.shape[1]))
    out_rows = _connected(out_rows, hidden, weights, gate_up_proj, down_proj)
    back = _Return.apply(out_rows, route.recv_sizes, route.send_sizes, group)
    return _SumRows.apply(back, route.send_token, route.table, out_rows.dtype)


def _local_ids(global_ids: torch.Tensor, first, num_local: int) -> torch.Tensor:
    """int32 expert ids local to the rank whose experts start at `first` (a tensor broadcasts over ranks); the
    experts of other ranks (and the padding's id E) become the sentinel num_local."""
    ids = global_ids.long() - first
    return torch.where((ids >= 0) & (ids < num_local), ids, num_local).to(torch.int32)


_LOCAL_ID_TABLES: dict = {}


def _local_ids_on_rank(global_ids: torch.Tensor, rank: int, num_local: int, ep_size: int) -> torch.Tensor:
    """`_local_ids(global_ids, rank * num_local, num_local)` in one gather from a cached (ep * num_local + 1,)
    int32 table (global id, or the padding's id E -> local id or the sentinel), instead of six elementwise ops a
    call. The ids must be in [0, E] (checked where the caller's top_k_index came in). Outside a CUDA-graph
    capture only (a table created during one would be written only by the graph's replays)."""
    key = (global_ids.device, rank, num_local, ep_size)
    table = _LOCAL_ID_TABLES.get(key)
    if table is None:
        if capturing(global_ids.device):
            return _local_ids(global_ids, rank * num_local, num_local)
        table = _local_ids(torch.arange(ep_size * num_local + 1, device=global_ids.device), rank * num_local,
                           num_local)
        _LOCAL_ID_TABLES[key] = table
    return table[global_ids]


def _destination_ids(top_k_index: torch.Tensor, ep_size: int, num_local: int) -> torch.Tensor:
    """(ep, T, K) int32: each token's top-k expert ids local to each destination rank (others: the sentinel)."""
    first = torch.arange(ep_size, device=top_k_index.device)[:, None, None] * num_local
    return _local_ids(top_k_index[None], first, num_local)


def _check_capacity(tokens: int, capacity: int) -> None:
    if tokens > capacity:
        raise ValueError(f"expert parallelism: {tokens} tokens in this call exceed the fixed capacity {capacity} "
                         "(set_capacity / shard_experts(capacity=)); raise it to the largest micro-batch")


def _fixed_capacity_forward(hidden_states, top_k_index, top_k_weights, num_local: int, capacity: int, group,
                            local_experts):
    """The sync-free exchange: every token to every rank, C rows per destination (tokens past T: zeros with the
    sentinel), ids local to the destination (others: the sentinel). The sum over destinations of the returned
    partial outputs (fp32, rank order) is the token's output; autograd sums the rows' gradients back likewise."""
    ep_size = dist.get_world_size(group)
    (T, K), H = top_k_index.shape, hidden_states.shape[1]
    _check_capacity(T, capacity)
    pad = capacity - T
    ids = _destination_ids(top_k_index, ep_size, num_local)
    ids = torch.nn.functional.pad(ids, (0, 0, 0, pad), value=num_local).reshape(ep_size * capacity, K)
    hidden_rows = torch.nn.functional.pad(hidden_states, (0, 0, 0, pad))[None].expand(ep_size, capacity, H)
    weight_rows = torch.nn.functional.pad(top_k_weights, (0, 0, 0, pad))[None].expand(ep_size, capacity, K)
    sizes = [capacity] * ep_size
    hidden, weights, ids = _Dispatch.apply(hidden_rows.reshape(-1, H), weight_rows.reshape(-1, K), ids, sizes,
                                           sizes, group)
    out_rows = local_experts(hidden, ids, weights)
    back = _Return.apply(out_rows, sizes, sizes, group).view(ep_size, capacity, H)[:, :T]
    return torch.sum(back, dim=0, dtype=torch.float32).to(out_rows.dtype)


# ------------------------------------------------------------------------- fixed capacity, fused local experts
#
# The fixed exchange sends every token to every rank, so its two "every rank gets the same rows" directions are
# all-gathers: the dispatch (hidden state, top-k weights, global expert ids; each rank maps the ids to its own
# local ones) and, in the backward, the output's gradient. The rows are packed once per call, not once per
# destination. The other two directions carry per-destination rows and stay all-to-alls: the experts' partial
# outputs back to their tokens' ranks, and in the backward their input gradients. The sums over source ranks are
# fp32 in rank order, as in `_fixed_capacity_forward`.
#
# The call's T tokens go in `chunks` consecutive pieces (sizes differ by at most one), each padded to
# R = ceil(C / chunks) rows (R >= every piece, since T <= C): static sizes, no host sync. Forward: every chunk's
# dispatch is issued up front (async: the collectives queue on the communicator's stream); chunk c waits for its
# own (the compute stream waits, not the host), runs the local experts and issues its return. So chunk c + 1's
# dispatch runs under chunk c's expert GEMMs and chunk c's return under chunk c + 1's. Autograd would not order
# the reverse exchanges so, hence one autograd.Function whose backward runs the same pipeline in reverse: the
# output gradients of every chunk gathered at once, then per chunk its wait and its experts' backward, whose
# input gradients leave (all-to-all) as soon as they exist, under the gate_up weight-grad GEMM
# (`_experts_bwd(on_input_grads=)`): with one chunk too, that GEMM hides part of the exchange. The experts are
# the fused op's implementations (`ops._experts_fwd` / `_experts_bwd`); what each chunk's backward needs is saved
# with the Function's own save_for_backward, so activation checkpointing frees it and recomputes the whole
# pipeline once.

class _Pipeline(NamedTuple):
    num_local: int
    ep_size: int
    rank: int      # this rank's index in the EP group
    rows: int      # R: rows per chunk and source rank
    spans: tuple   # (first token, tokens) of each chunk
    group: object


def _pipeline(tokens: int, num_local: int, capacity: int, chunks: int, group) -> _Pipeline:
    base, extra = divmod(tokens, chunks)
    counts = [base + (c < extra) for c in range(chunks)]
    spans = tuple((sum(counts[:c]), n) for c, n in enumerate(counts))
    return _Pipeline(num_local, dist.get_world_size(group), dist.get_rank(group), -(-capacity // chunks), spans,
                     group)


def _gather_chunks(pipe: _Pipeline, fmt: _RowFormat, chunk_parts, pad_parts, device):
    """Pack each chunk (chunk_parts(first, tokens): (tokens, ·) fields; pad_parts(): one padding row's (1, ·)
    fields, built only if a chunk has fewer tokens than R) into (R, row_bytes) and issue its all-gather over the EP
    group (before packing the next); returns (recv, works): recv (chunks, ep * R, row_bytes), chunk c's rows
    grouped by source rank once works[c] is waited."""
    send = torch.empty((len(pipe.spans), pipe.rows, fmt.row_bytes), dtype=torch.uint8, device=device)
    recv = torch.empty((len(pipe.spans), pipe.ep_size * pipe.rows, fmt.row_bytes), dtype=torch.uint8,
                       device=send.device)
    works = []
    pad = None
    for c, (first, n) in enumerate(pipe.spans):
        fmt.pack(send[c, :n], chunk_parts(first, n))
        if n < pipe.rows:
            pad = pad or pad_parts()
            fmt.pack(send[c, n:], pad)
        works.append(_all_gather(recv[c], send[c], group=pipe.group, async_op=True))
    return recv, works


def _sum_over_ranks(pipe: _Pipeline, rows: torch.Tensor, c: int, dtype: torch.dtype) -> torch.Tensor:
    """Chunk c's tokens from (ep * R, X) rows grouped by rank: the sum over ranks (fp32, rank order)."""
    n = pipe.spans[c][1]
    return torch.sum(rows.view(pipe.ep_size, pipe.rows, -1)[:, :n], dim=0, dtype=torch.float32).to(dtype)


def _pipelined_forward(pipe: _Pipeline, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
                       saved: list | None):
    """The forward pipeline; `saved` (unless None) gets each chunk's tensors for `_experts_bwd`."""
    K, H = top_k_index.shape[1], hidden_states.shape[1]
    fields = [hidden_states, top_k_weights, top_k_index.to(torch.int32)]
    fmt = _RowFormat.of(fields)
    recv, dispatches = _gather_chunks(
        pipe, fmt, lambda first, n: [f[first:first + n] for f in fields],
        lambda: [hidden_states.new_zeros(1, H), top_k_weights.new_zeros(1, K),
                 fields[2].new_full((1, K), pipe.num_local * pipe.ep_size)], hidden_states.device)
    returns = []
    for c, work in enumerate(dispatches):
        work.wait()
        hidden, weights, global_ids = fmt.unpack(recv[c])
        hidden, weights = hidden.contiguous(), weights.contiguous()
        local_ids = _local_ids_on_rank(global_ids, pipe.rank, pipe.num_local, pipe.ep_size)
        _check_inputs(hidden, local_ids, weights, gate_up_proj, down_proj)
        # the ids' range was checked on the way in (experts_forward); the table maps them into [0, num_local]
        out, *state = _experts_fwd(hidden, local_ids, weights, gate_up_proj, down_proj, check_ids=False)
        if saved is not None:
            saved.append((hidden, local_ids, weights, *state))
        back = torch.empty_like(out)
        returns.append((dist.all_to_all_single(back, out, group=pipe.group, async_op=True), back))
    outs = []
    for c, (work, back) in enumerate(returns):
        work.wait()
        outs.append(_sum_over_ranks(pipe, back, c, back.dtype))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


class _PipelinedExperts(torch.autograd.Function):
    """Exchange + local experts + exchange back, pipelined in chunks, forward and backward (see above)."""

    @staticmethod
    def forward(ctx, hidden_states, top_k_weights, gate_up_proj, down_proj, top_k_index, pipe):
        saved = []
        out = _pipelined_forward(pipe, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, saved)
        ctx.save_for_backward(gate_up_proj, down_proj, *(t for chunk in saved for t in chunk))
        ctx.pipe, ctx.backpropagated = pipe, False
        ctx.grad_rows = _RowFormat.of([hidden_states, top_k_weights])  # their gradients' rows on the way back
        return out

    @staticmethod
    @first_order("expert parallelism")
    def backward(ctx, d_out):
        if ctx.backpropagated:  # the Triton backward overwrites a saved buffer (as the moe_experts op declares)
            raise RuntimeError("expert parallelism: the fixed-capacity exchange with the fused experts was already "
                               "backpropagated once; a second backward through the same graph (retain_graph=True) "
                               "is not supported")
        ctx.backpropagated = True
        pipe, fmt = ctx.pipe, ctx.grad_rows
        gate_up_proj, down_proj, *flat = ctx.saved_tensors
        per_chunk = len(flat) // len(pipe.spans)
        saved = [flat[c * per_chunk:(c + 1) * per_chunk] for c in range(len(pipe.spans))]
        d_out = d_out.to(gate_up_proj.dtype)
        # the returns' gradients: every rank that computed a chunk's rows gets the same d_out rows of the chunk
        d_fmt = _RowFormat.of([d_out])
        d_recv, gathers = _gather_chunks(pipe, d_fmt, lambda first, n: [d_out[first:first + n]],
                                         lambda: [d_out.new_zeros(1, d_out.shape[1])], d_out.device)
        # the expert weights' gradients summed over the chunks in fp32, cast at the end; two chunks: their sum in
        # the weights' dtype is that already (an elementwise add rounds its fp32 result once), with no fp32 copy
        sum_dtype = torch.float32 if len(pipe.spans) > 2 else None
        sums = [None, None]
        sent = []

        def send_input_grads(d_hidden, d_weights):
            rows = torch.empty((pipe.ep_size * pipe.rows, fmt.row_bytes), dtype=torch.uint8, device=d_out.device)
            fmt.pack(rows, [d_hidden, d_weights])
            back = torch.empty_like(rows)
            sent.append((dist.all_to_all_single(back, rows, group=pipe.group, async_op=True), back))

        for c, work in enumerate(gathers):
            work.wait()
            hidden, local_ids, weights, *state = saved[c]
            d_rows = d_fmt.unpack(d_recv[c])[0].contiguous()
            _, _, *d_experts = _experts_bwd(d_rows, hidden, local_ids, weights, gate_up_proj, down_proj, *state,
                                            on_input_grads=send_input_grads)
            sums = [g.to(sum_dtype or g.dtype) if total is None else total.add_(g) for total, g in zip(sums, d_experts)]
        d_inputs = [[], []]  # the hidden states' and the top-k weights' gradients, chunk by chunk
        for c, (work, back) in enumerate(sent):
            work.wait()
            for d, rows, dtype in zip(d_inputs, fmt.unpack(back), fmt.dtypes):
                d.append(_sum_over_ranks(pipe, rows, c, dtype))
        d_gate_up, d_down = (total.to(w.dtype) if need else None
                             for total, w, need in zip(sums, (gate_up_proj, down_proj), ctx.needs_input_grad[2:4]))
        return (*(d[0] if len(d) == 1 else torch.cat(d) for d in d_inputs), d_gate_up, d_down, None, None)


def _fused_fixed_capacity_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
                                  num_local: int, capacity: int, chunks: int, group) -> torch.Tensor:
    """The fixed-capacity exchange around the fused local experts, in `chunks` pieces (see above)."""
    _check_capacity(top_k_index.shape[0], capacity)
    hidden_states, gate_up_proj, down_proj = _autocast_inputs(hidden_states, gate_up_proj, down_proj)
    pipe = _pipeline(top_k_index.shape[0], num_local, capacity, chunks, group)
    inputs = (hidden_states, top_k_weights, gate_up_proj, down_proj)
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return _PipelinedExperts.apply(*inputs, top_k_index, pipe)
    return _pipelined_forward(pipe, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, None)


__all__ = ["shard_experts", "set_capacity", "expert_modules", "is_expert_parallel", "experts_forward"]
