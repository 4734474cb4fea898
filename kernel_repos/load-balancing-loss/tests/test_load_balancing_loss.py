"""Numerics of the fused load-balancing loss and the fused softmax-top-k router, forward and backward.

CPU runs the Triton kernels under TRITON_INTERPRET=1 (root conftest), fp32/fp16 at small shapes; bf16 at
the real sizes is marked gpu. References: a float64 implementation of the spec (selection on the routing
weights rounded to the logits dtype, ties to the lower index) and transformers' own functions.
"""
import types
from pathlib import Path

import pytest
import torch

import hubfuse.load_balancing_loss as lbl
from hubfuse.load_balancing_loss import layers, reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-7), torch.float16: dict(rtol=2e-3, atol=1e-5),
       torch.bfloat16: dict(rtol=2e-2, atol=1e-4)}


# ------------------------------------------------------------------ float64 references

def lbl_float64_parts(gate_logits, num_experts, top_k, mask=None):
    """Spec in float64 on the logits' device: (loss, per-layer routing probs p (logits-dtype rounded, as HF),
    token weights, per-expert selection counts, total rows n)."""
    T, dev = gate_logits[0].shape[0], gate_logits[0].device
    wt = torch.ones(T, dtype=torch.float64, device=dev) if mask is None else mask.reshape(-1).double()
    counts = torch.zeros(num_experts, dtype=torch.float64, device=dev)
    prob_sum = torch.zeros(num_experts, dtype=torch.float64, device=dev)
    probs = []
    for z in gate_logits:
        p_r = torch.softmax(z.detach().float(), -1).to(z.dtype)  # HF routing weights (logits dtype)
        sel = reference.topk_lowest_index(p_r, top_k)
        p = p_r.double()
        probs.append(p)
        counts += torch.zeros(num_experts, dtype=torch.float64, device=dev).scatter_add_(
            0, sel.reshape(-1), wt.repeat_interleave(top_k))
        prob_sum += (p * wt[:, None]).sum(0)
    n = wt.sum() * len(gate_logits)
    loss = num_experts * ((counts / n) * (prob_sum / n)).sum()
    return loss, probs, wt, counts, n


def lbl_grad_float64(p, wt, w):
    """d loss / d z of one layer for dloss/dprob_sum = w (E,): mask_t * p * (w - <p, w>)."""
    w = w[None, :]
    return p * (w - (p * w).sum(-1, keepdim=True)) * wt[:, None]


def lbl_float64(gate_logits, num_experts, top_k, mask=None):
    """Spec in float64 on the logits' device: returns (loss, [dloss/dz per layer]) for an upstream grad of 1."""
    loss, probs, wt, counts, n = lbl_float64_parts(gate_logits, num_experts, top_k, mask)
    w = num_experts * counts / n / n
    return loss, [lbl_grad_float64(p, wt, w) for p in probs]


def router_float64(z, top_k, normalize):
    """(scores, indices, z64) in float64 with the kernels' tie rule; z64 is a float64 leaf for autograd."""
    z64 = z.detach().double().cpu().requires_grad_()
    p = torch.softmax(z64, -1)
    idx = reference.topk_lowest_index(torch.softmax(z.detach().float(), -1).cpu(), top_k)
    v = p.gather(1, idx)
    s = v / v.sum(-1, keepdim=True) if normalize else v
    return s, idx, z64


def make_logits(L, T, E, dtype, scale=1.0, device=DEV):
    return [(torch.randn(T, E, device=device) * scale).to(dtype).requires_grad_() for _ in range(L)]


def make_mask(T, device=DEV):
    mask = (torch.rand(T, device=device) > 0.3).long()
    mask[0] = 1
    return mask


def run_fused(zs, E, K, mask, upstream=1.0):
    loss = lbl.load_balancing_loss(zs, E, K, mask)
    (loss * upstream).backward()
    grads = [z.grad.clone() for z in zs]
    for z in zs:
        z.grad = None
    return loss.detach(), grads


# ------------------------------------------------------------------ load-balancing loss

