"""The bad-input matrix (tests/bad_input_matrix.py): every sampled cell gives torch's float64 result, forward and
backward, or a clear error; silent wrong = 0. CPU: the torch path and the Triton kernels under the interpreter;
the `gpu` variant runs the same cells on CUDA, and the value checks (device-side asserts, which poison the CUDA
context) in subprocesses. The run writes the report to out/bad_input_matrix.md or `HUBFUSE_BAD_INPUT_REPORT=<path>`
(root conftest; docs/bad_input_matrix.md is that file) and prints one line pointing at it.
"""
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from tests import bad_input_matrix as matrix
from tests.utils import ROOT

CELLS = matrix.generate(("ref", "interp"))
# on CUDA an out-of-range id is a device-side assert: those cells run in a subprocess (test_gpu_value_checks);
# generated only where they run (some thousand skipped items cost the CPU run time)
GPU_CELLS = [c for c in matrix.generate(("cuda",)) if not c.values.startswith("id_") or c.values == "id_sentinel"
             ] if torch.cuda.is_available() else []


def _check(outcome):
    matrix.RESULTS.append(outcome)
    assert outcome.category in ("correct", "clear_error"), f"{outcome.category}: {outcome.detail}"
    # the matrix can fail: a target that raised on everything would pass every bad cell with a "clear error"
    assert outcome.category == "correct" or not matrix.is_base(outcome.cell), outcome.detail


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.id)
def test_cell(cell):
    _check(matrix.run_cell(cell))


def test_every_public_name_is_in_the_matrix():
    assert matrix.uncovered_names() == []


def test_every_target_has_a_base_cell():
    assert {c.target for c in CELLS if matrix.is_base(c)} == set(matrix.TARGETS)


@pytest.mark.gpu
@pytest.mark.parametrize("cell", GPU_CELLS, ids=lambda c: c.id)
def test_cell_gpu(cell):
    _check(matrix.run_cell(cell, device="cuda"))


# A device-side assert leaves the CUDA context unusable: each bad value runs in its own process, which must
# die with the assert at the next synchronisation (and not before: no host sync).
_VALUE_CHECK = textwrap.dedent("""
    import sys
    import torch
    sys.path.insert(0, {torch_ext!r})
    import hubfuse.cross_entropy as cross_entropy
    import hubfuse.gated_delta_net as gated_delta_net
    import hubfuse.moe as moe
    case, mode = sys.argv[1], sys.argv[2]
    dev = "cuda"
    torch.manual_seed(0)
    if case.startswith("ce"):
        fn = lambda x, y: cross_entropy.cross_entropy(x, y, inplace=False)
        if case == "ce_linear":
            w = torch.randn(37, 16, device=dev)
            fn = lambda x, y: cross_entropy.linear_cross_entropy(x, w, y)
            x = torch.randn(6, 16, device=dev)
        else:
            x = torch.randn(6, 37, device=dev)
        y = torch.randint(0, 37, (6,), device=dev)
        bad = y.clone()
        bad[3] = 37 if case != "ce_low" else -1
        args_ok, args_bad = (x, y), (x, bad)
    elif case.startswith("cu_seqlens"):  # packed sequences: T = 100 tokens
        q, k = torch.randn(1, 100, 1, 16, device=dev), torch.randn(1, 100, 1, 16, device=dev)
        v = torch.randn(1, 100, 2, 16, device=dev)
        g, beta = -torch.rand(1, 100, 2, device=dev), torch.rand(1, 100, 2, device=dev)
        fn = lambda cu: gated_delta_net.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)
        bad = dict(cu_seqlens_unsorted=[0, 60, 30, 100], cu_seqlens_high=[0, 50, 120],
                   cu_seqlens_low=[-5, 50, 100])[case]
        args_ok, args_bad = (torch.tensor([0, 30, 30, 100], device=dev),), (torch.tensor(bad, device=dev),)
    else:
        E = 4
        h, w = torch.randn(5, 16, device=dev), torch.rand(5, 2, device=dev)
        gu, d = torch.randn(E, 16, 16, device=dev), torch.randn(E, 16, 8, device=dev)
        idx = torch.randint(0, E, (5, 2), device=dev)
        bad = idx.clone()
        bad[2, 1] = -1 if case == "moe_low" else E + 1
        fn = lambda i: moe.moe_experts(h, i, w, gu, d)
        args_ok, args_bad = (idx,), (bad,)
    if mode == "compile":
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    fn(*args_ok)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a host sync in the op would raise here
    fn(*args_bad)  # queued: no error yet
    torch.cuda.set_sync_debug_mode("default")
    print("QUEUED", flush=True)
    torch.cuda.synchronize()
    print("NO ASSERT", flush=True)
""")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "compile"])
@pytest.mark.parametrize("case", ["ce_low", "ce_high", "ce_linear", "moe_low", "moe_high", "cu_seqlens_unsorted",
                                  "cu_seqlens_high", "cu_seqlens_low"])
