"""FSDP2, expert parallelism (EP) and both together over preset-kernelized models, on CPU with gloo.

Every scenario trains tiny fp32 models (tests/utils.tiny_config, aux loss coefficient raised to 0.1 so that it
shows in the gradients) for 3 AdamW steps, each rank on its own micro-batch, with the fused losses and the fused
aux loss reduced over the world (`aux_loss_group`). The reference is one process running the plain HF eager model
on the concatenated global batch: its loss must equal the mean of the ranks' losses at every step, and its
first-step gradients the full (gathered) gradients of the sharded run, within fp32 tolerance.

- 2 processes: FSDP2 alone over Qwen3 / Qwen3-MoE / Qwen3.5-MoE (per-decoder-layer + root, a MixedPrecisionPolicy
  in fp32); EP alone over Qwen3-MoE (2 of 4 experts per rank, no FSDP: dense gradients averaged by hand); EP over
  both ranks + FSDP2 (dp 1 x ep 2: the experts out of FSDP) over Qwen3.5-MoE, also with each rank's rows packed
  into one row (`PACKED`: positions restarting, cu_seq_lens) against the reference's unpacked rows;
  transformers' own `distributed_config` (fsdp 2, ep 2, with `fix_single_rank_expert_reduction`) over Qwen3-MoE.
- 4 processes: dp2 x ep2 (`moe.shard_experts` on mesh["ep"], `hubfuse.distributed.fully_shard_model` on the
  2-D mesh) over Qwen3-MoE and Qwen3.5-MoE; transformers' own `distributed_config` (fsdp 4, ep 2) over Qwen3-MoE,
  with our kernels (their EP forward) instead of its dispatch. After the Qwen3.5-MoE runs (dp2 x ep2, and dp1 x
  ep2 with 2 processes) and the transformers run, checkpoint round trips: `hubfuse.distributed.save_pretrained` writes a checkpoint that plain `from_pretrained`
  loads with the same weights; (Qwen3.5-MoE) a torch.distributed.checkpoint (DCP) save loads back into a freshly
  sharded model.
- Both: the EP exchange on raw tensors against `moe_experts` (routing edge cases; sized and fixed-capacity
  exchange, the latter also pipelined in chunks), EP over all ranks; with 2 processes also the errors for bad
  configurations. The `FIXED_CAPACITY` scenarios run the models with the sync-free exchange (one of them pipelined
  in 2 chunks), the other EP scenarios with the sized one.
- Every scenario: `lm_head`'s forward runs at every step (the fused loss calls it) and FSDP warns about no module
  that skipped its forward.

One process launch per world size runs all of its scenarios (a module-scoped fixture); each test checks one.
The kernels run as Triton under the interpreter in the `INTERPRETED` scenarios, their torch reference elsewhere.
Workers are `python tests/test_distributed.py --worker` processes; rendezvous through a file store in a temporary
directory, gloo bound to the loopback interface, every process killed on timeout.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3
LR = 1e-2
ROWS, SEQ = 2, 12  # micro-batch per rank
AUX_COEF = 0.1
TOL = dict(atol=2e-5, rtol=2e-5)
GRAD_TOL = dict(atol=5e-5, rtol=5e-4)
TIMEOUT_S = 240
FAMILIES = {"qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "qwen3_5_moe": "qwen3_5_moe_text"}  # preset -> tiny config
# name -> (family, world size, ep size, sharding): "fsdp" = hubfuse.distributed.fully_shard_model (after
# moe.shard_experts when ep > 1), "none" = EP only, gradients averaged by hand, "transformers" =
# from_pretrained(distributed_config=DistributedConfig(fsdp_size=world, ep_size=ep)): transformers shards and
# wraps, kernelize then replaces its token-dispatch forward with ours
SCENARIOS = {
    "fsdp2_qwen3": ("qwen3", 2, 1, "fsdp"),
    "fsdp2_qwen3_moe": ("qwen3_moe", 2, 1, "fsdp"),
    "fsdp2_qwen3_5_moe": ("qwen3_5_moe", 2, 1, "fsdp"),
    "ep_qwen3_moe": ("qwen3_moe", 2, 2, "none"),
    "fsdp2_ep_qwen3_5_moe_ep2": ("qwen3_5_moe", 2, 2, "fsdp"),
    "fsdp2_ep_qwen3_5_moe_ep2_packed": ("qwen3_5_moe", 2, 2, "fsdp"),
    "fsdp2_ep_qwen3_moe_ep2_units2": ("qwen3_moe", 2, 2, "fsdp"),
    "transformers_fsdp2_ep2_qwen3_moe": ("qwen3_moe", 2, 2, "transformers"),
    "fsdp2_ep_qwen3_moe": ("qwen3_moe", 4, 2, "fsdp"),
    "fsdp2_ep_qwen3_5_moe": ("qwen3_5_moe", 4, 2, "fsdp"),
    "transformers_fsdp2_ep_qwen3_moe": ("qwen3_moe", 4, 2, "transformers"),
}
# the checkpoint round trips run after these (EP experts + a fused shared expert; transformers' sharding)
CHECKPOINT_SCENARIOS = {"fsdp2_ep_qwen3_5_moe": ("hf", "dcp"), "fsdp2_ep_qwen3_5_moe_ep2": ("hf", "dcp"),
                        "transformers_fsdp2_ep_qwen3_moe": ("hf",)}
# Scenarios whose kernels run as Triton under the interpreter; the others take the kernels' torch reference path
# (TRITON_INTERPRET=0: same ops, dispatch and sharding code, ~5x less time on the CI's 2 cores). The kernels'
# numerics are the kernel and model tests' business; here the sharding and the exchanges are under test.
INTERPRETED = {"fsdp2_qwen3", "fsdp2_ep_qwen3_moe"}
# Scenarios whose experts use the sync-free fixed-capacity exchange (moe.set_capacity, capacity = the micro-batch's
# tokens), name -> its pipeline's chunks (set_capacity(chunks=)); the other EP scenarios use the sized one
FIXED_CAPACITY = {"fsdp2_ep_qwen3_5_moe_ep2": 2, "fsdp2_ep_qwen3_5_moe_ep2_packed": 1,
                  "transformers_fsdp2_ep_qwen3_moe": 1}
# Scenarios whose ranks feed each micro-batch's rows as one packed row (transformers' packing kwargs), against the
# reference's unpacked rows: the Gated DeltaNet layers keep the documents apart by cu_seq_lens, the attention
# layers by the restarting positions, the exchange is per token
PACKED = {"fsdp2_ep_qwen3_5_moe_ep2_packed"}
# Scenarios whose decoder layers go to fully_shard_model in FSDP units of several layers (layers_per_unit)
LAYERS_PER_UNIT = {"fsdp2_ep_qwen3_moe_ep2_units2": 2}
# Scenarios whose input embedding is row-sharded by hubfuse.distributed.shard_embedding (out of FSDP), name ->
# tokens_per_rank (above the micro-batch's tokens in one of them: the padding path)
ROW_SHARDED_EMBEDDING = {"fsdp2_qwen3": ROWS * SEQ + 5, "fsdp2_ep_qwen3_5_moe": ROWS * SEQ}


def _packed(micro: dict) -> dict:
    """A (rows, seq) micro-batch as one packed row: positions restarting per document, cu_seq_lens, and no target
    across documents (the label of each later document's first token ignored): the targets of the rows."""
    import torch

    ids = micro["input_ids"]
    rows, seq = ids.shape
    labels = micro["labels"].clone()
    labels[1:, 0] = -100
    cu = torch.arange(rows + 1, dtype=torch.int32) * seq
    return dict(input_ids=ids.reshape(1, -1), labels=labels.reshape(1, -1),
                position_ids=torch.arange(seq).repeat(rows)[None], cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                max_length_q=seq, max_length_k=seq)


def _model_overrides(family: str) -> dict:
    return dict(output_router_logits=True, router_aux_loss_coef=AUX_COEF) if family != "qwen3" else {}


def _batches(vocab_size: int, world: int):
    """batches[step][rank]: a (ROWS, SEQ) micro-batch per rank; the last step repeats the first."""
    import torch

    g = torch.Generator().manual_seed(123)
    out = []
    for _ in range(STEPS):
        step = []
        for _ in range(world):
            ids = torch.randint(0, vocab_size, (ROWS, SEQ), generator=g)
            step.append({"input_ids": ids, "labels": ids.clone()})
        out.append(step)
    out[-1] = out[0]
    return out


# ---------------------------------------------------------------------------------------------------- workers

def _full_grads(model) -> dict:
    """name -> full gradient (every rank takes part in the gathers; all ranks hold the result)."""
    from torch.distributed.tensor import DTensor

    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return grads


def _average_grads(model, world: int) -> None:
    """EP without FSDP: dense gradients averaged over the ranks by hand (what DDP would do); expert gradients are
    sums over the EP group (moe.expert_parallel), divided by the number of data-parallel ranks."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if isinstance(p.grad, DTensor):
            p.grad.div_(world)
        else:
            dist.all_reduce(p.grad)
            p.grad.div_(world)


def _build(family: str, path, world: int, ep: int, sharding: str, capacity: int | None = None, chunks: int = 1,
           layers_per_unit: int = 1, embedding_tokens: int | None = None):
    import torch
    import torch.distributed as dist
    from kernels import get_kernel
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from hubfuse import distributed, presets
    from tests.utils import REVISION, load

    kw = {}
    if sharding == "transformers":
        from transformers.distributed import DistributedConfig

        kw["distributed_config"] = DistributedConfig(fsdp_size=world, ep_size=ep)
    model = load(path, presets.kernel_mapping(family, revision=REVISION), **kw).train()
    moe_family = family in presets.MOE_FAMILIES
    presets.enable_losses(model, family, revision=REVISION, aux_loss_group=dist.group.WORLD if moe_family else None)
    local_rows = []  # experts held by this rank after expert-parallel sharding (before FSDP shards them further)
    if sharding == "transformers":
        if capacity is not None:
            get_kernel("hubfuse/moe", revision=REVISION).set_capacity(model, capacity, chunks=chunks)
        return distributed.fix_single_rank_expert_reduction(model), local_rows
    if ep > 1:
        mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("dp", "ep"))
        get_kernel("hubfuse/moe", revision=REVISION).shard_experts(model, mesh["ep"], capacity=capacity,
                                                                   chunks=chunks)
        local_rows = [m.gate_up_proj.to_local().shape[0] for name, m in model.named_modules()
                      if name.endswith("mlp.experts")]
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    with warnings.catch_warnings(record=True) as caught:  # both flatten a 2-D mesh: quietly, on every torch
        warnings.simplefilter("always")
        if embedding_tokens is not None:
            distributed.shard_embedding(model, mesh, embedding_tokens)
        if sharding == "fsdp":
            distributed.fully_shard_model(model, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32,
                                                                                      reduce_dtype=torch.float32),
                                          layers_per_unit=layers_per_unit)
    mesh_warnings = [str(w.message) for w in caught if "mesh" in str(w.message).lower()]
    assert not mesh_warnings, mesh_warnings
    return model, local_rows


class _FsdpWarnings(logging.Handler):
    """FSDP's complaints about modules that skipped their forward (a warning or a log record, by torch version)."""

    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.add(record.getMessage())

    def add(self, message: str):
        if "did not run forward" in message or "FSDPLinear" in message:
            self.messages.append(message[:300])


def _train(model, batches, rank: int, world: int, sharding: str):
    """(losses, first-step gradients, facts about lm_head: its forward calls, FSDP warnings)."""
    import torch

    head_calls = []
    model.lm_head.register_forward_hook(lambda *_: head_calls.append(1))  # the fused loss runs through lm_head
    fsdp_warnings = _FsdpWarnings()
    logging.getLogger("torch.distributed").addHandler(fsdp_warnings)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, grads = _steps(model, batches, rank, world, sharding)
    logging.getLogger("torch.distributed").removeHandler(fsdp_warnings)
    for w in caught:
        fsdp_warnings.add(str(w.message))
    return losses, grads, dict(lm_head_calls=len(head_calls), fsdp_warnings=fsdp_warnings.messages)


def _steps(model, batches, rank: int, world: int, sharding: str):
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], None
    for step, micro in enumerate(batches):
        out = model(**micro[rank])
        assert out.logits is None  # the fused linear cross-entropy ran
        out.loss.backward()
        if sharding == "none":
            _average_grads(model, world)
        if step == 0:
            grads = _full_grads(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    return losses, grads


def _facts(model, local_rows) -> dict:
    from torch.distributed.tensor import DTensor

    from torch.distributed.fsdp import FSDPModule

    bound = sorted({getattr(m.__dict__["forward"], "__func__", m.__dict__["forward"]).__qualname__.split(".")[0]
                    for name, m in model.named_modules() if name and "forward" in m.__dict__})
    decoder_units = {id(m._get_fsdp_state()) for m in model.model.layers if isinstance(m, FSDPModule)}
    return {"bound": bound, "sharded": sum(isinstance(p, DTensor) for p in model.parameters()),
            "params": sum(1 for _ in model.parameters()), "experts_local_rows": local_rows,
            "experts_fsdp": [isinstance(m, FSDPModule) for name, m in model.named_modules()
                             if name.endswith("mlp.experts")],
            "decoder_units": len(decoder_units), "decoder_layers": len(model.model.layers),
            "head_unit": isinstance(model.lm_head, FSDPModule)}


def _bare_experts(gate_up_proj, down_proj):
    """An experts module with only the v5 layout's parameters and act_fn (no HF class, no kernelize)."""
    from torch import nn

    module = nn.Module()
    module.gate_up_proj = nn.Parameter(gate_up_proj.clone())
    module.down_proj = nn.Parameter(down_proj.clone())
    module.act_fn = nn.SiLU()
    return module


def _expert_parallel_functional(world: int) -> list[str]:
    """moe.expert_parallel on raw tensors, EP over all ranks, against `moe_experts` with the full weights on each
    rank: outputs, hidden/weight gradients, and expert gradients (the EP one is the sum over ranks). Cases:
    random routing, every token routed to rank 0's experts (the other ranks receive no rows), the sentinel E;
    each with the sized exchange, the fixed-capacity (sync-free) one, and the latter pipelined in 2 and 3 chunks
    (token counts not divisible by them, below the capacity), which must also equal the one-chunk exchange.
    The pipelined exchange also under activation checkpointing (the backward recomputes the whole pipeline), and
    chunks set around HF's expert loop (a GELU act_fn: not the fused kernel, which runs the one-chunk exchange).
    Each rank has its own token count; top_k 3 is above the EP size 2 and below 4 (both table widths)."""
    import torch
    import torch.distributed as dist
    from kernels import get_kernel
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from tests.utils import REVISION

    moe = get_kernel("hubfuse/moe", revision=REVISION)
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    E, H, I, K = 3 * world, 16, 8, 3
    g = torch.Generator().manual_seed(7)  # the same weights on every rank
    gate_up, down = torch.randn(E, 2 * I, H, generator=g) * 0.3, torch.randn(E, H, I, generator=g) * 0.3
    errors = []
    capacity = 5 + 2 * world + 1  # above every rank's token count (5 + 2 * rank)
    exchanges = [(None, 1), (capacity, 1), (capacity, 2), (capacity, 3)]
    for case, cap, chunks in [(c, k, n) for k, n in exchanges for c in ("random", "one_rank", "sentinel")] \
            + [("one_rank, HF loop", capacity, 2), ("random, checkpointed", capacity, 2)]:
        act_fn = nn.GELU() if "HF loop" in case else None
        case = case if cap is None else f"{case}, fixed capacity {cap}, {chunks} chunk(s)"
        g = torch.Generator().manual_seed(100 * rank + len(case.split(",")[0]))
        T = 5 + 2 * rank
        hidden = torch.randn(T, H, generator=g)
        index = torch.rand(T, E, generator=g).argsort(1)[:, :K]  # distinct experts per token
        if case.startswith("one_rank"):
            index = torch.rand(T, E // world, generator=g).argsort(1)[:, :K]  # rank 0's experts only
        if case.startswith("sentinel"):
            index[::2, -1] = E
        weights = torch.rand(T, K, generator=g)
        probe = torch.randn(T, H, generator=g)
        ref_inputs = [t.clone().requires_grad_() for t in (hidden, weights, gate_up, down)]
        if act_fn is None:
            ref = moe.moe_experts(ref_inputs[0], index, ref_inputs[1], ref_inputs[2], ref_inputs[3])
        else:
            ref = moe.experts_hf(ref_inputs[0], index, ref_inputs[1], ref_inputs[2], ref_inputs[3], act_fn)
        (ref * probe).sum().backward()
        experts = _bare_experts(gate_up, down)
        if act_fn is not None:
            experts.act_fn = act_fn
        experts = moe.shard_experts(experts, mesh, capacity=cap, chunks=chunks)
        h, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
        if "checkpointed" in case:  # the layer's forward runs again in the backward (the exchanges with it)
            out = torch.utils.checkpoint.checkpoint(experts, h, index, w, use_reentrant=False)
        else:
            out = experts(h, index, w)
        (out * probe).sum().backward()
        n = E // world
        checks = [("output", out, ref), ("hidden grad", h.grad, ref_inputs[0].grad),
                  ("weights grad", w.grad, ref_inputs[1].grad)]
        expert_grads = [experts.gate_up_proj.grad.to_local().clone(), experts.down_proj.grad.to_local().clone()]
        for name, got, full_ref in (("gate_up_proj grad", expert_grads[0], ref_inputs[2]),
                                    ("down_proj grad", expert_grads[1], ref_inputs[3])):
            total = full_ref.grad.clone()
            dist.all_reduce(total)  # every rank's loss reaches the owner's experts
            checks.append((name, got, total[rank * n:(rank + 1) * n]))
        if chunks > 1 and act_fn is None:  # the same call in one chunk
            moe.set_capacity(experts, cap, chunks=1).zero_grad()
            h1, w1 = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
            out1 = experts(h1, index, w1)
            (out1 * probe).sum().backward()
            checks += [("output vs 1 chunk", out, out1), ("hidden grad vs 1 chunk", h.grad, h1.grad),
                       ("weights grad vs 1 chunk", w.grad, w1.grad),
                       ("gate_up_proj grad vs 1 chunk", expert_grads[0], experts.gate_up_proj.grad.to_local()),
                       ("down_proj grad vs 1 chunk", expert_grads[1], experts.down_proj.grad.to_local())]
        for name, got, want in checks:
            try:
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            except AssertionError as e:
                errors.append(f"rank {rank}, {case}: {name}: {e}")
    return errors


def _pipelined_exchange_nccl(world: int) -> dict:
    """NCCL, one GPU per rank, Qwen3-30B-A3B widths (128 experts top-8, hidden 2048, moe_intermediate 768, bf16),
    one MoE layer's experts over all ranks, 4096 tokens per rank (its own routing): the fixed-capacity exchange in
    2 and 4 chunks against 1 chunk, output and every gradient (bf16: relative to the largest value), where the
    chunks' all-to-alls run on NCCL's stream against the compute stream (waits, not host syncs); then forward +
    backward timed for each (CUDA events, median of 10 after 3 warm-up calls)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import hubfuse.moe as moe

    rank = dist.get_rank()
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("ep",))
    E, H, I, K, T = 128, 2048, 768, 8, 4096
    g = torch.Generator(device="cuda").manual_seed(7)  # the same weights on every rank
    gate_up = torch.randn(E, 2 * I, H, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
    down = torch.randn(E, H, I, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
    g.manual_seed(100 + rank)
    hidden = torch.randn(T, H, generator=g, device="cuda", dtype=torch.bfloat16)
    weights, index = torch.randn(T, E, generator=g, device="cuda").softmax(-1).topk(K)
    weights = weights.to(torch.bfloat16)
    probe = torch.randn(T, H, generator=g, device="cuda")
    results, times, errors = {}, {}, []
    for chunks in (1, 2, 4):
        experts = moe.shard_experts(_bare_experts(gate_up, down), mesh, capacity=T, chunks=chunks)

        def step():
            h, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
            out = experts(h, index, w)
            (out.float() * probe).sum().backward()
            return out, h.grad, w.grad

        for _ in range(3):
            experts.zero_grad()
            step()
        spans = []
        for _ in range(10):
            experts.zero_grad()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            dist.barrier()
            start.record()
            got = step()
            end.record()
            torch.cuda.synchronize()
            spans.append(start.elapsed_time(end))
        times[chunks] = sorted(spans)[len(spans) // 2]
        results[chunks] = [*got, experts.gate_up_proj.grad.to_local(), experts.down_proj.grad.to_local()]
    names = ("output", "hidden grad", "weights grad", "gate_up_proj grad", "down_proj grad")
    for chunks in (2, 4):
        for name, got, want in zip(names, results[chunks], results[1]):
            err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            if not err <= 1e-2:
                errors.append(f"rank {rank}, {chunks} chunks: {name} differs from 1 chunk by {err:.2e} (relative)")
    return dict(errors=errors, ms=times)


def _row_sharded_embedding_functional(world: int, device: str = "cpu") -> list[str]:
    """hubfuse.distributed.shard_embedding on a bare nn.Embedding (float64, a vocabulary of 11: uneven over 2 and 4
    ranks, a padding_idx), each rank with its own token count (5 + 2 * rank, below tokens_per_rank): the output
    equals nn.Embedding's bit for bit, the weight gradient the mean over ranks of every rank's nn.Embedding
    gradient. On CPU (gloo) then bad input raises errors naming the problem, on every rank at once (before any
    exchange); on CUDA (NCCL) also Qwen3-30B-A3B's embedding in bf16 (151936 x 2048, 4096 tokens a rank)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from hubfuse import distributed

    rank = dist.get_rank()
    mesh = init_device_mesh(device, (world,), mesh_dim_names=("dp",))
    cases = [(11, 6, 3, 5 + 2 * world + 1, torch.float64, dtype, lambda r: 5 + 2 * r, 1e-12)
             for dtype in (torch.int64, torch.int32)]
    if device == "cuda":  # a real embedding in bf16: NCCL's sums of one row and zeros must stay exact
        cases.append((151936, 2048, None, 4096, torch.bfloat16, torch.int64, lambda r: 4096 - 7 * r, 1e-2))

    errors = []
    for vocab, hidden, padding_idx, capacity, wdtype, dtype, count, tol in cases:
        def tokens(r: int):
            g = torch.Generator().manual_seed(50 + r)
            ids = torch.randint(0, vocab, (count(r),), generator=g)
            if padding_idx is not None:
                ids[0] = padding_idx
            grad = torch.randn(count(r), hidden, generator=g, dtype=torch.float64)
            return ids.to(device, dtype), grad.to(device, wdtype)

        full = nn.Embedding(vocab, hidden, padding_idx=padding_idx, dtype=wdtype, device=device)
        with torch.no_grad():
            full.weight.copy_(torch.randn(vocab, hidden, generator=torch.Generator(device).manual_seed(5),
                                          device=device, dtype=wdtype))
        model = nn.Module()
        model.embed = nn.Embedding(vocab, hidden, padding_idx=padding_idx, dtype=wdtype, device=device)
        model.embed.load_state_dict(full.state_dict())
        model.get_input_embeddings = lambda: model.embed
        distributed.shard_embedding(model, mesh, capacity)
        ids, grad = tokens(rank)
        out = model.embed(ids.view(1, -1))
        want_out = full(ids.view(1, -1))
        what = f"rank {rank}, vocabulary {vocab}, {wdtype}, {dtype}"
        if out.shape != want_out.shape or not torch.equal(out, want_out):
            errors.append(f"{what}: output differs from nn.Embedding")
        out.backward(grad.view(1, -1, hidden))
        for r in range(world):
            other_ids, other_grad = tokens(r)
            full(other_ids).backward(other_grad / world)
        got, want = model.embed.weight.grad.full_tensor().double(), full.weight.grad.double()
        err = ((got - want).abs().max() / want.abs().max()).item()
        if not err <= tol:
            errors.append(f"{what}: weight gradient off by {err:.3g} (relative to its largest value)")
    if device != "cpu":
        return errors  # the bad-input cases below: device-side asserts would end the CUDA context
    vocab, capacity = cases[0][0], cases[0][3]
    model = nn.Module()
    model.embed = nn.Embedding(vocab, 6)
    model.get_input_embeddings = lambda: model.embed
    distributed.shard_embedding(model, mesh, capacity)
    tied = nn.Module()
    tied.embed, tied.head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
    tied.head.weight = tied.embed.weight
    tied.get_input_embeddings = lambda: tied.embed
    wrapped = nn.Module()
    wrapped.get_input_embeddings = lambda: nn.Sequential(nn.Embedding(8, 4))
    plain = nn.Module()
    plain.embed = nn.Embedding(8, 4)
    plain.get_input_embeddings = lambda: plain.embed
    small = nn.Module()
    small.embed = nn.Embedding(1, 4)
    small.get_input_embeddings = lambda: small.embed
    errors += _unmet_errors([
        ("tokens above tokens_per_rank", lambda: model.embed(torch.zeros(1, capacity + 1, dtype=torch.long)),
         ValueError, f"{capacity + 1} tokens in this call, more than tokens_per_rank {capacity}"),
        ("float input_ids", lambda: model.embed(torch.zeros(1, 3)), TypeError, "int32 or int64"),
        ("input_ids on another device", lambda: model.embed(torch.zeros(1, 3, dtype=torch.long, device="meta")),
         ValueError, "input_ids are on meta but the embedding on cpu"),
        ("input_ids out of range", lambda: model.embed(torch.tensor([[0, vocab]])), ValueError,
         f"input_ids must be in [0, {vocab})"),
        ("sharded twice", lambda: distributed.shard_embedding(model, mesh, 8), ValueError, "sharded already"),
        ("tied head", lambda: distributed.shard_embedding(tied, mesh, 8), ValueError, "tied to head"),
        ("not an nn.Embedding", lambda: distributed.shard_embedding(wrapped, mesh, 8), ValueError,
         "not a plain nn.Embedding"),
        ("fewer rows than ranks", lambda: distributed.shard_embedding(small, mesh, 8), ValueError,
         f"1 embedding rows cannot be shared by {world} ranks"),
        ("tokens_per_rank 0", lambda: distributed.shard_embedding(tied, mesh, 0), ValueError,
         "tokens_per_rank must be a positive int"),
        ("tokens_per_rank a float", lambda: distributed.shard_embedding(tied, mesh, 8.0), ValueError,
         "tokens_per_rank must be a positive int"),
        ("mesh smaller than the world", lambda: distributed.shard_embedding(
            plain, init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("a", "b"))["a"], 8), ValueError,
         f"the world has {world} processes"),
    ])
    dist.barrier()
    return [f"rank {rank}: {p}" for p in errors]


def _unmet_errors(cases) -> list[str]:
    """(what, call, exception type, text) cases: each call must raise that type with that text in its message."""
    problems = []
    for what, call, exc, text in cases:
        try:
            call()
            problems.append(f"{what}: no error")
        except exc as e:
            if text not in str(e):
                problems.append(f"{what}: {type(e).__name__}: {e!r} does not say {text!r}")
    return problems


def _configuration_errors(world: int) -> list[str]:
    """Bad configurations must raise errors that name the problem (2 ranks: needs an EP size above 1)."""
    import torch
    import torch.distributed as dist
    from kernels import get_kernel
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from hubfuse import distributed
    from tests.utils import REVISION

    moe = get_kernel("hubfuse/moe", revision=REVISION)
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "ep"))
    other = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "ep"))  # another EP group (size 1)
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([nn.Module()])
    model.model.layers[0].experts = _bare_experts(torch.randn(4, 8, 6), torch.randn(4, 6, 4))
    cases = [
        ("E not divisible", lambda: moe.shard_experts(_bare_experts(torch.randn(3, 8, 6), torch.randn(3, 6, 4)),
                                                      mesh["ep"]), ValueError, "3 experts, not divisible"),
        ("2-D ep_mesh", lambda: moe.shard_experts(model, mesh), ValueError, "1-D DeviceMesh"),
        ("not a mesh", lambda: moe.shard_experts(model, "ep"), TypeError, "ep_mesh must be"),
        ("no experts", lambda: moe.shard_experts(nn.Linear(2, 2), mesh["ep"]), ValueError, "no routed-experts"),
        ("EP size 2 without shard_experts", lambda: distributed.fully_shard_model(model, mesh), ValueError,
         "call moe.shard_experts"),
    ]
    dense = nn.Module()
    dense.model = nn.Module()
    dense.model.layers = nn.ModuleList([nn.Linear(4, 4)])
    cases += [
        ("dense model under EP", lambda: distributed.fully_shard_model(dense, mesh), ValueError,
         "no routed experts"),
        ("mesh smaller than the world", lambda: distributed.fully_shard_model(dense, mesh["dp"]), ValueError,
         f"the world has {world} processes"),
        ("capacity not an int", lambda: moe.set_capacity(model, 2.5), TypeError, "capacity must be None or an int"),
        ("capacity below 1", lambda: moe.set_capacity(model, 0), ValueError, "capacity must be >= 1"),
        ("capacity before sharding", lambda: moe.set_capacity(model, 8), ValueError, "no expert-parallel experts"),
        ("chunks not an int", lambda: moe.set_capacity(model, 8, chunks=2.0), TypeError, "chunks must be an int"),
        ("chunks below 1", lambda: moe.set_capacity(model, 8, chunks=0), ValueError, "chunks must be >= 1"),
        ("chunks without a capacity", lambda: moe.set_capacity(model, None, chunks=2), ValueError,
         "chunks=2 needs a fixed capacity"),
        ("chunks not an int (shard_experts)", lambda: moe.shard_experts(model, mesh["ep"], capacity=8, chunks="2"),
         TypeError, "chunks must be an int"),
        ("layers_per_unit not an int", lambda: distributed.fully_shard_model(dense, mesh["ep"], layers_per_unit=2.0),
         TypeError, "layers_per_unit must be an int"),
        ("layers_per_unit a bool", lambda: distributed.fully_shard_model(dense, mesh["ep"], layers_per_unit=True),
         TypeError, "layers_per_unit must be an int"),
        ("layers_per_unit below 1", lambda: distributed.fully_shard_model(dense, mesh["ep"], layers_per_unit=0),
         ValueError, "layers_per_unit must be >= 1"),
        ("head_unit not a bool", lambda: distributed.fully_shard_model(dense, mesh["ep"], head_unit="yes"),
         TypeError, "head_unit must be a bool"),
    ]
    problems = _unmet_errors(cases)
    moe.shard_experts(model, mesh["ep"])
    problems += _unmet_errors([
        ("experts sharded over another mesh", lambda: distributed.fully_shard_model(model, other), ValueError,
         "not over this mesh"),
        ("1-D mesh with EP experts", lambda: distributed.fully_shard_model(model, mesh["ep"]), ValueError,
         "2-D (dp, 'ep') mesh"),
        ("tokens above the capacity", lambda: moe.set_capacity(model, 3).model.layers[0].experts(
            torch.randn(4, 6), torch.zeros(4, 2, dtype=torch.long), torch.rand(4, 2)), ValueError,
         "exceed the fixed capacity 3"),
        ("tokens above the capacity, 2 chunks", lambda: moe.set_capacity(model, 3, chunks=2).model.layers[0].experts(
            torch.randn(4, 6), torch.zeros(4, 2, dtype=torch.long), torch.rand(4, 2)), ValueError,
         "exceed the fixed capacity 3"),
    ])
    dist.barrier()
    return [f"rank {dist.get_rank()}: {p}" for p in problems]