SHAPES = [  # layers, tokens, experts, top_k, masked
    (1, 1, 4, 1, False),
    (3, 37, 8, 2, True),
    (2, 50, 128, 8, False),
    (2, 19, 130, 1, True),
    (1, 9, 512, 8, True),
    (5, 3, 6, 6, False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("L,T,E,K,masked", SHAPES)
def test_lbl_matches_float64(dtype, L, T, E, K, masked):
    torch.manual_seed(L * 1000 + T * 10 + E + K)
    zs = make_logits(L, T, E, dtype, scale=2.0)
    mask = make_mask(T) if masked else None
    upstream = 1.7
    loss, grads = run_fused(zs, E, K, mask, upstream)
    ref_loss, ref_grads = lbl_float64(zs, E, K, mask)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-7)
    for g, r in zip(grads, ref_grads):
        assert g.dtype == dtype and g.shape == (T, E)
        torch.testing.assert_close(g.double(), r * upstream, **TOL[dtype])
    if masked:  # padded tokens get no gradient
        for g in grads:
            assert (g[mask.bool().logical_not()] == 0).all()


HF_CASES = [  # layers, tokens, experts, top_k, masked, kind
    (4, 33, 4, 1, True, "random"),
    (3, 40, 64, 8, False, "random"),
    (2, 17, 512, 8, True, "random"),
    (3, 24, 16, 2, False, "equal_layers"),
    (3, 24, 16, 4, True, "skewed"),
]


@pytest.mark.parametrize("L,T,E,K,masked,kind", HF_CASES)
def test_lbl_matches_transformers(L, T, E, K, masked, kind):
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func as hf35
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func as hf3

    torch.manual_seed(7 + L + T + E)
    zs = make_logits(L, T, E, torch.float32)
    if kind == "equal_layers":
        zs = [zs[0]] * L
    elif kind == "skewed":  # every token routed to the first experts; layers very different
        with torch.no_grad():
            zs[0][:, :K] += 20.0
            zs[1].mul_(10.0)
    mask = make_mask(T).reshape(1, T) if masked else None
    leaves = list({id(z): z for z in zs}.values())
    loss = lbl.load_balancing_loss(tuple(zs), E, K, mask)
    grads = torch.autograd.grad(loss, leaves)
    # HF's function run in float64 is the oracle: its fp32 run rounds differently on every device (a 2e-8
    # gap in a 1e-4 gradient failed on CUDA), so fp32-vs-fp32 would only compare two rounding orders
    leaves64 = [z.detach().double().requires_grad_() for z in leaves]
    zs64 = [leaves64[[id(x) for x in leaves].index(id(z))] for z in zs]
    for hf in (hf3, hf35):
        hf_loss = hf(tuple(zs64), E, K, mask)
        hf_grads = torch.autograd.grad(hf_loss, leaves64)
        torch.testing.assert_close(loss.double(), hf_loss.double(), rtol=1e-6, atol=1e-8)
        for g, h in zip(grads, hf_grads):
            # fp32 math; the softmax gradient p * (c - sum p c) cancels: ~16 ulps of the largest gradient
            torch.testing.assert_close(g.double(), h.double(), rtol=1e-5, atol=2e-6 * h.abs().max().item())


def test_lbl_input_forms_and_determinism():
    torch.manual_seed(3)
    zs = make_logits(3, 21, 12, torch.float32)
    stacked = torch.stack([z.detach() for z in zs]).requires_grad_()
    a, ga = run_fused(zs, 12, 3, None)
    b, gb = run_fused(zs, 12, 3, None)
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ga, gb))  # bitwise repeatable
    c = lbl.load_balancing_loss(stacked, 12, 3)
    c.backward()
    assert torch.equal(a, c.detach()) and torch.equal(torch.stack(ga), stacked.grad)
    assert lbl.load_balancing_loss(None, 12, 3) == 0
    assert lbl.load_balancing_loss_func(zs, 12, 3) == 0  # HF returns 0 for a non-tuple
    assert torch.equal(lbl.load_balancing_loss_func(tuple(zs), 12, 3).detach(), a)
    # non-contiguous layer logits are accepted
    nc = [torch.randn(12, 21).t().requires_grad_() for _ in range(2)]
    torch.testing.assert_close(lbl.load_balancing_loss(nc, 12, 3),
                               lbl.load_balancing_loss([z.contiguous() for z in nc], 12, 3))


