"""FSDP2 (`torch.distributed.fsdp.fully_shard`) over a preset-kernelized Qwen3, 2 processes.

- gloo: a tiny fp32 Qwen3 on 2 CPU processes (the normal suite);
- nccl (`gpu`, needs 2 GPUs): a real slice in bf16 (hidden 2048, 16/8 heads, head_dim 128, intermediate 6144,
  2 layers, vocab 151936, 2 x 1024 tokens per rank), one GPU per rank.
Each rank trains its own micro-batch for 3 AdamW steps (torch's, or hubfuse.optim.AdamW on the local shards;
every decoder layer and the root sharded, as accelerate / TRL do with FSDP2); the per-rank losses must equal
those of the non-sharded eager model trained on both micro-batches with the gradients averaged (what FSDP's
reduce-scatter computes).

The ranks are two `python tests/test_fsdp2.py --worker` processes started here. Rendezvous goes through a
file store in a temporary directory (no port to pick, nothing listens beyond the gloo pairs, which are bound
to the loopback interface).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
import pytest

WORLD_SIZE = 2
STEPS = 3
FAMILY = "qwen3"
# backend -> (device, dtype name, learning rate, tokens per micro-batch row, loss tolerance)
SETUPS = {"gloo": ("cpu", "float32", 1e-2, 12, 2e-5), "nccl": ("cuda", "bfloat16", 1e-3, 1024, 2e-2)}
REAL_SLICE = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, num_hidden_layers=2, max_position_embeddings=4096)


def _batches(vocab_size: int, seq: int):
    """batches[step][rank]: a (2, seq) micro-batch per rank per step; the last step repeats the first step's
    batches, so its loss shows what training did."""
    import torch

    g = torch.Generator().manual_seed(123)
    out = []
    for _ in range(STEPS):
        step = []
        for _ in range(WORLD_SIZE):
            ids = torch.randint(0, vocab_size, (2, seq), generator=g)
            step.append({"input_ids": ids, "labels": ids.clone()})
        out.append(step)
    out[-1] = out[0]
    return out


def _reference_losses(path, batches, backend):
    """Non-sharded eager model: per step, the mean of the ranks' micro-batch losses is backpropagated."""
    import torch

    from tests.utils import load

    device, dtype, lr, _, _ = SETUPS[backend]
    model = load(path, dtype=getattr(torch, dtype), device=device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in batches:
        opt.zero_grad(set_to_none=True)
        per_rank = []
        for batch in step:
            loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
            (loss / WORLD_SIZE).backward()
            per_rank.append(loss.item())
        opt.step()
        losses.append(per_rank)
    return losses


def _worker(backend: str, rank: int, optimizer: str, store_file: str, path: str, batches_file: str,
            out_file: str) -> None:
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hubfuse import presets
    from tests.utils import REVISION, load

    device_type, dtype, lr, _, _ = SETUPS[backend]
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{store_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        mesh = init_device_mesh(device_type, (WORLD_SIZE,))
        model = load(path, presets.kernel_mapping(FAMILY, revision=REVISION), dtype=getattr(torch, dtype),
                     device=device).train()
        presets.enable_losses(model, FAMILY, revision=REVISION)
        layouts = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Layout")})
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)  # root: embeddings, final norm, lm_head (the fused loss reads lm_head.weight)
        sharded = sum(type(p).__name__ == "DTensor" for p in model.parameters())
        kernel_updates = []
        if optimizer == "hubfuse":  # every local shard through the kernel (the interpreter on CPU)
            from hubfuse import _optim_kernels
            from hubfuse.optim import AdamW

            update = _optim_kernels.adamw_update
            _optim_kernels.adamw_update = lambda *a: (kernel_updates.append(a[0].numel()), update(*a))
            AdamW.KERNEL_MIN_NUMEL = 1
            opt = AdamW(model.parameters(), lr=lr)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=lr)
        batches = torch.load(batches_file)
        losses = []
        for step in batches:
            out = model(**{k: v.to(device) for k, v in step[rank].items()})
            assert out.logits is None  # the fused linear cross-entropy ran
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(out.loss.item())
        bound = sorted({getattr(m.__dict__["forward"], "__func__", m.__dict__["forward"]).__qualname__.split(".")[0]
                        for name, m in model.named_modules() if name and "forward" in m.__dict__})
        with open(out_file, "w") as f:
            json.dump({"losses": losses, "layouts": layouts, "bound": bound, "sharded_params": sharded,
                       "params": sum(1 for _ in model.parameters()), "kernel_updates": len(kernel_updates)}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("optimizer", ["torch", "hubfuse"])
@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.gpu)])
def test_fsdp2_kernelized_qwen3_matches_unsharded_eager(tmp_path, backend, optimizer):
    """`optimizer`: torch's AdamW or hubfuse.optim.AdamW (its kernel on every local shard) on the sharded model;
    the reference is torch's AdamW on the unsharded one."""
    import torch

    from tests.utils import register_local_kernels, save_tiny_model, tiny_config

    if backend == "nccl" and torch.cuda.device_count() < WORLD_SIZE:
        pytest.skip(f"needs {WORLD_SIZE} GPUs")
    _, _, _, seq, tol = SETUPS[backend]
    from hubfuse.build import families

    register_local_kernels(*families())  # every repo the preset maps (decoder-layer too), whatever ran before
    overrides = REAL_SLICE if backend == "nccl" else {}
    path = save_tiny_model(FAMILY, tmp_path, **overrides)
    batches = _batches(tiny_config(FAMILY, **overrides).vocab_size, seq)
    torch.save(batches, tmp_path / "batches.pt")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1" if not torch.cuda.is_available() else "0"))
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", backend, str(rank), optimizer, str(store),
                               str(path),
                               str(tmp_path / "batches.pt"), str(tmp_path / f"rank{rank}.json")],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(WORLD_SIZE)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:  # only the two workers started above
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{log[-4000:]}"
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    for r in results:
        assert r["sharded_params"] == r["params"] > 0  # every parameter is a DTensor shard
        assert {"DecoderLayerLayout", "QKNormRopeAttentionLayout", "RMSNormLayout", "SwiGLUMLPLayout"} \
            <= set(r["layouts"])
        assert {"DecoderLayer", "RMSNorm"} <= set(r["bound"])
        assert r["kernel_updates"] == (STEPS * r["params"] if optimizer == "hubfuse" else 0)
    want = _reference_losses(path, batches, backend)
    got = [[results[rank]["losses"][step] for rank in range(WORLD_SIZE)] for step in range(STEPS)]
    print(f"{backend}: FSDP2 + kernels {got}; unsharded eager {want}")
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=tol, rtol=tol)
    assert all(want[-1][r] < want[0][r] - 1e-3 for r in range(WORLD_SIZE))  # same batches, lower loss: it trained


if __name__ == "__main__" and len(sys.argv) == 9 and sys.argv[1] == "--worker":
    _worker(sys.argv[2], int(sys.argv[3]), *sys.argv[4:])
