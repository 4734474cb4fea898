"""Kernel tests import the assembled op packages (source + vendored shared modules, `scripts/build.py --stage`),
re-assembled at the start of every test session so that they always test the current source."""
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import build  # noqa: E402

sys.path.remove(str(ROOT / "scripts"))
sys.path.insert(0, str(build.stage()))


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
