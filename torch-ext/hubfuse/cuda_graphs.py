"""A whole training step (forward, backward, optimizer step) captured in one CUDA graph.

    from hubfuse.cuda_graphs import capture_train_step
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-4, device="cuda"), fused=True, capturable=True)
    step = capture_train_step(model, opt, first_batch)   # warms up, then captures
    for batch in loader:                                 # every batch of the same shapes
        loss = step(batch)                               # copies the batch in, replays: a handful of launches

Every hubfuse kernel is graph-capturable (no host syncs, launch shapes fixed by the input shapes, routing and
value checks on the device), so the step replays with no Python at all: what is left of a step's host time
is the copy of the batch and one graph launch. The rules are CUDA graphs' own:

- static shapes: every batch has the shapes of `example_batch` (pad or bucket; one graph per shape);
- a capturable optimizer (`capturable=True`, or `hubfuse.optim.AdamW`, whose CUDA step always is; a tensor
  learning rate, updated in place, lets a scheduler change it between replays);
- gradients are allocated by the capture (`zero_grad(set_to_none=True)` before it, none between replays:
  each replay writes them afresh), so gradient accumulation over micro-batches means one graph per micro-batch
  position, or torch.compile(mode="reduce-overhead") instead;
- the returned loss tensor is the graph's output buffer: read or clone it before the next replay.

Attention in the graph: while capturing, transformers cannot read the positions to check for packed sequences,
so a plain model builds a full (batch, 1, seq, seq) mask and SDPA runs its masked kernels (slower, the backward
above all) where eager runs the causal ones. A model loaded with `hubfuse.KernelConfig` (or given
`hubfuse.training.apply_training_defaults`) passes Qwen3 / Qwen2 / Qwen3.5-MoE batches without a mask or
positions the mask eager computes (none: SDPA's `is_causal` path), so the graph runs the kernels eager runs.

With transformers' Trainer, which runs its own step, use `torch_compile=True, torch_compile_mode=
"reduce-overhead"` (CUDA graphs of the compiled forward and backward; our kernels are custom ops inside them).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch


def capture_train_step(model, optimizer, example_batch: dict, warmup_steps: int = 3,
                       forward: Optional[Callable] = None) -> Callable[[dict], torch.Tensor]:
    """Capture `loss = forward(model, batch); loss.backward(); optimizer.step()` in a CUDA graph.

    `example_batch`: a dict of CUDA tensors with the shapes every later batch has (e.g. input_ids, labels).
    `forward(model, batch) -> loss` defaults to `model(**batch, use_cache=False).loss`. The warm-up steps run on
    a side stream before the capture (Triton compilation, cuBLAS workspaces, allocator pools); they train the
    model too. Returns `step(batch) -> loss`, which copies `batch` into the graph's inputs and replays it.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("capture_train_step needs a CUDA device")
    for group in optimizer.param_groups:
        if not (group.get("capturable", False) or getattr(optimizer, "capturable_on_cuda", False)):
            raise ValueError(f"capture_train_step: the optimizer must be capturable ({type(optimizer).__name__}"
                             f"(..., capturable=True)): its step runs inside the graph")
    bad = [k for k, v in example_batch.items() if not (isinstance(v, torch.Tensor) and v.is_cuda)]
    if bad:
        raise ValueError(f"capture_train_step: example_batch entries {bad} are not CUDA tensors")
    forward = forward or (lambda m, batch: m(**batch, use_cache=False).loss)
    static = {k: v.clone() for k, v in example_batch.items()}

    def eager_step():
        optimizer.zero_grad(set_to_none=True)
        loss = forward(model, static)
        loss.backward()
        optimizer.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup_steps):
            eager_step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    # captured on the warm-up stream: cuBLAS keeps a workspace per stream, so a capture on a stream of its own
    # (torch.cuda.graph's default) would allocate another one into the graph's pool (0.06 GiB on Hopper)
    with torch.cuda.graph(graph, stream=side):
        static_loss = forward(model, static)
        static_loss.backward()
        optimizer.step()

    def step(batch: dict) -> torch.Tensor:
        for key, value in batch.items():
            target = static.get(key)
            if target is None or target.shape != value.shape:
                raise ValueError(f"captured train step: batch[{key!r}] has shape "
                                 f"{tuple(value.shape) if hasattr(value, 'shape') else value!r}, the graph was "
                                 f"captured with {tuple(target.shape) if target is not None else 'no such input'}")
            target.copy_(value, non_blocking=True)
        graph.replay()
        return static_loss

    step.graph = graph
    return step


__all__ = ["capture_train_step"]
