"""Variant sweep for the MoE grouped-GEMM kernels on one GPU (< 3 minutes at the default shape).

    python kernel_repos/moe/benchmarks/tune_moe.py [T E K H I] [--budget-s 130]
    python kernel_repos/moe/benchmarks/tune_moe.py --small      # CPU logic check under TRITON_INTERPRET=1

1. times the current `TUNING` (fwd, bwd, routing; `triton.testing.do_bench` medians) and prints a
   per-kernel breakdown of one fwd+bwd (CUDA profiler: device time of every launch, torch glue included);
2. tries a short list of variants, one kernel at a time (`VARIANTS`: overrides of that kernel's
   `TUNING` entry, e.g. TMA weight loads, more stages; for "backward" the implementation: the Triton
   kernels, or torch._grouped_mm for the weight grads only or also for g_act = dout_rows @ Wd[e]). Each is timed
   against the current config on the phase that runs the kernel, call by call alternating between the two (medians
   of `PAIRED_ROUNDS` calls each, so clock drift hits both alike), and its outputs are
   compared with the current implementation's: a variant off by more than `MAX_REL_ERR` is flagged WRONG
   and never chosen; one that fails to compile is reported and skipped;
3. applies each kernel's fastest correct variant (if > 1% faster), times fwd+bwd again with a breakdown and
   prints the `TUNING` block to paste into triton_kernels.py.
Default shape: Qwen3-30B-A3B (T=8192 E=128 K=8 H=2048 I=768, bf16). Not uploaded (only benchmark*.py is).
"""
import argparse
import importlib
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

SMALL = "--small" in sys.argv
if SMALL and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import triton  # noqa: E402
from kernels import get_local_kernel  # noqa: E402

# the built repo, as users load it (run `python scripts/build.py moe` first)
moe = get_local_kernel(Path(__file__).resolve().parents[1])
reference, tk = moe.reference, importlib.import_module(moe.__name__ + ".triton_kernels")

TRITON_W = {"backward": dict(impl="triton")}  # context of the Triton down weight-grad kernel's variants
LEAN = {"backward": dict(impl="grouped_mm_lean")}  # context of the Triton gate_up weight-grad kernel's variants
FUSED_ACT = {"backward": dict(impl="grouped_mm_wgrad")}  # context of the fused Triton g_act kernel's variants

# (kernel, overrides of its TUNING entry[, context]), most promising first (the budget may cut the tail).
# context: overrides of other entries, applied to the variant and to its paired baseline alike; such a variant is
# chosen only if the final config keeps that context
# the fused Triton g_act kernel (SwiGLU backward in its epilogue) on the gathered dout rows: 0.714 ms at 128x128
# tiles, vs 0.368 + 0.144 ms for CUTLASS's M-grouped GEMM and the separate row epilogue; in these configs the
# grouped_mm_wgrad backward measured -44 %, -37 %, -14 % against grouped_mm (TMA + TMA_A + half tiles the best)
FUSED_ACT_CONFIGS = [
    dict(TMA=True, TMA_A=True, BLOCK_N=256, num_stages=3, PERSISTENT=True),
    dict(TMA=True, TMA_A=True, BLOCK_N=256, num_stages=3, HALF_TILES=True),
    dict(TMA=True, TMA_A=True, PERSISTENT=True),
]
TRITON_G = {"backward": dict(g_act="triton")}  # context of the Triton g_act row GEMM's variants

