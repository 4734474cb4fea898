"""Our attention Layouts (`kernel_repos/rotary`: `QKNormRopeAttention`, `GatedQKNormRopeAttention`,
`RopeAttention`; in the dense families inside the `DecoderLayer` Layout) under every attention implementation a
user picks, on padded and on padding-free packed batches.

A one-argument kernelized load (`hubfuse.KernelConfig()`, every kernel of the family) against a plain load with the
same `attn_implementation`: loss and every gradient equal (CPU fp32: `sdpa`, `eager`; GPU bf16:
`flash_attention_4`, the `flash-attn-4` wheel, skipped where it is not importable). Packed batches are what TRL's
`padding_free=True` makes: one row, `position_ids` restarting at each sequence, no attention mask, the sequence
boundaries also as `cu_seq_lens_*` / `max_length_*` (not for Qwen3.5-MoE, whose linear-attention layers refuse
them without `causal_conv1d`); there the logits of each packed sequence also equal that sequence run alone.
"""
import pytest
import torch
from transformers import AutoModelForCausalLM

import hubfuse
from hubfuse import presets
from tests.utils import save_tiny_model, tiny_config

FAMILIES = ("qwen3", "qwen3_moe", "qwen3_5_moe_text", "llama", "qwen2")
# the attention Layout of each family, and the Layer kernelize binds where it runs (the dense families' decoder
# layer runs it inside, hubfuse/decoder-layer)
BOUND_LAYER = {"qwen3": "DecoderLayer", "qwen3_moe": "QKNormRopeAttention",
               "qwen3_5_moe_text": "GatedQKNormRopeAttention", "llama": "DecoderLayer", "qwen2": "DecoderLayer"}
ATTENTION_LAYER = {"qwen3": "QKNormRopeAttention", "qwen3_moe": "QKNormRopeAttention",
                   "qwen3_5_moe_text": "GatedQKNormRopeAttention", "llama": "RopeAttention", "qwen2": "RopeAttention"}
