"""Root pytest configuration: run Triton kernels under the interpreter when there is no GPU.

Must run before triton is imported anywhere, hence at the root and at import time.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Triton fixes the interpreter mode of nested @triton.jit functions when it is first imported: import it
    # now, so that a test which flips TRITON_INTERPRET=0 (the torch path) first cannot break later kernels
    try:
        import triton  # noqa: F401
    except ImportError:
        pass


@pytest.fixture
def use_kernel_path(monkeypatch):
    """`use_kernel_path(name)` sets a test up to run one path of the ops: "torch" = the torch reference path (the
    no-Triton CPU path: TRITON_INTERPRET=0), any other name = the Triton kernels (on CPU, under the interpreter).
    Skips where that path does not run here."""
    def use(name: str) -> None:
        if name == "torch":
            if torch.cuda.is_available():
                pytest.skip("the torch path is the no-Triton CPU path")
            monkeypatch.setenv("TRITON_INTERPRET", "0")
        elif not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("needs TRITON_INTERPRET=1 on CPU")

    return use


@pytest.fixture
def triton_interpreter(monkeypatch):
    """`triton_interpreter()` runs the rest of a test with the Triton kernels under the CPU interpreter
    (TRITON_INTERPRET=1). Skips on a GPU machine: Triton fixes a kernel's interpreter mode when its module is first
    imported, so kernels imported there would stay interpreted, CUDA tensors included, for the rest of the process
    (the GPU tests run the kernels on CUDA instead)."""
    def use() -> None:
        if torch.cuda.is_available():
            pytest.skip("a CPU interpreter test: on a GPU machine it would leave kernels interpreted")
        monkeypatch.setenv("TRITON_INTERPRET", "1")

    return use


@pytest.fixture
def zero_fills():
    """`with zero_fills() as fills:` records the name of every op run inside that fills a tensor with zeros
    (zeros, zeros_like, new_zeros, zero_, fill_): on a GPU each is a launch."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class ZeroFills(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.fills = []

        def __enter__(self):
            super().__enter__()
            return self.fills

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in ("zeros", "new_zeros", "zeros_like", "zero_", "fill_"):
                self.fills.append(str(func))
            return func(*args, **(kwargs or {}))

    return ZeroFills


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped otherwise)")
    config.addinivalue_line("markers", "slow: long-running test")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """When the bad-input matrix cells ran (tests/test_bad_input_matrix.py), write its report to
    HUBFUSE_BAD_INPUT_REPORT (default out/bad_input_matrix.md) and print one line pointing at it."""
    import sys
    from pathlib import Path

    matrix = sys.modules.get("tests.bad_input_matrix")
    if matrix is None or not matrix.RESULTS:
        return
    text = matrix.report(matrix.RESULTS, seconds=sum(o.seconds for o in matrix.RESULTS))
    path = Path(os.environ.get("HUBFUSE_BAD_INPUT_REPORT") or Path(__file__).parent / "out/bad_input_matrix.md")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    terminalreporter.write_line(f"bad-input matrix report ({len(matrix.RESULTS)} cells): {path}")
