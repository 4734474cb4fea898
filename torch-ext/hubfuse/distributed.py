"""FSDP2 (and expert parallelism) for hubfuse-kernelized models, and HF-format checkpoints of the sharded model.

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from hubfuse import distributed, presets

    mesh = init_device_mesh("cuda", (dp, ep), mesh_dim_names=("dp", "ep"))  # or (world,): FSDP2 without EP
    model = ...kernelized from_pretrained on every rank...
    presets.enable_losses(model, "qwen3_moe", aux_loss_group=dist.group.WORLD)
    moe.shard_experts(model, mesh["ep"])                 # the moe kernel (get_kernel("hubfuse/moe"))
    distributed.shard_embedding(model, mesh, tokens_per_rank=batch * seq)  # optional: the embedding out of FSDP
    distributed.fully_shard_model(model, mesh, mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    optimizer = torch.optim.AdamW(model.parameters(), ...)
    ...
    distributed.save_pretrained(model, out_dir)          # every rank calls it; rank 0 writes the HF checkpoint

Only engines from torch: `fully_shard`, DeviceMesh, `torch.distributed.checkpoint.state_dict`. Nothing here
imports transformers; the kernels need nothing from this module (it is the recipe, as code).
"""
from __future__ import annotations

from types import MethodType

import torch
import torch.distributed as dist
from torch import nn

from ._common.checks import check_range, first_order
from ._common.collectives import all_gather_single, reduce_scatter_single


