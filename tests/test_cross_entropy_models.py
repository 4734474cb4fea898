"""Fused cross-entropy through transformers: tiny Qwen3 / Qwen3-MoE / Qwen3.5-MoE causal LMs.

The kernel is loaded as a hub kernel (local build through LOCAL_KERNELS, revision v1) and switched on per
instance with `enable_fused_loss`. Loss and every parameter gradient against HF's own loss on a plain eager
load (same weights); MoE aux loss included; label shift, `shift_labels`, `logits_to_keep`,
`num_items_in_batch` (4 micro-batches == one big batch); other instances and the class untouched;
`disable_fused_loss`; the logits-based `loss_function`; torch.compile(fullgraph=True); save/load.
"""
import pytest
import torch

from tests.utils import FAMILIES, hub, load, make_batch, register_local_kernels, save_tiny_model, tiny_config

ATOL = RTOL = 2e-5


@pytest.fixture(scope="module")
def ce():
    register_local_kernels("cross-entropy", "rmsnorm", "hubfuse")
    from kernels import get_kernel

    return get_kernel("hubfuse/cross-entropy", revision="v1")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("ce_models")
    return {fam: save_tiny_model(fam, d) for fam in FAMILIES}


def _batch(family, seed=1, batch=2, seq=7):
    b = make_batch(tiny_config(family).vocab_size, batch=batch, seq=seq, seed=seed)
    b["labels"][0, :2] = -100  # some ignored positions (prompt masking)
    return b


def _step(model, **batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def _assert_same(out_ref, grads_ref, out, grads):
    torch.testing.assert_close(out.loss, out_ref.loss, atol=ATOL, rtol=RTOL)
    assert grads.keys() == grads_ref.keys(), set(grads) ^ set(grads_ref)
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], atol=ATOL, rtol=RTOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_loss_matches_hf_loss_and_grads(family, model_dirs, ce):
    eager, ours = load(model_dirs[family]), load(model_dirs[family])
    eager.train(), ours.train()
    ce.enable_fused_loss(ours)
    extra = {"output_router_logits": True} if family != "qwen3" else {}
    out_ref, g_ref = _step(eager, **_batch(family), **extra)
    out, g = _step(ours, **_batch(family), **extra)
    assert out.logits is None and out_ref.logits is not None
    if extra:  # the router aux loss is still added
        assert out.aux_loss is not None
        torch.testing.assert_close(out.aux_loss, out_ref.aux_loss)
        assert any("router" in n or "gate" in n for n in g)
    _assert_same(out_ref, g_ref, out, g)


@pytest.mark.parametrize("family", FAMILIES)
def test_per_instance_switch_and_disable(family, model_dirs, ce):
    ours, other = load(model_dirs[family]), load(model_dirs[family])
    cls_forward = type(ours).forward
    ce.enable_fused_loss(ours)
    assert ce.fused_loss_enabled(ours) and not ce.fused_loss_enabled(other)
    assert type(ours).forward is cls_forward
    batch = _batch(family)
    assert other(**batch).logits is not None  # another instance keeps HF's forward
    assert ours(**batch).logits is None
    # without labels the forward is HF's own
    no_labels = {"input_ids": batch["input_ids"]}
    torch.testing.assert_close(ours(**no_labels).logits, other(**no_labels).logits)
    # tuple outputs (return_dict=False) still work
    assert torch.is_tensor(ours(**batch, return_dict=False)[0])
    ce.disable_fused_loss(ours)
    assert not ce.fused_loss_enabled(ours) and "forward" not in ours.__dict__
    out = ours(**batch)
    assert out.logits is not None
    torch.testing.assert_close(out.loss, other(**batch).loss)


def test_shift_labels_logits_to_keep_and_return_logits(model_dirs, ce):
    eager, ours = load(model_dirs["qwen3"]), load(model_dirs["qwen3"])
    ce.enable_fused_loss(ours, return_logits=True)
    batch = _batch("qwen3", seq=9)
    # explicit shift_labels (e.g. context parallelism / packed sequences)
    shift = torch.roll(batch["labels"], -1, dims=1)
    shift[:, -1] = -100
    kw = dict(input_ids=batch["input_ids"], labels=batch["labels"], shift_labels=shift)
    out_ref, g_ref = _step(eager, **kw)
    out, g = _step(ours, **kw)
    _assert_same(out_ref, g_ref, out, g)
    torch.testing.assert_close(out.logits, out_ref.logits)  # return_logits=True
    # logits_to_keep: loss over the last 4 positions, labels given for those positions only
    kw = dict(input_ids=batch["input_ids"], labels=batch["labels"][:, -4:], logits_to_keep=4)
    out_ref, g_ref = _step(eager, **kw)
    out, g = _step(ours, **kw)
    _assert_same(out_ref, g_ref, out, g)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_gradient_accumulation_with_num_items_equals_one_big_batch(family, model_dirs, ce):
    eager, ours = load(model_dirs[family]), load(model_dirs[family])
    ce.enable_fused_loss(ours)
    micro = [_batch(family, seed=s) for s in range(4)]
    for m, s in zip(micro, range(4)):
        m["labels"][1, : s + 1] = -100  # different valid-token counts per micro-batch
    num_items = sum(int((m["labels"][:, 1:] != -100).sum()) for m in micro)
    ours.zero_grad(set_to_none=True)
    total = 0.0
    for m in micro:
        loss = ours(**m, num_items_in_batch=torch.tensor(num_items)).loss
        loss.backward()
        total = total + loss.detach()
    grads = {n: p.grad.clone() for n, p in ours.named_parameters() if p.grad is not None}
    big = {k: torch.cat([m[k] for m in micro]) for k in micro[0]}
    eager.zero_grad(set_to_none=True)
    ref = eager(**big).loss
    ref.backward()
    torch.testing.assert_close(total, ref.detach(), atol=ATOL, rtol=RTOL)
    for n, p in eager.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[n], p.grad, atol=ATOL, rtol=RTOL, msg=lambda m: f"{n}: {m}")


