"""Numerics of the fused cross-entropy ops against a float64 materialised reference, fwd + bwd.

On CPU the Triton kernel runs under TRITON_INTERPRET=1 (root conftest) at small sizes; bf16 at real sizes
runs on CUDA only (`gpu` marker).
"""
import os

import pytest
import torch
import torch.nn.functional as F

import hubfuse.cross_entropy as cross_entropy
from hubfuse.cross_entropy import cross_entropy as fused_ce
from hubfuse.cross_entropy import linear_cross_entropy
from hubfuse._common.device import use_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (5e-3, 5e-3), torch.bfloat16: (2e-2, 2e-2)}
# relative error of the whole tensor (|a - b| / |b|): catches errors that an absolute tolerance hides when
# the values are tiny (gradients of a mean over many tokens)
REL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _ref(logits64, labels, **opts):
    """float64 oracle: torch's F.cross_entropy (+ z-loss, softcap, num_items) on materialised logits."""
    softcap = opts.pop("softcap", None)
    z_w = opts.pop("z_loss_weight", 0.0)
    nib = opts.pop("num_items_in_batch", None)
    reduction = opts.pop("reduction", "mean")
    ignore_index = opts.get("ignore_index", -100)
    x = softcap * torch.tanh(logits64 / softcap) if softcap else logits64
    x = x.reshape(-1, x.shape[-1])
    y = labels.reshape(-1)
    rows = F.cross_entropy(x, y, reduction="none", **opts)
    valid = y != ignore_index
    z = torch.where(valid, z_w * torch.logsumexp(x, -1) ** 2, torch.zeros_like(rows))
    rows = rows + z
    if reduction == "none":
        return rows.view(labels.shape), z.view(labels.shape)
    if nib is not None:
        return rows.sum() / nib, z.sum() / nib
    if reduction == "sum":
        return rows.sum(), z.sum()
    return rows.sum() / valid.sum(), z.sum() / valid.sum()


def _labels(shape, V, ignore_frac=0.25, ignore_index=-100, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, V, shape, generator=g)
    y[torch.rand(shape, generator=g) < ignore_frac] = ignore_index
    return y.to(DEV)


def _close(a, b, dtype, what, scale=1.0):
    atol, rtol = TOL[dtype]
    a, b = a.double(), b.double()
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert torch.allclose(a, b, atol=atol * scale, rtol=rtol), f"{what}: max abs err {err}"
    if a.numel() and b.abs().max() > 0:
        assert _rel_err(a, b) < REL[dtype], f"{what}: relative error {_rel_err(a, b)}"


OPTION_SETS = [
    dict(),
    dict(reduction="sum"),
    dict(reduction="none"),
    dict(label_smoothing=0.1),
    dict(z_loss_weight=1e-3),
    dict(softcap=4.0),
    dict(num_items_in_batch=9),
    dict(label_smoothing=0.2, z_loss_weight=1e-2, softcap=3.0, reduction="none", ignore_index=7),
    dict(label_smoothing=0.05, z_loss_weight=1e-4, num_items_in_batch=5),
]


def test_kernel_path_is_exercised():
    # on CPU the tests must run the Triton kernel (interpreter), not the torch twin
    assert use_triton(torch.empty(1, device=DEV))


