#!/usr/bin/env python
"""What one training forward keeps for the backward, by producer, for HF stock and hubfuse (CPU).

Every tensor handed to autograd for the backward (`torch.autograd.graph.saved_tensors_hooks`) is recorded with the
module and the source line that saved it, deduplicated by storage (a storage saved by several ops counts once, for
the first saver; parameters are left out). The report gives bytes per token per decoder layer by producer, what
lies outside the layers (embedding, final norm, the loss), the static memory (parameters, gradients, AdamW
states in the parameters' dtype, as scripts/bench.py's fused AdamW), and an estimate of the CUDA peak of a
`--est-tokens` x `--est-layers` step: static + every saved activation + the loss's chunk buffer, at the end of the
forward (the backward frees a layer's activations before the next one's grads grow past them).

    python scripts/profile_memory.py                       # Qwen3-0.6B widths, 2 layers, 2 x 64 tokens, bf16
    python scripts/profile_memory.py --configs ours --layers 1 --seq 128
    python scripts/profile_memory.py --tiny                # the same structure at tiny widths (a smoke run)

The model is the Qwen3-0.6B slice of scripts/bench.py (built from its config, saved, loaded with
from_pretrained as there); kernels are the local builds. On CPU our ops run their torch reference paths
(TRITON_INTERPRET=1: the Triton ones); their `setup_context` is shared by both paths, so what they save holds on
CUDA. SDPA on CPU may save differently from CUDA's flash / cuDNN kernels (query, key, value, output, log-sum-exp).
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import bench  # noqa: E402  (puts the repo root and torch-ext on sys.path)

import torch  # noqa: E402

from hubfuse._common.released import OBSERVES_ONLY  # noqa: E402

_SKIP = ("torch/autograd/", "torch/_library/", "torch/_ops.py", "_common/custom_op.py", "torch/utils/",
         "profile_memory.py", "torch/nn/modules/module.py")
_LAYER = re.compile(r"layers\.(\d+)(\.|\b)")  # a decoder layer's index, in its own name or a submodule's


def _layers_folded(where: str) -> str:
    return _LAYER.sub(lambda m: "layers.*" + m.group(2), where)


def _saver() -> str:
    """`file:line function` of the innermost frame outside torch's autograd / custom-op machinery."""
    for frame in reversed(traceback.extract_stack()):
        if not any(s in frame.filename for s in _SKIP):
            return f"{Path(frame.filename).name}:{frame.lineno} {frame.name}"
    return "?"


