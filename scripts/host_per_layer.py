#!/usr/bin/env python
"""Host time of one decoder layer, forward and backward, HF stock against hubfuse (issue 35: host <= GPU time).

For each configuration, one decoder layer of a loaded model (`model.model.layers[0]`, training mode, as the step
runs it: no mask, no cache, the model's rotary embeddings) is called on a (batch, seq, hidden) input; each
forward and each backward is timed with the device queue drained before it (torch.cuda.synchronize), so the time
is what the host takes to enqueue it: Python, dispatch, checks and launch calls. Median over --iters.
On CUDA the launch calls per layer come from torch.profiler as well. On CPU (tiny widths, one torch thread) the
kernels run inline and the times are this thread's CPU time (robust to other processes on the cores). With
--no-kernels our ops take their Triton path (TRITON_INTERPRET=1 for the dispatch) with every Triton launch
replaced by a no-op: the host work of the CUDA path (Python, checks, allocations, autograd) without the kernels
(outputs are garbage; aten ops still run, at tiny widths); its "launches" column counts the aten ops that would
launch a kernel plus our Triton launches, one forward + backward with the parameters' grads unset (as in a step).

    python scripts/host_per_layer.py                                   # CUDA: Qwen3-0.6B widths, 8 x 1024
    python scripts/host_per_layer.py --configs eager ours ours@cudnn ours@flash --table 25
    python scripts/host_per_layer.py --tiny --batch 1 --seq 8 --no-kernels   # CPU proxy of the CUDA path
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import bench  # noqa: E402  (puts the repo root and torch-ext on sys.path)

import torch  # noqa: E402

LAUNCH_APIS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaMemsetAsync",
               "cudaMemcpyAsync")


def drain(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def layer_inputs(model, batch: int, seq: int, device: str, dtype):
    """(hidden_states leaf, the layer's keyword arguments) as the decoder model passes them in training."""
    inner = model.model
    hidden = torch.randn(batch, seq, model.config.hidden_size, device=device, dtype=dtype, requires_grad=True)
    positions = torch.arange(seq, device=device).unsqueeze(0).expand(batch, -1)
    cos_sin = inner.rotary_emb(hidden, positions)
    return hidden, dict(attention_mask=None, position_ids=positions, position_embeddings=cos_sin, use_cache=False)


def time_layer(layer, hidden, kwargs, iters: int, device: str) -> tuple[float, float]:
    """Median host µs of one forward and of one backward, the device drained before each."""
    clock = time.perf_counter if device == "cuda" else time.thread_time
    grad = torch.randn_like(hidden)
    fwd, bwd = [], []
    for _ in range(iters):
        drain(device)
        t0 = clock()
        out = layer(hidden, **kwargs)
        t1 = clock()
        drain(device)
        t2 = clock()
        out.backward(grad)
        t3 = clock()
        drain(device)
        fwd.append(t1 - t0)
        bwd.append(t3 - t2)
        hidden.grad = None
        layer.zero_grad(set_to_none=True)
    return statistics.median(fwd) * 1e6, statistics.median(bwd) * 1e6


def profile_layer(layer, hidden, kwargs, device: str):
    """torch.profiler over one forward + backward of the layer."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        layer(hidden, **kwargs).backward(torch.ones_like(hidden))
        drain(device)
    return prof


TRITON_LAUNCHES = [0]


def skip_triton_launches() -> None:
    """Every loaded `hubfuse._common.launch.launch` (the source package and the hub builds' vendored copies)
    replaced, in the modules that imported it, by a no-op that counts the launches."""
    def no_launch(kernel, grid, *args, **kwargs):
        TRITON_LAUNCHES[0] += 1

    for module in list(sys.modules.values()):
        fn = getattr(module, "launch", None)
        if callable(fn) and getattr(fn, "__module__", "").endswith("_common.launch"):
            module.launch = no_launch


def kernels_per_layer(layer, hidden, kwargs) -> int:
    """CPU (--no-kernels): the kernels one forward + backward would launch on CUDA, counted as the aten ops that
    compute (views, allocations and dtype queries left out) plus our (no-op) Triton launches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    no_kernel = {"view", "_unsafe_view", "transpose", "t", "expand", "slice", "select", "unsqueeze", "squeeze",
                 "permute", "as_strided", "alias", "split", "split_with_sizes", "detach", "unbind", "empty",
                 "empty_strided", "empty_like", "new_empty", "new_empty_strided", "promote_types", "ones_like"}

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += func.overloadpacket.__name__ not in no_kernel
            return func(*args, **(kwargs or {}))

    layer.zero_grad(set_to_none=True)
    grad = torch.ones_like(hidden)
    TRITON_LAUNCHES[0] = 0
    with Count():
        layer(hidden, **kwargs).backward(grad)
    hidden.grad = None
    return Count.n + TRITON_LAUNCHES[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["eager", "ours"], type=bench.parse_config,
                   metavar="{eager,ours}[@BACKEND]", help="@flash / @cudnn / @efficient / @math: SDPA held to it")
    p.add_argument("--table", type=int, default=0, metavar="N",
                   help="also print the profiler's top N ops of one layer by self CPU time, per config")
    p.add_argument("--tiny", action="store_true", help="the --smoke widths of scripts/bench.py (hidden 64)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-kernels", action="store_true", help="CPU: the Triton path with no-op launches")
    args = p.parse_args(argv)
    if args.no_kernels:
        os.environ["TRITON_INTERPRET"] = "1"
    from transformers import AutoModelForCausalLM

    from hubfuse import presets
    from tests.utils import load, register_local_kernels

    register_local_kernels(*presets.kernel_repos("qwen3"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)
    dtype = torch.bfloat16
    cfg = bench.slice_config("qwen3_0_6b", 1, smoke=args.tiny)
    print(f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, hidden {cfg.hidden_size}, "
          f"{args.batch} x {args.seq} tokens, bf16, median of {args.iters}")
    print("| config | forward host µs | backward host µs | layer host µs | launches / layer |")
    print("| --- | ---: | ---: | ---: | ---: |")
    tables = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg, dtype=dtype).save_pretrained(tmp)
        for config in args.configs:
            base, backend = bench.split_config(config)
            if base not in ("eager", "ours", "ours_modules"):
                p.error(f"--configs: {config!r}: expected eager, ours or ours_modules, optionally @<backend>")
            scope = contextlib.ExitStack()
            if backend is not None:
                from torch.nn.attention import SDPBackend, sdpa_kernel

                scope.enter_context(sdpa_kernel(getattr(SDPBackend, bench.SDPA_BACKENDS[backend])))
            mapping = (None if base == "eager" else
                       presets.kernel_mapping("qwen3", revision=bench.REVISION, decoder_layer=base == "ours"))
            model = load(tmp, mapping, dtype=dtype, device=device, attn_implementation="sdpa").train()
            layer = model.model.layers[0]
            hidden, kwargs = layer_inputs(model, args.batch, args.seq, device, dtype)
            time_layer(layer, hidden, kwargs, args.warmup, device)
            if args.no_kernels:  # after the warm-up: the ops import their Triton modules on first use
                skip_triton_launches()
            fwd, bwd = time_layer(layer, hidden, kwargs, args.iters, device)
            prof = profile_layer(layer, hidden, kwargs, device) if device == "cuda" or args.table else None
            if device == "cuda":
                n = sum(e.name in LAUNCH_APIS for e in prof.events())
            else:
                n = kernels_per_layer(layer, hidden, kwargs) if args.no_kernels else float("nan")
            print(f"| {config} | {fwd:.0f} | {bwd:.0f} | {fwd + bwd:.0f} | {n:.0f} |", flush=True)
            if args.table:
                tables.append(f"{config}:\n" + prof.key_averages().table(sort_by="self_cpu_time_total",
                                                                         row_limit=args.table))
            scope.close()
            del model, layer
    print("\n\n".join(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
