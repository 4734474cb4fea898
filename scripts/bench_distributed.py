#!/usr/bin/env python
"""Qwen3-30B-A3B training throughput under FSDP2 (+ expert parallelism): our kernels vs HF + FSDP2 eager.

Qwen3-30B-A3B widths (hidden 2048, 128 experts top-8, moe_intermediate 768, 32/4 heads, head_dim 128, vocab
151936, router aux loss on), `--layers` decoder layers (48 = the full model), bf16 weights, random init (a
checkpoint built once by rank 0 under --model-dir), random tokens, `--batch` x `--seq` tokens per GPU per step.
One training step = forward + backward + AdamW (fused on CUDA). Configurations, in the same run, same weights
and batches:

  hf    transformers 5.22.2 stock: experts_implementation="grouped_mm", sdpa attention, HF losses
  ours  hubfuse.KernelConfig(presets.kernel_mapping("qwen3_moe")) + presets.enable_losses (fused linear
        cross-entropy, fused aux loss with its statistics reduced over all ranks)

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
--single-gpu: one process, no process group, the 8-layer slice (the per-GPU proxy), no FSDP.

Reported per config: tokens/s/GPU (batch*seq / median step time, the slowest rank's), MFU (model FLOPs per
token: 6 x active matmul parameters + 6 x layers x seq x heads x head_dim for causal attention, over
--peak-tflops, default 989 for H100/H200 bf16 dense), peak memory per GPU (max over ranks of
max_memory_allocated over the measured steps), loss of the first and last step (mean over ranks), and the
scaling efficiency: tokens/s/GPU over the one-GPU tokens/s of the same config, depth, seq and batch, read from
--one-gpu-reference (rank 0 first runs the configs alone on its GPU, the other ranks wait) or --reference (the
JSON of a --single-gpu run with the same --layers). Writes $OUT/bench_distributed_<tag>.json and .md (OUT
defaults to ./out; tag "1gpu" or "<N>gpu_ep<ep>") after every config, and prints the table.

    python scripts/bench_distributed.py --single-gpu                                  # 1 GPU, 8 layers
    torchrun --standalone --nproc-per-node 8 scripts/bench_distributed.py --layers 48 --ep 8
    torchrun --standalone --nproc-per-node 8 scripts/bench_distributed.py --layers 8 --ep 8 \\
        --one-gpu-reference                                                           # scaling at 8 layers
    torchrun --standalone --nproc-per-node 2 scripts/bench_distributed.py --smoke     # CPU, gloo, tiny dims
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT / "scripts", ROOT / "torch-ext", ROOT):
    sys.path.insert(0, str(p))

SLICE = "qwen3_30b_a3b"  # scripts/bench.py's slice: the Qwen3-30B-A3B config
FAMILY = "qwen3_moe"
REVISION = "v1"
CONFIGS = ("hf", "ours")
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "H800": 989.4, "H20": 148.0, "B200": 2250.0, "A100": 312.0}


def log(msg: str) -> None:
    print(msg, flush=True)


def flops_per_token(cfg, seq: int) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward): matmuls of the active parameters (attention
    projections, router, top-k experts, lm_head) and causal attention (average context seq / 2)."""
    h, d_attn, d_kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = (2 * h * d_attn + 2 * h * d_kv + h * cfg.num_experts
                 + cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size)
    active = cfg.num_hidden_layers * per_layer + h * cfg.vocab_size
    return 6.0 * active + 6.0 * cfg.num_hidden_layers * seq * d_attn


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

    @classmethod
    def alone(cls, other: "Dist") -> "Dist":
        """This process on its own (world 1, no collectives), on `other`'s device."""
        d = cls.__new__(cls)
        d.world, d.rank, d.local_rank, d.device = 1, 0, other.local_rank, other.device
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


