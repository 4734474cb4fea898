"""`python scripts/demo.py` (README command 1) on CPU: exits 0, parity for each family, the activation-memory table,
which path ran on CPU, where the GPU numbers are, and no warning line (a subset of families keeps this test short;
the demo runs them one after the other)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_demo_is_quiet_and_shows_parity_and_memory():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LOCAL_KERNELS")}  # as a user runs it
    run = subprocess.run([sys.executable, "scripts/demo.py", "--families", "qwen3_moe", "qwen3_5_moe", "--no-bench"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "WARNING" not in out and "falling back" not in out and "No kernel mapping found" not in out and "entry ignored" not in out, out
    assert "OK: every kernelized model matches the plain one" in out
    lines = out.splitlines()
    memory = lines[lines.index(next(line for line in lines if line.startswith("Activation memory"))) + 3:][:2]
    for row, family in zip(memory, ("qwen3_moe", "qwen3_5_moe")):
        name, eager, ours, _ = row.split()
        assert name == family and float(ours) < 0.5 * float(eager), row  # the logits are not kept
    # which path ran on CPU (the user's environment has no TRITON_INTERPRET), and where the GPU numbers are
    assert "On CPU hubfuse ran the kernels' torch reference path (HF-exact numerics), not the Triton kernels" in out
    assert "GPU numbers (the Triton kernels: " in out and "are in docs/benchmarks.md" in out
