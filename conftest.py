"""Root pytest configuration: run Triton kernels under the interpreter when there is no GPU.

Must run before triton is imported anywhere, hence at the root and at import time.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Triton fixes the interpreter mode of nested @triton.jit functions when it is first imported: import it
    # now, so that a test which flips TRITON_INTERPRET=0 (the torch path) first cannot break later kernels
    try:
        import triton  # noqa: F401
    except ImportError:
        pass


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped otherwise)")
    config.addinivalue_line("markers", "slow: long-running test")


def pytest_collection_modifyitems(config, items):
    import pytest

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