VARIANTS = [
    # the persistent row GEMMs with other K steps (128 x 2 stages, 32 x 6-8 stages) or four warpgroups (16 warps:
    # 64 accumulator registers per thread at 128 x 256): all measured slower, -1.6 to -9.9 % on their phase;
    # 16 warps needs 262 KB of shared memory in the two backward kernels
    *[(name, variant, context) for name, stages, context in (("down_fwd", 6, {}), ("gate_up_bwd_x", 8, {}),
                                                             ("down_bwd_g", 8, TRITON_G))
      for variant in (dict(BLOCK_K=128, num_stages=2), dict(BLOCK_K=32, num_stages=stages), dict(num_warps=16))],
    # two CTAs per SM (<= 113 KB of shared memory each), so that one's epilogue overlaps the other's main loop: the
    # gathered gate_up forward with 64 gate + 64 up columns per tile (3 stages: the default, +1.5 % on the fwd
    # phase over the one-CTA config in the first line), the other row GEMMs with 128-column tiles (-1.0 to -1.7 %)
    ("gate_up_fwd", dict(BLOCK_N=128, num_stages=4)),
    ("gate_up_fwd", dict(BLOCK_N=64, num_stages=4)),
    ("gate_up_fwd", dict(BLOCK_N=64, num_stages=3, num_warps=4)),
    ("gate_up_fwd", dict(BLOCK_N=64, BLOCK_K=32, num_stages=6)),
    ("gate_up_fwd", dict(BLOCK_N=128, num_stages=3)),
    ("down_fwd", dict(BLOCK_N=128, PERSISTENT=False)),
    ("down_fwd", dict(BLOCK_N=128, num_warps=4, PERSISTENT=False)),
    ("gate_up_bwd_x", dict(BLOCK_N=128, num_stages=3, PERSISTENT=False)),
    # g_act = dout_rows @ Wd[e] through the Triton row GEMM (persistent, TMA, half tiles in the per-tile launch)
    # instead of CUTLASS's M-grouped GEMM, which pads every expert's last row tile to the full tile
    # (+2.4 % on the bwd phase, so it is the default; the reverse check times CUTLASS against it)
    ("backward", dict(g_act="cutlass")),
    ("down_bwd_g", dict(PERSISTENT=False), TRITON_G),
    ("down_bwd_g", dict(num_stages=3), TRITON_G),
    ("down_bwd_g", dict(BLOCK_N=128, PERSISTENT=False), TRITON_G),
    # the fused g_act backward against the default (CUTLASS g_act + row epilogue), in its best-guess configs, then
    # the fused kernel's own variants
    *[("backward", dict(impl="grouped_mm_wgrad"), {"down_bwd_act": cfg}) for cfg in FUSED_ACT_CONFIGS],
    ("down_bwd_act", dict(TMA=True, TMA_A=True), FUSED_ACT),
    *[("down_bwd_act", cfg, FUSED_ACT) for cfg in FUSED_ACT_CONFIGS],
    ("down_bwd_act", dict(TMA=True, TMA_A=True, BLOCK_N=256, num_stages=4, PERSISTENT=True), FUSED_ACT),
    ("down_bwd_act", dict(TMA=True, TMA_A=True, HALF_TILES=True), FUSED_ACT),
    ("down_bwd_act", dict(TMA=True, TMA_A=True, BLOCK_N=256, num_stages=3), FUSED_ACT),
    # persistent launches: a program per SM loops over the tiles in one flattened software pipeline, so the next
    # tile's first loads overlap this tile's epilogue (full-size tile bodies only: no HALF_TILES)
    # (gate_up_fwd -13 %, down_fwd +2.7 %, gate_up_bwd_x +0.7 % / +1.0 % with 4 stages: the last two are on;
    # persistent Triton weight grads measured -20 % / -11 % on the lean / triton backward, so that option is gone)
    ("gate_up_fwd", dict(PERSISTENT=True)),
    ("down_fwd", dict(PERSISTENT=False)),
    ("gate_up_bwd_x", dict(PERSISTENT=False, num_stages=3)),
    ("down_fwd", dict(num_stages=4)),
    ("gate_up_bwd_x", dict(num_stages=3)),
    # a row tile with at most BLOCK_M / 2 of its expert's rows computes only those (most experts' last tile)
    ("gate_up_fwd", dict(HALF_TILES=True)),
    ("down_fwd", dict(HALF_TILES=True)),
    ("gate_up_bwd_x", dict(HALF_TILES=True)),
    # the contiguous sorted-row operand (act, dgate_up_out) through TMA as well as the weight operand
    ("down_fwd", dict(TMA_A=True)),
    ("gate_up_bwd_x", dict(TMA_A=True)),
    ("down_fwd", dict(TMA_A=True, num_stages=4)),
    ("gate_up_bwd_x", dict(TMA_A=True, num_stages=4)),
    # 64-row tiles for the row-tiled GEMMs: with ~512 rows per expert (uniform routing) 128-row tiles compute 13 %
    # padding rows (each expert's last tile is mostly empty), 64-row tiles 6.4 %
    *[("gate_up_fwd", dict(BLOCK_M=64, **extra)) for extra in ({}, dict(num_warps=4), dict(BLOCK_N=256),
                                                                dict(num_stages=5))],
    *[(name, dict(BLOCK_M=64, **extra)) for name in ("down_fwd", "gate_up_bwd_x")
      for extra in ({}, dict(num_warps=4), dict(num_stages=4))],
    # backward GEMMs: the default "grouped_mm" (CUTLASS K-grouped weight grads over gathered sorted rows and the
    # M-grouped g_act GEMM + its row epilogue), "grouped_mm_lean" (the same but the gate_up weight grad in
    # Triton: less memory, a little slower), CUTLASS weight grads with the fused Triton g_act kernel, or all Triton
    # (the Triton kernels' configs are timed in those contexts)
    ("backward", dict(impl="grouped_mm_lean")),
    ("backward", dict(impl="grouped_mm_wgrad")),
    ("backward", dict(impl="triton")),
    ("swiglu_bwd_rows", dict(BLOCK_R=8, BLOCK_N=256)),
    ("swiglu_bwd_rows", dict(BLOCK_R=2, BLOCK_N=512)),
    ("swiglu_bwd_rows", dict(BLOCK_R=4, BLOCK_N=256, num_warps=8)),
    # weight-grad kernels (K = the expert's ~512 rows): the gathered-row index load takes pipeline stages,
    # so 4 stages leave 2 operand buffers; 5 gives 3 (99 KB smem: still 2 CTAs/SM)
    ("gate_up_bwd_w", dict(num_stages=5), LEAN),
    ("down_bwd_w", dict(num_stages=5), TRITON_W),
    ("gate_up_bwd_w", dict(num_stages=5, num_warps=4), LEAN),
    ("down_bwd_w", dict(num_stages=5, num_warps=4), TRITON_W),
    ("gate_up_bwd_w", dict(BLOCK_N=256, num_stages=5), LEAN),
    ("down_bwd_w", dict(BLOCK_M=256, num_stages=5), TRITON_W),
    ("gate_up_bwd_w", dict(BLOCK_K=128, num_stages=4), LEAN),
    ("down_bwd_w", dict(BLOCK_K=128, num_stages=4), TRITON_W),
    ("gate_up_bwd_w", dict(num_stages=3), LEAN),
    # row-tiled kernels: the dense per-expert weight operand through TMA instead of cp.async pointer loads
    ("gate_up_fwd", dict(TMA=True)),
    ("down_fwd", dict(TMA=True)),
    ("down_bwd_act", dict(TMA=True), FUSED_ACT),
    ("gate_up_bwd_x", dict(TMA=True)),
    ("gate_up_fwd", dict(TMA=True, num_stages=4)),
    ("down_fwd", dict(TMA=True, BLOCK_N=256, num_stages=3)),
    ("gate_up_bwd_x", dict(TMA=True, BLOCK_N=256, num_stages=3)),
    ("down_bwd_act", dict(TMA=True, num_stages=5), FUSED_ACT),
    ("gate_up_bwd_x", dict(TMA=True, num_stages=5)),
    ("down_fwd", dict(TMA=True, num_stages=5)),
    # memory-bound combine (y rows -> tokens), used in fwd and bwd, and the row gathers of the grouped_mm backward
    ("combine", dict(BLOCK_T=4)),
    ("combine", dict(BLOCK_T=16, num_warps=8)),
    ("combine", dict(BLOCK_T=8, BLOCK_N=512, num_warps=8)),
    ("combine", dict(BLOCK_T=4, BLOCK_N=1024, num_warps=8)),
    ("gather_rows", dict(BLOCK_R=4, BLOCK_N=1024)),
    ("gather_rows", dict(BLOCK_R=16, BLOCK_N=512, num_warps=8)),
    ("gather_rows", dict(BLOCK_R=4, BLOCK_N=2048, num_warps=8)),
    ("gather_rows", dict(BLOCK_R=2, BLOCK_N=2048, num_warps=4)),
]
MAX_REL_ERR = 1e-2  # max |variant - current| / max |current| per output (bf16 accumulation-order noise ~1e-3)
PAIRED_ROUNDS = 40  # alternating calls per config when a variant is timed against the current config
MIN_GAIN = 0.01  # a variant must beat the current config by this fraction to be chosen


