#!/usr/bin/env python
"""The main job: build the kernel repos, load each model family's embedded tiny model with its preset
(`hubfuse.presets.kernel_mapping(family)` + `enable_losses`: every hubfuse kernel that applies, the fused
cross-entropy and, for MoE, the fused aux loss), train a few steps beside an eager copy, and print one table:
kernels active per module type, loss / aux-loss / grad parity (fused parameters mapped back to HF names), step
time and peak memory. Exits non-zero on a parity failure.

    python scripts/demo.py                # CPU: tiny models; CUDA: the Triton path at a realistic size too
    python scripts/demo.py --steps 5 --families qwen3 llama

Everything is local: models are built from configs, kernel repos load from their builds via LOCAL_KERNELS.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "torch-ext"))  # hubfuse without `pip install -e .`

import torch  # noqa: E402

from hubfuse import presets  # noqa: E402
from tests.utils import REVISION, load, register_local_kernels, save_tiny_model, tiny_config  # noqa: E402

FAMILIES = ("qwen3", "qwen3_moe", "qwen3_5_moe_text", "llama", "qwen2")
# Per family: the preset mapping (every kernel of ours that applies; see hubfuse/presets.py for the choices)
PRESETS = {family: presets.kernel_mapping(family, revision=REVISION) for family in FAMILIES}
KERNEL_REPOS = tuple(sorted({repo for family in FAMILIES for repo in presets.kernel_repos(family)}))
# Tiny-model overrides: MoE models return router logits (aux loss in the loss); Qwen3-MoE gets one dense layer
TINY_OVERRIDES = {"qwen3_moe": dict(output_router_logits=True, mlp_only_layers=[1]),
                  "qwen3_5_moe_text": dict(output_router_logits=True)}
# A realistic slice for CUDA (Qwen3-8B-like widths, 2 layers) — only on a GPU.
REALISTIC = {"qwen3": dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                           num_key_value_heads=8, head_dim=128, num_hidden_layers=2, vocab_size=32000)}
ROPE_HUB_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")  # `apply_rotary_pos_emb` with the hub name
PARITY_TOL = 1e-4  # fp32 on CPU


def log(msg: str) -> None:
    print(msg, flush=True)


def bound_kernels(model) -> dict[str, int]:
    """"<module type> -> <kernel layer>" -> number of submodules whose forward kernelize bound to that layer."""
    counts: dict[str, int] = {}
    for name, module in model.named_modules():
        func = getattr(module.__dict__.get("forward"), "__func__", None)
        if name and func is not None and func is not type(module).forward:  # root: the loss hook, not a kernel
            key = f"{type(module).__name__}->{func.__qualname__.split('.')[0]}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def rope_functions():
    """The module-global `apply_rotary_pos_emb` of each family with the hub name: the `rotary_pos_emb` kernel
    binds onto it process-wide (kernel_repos/rotary/CARD.md), so the eager copies run before it is bound and
    the binding is undone after each family."""
    return {f: importlib.import_module(f"transformers.models.{f}.modeling_{f}").apply_rotary_pos_emb
            for f in ROPE_HUB_FAMILIES}


def train_steps(model, batches, lr=1e-3):
    """A few AdamW steps; returns losses, the first step's grads, and the median step time (s)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, first_grads, times = [], None, []
    for batch in batches:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        if first_grads is None:
            first_grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()
                           if p.grad is not None}
        opt.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return losses, first_grads, sorted(times)[len(times) // 2]


def run_family(family, path, steps, device, dtype, batch, seq):
    vocab = tiny_config(family).vocab_size if device == "cpu" else REALISTIC.get(family, {}).get("vocab_size", 96)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
        batches.append({"input_ids": ids, "labels": ids})
    rope = rope_functions()
    saved_rope = {f: fn.__dict__.get("forward") for f, fn in rope.items()}
    log(f"[{family}] eager: loading and training {steps} steps ({device}, {dtype})")
    eager = load(path, dtype=dtype, device=device).train()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    loss_e, grads_e, t_e = train_steps(eager, batches)
    mem_e = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else float("nan")
    del eager
    log(f"[{family}] kernelized: loading with presets.kernel_mapping({family!r}) + enable_losses")
    try:
        ours = load(path, PRESETS[family], dtype=dtype, device=device).train()
        presets.enable_losses(ours, family, revision=REVISION)
        kernels = bound_kernels(ours)
        for f, fn in rope.items():  # the RoPE hub function (Llama / Qwen2 presets): bound on the module global
            func = getattr(fn.__dict__.get("forward"), "__func__", None)
            if func is not None and fn.__dict__.get("forward") is not saved_rope[f]:
                kernels[f"{f}.apply_rotary_pos_emb->{func.__qualname__.split('.')[0]} (process-wide)"] = 1
        if "_hubfuse_fused_loss" in ours.__dict__:  # per-instance loss switches (enable_losses)
            kernels["causal-LM loss->linear_cross_entropy"] = 1
        if "_hubfuse_fused_aux_loss" in ours.__dict__:
            kernels["aux loss->load_balancing_loss"] = 1
        log(f"[{family}] kernels bound after model.train(): {kernels}")
        log(f"[{family}] kernelized: training {steps} steps")
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        loss_o, grads_o, t_o = train_steps(ours, batches)
        mem_o = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else float("nan")
    finally:
        for f, fwd in saved_rope.items():  # undo the process-wide rotary_pos_emb binding (Llama / Qwen2)
            if fwd is None:
                rope[f].__dict__.pop("forward", None)
            else:
                rope[f].forward = fwd
    want = presets.eager_to_kernelized(grads_e, list(grads_o))  # gate_up_proj = cat(gate, up), fusion names
    max_grad_diff = max((grads_o[n] - want[n]).abs().max().item() for n in grads_o)
    max_loss_diff = max(abs(a - b) for a, b in zip(loss_o, loss_e))
    return dict(family=family, device=device, kernels=kernels, loss_eager=loss_e[-1], loss_ours=loss_o[-1],
                max_loss_diff=max_loss_diff, max_grad_diff=max_grad_diff, n_grads=len(grads_o),
                step_ms_eager=t_e * 1e3, step_ms_ours=t_o * 1e3, peak_mib_eager=mem_e, peak_mib_ours=mem_o)


def print_table(rows):
    head = (f"{'model':18s} {'device':6s} {'loss eager':>10s} {'loss ours':>10s} {'max|Δloss|':>10s} "
            f"{'max|Δgrad|':>10s} {'grads':>5s} {'step eager':>11s} {'step ours':>10s} {'peak MiB e/o':>13s}")
    log("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        log(f"{r['family']:18s} {r['device']:6s} {r['loss_eager']:10.4f} {r['loss_ours']:10.4f} "
            f"{r['max_loss_diff']:10.2e} {r['max_grad_diff']:10.2e} {r['n_grads']:5d} {r['step_ms_eager']:9.1f}ms "
            f"{r['step_ms_ours']:8.1f}ms " + (f"{r['peak_mib_eager']:6.0f}/{r['peak_mib_ours']:<6.0f}"
                                                  if r['peak_mib_eager'] == r['peak_mib_eager'] else f"{'-/-':>8s}"))
    log("\nkernels active per module type (module class -> kernel layer x modules; the losses are per-instance "
        "switches from presets.enable_losses)")
    for r in rows:
        kernels = ", ".join(f"{k} x{v}" for k, v in sorted(r["kernels"].items())) or "NONE"
        log(f"  {r['family']:18s} {r['device']:6s} {kernels}")
    if rows and rows[0]["device"] == "cpu":
        log("  (peak memory: CUDA only; loss includes router_aux_loss_coef * aux loss for MoE)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--families", nargs="*", default=list(PRESETS), choices=list(PRESETS))
    args = parser.parse_args(argv)

    log(f"building kernel repos {KERNEL_REPOS} (scripts/build.py) ...")
    register_local_kernels(*KERNEL_REPOS)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, family in enumerate(args.families, 1):
            log(f"\n== {i}/{len(args.families)} {family}: embedded tiny model ==")
            path = save_tiny_model(family, Path(tmp), **TINY_OVERRIDES.get(family, {}))
            rows.append(run_family(family, path, args.steps, "cpu", torch.float32, batch=2, seq=16))
        if torch.cuda.is_available():
            for family, dims in REALISTIC.items():
                if family not in args.families:
                    continue
                log(f"\n== CUDA: realistic slice of {family} ({dims}) in bf16, Triton path ==")
                path = save_tiny_model(family, Path(tmp) / "realistic", **dims)
                rows.append(run_family(family, path, args.steps + 2, "cuda", torch.bfloat16, batch=2, seq=2048))
        else:
            log("\n(no CUDA device: the realistic slice runs only on a GPU; CPU runs the torch reference path"
                f"{' — TRITON_INTERPRET=1 is set, so the Triton kernels run in the interpreter' if os.environ.get('TRITON_INTERPRET') == '1' else ''})")
    print_table(rows)
    bad = [r["family"] for r in rows if not r["kernels"] or (r["device"] == "cpu" and (
        r["max_grad_diff"] > PARITY_TOL or r["max_loss_diff"] > PARITY_TOL))]
    if bad:
        log(f"\nFAILED: no kernels bound, or loss / grads differ from eager by > {PARITY_TOL}, for {bad}")
        return 1
    log("\nOK: every kernelized model matches eager (loss and grads) with its kernels still bound in training.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
