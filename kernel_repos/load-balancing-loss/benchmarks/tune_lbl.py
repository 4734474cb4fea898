"""Launch-config sweep of the fused load-balancing loss on one GPU, at the issue's shape (48 layers x 8192
tokens x 128 experts, top-8), bf16 and fp32 router logits.

    python kernel_repos/load-balancing-loss/benchmarks/tune_lbl.py            # GPU, < 120 s
    python kernel_repos/load-balancing-loss/benchmarks/tune_lbl.py --small    # CPU smoke run (interpreter)

1. The whole public call, forward + backward with 48 leaf tensors as a model records them (what
   scripts/bench_ops.py times), with the default configs (per dtype): stream ms vs GPU ms shows the per-call
   CPU cost, and the per-kernel GPU times (forward, partials reduction, loss, backward) and launch count;
   the same through the custom op for comparison; and softmax_topk.
2. Forward and backward kernels separately, for each candidate `TUNING` entry of the dtype's kinds
   ("fwd"/"bwd" for bf16, "fwd_fp32"/"bwd_fp32" for fp32) and for the partials reduction's experts per
   program (`FINALIZE_EXPERTS`): GPU ms (summed kernel time, torch.profiler; the forward includes the
   reduction and loss kernels) and stream ms (do_bench median), checked against the default (selection
   counts, loss, grads).
Make the winners the defaults by editing `TUNING` / `FINALIZE_EXPERTS` in triton_kernels.py. Not uploaded
(only benchmark*.py is).
"""
import importlib
import os
import sys
import time
from pathlib import Path

SMALL = "--small" in sys.argv
if SMALL:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
from kernels import get_local_kernel  # noqa: E402

# the built repo, as users load it (run `python scripts/build.py load-balancing-loss` first)
lbl = get_local_kernel(Path(__file__).resolve().parents[1])
ops, tk = lbl.ops, importlib.import_module(lbl.__name__ + ".triton_kernels")

DEV = "cpu" if SMALL else "cuda"
L, T, E, K = (2, 64, 128, 8) if SMALL else (48, 8192, 128, 8)
BUDGET_S = 100
DEFAULT = {kind: dict(cfg) for kind, cfg in tk.TUNING.items()}
DEFAULT_FINALIZE_EXPERTS = tk.FINALIZE_EXPERTS


def cfg(tile=4096, lanes=4, num_warps=4, programs=1024, num_stages=1):
    return dict(tile=tile, lanes=lanes, num_warps=num_warps, programs=programs, num_stages=num_stages)


CANDIDATES = {  # per kernel and dtype; the default is always timed first (num_stages=2: forward only)
    "fwd": [cfg(programs=264), cfg(programs=396), cfg(programs=792), cfg(programs=1024),
            cfg(tile=2048, lanes=8, programs=528), cfg(tile=2048, lanes=8, programs=1024),
            cfg(programs=528, num_stages=2)],
    "bwd": [cfg(programs=4224), cfg(programs=1024), cfg(tile=8192, num_warps=8, programs=2112),
            cfg(tile=2048, lanes=8, programs=2112)],
    "fwd_fp32": [cfg(programs=528), cfg(programs=792), cfg(programs=1320), cfg(programs=2112),
                 cfg(lanes=8), cfg(tile=2048, lanes=8), cfg(num_stages=2)],
    "bwd_fp32": [cfg(tile=8192, num_warps=8, programs=2112), cfg(tile=8192, num_warps=8, programs=528),
                 cfg(programs=2112), cfg()],
}
FINALIZE_CANDIDATES = [4, 16, 32, 128]  # experts per program of the partials' reduction (default 8)
T0 = time.time()


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def stream_ms(fn):
    if SMALL:
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def gpu_ms(fn, steps=10, per_kernel=False):
    """Summed device time of the kernels one call launches (torch.profiler); nan on CPU. per_kernel: also
    print each kernel's time and launches per call."""
    if SMALL:
        return float("nan")
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        sync()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    if per_kernel:
        for e in sorted(events, key=lambda e: -e.self_device_time_total):
            print(f"      {e.key[:70]:70s} {e.self_device_time_total / steps / 1e3:7.4f} ms  "
                  f"x{e.count / steps:.0f} per call")
    return sum(e.self_device_time_total for e in events) / steps / 1e3