# the GPU models: head_dim 128 (flash kernels), still tiny
GPU_DIMS = dict(hidden_size=256, head_dim=128, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module", autouse=True)
def _local_builds():
    hubfuse.use_local_builds()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    return {fam: save_tiny_model(fam, d) for fam in FAMILIES}


@pytest.fixture(scope="module")
def gpu_model_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu_models")
    return {fam: save_tiny_model(fam, d, **GPU_DIMS) for fam in FAMILIES}


def _seed() -> int:
    return torch.randint(0, 2**16, ()).item()


def padded_batch(vocab, lengths=(9, 5, 7), device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.randint(0, vocab, (len(lengths), n), generator=g)
    mask = torch.tensor([[1] * k + [0] * (n - k) for k in lengths])
    labels = ids.masked_fill(mask == 0, -100)
    return {k: v.to(device) for k, v in dict(input_ids=ids, attention_mask=mask, labels=labels).items()}


def packed_batch(vocab, lengths=(6, 9, 4), varlen_kwargs=True, device="cpu", seed=0):
    """TRL's padding-free batch: one row, position_ids restarting per sequence, labels -100 at each start."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (k,), generator=g) for k in lengths]
    position_ids = torch.cat([torch.arange(k) for k in lengths])[None]
    labels = torch.cat(seqs)[None].masked_fill(position_ids == 0, -100)
    batch = dict(input_ids=torch.cat(seqs)[None], position_ids=position_ids, labels=labels, use_cache=False)
    if varlen_kwargs:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}, seqs


def load_pair(path, attn, dtype=torch.float32, device="cpu"):
    kw = dict(attn_implementation=attn, dtype=dtype, **({} if device == "cpu" else {"device_map": device}))
    plain = AutoModelForCausalLM.from_pretrained(path, **kw).train()
    ours = AutoModelForCausalLM.from_pretrained(path, use_kernels=True, kernel_config=hubfuse.KernelConfig(),
                                                **kw).train()
    return plain, ours


def attention_modules_bound(model, layer):
    return [n for n, m in model.named_modules() if getattr(getattr(m.__dict__.get("forward"), "__func__", None),
                                                           "__qualname__", "").startswith(f"{layer}.")]


def step(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}


def assert_same_step(plain, ours, batch, atol, rtol):
    loss_p, grads_p = step(plain, batch)
    loss_o, grads_o = step(ours, batch)
    torch.testing.assert_close(loss_o.float(), loss_p.float(), atol=atol, rtol=rtol)
    want = presets.eager_to_kernelized(grads_p, list(grads_o))
    for name in grads_o:
        torch.testing.assert_close(grads_o[name], want[name], atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


def assert_packed_equals_separate(model, batch, seqs, atol):
    """Each packed sequence sees only itself: its logits equal a run of that sequence alone."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        packed = model(**inputs).logits[0].float()
        start = 0
        for seq in seqs:
            alone = model(input_ids=seq[None].to(packed.device), use_cache=False).logits[0].float()
            torch.testing.assert_close(packed[start:start + len(seq)], alone, atol=atol, rtol=atol)
            start += len(seq)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_padded_batch(family, attn, model_dirs):
    plain, ours = load_pair(model_dirs[family], attn)
    assert ours.config._attn_implementation == attn
    assert len(attention_modules_bound(ours, BOUND_LAYER[family])) >= 1
    assert_same_step(plain, ours, padded_batch(tiny_config(family).vocab_size, seed=_seed()), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_padding_free_packed_batch(family, attn, model_dirs):
    plain, ours = load_pair(model_dirs[family], attn)
    packed_hf_ok = family != "qwen3_5_moe_text"  # HF's linear attention mixes packed sequences on its torch path
    batch, seqs = packed_batch(tiny_config(family).vocab_size, varlen_kwargs=packed_hf_ok, seed=_seed())
    assert_same_step(plain, ours, batch, atol=2e-5, rtol=2e-5)
    if packed_hf_ok:
        assert_packed_equals_separate(ours, batch, seqs, atol=2e-5)


def _flash_attention_4_available() -> bool:
    from transformers.utils import is_flash_attn_4_available

    return torch.cuda.is_available() and is_flash_attn_4_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _flash_attention_4_available(), reason="flash-attn-4 not installed (pip install flash-attn-4)")
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_flash_attention_4(family, packed, gpu_model_dirs):
    plain, ours = load_pair(gpu_model_dirs[family], "flash_attention_4", dtype=torch.bfloat16, device="cuda")
    assert len(attention_modules_bound(ours, BOUND_LAYER[family])) >= 1
    vocab = tiny_config(family).vocab_size
    if packed:
        packed_hf_ok = family != "qwen3_5_moe_text"
        batch, seqs = packed_batch(vocab, varlen_kwargs=packed_hf_ok, device="cuda", seed=_seed())
    else:
        batch = padded_batch(vocab, device="cuda", seed=_seed())
    assert_same_step(plain, ours, batch, atol=3e-2, rtol=3e-2)
    if packed and packed_hf_ok:
        assert_packed_equals_separate(ours, batch, seqs, atol=3e-2)


def _count_releases(model, layer: str, monkeypatch) -> list[int]:
    """The number of tensors of each `release_until_backward` call our attention Layout makes from now on."""
    import sys

    attention = next(m for m in model.modules() if type(m).__name__ == f"{layer}Layout")
    layers = sys.modules[type(attention).__module__]
    release, released = layers.release_until_backward, []

    def spy(anchors, tensors, rebuild):
        release(anchors, tensors, rebuild)
        released.append(len(tensors))

    monkeypatch.setattr(layers, "release_until_backward", spy)
    return released


@pytest.mark.parametrize("family", FAMILIES)
def test_released_activations_rebuilt_bit_for_bit(family, model_dirs, monkeypatch):
    """In training our attentions release what they can rebuild (`_common.released`): the input norm's output
    the q/k/v projections saved, and (q/k norm families) the rotated q / k the attention saved. Loss, logits and
    every gradient are bit for bit those of the same model with nothing released (saved-tensor hooks active)."""
    def forward_backward(model, batch):
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    _, ours = load_pair(model_dirs[family], "sdpa")
    released = _count_releases(ours, ATTENTION_LAYER[family], monkeypatch)
    batch = padded_batch(tiny_config(family).vocab_size)
    got = forward_backward(ours, batch)
    per_layer = [3] if ATTENTION_LAYER[family] != "RopeAttention" else [1]  # the norm output (+ rotated q, k)
    attention_layers = len(attention_modules_bound(ours, BOUND_LAYER[family]))
    assert sorted(released) == sorted(per_layer * attention_layers), released
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        want = forward_backward(ours, batch)
    assert len(released) == len(per_layer) * attention_layers  # nothing released under the hooks
    assert torch.equal(got[0], want[0]) and got[1].keys() == want[1].keys()
    for name in want[1]:
        assert torch.equal(got[1][name], want[1][name]), name


def test_norm_output_seen_by_a_forward_hook_is_not_released(model_dirs, monkeypatch):
    """A forward hook on the input norm may keep its output and read it after the step: that output stays."""
    _, ours = load_pair(model_dirs["qwen3"], "sdpa")
    released = _count_releases(ours, "QKNormRopeAttention", monkeypatch)
    kept = []
    norm = ours.model.layers[0].input_layernorm
    norm.register_forward_hook(lambda module, args, out: kept.append((args[0], out)))
    ours(**padded_batch(tiny_config("qwen3").vocab_size)).loss.backward()
    assert released == [2, 3]  # layer 0: the rotated q, k only; layer 1: its norm output too
    x, out = kept[0]
    assert out.untyped_storage().nbytes() == out.numel() * out.element_size()
    torch.testing.assert_close(out, norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)))