def _kernel_counts(zs, E, K, mask=None):
    """Per-expert selection counts of the fused forward, recovered from dloss/dprob_sum = E * counts / n^2."""
    from hubfuse.load_balancing_loss.ops import _lbl_fwd

    _, n = lbl_float64_parts(zs, E, K, mask)[3:]
    if mask is not None:  # as the public function passes it
        mask = mask.reshape(-1).view(torch.uint8) if mask.dtype == torch.bool else mask.reshape(-1)
    _, dloss = _lbl_fwd([z.detach() for z in zs], mask, E, K)
    return dloss.double() * n * n / E


def test_lbl_fp32_ties_at_kth_place():
    """fp32 selection keys drop low bits of p (2^-17 relative at E=256): near-ties at the k-th place (p 1.5e-6
    apart, ~12 ulp) must still pick the larger p (the exact 64-bit redo), exact ties the lower column."""
    torch.manual_seed(8)
    T, E, K = 48, 256, 8
    z = torch.randn(T, E, dtype=torch.float64) * 2
    order = z.argsort(-1, descending=True)
    kth, nxt = order[:, K - 1], order[:, K]
    rows = torch.arange(T)
    sign = torch.where(torch.rand(T) < 0.5, -1.0, 1.0)  # the lower column above or below the other
    z[rows, nxt] = z[rows, kth] - 1.5e-6 * sign * torch.where(kth < nxt, 1.0, -1.0)
    z[:8, nxt[:8]] = z[:8, kth[:8]]  # exact ties
    z[8:12] = 0.25  # all experts tie
    zs = [z.float().to(DEV).requires_grad_(), torch.randn(T, E, device=DEV).requires_grad_()]
    mask = make_mask(T)
    for m in (None, mask):
        counts = _kernel_counts(zs, E, K, m)
        assert torch.equal(counts.round(), lbl_float64_parts(zs, E, K, m)[3])
        loss, grads = run_fused(zs, E, K, m)
        ref_loss, ref_grads = lbl_float64(zs, E, K, m)
        torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_lbl_launch_configs_agree(monkeypatch, dtype):
    """Every launch setting the tuner may pick (tile, lanes, warps, grid size) gives the same selection and
    the same loss and grads to rounding."""
    from hubfuse.load_balancing_loss import triton_kernels

    torch.manual_seed(9)
    L, T, E, K = 2, 45, 24, 3
    zs = make_logits(L, T, E, dtype, scale=2.0)
    mask = make_mask(T).bool()
    ref_loss, ref_grads = lbl_float64(zs, E, K, mask)
    counts = lbl_float64_parts(zs, E, K, mask)[3]
    for tile, lanes, warps, programs in ((512, 1, 2, 1), (1024, 4, 4, 7), (256, 32, 1, 1024), (4096, 2, 8, 3)):
        cfg = dict(tile=tile, lanes=lanes, num_warps=warps, programs=programs, num_stages=1)
        for kind in ("fwd", "bwd", "fwd_fp32", "bwd_fp32"):
            monkeypatch.setitem(triton_kernels.TUNING, kind, cfg)
        assert torch.equal(_kernel_counts(zs, E, K, mask).round(), counts), cfg
        loss, grads = run_fused(zs, E, K, mask)
        torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-7)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g.double(), r, **TOL[dtype])


def test_lbl_unaligned_layer_views():
    """Layers that are views into one buffer at offsets that are not 16-byte multiples (70 bytes apart)."""
    torch.manual_seed(4)
    stacked = torch.randn(3, 7, 5, device=DEV).half().requires_grad_()
    mask = make_mask(7)
    loss = lbl.load_balancing_loss(stacked, 5, 2, mask)
    loss.backward()
    ref_loss, ref_grads = lbl_float64(list(stacked.detach().unbind(0)), 5, 2, mask)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(stacked.grad.double(), torch.stack(ref_grads), **TOL[torch.float16])


