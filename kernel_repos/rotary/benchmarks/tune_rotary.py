"""Launch-shape sweep for the rotary kernels on one GPU, then fwd+bwd through autograd: default vs best.

    python kernel_repos/rotary/benchmarks/tune_rotary.py [--budget-s 130] [--small]

Part 1 times each kernel alone (the custom op, `do_bench` median) for every candidate `TUNING[key]` of
triton_kernels.py (key = rope_fwd, rope_bwd, norm_fwd, norm_bwd), on the cases that use it, and checks its
outputs against the current TUNING's (a fast but wrong variant is flagged and never chosen). The best
variant of a key minimises the summed time over its cases. Part 2 runs the ops as the benchmark does
(B8 T2048 bf16, fwd + bwd with a random upstream grad, q/k in the layout models hand over) with the
default TUNING and with the best one: do_bench ms, profiler GPU ms (all kernels, and the rotary kernels
alone), peak extra MiB. The last line is the TUNING to paste into triton_kernels.py. --small: tiny shapes,
runs on CPU under TRITON_INTERPRET=1 (checks the script's logic; timings meaningless).
Not uploaded (only benchmark*.py is).
"""
import argparse
import copy
import importlib
import itertools
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton  # noqa: E402
from kernels import get_local_kernel  # noqa: E402

# the built repo, as users load it (run `python scripts/build.py rotary` first)
rotary = get_local_kernel(Path(__file__).resolve().parents[1])
apply_rotary_pos_emb, apply_rotary_pos_emb_ = rotary.apply_rotary_pos_emb, rotary.apply_rotary_pos_emb_
apply_rotary_pos_emb_flat, qk_norm_rope_flat = rotary.apply_rotary_pos_emb_flat, rotary.qk_norm_rope_flat
ops, tk = rotary.ops, importlib.import_module(rotary.__name__ + ".triton_kernels")
STANDARD, ZERO_CENTERED = rotary.reference.STANDARD, rotary.reference.ZERO_CENTERED

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DT = torch.bfloat16 if DEV == "cuda" else torch.float32
KERNEL_NAMES = ("_fwd_kernel", "_bwd_kernel")  # the rotary Triton kernels, as the profiler names them

ELEMS_PER_WARP = (256, 512, 1024)
# row_tile=True: the row-tile kernels for partial RoPE (one [BLOCK_M, next_pow2(D)] tile per row, partner
# loads); the column-group candidates are the best of an earlier full sweep on H200. row_tile only changes the
# partial (R < D) cases; the full-RoPE cases run the same kernel in every candidate.
CANDIDATES = {
    "norm_bwd": [dict(block_elems=b, elems_per_warp=w, programs_per_sm=p, row_tile=False)
                 for b, w, p in ((2048, 512, 16), (4096, 512, 16), (2048, 1024, 32))]
                + [dict(block_elems=b, elems_per_warp=w, programs_per_sm=p, row_tile=True)
                   for b, w, p in itertools.product((1024, 2048, 4096), ELEMS_PER_WARP, (8, 16, 32))],
    "norm_fwd": [dict(block_elems=b, elems_per_warp=w, row_tile=False) for b, w in ((2048, 1024), (4096, 1024), (2048, 512))]
                + [dict(block_elems=b, elems_per_warp=w, row_tile=True)
                   for b, w in itertools.product((1024, 2048, 4096, 8192), ELEMS_PER_WARP)],
    "rope_bwd": [dict(block_elems=b, elems_per_warp=w, row_tile=False)
                 for b, w in ((4096, 512), (16384, 1024), (2048, 512), (8192, 256))]
                + [dict(block_elems=b, elems_per_warp=w, row_tile=True)
                   for b, w in ((2048, 512), (4096, 512), (4096, 1024), (8192, 1024))],
    "rope_fwd": [dict(block_elems=b, elems_per_warp=w, row_tile=False)
                 for b, w in ((4096, 512), (4096, 1024), (2048, 1024), (16384, 256))]
                + [dict(block_elems=b, elems_per_warp=w, row_tile=True)
                   for b, w in ((2048, 512), (4096, 512), (4096, 1024), (8192, 1024))],
}