def saved_tensors(model, batch) -> tuple[list[dict], torch.Tensor]:
    """One training forward of `model` on `batch`: every saved storage (first saver; `also` lists the others)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    path: list[str] = [""]
    names = {m: n for n, m in model.named_modules()}

    def enter(module, _args):
        path.append(names.get(module, path[-1]))

    def leave(*_):
        path.pop()

    # global module hooks: hooks of a module's own make a fused Layer call that submodule instead of reading its
    # weights (`_common.modules.hooked`), which would change what is measured
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    hooks = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
    by_storage: dict[int, dict] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() in params or t.device.type == "meta":
            return t
        key = t.untyped_storage()._cdata  # the storage itself (a released one's address is 0, then reused)
        where = f"{path[-1]} @ {_saver()}"
        if key in by_storage:
            by_storage[key]["also"].append(where)
        else:
            by_storage[key] = dict(where=where, module=path[-1], nbytes=t.untyped_storage().nbytes(),
                                   dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape), also=[],
                                   keep=t)  # kept alive: a freed storage's address could be reused
        return t

    setattr(pack, OBSERVES_ONLY, True)  # our ops still release what they rebuild in the backward
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(**batch).loss
    finally:
        for h in hooks:
            h.remove()
    records = list(by_storage.values())
    for r in records:
        if r.pop("keep").untyped_storage().nbytes() == 0:  # released until the backward (_common.released)
            r["nbytes"] = 0
    return records, loss


def static_bytes(model, layers: int, est_layers: int) -> int:
    """Parameters + AdamW states (2 per parameter, its dtype) of the model with `est_layers` decoder layers."""
    total = layer = 0
    for name, p in model.named_parameters():
        total += p.numel() * p.element_size()
        layer += p.numel() * p.element_size() if ".layers." in f".{name}" else 0
    params = total - layer + layer * est_layers / layers
    return 3 * params


def report(config: str, records: list[dict], tokens: int, seq: int, layers: int, static: float, chunk_bytes: int,
           est_tokens: int, est_layers: int) -> list[str]:
    per_layer = collections.defaultdict(lambda: [0, 0])  # producer (layer index folded) -> [bytes, storages]
    outside = collections.defaultdict(lambda: [0, 0])  # label -> [bytes, scales with the tokens]
    for r in records:
        layer_ids = {m.group(1) for m in _LAYER.finditer(" ".join([r["where"]] + r["also"]))}
        label = f"{_layers_folded(r['where'])} [{r['dtype']} {r['shape']}]"
        if r["also"]:
            label += " (also saved by " + "; ".join(_layers_folded(a) for a in r["also"]) + ")"
        entry = per_layer[label] if len(layer_ids) == 1 else outside[label + (" (shared by layers)" if layer_ids else "")]
        entry[0] += r["nbytes"]
        entry[1] += 1 if len(layer_ids) == 1 else bool({tokens, seq} & set(r["shape"]))
    lines = [f"## {config}: {tokens} tokens, {layers} layer(s)", "",
             "| saved in every decoder layer (first saver) | storages / layer | bytes / token / layer |",
             "| --- | ---: | ---: |"]
    layer_total = 0.0
    for label, (b, n) in sorted(per_layer.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"| {label} | {n / layers:g} | {b / tokens / layers:.0f} |")
        layer_total += b / tokens / layers
    lines += [f"| **total** | | **{layer_total:.0f}** |", "", "| saved outside the layers | bytes |", "| --- | ---: |"]
    for label, (b, _) in sorted(outside.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"| {label} | {b} |")
    gib = 2**30
    est_acts = layer_total * est_tokens * est_layers
    # outside the layers: tensors with a token or sequence dimension scale with the tokens, the others (the
    # loss's vocabulary-sized dW, cos / sin of one sequence are counted as per token) do not
    est_outside = sum(b * (est_tokens / tokens if per_token else 1) for b, per_token in outside.values())
    peak = static + est_acts + est_outside + chunk_bytes
    lines += ["", f"Estimate for {est_tokens} tokens x {est_layers} layers: parameters + AdamW states "
              f"{static / gib:.2f} GiB, layer activations {est_acts / gib:.2f} GiB, outside the layers "
              f"{est_outside / gib:.2f} GiB, loss chunk buffer {chunk_bytes / gib:.2f} GiB: CUDA peak (end of the "
              f"forward, in the loss; saved tensors only, no transient buffers) ~{peak / gib:.2f} GiB"]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["eager", "ours"], choices=["eager", "ours"])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--tiny", action="store_true", help="the --smoke widths of scripts/bench.py (hidden 64)")
    p.add_argument("--est-tokens", type=int, default=8 * 1024)
    p.add_argument("--est-layers", type=int, default=28)
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM

    from hubfuse import presets
    from tests.utils import load, register_local_kernels

    register_local_kernels(*presets.kernel_repos("qwen3"))
    cfg = bench.slice_config("qwen3_0_6b", args.layers, smoke=args.tiny)
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg, dtype=dtype).save_pretrained(tmp)
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
        for config in args.configs:
            batch = dict(input_ids=ids, labels=ids)
            if config == "ours":
                model = load(tmp, presets.kernel_mapping("qwen3", revision=bench.REVISION), dtype=dtype)
                presets.enable_losses(model, "qwen3", revision=bench.REVISION)
                chunk = loss_chunk_bytes(args.est_tokens, cfg.vocab_size, torch.finfo(torch.bfloat16).bits // 8)
            else:  # as scripts/bench.py runs HF
                model = load(tmp, dtype=dtype, attn_implementation="sdpa")
                batch["use_cache"] = False
                chunk = 0
            model.train()
            records, loss = saved_tensors(model, batch)
            loss.backward()
            static = static_bytes(model, args.layers, args.est_layers)
            print("\n".join(report(config, records, args.batch * args.seq, args.seq, args.layers, static, chunk,
                                   args.est_tokens, args.est_layers)) + "\n", flush=True)
            del model
    return 0


def loss_chunk_bytes(tokens: int, vocab: int, itemsize: int) -> int:
    """The linear cross-entropy's logits buffer (one chunk, reused by every chunk) for `tokens` tokens, bf16."""
    from kernels import get_kernel

    ce = get_kernel("hubfuse/cross-entropy", revision=bench.REVISION)
    return ce.ops.default_chunk_size(tokens, vocab, itemsize) * vocab * itemsize


if __name__ == "__main__":
    sys.exit(main())
