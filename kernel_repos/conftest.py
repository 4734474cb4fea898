"""Kernel tests import the source packages (`hubfuse.<pkg>`); `use_kernel_path` picks the path of the ops a test runs."""
import os

import pytest
import torch


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
