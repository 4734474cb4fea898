"""GPU side-by-side cases for hubfuse/moe: routed experts fwd+bwd (bf16), called by scripts/bench_ops.py.

Shapes: Qwen3-30B-A3B (T=8192 and T=32768, E=128, top-8, H=2048, I=768) and Qwen3.5-35B-A3B (T=8192, E=256,
top-8, H=2048, I=512). Peers: HF eager loop, HF `batched_mm`, HF `grouped_mm`, torch.compile of HF
`grouped_mm`, Liger's fused MoE; ours through the functional API. Weights are inputs (fresh leaves, their
grads reset every step like the activations'), so every impl does the same work: dhidden, dweights, dW.
Floor = fwd+bwd GEMM FLOPs (3 x 2 x T*K x 3*H*I) at the measured bf16 matmul rate (as anchor_bench.py).
BENCH_MOE_CASES=label[,label] runs only those cases (Liger's fused MoE autotunes for minutes per shape).
After each case's rows, the fast impls (INTERLEAVED) are timed once more round-robin, call by call, on the same inputs:
rows "<impl> (interleaved)", whose ratios do not move with clock / power drift between the do_bench calls.
"""
import importlib
import os

import torch

CASES = [  # label, T, H, E, K, I, peers beyond grouped_mm
    ("qwen3_moe_30b_a3b", 8192, 2048, 128, 8, 768, ("eager", "batched_mm", "compile", "liger")),
    ("qwen3_moe_30b_a3b_T32k", 32768, 2048, 128, 8, 768, ("liger",)),
    ("qwen3_5_moe_35b_a3b", 8192, 2048, 256, 8, 512, ("liger",)),
]


# timed once more round-robin after each case's do_bench rows (`interleaved`)
INTERLEAVED = ("hf_grouped_mm", "torch.compile(hf_grouped_mm)", "liger_fused_moe", "hubfuse")
INTERLEAVED_ROUNDS = 30


def _flops(T, H, K, I):
    return 3 * T * K * (2 * H * 2 * I + 2 * I * H)


def run(h):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    moe = h.load_kernel("moe")
    tk = importlib.import_module(moe.__name__ + ".triton_kernels")
    dt = torch.bfloat16 if str(h.dev) != "cpu" else torch.float32  # cpu: smoke runs only
    only = [c for c in os.environ.get("BENCH_MOE_CASES", "").split(",") if c]
    unknown = sorted(set(only) - {case[0] for case in CASES})
    if unknown:
        raise ValueError(f"BENCH_MOE_CASES: unknown case(s) {unknown}; known: {[case[0] for case in CASES]}")
    for label, T, H, E, K, I, peers in CASES:
        if only and label not in only:
            continue
        op = f"moe_experts_{label}"
        flops = _flops(T, H, K, I)
        floor = flops / h.MM_RATE * 1e3
        note = f"T={T} E={E} K={K} H={H} I={I}; {flops / 1e12:.2f} TFLOP fwd+bwd; TFLOP/s = that / ms * 1e3"

        def mk(T=T, H=H, E=E, K=K, I=I):
            g = torch.Generator(device=h.dev).manual_seed(0)
            x = torch.randn(T, H, dtype=dt, device=h.dev, generator=g).requires_grad_()
            logits = torch.randn(T, E, device=h.dev, generator=g)
            w, idx = torch.topk(logits.softmax(-1), K, dim=-1)
            w = (w / w.sum(-1, keepdim=True)).to(dt).requires_grad_()
            gu = (torch.randn(E, 2 * I, H, dtype=dt, device=h.dev, generator=g) * 0.02).requires_grad_()
            dn = (torch.randn(E, H, I, dtype=dt, device=h.dev, generator=g) * 0.02).requires_grad_()
            return x, idx, w, gu, dn

        def hf(impl, E=E, H=H, I=I, K=K):
            cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K)
            cfg._experts_implementation = impl
            ex = Qwen3MoeExperts(cfg).to(h.dev, dt)

            def fn(x, idx, w, gu, dn):
                return torch.func.functional_call(ex, {"gate_up_proj": gu, "down_proj": dn}, (x, idx, w))

            return fn

        impls = [("hf_grouped_mm", lambda: hf("grouped_mm"))]
        if "eager" in peers:
            impls.append(("hf_eager", lambda: hf("eager")))
        if "batched_mm" in peers:
            impls.append(("hf_batched_mm", lambda: hf("batched_mm")))
        if "compile" in peers:
            impls.append(("torch.compile(hf_grouped_mm)", lambda: h.comp(hf("grouped_mm"))))
        if "liger" in peers and h.liger is not None:
            def liger():
                from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

                return lambda x, idx, w, gu, dn: LigerFusedMoEFunction.apply(x, gu, dn, idx.to(torch.int32), w)

            impls.append(("liger_fused_moe", liger))
        impls.append(("hubfuse", lambda: moe.moe_experts))
        # the leaner, slower backward (TUNING["backward"]; the default is grouped_mm)
        impls.append(("hubfuse (backward grouped_mm_lean)", lambda: moe.moe_experts))
        fns = {}  # the INTERLEAVED impls that ran, for the round-robin timing after the loop
        for impl, make_fn in impls:
            try:
                fn = make_fn()
            except Exception as e:  # peer missing or failing to build: record through the harness
                def fn(*a, e=e):
                    raise RuntimeError(f"could not build {impl}: {e}")
            default_backward = tk.TUNING["backward"]
            if impl == "hubfuse (backward grouped_mm_lean)":
                # read at call time, by every backward; only the impl changes
                tk.TUNING["backward"] = dict(default_backward, impl="grouped_mm_lean")
            try:
                h.bench(op, impl, fn, mk, floor, note=note)
            finally:
                tk.TUNING["backward"] = default_backward
            if impl in INTERLEAVED and "error" not in h.RESULTS[-1]:
                fns[impl] = fn
            torch.cuda.empty_cache()
        interleaved(h, op, fns, mk, floor)
        torch.cuda.empty_cache()


def interleaved(h, op, fns, make_inputs, floor):
    """The fast impls' fwd+bwd steps once more, round-robin: INTERLEAVED_ROUNDS calls of each, alternating call by
    call on the same inputs (CUDA events, medians). The rows above time each impl in its own do_bench call one after
    the other, so clock and power drift between those calls moves their ratios by a few percent; here it hits every
    impl alike. Rows "<impl> (interleaved)"; their peak memory is the do_bench row's."""
    if len(fns) < 2:
        return
    inputs = make_inputs()
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    upstream = torch.randn(inputs[0].shape, dtype=inputs[0].dtype, device=inputs[0].device)

    def step(fn):
        for t in leaves:
            t.grad = None
        fn(*inputs).backward(upstream)

    medians = h.round_robin_ms({impl: (lambda fn=fn: step(fn)) for impl, fn in fns.items()}, INTERLEAVED_ROUNDS)
    peak = {r["impl"]: r.get("peak_extra_MiB", 0.0) for r in h.RESULTS if r.get("op") == op}
    note = f"round-robin with {', '.join(fns)}: {INTERLEAVED_ROUNDS} alternating calls each, median"
    for impl, ms in medians.items():
        row = dict(op=op, impl=f"{impl} (interleaved)", ms=round(ms, 4), peak_extra_MiB=peak.get(impl, 0.0),
                   floor_ms=round(floor, 4), floor_ratio=round(floor / ms, 3), note=note)
        h.RESULTS.append(row)
        print(row, flush=True)