def make_inputs(T, E, K, H, I, dev, dt):
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, H, device=dev, dtype=dt, generator=g)
    w, idx = torch.topk(torch.randn(T, E, device=dev, generator=g).softmax(-1), K, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(dt)
    gu = torch.randn(E, 2 * I, H, device=dev, dtype=dt, generator=g) * 0.02
    dn = torch.randn(E, H, I, device=dev, dtype=dt, generator=g) * 0.02
    dout = torch.randn(T, H, device=dev, dtype=dt, generator=g)
    return x, idx, w, gu, dn, dout


def rel_err(outs, refs):
    return max(((o.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-6)).item()
               for o, r in zip(outs, refs))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("shape", nargs="*", type=int, default=[8192, 128, 8, 2048, 768])
    p.add_argument("--budget-s", type=float, default=130.0,
                   help="no new variant once this much has passed (or the last variant's time would pass it); "
                        "the final timing and breakdown take ~10 s more")
    p.add_argument("--small", action="store_true", help="tiny shape; runs on CPU under the interpreter")
    p.add_argument("--only", nargs="+", metavar="KERNEL", help="only the variants of these TUNING entries")
    a = p.parse_args()
    variants = VARIANTS
    if a.only:
        unknown = sorted(set(a.only) - {v[0] for v in VARIANTS})
        if unknown:
            p.error(f"--only {unknown}: no variants (kernels with variants: {sorted({v[0] for v in VARIANTS})})")
        variants = [v for v in VARIANTS if v[0] in a.only]
    T, E, K, H, I = [64, 8, 2, 64, 64] if a.small else a.shape
    on_gpu = torch.cuda.is_available()
    dev, dt = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    if not on_gpu:  # the interpreter ignores TUNING: only the sweep logic is exercised
        print("no CUDA: checking the script's logic under the interpreter (timings meaningless)")
        if hasattr(torch, "_grouped_mm"):  # the backward variants through torch's CPU _grouped_mm
            tk._grouped_mm_applies = lambda *args: True
    x, idx, w, gu, dn, dout = make_inputs(T, E, K, H, I, dev, dt)
    slot, offs = reference.route(idx, E)
    flops = 3 * T * K * (2 * H * 2 * I + 2 * I * H)

    def fwd():
        return tk.moe_fwd(x, idx, w, gu, dn, slot, offs)

    saved = fwd()

    def bwd():
        return tk.moe_bwd(dout, x, idx, w, gu, dn, saved[1], slot, offs, saved[2])

    def fwd_bwd():
        return fwd() + bwd()

    def timed(fn, rep=40):
        if not on_gpu:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")

    def paired(phase, name, variant, current, rounds=PAIRED_ROUNDS):
        """(variant ms, current ms) of phase: medians over calls that alternate between the two configs of kernel
        `name`, so that both see the same clocks (at its power cap the H200's SM clock wanders by ~10 % within
        seconds: two back-to-back do_bench runs of one config differ by more than most variants gain)."""
        cfgs = (variant, current)
        for cfg in cfgs * 3:  # warm-up (and compile) both
            tk.TUNING[name] = cfg
            phase()
        times = ([], [])
        for i in range(2 * rounds):
            tk.TUNING[name] = cfgs[i % 2]
            if on_gpu:
                ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                ev[0].record()
                phase()
                ev[1].record()
                times[i % 2].append(ev)
            else:
                t = time.perf_counter()
                phase()
                times[i % 2].append((time.perf_counter() - t) * 1e3)
        tk.TUNING[name] = current
        if on_gpu:
            torch.cuda.synchronize()
            times = tuple([s.elapsed_time(e) for s, e in ev_list] for ev_list in times)
        return statistics.median(times[0]), statistics.median(times[1])

    def total():
        r, f, b = timed(lambda: reference.route(idx, E), 100), timed(fwd, 100), timed(bwd, 100)
        print(f"  route {r:.3f} + fwd {f:.3f} + bwd {b:.3f} = {r + f + b:.3f} ms "
              f"({flops / (r + f + b) / 1e9:.0f} TFLOP/s)", flush=True)
        return r + f + b

    def breakdown():
        # device time of every launch in one fwd+bwd, averaged over a few iterations
        if not on_gpu:
            return
        from torch.profiler import ProfilerActivity, profile

        iters = 5
        fwd_bwd()
        torch.cuda.synchronize()
        try:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(iters):
                    reference.route(idx, E)
                    fwd_bwd()
                torch.cuda.synchronize()
        except Exception as e:  # profiler unavailable: the totals above still stand
            print(f"  (no breakdown: {type(e).__name__} {str(e)[:100]})")
            return
        per_name, calls = defaultdict(float), defaultdict(int)
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                per_name[ev.name] += ev.time_range.elapsed_us() / iters
                calls[ev.name] += 1
        device_ms = sum(per_name.values()) / 1e3
        print(f"  per-kernel device time of route+fwd+bwd (sum {device_ms:.3f} ms):")
        for name, us in sorted(per_name.items(), key=lambda kv: -kv[1]):
            print(f"    {us / 1e3:8.3f} ms {100 * us / 1e3 / device_ms:5.1f}%  x{calls[name] // iters}  {name[:90]}")

    t0 = time.time()
    ref_f, ref_b = [o.clone() for o in fwd()], [o.clone() for o in bwd()]
    print(f"shape T={T} E={E} K={K} H={H} I={I} {dt}; current TUNING:", flush=True)
    base_ms = total()
    breakdown()

    start = {k: dict(v) for k, v in tk.TUNING.items()}
    best = {name: (None, 0.0, None) for name in start}  # kernel -> (overrides, fractional gain, context)
    print(f"\nvariants ({len(variants)}; time = the phase that runs the kernel, paired with the current config):")
    last_s = 0.0
    for name, over, *context in variants:
        context = context[0] if context else {}
        if time.time() - t0 + last_s > a.budget_s:
            print(f"  budget of {a.budget_s:.0f} s spent: skipping the remaining variants", flush=True)
            break
        phase = fwd_bwd if name == "combine" else fwd if name.endswith("_fwd") else bwd
        ref = ref_f + ref_b if name == "combine" else ref_f if name.endswith("_fwd") else ref_b
        for k, v in context.items():
            tk.TUNING[k] = dict(start[k], **v)
        tk.TUNING[name] = dict(start[name], **over)
        ctx = ", ".join(f"{k}={v}" for o in context.values() for k, v in o.items())
        label = f"{name:19s} {str(over):40s}" + (f" [{ctx}]" if context else "")
        impls = {n: tk.TUNING[n]["impl"] for n in [name, *context] if n == "backward"}
        if impls and tk.backward_impl(x, H, I, E) != impls["backward"]:
            for k in [name, *context]:
                tk.TUNING[k] = start[k]
            print(f"  {label} n/a here ({impls['backward']} does not apply: grouped_mm needs the "
                  f"torch._grouped_mm fast path): skipped", flush=True)
            continue
        v0 = time.time()
        try:
            err = rel_err(phase(), ref)
            ms, cur_ms = paired(phase, name, tk.TUNING[name], start[name])  # both with the context, if any
        except Exception as e:  # e.g. out of shared memory, or an API this triton lacks
            for k in context:
                tk.TUNING[k] = start[k]
            print(f"  {label} FAILED {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}", flush=True)
            continue
        finally:
            tk.TUNING[name] = start[name]
        for k in context:
            tk.TUNING[k] = start[k]
        last_s = time.time() - v0
        gain = (cur_ms - ms) / cur_ms
        ok = err <= MAX_REL_ERR
        print(f"  {label} {ms:7.3f} ms vs {cur_ms:7.3f} ({100 * gain:+5.1f}%)  rel err {err:.1e}"
              f"{'' if ok else '  WRONG (rejected)'}", flush=True)
        if ok and gain > max(MIN_GAIN, best[name][1]):
            best[name] = (over, gain, context)

    print("\nbest per kernel:")
    for name, (over, gain, context) in best.items():
        # a variant timed in a context counts only if the final config keeps that context (e.g. the Triton
        # weight-grad kernels' configs, if impl "triton" won)
        final = {k: dict(start[k], **(best[k][0] or {})) for k in context or {}}
        lost = any(final[k].get(kk) != vv for k, v in (context or {}).items() for kk, vv in v.items())
        if lost:
            print(f"  {name:19s} keep current ({over} won in {context}, which the final config does not keep)")
            continue
        print(f"  {name:19s} {'keep current' if over is None else f'{over} ({100 * gain:+.1f}% on its phase)'}")
        if over is not None:
            tk.TUNING[name] = dict(start[name], **over)
    err = rel_err(fwd() + bwd(), ref_f + ref_b)
    print(f"\nfinal (rel err vs start {err:.1e}{'' if err <= MAX_REL_ERR else ' WRONG'}):", flush=True)
    final_ms = total()
    if any(over is not None for over, _, _ in best.values()):
        breakdown()
    print(f"fwd+bwd {base_ms:.3f} -> {final_ms:.3f} ms ({time.time() - t0:.0f} s). Paste into triton_kernels.py:")
    print("TUNING = {")
    for k, v in tk.TUNING.items():
        print(f"    {k!r}: dict({', '.join(f'{kk}={vv!r}' for kk, vv in v.items())}),")
    print("}")


if __name__ == "__main__":
    main()