def test_gpu_value_checks(case, mode, tmp_path):
    script = tmp_path / "value_check.py"
    script.write_text(_VALUE_CHECK.format(torch_ext=str(ROOT / "torch-ext")))
    run = subprocess.run([sys.executable, str(script), case, mode], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "TRITON_INTERPRET": "0"}, timeout=600)
    assert "QUEUED" in run.stdout, run.stderr[-3000:]  # the check itself did not sync the host
    assert "NO ASSERT" not in run.stdout and run.returncode != 0
    assert "device-side assert" in run.stderr or "Assertion" in run.stderr, run.stderr[-3000:]


@pytest.mark.gpu
def test_gpu_value_checks_do_not_sync_the_host():
    # valid ids, labels and cu_seqlens: forward and backward of the ops with value checks run with no host sync
    import hubfuse.cross_entropy as cross_entropy
    import hubfuse.gated_delta_net as gdn
    import hubfuse.moe as moe

    torch.manual_seed(0)
    x = torch.randn(8, 37, device="cuda", requires_grad=True)
    y = torch.randint(0, 37, (8,), device="cuda")
    h, w = torch.randn(8, 16, device="cuda", requires_grad=True), torch.randn(37, 16, device="cuda")
    hm, wm = torch.randn(5, 16, device="cuda", requires_grad=True), torch.rand(5, 2, device="cuda")
    gu, d = torch.randn(4, 16, 16, device="cuda"), torch.randn(4, 16, 8, device="cuda")
    idx = torch.randint(0, 5, (5, 2), device="cuda")  # 4 = the expert-parallel sentinel: valid
    q, k = (torch.randn(1, 100, 1, 64, device="cuda", requires_grad=True) for _ in range(2))
    v = torch.randn(1, 100, 2, 64, device="cuda", requires_grad=True)
    g = torch.nn.functional.logsigmoid(torch.randn(1, 100, 2, device="cuda")).requires_grad_()
    beta = torch.rand(1, 100, 2, device="cuda", requires_grad=True)
    cu = torch.tensor([0, 30, 30, 100], device="cuda", dtype=torch.int32)
    for checked in (False, True):  # the first round compiles the kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if checked else "default")
        try:
            cross_entropy.cross_entropy(x * 1, y).backward()
            cross_entropy.linear_cross_entropy(h, w, y).backward()
            moe.moe_experts(hm, idx, wm, gu, d).sum().backward()
            o, _ = gdn.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
            o.sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_run_ends_with_pytest_summary_and_writes_the_report(tmp_path):
    """The report goes to a file (HUBFUSE_BAD_INPUT_REPORT, default out/bad_input_matrix.md); the terminal gets
    one line pointing at it, then pytest's own summary. The report has no references outside the repository."""
    report = tmp_path / "matrix.md"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q",
                          "tests/test_bad_input_matrix.py::test_cell[rms_norm-ref-eager]"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env={**os.environ, "HUBFUSE_BAD_INPUT_REPORT": str(report)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert f"bad-input matrix report (1 cells): {report}" in lines
    assert "| target |" not in run.stdout and "1 passed" in lines[-1]
    text = report.read_text()
    assert text.startswith("# Bad-input matrix") and "`rms_norm`" in text
    assert not re.search(r"issue \d|machine that wrote", text)