def _checkpoint_round_trip(model, name: str, path, world: int, out_dir: Path, rank: int) -> dict:
    """Gather-then-save (HF format); for "dcp" also a DCP save loaded into a freshly sharded model."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from hubfuse import distributed

    family, _, ep, sharding = SCENARIOS[name]
    trained = distributed.full_state_dict(model)
    hf_dir = out_dir / f"{name}_hf_checkpoint"
    distributed.save_pretrained(model, hf_dir)
    result = {"hf_dir": str(hf_dir)}
    if "dcp" in CHECKPOINT_SCENARIOS[name]:
        dcp_dir = out_dir / f"{name}_dcp_checkpoint"
        dcp.save(get_model_state_dict(model), checkpoint_id=str(dcp_dir))
        fresh, _ = _build(family, path, world, ep, sharding,  # the untrained weights, sharded the same way
                          embedding_tokens=ROW_SHARDED_EMBEDDING.get(name))
        state = get_model_state_dict(fresh)
        dcp.load(state, checkpoint_id=str(dcp_dir))
        set_model_state_dict(fresh, state)
        reloaded = distributed.full_state_dict(fresh)
        result["dcp_equal"] = rank != 0 or (sorted(trained) == sorted(reloaded) and all(
            torch.equal(trained[k], reloaded[k]) for k in trained))
    if rank == 0:
        torch.save(trained, out_dir / f"{name}_trained_state.pt")
    dist.barrier()
    return result


def _worker(spec_file: str) -> None:
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed as dist

    spec = json.loads(Path(spec_file).read_text())
    rank, world = spec["rank"], spec["world"]
    out_dir = Path(spec["out_dir"])
    os.environ["TRITON_INTERPRET"] = "0" if spec["nccl"] else "1"
    import triton  # noqa: F401  (interpreter mode is fixed when triton's own jit functions are created)

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))  # read by transformers
    if spec["nccl"]:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{spec['store']}", rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank))
        try:
            result = _pipelined_exchange_nccl(world)
            result["errors"] += _row_sharded_embedding_functional(world, "cuda")
            (out_dir / f"nccl_rank{rank}.json").write_text(json.dumps(result))
        finally:
            dist.destroy_process_group()
        return
    dist.init_process_group("gloo", init_method=f"file://{spec['store']}", rank=rank, world_size=world)
    try:
        t0 = time.time()
        os.environ["TRITON_INTERPRET"] = "0"
        errors = _expert_parallel_functional(world) + _row_sharded_embedding_functional(world)
        if world == 2:
            errors += _configuration_errors(world)
        (out_dir / f"functional_rank{rank}.json").write_text(json.dumps(dict(errors=errors,
                                                                             seconds=round(time.time() - t0, 1))))
        for name in spec["scenarios"]:
            family, _, ep, sharding = SCENARIOS[name]
            path = spec["paths"][family]
            t0 = time.time()
            os.environ["TRITON_INTERPRET"] = "1" if name in INTERPRETED else "0"  # read by the kernels at every call
            batches = torch.load(out_dir / f"batches_{family}.pt")
            if name in PACKED:
                batches = [[_packed(micro) for micro in step] for step in batches]
            model, local_rows = _build(family, path, world, ep, sharding,
                                       capacity=ROWS * SEQ if name in FIXED_CAPACITY else None,
                                       chunks=FIXED_CAPACITY.get(name, 1), layers_per_unit=LAYERS_PER_UNIT.get(name, 1),
                                       embedding_tokens=ROW_SHARDED_EMBEDDING.get(name))
            facts = _facts(model, local_rows)
            losses, grads, head = _train(model, batches, rank, world, sharding)
            result = dict(facts, **head, losses=losses)
            if name in CHECKPOINT_SCENARIOS:
                result.update(_checkpoint_round_trip(model, name, path, world, out_dir, rank))
            if rank == 0:
                torch.save(grads, out_dir / f"{name}_grads.pt")
            result["seconds"] = round(time.time() - t0, 1)
            (out_dir / f"{name}_rank{rank}.json").write_text(json.dumps(result))
            del model
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------- launcher

def _launch(world: int, scenarios: list[str], paths: dict, out_dir: Path, nccl: bool = False) -> None:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "torch-ext"), os.environ.get("PYTHONPATH", "")]))
    procs = []
    for rank in range(world):
        spec = out_dir / f"spec{rank}.json"
        spec.write_text(json.dumps(dict(rank=rank, world=world, store=str(out_dir / "store"), scenarios=scenarios,
                                        paths={k: str(v) for k, v in paths.items()}, out_dir=str(out_dir),
                                        nccl=nccl)))
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", str(spec)], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        deadline = time.time() + TIMEOUT_S
        for p in procs:
            try:
                logs.append(p.communicate(timeout=max(1.0, deadline - time.time()))[0])
            except subprocess.TimeoutExpired:
                logs.append(f"(timed out after {TIMEOUT_S} s)")
                break
    finally:
        for p in procs:  # only the workers started above
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [(rank, p.returncode, logs[rank] if rank < len(logs) else "") for rank, p in enumerate(procs)
              if p.returncode != 0]
    # the rank that failed first is the one whose error is not a peer that went away
    failed.sort(key=lambda f: "remote worker" in f[2][-600:])
    if failed:
        pytest.fail("\n".join(f"{world}-process run, rank {rank} exited {code}:\n{log[-4000:]}"
                              for rank, code, log in failed[:2]), pytrace=False)


def _reference(path, batches, world: int):
    """Plain HF eager model, one process, the concatenated global batch: losses per step, first-step grads."""
    import torch

    from tests.utils import load

    model = load(path).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], None
    for step, micro in enumerate(batches):
        batch = {k: torch.cat([micro[r][k] for r in range(world)]) for k in micro[0]}
        loss = model(**batch).loss
        loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grads


def _run_world(world: int, tmp_path_factory):
    import torch

    from hubfuse import presets
    from tests.utils import register_local_kernels, save_tiny_model, tiny_config

    names = [n for n, s in SCENARIOS.items() if s[1] == world]
    families = sorted({SCENARIOS[n][0] for n in names})
    out_dir = tmp_path_factory.mktemp(f"dist{world}")
    register_local_kernels(*sorted({r for f in families for r in presets.kernel_repos(f)}))
    paths = {}
    for family in families:
        config_family = FAMILIES[family]
        paths[family] = save_tiny_model(config_family, out_dir / "models", **_model_overrides(family))
        vocab = tiny_config(config_family).vocab_size
        torch.save(_batches(vocab, world), out_dir / f"batches_{family}.pt")
    t0 = time.time()
    _launch(world, names, paths, out_dir)
    print(f"{world} processes, {names}: {time.time() - t0:.1f} s")
    return out_dir, paths


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _run_world(2, tmp_path_factory)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _run_world(4, tmp_path_factory)


def _results(out_dir: Path, name: str, world: int) -> list[dict]:
    return [json.loads((out_dir / f"{name}_rank{r}.json").read_text()) for r in range(world)]


def _check_against_reference(name: str, run) -> list[dict]:
    import torch

    from hubfuse import presets

    out_dir, paths = run
    family, world, ep, sharding = SCENARIOS[name]
    results = _results(out_dir, name, world)
    batches = torch.load(out_dir / f"batches_{family}.pt")
    want_losses, want_grads = _reference(paths[family], batches, world)
    got_losses = [sum(r["losses"][s] for r in results) / world for s in range(STEPS)]
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want_losses), **TOL,
                               msg=lambda m: f"{name}: mean loss over ranks vs one process: {m}")
    assert want_losses[-1] < want_losses[0] - 1e-3  # same batch as step 1, lower loss: it trained
    got_grads = torch.load(out_dir / f"{name}_grads.pt")
    want = presets.eager_to_kernelized(want_grads, got_grads.keys())
    for key in want:
        torch.testing.assert_close(got_grads[key], want[key], **GRAD_TOL,
                                   msg=lambda m: f"{name}: gradient of {key} vs one process: {m}")
    for r in results:
        # lm_head runs its forward (and FSDP its hooks) at every step under the fused loss, without FSDP warnings
        assert r["lm_head_calls"] == STEPS, f"{name}: lm_head forward ran {r['lm_head_calls']} times"
        assert not r["fsdp_warnings"], f"{name}: {r['fsdp_warnings']}"
        if sharding != "none":
            assert r["sharded"] == r["params"] > 0, f"{name}: every parameter should be a DTensor"
        if ep > 1 and sharding != "transformers":
            n = _num_experts(family)
            assert r["experts_local_rows"] and all(x == n // ep for x in r["experts_local_rows"]), r
        if sharding == "fsdp":  # fully_shard_model: one FSDP unit per layers_per_unit decoder layers
            per_unit = LAYERS_PER_UNIT.get(name, 1)
            assert r["decoder_units"] == -(-r["decoder_layers"] // per_unit), r
            assert r["head_unit"], f"{name}: lm_head (untied) should be an FSDP unit of its own"
        if ep > 1 and sharding == "fsdp":
            # fully_shard_model: one rank per expert (dp 1) leaves the experts out of FSDP, dp > 1 wraps them
            assert r["experts_fsdp"] and set(r["experts_fsdp"]) == {world // ep > 1}, r["experts_fsdp"]
        if family != "qwen3":
            assert "GroupedGemmExperts" in r["bound"], r["bound"]
        assert ("_row_sharded_forward" in r["bound"]) == (name in ROW_SHARDED_EMBEDDING), r["bound"]
    return results


def _num_experts(family: str) -> int:
    from tests.utils import tiny_config

    return tiny_config(FAMILIES[family]).num_experts


def test_experts_left_out_of_fsdp_only_when_fsdp_has_nothing_to_do():
    """fully_shard_model's rule for EP experts with one rank each (dp 1): out of FSDP unless FSDP must cast their
    parameters (a mixed-precision param dtype other than theirs) or offload them to the CPU."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    from hubfuse.distributed import _plain_experts_fit

    experts = nn.Module()
    experts.gate_up_proj = nn.Parameter(torch.randn(4, 6, 3, dtype=torch.bfloat16))
    experts.down_proj = nn.Parameter(torch.randn(4, 3, 3, dtype=torch.bfloat16))
    assert _plain_experts_fit(experts, None, None)
    assert _plain_experts_fit(experts, MixedPrecisionPolicy(param_dtype=torch.bfloat16), OffloadPolicy())
    assert _plain_experts_fit(experts, MixedPrecisionPolicy(reduce_dtype=torch.float32), None)
    assert not _plain_experts_fit(experts, MixedPrecisionPolicy(param_dtype=torch.float32), None)
    assert not _plain_experts_fit(experts, None, CPUOffloadPolicy())


