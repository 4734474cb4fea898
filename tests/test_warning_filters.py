"""The test run's summary shows no warning that comes from elsewhere than our code: the third-party warnings
the suite triggers are filtered in pyproject.toml, each with its reason."""
import os
import subprocess
import sys

from tests.utils import ROOT

# what triggers them in the suite: torch.compile's inductor backend (torch.jit.script_method in torch's own
# modules), NaN/inf through a Triton kernel under the interpreter (numpy RuntimeWarnings), a Trainer's pinned
# data loader on a machine without a GPU
_TRIGGERS = '''
import torch
import triton
import triton.language as tl


@triton.jit
def _sub(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, (x - x) / x * 1e38 * 1e38, mask=offs < n)


@triton.jit
def _reduce(x_ptr, y_ptr, BLOCK: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, BLOCK))
    tl.store(y_ptr, tl.sum(x, 0))
    tl.store(y_ptr + 1, tl.max(x, 0))


def test_pinned_loader_without_a_gpu():  # transformers' Trainer default
    assert next(iter(torch.utils.data.DataLoader([1.0], pin_memory=True))).item() == 1.0


def test_inductor_import():
    import torch._inductor.compile_fx  # noqa: F401


def test_nan_inf_under_the_interpreter():
    x = torch.tensor([float("nan"), float("inf"), 0.0, 3.0e38])
    y = torch.empty_like(x)
    _sub[(1,)](x, y, x.numel(), BLOCK=4)
    assert y.isnan()[:3].all()
    for x in (torch.tensor([float("inf"), -float("inf")] * 2), torch.full((4,), float("nan"))):
        _reduce[(1,)](x, y, BLOCK=4)
        assert y[0].isnan()
'''


def test_third_party_warnings_are_filtered(tmp_path):
    (tmp_path / "test_triggers.py").write_text(_TRIGGERS)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-c", str(ROOT / "pyproject.toml"), "--rootdir",
                          str(tmp_path), str(tmp_path / "test_triggers.py")], capture_output=True, text=True,
                         cwd=tmp_path, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "3 passed" in run.stdout and "warning" not in run.stdout, run.stdout[-3000:]
