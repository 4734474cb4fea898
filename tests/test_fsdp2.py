"""FSDP2 (`torch.distributed.fsdp.fully_shard`) over a preset-kernelized tiny Qwen3, 2 CPU processes (gloo).

Each rank trains its own micro-batch for 3 AdamW steps (every decoder layer and the root sharded, as
accelerate / TRL do with FSDP2); the per-rank losses must equal those of the non-sharded eager model trained
on both micro-batches with the gradients averaged (what FSDP's reduce-scatter computes).

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
WORLD_SIZE = 2
STEPS = 3
LR = 1e-2
FAMILY = "qwen3"


def _batches(vocab_size: int):
    """batches[step][rank]: a (2, 12) micro-batch per rank per step; the last step repeats the first step's
    batches, so its loss shows what training did."""
    import torch

    g = torch.Generator().manual_seed(123)
    out = []
    for _ in range(STEPS):
        step = []
        for _ in range(WORLD_SIZE):
            ids = torch.randint(0, vocab_size, (2, 12), generator=g)
            step.append({"input_ids": ids, "labels": ids.clone()})
        out.append(step)
    out[-1] = out[0]
    return out


def _reference_losses(path, batches):
    """Non-sharded eager model: per step, the mean of the ranks' micro-batch losses is backpropagated."""
    import torch

    from tests.utils import load

    model = load(path).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in batches:
        opt.zero_grad(set_to_none=True)
        per_rank = []
        for batch in step:
            loss = model(**batch).loss
            (loss / WORLD_SIZE).backward()
            per_rank.append(loss.item())
        opt.step()
        losses.append(per_rank)
    return losses


def _worker(rank: int, store_file: str, path: str, batches_file: str, out_file: str) -> None:
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hubfuse import presets
    from tests.utils import REVISION, load

    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        model = load(path, presets.kernel_mapping(FAMILY, revision=REVISION)).train()
        presets.enable_losses(model, FAMILY, revision=REVISION)
        layouts = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Layout")})
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)  # root: embeddings, final norm, lm_head (the fused loss reads lm_head.weight)
        sharded = sum(type(p).__name__ == "DTensor" for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        batches = torch.load(batches_file)
        losses = []
        for step in batches:
            out = model(**step[rank])
            assert out.logits is None  # the fused linear cross-entropy ran
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(out.loss.item())
        bound = sorted({getattr(m.__dict__["forward"], "__func__", m.__dict__["forward"]).__qualname__.split(".")[0]
                        for name, m in model.named_modules() if name and "forward" in m.__dict__})
        with open(out_file, "w") as f:
            json.dump({"losses": losses, "layouts": layouts, "bound": bound, "sharded_params": sharded,
                       "params": sum(1 for _ in model.parameters())}, f)
    finally:
        dist.destroy_process_group()


def test_fsdp2_kernelized_qwen3_matches_unsharded_eager(tmp_path):
    import torch

    from tests.utils import register_local_kernels, save_tiny_model, tiny_config

    register_local_kernels("rmsnorm", "rotary", "swiglu", "cross-entropy")
    path = save_tiny_model(FAMILY, tmp_path)
    batches = _batches(tiny_config(FAMILY).vocab_size)
    torch.save(batches, tmp_path / "batches.pt")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1" if not torch.cuda.is_available() else "0"))
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(rank), str(store), str(path),
                               str(tmp_path / "batches.pt"), str(tmp_path / f"rank{rank}.json")],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(WORLD_SIZE)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=100)[0])
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
        assert {"QKNormRopeAttentionLayout", "RMSNormLayout", "RMSNormSwiGLUMLPLayout"} <= set(r["layouts"])
        assert {"QKNormRopeAttention", "RMSNorm", "RMSNormSwiGLUMLP"} <= set(r["bound"])
    want = _reference_losses(path, batches)
    got = [[results[rank]["losses"][step] for rank in range(WORLD_SIZE)] for step in range(STEPS)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=2e-5, rtol=2e-5)
    assert all(want[-1][r] < want[0][r] - 1e-3 for r in range(WORLD_SIZE))  # same batches, lower loss: it trained


if __name__ == "__main__" and len(sys.argv) == 7 and sys.argv[1] == "--worker":
    _worker(int(sys.argv[2]), *sys.argv[3:])
