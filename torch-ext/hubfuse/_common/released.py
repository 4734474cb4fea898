"""Activations released after the forward and rebuilt, bit for bit, just before the backward reads them.

Some tensors an op saves for its backward can be recomputed exactly and cheaply from tensors saved anyway (SDPA's
rotated q / k from the q / k projections the q/k norm + RoPE backward keeps). `release_until_backward` frees
their memory (the storage is resized to 0 bytes; the tensor objects autograd saved stay) and registers a
pre-hook on the autograd nodes of `anchors`: the backward runs one of them before any node that reads the
released tensors, and the hook reallocates the storage and writes the rebuilt values into it. The writes leave
the saved tensors' version counters where they were (autograd's in-place check passes): Triton kernels write in
place unseen by autograd, torch ops write through an alias of the storage (`write_alias`).

An op whose output can be rebuilt so (the RMSNorm from its input) marks it (`mark_rebuildable`); a consumer that
knows it is the output's only reader (the attention fed by the decoder layer's input norm) releases it, or, where
it runs its own backward, keeps the output's sources instead and rebuilds it there.

Only where nothing else decides what is saved: not under torch.compile (it traces the graph itself), not under
saved-tensor hooks (activation checkpointing recomputes the forward and reads what it saved without running our
hooks; CPU offloading copies at save time), not without gradients, and not with
`HUBFUSE_RELEASE_ACTIVATIONS=0` in the environment.
"""
import os

import torch

RELEASE_SWITCH = "HUBFUSE_RELEASE_ACTIVATIONS"  # the environment variable of `release_enabled`
_REBUILD = "_hubfuse_rebuild"  # a tensor attribute: how to rebuild the tensor's values (mark_rebuildable)


OBSERVES_ONLY = "_hubfuse_observes_only"  # on a pack hook that returns its tensor unchanged (memory accounting)


def saved_tensor_hooks_active() -> bool:
    """Whether a `torch.autograd.graph.saved_tensors_hooks` context is active (checkpointing, offloading), other
    than one whose pack hook is marked `OBSERVES_ONLY`. torch has no public query: a torch-private access (the op
    packages' other one is `_common.sdpa`); tests/test_released.py fails when torch changes it."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and not getattr(hooks[0], OBSERVES_ONLY, False)


def release_enabled() -> bool:
    """The switch `HUBFUSE_RELEASE_ACTIVATIONS`: "1" (the default) releases, "0" keeps every saved tensor (more
    memory, less host work a step: the rebuilds' launches and hooks). Read at every call, as the device choice."""
    value = os.environ.get(RELEASE_SWITCH, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{RELEASE_SWITCH} must be 0 or 1, got {value!r}")
    return value == "1"


def can_release() -> bool:
    """Whether tensors saved in this forward may be released until the backward (see the module docstring)."""
    return (torch.is_grad_enabled() and not torch.compiler.is_compiling() and not saved_tensor_hooks_active()
            and release_enabled())


def write_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over t's storage with t's geometry and a version counter of its own: what a rebuild writes through
    with torch ops (an in-place op on `t` itself would move the version autograd saved; a Triton kernel's writes
    do not, so the Triton path writes into `t` directly)."""
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())


def release_until_backward(anchors, tensors, rebuild) -> None:
    """Free `tensors`' storage now; before the first autograd node of `anchors` (tensors whose gradient path
    every reader of `tensors` in the backward lies behind) runs, reallocate it and call `rebuild(*tensors)`, which
    writes the values into them without moving their version counters (Triton kernels, or torch ops through
    `write_alias`). Each tensor must own its storage alone, whole."""
    storages = [t.untyped_storage() for t in tensors]
    nbytes = [s.nbytes() for s in storages]
    for t, s, n in zip(tensors, storages, nbytes):
        if t.storage_offset() != 0 or t.numel() * t.element_size() != n:
            raise ValueError(f"release_until_backward: a {tuple(t.shape)} tensor shares its storage ({n} bytes)")
    pending = [(tensors, storages, nbytes, rebuild)]  # emptied by the first hook that runs (no references kept)

    def refill(*_):
        if pending:
            ts, ss, ns, fn = pending.pop()
            for s, n in zip(ss, ns):
                s.resize_(n)
            fn(*ts)

    nodes = {id(a.grad_fn): a.grad_fn for a in anchors if a.grad_fn is not None}
    if not nodes:
        raise ValueError("release_until_backward: no anchor has an autograd node (nothing would rebuild)")
    for s in storages:
        s.resize_(0)
    for node in nodes.values():
        node.register_prehook(refill)


class Rebuild:
    """How to rebuild a tensor's values: `write(out, *sources)` writes them into `out`, bit for bit, from `sources`
    (tensors its producer saves for the backward anyway). Calling it (`rebuild(out)`) writes from the sources it
    holds; a consumer that runs its own backward may instead save `sources` itself (autograd then checks them) and
    call `write` with them."""

    __slots__ = ("write", "sources")

    def __init__(self, write, sources):
        self.write, self.sources = write, tuple(sources)

    def __call__(self, out: torch.Tensor) -> None:
        self.write(out, *self.sources)


def mark_rebuildable(t: torch.Tensor, write, *sources: torch.Tensor) -> torch.Tensor:
    """Record on `t` (an op's output, owning its storage) how to rebuild its values: `write(out, *sources)`
    writes them into `out`, bit for bit, from `sources`, tensors its producer saves for the backward anyway. A
    consumer that alone reads `t` may then release it until the backward, or not keep it at all (`rebuildable`).
    Returns t."""
    setattr(t, _REBUILD, Rebuild(write, sources))
    return t


def rebuildable(t: torch.Tensor):
    """`t`'s `Rebuild` (mark_rebuildable), or None."""
    return getattr(t, _REBUILD, None)