@pytest.mark.skipif(DEV != "cpu", reason="CPU stand-in for the CUDA-graph capture branch")
def test_lbl_capture_branch_writes_the_table_by_launches(monkeypatch):
    """The branch taken for a new layout under CUDA-graph capture, forced on CPU: the offsets written by
    `_offset_table_kernel` launches (two at 19 layers), no stacked copy; the table equals the one copied from
    the host, and loss and gradients match float64."""
    from hubfuse.load_balancing_loss import triton_kernels

    torch.manual_seed(6)
    for L, dtype, (T, E) in ((3, torch.float32, (9, 12)), (19, torch.float16, (7, 5))):  # aligned, unaligned
        zs = make_logits(L, T, E, dtype)
        zs.insert(0, zs.pop(L // 2))  # offsets of both signs
        copied = triton_kernels.layer_table(zs)
        monkeypatch.setattr(triton_kernels, "capturing", lambda device: True)
        monkeypatch.setattr(triton_kernels, "_OFFSET_TABLES", {})
        base, table, unit = triton_kernels.layer_table(zs)
        assert base is zs[0] and unit == copied[2]
        assert table.tolist() == copied[1].tolist() and len(set(table.tolist())) == L
        mask = make_mask(T)
        loss, grads = run_fused(zs, E, 2, mask)
        ref_loss, ref_grads = lbl_float64(zs, E, 2, mask)
        torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-7)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g.double(), r, **TOL[dtype])
        monkeypatch.undo()


def test_lbl_bad_inputs():
    z = torch.randn(10, 8)
    with pytest.raises(ValueError, match="num_experts"):
        lbl.load_balancing_loss([z], 16, 2)
    with pytest.raises(ValueError, match="top_k"):
        lbl.load_balancing_loss([z], 8, 9)
    with pytest.raises(ValueError, match="top_k"):
        lbl.load_balancing_loss([z], 8, 0)
    with pytest.raises(ValueError, match="attention_mask"):
        lbl.load_balancing_loss([z], 8, 2, torch.ones(2, 6))
    with pytest.raises(ValueError, match="shape"):
        lbl.load_balancing_loss([z, torch.randn(11, 8)], 8, 2)
    with pytest.raises(TypeError, match="dtype"):
        lbl.load_balancing_loss([z.long()], 8, 2)
    with pytest.raises(TypeError, match="dtype"):
        lbl.load_balancing_loss([z, z.half()], 8, 2)
    with pytest.raises(ValueError, match="empty"):
        lbl.load_balancing_loss([], 8, 2)
    with pytest.raises(ValueError, match="empty"):
        lbl.load_balancing_loss([torch.randn(0, 8)], 8, 2)
    with pytest.raises(ValueError, match="2-D"):
        lbl.load_balancing_loss([torch.randn(2, 5, 8)], 8, 2)
    with pytest.raises(TypeError, match="top_k"):
        lbl.load_balancing_loss([z], 8, 2.0)
    with pytest.raises(TypeError):
        lbl.load_balancing_loss("logits", 8, 2)


def test_lbl_torch_compile_fullgraph():
    torch.manual_seed(5)
    zs = make_logits(3, 13, 10, torch.float32)
    mask = make_mask(13)

    def f(a, b, c, m):
        return lbl.load_balancing_loss((a, b, c), 10, 2, m) * 0.01

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(*zs, mask)
    grads = torch.autograd.grad(out, zs)
    ref = f(*zs, mask)
    ref_grads = torch.autograd.grad(ref, zs)
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


# ------------------------------------------------------------------ router

