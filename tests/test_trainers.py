"""`transformers.Trainer` and TRL's `SFTTrainer` with a one-argument kernelized model (`hubfuse.KernelConfig()`).

Tiny Qwen3 / Qwen3-MoE / Qwen3.5-MoE, a tiny in-memory dataset of varied lengths, 2 optimizer steps of 2 accumulated
micro-batches each (SGD, fp32): the logged losses and the trained weights equal the same run on a plain load.
- Trainer: the loss is our fused linear cross-entropy (+ fused MoE aux loss); `num_items_in_batch` reaches it, so
  gradient accumulation over micro-batches of different token counts is exact.
- SFTTrainer: TRL computes the loss with its own fused LM head (`fused_lm_head=True`), our kernels run in the
  decoder; padded and padding-free (packed, position_ids restarting per sequence) batches (not Qwen3.5-MoE: without
  `causal_conv1d` transformers itself refuses packed sequences in its linear-attention layers).
On CPU our layers run their torch reference path here, as a CPU user gets (TRITON_INTERPRET unset): this file tests
the trainer plumbing; the kernels' numerics under the Triton interpreter are tested per kernel and in test_presets.
"""
import functools
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import hubfuse
from hubfuse import presets
from tests.utils import save_tiny_model, tiny_config

FAMILIES = ("qwen3", "qwen3_moe", "qwen3_5_moe_text")
OVERRIDES = {"qwen3_moe": dict(output_router_logits=True), "qwen3_5_moe_text": dict(output_router_logits=True)}
COMMON_ARGS = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2, learning_rate=0.1,
                   optim="sgd", logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0, data_seed=0,
                   disable_tqdm=True, bf16=False)  # fp32: TRL's default bf16 would compare bf16 roundings


@pytest.fixture(scope="module", autouse=True)
def _local_builds():
    hubfuse.use_local_builds()