def make_case(dtype, masked):
    g = torch.Generator(device=DEV).manual_seed(0)
    zs = [torch.randn(T, E, device=DEV, generator=g).to(dtype) for _ in range(L)]
    mask = (torch.rand(4, T // 4, device=DEV, generator=g) > 0.2).long() if masked else None
    flat = None if mask is None else mask.reshape(-1)
    return zs, mask, flat


def sweep_kernels(dtype, masked):
    tag = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype] + ("+mask" if masked else "")
    zs, _, mask = make_case(dtype, masked)
    layers = tk.layer_table(zs)
    n = (mask.sum().item() if mask is not None else T) * L
    grad_out = torch.ones((), device=DEV)
    suffix = "_fp32" if dtype == torch.float32 else ""
    best = {}
    for kind in ("fwd" + suffix, "bwd" + suffix, "finalize"):
        ref = None
        rows = []
        if kind == "finalize":  # experts per program of the partials' reduction, default forward config
            variants = [DEFAULT_FINALIZE_EXPERTS] + [f for f in FINALIZE_CANDIDATES if f != DEFAULT_FINALIZE_EXPERTS]
        else:
            variants = [DEFAULT[kind]] + [c for c in CANDIDATES[kind] if c != DEFAULT[kind]]
        for c in variants:
            if time.time() - T0 > BUDGET_S:
                print(f"  [{tag} {kind}] time budget reached, skipping the remaining candidates")
                break
            if kind == "finalize":
                tk.FINALIZE_EXPERTS = c
            else:
                tk.TUNING[kind] = c
            try:
                if not kind.startswith("bwd"):
                    fn = lambda: tk.load_balancing_loss_fwd(zs, mask, K, layers)  # noqa: E731
                    loss, dloss = fn()
                    out = (loss.double(), (dloss.double() * n * n / E).round())  # loss, selection counts
                else:
                    dloss = tk.load_balancing_loss_fwd(zs, mask, K, layers)[1]
                    fn = lambda: tk.load_balancing_loss_bwd(grad_out, zs, mask, dloss, layers)  # noqa: E731
                    out = fn().float()
                sync()
                if ref is None:
                    ref, check = out, "ref"
                elif not kind.startswith("bwd"):
                    flips = (out[1] - ref[1]).abs().sum().item() / 2
                    rel = abs(out[0] - ref[0]).item() / abs(ref[0]).item()
                    check = f"flips {flips:.0f} rel {rel:.1e}" + ("  << MISMATCH" if flips > 64 or rel > 1e-4 else "")
                else:
                    err = ((out - ref).abs().max() / ref.abs().max()).item()
                    check = f"err {err:.1e}" + ("  << MISMATCH" if err > (1e-2 if dtype != torch.float32 else 1e-5)
                                                else "")
                g, s = gpu_ms(fn), stream_ms(fn)
                rows.append((g if g == g else s, c, g, s, check))
                print(f"  [{tag} {kind}] {str(c):80s} GPU {g:7.4f} ms  stream {s:7.4f} ms  {check}", flush=True)
            except Exception as e:  # a config that does not compile or run: report and go on
                print(f"  [{tag} {kind}] {c}: {type(e).__name__}: {str(e)[:150]}", flush=True)
        tk.FINALIZE_EXPERTS = DEFAULT_FINALIZE_EXPERTS
        if kind in DEFAULT:
            tk.TUNING[kind] = DEFAULT[kind]
        good = [r for r in rows if "MISMATCH" not in r[4]]
        if good:
            best[kind] = min(good, key=lambda r: r[0])
            print(f"  [{tag} {kind}] best: {best[kind][1]}  GPU {best[kind][2]:.4f} ms  "
                  f"(default {rows[0][2]:.4f} ms)")
    return best


def time_public_call(dtype, masked):
    """fwd + bwd through the public function with 48 leaf tensors (as bench_ops.py): eager autograd.Function
    path and, for comparison, the custom op (the old eager path)."""
    tag = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype] + ("+mask" if masked else "")
    zs, mask, flat = make_case(dtype, masked)
    zs = [z.requires_grad_() for z in zs]

    def step(fn):
        def run():
            for z in zs:
                z.grad = None
            fn().backward()
        return run

    api = step(lambda: lbl.load_balancing_loss(zs, E, K, mask))
    custom = step(lambda: ops._lbl_fwd(zs, None if flat is None else flat.contiguous(), E, K)[0])
    for name, fn in (("public api (autograd.Function)", api), ("custom op (torch.compile path)", custom)):
        fn()
        per_kernel = name.startswith("public")
        g = gpu_ms(fn, per_kernel=per_kernel)
        print(f"  [{tag}] {name:32s} stream {stream_ms(fn):7.4f} ms  GPU {g:7.4f} ms"
              + ("  (target <= 0.3)" if per_kernel else ""), flush=True)


def time_softmax_topk():
    z = torch.randn(T, E, device=DEV).to(torch.bfloat16).requires_grad_()
    g = torch.randn(T, K, device=DEV).to(torch.bfloat16)

    def api():
        z.grad = None
        lbl.softmax_topk(z, K, True)[0].backward(g)

    def custom():
        z.grad = None
        ops._router_fwd(z, K, True)[0].backward(g)

    for name, fn in (("softmax_topk api", api), ("softmax_topk custom op", custom)):
        fn()
        print(f"  [bf16] {name:32s} stream {stream_ms(fn):7.4f} ms  GPU {gpu_ms(fn):7.4f} ms", flush=True)


def main():
    dev_name = "CPU (interpreter)" if SMALL else torch.cuda.get_device_name()
    print(f"{dev_name}, torch {torch.__version__}, triton {triton.__version__}; L={L} T={T} E={E} top-{K}")
    print(f"default TUNING: {DEFAULT}")
    print("== public call, fwd+bwd (default config)")
    for dtype, masked in ((torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True),
                          (torch.float32, True)):
        time_public_call(dtype, masked)
    time_softmax_topk()
    print("== kernel sweep (GPU = summed kernel ms per call; checks vs the default config)")
    winners = {}
    for dtype in (torch.bfloat16, torch.float32):  # a padding mask only adds one load per row
        winners[(dtype, False)] = sweep_kernels(dtype, False)
    print("== best per case")
    for (dtype, masked), best in winners.items():
        for kind, r in best.items():
            print(f"best {kind} {dtype} masked={masked}: {r[1]}  GPU {r[2]:.4f} ms  stream {r[3]:.4f} ms"
                  f"  ({r[4]})")
    print(f"total {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
