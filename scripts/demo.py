#!/usr/bin/env python
"""The main job: what hubfuse does for a model, in one command.

    python scripts/demo.py                       # CPU: ~1 min; on a CUDA machine also the speed/memory benchmark
    python scripts/demo.py --families qwen3 llama --no-bench

1. Builds every kernel repo and loads them locally (`hubfuse.use_local_builds()`).
2. Parity, every family (tiny models built from configs): a plain load against the one-argument load
   `from_pretrained(path, use_kernels=True, kernel_config=hubfuse.KernelConfig())` (every kernel of the family,
   fused losses on), a few AdamW steps each: kernels bound per module type, loss and gradient differences.
3. Memory, every family: the activations a training step keeps for the backward (saved-tensor bytes, parameters
   excluded) with the real Qwen vocabulary, where HF keeps the (tokens x vocab) logits and the fused loss does not.
4. On CUDA: `scripts/bench.py` on 2-layer slices of Qwen3-8B / Qwen3-30B-A3B / Qwen3.5-MoE, HF eager vs
   torch.compile vs hubfuse: step time, tokens/s, peak memory, and a PNG plot of speed and of memory (< 5 min).

Exits non-zero on a parity failure. Everything is local: no hub access, no downloads.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "torch-ext"))  # hubfuse without `pip install -e .`

import torch  # noqa: E402

import hubfuse  # noqa: E402
from hubfuse import presets  # noqa: E402
from tests.utils import save_tiny_model, tiny_config  # noqa: E402

FAMILIES = ("qwen3", "qwen3_moe", "qwen3_5_moe", "llama", "qwen2")
CONFIG_TYPE = {"qwen3_5_moe": "qwen3_5_moe_text"}  # the text model of Qwen3.5-MoE
# Tiny-model overrides: MoE models return router logits (aux loss in the loss); Qwen3-MoE gets one dense layer
TINY_OVERRIDES = {"qwen3_moe": dict(output_router_logits=True, mlp_only_layers=[1]),
                  "qwen3_5_moe": dict(output_router_logits=True)}
MEMORY_VOCAB, MEMORY_TOKENS = 151936, (2, 128)  # Qwen3's vocabulary; batch x sequence
ROPE_HUB_FAMILIES = ("llama", "qwen2")  # their preset binds the process-wide `rotary_pos_emb` hub function
PARITY_TOL = 1e-4  # fp32 on CPU
BENCH = ["--slices", "qwen3_8b", "qwen3_30b_a3b", "qwen3_5_moe", "--configs", "eager", "compile", "ours",
         "--layers", "2", "--batch", "4", "--steps", "5", "--warmup", "2", "--budget-s", "240"]


def log(msg: str = "") -> None:
    print(msg, flush=True)


def load(path, kernels: bool):
    from transformers import AutoModelForCausalLM

    if not kernels:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, use_kernels=True,
                                                kernel_config=hubfuse.KernelConfig())


def _rope_function(family):
    import importlib

    return importlib.import_module(f"transformers.models.{family}.modeling_{family}").apply_rotary_pos_emb


def train_steps(model, batches, lr=1e-3):
    """AdamW steps; returns the losses and the first step's grads."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, first_grads = [], None
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        if first_grads is None:
            first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        losses.append(loss.item())
    return losses, first_grads


def _batches(vocab, steps, batch, seq, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def parity(family, path, steps):
    batches = _batches(tiny_config(CONFIG_TYPE.get(family, family)).vocab_size, steps, batch=2, seq=16)
    rope = _rope_function(family) if family in ROPE_HUB_FAMILIES else None
    saved_rope = rope.__dict__.get("forward") if rope is not None else None
    loss_e, grads_e = train_steps(load(path, kernels=False).train(), batches)
    try:
        ours = load(path, kernels=True).train()
        kernels = presets.bound_kernels(ours)
        loss_o, grads_o = train_steps(ours, batches)
    finally:  # the Llama / Qwen2 RoPE hub function is bound process-wide: later plain loads must stay plain
        if rope is not None:
            rope.__dict__.pop("forward", None)
            if saved_rope is not None:
                rope.forward = saved_rope
    want = presets.eager_to_kernelized(grads_e, list(grads_o))  # gate_up_proj = cat(gate, up), fusion names
    return dict(family=family, kernels=kernels, loss_eager=loss_e[-1], loss_ours=loss_o[-1],
                max_loss_diff=max(abs(a - b) for a, b in zip(loss_o, loss_e)),
                max_grad_diff=max((grads_o[n] - want[n]).abs().max().item() for n in grads_o), n_grads=len(grads_o))


def saved_activation_bytes(model, batch) -> int:
    """Bytes of the distinct tensors autograd keeps for the backward of one training step (parameters and views
    of them excluded): the activation memory of the step."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.device.type != "meta":
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
    loss.backward()
    return sum(seen.values())


def memory(family, path, rows):
    batch = _batches(MEMORY_VOCAB, 1, *MEMORY_TOKENS, seed=1)[0]
    rope = _rope_function(family) if family in ROPE_HUB_FAMILIES else None
    saved_rope = rope.__dict__.get("forward") if rope is not None else None
    eager = saved_activation_bytes(load(path, kernels=False).train(), batch)
    try:
        ours = saved_activation_bytes(load(path, kernels=True).train(), batch)
    finally:
        if rope is not None:
            rope.__dict__.pop("forward", None)
            if saved_rope is not None:
                rope.forward = saved_rope
    rows.append(dict(family=family, eager_mib=eager / 2**20, ours_mib=ours / 2**20))


def cpu_path() -> str:
    """Which implementation of the kernels the demo's CPU models run (each op picks it from the tensor's device)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "the Triton kernels, under the Triton interpreter (TRITON_INTERPRET=1)"
    return ("the kernels' torch reference path (HF-exact numerics), not the Triton kernels: those run on a GPU, "
            "or on CPU under TRITON_INTERPRET=1")


