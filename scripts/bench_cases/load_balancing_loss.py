"""GPU side-by-side cases for hubfuse/load-balancing-loss, called by scripts/bench_ops.py.

1. The aux loss at the issue's shape: 48 layers x 8192 tokens x 128 experts, top-8, bf16 and fp32 router
   logits (and bf16 with a padding mask), forward + backward: HF eager `load_balancing_loss_func`,
   torch.compile of it, ours. Liger has no such op. Inputs: 48 separate leaves, as a model records them.
   Floor = one read of all logits (fwd) + one read and one write (bwd) at the measured copy bandwidth
   (anchor_bench.py's formula, at the logits' element size).
2. The router at Qwen3-30B-A3B's shape (8192 tokens, hidden 2048, 128 experts, top-8, bf16): HF's
   `Qwen3MoeTopKRouter` forward, torch.compile of it, ours (`topk_router`: cuBLAS linear + fused
   softmax-top-k), fwd+bwd through the scores. Floor = router GEMM FLOPs fwd+bwd at the mm rate.
3. The softmax-top-k part alone (router logits in, scores out): floor = read logits fwd, read + write bwd.
"""
import torch

L, T, E, K, H = 48, 8192, 128, 8, 2048


def run(h):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter, load_balancing_loss_func

    lbl = h.load_kernel("load-balancing-loss")
    dev = h.dev

    # ---- 1. aux loss over all layers
    for dt, masked in ((torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True)):
        tag = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dt] + ("_masked" if masked else "")
        op = f"load_balancing_loss_L{L}_T{T}_E{E}_K{K}_{tag}"
        floor = 3 * L * T * E * torch.finfo(dt).bits // 8 / h.COPY_BW * 1e3
        note = "floor = read logits fwd + read/write bwd; mask: batch 4 x 2048, 20% padding" if masked else \
            "floor = read logits fwd + read/write bwd"

        def mk(dt=dt, masked=masked):
            g = torch.Generator(device=dev).manual_seed(0)
            zs = [torch.randn(T, E, device=dev, generator=g).to(dt).requires_grad_() for _ in range(L)]
            mask = (torch.rand(4, T // 4, device=dev, generator=g) > 0.2).long() if masked else None
            return (*zs, mask)

        def hf_fn(*args):
            return load_balancing_loss_func(tuple(args[:-1]), E, K, args[-1])

        def ours(*args):
            return lbl.load_balancing_loss(args[:-1], E, K, args[-1])

        h.bench(op, "hf_eager", hf_fn, mk, floor, note=note)
        h.bench(op, "torch.compile(hf)", h.comp(hf_fn), mk, floor)
        h.bench(op, "hubfuse", ours, mk, floor)
        torch.cuda.empty_cache()

    # ---- 2. whole router (GEMM + softmax-top-k), bf16
    dt = torch.bfloat16
    cfg = Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=K, norm_topk_prob=True)
    router = Qwen3MoeTopKRouter(cfg).to(dev, dt)
    op = f"moe_router_T{T}_H{H}_E{E}_K{K}_bf16"
    floor = 3 * 2 * T * H * E / h.MM_RATE * 1e3

    def mk_router():
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(T, H, device=dev, generator=g).to(dt).requires_grad_()
        w = (torch.randn(E, H, device=dev, generator=g) * 0.02).to(dt).requires_grad_()
        return x, w

    def hf_router(x, w):
        return torch.func.functional_call(router, {"weight": w}, (x,))[1]

    def ours_router(x, w):
        return lbl.topk_router(x, w, K, True)[1]

    h.bench(op, "hf_eager", hf_router, mk_router, floor, note="output: scores; floor = router GEMM fwd+bwd FLOPs")
    h.bench(op, "torch.compile(hf)", h.comp(hf_router), mk_router, floor)
    h.bench(op, "hubfuse", ours_router, mk_router, floor)

    # ---- 3. softmax-top-k alone on bf16 router logits
    op = f"softmax_topk_T{T}_E{E}_K{K}_bf16"
    floor = 3 * T * E * 2 / h.COPY_BW * 1e3

    def mk_logits():
        g = torch.Generator(device=dev).manual_seed(0)
        return (torch.randn(T, E, device=dev, generator=g).to(dt).requires_grad_(),)

    def hf_softmax_topk(z):
        p = torch.softmax(z, dtype=torch.float, dim=-1)
        v, _ = torch.topk(p, K, dim=-1)
        v = v / v.sum(-1, keepdim=True)
        return v.to(z.dtype)

    h.bench(op, "hf_eager", hf_softmax_topk, mk_logits, floor, note="floor = read logits fwd + read/write bwd")
    h.bench(op, "torch.compile(hf)", h.comp(hf_softmax_topk), mk_logits, floor)
    h.bench(op, "hubfuse", lambda z: lbl.softmax_topk(z, K, True)[0], mk_logits, floor)
