"""Where an op runs, decided from the tensor at call time (vendored into every hub variant).

Triton on CUDA / ROCm / XPU, and on CPU when `TRITON_INTERPRET=1` (how the CPU tests run the kernels); the
torch reference path everywhere else. The environment is read on every call so that a test can switch paths.
"""
import functools
import os

import torch


def use_triton(t: torch.Tensor) -> bool:
    device_type = t.device.type
    if device_type == "cuda" or device_type == "xpu":
        return True
    return device_type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def capturing(device: torch.device) -> bool:
    """Whether `device` is CUDA and its current stream is capturing a CUDA graph (work enqueued now is recorded,
    not run: no host-to-device copy of new values, no reading results back)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def int64_table(values, device: torch.device) -> torch.Tensor:
    """`values` (ints) as an int64 tensor on `device`; on CUDA through pinned host memory and an asynchronous copy,
    so that the host does not wait for the stream (a pageable copy would)."""
    cuda = device.type == "cuda"
    return torch.tensor(values, dtype=torch.int64, pin_memory=cuda).to(device, non_blocking=cuda)


def cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached); 4 elsewhere (the interpreter, tests)."""
    return _sm_count(cuda_index(device)) if device.type == "cuda" else 4


def capability(device: torch.device) -> tuple[int, int]:
    """Compute capability of a CUDA device (cached); (0, 0) elsewhere."""
    return _capability(cuda_index(device)) if device.type == "cuda" else (0, 0)


_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu")


def autocast_dtype(t: torch.Tensor):
    """The autocast dtype when `torch.autocast` is on for `t`'s device, else None. Traceable by dynamo on every
    supported torch (it constant-folds these two calls; `torch.amp.is_autocast_available` is a graph break on
    torch 2.11)."""
    device_type = t.device.type
    if device_type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None