def _ep_experts(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Experts modules whose parameters are sharded over an EP mesh (moe.shard_experts, or transformers' EP plan)."""
    from torch.distributed.tensor import DTensor

    return [(name, m) for name, m in module.named_modules()
            if isinstance(m._parameters.get("gate_up_proj"), DTensor)
            and not hasattr(m, "_get_fsdp_state")]  # not yet wrapped by fully_shard


def _has_routed_experts(model: nn.Module) -> bool:
    """Whether the model has routed-experts modules in the transformers v5 layout (3-D `gate_up_proj`)."""
    return any(name.rsplit(".", 1)[-1] == "gate_up_proj" and p.dim() == 3 for name, p in model.named_parameters())


def decoder_layers(model: nn.Module):
    """The decoder layers of a transformers causal LM (`model.model.layers`)."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"fully_shard_model: {type(model).__name__} has no decoder layers at model.model.layers")
    return layers


def _flattened(mesh, dims: tuple[str, ...]):
    """`mesh`'s dims `dims` (2-D callers) as one 1-D mesh. Flattening again under the same name returns the
    earlier mesh (torch 2.13); slicing it back out of the root by name (`mesh[name]`) is deprecated and warns,
    so it is only the fallback."""
    name = "_".join(dims)
    try:
        return mesh[tuple(dims)]._flatten(name)
    except (RuntimeError, ValueError):  # a torch that refuses to flatten under the same name twice
        return mesh[name]


def fully_shard_model(model: nn.Module, mesh, *, ep_dim: str = "ep", mp_policy=None, offload_policy=None,
                      reshard_after_forward: bool = True, layers_per_unit: int = 1,
                      head_unit: bool = True) -> nn.Module:
    """FSDP2 over a (kernelized) causal LM: each decoder layer (or each run of `layers_per_unit` consecutive
    layers, one FSDP unit: fewer hooks and collectives a step, more parameters unsharded at once), then `lm_head`
    (`head_unit`, unless its weight is tied to the embeddings), then the root (embeddings, final norm). Returns the
    model. The mesh must cover every rank of the world (ValueError otherwise).

    Qwen3-30B-A3B widths under EP 4 (docs/benchmarks.md, scale-out): `layers_per_unit=8` took the host out of the
    step's way (8 layers 6 % faster, 48 layers 10 %) for the parameters of 8 layers unsharded at once.

    `lm_head` as its own unit (the fused loss calls it, so its hooks run): its gradient exists as soon as the
    backward starts (the fused loss computes it in the forward), so its reduce-scatter runs under the decoder
    layers' backward instead of after the whole backward with the root's; its all-gather is issued when the
    host reaches it, ahead of the GPU. It is not resharded after the forward (the backward would gather it again
    only to receive a gradient computed already): the same memory as inside the root, which FSDP2 never reshards.

    mesh: a 1-D DeviceMesh: every parameter is sharded over all its ranks. Or a 2-D mesh with dims (dp, `ep_dim`)
    after `moe.shard_experts(model, mesh[ep_dim])`: the dense parameters are sharded over all dp x ep ranks (the
    flattened mesh); each expert-parallel experts module gets its own `fully_shard` over mesh[dp] (its dim-0
    slices further sharded: 2-D DTensors), with the gradient divide factor dp x ep, because its gradient is a
    sum over the EP group (moe.expert_parallel), reduced as a sum (`set_force_sum_reduction_for_comms`: gloo
    has no pre-multiplied sum) when dp > 1. With dp = 1 (every expert on one rank) and no offload or dtype cast
    for FSDP to do, the experts stay out of FSDP (`ignored_params`), their gradients divided by dp x ep by a
    hook: a one-rank FSDP group would copy every expert weight and gradient at every step. `mp_policy`,
    `offload_policy`, `reshard_after_forward` go to every layer's `fully_shard` (the root keeps FSDP2's default).
    """
    from torch.distributed.fsdp import fully_shard

    if isinstance(layers_per_unit, bool) or not isinstance(layers_per_unit, int):
        raise TypeError(f"fully_shard_model: layers_per_unit must be an int, got {type(layers_per_unit).__name__}")
    if layers_per_unit < 1:
        raise ValueError(f"fully_shard_model: layers_per_unit must be >= 1, got {layers_per_unit}")
    if not isinstance(head_unit, bool):
        raise TypeError(f"fully_shard_model: head_unit must be a bool, got {type(head_unit).__name__}")

    kw = {}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    if offload_policy is not None:
        kw["offload_policy"] = offload_policy
    layers = decoder_layers(model)
    if dist.is_initialized() and mesh.size() != dist.get_world_size():
        raise ValueError(f"fully_shard_model: the mesh has {mesh.size()} ranks (shape {tuple(mesh.shape)}) but the "
                         f"world has {dist.get_world_size()} processes; the mesh must cover every rank (one model "
                         "replica, its gradients reduced over all ranks)")
    experts = _ep_experts(model)
    if mesh.ndim == 1:
        if experts:
            raise ValueError(f"fully_shard_model: {experts[0][0]} is sharded over an expert-parallel mesh; pass "
                             f"the 2-D (dp, {ep_dim!r}) mesh whose {ep_dim!r} dimension it uses")
        dense_mesh, expert_mesh = mesh, None
    elif mesh.ndim == 2:
        names = mesh.mesh_dim_names or ()
        if ep_dim not in names:
            raise ValueError(f"fully_shard_model: a 2-D mesh needs an {ep_dim!r} dimension (ep_dim), got {names}")
        dp_dim = names[1 - names.index(ep_dim)]
        ep_mesh = mesh[ep_dim]
        for name, module in experts:
            if module.gate_up_proj.device_mesh != ep_mesh:
                raise ValueError(f"fully_shard_model: {name} is sharded over {module.gate_up_proj.device_mesh}, "
                                 f"not over this mesh's {ep_dim!r} dimension {ep_mesh} (mismatched process groups)")
        if ep_mesh.size() > 1 and not _has_routed_experts(model):
            raise ValueError(f"fully_shard_model: the mesh has {ep_dim!r} size {ep_mesh.size()} but "
                             f"{type(model).__name__} has no routed experts (3-D gate_up_proj parameters): expert "
                             "parallelism needs an MoE model; use a 1-D mesh for a dense model")
        if ep_mesh.size() > 1 and not experts:
            raise ValueError(f"fully_shard_model: the mesh has {ep_dim!r} size {ep_mesh.size()} but no experts are "
                             f"sharded over it: call moe.shard_experts(model, mesh[{ep_dim!r}]) first")
        dense_mesh, expert_mesh = _flattened(mesh, names), mesh[dp_dim]
    else:
        raise ValueError(f"fully_shard_model: mesh must be 1-D (dp) or 2-D (dp, {ep_dim!r}), got {mesh.ndim}-D")
    unwrapped = set()  # expert parameters left out of FSDP (one rank per expert: nothing to shard or reduce)
    for layer in layers:
        for _, module in _ep_experts(layer):
            if expert_mesh.size() == 1 and _plain_experts_fit(module, mp_policy, offload_policy):
                _average_gradients(module, float(mesh.size()))
                unwrapped.update(module.parameters())
                continue
            fully_shard(module, mesh=expert_mesh, reshard_after_forward=reshard_after_forward, **kw)
            module.set_gradient_divide_factor(float(mesh.size()))
            if expert_mesh.size() > 1:
                # a plain sum, then the division (gloo has no pre-multiplied sum). Not with one rank per expert
                # (dp 1): torch 2.13's FSDP2 then divides twice (its copy for a 1-rank group and the post-divide)
                module.set_force_sum_reduction_for_comms(True)
    for first in range(0, len(layers), layers_per_unit):
        unit = list(layers[first:first + layers_per_unit])
        fully_shard(unit[0] if len(unit) == 1 else unit, mesh=dense_mesh, reshard_after_forward=reshard_after_forward,
                    ignored_params=unwrapped & {p for m in unit for p in m.parameters()}, **kw)
    head = _untied_head(model) if head_unit else None
    if head is not None:
        fully_shard(head, mesh=dense_mesh, reshard_after_forward=False, **kw)
    embedding = model.get_input_embeddings()
    if getattr(embedding, _ROW_SHARDED, None) is not None:  # shard_embedding: its own exchange, out of FSDP
        unwrapped.add(embedding.weight)
    fully_shard(model, mesh=dense_mesh, ignored_params=unwrapped, **kw)
    return model


_ROW_SHARDED = "_hubfuse_row_sharded"  # on an embedding module: (process group, capacity) of shard_embedding


def shard_embedding(model: nn.Module, mesh, tokens_per_rank: int) -> nn.Module:
    """Shard the input embedding's rows over every rank of `mesh` (call it before `fully_shard_model`, which then
    leaves the embedding out of FSDP), and look tokens up where their rows live. Returns the model.

    Under FSDP the embedding (151936 x 2048 in Qwen3-30B-A3B, 0.6 GB in bf16) is all-gathered whole at the start of
    the forward, and its dense gradient (1.2 GB in fp32) reduce-scattered after the whole backward, where nothing
    is left to hide it under. Here rank r keeps rows [r * ceil(V / n), ...) as a DTensor `Shard(0)` over the
    (flattened) mesh, so the optimizer, `state_dict()` and checkpoints see the original parameter, and one call
    moves token-sized tensors instead:
    - forward: the token ids are all-gathered, each rank looks up the rows it owns for every rank's tokens (zero
      rows elsewhere), and one reduce-scatter of (n x tokens_per_rank, hidden) gives each rank its own tokens'
      rows. Each row has one nonzero contribution, so the sum is exact: the output equals `nn.Embedding`'s bit
      for bit.
    - backward: the output gradients are all-gathered and each rank computes its own rows' gradient over all
      the ranks' tokens (`embedding_dense_backward`, fp32 accumulation as in one process), divided by n: the mean
      over ranks that FSDP's gradient reduction gives the other parameters.

    Every rank's call carries at most `tokens_per_rank` tokens (ValueError otherwise); fewer are padded to it, so
    ranks may hold different token counts and no size crosses to the host (no host sync, static shapes). mesh: the
    mesh given to `fully_shard_model` (1-D, or 2-D (dp, ep): its ranks flattened), covering every rank. The
    embedding must be a plain `nn.Embedding` (`model.get_input_embeddings()`) whose weight no other module shares:
    a head tied to it needs the whole matrix (ValueError).
    """
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    if isinstance(tokens_per_rank, bool) or not isinstance(tokens_per_rank, int) or tokens_per_rank < 1:
        raise ValueError(f"shard_embedding: tokens_per_rank must be a positive int, got {tokens_per_rank!r}")
    if dist.is_initialized() and mesh.size() != dist.get_world_size():
        raise ValueError(f"shard_embedding: the mesh has {mesh.size()} ranks (shape {tuple(mesh.shape)}) but the "
                         f"world has {dist.get_world_size()} processes; the mesh must cover every rank")
    if mesh.ndim == 2:
        mesh = _flattened(mesh, mesh.mesh_dim_names)
    elif mesh.ndim != 1:
        raise ValueError(f"shard_embedding: mesh must be 1-D or 2-D, got {mesh.ndim}-D")
    embedding = model.get_input_embeddings()
    if type(embedding) is not nn.Embedding:
        raise ValueError(f"shard_embedding: {type(model).__name__}'s input embedding is "
                         f"{type(embedding).__name__}, not a plain nn.Embedding")
    if getattr(embedding, _ROW_SHARDED, None) is not None or isinstance(embedding.weight, DTensor):
        raise ValueError("shard_embedding: the input embedding is sharded already")
    if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
        raise ValueError("shard_embedding: max_norm, scale_grad_by_freq and sparse embeddings are not supported")
    weight = embedding.weight
    if weight.shape[0] < mesh.size():
        raise ValueError(f"shard_embedding: {weight.shape[0]} embedding rows cannot be shared by {mesh.size()} ranks")
    for name, module in model.named_modules():
        if module is not embedding and any(p is weight for p in module.parameters(recurse=False)):
            raise ValueError(f"shard_embedding: the input embedding's weight is tied to {name or 'the model'}; a "
                             "tied head needs the whole matrix (keep the embedding in FSDP)")
    sharded = distribute_tensor(weight.detach(), mesh, [Shard(0)])
    embedding.weight = nn.Parameter(sharded, requires_grad=weight.requires_grad)
    setattr(embedding, _ROW_SHARDED, (mesh.get_group(), tokens_per_rank))
    embedding.forward = MethodType(_row_sharded_forward, embedding)
    return model


def _row_sharded_forward(self: nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
    group, capacity = getattr(self, _ROW_SHARDED)
    weight = self.weight
    local = weight.to_local()  # differentiable: its gradient comes back as a Shard(0) DTensor
    num_rows, world, rank = weight.shape[0], dist.get_world_size(group), dist.get_rank(group)
    offset = min(rank * -(-num_rows // world), num_rows)  # Shard(0) splits as torch.chunk
    if input_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"shard_embedding: input_ids must be int32 or int64, got {input_ids.dtype}")
    if input_ids.device != local.device:
        raise ValueError(f"shard_embedding: input_ids are on {input_ids.device} but the embedding on {local.device}")
    if input_ids.numel() > capacity:
        raise ValueError(f"shard_embedding: {input_ids.numel()} tokens in this call, more than tokens_per_rank "
                         f"{capacity}")
    check_range(input_ids, 0, num_rows, f"shard_embedding: input_ids must be in [0, {num_rows})")
    rows = _RowShardedEmbedding.apply(input_ids.reshape(-1), local, group, capacity, offset, self.padding_idx)
    return rows.view(*input_ids.shape, local.shape[1])


class _RowShardedEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, local_weight, group, capacity, offset, padding_idx):
        world, tokens = dist.get_world_size(group), ids.numel()
        num_local, hidden = local_weight.shape
        send = ids.new_full((capacity,), -1)  # padding: an id no rank owns
        send[:tokens] = ids
        every = ids.new_empty(world * capacity)
        all_gather_single(every, send, group=group)
        index = every - offset
        foreign = (index < 0) | (index >= num_local)
        rows = nn.functional.embedding(index.clamp(0, num_local - 1), local_weight)
        rows.masked_fill_(foreign.unsqueeze(1), 0)
        out = rows.new_empty(capacity, hidden)
        reduce_scatter_single(out, rows, group=group)
        ctx.group, ctx.capacity, ctx.num_local = group, capacity, num_local
        # rows this rank does not own go to one spare row, dropped after the backward
        ctx.save_for_backward(index.masked_fill(foreign, num_local))
        local_padding = padding_idx - offset if padding_idx is not None else -1
        ctx.padding_idx = local_padding if 0 <= local_padding < num_local else -1
        return out[:tokens]

    @staticmethod
    @first_order("shard_embedding")
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        world = dist.get_world_size(ctx.group)
        send = grad.new_zeros(ctx.capacity, grad.shape[1])
        send[:grad.shape[0]] = grad
        every = grad.new_empty(world * ctx.capacity, grad.shape[1])
        all_gather_single(every, send, group=ctx.group)
        weight_grad = torch.ops.aten.embedding_dense_backward(every, index, ctx.num_local + 1, ctx.padding_idx,
                                                              False)
        return None, weight_grad[:ctx.num_local].div_(world), None, None, None, None


def _untied_head(model: nn.Module) -> nn.Module | None:
    """`model.lm_head` if it is a module whose parameters no other module of the model shares (untied)."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Module) or not any(True for _ in head.parameters()):
        return None
    own = {id(p) for p in head.parameters()}
    for name, module in model.named_modules(remove_duplicate=False):
        if name == "lm_head" or name.startswith("lm_head."):
            continue
        if any(id(p) in own for p in module.parameters(recurse=False)):
            return None  # tied (e.g. to the input embeddings): one FSDP unit must hold both
    return head


