"""Checks shared by every op family (vendored into every hub variant).

* `first_order(name)`: the fused backwards are not themselves differentiable. A backward run to build a graph
  (`create_graph=True`, the first step of a double backward) raises instead of returning gradients that
  silently lack their second-order terms. (Autograd runs a backward with grad mode on exactly then.)
* `check_offsets(...)`: the same for sequence boundaries (`cu_seqlens`): 0 first, never decreasing, the token
  count last.
* `check_range(...)`: value checks of index tensors (labels, expert ids) that never sync the host: on CPU a
  `ValueError` at once (there is no device to wait for), elsewhere a device-side assert
  (`torch._assert_async`, as PyTorch's own index kernels do) that fails the next synchronising call; the CUDA
  context cannot be used after it fired. Called inside the custom ops' implementations, so eager mode and
  torch.compile (which runs the real implementation of an opaque op) check alike, with no graph break.
"""
import functools

import torch


def first_order(name: str):
    """Decorator for a backward (of an `autograd.Function` or given to `register_autograd`)."""

    def wrap(backward):
        @functools.wraps(backward)
        def checked(ctx, *grads):
            if torch.is_grad_enabled():
                raise RuntimeError(
                    f"{name}: double backward is not supported: the fused backward is not differentiable, so "
                    "create_graph=True cannot build the graph of the gradients. Use the torch reference (the "
                    "`*_hf` / `*_reference` functions or the Layout's forward) for higher-order gradients.")
            return backward(ctx, *grads)

        return checked

    return wrap


def check_range(t: torch.Tensor, low: int, high: int, message: str, ignore=None) -> None:
    """Every value of the integer tensor `t` is in [low, high) (or equals `ignore`), else an error with
    `message` (which should name the argument and the expected range)."""
    valid = (t >= low) & (t < high)
    if ignore is not None:
        valid |= t == ignore
    if t.device.type == "cpu":
        if not bool(valid.all()):
            raise ValueError(f"{message}; found {t[~valid][0].item()}")
        return
    torch._assert_async(valid.all(), message)


def check_offsets(offsets: torch.Tensor, total: int, message: str) -> None:
    """The 1-D integer tensor `offsets` (at least one entry) starts at 0, never decreases and ends at `total`,
    else an error with `message` (as `check_range`: ValueError on CPU, a device-side assert elsewhere)."""
    valid = (offsets[0] == 0) & (offsets[-1] == total) & (offsets[1:] >= offsets[:-1]).all()
    if offsets.device.type == "cpu":
        if not bool(valid):
            shown = offsets[:16].tolist()
            raise ValueError(f"{message}; got {shown}{' ...' if offsets.numel() > 16 else ''}")
        return
    torch._assert_async(valid, message)