ROUTER_SHAPES = [(1, 4, 1), (37, 8, 2), (50, 128, 8), (9, 130, 10), (5, 512, 8)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("T,E,K", ROUTER_SHAPES)
def test_router_matches_float64(dtype, normalize, T, E, K):
    torch.manual_seed(T + E + K)
    # distinct logits: no exact ties, so the selection is unambiguous in every implementation
    z = (torch.randperm(T * E, device=DEV).reshape(T, E).float() / (T * E) * 8).to(dtype).requires_grad_()
    scores, indices = lbl.softmax_topk(z, K, normalize)
    s, idx, z64 = router_float64(z, K, normalize)
    assert scores.dtype == dtype and indices.dtype == torch.int64 and scores.shape == (T, K)
    assert torch.equal(indices.cpu(), idx)
    torch.testing.assert_close(scores.double().cpu(), s.detach().to(dtype).double(), **TOL[dtype])
    ds = torch.randn(T, K, device=DEV).to(dtype)
    (dz,) = torch.autograd.grad(scores, z, ds)
    (dz64,) = torch.autograd.grad(s, z64, ds.double().cpu())
    torch.testing.assert_close(dz.double().cpu(), dz64, **TOL[dtype])


@pytest.mark.parametrize("normalize", [True, False])
def test_router_layers_match_transformers(normalize):
    from transformers import Qwen3_5MoeTextConfig, Qwen3MoeConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(11)
    cfg = Qwen3MoeConfig(hidden_size=48, num_experts=24, num_experts_per_tok=4, norm_topk_prob=normalize)
    cfg35 = Qwen3_5MoeTextConfig(hidden_size=48, num_experts=24, num_experts_per_tok=4)
    layout = layers.TopKRouterLayout(cfg)
    cases = [(Qwen3MoeTopKRouter(cfg), layers.TopKRouter), (Qwen3_5MoeTopKRouter(cfg35), layers.SoftmaxTopKRouter)]
    for hf_mod, layer in cases:
        hf_mod = hf_mod.to(DEV)
        with torch.no_grad():
            hf_mod.weight.normal_()
            layout.weight.copy_(hf_mod.weight)
        layout.to(DEV)
        h = torch.randn(2, 7, 48, device=DEV, requires_grad=True)
        ref = hf_mod(h)
        fused = types.MethodType(layer.forward, hf_mod)(h)
        if layer is layers.TopKRouter:
            lay = layout(h)
            for a, b in zip(lay, ref):
                assert torch.equal(a, b)
        assert torch.equal(fused[0], ref[0]) and torch.equal(fused[2], ref[2])
        torch.testing.assert_close(fused[1], ref[1], rtol=1e-6, atol=1e-7)
        # grads to hidden and weight through both the logits and the scores
        up_l, up_s = torch.randn_like(ref[0]), torch.randn_like(ref[1])
        g_ref = torch.autograd.grad((ref[0] * up_l).sum() + (ref[1] * up_s).sum(), [h, hf_mod.weight])
        g_fused = torch.autograd.grad((fused[0] * up_l).sum() + (fused[1] * up_s).sum(), [h, hf_mod.weight])
        for a, b in zip(g_fused, g_ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_router_guards():
    holder = torch.nn.Module()
    holder.weight = torch.nn.Parameter(torch.randn(8, 16))
    holder.top_k = 2
    holder.e_score_correction_bias = torch.nn.Parameter(torch.zeros(8), requires_grad=False)
    with pytest.raises(NotImplementedError, match="sigmoid"):
        types.MethodType(layers.SoftmaxTopKRouter.forward, holder)(torch.randn(3, 16))
    z = torch.randn(5, 8)
    with pytest.raises(ValueError, match="top_k"):
        lbl.softmax_topk(z, 9)
    with pytest.raises(ValueError, match="empty"):
        lbl.softmax_topk(z[:, :0], 1)
    with pytest.raises(TypeError, match="dtype"):
        lbl.softmax_topk(z.long(), 2)
    with pytest.raises(ValueError, match="hidden size"):
        lbl.topk_router(torch.randn(3, 15), torch.randn(8, 16), 2)


def test_router_torch_compile_fullgraph():
    torch.manual_seed(2)
    h = torch.randn(9, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)

    def f(h, w):
        logits, scores, idx = lbl.topk_router(h, w, 4, True)
        return logits.square().mean() + (scores * idx.float()).sum()

    out = torch.compile(f, fullgraph=True, backend="aot_eager")(h, w)
    ref = f(h, w)
    torch.testing.assert_close(out, ref)
    for a, b in zip(torch.autograd.grad(out, [h, w]), torch.autograd.grad(ref, [h, w])):
        torch.testing.assert_close(a, b)


def test_build_toml_parses():
    kernels_rust = pytest.importorskip("kernels._rust")
    kernels_rust.Build.open(str(Path(__file__).resolve().parents[1]))


# ------------------------------------------------------------------ GPU, real sizes

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("masked", [False, True])
def test_gpu_lbl_real_size(dtype, masked):
    """Real size, judged against float64, in two parts. (1) Selection: the kernel's per-expert counts
    (recovered from its dloss/dprob_sum = E * counts / n^2) equal the spec's up to a few assignments that
    flip on near-ties (Triton's exp vs torch's differs by a few ulp; in bf16 that can move the rounding of p).
    (2) Gradient arithmetic: the float64 gradient computed with the kernel's own counts, per element (all
    w_e agree to ~1%, so the grads are ~1% of p * w and the fp32 cancellation in w - <p, w> makes the error
    scale with p * max|w|, not with the grad: ~1.5e-5 of max|grad| in fp32, for HF's fp32 autograd too).
    HF is not the yardstick for the grads: its bf16 autograd rounds w to bf16 (only a handful of distinct
    values when all w_e are within ~1% of each other), so its grads are ~50% off in norm; we require ours to
    be at least as close to float64 as HF's."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func as hf
    from hubfuse.load_balancing_loss.ops import _lbl_fwd

    torch.manual_seed(0)
    L, B, S, E, K = 48, 4, 2048, 128, 8
    zs = [torch.randn(B * S, E, device="cuda").to(dtype).requires_grad_() for _ in range(L)]
    mask = (torch.rand(B, S, device="cuda") > 0.2).long() if masked else None
    upstream = 3.0
    loss = lbl.load_balancing_loss(tuple(zs), E, K, mask)
    grads = torch.autograd.grad(loss * upstream, zs)
    hf_loss = hf(tuple(zs), E, K, mask)
    hf_grads = torch.autograd.grad(hf_loss * upstream, zs)
    ref_loss, probs, wt, counts, n = lbl_float64_parts(zs, E, K, mask)  # float64 on the GPU, all layers
    assert loss.device.type == "cuda" and all(g.device.type == "cuda" for g in grads)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(loss, hf_loss, rtol=1e-5, atol=1e-6)  # top-k ties at the k-th place barely move it
    # (1) selection
    mask_f = None if mask is None else mask.reshape(-1).float()
    _, dloss_dprobsum = _lbl_fwd([z.detach() for z in zs], mask_f, E, K)
    kernel_counts = dloss_dprobsum.double() * n * n / E
    assert (kernel_counts - kernel_counts.round()).abs().max().item() < 0.05
    flips = (kernel_counts.round() - counts).abs().sum().item() / 2
    assert flips <= 32, f"{flips} top-k assignments differ from the float64 spec (lower-index ties)"
    # (2) gradient arithmetic, with the kernel's counts. Bound per element: fp32 cancellation in w - <p, w>
    # (64 eps * p * max|w|); in bf16 also the storage rounding of the grad, and p itself is ambiguous by one
    # bf16 ulp where Triton's fp32 softmax (approximate exp and divide) and torch's land on opposite sides
    # of a rounding boundary (~1e-4 of the elements): 2^-7 of p_t (w - <p, w>) and of p_t * p_e * max|w|.
    w = upstream * dloss_dprobsum.double()
    w_max = w.abs().max()
    eps32 = torch.finfo(torch.float32).eps
    for layer in range(0, L, L // 6):
        g, h, p = grads[layer].double(), hf_grads[layer].double(), probs[layer]
        r = lbl_grad_float64(p, wt, w)
        bound = 64 * eps32 * p * w_max
        if dtype == torch.bfloat16:
            bound = bound + 2.0 ** -6 * r.abs() + 2.0 ** -7 * p.amax(-1, keepdim=True) * p * w_max
        worst = ((g - r).abs() / bound).max().item()
        assert worst <= 1.0, f"layer {layer}: error {worst:.2f}x the bound"
        if masked:
            assert (g[wt == 0] == 0).all()
        # HF is not more accurate: ours vs float64 (kernel counts), HF vs float64 (spec counts = HF's selection)
        r_spec = lbl_grad_float64(p, wt, upstream * E * counts / n / n)
        ours_rel = ((g - r).norm() / r.norm()).item()
        hf_rel = ((h - r_spec).norm() / r_spec.norm()).item()
        assert ours_rel <= 1.5 * hf_rel + 1e-5, (layer, ours_rel, hf_rel)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_router_real_size(dtype):
    """Contract vs HF's `softmax -> torch.topk`: per row the same set of (expert, score) pairs. The slot order
    is by descending probability, equal probabilities in increasing expert index; torch.topk's order among
    equal values is unspecified (its sort is not stable), and HF's experts accumulate per expert, not per
    slot, so the order does not change the model output. Which expert is taken when the k-th and (k+1)-th
    probabilities tie exactly (bf16 logits tie often at E=128): the lower index, as torch.topk's CUDA
    gather (strictly-greater values first, then equal ones in index order) -- asserted here with no
    exception. Only fp32 near-ties within a few ulp (Triton's exp vs torch's) may pick differently."""
    torch.manual_seed(0)
    T, H, E, K = 8192, 2048, 128, 8
    h = torch.randn(T, H, device="cuda", dtype=dtype, requires_grad=True)
    w = (torch.randn(E, H, device="cuda") * 0.02).to(dtype).requires_grad_()
    ref = reference.topk_router_hf(h, w, K, True)
    fused = lbl.topk_router(h, w, K, True)
    assert all(t.device.type == "cuda" for t in (*fused, *ref))
    assert torch.equal(fused[0], ref[0])  # the same cuBLAS linear
    p = torch.softmax(ref[0].detach(), dtype=torch.float, dim=-1)
    # order: descending probability, ties in increasing index
    pf = p.gather(1, fused[2])
    assert (pf[:, :-1] >= pf[:, 1:]).all()
    assert ((pf[:, :-1] > pf[:, 1:]) | (fused[2][:, :-1] < fused[2][:, 1:])).all()
    # the selected set
    fused_set, fused_pos = fused[2].sort(-1)
    ref_set, ref_pos = ref[2].sort(-1)
    differ = (fused_set != ref_set).any(-1)
    top = p.topk(K + 1, dim=-1).values
    exact_tie = top[:, K - 1] == top[:, K]
    near_tie = (top[:, K - 1] - top[:, K]) <= 1e-6 * top[:, K - 1]
    assert not (differ & exact_tie).any(), (
        f"{int((differ & exact_tie).sum())} rows: an exact tie at the k-th place resolved differently from "
        f"torch.topk (rows with such ties: {int(exact_tie.sum())})")
    assert not (differ & ~near_tie).any(), f"{int((differ & ~near_tie).sum())} rows select different experts"
    same = ~differ
    # scores paired by expert
    torch.testing.assert_close(fused[1].gather(1, fused_pos)[same].float(), ref[1].gather(1, ref_pos)[same].float(),
                               rtol=TOL[dtype]["rtol"], atol=1e-6)
    # gradients with an upstream that depends on the expert (not the slot)
    U = torch.randn(T, E, device="cuda") * same[:, None]

    def loss_of(out):
        return (out[1].float() * U.gather(1, out[2])).sum()

    z = ref[0].detach().requires_grad_()
    z_out = (None, *lbl.softmax_topk(z, K, True))
    pr = torch.softmax(z, dtype=torch.float, dim=-1)
    v, i = torch.topk(pr, K, dim=-1)
    z_ref = (None, (v / v.sum(-1, keepdim=True)).to(dtype), i)
    (dz_f,) = torch.autograd.grad(loss_of(z_out), z)
    (dz_r,) = torch.autograd.grad(loss_of(z_ref), z)
    torch.testing.assert_close(dz_f.float(), dz_r.float(), rtol=TOL[dtype]["rtol"],
                               atol=TOL[dtype]["rtol"] * dz_r.abs().max().item())
    # the whole router's grads (hidden, weight)
    g_ref = torch.autograd.grad(loss_of(ref), [h, w])
    g_fused = torch.autograd.grad(loss_of(fused), [h, w])
    for a, b in zip(g_fused, g_ref):
        rel = (a.float() - b.float()).norm() / b.float().norm()
        assert rel.item() < 1e-2, rel


@pytest.mark.gpu
def test_gpu_cuda_graph_capture():
    """Forward + backward captured in a CUDA graph (a new layout under capture: the table written by launches)."""
    torch.manual_seed(0)
    L, T, E, K = 4, 1024, 64, 4
    warm = [torch.randn(T, E, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(L)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (kernel compilation) off the capture
        for _ in range(2):
            torch.autograd.grad(lbl.load_balancing_loss(warm, E, K), warm)
    torch.cuda.current_stream().wait_stream(side)
    static, pads = [], []
    for i in range(L):  # a layout not seen before: the table is created inside the capture
        static.append(torch.randn(T, E, device="cuda", dtype=torch.bfloat16, requires_grad=True))
        pads.append(torch.empty(4096 * (i + 3), device="cuda"))
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.cuda.graph(graph):
        loss = lbl.load_balancing_loss(static, E, K)
        grads = torch.autograd.grad(loss, static)
    # the capture holds the gradients' one (L, T, E) buffer and small tables, not a stacked copy of the logits
    layers_bytes = L * T * E * static[0].element_size()
    assert torch.cuda.max_memory_allocated() - before < 1.5 * layers_bytes
    fresh = [torch.randn(T, E, device="cuda", dtype=torch.bfloat16) for _ in range(L)]
    with torch.no_grad():
        for s, f in zip(static, fresh):
            s.copy_(f)
    graph.replay()
    torch.cuda.synchronize()
    ref_loss, ref_grads = lbl_float64(fresh, E, K)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-7)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r, **TOL[torch.bfloat16])


_SM90_COMPILE_SCRIPT = r"""
import sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hubfuse.load_balancing_loss import triton_kernels as tk


def compile_ptx(fn, signature, constexprs):
    names = list(signature)
    aligned = [n for n in names if signature[n].startswith("*") or signature[n] == "i32" and n in ("E", "stride_z")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]


ints = {"T": "i32", "rows_per_program": "i32"}
tile = {"E": 128, "BLOCK_T": 32, "BLOCK_E": 128, "NUM_STAGES": 1}
fwd = {}
for dt in ("bf16", "fp32"):  # exact 32-bit keys; fp32's truncated keys with the 64-bit redo
    fwd[dt] = compile_ptx(
        tk._lbl_fwd_kernel,
        {"Z0": "*" + dt, "OFFS": "*i64", "MASK": "*i64", "PARTS": "*fp32", **ints, "num_parts": "i32",
         **{k: "constexpr" for k in ("DT", "UNIT", "HAS_MASK", "TOP_K", "COL_BITS", "EXACT_KEYS", "CHUNK", *tile)}},
        {"DT": getattr(tl, {"bf16": "bfloat16", "fp32": "float32"}[dt]), "UNIT": 8 if dt == "bf16" else 4,
         "HAS_MASK": True, "TOP_K": 8, "COL_BITS": 7, "EXACT_KEYS": dt == "bf16",
         "CHUNK": 32 if dt == "bf16" else 16, **tile})
bwd = compile_ptx(tk._lbl_bwd_kernel,
                  {"Z0": "*bf16", "OFFS": "*i64", "GRAD": "*bf16", "MASK": "*i64", "DLOSS": "*fp32",
                   "GRAD_OUT": "*fp32", **ints, **{k: "constexpr" for k in ("DT", "UNIT", "HAS_MASK", "CHUNK", *tile)}},
                  {"DT": tl.bfloat16, "UNIT": 8, "HAS_MASK": True, "CHUNK": 32, **tile})
fwd = fwd["bf16"] + fwd["fp32"]
assert "ld.global.v4.b32" in fwd and "ld.global.v4.b32" in bwd and "st.global.v4.b32" in bwd, "not vectorised"
rsig = {"T": "i32", "E": "i32", "stride_z": "i32", "rows_per_program": "i32",
        **{k: "constexpr" for k in ("TOP_K", "NORMALIZE", "BLOCK_T", "BLOCK_E", "BLOCK_K")}}
rconst = {"TOP_K": 8, "NORMALIZE": True, "BLOCK_T": 16, "BLOCK_E": 128, "BLOCK_K": 8}
compile_ptx(tk._router_fwd_kernel, {"Z": "*bf16", "SCORES": "*bf16", "INDICES": "*i64", "STATS": "*fp32", **rsig},
            rconst)
compile_ptx(tk._router_bwd_kernel, {"DS": "*bf16", "Z": "*bf16", "STATS": "*fp32", "INDICES": "*i64",
                                    "DZ": "*bf16", **rsig}, rconst)
compile_ptx(tk._lbl_reduce_parts_kernel,
            {"PARTS": "*fp32", "TOTALS": "*fp32", "num_parts": "i32", "E": "i32", "BLOCK_P": "constexpr",
             "BLOCK_E": "constexpr"}, {"BLOCK_P": 512, "BLOCK_E": 8})
compile_ptx(tk._lbl_loss_kernel,
            {"TOTALS": "*fp32", "LOSS": "*fp32", "DLOSS": "*fp32", "E": "i32", "top_k_f": "fp32",
             "num_experts_f": "fp32", "BLOCK_E": "constexpr"}, {"BLOCK_E": 128})
print("compiled")
"""


def test_kernels_compile_for_sm90():
    """Ahead-of-time compile of every kernel for an H100/H200 target (no GPU needed, in a subprocess without
    TRITON_INTERPRET): catches compiled-mode errors the interpreter cannot, and checks that the layer loads
    and gradient stores are 16-byte vectorised."""
    import os
    import subprocess
    import sys

    import hubfuse

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(hubfuse.__file__).resolve().parents[1]),  # this hubfuse
                                         env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", _SM90_COMPILE_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-3000:]