def cos_sin(B, T, R):
    pos = torch.arange(T, device=DEV).float().expand(B, T)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, R, 2, device=DEV).float() / R))
    emb = torch.cat([pos[..., None] * inv_freq] * 2, dim=-1)
    return emb.cos().to(DT), emb.sin().to(DT)


def timed(fn):
    if DEV != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")


def gpu_ms(fn, steps=5):
    """(all kernels, rotary kernels) device ms per call, from torch.profiler."""
    if DEV != "cuda":
        return float("nan"), float("nan")
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events)
    ours = sum(e.self_device_time_total for e in events if any(n in e.key for n in KERNEL_NAMES))
    return total / steps / 1e3, ours / steps / 1e3


def peak_extra_mib(fn):
    if DEV != "cuda":
        return float("nan")
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def max_err(got, want):
    """Largest |got - want| over the largest |want| (0: bitwise equal)."""
    errs = [(a.float() - b.float()).abs().max().item() / max(b.float().abs().max().item(), 1e-30)
            for a, b in zip(got, want)]
    return max(errs)


# ------------------------------------------------------------------ cases: (name, shape) -> kernel callables


def shapes(small):
    B, T = (1, 16) if small else (8, 2048)
    return dict(
        norm_partial_zc=(B, T, 16, 2, 256, 64, ZERO_CENTERED), norm_full=(B, T, 32, 8, 128, 128, STANDARD),
        rope_full=(B, T, 32, 8, 128, 128, None), rope_partial=(B, T, 16, 2, 256, 64, None))


def norm_case(B, T, Hq, Hk, D, R, mode):
    q = torch.randn(B, T, Hq, D, device=DEV, dtype=DT)
    k = torch.randn(B, T, Hk, D, device=DEV, dtype=DT)
    wq = torch.randn(D, device=DEV, dtype=DT) * 0.1 + (1.0 if mode == STANDARD else 0.0)
    wk = torch.randn(D, device=DEV, dtype=DT) * 0.1 + (1.0 if mode == STANDARD else 0.0)
    cos, sin = cos_sin(B, T, R)
    dq_out, dk_out = torch.randn(B, Hq, T, D, device=DEV, dtype=DT), torch.randn(B, Hk, T, D, device=DEV, dtype=DT)
    fwd = lambda: ops._qk_norm_rope_fwd(q, k, wq, wk, cos, sin, 1e-6, mode)
    bwd = lambda: ops._qk_norm_rope_bwd(dq_out, dk_out, q, k, wq, wk, cos, sin, 1e-6, mode)
    return {"norm_fwd": fwd, "norm_bwd": bwd}


def rope_case(B, T, Hq, Hk, D, R, _):
    # the layout models hand over: transposed (B, S, H, D) projections, grads alike
    q = torch.randn(B, T, Hq, D, device=DEV, dtype=DT).transpose(1, 2)
    k = torch.randn(B, T, Hk, D, device=DEV, dtype=DT).transpose(1, 2)
    cos, sin = cos_sin(B, T, R)
    dq_out, dk_out = torch.randn_like(q), torch.randn_like(k)
    order = ops._dim_order(q)
    fwd = lambda: ops._rope_fwd(q, k, cos, sin, 1)
    bwd = lambda: ops._rope_bwd(dq_out, dk_out, cos, sin, 1, order, order)
    kernels = {"rope_fwd": fwd, "rope_bwd": bwd}
    if R < D:  # in place on the rotary slice (uses TUNING["rope_fwd"]); each call rotates q and k again
        qi, ki = q.clone(), k.clone()

        def inplace():
            qi.copy_(q), ki.copy_(k)  # fresh inputs for the result check; not timed (see below)
            return ops._rope_fwd_(qi, cos, sin, 1), ops._rope_fwd_(ki, cos, sin, 1), qi, ki

        kernels["rope_fwd_inplace"] = (inplace, lambda: (ops._rope_fwd_(qi, cos, sin, 1),
                                                         ops._rope_fwd_(ki, cos, sin, 1)))
    return kernels


