"""Tile-config sweep for the MoE grouped-GEMM kernels on one GPU (coordinate descent, one kernel at a time).

    python kernel_repos/moe/benchmarks/tune_moe.py [T E K H I] [--budget-s 420]

Times the forward (for *_fwd kernels) or backward (the others) of `moe_experts` at the Qwen3-30B-A3B shape
(default T=8192 E=128 K=8 H=2048 I=768, bf16), trying a short list of configs per kernel and keeping the
fastest whose results match the starting config. Prints the best `GPU_CONFIGS` to paste into
triton_kernels.py and the fwd+bwd time / TFLOP/s before and after. Not uploaded (only benchmark*.py is).
"""
import argparse
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch-ext"))
from moe import reference, triton_kernels as tk  # noqa: E402

CANDIDATES = [  # BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages
    (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 8, 3), (128, 64, 64, 4, 4),
    (64, 128, 64, 4, 4), (128, 256, 64, 8, 3), (128, 128, 32, 8, 4), (64, 64, 64, 4, 3),
]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("shape", nargs="*", type=int, default=[8192, 128, 8, 2048, 768])
    p.add_argument("--budget-s", type=float, default=420.0)
    a = p.parse_args()
    T, E, K, H, I = a.shape
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, H, device=dev, dtype=dt, generator=g)
    w, idx = torch.topk(torch.randn(T, E, device=dev, generator=g).softmax(-1), K, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(dt)
    gu = torch.randn(E, 2 * I, H, device=dev, dtype=dt, generator=g) * 0.02
    dn = torch.randn(E, H, I, device=dev, dtype=dt, generator=g) * 0.02
    dout = torch.randn(T, H, device=dev, dtype=dt, generator=g)
    slot, offs = reference.route(idx, E)
    flops = 3 * T * K * (2 * H * 2 * I + 2 * I * H)

    def fwd():
        return tk.moe_fwd(x, idx, w, gu, dn, slot, offs)

    saved = fwd()

    def bwd():
        return tk.moe_bwd(dout, x, idx, w, gu, dn, saved[1], saved[2], slot, offs)

    def timed(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")

    def total():
        route_ms = timed(lambda: reference.route(idx, E))
        return timed(fwd) + timed(bwd) + route_ms

    t0 = time.time()
    base_ms = total()
    print(f"start: fwd+bwd {base_ms:.3f} ms = {flops / base_ms / 1e9:.0f} TFLOP/s; {tk.GPU_CONFIGS}", flush=True)
    ref_f, ref_b = fwd(), bwd()
    for name in list(tk.GPU_CONFIGS):
        phase, ref = (fwd, ref_f) if name.endswith("_fwd") else (bwd, ref_b)
        best = dict(tk.GPU_CONFIGS[name])
        best_ms = timed(phase)
        for bm, bn, bk, nw, ns in CANDIDATES:
            if time.time() - t0 > a.budget_s:
                print("budget spent", flush=True)
                break
            cand = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns)
            if cand == best:
                continue
            tk.GPU_CONFIGS[name] = cand
            try:
                out = phase()
                ok = all(torch.allclose(o.float(), r.float(), atol=2e-2, rtol=2e-2) for o, r in zip(out, ref))
                ms = timed(phase) if ok else float("inf")
            except Exception as e:  # e.g. out of shared memory
                ok, ms = False, float("inf")
                print(f"  {name} {cand}: {type(e).__name__} {str(e)[:100]}", flush=True)
            print(f"  {name} {cand}: {ms:.3f} ms{'' if ok else ' (rejected)'}", flush=True)
            if ms < best_ms:
                best, best_ms = cand, ms
        tk.GPU_CONFIGS[name] = best
        print(f"{name}: best {best} -> {phase.__name__} {best_ms:.3f} ms", flush=True)
    final_ms = total()
    print(f"final: fwd+bwd {final_ms:.3f} ms = {flops / final_ms / 1e9:.0f} TFLOP/s (start {base_ms:.3f} ms)")
    print("GPU_CONFIGS = {")
    for k, v in tk.GPU_CONFIGS.items():
        print(f"    {k!r}: dict({', '.join(f'{kk}={vv}' for kk, vv in v.items())}),")
    print("}")


if __name__ == "__main__":
    main()