@pytest.fixture(autouse=True)
def _reference_path(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    return {fam: save_tiny_model(fam, d, **OVERRIDES.get(fam, {})) for fam in FAMILIES}


def _sequences(vocab: int, n: int = 8, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(5, 14, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _assert_same_training(ref, ours, losses_ref, losses_ours):
    assert len(losses_ref) == 2
    torch.testing.assert_close(torch.tensor(losses_ours), torch.tensor(losses_ref), atol=1e-5, rtol=1e-5)
    weights_ref = {n: p.detach() for n, p in ref.named_parameters()}
    want = presets.eager_to_kernelized(weights_ref, [n for n, _ in ours.named_parameters()])
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.detach(), want[name], atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def _collate(rows):
    """Right padding: pad id 0, labels -100 on padding and on the first third of each row (a prompt)."""
    n = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (n - len(r)) for r in rows])
    labels = torch.tensor([[-100] * (len(r) // 3) + r[len(r) // 3:] + [-100] * (n - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (n - len(r)) for r in rows])
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _train(model, data, tmp_path, collate):
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), **COMMON_ARGS),
                      train_dataset=data, data_collator=collate)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_with_fused_losses_and_gradient_accumulation(family, model_dirs, tmp_path, caplog):
    data = _sequences(tiny_config(family).vocab_size, seed=torch.randint(0, 2**16, ()).item())
    ref = AutoModelForCausalLM.from_pretrained(model_dirs[family])
    losses_ref = _train(ref, data, tmp_path, _collate)
    ours = AutoModelForCausalLM.from_pretrained(model_dirs[family], use_kernels=True,
                                                kernel_config=hubfuse.KernelConfig())
    assert presets.bound_kernels(ours)["loss->linear_cross_entropy"] == 1
    seen = []
    fused_forward = ours.forward

    @functools.wraps(fused_forward)
    def spy(*args, **kwargs):
        out = fused_forward(*args, **kwargs)
        seen.append((kwargs.get("num_items_in_batch"), out.logits))
        return out

    ours.forward = spy
    with caplog.at_level(logging.WARNING):
        losses_ours = _train(ours, data, tmp_path, _collate)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []  # a quiet run
    assert len(seen) == 4 and all(n is not None and logits is None for n, logits in seen)  # fused, GA-aware
    assert len({int(n) for n, _ in seen}) > 1  # micro-batches of different token counts
    _assert_same_training(ref, ours, losses_ref, losses_ours)


def _tokenizer(vocab: int):
    """A word-level tokenizer over "t0" .. "t{vocab-1}", built in memory (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t2", unk_token="t1")


def _sft(model, texts, tokenizer, tmp_path, padding_free):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(tmp_path), padding_free=padding_free, max_length=None if padding_free else 64,
                     **COMMON_ARGS)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list([{"text": t} for t in texts]),
                         processing_class=tokenizer)
    batches = []
    compute_loss = trainer.compute_loss
    trainer.compute_loss = lambda model, inputs, **kw: batches.append(dict(inputs)) or compute_loss(model, inputs, **kw)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], batches


@pytest.mark.parametrize("family, padding_free", [(f, False) for f in FAMILIES] + [
    ("qwen3", True), ("qwen3_moe", True)], ids=lambda v: {False: "padded", True: "padding_free"}.get(v, v))
def test_sft_trainer(family, padding_free, model_dirs, tmp_path):
    vocab = tiny_config(family).vocab_size
    texts = [" ".join(f"t{i}" for i in seq) for seq in _sequences(vocab, seed=torch.randint(0, 2**16, ()).item())]
    tokenizer = _tokenizer(vocab)
    ref = AutoModelForCausalLM.from_pretrained(model_dirs[family])
    losses_ref, _ = _sft(ref, texts, tokenizer, tmp_path, padding_free)
    ours = AutoModelForCausalLM.from_pretrained(model_dirs[family], use_kernels=True,
                                                kernel_config=hubfuse.KernelConfig())
    losses_ours, batches = _sft(ours, texts, tokenizer, tmp_path, padding_free)
    if padding_free:  # one packed row per micro-batch, positions restarting at each sequence
        assert all(b["input_ids"].shape[0] == 1 and "attention_mask" not in b for b in batches)
        assert all(int((b["position_ids"] == 0).sum()) == 2 for b in batches)
    _assert_same_training(ref, ours, losses_ref, losses_ours)


@pytest.mark.parametrize("kernel", [False, True], ids=["torch-path", "kernel-under-interpreter"])
def test_trainer_with_hubfuse_adamw(kernel, model_dirs, tmp_path, monkeypatch, triton_interpreter):
    """`Trainer(optimizer_cls_and_kwargs=(hubfuse.optim.AdamW, {...}))` trains as with torch's AdamW: bit for bit
    on the plain CPU path; with every tensor through the Triton kernel (the interpreter) within fp32 roundings."""
    from hubfuse.optim import AdamW

    if kernel:
        triton_interpreter()
        monkeypatch.setattr(AdamW, "KERNEL_MIN_NUMEL", 1)
    data = _sequences(tiny_config("qwen3").vocab_size, seed=3)
    kw = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.05)
    runs = {}
    for name, cls in (("torch", torch.optim.AdamW), ("hubfuse", AdamW)):
        model = AutoModelForCausalLM.from_pretrained(model_dirs["qwen3"], use_kernels=True,
                                                     kernel_config=hubfuse.KernelConfig())
        args = TrainingArguments(output_dir=str(tmp_path / name), **COMMON_ARGS)
        trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=_collate,
                          optimizer_cls_and_kwargs=(cls, kw))
        trainer.train()
        assert isinstance(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer")
                          else trainer.optimizer, cls)
        runs[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name, want in runs["torch"].items():
        if kernel:
            torch.testing.assert_close(runs["hubfuse"][name], want, rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert torch.equal(runs["hubfuse"][name], want), name
