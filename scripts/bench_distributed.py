#!/usr/bin/env python
"""MoE training throughput under FSDP2 (+ expert parallelism): our kernels vs HF + FSDP2 eager, in the same run.

Models (`--model`): qwen3_30b_a3b (Qwen3-30B-A3B widths: hidden 2048, 128 experts top-8, moe_intermediate 768,
32/4 heads, head_dim 128, vocab 151936) or qwen3_5_moe (Qwen3.5-MoE widths: transformers' Qwen3_5MoeTextConfig
defaults, 256 experts top-8 + a shared expert, Gated DeltaNet : full attention 3 : 1, vocab 248320); router aux
loss on, `--layers` decoder layers, bf16 weights and (hence) bf16 AdamW states, random init, random tokens,
`--batch` x `--seq` tokens per GPU per step. The checkpoint (built once by rank 0 under --model-dir) holds every
weight but the routed experts (48 layers: 3.1 of 61 GB; 8 layers: 1.6 of 11 GB; Qwen3.5-MoE, 8 layers: 2.6 of
15.5 GB): each configuration initializes its own shards of them after the sharded load, as transformers would
(normal, std initializer_range), from seeds given by the parameter name and shard position, so both
configurations train the same weights. One training step = forward + backward + AdamW (fused on CUDA).
Configurations, in the same run, same weights and batches:

  hf    transformers 5.22.2 stock: experts_implementation="grouped_mm", sdpa attention, HF losses
  ours  hubfuse.KernelConfig(presets.kernel_mapping(family)) + presets.enable_losses (fused linear cross-entropy
        through lm_head, fused aux loss with its statistics reduced over all ranks)
  ours_fsdp  ours, always sharded the hubfuse way (below) whatever --sharding says: next to the transformers-
        sharded rows in one run (with dp 1, fully_shard_model leaves the experts out of FSDP). Its one-GPU
        reference is ours'.

Sharding (`--sharding`, several GPUs):
  transformers (default)  from_pretrained(distributed_config=DistributedConfig(fsdp_size=N, ep_size=--ep,
        fsdp_mixed_precision=True)): transformers builds the model on the meta device, applies its EP plan and
        its FSDP2 plan (experts over the `efsdp` group), and each rank reads only its shard: the full 48 layers
        load within a GPU. hf runs transformers' own all-to-all token dispatch, ours our kernel's (kernelize
        replaces the dispatch forward). `hubfuse.distributed.fix_single_rank_expert_reduction` is applied (it
        only changes gradient values, for efsdp = 1).
  hubfuse  every rank loads the whole model, then ours: moe.shard_experts(mesh["ep"]) +
        hubfuse.distributed.fully_shard_model(2-D (dp, ep) mesh); hf: fully_shard_model on the 1-D mesh (no
        EP: its experts are FSDP-sharded like the rest). Needs the whole model in each GPU's memory at load.
--single-gpu: one process, no process group, no FSDP.

Variants measured on the same loaded model, one row each (several GPUs): `--ep-dispatch` (ours with EP: fixed =
the sync-free fixed-capacity exchange, capacity batch x seq; fixed2 = the same in 2 chunks pipelined with the
experts, so that one chunk's all-to-alls run under the other's expert GEMMs; sized = split sizes read on the
host) and `--fsdp`
(default = FSDP2's implicit prefetch; prefetch2 = explicit forward / backward prefetch of the next / previous 2
decoder layers and their experts modules; noreshard = reshard_after_forward=False on the decoder layers).
`--activation-checkpointing`: per decoder layer (transformers' gradient_checkpointing_enable, non-reentrant).
`--profile N`: after the measured steps of every row, N more steps under torch.profiler on every rank; per rank:
GPU time per step, compute, NCCL all-gather / reduce-scatter / all-to-all / all-reduce (busy and exposed = not
overlapped by compute), idle GPU time, host syncs (cudaStreamSynchronize / cudaEventSynchronize calls and their
time); a table on rank 0 and $OUT/bench_distributed_<tag>_profile.json. Profiling tears CUPTI down after each
profile (TEARDOWN_CUPTI=1, unless set otherwise), so that the steps measured after it run uninstrumented.

Stragglers: per rank and row, the medians of the host's enqueue time (step start until train_step returns, before
the synchronize) and of the step time, and the CUDA caching allocator's cudaMalloc / cudaFree / retry counts over
the measured steps (`per_rank` in the JSON, a table in the .md); once per run, after the first multi-GPU step on
CUDA, which devices each rank holds a CUDA context on and nvidia-smi's compute processes per GPU
(`gpu_contexts`). The Python garbage collector is off during a row's steps (collected before them).

Reported per row: tokens/s/GPU (batch*seq / median step time, the slowest rank's), MFU (model FLOPs per token:
6 x active matmul parameters (embedding lookups excluded, routed experts x top_k / E) + 6 x full-attention
layers x seq x heads x head_dim (causal attention; the Gated DeltaNet recurrence is not counted), over
--peak-tflops, default 989 for H100/H200 bf16 dense), peak memory per GPU (max over ranks of
max_memory_allocated over the measured steps), loss of the first and last step (mean over ranks), and the
scaling efficiency: tokens/s/GPU over the one-GPU tokens/s of the same config, depth, seq and batch, read from
--one-gpu-reference [first|last] (rank 0 runs the configs alone on its GPU while the other ranks wait at a
barrier; by default last, after the multi-GPU rows) or --reference (the JSON of a --single-gpu run with the same
--layers). Writes $OUT/bench_distributed_<tag>.json and .md (OUT
defaults to ./out; tag "<model>_<layers>l_1gpu" or "<model>_<layers>l_<N>gpu_ep<ep>") after every row, and prints
the table. Progress lines only (one per warm-up step and every 5 measured steps, on rank 0).

    python scripts/bench_distributed.py --single-gpu                                  # 1 GPU, 8 layers
    torchrun --standalone --nproc-per-node 4 scripts/bench_distributed.py --layers 8 --ep 4 \\
        --one-gpu-reference --profile 1                                               # scaling at 8 layers
    torchrun --standalone --nproc-per-node 4 scripts/bench_distributed.py --model qwen3_5_moe --layers 8 --ep 4
    torchrun --standalone --nproc-per-node 4 scripts/bench_distributed.py --layers 48 --ep 4 \\
        --activation-checkpointing                                                    # the full depth
    torchrun --standalone --nproc-per-node 2 scripts/bench_distributed.py --smoke     # CPU, gloo, tiny dims
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT / "scripts", ROOT / "torch-ext", ROOT):
    sys.path.insert(0, str(p))

# --model -> (scripts/bench.py's slice: the config; the preset family; title)
MODELS = {"qwen3_30b_a3b": ("qwen3_30b_a3b", "qwen3_moe", "Qwen3-30B-A3B widths"),
          "qwen3_5_moe": ("qwen3_5_moe", "qwen3_5_moe", "Qwen3.5-MoE widths (256 experts + shared, Gated DeltaNet)")}
REVISION = "v1"
CONFIGS = ("hf", "ours", "ours_fsdp")  # ours_fsdp: our kernels, sharded by hubfuse whatever --sharding says
FSDP_MODES = ("default", "prefetch2", "noreshard")
EP_DISPATCH = {"fixed": 1, "fixed2": 2, "sized": None}  # --ep-dispatch -> chunks of the fixed-capacity exchange
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "H800": 989.4, "H20": 148.0, "B200": 2250.0, "A100": 312.0}


START = time.time()


def log(msg: str) -> None:
    print(msg, flush=True)


def elapsed() -> str:
    """Seconds since the script started (in the progress lines: where a part's time budget goes)."""
    return f"t={time.time() - START:.0f} s"


def flops_per_token(cfg, seq: int) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward): matmuls of the active parameters (every >= 2-D
    parameter of the model built on the meta device, except the embedding lookup; routed experts x top_k / E)
    and causal attention in the full-attention layers (average context seq / 2)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    active = 0.0
    for name, p in model.named_parameters():
        if p.dim() < 2 or "embed_tokens" in name:
            continue
        routed = name.endswith(("experts.gate_up_proj", "experts.down_proj"))
        active += p.numel() * (cfg.num_experts_per_tok / cfg.num_experts if routed else 1.0)
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    full = sum(t == "full_attention" for t in types)
    return 6.0 * active + 6.0 * full * seq * cfg.num_attention_heads * cfg.head_dim