def test_head_unit_only_when_untied():
    """fully_shard_model's own FSDP unit for lm_head: only when no other module holds its weight (tied
    embeddings stay in one unit, the root)."""
    from torch import nn

    from hubfuse.distributed import _untied_head

    model = nn.Module()
    model.model = nn.Module()
    model.model.embed_tokens = nn.Embedding(11, 4)
    model.lm_head = nn.Linear(4, 11, bias=False)
    assert _untied_head(model) is model.lm_head
    model.lm_head.weight = model.model.embed_tokens.weight
    assert _untied_head(model) is None
    model.lm_head = nn.Identity()
    assert _untied_head(model) is None
    del model.lm_head
    assert _untied_head(model) is None


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_functional(two_ranks, four_ranks, world):
    """The EP exchange on raw tensors (uneven token counts, a rank receiving nothing, the sentinel) equals
    moe_experts with the full weights: outputs and every gradient. With 2 ranks also: bad configurations raise
    errors naming the problem (experts not divisible by the EP size, a 2-D ep_mesh, experts sharded over another
    mesh than the one given to fully_shard_model, ...)."""
    out_dir = (two_ranks if world == 2 else four_ranks)[0]
    errors = [e for r in range(world) for e in json.loads((out_dir / f"functional_rank{r}.json").read_text())["errors"]]
    assert not errors, "\n".join(errors)


