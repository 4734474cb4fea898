"""The optimizer step alone: hubfuse.optim.AdamW against torch's fused and foreach AdamW, on the parameters of
bench.py's slices (shapes from the model built on the meta device), bf16 weights, gradients and states, random
values; and the floor (the bytes an AdamW step must move over the measured copy bandwidth).

    python scripts/bench_adamw.py                       # slices qwen3_30b_a3b_8l qwen3_0_6b qwen3_5_moe
    python scripts/bench_adamw.py --slices qwen3_8b --steps 30
    python scripts/bench_adamw.py --optimizers torch_fused+graph hubfuse+graph   # the step in a CUDA graph

Per optimizer: GPU ms per step (median of CUDA-event times, each step alone on the stream), host ms (the time
to enqueue one step, queue drained), TB/s (14 bytes a parameter: read weight, grad and two states, write weight
and two states) and the ratio to torch's fused AdamW (to `torch_fused+graph` for `+graph` rows).
`<optimizer>+graph`: the step captured once in a CUDA graph (torch's with `capturable=True`), each timed step a
replay (what `hubfuse.cuda_graphs.capture_train_step` runs; hubfuse's AdamW then sends its small tensors through
the many-tensor launch). Writes out/bench_adamw.json and .md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "torch-ext"))
sys.path.insert(0, str(ROOT / "scripts"))

# hubfuse_all: every tensor through the kernel (KERNEL_MIN_NUMEL = 1), the host cost of a launch per tensor
OPTIMIZERS = ("torch_fused", "torch_foreach", "hubfuse", "hubfuse_all")
# hubfuse:<BLOCK>x<NUM_WARPS>: the kernel with another launch setting (elements a program, warps)
DEFAULT_LAUNCH = {}


def parse_optimizer(text: str) -> str:
    base, _, launch = text.removesuffix("+graph").partition(":")
    if base not in OPTIMIZERS or (launch and (base != "hubfuse" or not launch.replace("x", "").isdigit())):
        raise argparse.ArgumentTypeError(f"{text!r}: expected one of {list(OPTIMIZERS)} or hubfuse:<BLOCK>x<WARPS>")
    return text


def param_shapes(slice_name: str) -> list[tuple[int, ...]]:
    import torch
    from transformers import AutoModelForCausalLM

    import bench

    cfg = bench.slice_config(slice_name, bench.SLICES[slice_name]["layers"], smoke=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return [tuple(p.shape) for p in model.parameters()]


def make_optimizer(name: str, params):
    import torch

    graph = name.endswith("+graph")
    name = name.removesuffix("+graph")
    if name.startswith("hubfuse"):
        from hubfuse import _optim_kernels
        from hubfuse.optim import AdamW

        block, warps = (map(int, name.split(":")[1].split("x")) if ":" in name
                        else (DEFAULT_LAUNCH["BLOCK"], DEFAULT_LAUNCH["NUM_WARPS"]))
        _optim_kernels.BLOCK, _optim_kernels.NUM_WARPS = block, warps
        opt = AdamW(params, lr=1e-5, weight_decay=0.01)
        if name == "hubfuse_all":
            opt.KERNEL_MIN_NUMEL = 1
        return opt
    return torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, fused=name == "torch_fused",
                             foreach=name == "torch_foreach", capturable=graph)


def copy_tb_s(n_bytes: int = 2 << 30) -> float:
    """Copy bandwidth (read + write bytes over time), median of 20 copies of a 2 GiB tensor."""
    import torch

    src = torch.empty(n_bytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(25):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return 2 * n_bytes / statistics.median(times[5:]) / 1e12


def time_optimizer(name: str, shapes, steps: int, warmup: int, seed: int = 0) -> dict:
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02)
              for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, device="cuda", dtype=torch.bfloat16) * 1e-3
    opt = make_optimizer(name, params)
    opt.step()  # states created, kernels compiled
    for group in opt.param_groups:
        for p in group["params"]:
            opt.state[p]["exp_avg"].normal_(0, 1e-3, generator=gen)
            opt.state[p]["exp_avg_sq"].uniform_(1e-8, 1e-6, generator=gen)
    torch.cuda.synchronize()
    step = opt.step
    if name.endswith("+graph"):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            opt.step()  # warm-up on the capture stream
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            opt.step()
        step = graph.replay
    gpu, host = [], []
    for i in range(warmup + steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        a.record()
        step()
        b.record()
        t1 = time.perf_counter()
        b.synchronize()
        if i >= warmup:
            gpu.append(a.elapsed_time(b))
            host.append((t1 - t0) * 1e3)
    n = sum(p.numel() for p in params)
    ms = statistics.median(gpu)
    row = dict(optimizer=name, params=n, tensors=len(params), gpu_ms=round(ms, 3),
               host_ms=round(statistics.median(host), 3), tb_s=round(14 * n / ms / 1e9, 2),
               finite=bool(all(torch.isfinite(p).all() for p in params)))
    del opt, params
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slices", nargs="+", default=["qwen3_30b_a3b_8l", "qwen3_0_6b", "qwen3_5_moe"])
    ap.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), type=parse_optimizer)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "out"))
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_adamw.py needs a CUDA device", file=sys.stderr)
        return 2
    from hubfuse import _optim_kernels

    DEFAULT_LAUNCH.update(BLOCK=_optim_kernels.BLOCK, NUM_WARPS=_optim_kernels.NUM_WARPS)
    bw = copy_tb_s()
    rows = []
    lines = [f"AdamW step alone, {torch.cuda.get_device_name()}, torch {torch.__version__}; bf16 weights, "
             f"gradients and states; copy bandwidth {bw:.2f} TB/s (floor = 14 B a parameter over it)", "",
             "| slice | optimizer | tensors | params (M) | GPU ms | host ms | TB/s | vs torch fused | floor ms |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in args.slices:
        shapes = param_shapes(s)
        fused = {}  # torch's fused AdamW's GPU ms, eager (False) and replayed in a graph (True)
        for name in args.optimizers:
            row = time_optimizer(name, shapes, args.steps, args.warmup)
            row["slice"] = s
            row["floor_ms"] = round(14 * row["params"] / bw / 1e9, 3)
            rows.append(row)
            graph = name.endswith("+graph")
            if name.removesuffix("+graph") == "torch_fused":
                fused[graph] = row["gpu_ms"]
            ratio = f"{fused[graph] / row['gpu_ms']:.2f}x" if graph in fused else ""
            lines.append(f"| {s} | {name} | {row['tensors']} | {row['params'] / 1e6:.0f} | {row['gpu_ms']:.2f} | "
                         f"{row['host_ms']:.2f} | {row['tb_s']:.2f} | {ratio} | {row['floor_ms']:.2f} |")
            print(lines[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_adamw.json").write_text(json.dumps(dict(copy_tb_s=bw, rows=rows), indent=1))
    (out / "bench_adamw.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