def test_options_match_reference_on_hf_logits(model_dirs, ce):
    eager, ours = load(model_dirs["qwen3"]), load(model_dirs["qwen3"])
    opts = dict(label_smoothing=0.1, z_loss_weight=1e-3, softcap=8.0)
    ce.enable_fused_loss(ours, **opts)
    batch = _batch("qwen3")
    out, g = _step(ours, **batch)
    eager.zero_grad(set_to_none=True)
    logits = eager(input_ids=batch["input_ids"]).logits
    shift = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    ref, ref_z = ce.cross_entropy_reference(logits, shift, **opts)
    ref.backward()
    torch.testing.assert_close(out.loss, ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out.z_loss, ref_z.detach(), atol=ATOL, rtol=RTOL)
    for n, p in eager.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(g[n], p.grad, atol=ATOL, rtol=RTOL, msg=lambda m: f"{n}: {m}")


def test_pluggable_aux_loss_fn(model_dirs, ce):
    ours = load(model_dirs["qwen3_moe"])
    calls = []

    def aux_fn(router_logits, num_experts, top_k, attention_mask):
        calls.append((len(router_logits), num_experts, top_k))
        return sum(r.float().pow(2).mean() for r in router_logits)

    ce.enable_fused_loss(ours, aux_loss_fn=aux_fn)
    batch = _batch("qwen3_moe")
    base = ours(**batch).loss
    out = ours(**batch, output_router_logits=True)
    assert calls == [(2, 4, 2)]
    torch.testing.assert_close(out.loss, base + ours.router_aux_loss_coef * out.aux_loss)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_loss_function_matches_hf(family, model_dirs, ce):
    eager, ours = load(model_dirs[family]), load(model_dirs[family])
    ce.install_loss_function(ours)  # inplace=False: outputs.logits stay the logits
    batch = _batch(family)
    out_ref, g_ref = _step(eager, **batch)
    out, g = _step(ours, **batch)
    torch.testing.assert_close(out.logits, out_ref.logits)
    _assert_same(out_ref, g_ref, out, g)
    with pytest.raises(ValueError, match="labels shape"):
        ours(input_ids=batch["input_ids"], labels=batch["labels"][:, :3])
    del ours._loss_function


def test_with_kernel_config_and_train_mode(model_dirs, ce):
    eager = load(model_dirs["qwen3"])
    ours = load(model_dirs["qwen3"], {"RMSNorm": hub("rmsnorm", "RMSNorm")})
    ours.train(), eager.train()
    ce.enable_fused_loss(ours)
    out_ref, g_ref = _step(eager, **_batch("qwen3"))
    out, g = _step(ours, **_batch("qwen3"))
    _assert_same(out_ref, g_ref, out, g)


def test_torch_compile_fullgraph_over_model_with_fused_loss(model_dirs, ce):
    torch._dynamo.reset()
    eager, ours = load(model_dirs["qwen3"]), load(model_dirs["qwen3"])
    ce.enable_fused_loss(ours)
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    batch = _batch("qwen3")
    out_ref, g_ref = _step(eager, **batch)
    out, g = _step(compiled, **batch)
    _assert_same(out_ref, {k.replace("_orig_mod.", ""): v for k, v in g_ref.items()}, out,
                 {k.replace("_orig_mod.", ""): v for k, v in g.items()})


def test_save_load_round_trip_with_fused_loss(model_dirs, ce, tmp_path):
    from safetensors.torch import load_file

    ours = load(model_dirs["qwen3_moe"])
    ce.enable_fused_loss(ours)
    ours.save_pretrained(tmp_path / "resaved")
    a = load_file(model_dirs["qwen3_moe"] / "model.safetensors")
    b = load_file(tmp_path / "resaved" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    again = load(tmp_path / "resaved")
    assert not ce.fused_loss_enabled(again)
    ce.enable_fused_loss(again)
    torch.testing.assert_close(again(**_batch("qwen3_moe")).loss, ours(**_batch("qwen3_moe")).loss)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_bf16_fused_loss(family, model_dirs, ce):
    eager = load(model_dirs[family], dtype=torch.bfloat16, device="cuda")
    ours = load(model_dirs[family], dtype=torch.bfloat16, device="cuda")
    ce.enable_fused_loss(ours)
    batch = {k: v.cuda() for k, v in _batch(family, batch=4, seq=64).items()}
    out_ref, g_ref = _step(eager, **batch)
    out, g = _step(ours, **batch)
    torch.testing.assert_close(out.loss.float(), out_ref.loss.float(), atol=2e-2, rtol=2e-2)
    assert g.keys() == g_ref.keys()
    for n in g_ref:  # bf16 end to end: whole-tensor relative error
        err = ((g[n].float() - g_ref[n].float()).norm() / g_ref[n].float().norm().clamp_min(1e-30)).item()
        assert err < 5e-2, f"{n}: relative error {err}"