class Dist:
    """World size, rank and the few collectives the bench needs (no-ops in a single process)."""

    def __init__(self, smoke: bool, single: bool, init_method: str | None = None):
        import torch

        self.world = 1 if single else int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = 0 if single else int(os.environ.get("RANK", "0"))
        self.local_rank = 0 if single else int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device("cpu") if smoke else torch.device("cuda", self.local_rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.world > 1:
            import torch.distributed as dist

            dist.init_process_group("gloo" if smoke else "nccl", init_method=init_method, rank=self.rank,
                                    world_size=self.world, timeout=timedelta(minutes=30),
                                    device_id=None if smoke else self.device)
        self.contexts_checked = False  # gpu_contexts: once per run, after the first step of the first row

    @classmethod
    def alone(cls, other: "Dist") -> "Dist":
        """This process on its own (world 1, no collectives), on `other`'s device."""
        d = cls.__new__(cls)
        d.world, d.rank, d.local_rank, d.device = 1, 0, other.local_rank, other.device
        d.contexts_checked = True
        return d

    def barrier(self):
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def reduce(self, value: float, op: str) -> float:
        if self.world == 1:
            return value
        import torch
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return t.item() / (self.world if op == "mean" else 1)

    def gather(self, obj) -> list:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def close(self):
        if self.world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()


def local_kernels(d: Dist, repos) -> None:
    """Rank 0 builds the kernel repos; every rank points LOCAL_KERNELS at the builds."""
    from tests import utils

    if d.rank == 0:
        utils.register_local_kernels(*repos)
    d.barrier()
    utils._BUILT.update(repos)  # built by rank 0: only set LOCAL_KERNELS here
    utils.register_local_kernels(*repos)


def load(config: str, path: Path, args, d: Dist, cfg, units: tuple = (1, True, False)):
    """(model, how it is sharded) for one configuration."""
    import bench
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hubfuse import KernelConfig, distributed, presets

    family = MODELS[args.model][1]
    kw = dict(dtype=torch.bfloat16, attn_implementation="sdpa")
    if config == "hf":
        kw["experts_implementation"] = "grouped_mm"
    else:
        kw.update(use_kernels=True, kernel_config=KernelConfig(presets.kernel_mapping(family, revision=REVISION)))
    tf_sharded = d.world > 1 and args.sharding == "transformers" and config != "ours_fsdp"
    if tf_sharded:
        from transformers.distributed import DistributedConfig

        kw["distributed_config"] = DistributedConfig(fsdp_size=d.world, ep_size=args.ep, fsdp_mixed_precision=True)
    else:
        kw["device_map"] = d.device
    model = AutoModelForCausalLM.from_pretrained(path, **kw)
    bench.init_routed_experts(model, cfg.initializer_range)  # not in the checkpoint (bench.ensure_model)
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    if config != "hf":
        presets.enable_losses(model, family, revision=REVISION,
                              aux_loss_group=dist.group.WORLD if d.world > 1 else None)
    if d.world == 1:
        return model, "none (one GPU)"
    if tf_sharded:
        distributed.fix_single_rank_expert_reduction(model)
        return model, f"transformers distributed_config fsdp {d.world} ep {args.ep}"
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if config != "hf" and args.ep > 1:
        mesh = init_device_mesh(d.device.type, (d.world // args.ep, args.ep), mesh_dim_names=("dp", "ep"))
        moe_kernel().shard_experts(model, mesh["ep"])
        how = f"hubfuse: shard_experts ep {args.ep} + fully_shard_model (dp {d.world // args.ep} x ep {args.ep})"
    else:
        mesh = init_device_mesh(d.device.type, (d.world,), mesh_dim_names=("dp",))
        how = f"hubfuse: fully_shard_model over {d.world} ranks (no EP)"
    per_unit, head_unit, embedding_rows = units
    if embedding_rows:
        distributed.shard_embedding(model, mesh, args.batch * args.seq)
        how += ", embedding rows sharded (shard_embedding)"
    distributed.fully_shard_model(model, mesh, mp_policy=mp, layers_per_unit=per_unit, head_unit=head_unit)
    if per_unit > 1:
        how += f", {per_unit} layers per FSDP unit"
    if not head_unit:
        how += ", lm_head in the root unit"
    return model, how


def moe_kernel():
    from kernels import get_kernel

    return get_kernel("hubfuse/moe", revision=REVISION)


def bound_kernels(model) -> list[str]:
    names = {getattr(m.__dict__["forward"], "__func__", m.__dict__["forward"]).__qualname__.split(".")[0]
             for name, m in model.named_modules() if name and "forward" in m.__dict__}
    return sorted(n for n in names if n not in ("SiLUActivation",))


def param_groups(model) -> list[dict]:
    """One optimizer parameter group per DTensor mesh (dense over all ranks, experts over their own 2-D mesh), so
    that the fused AdamW's multi-tensor launches never mix meshes."""
    groups: dict = {}
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        groups.setdefault(None if mesh is None else (tuple(mesh.mesh.flatten().tolist()), mesh.mesh_dim_names),
                          []).append(p)
    return [{"params": ps} for ps in groups.values()]


# ----------------------------------------------------------------------------------------------- variants

def variants(config: str, args, d: Dist) -> list[tuple[str, str | None]]:
    """(FSDP mode, EP dispatch or None) of every row measured on one loaded model."""
    if d.world == 1:
        return [("default", None)]
    dispatch = args.ep_dispatch if config != "hf" and args.ep > 1 else [None]
    return [(mode, ep) for ep in dispatch for mode in args.fsdp]


def variant_name(config: str, mode: str, dispatch: str | None, units: tuple = (1, True, False)) -> str:
    tags = [t for t in (dispatch, None if mode == "default" else mode, f"u{units[0]}" if units[0] > 1 else None,
                        None if units[1] else "headroot", "embrows" if units[2] else None) if t]
    return config + (f"[{','.join(tags)}]" if tags else "")


def set_fsdp_mode(model, mode: str) -> None:
    """FSDP2 settings of the decoder layers (and their own FSDP submodules: the experts), on a sharded model."""
    from torch.distributed.fsdp import FSDPModule

    from hubfuse import distributed

    layers = [layer for layer in distributed.decoder_layers(model) if isinstance(layer, FSDPModule)]
    units = [[layer] + [m for m in layer.modules() if m is not layer and isinstance(m, FSDPModule)]
             for layer in layers]
    for i, layer in enumerate(layers):
        nxt = [m for u in units[i + 1:i + 3] for m in u] if mode == "prefetch2" else []
        prev = [m for u in reversed(units[max(0, i - 2):i]) for m in reversed(u)] if mode == "prefetch2" else []
        layer.set_modules_to_forward_prefetch(nxt)
        layer.set_modules_to_backward_prefetch(prev)
        layer.set_reshard_after_forward(mode != "noreshard")


def set_ep_dispatch(model, dispatch: str | None, args) -> None:
    if dispatch is not None:
        chunks = EP_DISPATCH[dispatch]
        if chunks is None:
            moe_kernel().set_capacity(model, None)
        else:
            moe_kernel().set_capacity(model, args.batch * args.seq, chunks=chunks)


# ----------------------------------------------------------------------------------------------- one row

def run_one(config: str, path: Path, batches, args, d: Dist, cfg, record, units: tuple = (1, True, False)) -> None:
    """run_config; in a process on its own an exception (an OOM) becomes the row and the run goes on (with
    several ranks it cannot: the others would wait in a collective)."""
    import torch

    try:
        run_config(config, path, batches, args, d, cfg, record, units)
    except Exception as e:
        if d.world > 1:
            raise
        import gc

        oom = "out of memory" in str(e).lower()
        gc.collect()
        if d.device.type == "cuda":
            torch.cuda.empty_cache()
        record(dict(config=config, row=config, gpus=1, ep=1, layers=args.layers, status="oom" if oom else "error",
                    note=f"{type(e).__name__}: {str(e)[:300]}"), d)


def train_step(model, opt, batch):
    opt.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    return loss


def allocator_counts(cuda: bool) -> dict:
    """CUDA caching-allocator counters (cudaMalloc / cudaFree calls, free-cache-and-retry events: each of these
    synchronizes the device); their growth over the measured steps says whether a rank's steps allocate."""
    if not cuda:
        return {}
    import torch

    stats = torch.cuda.memory_stats()
    return {"cuda_mallocs": stats.get("num_device_alloc", 0), "cuda_frees": stats.get("num_device_free", 0),
            "alloc_retries": stats.get("num_alloc_retries", 0)}


def gpu_contexts(d: Dist) -> dict:
    """Which processes hold a CUDA context on which GPU (every rank calls it, once, after the first multi-GPU
    step): per rank, the devices on which it has a primary context (a rank with a context on another rank's GPU
    takes memory and time slices there) and, from rank 0, nvidia-smi's compute processes per GPU with the rank
    each pid belongs to (pids of other processes: `other`)."""
    import torch

    d.contexts_checked = True
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)  # private, hence optional
    mine = [i for i in range(torch.cuda.device_count()) if has_context(i)] if has_context else None
    ranks = d.gather(dict(rank=d.rank, pid=os.getpid(), device=d.device.index, contexts_on=mine))
    stray = [f"rank {r['rank']} on GPU {i}" for r in ranks for i in (r["contexts_on"] or []) if i != r["device"]]
    out = dict(ranks=ranks, stray=stray)
    if d.rank == 0:
        rank_of = {r["pid"]: r["rank"] for r in ranks}
        out["nvidia_smi"] = [dict(app, rank=rank_of.get(app["pid"], "other")) if isinstance(app, dict) else app
                             for app in nvidia_smi_apps()]
    return out


def nvidia_smi_apps() -> list:
    """nvidia-smi's compute processes: [{gpu, pid, name, used_MiB}], or one string saying why not."""
    import subprocess

    def query(what: str) -> list[str]:
        out = subprocess.run(["nvidia-smi", f"--query-{what}", "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
        return [line for line in out.splitlines() if line.strip()]

    try:
        index_of = {bus.strip(): int(i) for i, bus in (line.split(",", 1) for line in query("gpu=index,pci.bus_id"))}
        apps = []
        for line in query("compute-apps=gpu_bus_id,pid,used_memory,process_name"):
            bus, pid, used, name = (x.strip() for x in line.split(",", 3))
            apps.append(dict(gpu=index_of.get(bus, bus), pid=int(pid) if pid.isdigit() else pid,
                             used_MiB=int(used) if used.isdigit() else used, name=name))
        return apps
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        return [f"nvidia-smi: {type(e).__name__}: {e}"]


def run_config(config: str, path: Path, batches, args, d: Dist, cfg, record, units: tuple = (1, True, False)) -> None:
    """Load one configuration, then measure each of its variants (one row each) on the same model."""
    import gc

    import torch

    t0 = time.time()
    model, how = load(config, path, args, d, cfg, units)
    load_s = round(time.time() - t0, 1)
    kernels = bound_kernels(model) if config != "hf" else None
    cuda = d.device.type == "cuda"
    if args.optimizer == "hubfuse":
        from hubfuse.optim import AdamW

        opt = AdamW(param_groups(model), lr=1e-5, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(param_groups(model), lr=1e-5, weight_decay=0.01, fused=cuda)
    for mode, dispatch in variants(config, args, d):
        name = variant_name(config, mode, dispatch, units)
        row = dict(config=config, row=name, fsdp=mode, ep_dispatch=dispatch, gpus=d.world,
                   ep=args.ep if d.world > 1 else 1, layers=args.layers, seq=args.seq, batch=args.batch,
                   tokens_per_gpu_step=args.batch * args.seq, sharding=how, load_s=load_s,
                   activation_checkpointing=args.activation_checkpointing)
        if kernels is not None:
            row["kernels"] = kernels
        if d.world > 1:
            set_fsdp_mode(model, mode)
            set_ep_dispatch(model, dispatch, args)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times, enqueue, losses = [], [], []
        gc.collect()
        gc.disable()  # no collector pause inside a step, on any rank (a pause on one rank stalls the others)
        try:
            for i, batch in enumerate(batches):
                if i == args.warmup:
                    allocs = allocator_counts(cuda)
                    if cuda:
                        torch.cuda.reset_peak_memory_stats()
                d.barrier()
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                loss = train_step(model, opt, batch)
                queued = time.perf_counter() - start  # the host's share: train_step returned, the GPU may still run
                if cuda:
                    torch.cuda.synchronize()
                dt = time.perf_counter() - start
                losses.append(loss.item())
                if i >= args.warmup:
                    times.append(dt)
                    enqueue.append(queued)
                if i == 0 and cuda and not d.contexts_checked:
                    row["gpu_contexts"] = gpu_contexts(d)
                if d.rank == 0 and (i < args.warmup or i == len(batches) - 1 or (i - args.warmup) % 5 == 4):
                    log(f"[{name} x {d.world}] {'warm-up' if i < args.warmup else 'step'} {i + 1}/{len(batches)}: "
                        f"{dt * 1e3:.0f} ms (host {queued * 1e3:.0f} ms), loss {losses[-1]:.4f}, {elapsed()}")
            allocs = {k: v - allocs[k] for k, v in allocator_counts(cuda).items()}
            median = d.reduce(statistics.median(times), "max")  # the slowest rank sets the pace
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
            tps = row["tokens_per_gpu_step"] / median
            row.update(status="ok", step_ms_median=round(median * 1e3, 1), tokens_per_s_per_gpu=round(tps, 1),
                       tflops_per_gpu=round(tps * args.flops_per_token / 1e12, 1),
                       peak_mem_GiB_per_gpu=round(d.reduce(peak, "max"), 2),
                       loss_step1=round(d.reduce(losses[0], "mean"), 4),
                       loss_last=round(d.reduce(losses[-1], "mean"), 4),
                       per_rank=d.gather(dict(rank=d.rank, enqueue_ms=round(statistics.median(enqueue) * 1e3, 1),
                                              step_ms=round(statistics.median(times) * 1e3, 1), **allocs)))
            if not all(math.isfinite(x) for x in losses):
                row.update(status="error", note=f"non-finite loss {losses}")
            if args.back_to_back:
                row.update(back_to_back(model, opt, batches[args.warmup:] or batches, args, d, row))
            if config != "hf":
                row["expert_load"] = expert_load(model, batches[0], args, d)
            if args.profile:
                safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")  # plain file names: ours[fixed] -> ours_fixed
                trace = Path(args.trace) / f"trace_{safe}_{d.world}gpu_rank{d.rank}.json.gz" if args.trace else None
                row["profile"] = profile(lambda: train_step(model, opt, batches[0]), args.profile, d, trace)
        finally:
            gc.enable()
        record(row, d)
    del model, opt
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    d.barrier()


def back_to_back(model, opt, batches, args, d: Dist, row) -> dict:
    """--back-to-back: args.steps more steps with no synchronisation between them (the host may run ahead across
    step boundaries, as in a loop that reads the loss every N steps); one synchronize at the end. The rate over
    the whole run, the slowest rank's."""
    import torch

    cuda = d.device.type == "cuda"
    d.barrier()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(args.steps):
        train_step(model, opt, batches[i % len(batches)])
    if cuda:
        torch.cuda.synchronize()
    step_s = d.reduce((time.perf_counter() - start) / args.steps, "max")
    return dict(b2b_step_ms=round(step_s * 1e3, 1), b2b_tokens_per_s_per_gpu=round(row["tokens_per_gpu_step"] / step_s, 1))


def expert_load(model, batch, args, d: Dist) -> dict | None:
    """Routed slots that each EP rank's experts get, per MoE layer, summed over every rank's tokens, from one extra
    forward (no grad) of the first batch: max / mean over the EP ranks per layer. Every layer's exchanges wait
    for the slowest rank, so an uneven routing (a fresh router) is a straggler of its own."""
    import torch
    import torch.distributed as dist

    modules = [m for _, m in moe_kernel().expert_parallel.expert_modules(model)]
    if d.world == 1 or args.ep <= 1 or not modules:
        return None
    counts = []

    def count(module, inputs, kwargs):
        index = inputs[1] if len(inputs) > 1 else kwargs["top_k_index"]
        per_rank = module.gate_up_proj.shape[0] // args.ep  # global shape: DTensor
        ranks = torch.div(index.reshape(-1).long(), per_rank, rounding_mode="floor").clamp(0, args.ep)
        counts.append(torch.bincount(ranks, minlength=args.ep + 1)[:args.ep].float())

    handles = [m.register_forward_pre_hook(count, with_kwargs=True) for m in modules]
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for h in handles:
            h.remove()
    load = torch.stack(counts)  # (MoE layers, ep): this rank's tokens' slots per destination rank
    dist.all_reduce(load)
    ratio = (load.max(1).values / load.mean(1)).tolist()
    return dict(max_over_mean=[round(x, 3) for x in ratio], mean=round(sum(ratio) / len(ratio), 3))


def one_gpu_reference(rows, meta, args) -> dict:
    """config -> one-GPU tokens/s: this run's one-GPU rows (--one-gpu-reference), else --reference's JSON (used only
    if it has the same layers, seq and batch)."""
    ref = {r["config"]: r["tokens_per_s_per_gpu"] for r in rows if r.get("gpus") == 1 and r.get("status") == "ok"}
    if args.reference and not ref:
        data = json.loads(Path(args.reference).read_text())
        same = all(data["meta"].get(k) == meta.get(k) for k in ("layers", "seq", "batch"))
        ref = {r["config"]: r["tokens_per_s_per_gpu"] for r in data["results"]
               if r.get("status") == "ok" and r.get("gpus", 1) == 1 and same}
        meta["reference"] = dict(path=args.reference, matched=same)
    return ref


def _one_gpu_config(config: str) -> str:
    """The one-GPU row a configuration scales from (ours_fsdp differs from ours only in the sharding)."""
    return "ours" if config == "ours_fsdp" else config


def tag_of(args, d: Dist) -> str:
    return f"{args.model}_{args.layers}l_" + ("1gpu" if d.world == 1 else f"{d.world}gpu_ep{args.ep}")


def finish(rows, meta, args, d: Dist) -> list[str]:
    """MFU, x hf, scaling efficiency; JSON + markdown under --out; returns the table lines."""
    ref = one_gpu_reference(rows, meta, args)
    peak = args.peak_tflops or meta.get("peak_tflops")
    hf_tps = {r["gpus"]: r["tokens_per_s_per_gpu"] for r in rows
              if r.get("row") == "hf" and r.get("status") == "ok"}
    for r in rows:
        if r.get("status") != "ok":
            continue
        r["mfu"] = round(r["tflops_per_gpu"] / peak, 3) if peak else None
        hf = hf_tps.get(r["gpus"])
        r["x_hf"] = round(r["tokens_per_s_per_gpu"] / hf, 2) if hf else None
        r["scaling_efficiency"] = 1.0 if r["gpus"] == 1 else (
            round(r["tokens_per_s_per_gpu"] / ref[one], 3) if (one := _one_gpu_config(r["config"])) in ref else None)
    lines = [f"{MODELS[args.model][2]}, {args.layers} layers, {meta['device']} x {d.world}, "
             f"{args.batch} x {args.seq} tokens per GPU per step, bf16 weights and AdamW states"
             f"{', activation checkpointing per layer' if args.activation_checkpointing else ''}, median of "
             f"{args.steps} steps after {args.warmup} warm-up; torch {meta['torch']}, transformers "
             f"{meta['transformers']}, kernels {meta['kernels']}, triton {meta['triton']}; MFU over {peak} TFLOP/s "
             f"per GPU; {meta['flops_per_token'] / 1e9:.2f} GFLOP/token.",
             f"Command: `{meta['command']}`", "",
             "| config | GPUs | EP | tok/s/GPU | x hf | TFLOP/s/GPU | MFU | peak GiB/GPU | scaling eff. | step ms | "
             "loss 1 | loss last | sharding |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]

    def f(v, spec):
        return "" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)

    for r in rows:
        lines.append(f"| {r['row']} | {r['gpus']} | {r['ep']} | {f(r.get('tokens_per_s_per_gpu'), '.0f')} | "
                     f"{f(r.get('x_hf'), '.2f')} | {f(r.get('tflops_per_gpu'), '.0f')} | {f(r.get('mfu'), '.1%')} | "
                     f"{f(r.get('peak_mem_GiB_per_gpu'), '.1f')} | {f(r.get('scaling_efficiency'), '.2f')} | "
                     f"{f(r.get('step_ms_median'), '.0f')} | {f(r.get('loss_step1'), '.3f')} | "
                     f"{f(r.get('loss_last'), '.3f')} | {r.get('note') or r.get('sharding', '')} |")
    b2b = [r for r in rows if r.get("b2b_step_ms")]
    if b2b:
        ref_b2b = {r["config"]: r["b2b_tokens_per_s_per_gpu"] for r in b2b if r["gpus"] == 1}
        lines += ["", f"Back to back (--back-to-back: {args.steps} more steps with one synchronize at the end; the host "
                      "may run ahead across steps; scaling against the one-GPU row measured so):", "",
                  "| config | GPUs | tok/s/GPU | step ms | scaling eff. |", "| --- | ---: | ---: | ---: | ---: |"]
        for r in b2b:
            one = ref_b2b.get(_one_gpu_config(r["config"]))
            eff = 1.0 if r["gpus"] == 1 else (round(r["b2b_tokens_per_s_per_gpu"] / one, 3) if one else None)
            r["b2b_scaling_efficiency"] = eff
            lines.append(f"| {r['row']} | {r['gpus']} | {r['b2b_tokens_per_s_per_gpu']:.0f} | {r['b2b_step_ms']:.1f} | "
                         f"{f(eff, '.2f')} |")
    lines += per_rank_lines(rows)
    loads = [r for r in rows if r.get("expert_load")]
    if loads:
        lines += ["", "Expert load (one extra forward of the first batch: routed slots per EP rank, summed over every "
                      "rank's tokens; max / mean over the EP ranks, per MoE layer, and its mean over the layers):", ""]
        lines += [f"- {r['row']} x {r['gpus']}: mean {r['expert_load']['mean']:.3f}; per layer "
                  + ", ".join(f"{x:.2f}" for x in r["expert_load"]["max_over_mean"]) for r in loads]
    profiled = [r for r in rows if r.get("profile")]
    if profiled:
        lines += ["", f"Profile (torch.profiler, {args.profile} step(s) per row after the measured ones; ms per step "
                      "per rank; comm = busy / exposed (not overlapped by compute); host syncs = "
                      "cudaStreamSynchronize + cudaEventSynchronize calls per step and their ms; sync sites = the CPU "
                      "ops around them, the two most frequent, with their count over the profiled steps):", "",
                  "| config | GPUs | rank | GPU span | compute | all-gather | reduce-scatter | all-to-all | all-reduce "
                  "| GPU idle | host syncs | sync sites |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in profiled:
            for rank, prof in enumerate(r["profile"]):
                comm = [f"{prof[c]['busy_ms']:.1f} / {prof[c]['exposed_ms']:.1f}" for c in COMM_KINDS]
                lines.append(f"| {r['row']} | {r['gpus']} | {rank} | {prof['span_ms']:.1f} | {prof['compute_ms']:.1f} "
                             f"| {' | '.join(comm)} | {prof['idle_ms']:.1f} | {prof['host_syncs']:.0f} "
                             f"({prof['host_sync_ms']:.1f}) | "
                             + "; ".join(f"{site} x{n}" for site, n in list(prof.get("host_sync_sites", {}).items())[:2])
                             + " |")
    for r in profiled:
        top = r["profile"][0].get("top_kernels")
        if top:
            lines += ["", f"{r['row']} x {r['gpus']}, rank 0: compute kernels with the most GPU time (ms per step, "
                          "calls per step); collectives by kind: calls per step x median ms (min ms): "
                          + ", ".join(f"{k} {r['profile'][0][k]['calls']:.0f} x {r['profile'][0][k]['median_ms']:.2f}"
                                      f" (min {r['profile'][0][k]['min_ms']:.2f})" for k in COMM_KINDS
                                      if r["profile"][0][k].get("calls")), "",
                      "| kernel | ms | calls |", "| --- | ---: | ---: |"]
            lines += [f"| `{name}` | {ms:.2f} | {calls:.0f} |" for name, ms, calls in top]
    if d.rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        tag = tag_of(args, d)
        (out / f"bench_distributed_{tag}.json").write_text(json.dumps(dict(meta=meta, results=rows), indent=1))
        (out / f"bench_distributed_{tag}.md").write_text("\n".join(lines) + "\n")
        if profiled:
            (out / f"bench_distributed_{tag}_profile.json").write_text(json.dumps(
                {r["row"] + f" x {r['gpus']}": r["profile"] for r in profiled}, indent=1))
    return lines


def per_rank_lines(rows) -> list[str]:
    """The straggler view: per row and rank, the medians of the host's enqueue time (step start until train_step
    returns) and of the step time, the cudaMalloc / cudaFree / retry counts over the measured steps; then the
    CUDA contexts seen after the first multi-GPU step."""
    measured = [r for r in rows if r.get("per_rank")]
    if not measured:
        return []
    lines = ["", "Per rank (median over the measured steps; host = step start until train_step returns, before the "
                 "synchronize; a rank whose host time is near its step time is launch-bound; allocator = cudaMalloc / "
                 "cudaFree / free-and-retry calls during the measured steps):", "",
             "| config | GPUs | rank | host ms | step ms | allocator |", "| --- | ---: | ---: | ---: | ---: | --- |"]
    for r in measured:
        for p in r["per_rank"]:
            alloc = " / ".join(str(p[k]) for k in ("cuda_mallocs", "cuda_frees", "alloc_retries") if k in p)
            lines.append(f"| {r['row']} | {r['gpus']} | {p['rank']} | {p['enqueue_ms']:.1f} | {p['step_ms']:.1f} "
                         f"| {alloc} |")
    for r in rows:
        ctx = r.get("gpu_contexts")
        if not ctx:
            continue
        owners = [f"GPU {a['gpu']}: {'rank ' + str(a['rank']) if a['rank'] != 'other' else 'other'} (pid "
                  f"{a['pid']}, {a['used_MiB']} MiB)" if isinstance(a, dict) else a for a in ctx.get("nvidia_smi", [])]
        lines += ["", f"CUDA contexts after the first {r['gpus']}-GPU step: per rank, devices with a primary context: "
                      + ", ".join(f"rank {c['rank']}: {c['contexts_on']}" for c in ctx["ranks"])
                      + f"; on another rank's GPU: {', '.join(ctx['stray']) or 'none'}; nvidia-smi: "
                      + ("; ".join(owners) or "no compute processes listed")]
    return lines


# ----------------------------------------------------------------------------------------------- profile

COMM_KINDS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")
_HOST_SYNCS = ("cudaStreamSynchronize", "cudaEventSynchronize")


def _comm_kind(kernel: str) -> str | None:
    """NCCL kernel name -> COMM_KINDS entry (all-to-all runs as grouped send/recv), None for compute."""
    k = kernel.lower()
    if "nccl" not in k:
        return None
    if "allgather" in k:
        return "all_gather"
    if "reducescatter" in k:
        return "reduce_scatter"
    if "allreduce" in k:
        return "all_reduce"
    return "all_to_all"  # SendRecv / AllToAll (and any other p2p)


def _union(intervals) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(union) -> float:
    return sum(b - a for a, b in union)


def _overlap(u, v) -> float:
    """Length of the intersection of two unions of sorted disjoint intervals."""
    i = j = 0
    total = 0.0
    while i < len(u) and j < len(v):
        a, b = max(u[i][0], v[j][0]), min(u[i][1], v[j][1])
        total += max(0.0, b - a)
        if u[i][1] < v[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize_trace(trace: dict, steps: int) -> dict:
    """Per-step breakdown (ms) of one rank's chrome trace: GPU span, compute busy, each NCCL kind busy and exposed
    (outside compute), idle, host syncs, and where the syncs come from (`host_sync_sites`: the last 3 CPU ops
    enclosing each sync, outermost first -> how many)."""
    compute, comm = [], {c: [] for c in COMM_KINDS}
    sync_events, cpu_ops = [], {}
    for e in trace.get("traceEvents", []):
        cat, dur = e.get("cat", ""), e.get("dur")
        if dur is None:
            continue
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kind = _comm_kind(e.get("name", "")) if cat == "kernel" else None
            (comm[kind] if kind else compute).append((float(e["ts"]), float(e["ts"]) + float(dur)))
        elif cat == "cuda_runtime" and e.get("name") in _HOST_SYNCS:
            sync_events.append(e)
        elif cat in ("cpu_op", "user_annotation"):
            cpu_ops.setdefault(e.get("tid"), []).append((float(e["ts"]), float(e["ts"]) + float(dur), e.get("name")))
    sites: dict[str, int] = {}
    for e in sync_events:
        t = float(e["ts"])
        around = sorted((a, -b, name) for a, b, name in cpu_ops.get(e.get("tid"), []) if a <= t <= b)
        site = " > ".join(name for _, _, name in around[-3:]) or "(no CPU op)"
        sites[site] = sites.get(site, 0) + 1
    every = [iv for ivs in [compute, *comm.values()] for iv in ivs]
    busy = _union(compute)
    span = (max(b for _, b in every) - min(a for a, _ in every)) if every else 0.0
    out = dict(span_ms=span / steps / 1e3, compute_ms=_length(busy) / steps / 1e3,
               idle_ms=(span - _length(_union(every))) / steps / 1e3, host_syncs=len(sync_events) / steps,
               host_sync_ms=sum(float(e["dur"]) for e in sync_events) / steps / 1e3,
               host_sync_sites=dict(sorted(sites.items(), key=lambda kv: -kv[1])))
    for kind, ivs in comm.items():
        u = _union(ivs)
        durs = sorted(b - a for a, b in ivs)
        out[kind] = dict(busy_ms=_length(u) / steps / 1e3, exposed_ms=(_length(u) - _overlap(u, busy)) / steps / 1e3,
                         calls=len(ivs) / steps, median_ms=durs[len(durs) // 2] / 1e3 if durs else 0.0,
                         min_ms=durs[0] / 1e3 if durs else 0.0)
    out["top_kernels"] = _top_kernels(trace, steps)
    return out


def _top_kernels(trace: dict, steps: int, n: int = 15) -> list[list]:
    """The n compute kernels with the most GPU time: [name (first 90 chars), ms per step, calls per step]."""
    total: dict[str, list] = {}
    for e in trace.get("traceEvents", []):
        if e.get("cat") == "kernel" and e.get("dur") is not None and _comm_kind(e.get("name", "")) is None:
            t = total.setdefault(e["name"][:90], [0.0, 0])
            t[0] += float(e["dur"])
            t[1] += 1
    top = sorted(total.items(), key=lambda kv: -kv[1][0])[:n]
    return [[name, round(us / steps / 1e3, 3), c / steps] for name, (us, c) in top]


def profile(step, steps: int, d: Dist, trace: Path | None = None) -> list[dict]:
    """`steps` calls of `step` under torch.profiler on every rank; every rank's summary (gathered), rank order.
    trace: also write this rank's chrome trace there (gzip)."""
    import tempfile

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if d.device.type == "cuda" else [])
    # Kineto leaves CUPTI's kernel instrumentation on after the profile unless TEARDOWN_CUPTI=1 (pytorch/pytorch
    # #144455): every later step of this process would run instrumented, and this process (rank 0, which also
    # profiles the one-GPU rows) would run slower than the others. No CUDA graphs here (the reason torch turns it off).
    os.environ.setdefault("TEARDOWN_CUPTI", "1")
    d.barrier()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if d.device.type == "cuda":
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        text = path.read_text()
        summary = summarize_trace(json.loads(text), steps)
        if trace is not None:
            import gzip

            trace.parent.mkdir(parents=True, exist_ok=True)
            with gzip.open(trace, "wt") as f:
                f.write(text)
    summary["rank"] = d.rank
    if d.world == 1:
        return [summary]
    gathered = [None] * d.world
    dist.all_gather_object(gathered, summary)
    return gathered


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--single-gpu", action="store_true", help="one process, one GPU, no FSDP: the per-GPU proxy")
    p.add_argument("--model", choices=list(MODELS), default="qwen3_30b_a3b", help="the widths (default Qwen3-30B-A3B)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 48; --single-gpu 8; smoke 2)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 4096; smoke 32)")
    p.add_argument("--batch", type=int, default=None, help="sequences per GPU per step (default 2; smoke 2)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size (default: the world size)")
    p.add_argument("--sharding", choices=("transformers", "hubfuse"), default="transformers")
    p.add_argument("--optimizer", choices=("torch", "hubfuse"), default="torch",
                   help="torch's fused AdamW (default) or hubfuse.optim.AdamW (its kernel on each local shard)")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--steps", type=int, default=None, help="measured steps (default 10; smoke 2)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3; smoke 1)")
    p.add_argument("--activation-checkpointing", action="store_true", help="gradient checkpointing per layer")
    p.add_argument("--fsdp", nargs="+", default=["default"], choices=list(FSDP_MODES),
                   help="FSDP2 prefetch / reshard settings, one row each (several GPUs)")
    p.add_argument("--ep-dispatch", nargs="+", default=["fixed"], choices=list(EP_DISPATCH),
                   help="ours with EP: fixed = sync-free fixed-capacity exchange, fixed2 = the same pipelined in 2 "
                        "chunks with the experts (all-to-alls under the expert GEMMs), sized = host-read split sizes")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="N steps under torch.profiler after every row's measured steps (per-rank breakdown)")
    p.add_argument("--layers-per-unit", type=int, nargs="+", default=[1], metavar="N",
                   help="hubfuse-sharded rows (ours_fsdp, --sharding hubfuse): decoder layers per FSDP unit "
                        "(fully_shard_model(layers_per_unit=N)), one loaded model and row set per N (tag uN)")
    p.add_argument("--head-unit", nargs="+", default=["own"], choices=("own", "root"),
                   help="hubfuse-sharded rows: lm_head as its own FSDP unit (fully_shard_model(head_unit=True), "
                        "the default) or inside the root unit (tag headroot); one loaded model per choice")
    p.add_argument("--embedding", nargs="+", default=["fsdp"], choices=("fsdp", "rows"),
                   help="hubfuse-sharded rows: the input embedding in the root FSDP unit, or row-sharded by "
                        "hubfuse.distributed.shard_embedding (tag embrows); one loaded model per choice")
    p.add_argument("--back-to-back", action="store_true",
                   help="after the measured steps, as many more with no synchronisation between them (a table of its own)")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="with --profile: each rank's chrome trace of every profiled row, gzipped, into DIR")
    p.add_argument("--one-gpu-reference", nargs="?", const="last", choices=("first", "last"), default=None,
                   help="several GPUs: rank 0 also runs the configs alone on its GPU (the others wait at a barrier), "
                        "for the scaling efficiency (the model must fit one GPU); last (the default) after the "
                        "multi-GPU rows, so that nothing of it (memory, profiler state) is left on rank 0 during them")
    p.add_argument("--reference", help="JSON of a --single-gpu run (same layers/seq/batch): scaling efficiency")
    p.add_argument("--peak-tflops", type=float, help="per-GPU peak for MFU (default: by device name)")
    p.add_argument("--model-dir", default=None, help="where rank 0 builds the checkpoint (default: /tmp/...)")
    p.add_argument("--out", default=None, help="output dir (default $OUT or ./out)")
    p.add_argument("--smoke", action="store_true", help="CPU (gloo) with tiny dims: checks the script")
    p.add_argument("--init-method", default=None,
                   help="process-group rendezvous (default: torchrun's env://; e.g. file:///tmp/store)")
    args = p.parse_args(argv)
    defaults = dict(seq=32, batch=2, steps=2, warmup=1, layers=2) if args.smoke else \
        dict(seq=4096, batch=2, steps=10, warmup=3, layers=8 if args.single_gpu else 48)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.out = args.out or os.environ.get("OUT") or str(ROOT / "out")

    import torch

    if not args.smoke and not torch.cuda.is_available():
        log("bench_distributed: no CUDA device (use --smoke for the CPU check)")
        return 2
    d = Dist(args.smoke, args.single_gpu, args.init_method)
    args.ep = args.ep or d.world
    import logging

    import transformers

    logging.getLogger("kernels").setLevel(logging.ERROR)  # "no kernel mapping for SiLU" on every kernelize
    transformers.utils.logging.disable_progress_bar()
    if d.rank != 0:
        transformers.utils.logging.set_verbosity_error()
        logging.getLogger("hubfuse").setLevel(logging.ERROR)
    try:
        import bench
        from hubfuse import presets

        slice_name, family, _ = MODELS[args.model]
        cfg = bench.slice_config(slice_name, args.layers, args.smoke)
        if d.world > 1 and (d.world % args.ep or cfg.num_experts % args.ep):
            raise SystemExit(f"bench_distributed: --ep {args.ep} must divide the world size {d.world} and the "
                             f"{cfg.num_experts} experts")
        args.flops_per_token = flops_per_token(cfg, args.seq)
        local_kernels(d, presets.kernel_repos(family))
        model_dir = Path(args.model_dir or f"/tmp/hubfuse_bench_models/{'smoke' if args.smoke else 'gpu'}") / \
            f"{slice_name}_{args.layers}l"
        t0 = time.time()
        if d.rank == 0:  # without the routed experts: each configuration initializes its own shards of them
            bench.ensure_model(slice_name, model_dir, args, d.device.type, routed_experts=False)
        d.barrier()
        checkpoint_s = round(time.time() - t0, 1)
        import importlib.metadata as md

        name = torch.cuda.get_device_name(d.device) if d.device.type == "cuda" else "cpu (smoke)"
        meta = dict(command=("torchrun ... " if d.world > 1 else "python ") + "scripts/bench_distributed.py "
                    + " ".join(sys.argv[1:] if argv is None else argv),
                    model=args.model, device=name, world=d.world, ep=args.ep, layers=args.layers, seq=args.seq,
                    batch=args.batch, steps=args.steps, warmup=args.warmup, sharding=args.sharding,
                    optimizer=args.optimizer,
                    activation_checkpointing=args.activation_checkpointing,
                    flops_per_token=args.flops_per_token, checkpoint_s=checkpoint_s, torch=torch.__version__,
                    peak_tflops=next((v for k, v in PEAK_TFLOPS.items() if k in name), None))
        for dist_name in ("transformers", "kernels", "triton"):
            try:
                meta[dist_name] = md.version(dist_name)
            except md.PackageNotFoundError:
                meta[dist_name] = None
        g = torch.Generator().manual_seed(1234 + d.rank)  # each rank its own tokens; the same for every config
        batches = []
        for _ in range(args.warmup + args.steps):
            ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).to(d.device)
            batches.append({"input_ids": ids, "labels": ids})
        if d.rank == 0:
            log(f"bench_distributed: {args.model}, {d.world} x {name}, {args.layers} layers, {args.batch} x "
                f"{args.seq} tokens per GPU, ep {args.ep}, configs {args.configs}, fsdp {args.fsdp}, ep dispatch "
                f"{args.ep_dispatch}, {args.flops_per_token / 1e9:.1f} GFLOP/token; checkpoint ready in {checkpoint_s} s, "
                f"{elapsed()}")
        rows, lines = [], []

        def record(row, where):
            nonlocal lines
            if where.world == 1 and d.world > 1:
                row["note"] = "one-GPU reference (rank 0 alone)"
            rows.append(row)
            if d.rank == 0:
                lines = finish(rows, meta, args, d)
                log(f"[{row['row']} x {where.world}] {row['status']}: {row.get('tokens_per_s_per_gpu')} tok/s/GPU, "
                    f"{row.get('tflops_per_gpu')} TFLOP/s/GPU, peak {row.get('peak_mem_GiB_per_gpu')} GiB/GPU, "
                    f"{row.get('note') or row.get('sharding')}, load {row.get('load_s')} s, {elapsed()}")

        def one_gpu_rows():
            if d.rank == 0:  # alone on its GPU: no collective until the barrier below
                for config in dict.fromkeys(_one_gpu_config(c) for c in args.configs):
                    run_one(config, model_dir, batches, args, Dist.alone(d), cfg, record)
            d.barrier()  # the other ranks wait here meanwhile

        reference = args.one_gpu_reference if d.world > 1 else None
        if reference == "first":
            one_gpu_rows()
        for config in args.configs:
            hubfuse_sharded = d.world > 1 and (config == "ours_fsdp" or args.sharding == "hubfuse")
            for per_unit in (args.layers_per_unit if hubfuse_sharded else [1]):
                for head in (args.head_unit if hubfuse_sharded else ["own"]):
                    for embedding in (args.embedding if hubfuse_sharded else ["fsdp"]):
                        run_one(config, model_dir, batches, args, d, cfg, record,
                                (per_unit, head == "own", embedding == "rows"))
        if reference == "last":
            one_gpu_rows()
        if d.rank == 0:
            log("\n".join(lines))
    finally:
        d.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