def load(config: str, path: Path, args, d: Dist):
    """(model, how it is sharded) for one configuration."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hubfuse import KernelConfig, distributed, presets

    kw = dict(dtype=torch.bfloat16, attn_implementation="sdpa")
    if config == "hf":
        kw["experts_implementation"] = "grouped_mm"
    else:
        kw.update(use_kernels=True, kernel_config=KernelConfig(presets.kernel_mapping(FAMILY, revision=REVISION)))
    tf_sharded = d.world > 1 and args.sharding == "transformers"
    if tf_sharded:
        from transformers.distributed import DistributedConfig

        kw["distributed_config"] = DistributedConfig(fsdp_size=d.world, ep_size=args.ep, fsdp_mixed_precision=True)
    else:
        kw["device_map"] = d.device
    model = AutoModelForCausalLM.from_pretrained(path, **kw)
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    if config == "ours":
        presets.enable_losses(model, FAMILY, revision=REVISION, aux_loss_group=dist.group.WORLD if d.world > 1 else None)
    if d.world == 1:
        return model, "none (one GPU)"
    if tf_sharded:
        distributed.fix_single_rank_expert_reduction(model)
        return model, f"transformers distributed_config fsdp {d.world} ep {args.ep}"
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if config == "ours" and args.ep > 1:
        from kernels import get_kernel

        mesh = init_device_mesh(d.device.type, (d.world // args.ep, args.ep), mesh_dim_names=("dp", "ep"))
        get_kernel("hubfuse/moe", revision=REVISION).shard_experts(model, mesh["ep"])
        how = f"hubfuse: shard_experts ep {args.ep} + fully_shard_model (dp {d.world // args.ep} x ep {args.ep})"
    else:
        mesh = init_device_mesh(d.device.type, (d.world,), mesh_dim_names=("dp",))
        how = f"hubfuse: fully_shard_model over {d.world} ranks (no EP)"
    distributed.fully_shard_model(model, mesh, mp_policy=mp)
    return model, how


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


def run_one(config: str, path: Path, batches, args, d: Dist, cfg) -> dict:
    """run_config; in a process on its own an exception (an OOM) becomes the row and the run goes on (with
    several ranks it cannot: the others would wait in a collective)."""
    import torch

    try:
        return run_config(config, path, batches, args, d, cfg)
    except Exception as e:
        if d.world > 1:
            raise
        import gc

        oom = "out of memory" in str(e).lower()
        gc.collect()
        if d.device.type == "cuda":
            torch.cuda.empty_cache()
        return dict(config=config, gpus=1, ep=1, layers=args.layers, status="oom" if oom else "error",
                    note=f"{type(e).__name__}: {str(e)[:300]}")


def run_config(config: str, path: Path, batches, args, d: Dist, cfg) -> dict:
    import torch

    row = dict(config=config, gpus=d.world, ep=args.ep if d.world > 1 else 1, layers=args.layers, seq=args.seq,
               batch=args.batch, tokens_per_gpu_step=args.batch * args.seq)
    t0 = time.time()
    model, how = load(config, path, args, d)
    row.update(sharding=how, load_s=round(time.time() - t0, 1))
    if config == "ours":
        row["kernels"] = bound_kernels(model)
    cuda = d.device.type == "cuda"
    opt = torch.optim.AdamW(param_groups(model), lr=1e-5, weight_decay=0.01, fused=cuda)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i, batch in enumerate(batches):
        if i == args.warmup and cuda:
            torch.cuda.reset_peak_memory_stats()
        d.barrier()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - start
        losses.append(loss.item())
        if i >= args.warmup:
            times.append(dt)
        if d.rank == 0 and (i < args.warmup or i == len(batches) - 1 or (i - args.warmup) % 5 == 4):
            log(f"[{config}] {'warm-up' if i < args.warmup else 'step'} {i + 1}/{len(batches)}: {dt * 1e3:.0f} ms, "
                f"loss {losses[-1]:.4f}")
    median = d.reduce(statistics.median(times), "max")  # the slowest rank sets the pace
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    tps = row["tokens_per_gpu_step"] / median
    row.update(status="ok", step_ms_median=round(median * 1e3, 1), tokens_per_s_per_gpu=round(tps, 1),
               tflops_per_gpu=round(tps * flops_per_token(cfg, args.seq) / 1e12, 1),
               peak_mem_GiB_per_gpu=round(d.reduce(peak, "max"), 2),
               loss_step1=round(d.reduce(losses[0], "mean"), 4), loss_last=round(d.reduce(losses[-1], "mean"), 4))
    if not all(math.isfinite(x) for x in losses):
        row.update(status="error", note=f"non-finite loss {losses}")
    del model, opt
    import gc

    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    d.barrier()
    return row


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


def finish(rows, meta, args, d: Dist) -> list[str]:
    """MFU, x hf, scaling efficiency; JSON + markdown under --out; returns the table lines."""
    ref = one_gpu_reference(rows, meta, args)
    peak = args.peak_tflops or meta.get("peak_tflops")
    by = {(r["gpus"], r["config"]): r for r in rows}
    for r in rows:
        if r.get("status") != "ok":
            continue
        r["mfu"] = round(r["tflops_per_gpu"] / peak, 3) if peak else None
        hf = by.get((r["gpus"], "hf"), {}).get("tokens_per_s_per_gpu")
        r["x_hf"] = round(r["tokens_per_s_per_gpu"] / hf, 2) if hf else None
        r["scaling_efficiency"] = 1.0 if r["gpus"] == 1 else (
            round(r["tokens_per_s_per_gpu"] / ref[r["config"]], 3) if r["config"] in ref else None)
    lines = [f"Qwen3-30B-A3B widths, {args.layers} layers, {meta['device']} x {d.world}, "
             f"{args.batch} x {args.seq} tokens per GPU per step, bf16, median of {args.steps} steps after "
             f"{args.warmup} warm-up; torch {meta['torch']}, transformers {meta['transformers']}, "
             f"kernels {meta['kernels']}, triton {meta['triton']}; MFU over {peak} TFLOP/s per GPU.",
             f"Command: `{meta['command']}`", "",
             "| config | GPUs | EP | tok/s/GPU | x hf | TFLOP/s/GPU | MFU | peak GiB/GPU | scaling eff. | step ms | "
             "loss 1 | loss last | sharding |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]

    def f(v, spec):
        return "" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)

    for r in rows:
        lines.append(f"| {r['config']} | {r['gpus']} | {r['ep']} | {f(r.get('tokens_per_s_per_gpu'), '.0f')} | "
                     f"{f(r.get('x_hf'), '.2f')} | {f(r.get('tflops_per_gpu'), '.0f')} | {f(r.get('mfu'), '.1%')} | "
                     f"{f(r.get('peak_mem_GiB_per_gpu'), '.1f')} | {f(r.get('scaling_efficiency'), '.2f')} | "
                     f"{f(r.get('step_ms_median'), '.0f')} | {f(r.get('loss_step1'), '.3f')} | "
                     f"{f(r.get('loss_last'), '.3f')} | {r.get('sharding', r.get('note', ''))} |")
    if d.rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        tag = "1gpu" if d.world == 1 else f"{d.world}gpu_ep{args.ep}"
        (out / f"bench_distributed_{tag}.json").write_text(json.dumps(dict(meta=meta, results=rows), indent=1))
        (out / f"bench_distributed_{tag}.md").write_text("\n".join(lines) + "\n")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--single-gpu", action="store_true", help="one process, one GPU, no FSDP: the per-GPU proxy")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 48; --single-gpu 8; smoke 2)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 4096; smoke 32)")
    p.add_argument("--batch", type=int, default=None, help="sequences per GPU per step (default 2; smoke 2)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size (default: the world size)")
    p.add_argument("--sharding", choices=("transformers", "hubfuse"), default="transformers")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--steps", type=int, default=None, help="measured steps (default 10; smoke 2)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3; smoke 1)")
    p.add_argument("--activation-checkpointing", action="store_true", help="gradient checkpointing per layer")
    p.add_argument("--one-gpu-reference", action="store_true",
                   help="several GPUs: rank 0 first runs the configs alone on its GPU (the others wait), for the "
                        "scaling efficiency (the model must fit one GPU)")
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

        cfg = bench.slice_config(SLICE, args.layers, args.smoke)
        if d.world > 1 and (d.world % args.ep or cfg.num_experts % args.ep):
            raise SystemExit(f"bench_distributed: --ep {args.ep} must divide the world size {d.world} and the "
                             f"{cfg.num_experts} experts")
        local_kernels(d, presets.kernel_repos(FAMILY))
        model_dir = Path(args.model_dir or f"/tmp/hubfuse_bench_models/{'smoke' if args.smoke else 'gpu'}") / SLICE
        if d.rank == 0:
            bench.ensure_model(SLICE, model_dir, args, d.device.type)
        d.barrier()
        import importlib.metadata as md

        name = torch.cuda.get_device_name(d.device) if d.device.type == "cuda" else "cpu (smoke)"
        meta = dict(command=("torchrun ... " if d.world > 1 else "python ") + "scripts/bench_distributed.py "
                    + " ".join(sys.argv[1:] if argv is None else argv),
                    device=name, world=d.world, ep=args.ep, layers=args.layers, seq=args.seq, batch=args.batch,
                    steps=args.steps, warmup=args.warmup, sharding=args.sharding,
                    flops_per_token=flops_per_token(cfg, args.seq), torch=torch.__version__,
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
            log(f"bench_distributed: {d.world} x {name}, {args.layers} layers, {args.batch} x {args.seq} tokens per "
                f"GPU, ep {args.ep}, configs {args.configs}, {flops_per_token(cfg, args.seq) / 1e9:.1f} GFLOP/token")
        rows, lines = [], []

        def record(row, where):
            nonlocal lines
            rows.append(row)
            if d.rank == 0:
                lines = finish(rows, meta, args, d)
                log(f"[{row['config']} x {where.world}] {row['status']}: {row.get('tokens_per_s_per_gpu')} tok/s/GPU, "
                    f"peak {row.get('peak_mem_GiB_per_gpu')} GiB/GPU, {row.get('sharding', row.get('note'))}")

        if args.one_gpu_reference and d.world > 1:
            if d.rank == 0:  # alone on its GPU: no collective until the barrier below
                for config in args.configs:
                    row = run_one(config, model_dir, batches, args, Dist.alone(d), cfg)
                    row["note"] = "one-GPU reference (rank 0 alone)"
                    record(row, Dist.alone(d))
            d.barrier()  # the other ranks wait here meanwhile
        for config in args.configs:
            record(run_one(config, model_dir, batches, args, d, cfg), d)
        if d.rank == 0:
            log("\n".join(lines))
    finally:
        d.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
