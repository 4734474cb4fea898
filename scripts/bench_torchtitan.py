#!/usr/bin/env python
"""torchtitan 0.3.0 as the peer of scripts/bench_distributed.py: its Qwen3-30B-A3B flavor, `--layers` deep, on N
GPUs (torchrun), FSDP over all ranks + EP `--ep`, `--batch` x `--seq` random tokens per GPU, bf16, no tokenizer
and no dataset download (a random-token dataloader and a stub tokenizer plug into its Trainer config).

torchtitan runs its own trainer: its model (flex attention with a causal document mask, grouped-mm experts, its
all-to-all token dispatcher), its `parallelize_qwen3` (EP, FSDP2), its AdamW, its chunked cross-entropy, its
fwd+bwd CUDA graph unless --no-cuda-graphs. Settings chosen to match bench_distributed.py: `training.dtype`
bfloat16 (bf16 parameters and optimizer states, as our bench), no activation checkpointing unless
--activation-checkpointing (FullAC), no torch.compile unless --compile, no checkpointing, lr 1e-5.

Runs only where torch has what torchtitan 0.3.0 imports (`preflight`): torch >= 2.12. On torch 2.11 it cannot:
`torchtitan/distributed/fsdp.py` (lines 13-18, at import) takes `DataParallelMeshDims` from
`torch.distributed.fsdp`, and with EP > 1 its `apply_fsdp_to_decoder` (lines 261-267) needs FSDP2's per-parameter
meshes (`ShardPlacementResult` in `torch.distributed.fsdp._fully_shard._fsdp_common`); neither is in torch 2.11.
After its first step the trainer calls `torch.distributed.set_timeout` (`torchtitan/distributed/utils.py:595`, from
`trainer.py:1061-1067`), which torch 2.13.0 does not have either: where it is missing, this launcher installs a
no-op in its place (the process groups keep their initial timeout) and records that in the JSON.

Reported: tokens/s/GPU (torchtitan's own per-step `tps`, median over the steps after --warmup), TFLOP/s/GPU and
MFU with bench_distributed.py's FLOPs per token (6 x active matmul parameters + causal attention) and with
torchtitan's own count, peak memory (torchtitan's max reserved / max active, GiB). Writes
$OUT/bench_torchtitan_<layers>l_<N>gpu_ep<ep>.json. Install (the GPU machine, no network):

    pip install --no-deps --target /tmp/site_titan torchtitan-0.3.0-py3-none-any.whl spmd_types-0.2.3-py3-none-any.whl \\
        torchdata-0.11.0-py3-none-any.whl torch_checkpointing-0.1.1-py3-none-any.whl tyro-1.0.17-py3-none-any.whl \\
        docstring_parser-0.18.0-py3-none-any.whl typeguard-4.6.1-py3-none-any.whl tensorboard-2.21.0-py3-none-any.whl \\
        protobuf-7.36.2-cp310-abi3-manylinux2014_x86_64.whl absl_py-2.5.1-py3-none-any.whl
    (scripts/gpu_check.sh scale does this from .whl/titan/*.whl)
    PYTHONPATH=/tmp/site_titan:$PYTHONPATH torchrun --standalone --nproc-per-node 4 scripts/bench_torchtitan.py \\
        --layers 8 --ep 4
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(msg, flush=True)


def components():
    """The random-token dataloader and the stub tokenizer, as torchtitan Configurables (defined after its import)."""
    import torch
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer

    class StubTokenizer(BaseTokenizer):
        """No vocabulary file: the model's vocabulary size, token ids only."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab_size: int = 151936

        def __init__(self, config, *, tokenizer_path: str = ""):
            super().__init__()
            self.vocab_size = config.vocab_size
            self.eos_id = config.vocab_size - 1

        def encode(self, *args, **kwargs) -> list[int]:
            raise NotImplementedError("StubTokenizer: the benchmark feeds random token ids")

        def decode(self, *args, **kwargs) -> str:
            raise NotImplementedError("StubTokenizer: the benchmark feeds random token ids")

        def get_vocab_size(self) -> int:
            return self.vocab_size

    class RandomTokens(BaseDataLoader):
        """Endless (local_batch_size, seq_len) batches of random ids, one document per row (positions 0..seq-1),
        each data-parallel rank its own stream."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            vocab_size: int = 151936

        def __init__(self, config, *, dp_world_size: int, dp_rank: int, tokenizer, seq_len: int,
                     local_batch_size: int, **_):
            self.vocab_size, self.seq_len, self.batch = config.vocab_size, seq_len, local_batch_size
            self.generator = torch.Generator().manual_seed(1234 + dp_rank)

        def __iter__(self):
            positions = torch.arange(self.seq_len).expand(self.batch, self.seq_len).contiguous()
            while True:
                ids = torch.randint(0, self.vocab_size, (self.batch, self.seq_len + 1), generator=self.generator)
                yield {"input": ids[:, :-1], "positions": positions}, ids[:, 1:]

        def state_dict(self):
            return {}

        def load_state_dict(self, state_dict):
            pass

    return StubTokenizer, RandomTokens


def preflight() -> list[str]:
    """What this torch lacks for torchtitan 0.3.0 with EP (empty: it can run)."""
    import torch.distributed.fsdp as fsdp

    missing = []
    if not hasattr(fsdp, "DataParallelMeshDims"):
        missing.append("torch.distributed.fsdp.DataParallelMeshDims (imported by torchtitan/distributed/fsdp.py:13)")
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult  # noqa: F401
    except ImportError:
        missing.append("FSDP2 per-parameter meshes, ShardPlacementResult (torchtitan/distributed/fsdp.py:261, EP > 1)")
    return missing


def backfill_set_timeout() -> list[str]:
    """torchtitan's trainer lowers the process-group timeouts after step 1 through torch.distributed.set_timeout;
    where torch lacks it, a no-op (the groups keep their initial timeout)."""
    import torch.distributed as dist

    if hasattr(dist, "set_timeout"):
        return []
    dist.set_timeout = lambda timeout, group=None: None
    return ["torch.distributed.set_timeout: absent, replaced by a no-op"]


def trainer_config(args, world: int):
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.models.qwen3.config_registry import qwen3_30b_a3b

    StubTokenizer, RandomTokens = components()
    config = qwen3_30b_a3b()
    model = config.model_spec.model
    if args.layers > len(model.layers):
        raise SystemExit(f"bench_torchtitan: --layers {args.layers} > the flavor's {len(model.layers)} layers")
    model.layers = model.layers[:args.layers]
    vocab = model.vocab_size
    config.tokenizer = StubTokenizer.Config(vocab_size=vocab)
    config.dataloader = RandomTokens.Config(vocab_size=vocab)
    config.hf_assets_path = ""
    config.dump_folder = str(Path(args.out) / "torchtitan_dump")
    config.training.local_batch_size = args.batch
    config.training.seq_len = args.seq
    config.training.steps = args.warmup + args.steps
    config.training.dtype = "bfloat16"
    config.training.disable_cuda_graphs = args.no_cuda_graphs
    config.parallelism.data_parallel_shard_degree = world
    config.parallelism.expert_parallel_degree = args.ep
    config.activation_checkpoint = FullAC.Config() if args.activation_checkpointing else None
    config.compile.enable = args.compile
    config.metrics.log_freq = 1
    config.lr_scheduler.warmup_steps = 1
    for group in getattr(config.optimizer, "param_groups", None) or []:
        if hasattr(group, "lr"):
            group.lr = 1e-5
    if hasattr(config.optimizer, "lr"):
        config.optimizer.lr = 1e-5
    return config


def ours_flops_per_token(args) -> float:
    """bench_distributed.py's FLOPs per token for the same widths and depth (the same MFU yardstick)."""
    sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "torch-ext"), str(ROOT)]
    import bench
    import bench_distributed

    return bench_distributed.flops_per_token(bench.slice_config("qwen3_30b_a3b", args.layers, False), args.seq)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2, help="sequences per GPU per step")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size (default: the world size)")
    p.add_argument("--steps", type=int, default=5, help="measured steps")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps (CUDA-graph capture, allocator)")
    p.add_argument("--activation-checkpointing", action="store_true", help="torchtitan's FullAC per block")
    p.add_argument("--compile", action="store_true", help="torchtitan's torch.compile of the model and loss")
    p.add_argument("--no-cuda-graphs", action="store_true", help="training.disable_cuda_graphs (eager fwd+bwd)")
    p.add_argument("--peak-tflops", type=float, default=989.4, help="per-GPU bf16 dense peak for MFU (H100/H200)")
    p.add_argument("--out", default=None, help="output dir (default $OUT or ./out)")
    p.add_argument("--preflight", action="store_true",
                   help="only check that torchtitan imports and this torch has what it needs (exit 3 if not)")
    args = p.parse_args(argv)
    args.out = args.out or os.environ.get("OUT") or str(ROOT / "out")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    args.ep = args.ep or world
    import importlib.metadata as md

    import torch

    missing = preflight()
    if missing:
        log(f"bench_torchtitan: torch {torch.__version__} cannot run torchtitan 0.3.0 with EP: lacks "
            + "; ".join(missing))
        return 3
    if args.preflight:
        trainer_config(args, world)  # imports torchtitan's trainer, model and config
        log(f"bench_torchtitan: torch {torch.__version__}, torchtitan {md.version('torchtitan')}: can run")
        return 0
    shims = backfill_set_timeout()
    config = trainer_config(args, world)
    t0 = time.time()
    trainer = config.build()
    build_s = time.time() - t0
    steps: list[dict] = []
    metric_logger = trainer.metrics_processor.logger
    log_metrics = metric_logger.log

    def record(metrics, step, *a, **kw):
        steps.append(dict(metrics, step=step))
        if rank == 0:
            log(f"[torchtitan x {world}] step {step}/{args.warmup + args.steps}: "
                f"{metrics.get('throughput(tps)', 0):.0f} tok/s/GPU, loss "
                f"{metrics.get('loss_metrics/global_avg_loss', float('nan')):.4f}")
        return log_metrics(metrics, step, *a, **kw)

    metric_logger.log = record
    try:
        trainer.train()
    finally:
        trainer.close()
    measured = [s for s in steps if s["step"] > args.warmup]
    if rank == 0:
        tps = statistics.median(s["throughput(tps)"] for s in measured)
        ours = ours_flops_per_token(args)
        row = dict(config="torchtitan", gpus=world, ep=args.ep, layers=args.layers, seq=args.seq, batch=args.batch,
                   tokens_per_s_per_gpu=round(tps, 1), tflops_per_gpu=round(tps * ours / 1e12, 1),
                   mfu=round(tps * ours / 1e12 / args.peak_tflops, 3),
                   torchtitan_tflops=round(statistics.median(s["tflops"] for s in measured), 1),
                   torchtitan_mfu_pct=round(statistics.median(s.get("mfu(%)", float("nan")) for s in measured), 2),
                   peak_reserved_GiB=round(max(s["memory/max_reserved(GiB)"] for s in measured), 2),
                   peak_active_GiB=round(max(s["memory/max_active(GiB)"] for s in measured), 2),
                   loss_first=steps[0]["loss_metrics/global_avg_loss"],
                   loss_last=steps[-1]["loss_metrics/global_avg_loss"], build_s=round(build_s, 1),
                   cuda_graphs=not args.no_cuda_graphs, compile=args.compile, shims=shims,
                   activation_checkpointing=args.activation_checkpointing, flops_per_token=ours,
                   torch=torch.__version__, torchtitan=md.version("torchtitan"),
                   device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"bench_torchtitan_{args.layers}l_{world}gpu_ep{args.ep}.json"
        path.write_text(json.dumps(row, indent=1))
        log(f"| torchtitan | {world} | {args.ep} | {row['tokens_per_s_per_gpu']:.0f} | | {row['tflops_per_gpu']:.0f} | "
            f"{row['mfu']:.1%} | {row['peak_active_GiB']:.1f} (reserved {row['peak_reserved_GiB']:.1f}) | | | "
            f"{row['loss_first']:.3f} | {row['loss_last']:.3f} | torchtitan {row['torchtitan']} FSDP {world} + EP "
            f"{args.ep}{', CUDA graph' if row['cuda_graphs'] else ''} |")
        log(f"bench_torchtitan: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