@pytest.mark.parametrize("opts", OPTION_SETS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_linear_cross_entropy_matches_reference(opts, dtype):
    N, H, V = 23, 24, 67  # odd token count and vocab; chunk 8 puts chunk boundaries inside the sequence
    torch.manual_seed(0)
    h = torch.randn(N, H, device=DEV, dtype=dtype, requires_grad=True)
    w = (torch.randn(V, H, device=DEV, dtype=dtype) * 0.5).requires_grad_()
    b = (torch.randn(V, device=DEV, dtype=dtype) * 0.1).requires_grad_()
    y = _labels((N,), V, ignore_index=opts.get("ignore_index", -100))
    loss, z = linear_cross_entropy(h, w, y, b, chunk_size=8, return_z_loss=True, **opts)
    upstream = torch.randn_like(loss) if loss.dim() else torch.tensor(1.7, device=DEV)
    dh, dw, db = torch.autograd.grad(loss, (h, w, b), upstream)

    h64, w64, b64 = (t.detach().double().requires_grad_() for t in (h, w, b))
    logits64 = (h64 @ w64.t() + b64)
    if dtype != torch.float32:  # the fused op computes logits in the inputs' dtype, like nn.Linear
        logits64 = logits64 + ((h @ w.t() + b).double() - logits64).detach()
    ref, ref_z = _ref(logits64, y, **dict(opts))
    rdh, rdw, rdb = torch.autograd.grad(ref, (h64, w64, b64), upstream.double())
    assert loss.dtype == torch.float32
    _close(loss, ref, dtype, "loss")
    _close(z, ref_z, dtype, "z_loss")
    _close(dh, rdh, dtype, "dhidden")
    _close(dw, rdw, dtype, "dweight")
    _close(db, rdb, dtype, "dbias")


@pytest.mark.parametrize("opts", OPTION_SETS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cross_entropy_from_logits_matches_reference(opts, dtype):
    B, S, V = 3, 7, 131
    torch.manual_seed(1)
    x = (torch.randn(B, S, V, device=DEV, dtype=dtype) * 3).requires_grad_()
    y = _labels((B, S), V, ignore_index=opts.get("ignore_index", -100), seed=1)
    loss, z = fused_ce(x * 1, y, return_z_loss=True, **opts)  # x * 1: the in-place grad goes to the copy
    upstream = torch.randn_like(loss) if loss.dim() else torch.tensor(0.6, device=DEV)
    (dx,) = torch.autograd.grad(loss, (x,), upstream)
    x64 = x.detach().double().requires_grad_()
    ref, ref_z = _ref(x64, y, **dict(opts))
    (rdx,) = torch.autograd.grad(ref, (x64,), upstream.double())
    _close(loss, ref, dtype, "loss")
    _close(z, ref_z, dtype, "z_loss")
    _close(dx, rdx, dtype, "dlogits")
    assert dx.dtype == dtype


@pytest.mark.parametrize("op", ["cross_entropy", "linear_cross_entropy"])
def test_backward_fills_no_zero_gradient(op, zero_fills):
    """No zero gradient is filled for the op's non-differentiable z-loss output (a launch nothing reads)."""
    h = torch.randn(6, 8, device=DEV, requires_grad=True)
    w = torch.randn(13, 8, device=DEV)
    labels = torch.randint(0, 13, (6,), device=DEV)
    loss = fused_ce(h @ w.t(), labels) if op == "cross_entropy" else linear_cross_entropy(h, w, labels)
    with zero_fills() as fills:
        loss.backward()
    assert fills == []


def test_cross_entropy_inplace_writes_grad_into_logits_buffer():
    torch.manual_seed(2)
    x = torch.randn(9, 50, device=DEV, requires_grad=True)
    y = _labels((9,), 50, seed=2)
    logits = x * 1
    ptr = logits.data_ptr()
    loss = fused_ce(logits, y, inplace=True)
    loss.backward()
    x64 = x.detach().double().requires_grad_()
    F.cross_entropy(x64, y).backward()
    _close(x.grad, x64.grad, torch.float32, "dx")
    _close(logits.detach(), x64.grad, torch.float32, "buffer holds the gradient")
    assert logits.data_ptr() == ptr
    # inplace=False leaves the logits untouched
    logits2 = (x * 1).detach().requires_grad_()
    before = logits2.detach().clone()
    fused_ce(logits2, y, inplace=False).backward()
    assert torch.equal(logits2.detach(), before)


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("label_dtype", [torch.int8, torch.int16, torch.uint8])
@pytest.mark.parametrize("op", ["cross_entropy", "linear_cross_entropy"])
def test_small_integer_labels(use_kernel_path, path, label_dtype, op):
    """int8 / int16 / uint8 labels give the int64 result on both paths; a uint8 label of 156 is a class, not
    ignore_index=-100 wrapped around."""
    use_kernel_path(path)
    torch.manual_seed(3)
    V, H = 173, 16
    y = _labels((7,), 127, seed=3)
    if label_dtype == torch.uint8:
        y[y < 0] = 156
    h = torch.randn(7, H, device=DEV, dtype=torch.float64)
    w = torch.randn(V, H, device=DEV, dtype=torch.float64) / 4
    h32, w32 = h.float().requires_grad_(), w.float().requires_grad_()
    if op == "cross_entropy":
        loss = fused_ce(h32 @ w32.t(), y.to(label_dtype))
    else:
        loss = linear_cross_entropy(h32, w32, y.to(label_dtype))
    h64, w64 = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref, _ = _ref(h64 @ w64.t(), y)
    (loss * 1.7).backward()
    (ref * 1.7).backward()
    _close(loss, ref, torch.float32, "loss")
    _close(h32.grad, h64.grad, torch.float32, "dh")
    _close(w32.grad, w64.grad, torch.float32, "dw")


def test_inplace_on_logits_another_op_saved_names_the_argument():
    torch.manual_seed(4)
    x = torch.randn(6, 37, device=DEV, requires_grad=True)
    y = _labels((6,), 37, seed=4)
    logits = x * 1
    penalty = logits.pow(2).mean()  # saves the logits for its backward
    with pytest.raises(ValueError, match=r"^cross_entropy: inplace=True \(the default\) writes the gradient into "
                                         r"the logits, but another op saved them .*; pass inplace=False$"):
        fused_ce(logits, y)
    (fused_ce(logits, y, inplace=False) + penalty).backward()
    x64 = x.detach().double().requires_grad_()
    (F.cross_entropy(x64, y) + x64.pow(2).mean()).backward()
    _close(x.grad, x64.grad, torch.float32, "dx")


def test_all_labels_ignored_follows_torch():
    torch.manual_seed(3)
    h = torch.randn(6, 8, device=DEV, requires_grad=True)
    w = torch.randn(11, 8, device=DEV, requires_grad=True)
    y = torch.full((6,), -100, device=DEV)
    loss = linear_cross_entropy(h, w, y, chunk_size=4)
    assert torch.isnan(loss)  # mean over zero tokens, as F.cross_entropy
    loss.backward()
    assert torch.equal(h.grad, torch.zeros_like(h)) and torch.equal(w.grad, torch.zeros_like(w))
    assert linear_cross_entropy(h, w, y, reduction="sum").item() == 0.0
    x = torch.randn(6, 11, device=DEV, requires_grad=True)
    loss = fused_ce(x * 1, y)
    assert torch.isnan(loss)
    loss.backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


def test_chunking_does_not_change_result_and_is_deterministic():
    torch.manual_seed(4)
    h = torch.randn(2, 10, 16, device=DEV, requires_grad=True)  # (B, S, H) leading dims
    w = torch.randn(45, 16, device=DEV, requires_grad=True)
    y = _labels((2, 10), 45, seed=4)
    results = []
    for chunk in (1, 7, 20, None, 7):
        loss = linear_cross_entropy(h, w, y, chunk_size=chunk)
        dh, dw = torch.autograd.grad(loss, (h, w))
        results.append((loss, dh, dw))
    for r in results[1:]:
        for a, b in zip(results[0], r):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(results[1], results[4]):  # same chunking twice: bitwise identical
        assert torch.equal(a, b)


def test_frozen_weight_and_no_grad():
    torch.manual_seed(5)
    h = torch.randn(7, 8, device=DEV, requires_grad=True)
    w = torch.randn(13, 8, device=DEV)  # frozen lm_head: no dW work
    y = _labels((7,), 13, seed=5)
    linear_cross_entropy(h, w, y).backward()
    h64 = h.detach().double().requires_grad_()
    F.cross_entropy(h64 @ w.double().t(), y).backward()
    _close(h.grad, h64.grad, torch.float32, "dh")
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, y)
    assert not loss.requires_grad
    _close(loss, F.cross_entropy(h.detach().double() @ w.double().t(), y), torch.float32, "loss")


def test_weight_grad_fp32_accumulation():
    torch.manual_seed(6)
    h = torch.randn(19, 8, device=DEV, dtype=torch.float16, requires_grad=True)
    w = torch.randn(29, 8, device=DEV, dtype=torch.float16, requires_grad=True)
    y = _labels((19,), 29, seed=6)
    linear_cross_entropy(h, w, y, chunk_size=4, weight_grad_fp32=True).backward()
    assert w.grad.dtype == torch.float16
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    logits64 = h64 @ w64.t()
    logits64 = logits64 + ((h @ w.t()).double() - logits64).detach()
    F.cross_entropy(logits64, y).backward()
    _close(w.grad, w64.grad, torch.float16, "dw")
    _close(h.grad, h64.grad, torch.float16, "dh")


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(backend):
    torch._dynamo.reset()
    torch.manual_seed(7)
    h = torch.randn(10, 16, device=DEV, requires_grad=True)
    w = torch.randn(33, 16, device=DEV, requires_grad=True)
    y = _labels((10,), 33, seed=7)

    def step(h, w, y):
        a = linear_cross_entropy(h, w, y, chunk_size=4, z_loss_weight=1e-3)
        b = fused_ce(h @ w.t(), y, label_smoothing=0.1)
        return a + b

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    loss = compiled(h, w, y)
    dh, dw = torch.autograd.grad(loss, (h, w))
    eager = step(h, w, y)
    edh, edw = torch.autograd.grad(eager, (h, w))
    torch.testing.assert_close(loss, eager)
    torch.testing.assert_close(dh, edh)
    torch.testing.assert_close(dw, edw)


def test_layers_and_layouts():
    from hubfuse.cross_entropy import layers

    for cls in (layers.CrossEntropyLoss, layers.LinearCrossEntropyLoss):
        assert cls.has_backward and cls.can_torch_compile and "__init__" not in cls.__dict__
    torch.manual_seed(8)
    x = torch.randn(12, 40, device=DEV, requires_grad=True)
    y = _labels((12,), 40, seed=8)
    host = torch.nn.CrossEntropyLoss(label_smoothing=0.1, reduction="sum")
    ref = host(x, y)
    out = layers.CrossEntropyLoss.forward(host, x, y)
    _close(out, ref, torch.float32, "CrossEntropyLoss layer")
    layout = layers.CrossEntropyLossLayout(label_smoothing=0.1, reduction="sum")
    _close(layout(x, y), ref, torch.float32, "CrossEntropyLossLayout")
    with pytest.raises(ValueError, match="class weights|per-class"):
        layers.CrossEntropyLoss.forward(torch.nn.CrossEntropyLoss(weight=torch.ones(40)), x, y)
    h = torch.randn(12, 16, device=DEV, requires_grad=True)
    w = torch.randn(40, 16, device=DEV, requires_grad=True)
    lay = layers.LinearCrossEntropyLossLayout(z_loss_weight=1e-3, softcap=5.0)
    _close(layers.LinearCrossEntropyLoss.forward(lay, h, w, y), lay(h, w, y), torch.float32, "LinearCE layer")


def test_bad_inputs():
    h = torch.randn(4, 8, device=DEV)
    w = torch.randn(10, 8, device=DEV)
    y = torch.randint(0, 10, (4,), device=DEV)
    with pytest.raises(ValueError, match="labels shape"):
        linear_cross_entropy(h, w, y[:3])
    # label values are checked on CPU tensors here: on CUDA the check is a device-side assert, which ends the
    # process's CUDA context (test_label_out_of_range_asserts_on_the_device runs it in a subprocess)
    with pytest.raises(ValueError, match="must be in"):
        linear_cross_entropy(h.cpu(), w.cpu(), torch.tensor([0, 1, 10, 2]))
    with pytest.raises(ValueError, match="must be in"):
        linear_cross_entropy(h.cpu(), w.cpu(), torch.tensor([0, -5, 1, 2]))
    with pytest.raises(ValueError, match="hidden size"):
        linear_cross_entropy(h, torch.randn(10, 9, device=DEV), y)
    with pytest.raises(TypeError, match="dtype"):
        linear_cross_entropy(h, w.half(), y)
    with pytest.raises(TypeError, match="integer"):
        linear_cross_entropy(h, w, y.float())
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(h, w, y, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing"):
        linear_cross_entropy(h, w, y, label_smoothing=1.5)
    with pytest.raises(ValueError, match="softcap"):
        linear_cross_entropy(h, w, y, softcap=-1.0)
    with pytest.raises(ValueError, match="num_items_in_batch"):
        linear_cross_entropy(h, w, y, reduction="none", num_items_in_batch=3)
    with pytest.raises(ValueError, match="empty"):
        linear_cross_entropy(h[:0], w, y[:0])
    with pytest.raises(ValueError, match="labels shape"):
        fused_ce(torch.randn(4, 10, device=DEV), y[:2])
    with pytest.raises(ValueError, match="must be in"):
        fused_ce(torch.randn(4, 10), torch.tensor([0, 1, 2, 11]))
    with pytest.raises(TypeError, match="floating"):
        fused_ce(torch.ones(4, 10, dtype=torch.long, device=DEV), y)
    with pytest.raises(ValueError, match="vocab_size"):
        cross_entropy.make_loss_function()(torch.randn(1, 4, 10), y[None], vocab_size=12)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="on"):
            linear_cross_entropy(h, w.cpu(), y)


def test_build_toml_parses():
    kernels_rust = pytest.importorskip("kernels._rust")
    from pathlib import Path

    kernels_rust.Build.open(str(Path(__file__).resolve().parents[1]))


# ----------------------------------------------------------------------------- GPU, bf16, real sizes

@pytest.mark.gpu
@pytest.mark.parametrize("opts", [dict(), dict(label_smoothing=0.1, z_loss_weight=1e-4, softcap=30.0),
                                  dict(reduction="none")], ids=["default", "all_options", "none"])
def test_gpu_bf16_linear_cross_entropy_real_vocab(opts):
    torch.manual_seed(10)
    N, H, V = 4096, 1024, 151936
    h = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(V, H, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    y = torch.randint(0, V, (N,), device="cuda")
    y[::7] = -100
    loss = linear_cross_entropy(h, w, y, chunk_size=1000, **opts)
    up = torch.randn_like(loss) if loss.dim() else torch.tensor(1.0, device="cuda")
    dh, dw = torch.autograd.grad(loss, (h, w), up)
    # reference: materialised bf16 logits (as nn.Linear), fp32 math
    h2, w2 = h.detach().requires_grad_(), w.detach().requires_grad_()
    o = dict(opts)
    ref, _ = _ref((h2 @ w2.t()).float(), y, **o)
    rdh, rdw = torch.autograd.grad(ref, (h2, w2), up)
    torch.testing.assert_close(loss, ref, atol=2e-3, rtol=2e-3)
    # gradients of a mean over 4096 tokens are ~1e-6: compare whole-tensor relative errors
    assert _rel_err(dh, rdh) < 1e-2, _rel_err(dh, rdh)
    assert _rel_err(dw, rdw) < 1e-2, _rel_err(dw, rdw)


@pytest.mark.gpu
def test_gpu_bf16_cross_entropy_inplace_real_vocab():
    torch.manual_seed(11)
    x = torch.randn(2048, 151936, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, 151936, (2048,), device="cuda")
    y[::5] = -100
    loss = fused_ce(x * 1, y, label_smoothing=0.1, z_loss_weight=1e-4)
    (dx,) = torch.autograd.grad(loss, (x,))
    x2 = x.detach().float().requires_grad_()
    ref, _ = _ref(x2, y, label_smoothing=0.1, z_loss_weight=1e-4)
    (rdx,) = torch.autograd.grad(ref, (x2,))
    torch.testing.assert_close(loss, ref, atol=1e-3, rtol=1e-3)
    assert _rel_err(dx, rdx) < 1e-2, _rel_err(dx, rdx)


@pytest.fixture
def kernel_config():
    from hubfuse.cross_entropy import ops

    saved = dict(ops.TUNING)
    yield ops.TUNING
    ops.TUNING.clear()
    ops.TUNING.update(saved)


@pytest.mark.parametrize("vector_lse", [False, True])
@pytest.mark.parametrize("opts", [dict(), dict(label_smoothing=0.1, z_loss_weight=1e-3, softcap=5.0),
                                  dict(reduction="none")], ids=["default", "all", "none"])
def test_row_kernel_variants_several_blocks(kernel_config, vector_lse, opts):
    # blocks of 16 columns over V=83 (a masked tail), -inf logits in whole blocks: both pass-1 variants
    kernel_config.update(vector_lse=vector_lse, block_v=16, num_warps=1)
    torch.manual_seed(11)
    x = torch.randn(7, 83, device=DEV) * 3
    x[1, :40] = float("-inf")
    x[2, 70:] = float("-inf")
    y = _labels((7,), 83, seed=11)
    y[1], y[2] = 50, 5
    loss_ref, _ = _ref(x.double(), y, **dict(opts))
    leaf = x.clone().requires_grad_()
    leaf64 = x.double().requires_grad_()
    ref, _ = _ref(leaf64, y, **dict(opts))
    loss = fused_ce(leaf * 1, y, **opts)
    g = torch.rand_like(loss) if loss.dim() else None
    loss.backward(g)
    ref.backward(g.double() if g is not None else None)
    grad_ref = torch.nan_to_num(leaf64.grad)  # d/dx of a -inf logit is 0
    _close(loss, loss_ref, torch.float32, "loss")
    _close(leaf.grad, grad_ref, torch.float32, "dx")


@pytest.mark.parametrize("g", [1.0, 0.37])
@pytest.mark.parametrize("skip", [True, False])
def test_backward_scale_by_upstream_grad(kernel_config, g, skip):
    # the scalar-loss backward scales the saved gradients on the device, skipping the work when g == 1
    kernel_config.update(skip_unit_scale=skip)
    torch.manual_seed(12)
    h = torch.randn(21, 16, device=DEV, requires_grad=True)
    w = torch.randn(37, 16, device=DEV, requires_grad=True)
    y = _labels((21,), 37, seed=12)
    (linear_cross_entropy(h, w, y, chunk_size=8) * g).backward()
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (_ref(h64 @ w64.t(), y)[0] * g).backward()
    _close(h.grad, h64.grad, torch.float32, "dh")
    _close(w.grad, w64.grad, torch.float32, "dw")
    x = torch.randn(5, 37, device=DEV, requires_grad=True)
    x64 = x.detach().double().requires_grad_()
    (fused_ce(x * 1, y[:5]) * g).backward()
    (_ref(x64, y[:5])[0] * g).backward()
    _close(x.grad, x64.grad, torch.float32, "dx")


def test_scale_unless_one_kernel():
    if not use_triton(torch.empty(1, device=DEV)):
        pytest.skip("Triton path not active")
    from hubfuse.cross_entropy.triton_kernels import scale_unless_one_

    x = torch.randn(10000, device=DEV, dtype=torch.float16)
    before = x.clone()
    scale_unless_one_(x, torch.tensor([1.0], device=DEV))
    assert torch.equal(x, before)
    scale_unless_one_(x, torch.tensor([-2.5], device=DEV))
    torch.testing.assert_close(x, (before.float() * -2.5).half())


def test_label_out_of_range_raises_on_cpu():
    # (on CUDA the check is a device-side assert, no host sync: it aborts the CUDA context, tested in a subprocess)
    with pytest.raises(ValueError, match="found -3"):
        fused_ce(torch.randn(4, 10), torch.tensor([0, -3, -100, 1]))
    with pytest.raises(ValueError, match="must be in"):
        fused_ce(torch.randn(4, 10), torch.tensor([0, 1, 2, 11]))


_DEVICE_ASSERT_SCRIPT = """
import sys, torch
import hubfuse.cross_entropy as cross_entropy
h, w = torch.randn(4, 8, device="cuda"), torch.randn(10, 8, device="cuda")
try:  # the assert fires on the device; the error surfaces at the next CUDA call that checks
    loss = cross_entropy.linear_cross_entropy(h, w, torch.tensor([0, 1, {label}, 2], device="cuda"))
    torch.cuda.synchronize()
except RuntimeError as e:
    print("device assert:", str(e).splitlines()[0])
    sys.exit(0)
print("no error for label {label}")
sys.exit(1)
"""


@pytest.mark.gpu
@pytest.mark.parametrize("label", [10, -5])
def test_label_out_of_range_asserts_on_the_device(label):
    """On CUDA an out-of-range label trips a device-side assert (no host sync), in a subprocess: it ends the
    CUDA context."""
    import subprocess
    import sys
    from pathlib import Path

    import hubfuse

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(hubfuse.__file__).resolve().parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", _DEVICE_ASSERT_SCRIPT.format(label=label)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "device assert" in res.stdout, res.stdout + res.stderr[-2000:]


def test_default_chunk_size_policy():
    from hubfuse.cross_entropy import default_chunk_size

    assert default_chunk_size(16384, 151936, 2) == 1024  # 296.75 MiB of bf16 logits per chunk
    assert default_chunk_size(16384, 151936, 4) == 512
    assert default_chunk_size(300, 151936, 2) == 300  # all tokens fit in one chunk
    assert default_chunk_size(100000, 10**7, 4) == 256  # never below one aligned tile
    assert default_chunk_size(5000, 32000, 2) % 256 == 0