@pytest.mark.gpu
def test_pipelined_exchange_nccl(tmp_path):
    """The fixed-capacity exchange pipelined in chunks over NCCL (up to 4 GPUs) equals one chunk at Qwen3-30B-A3B
    widths; prints forward + backward ms per chunk count (one MoE layer's experts: the overlap on its own). Then
    shard_embedding over NCCL: bit for bit nn.Embedding's output, its gradient (float64, and Qwen3-30B-A3B's
    embedding in bf16)."""
    import torch

    world = min(torch.cuda.device_count(), 4)
    if world < 2:
        pytest.skip("needs 2 GPUs")
    _launch(world, [], {}, tmp_path, nccl=True)
    results = [json.loads((tmp_path / f"nccl_rank{r}.json").read_text()) for r in range(world)]
    print(f"EP {world}, 4096 tokens per rank, forward + backward ms by chunks: {[r['ms'] for r in results]}")
    errors = [e for r in results for e in r["errors"]]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("name", [n for n, s in SCENARIOS.items() if s[1] == 2])
def test_two_processes(two_ranks, name):
    _check_against_reference(name, two_ranks)


@pytest.mark.parametrize("name", [n for n, s in SCENARIOS.items() if s[1] == 4])
def test_four_processes_dp2_ep2(four_ranks, name):
    _check_against_reference(name, four_ranks)