def print_parity(rows):
    head = (f"{'model':12s} {'loss eager':>10s} {'loss ours':>10s} {'max|Δloss|':>10s} {'max|Δgrad|':>10s} "
            f"{'grads':>5s}")
    log("\nParity: plain load vs hubfuse.KernelConfig() (3 AdamW steps, fp32, CPU; loss includes the MoE aux loss)")
    log(f"On CPU hubfuse ran {cpu_path()}.")
    log(head + "\n" + "-" * len(head))
    for r in rows:
        log(f"{r['family']:12s} {r['loss_eager']:10.4f} {r['loss_ours']:10.4f} {r['max_loss_diff']:10.2e} "
            f"{r['max_grad_diff']:10.2e} {r['n_grads']:5d}")
    log("\nKernels bound after model.train() (module class -> kernel layer x modules):")
    for r in rows:
        log(f"  {r['family']:12s} " + (", ".join(f"{k} x{v}" for k, v in sorted(r["kernels"].items())) or "NONE"))


def print_memory(rows):
    b, s = MEMORY_TOKENS
    log(f"\nActivation memory of one training step: the tensors autograd keeps for the backward (fp32, {b} x {s} "
        f"tokens, vocabulary {MEMORY_VOCAB}, the tiny layers). HF keeps the tokens x vocab logits; the fused loss "
        f"keeps one weight-sized gradient instead:")
    head = f"{'model':12s} {'HF eager MiB':>12s} {'hubfuse MiB':>12s} {'saved':>7s}"
    log(head + "\n" + "-" * len(head))
    for r in rows:
        log(f"{r['family']:12s} {r['eager_mib']:12.1f} {r['ours_mib']:12.1f} "
            f"{1 - r['ours_mib'] / r['eager_mib']:7.0%}")


def bench(out_dir: Path) -> int:
    cmd = [sys.executable, str(ROOT / "scripts" / "bench.py"), *BENCH, "--out", str(out_dir)]
    log(f"\nGPU: {' '.join(cmd[1:])}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    for name in ("bench_train_speed.png", "bench_train_memory.png"):
        if (out_dir / name).exists():
            log(f"plot: {out_dir / name}")
    return rc


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--families", nargs="*", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--no-bench", action="store_true", help="skip the CUDA benchmark")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "out"), help="benchmark output dir")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the per-load "Loading weights" bars
    # the plain Qwen3.5 reference runs transformers' own torch path for Gated DeltaNet on purpose
    hf_logging.get_logger("transformers.integrations.hub_kernels").addFilter(
        lambda record: "falling back to its reference PyTorch implementation" not in record.getMessage())
    t0 = time.time()
    log("building every kernel repo and loading them locally (hubfuse.use_local_builds()) ...")
    hubfuse.use_local_builds()
    parity_rows, memory_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i, family in enumerate(args.families, 1):
            config_type = CONFIG_TYPE.get(family, family)
            log(f"[{i}/{len(args.families)}] {family}: parity ({args.steps} steps) and activation memory")
            path = save_tiny_model(config_type, Path(tmp) / "parity", **TINY_OVERRIDES.get(family, {}))
            parity_rows.append(parity(family, path, args.steps))
            path = save_tiny_model(config_type, Path(tmp) / "memory", vocab_size=MEMORY_VOCAB,
                                   **TINY_OVERRIDES.get(family, {}))
            memory(family, path, memory_rows)
    print_parity(parity_rows)
    print_memory(memory_rows)
    bad = [r["family"] for r in parity_rows if not r["kernels"] or r["max_grad_diff"] > PARITY_TOL
           or r["max_loss_diff"] > PARITY_TOL]
    if bad:
        log(f"\nFAILED: no kernels bound, or loss / grads differ from eager by > {PARITY_TOL}, for {bad}")
        return 1
    log(f"\nOK: every kernelized model matches the plain one (loss and grads) with its kernels bound in training "
        f"({time.time() - t0:.0f} s).")
    if torch.cuda.is_available() and not args.no_bench:
        return bench(Path(args.out) / "demo_bench")
    log("GPU numbers (the Triton kernels: HF eager, torch.compile, Liger and hubfuse, bf16 training steps of 4-layer "
        "slices with the full vocabulary, H200) are in docs/benchmarks.md; on a CUDA machine this demo measures HF "
        "eager, torch.compile and hubfuse itself and plots them.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
