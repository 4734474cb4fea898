"""scripts/profile_memory.py and scripts/host_per_layer.py end to end on CPU at tiny widths: they run, report both
configurations, and hubfuse saves less per decoder layer and launches fewer kernels than HF. The Gated DeltaNet
sweep's rule steps (scripts/sweep_gated_delta_net.py, a GPU script) on CPU."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_profile_memory_tiny():
    out = _run("profile_memory.py", "--tiny", "--layers", "2", "--batch", "1", "--seq", "16")
    totals = [float(t) for t in re.findall(r"\| \*\*total\*\* \| \| \*\*([\d.]+)\*\* \|", out)]
    assert len(totals) == 2, out  # eager, ours
    assert 0 < totals[1] < totals[0], totals
    assert "_decoder_layer_block" in out, out  # attributed to our ops (the decoder layer as one node)
    assert out.count("CUDA peak") == 2


def test_host_per_layer_cpu_proxy_counts_kernels():
    out = _run("host_per_layer.py", "--tiny", "--batch", "1", "--seq", "8", "--iters", "3", "--warmup", "1",
               "--no-kernels")
    rows = dict(re.findall(r"^\| (eager|ours) \| .* \| (\d+) \|$", out, flags=re.M))
    assert set(rows) == {"eager", "ours"}, out
    assert 0 < int(rows["ours"]) < int(rows["eager"]), rows


def test_sweep_gated_delta_net_rule_steps(monkeypatch):
    """scripts/sweep_gated_delta_net.py's rule step on CPU (the torch path): each step writes the gradients afresh
    (the profiled GPU time holds no accumulation kernels), and its FLA step gives FLA q and k with the key heads
    repeated to the value heads, as transformers calls it."""
    import torch

    import hubfuse.gated_delta_net as gdn

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch path: real head counts, one short chunk
    import sweep_gated_delta_net as sweep

    step = sweep.rule_workload(gdn, "cpu", torch.float32, 1, 3)
    q = step.leaves[0]
    assert q.shape[2] == sweep.HK
    step()
    once = q.grad.clone()
    step()
    assert torch.equal(q.grad, once)

    seen = {}

    def fake_fla(q, k, v, g, beta, **kwargs):
        seen.update(q=q.shape, k=k.shape, v=v.shape)
        return gdn.chunk_gated_delta_rule(q, k, v, g, beta, **kwargs)

    sweep.rule_workload(gdn, "cpu", torch.float32, 1, 3, fla=fake_fla)()
    assert seen["q"][2] == seen["k"][2] == seen["v"][2] == sweep.HV, seen

    if importlib.util.find_spec("fla") is None:  # --fla without FLA: a clear exit, not a traceback
        monkeypatch.delenv("HUBFUSE_FLA_SITE", raising=False)
        with pytest.raises(SystemExit, match="flash-linear-attention is not importable"):
            sweep.load_fla()