@pytest.mark.parametrize("name", list(CHECKPOINT_SCENARIOS))
def test_checkpoint_round_trip(request, name):
    """After training (dp2 x ep2 and dp1 x ep2 Qwen3.5-MoE, the latter's experts out of FSDP; transformers-sharded
    Qwen3-MoE): the HF checkpoint written by hubfuse.distributed.save_pretrained loads with plain from_pretrained
    to the same weights (original keys: the experts per expert, the fused shared-expert MLP split back), and the
    DCP checkpoint loads back."""
    import torch
    from safetensors.torch import load_file

    from hubfuse import presets
    from tests.utils import load

    family, world = SCENARIOS[name][:2]
    out_dir, paths = request.getfixturevalue("two_ranks" if world == 2 else "four_ranks")
    result = _results(out_dir, name, world)[0]
    if "dcp" in CHECKPOINT_SCENARIOS[name]:
        assert all(r["dcp_equal"] for r in _results(out_dir, name, world)), \
            "DCP save -> load into a freshly sharded model changed the weights"
    hf_dir = Path(result["hf_dir"])
    config = json.loads((hf_dir / "config.json").read_text())
    want_arch = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}[family]
    assert config["architectures"] == [want_arch], config["architectures"]
    keys = set(load_file(hf_dir / "model.safetensors"))
    original = set(load_file(Path(paths[family]) / "model.safetensors"))
    assert keys == original, keys ^ original  # the original architecture's keys (per-expert, gate/up split)
    trained = torch.load(out_dir / f"{name}_trained_state.pt")
    plain = load(hf_dir).state_dict()
    want = presets.eager_to_kernelized(plain, trained.keys())
    for key, value in trained.items():
        assert torch.equal(value, want[key]), f"{family}: {key} differs after save -> plain from_pretrained"


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    _worker(sys.argv[2])