def _plain_experts_fit(module: nn.Module, mp_policy, offload_policy) -> bool:
    """Whether an EP experts module with one rank per expert (dp 1) can stay out of FSDP: its FSDP group would have
    one rank, whose "all-gather" and "reduce-scatter" are copies of every expert weight and gradient (a fp32 copy
    with a reduce dtype) at every step. Only where FSDP has nothing else to do: no CPU offload, and no
    mixed-precision cast (the parameters already in the policy's param dtype)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    if isinstance(offload_policy, CPUOffloadPolicy):
        return False
    dtype = getattr(mp_policy, "param_dtype", None)
    return all(dtype is None or p.dtype == dtype for p in module.parameters())


def _average_gradients(module: nn.Module, factor: float) -> None:
    """What FSDP's gradient divide factor does for an unwrapped experts module: each incoming gradient (a sum over
    the EP group) divided by the data-parallel world before it accumulates into .grad."""
    for p in module.parameters():
        if p.requires_grad:
            p.register_hook(lambda grad, factor=factor: grad / factor)


def fix_single_rank_expert_reduction(model: nn.Module) -> nn.Module:
    """For models sharded by transformers' `from_pretrained(distributed_config=DistributedConfig(fsdp_size=N,
    ep_size=N))` (5.22.2; every expert on one rank, `efsdp` = 1): transformers wraps each experts module with
    gradient divide factor N and a forced sum reduction, and torch 2.13's FSDP2 divides twice on a 1-rank group
    (expert gradients come out N times too small; seen at N = 2 on CPU). This turns the forced sum off where the
    experts' FSDP group has one rank (then FSDP2 divides once). Returns the model."""
    from torch.distributed.tensor import DTensor

    for module in model.modules():
        p = module._parameters.get("gate_up_proj")
        if hasattr(module, "set_force_sum_reduction_for_comms") and isinstance(p, DTensor) \
                and p.device_mesh.ndim == 2 and p.device_mesh.shape[0] == 1:
            module.set_force_sum_reduction_for_comms(False)
    return model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every rank calls it: the full (unsharded) state dict, on the CPU, on rank 0; {} on the other ranks. Keys
    are the model's own (a kernelized model's; `save_pretrained` reverts them to the checkpoint's)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_pretrained(model: nn.Module, directory, **kwargs) -> None:
    """Gather-then-save: every rank calls it, rank 0 writes `model.save_pretrained(directory, state_dict=...)`
    (HF keys and layout of the original architecture; a plain `from_pretrained` loads it). `kwargs` go to
    `save_pretrained`. A model sharded by transformers' `distributed_config` saves through transformers (every
    rank calls its `save_pretrained`, which gathers the same way). For resumable sharded checkpoints use
    torch.distributed.checkpoint instead (docs/distributed.md)."""
    if getattr(getattr(model, "config", None), "distributed_config", None) is not None:
        model.save_pretrained(directory, **kwargs)
        return
    state_dict = full_state_dict(model)
    if dist.get_rank() == 0:
        model.save_pretrained(directory, state_dict=state_dict, **kwargs)
    dist.barrier()


__all__ = ["fully_shard_model", "shard_embedding", "decoder_layers", "fix_single_rank_expert_reduction", "full_state_dict",
           "save_pretrained"]
