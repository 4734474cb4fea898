"""scripts/profile_memory.py and scripts/host_per_layer.py end to end on CPU at tiny widths: they run, report both
configurations, and hubfuse saves less per decoder layer and launches fewer kernels than HF."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

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