# ------------------------------------------------------------------ part 1: per-kernel sweep


def sweep(cases, budget_s, t_start):
    best = {}
    for key, candidates in CANDIDATES.items():
        default = copy.deepcopy(tk.TUNING[key])
        # (case name, run-for-check, run-for-timing) of the kernels this key drives
        users = []
        for cname, kernels in cases.items():
            for kname, fn in kernels.items():
                if kname == key or (key == "rope_fwd" and kname == "rope_fwd_inplace"):
                    check, run = fn if isinstance(fn, tuple) else (fn, fn)
                    users.append((f"{cname}/{kname}", check, run))
        want = {name: [t.clone() for t in check() if isinstance(t, torch.Tensor)] for name, check, _ in users}
        totals = []
        for cand in [default] + [c for c in candidates if c != default]:
            if time.time() - t_start > budget_s:
                print(f"  {key}: budget spent, {len(candidates) - len(totals)} candidates skipped", flush=True)
                break
            tk.TUNING[key] = cand
            total, parts, bad = 0.0, [], []
            try:
                for name, check, run in users:
                    D, R = (256, 64) if "partial" in name else (128, 128)
                    bm, _, _, rb, nw = tk._blocks(key, D, R, D > R and "inplace" not in name)
                    err = max_err([t for t in check() if isinstance(t, torch.Tensor)], want[name])
                    tol = 0.0 if key.startswith("rope") else 2.0 ** -7  # norm: reduction order may flip an ulp
                    if err > tol:
                        bad.append(f"{name} err {err:.2e}")
                    ms = timed(run)
                    total += ms
                    short = name.split('/')[0] + (" in place" if "inplace" in name else "")
                    parts.append(f"{short} {ms:.4f} (BM{bm} w{nw}{' row' if rb else ''})")
            except Exception as e:  # a variant that fails to compile or launch: report and go on
                print(f"  {key} {cand}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            tag = "  WRONG: " + "; ".join(bad) if bad else ""
            mark = " (default)" if cand == default else ""
            print(f"  {key} {cand}{mark}: total {total:.4f} ms = " + ", ".join(parts) + tag, flush=True)
            if not bad:
                totals.append((total, cand))
        tk.TUNING[key] = default
        if totals:
            base = next((t for t, c in totals if c == default), None)
            t, cand = min(totals, key=lambda x: x[0])
            best[key] = cand
            print(f"best {key}: {cand} {t:.4f} ms" + (f" (default {base:.4f} ms)" if base else ""), flush=True)
    return best


# ------------------------------------------------------------------ part 2: ops through autograd


def e2e_cases(small):
    sh = shapes(small)
    out = []
    for name in ("norm_partial_zc", "norm_full"):
        B, T, Hq, Hk, D, R, mode = sh[name]

        def mk(B=B, T=T, Hq=Hq, Hk=Hk, D=D, R=R, mode=mode):
            base = 1.0 if mode == STANDARD else 0.0
            return [torch.randn(B, T, Hq, D, device=DEV, dtype=DT, requires_grad=True),
                    torch.randn(B, T, Hk, D, device=DEV, dtype=DT, requires_grad=True),
                    (torch.randn(D, device=DEV, dtype=DT) * 0.1 + base).requires_grad_(),
                    (torch.randn(D, device=DEV, dtype=DT) * 0.1 + base).requires_grad_(), *cos_sin(B, T, R)]

        zc = mode == ZERO_CENTERED
        out.append((f"{name} fused (flat)", mk, lambda q, k, wq, wk, c, s, zc=zc: qk_norm_rope_flat(
            q, k, wq, wk, c, s, 1e-6, zero_centered=zc)))
    for name in ("rope_full", "rope_partial"):
        B, T, Hq, Hk, D, R, _ = sh[name]

        def mk(B=B, T=T, Hq=Hq, Hk=Hk, D=D, R=R):  # model layout: transposed (B, S, H, D) leaves
            return [torch.randn(B, T, Hq, D, device=DEV, dtype=DT).transpose(1, 2).requires_grad_(),
                    torch.randn(B, T, Hk, D, device=DEV, dtype=DT).transpose(1, 2).requires_grad_(), *cos_sin(B, T, R)]

        out.append((f"{name} model layout, flat", mk, lambda q, k, c, s: apply_rotary_pos_emb_flat(q, k, c, s)))
        out.append((f"{name} model layout, pair", mk, lambda q, k, c, s: apply_rotary_pos_emb(q, k, c, s)))
        if R < D:
            def mk_nonleaf(B=B, T=T, Hq=Hq, Hk=Hk, D=D, R=R):  # in place needs non-leaf inputs: (B, S, H, D) leaves
                return [torch.randn(B, T, Hq, D, device=DEV, dtype=DT, requires_grad=True),
                        torch.randn(B, T, Hk, D, device=DEV, dtype=DT, requires_grad=True), *cos_sin(B, T, R)]

            views = lambda q, k: ((q * 1).transpose(1, 2), (k * 1).transpose(1, 2))
            out.append((f"{name} in place (non-leaf: x*1 views; compare rotary-kernel ms)", mk_nonleaf,
                        lambda q, k, c, s: apply_rotary_pos_emb_(*views(q, k), c, s)))
            out.append((f"{name} out of place, same inputs as in place", mk_nonleaf,
                        lambda q, k, c, s: apply_rotary_pos_emb(*views(q, k), c, s)))
    return out


def run_e2e(label, small):
    print(f"-- fwd+bwd through autograd, {label} TUNING", flush=True)
    for name, mk, fn in e2e_cases(small):
        try:
            inputs = mk()
            out = fn(*inputs)
            outs = out if isinstance(out, tuple) else (out,)
            grads = [torch.randn_like(o) for o in outs]

            def step():
                for t in inputs:
                    t.grad = None
                o = fn(*inputs)
                torch.autograd.backward(o if isinstance(o, tuple) else (o,), grads)

            step()
            ms = timed(step)
            all_ms, ours_ms = gpu_ms(step)
            peak = peak_extra_mib(step)
            print(f"  {name}: {ms:.4f} ms, GPU {all_ms:.4f} ms (rotary kernels {ours_ms:.4f}), "
                  f"peak extra {peak:.0f} MiB", flush=True)
        except Exception as e:
            print(f"  {name}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--budget-s", type=float, default=110.0, help="part 1 stops starting variants after this")
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU interpreter: checks the logic)")
    a = p.parse_args()
    if a.small:
        for key in CANDIDATES:  # a few variants each: the interpreter is slow
            CANDIDATES[key] = CANDIDATES[key][::7]
    torch.manual_seed(0)
    t0 = time.time()
    device = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter)"
    print(f"device {device}, torch {torch.__version__}, triton {triton.__version__}; default TUNING {tk.TUNING}", flush=True)
    sh = shapes(a.small)
    cases = {n: (norm_case if n.startswith("norm") else rope_case)(*sh[n]) for n in sh}
    best = sweep(cases, a.budget_s - (15 if not a.small else 0), t0)
    del cases
    default = copy.deepcopy(tk.TUNING)
    run_e2e("default", a.small)
    tuned = {**default, **best}
    if tuned != default:
        tk.TUNING.update(tuned)
        run_e2e("best", a.small)
        tk.TUNING.update(default)
    print(f"total {time.time() - t0:.0f} s", flush=True)
    print("best TUNING = {\n" + "".join(f"    {k!r}: dict({', '.join(f'{n}={v}' for n, v in c.items())}),\n"
                                        for k, c in tuned.items()) + "}", flush=True)


if __name__ == "__main__":
    main()
