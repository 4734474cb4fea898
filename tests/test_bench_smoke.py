"""scripts/bench.py --smoke: the training-step benchmark end to end on CPU (tiny dims, bf16): every slice with
the configurations that run on CPU (HF eager, ours), each in its subprocess, and the skipped ones (compile,
Liger: GPU only) recorded with a note."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SLICES = ("qwen3_small", "qwen3_moe_small", "qwen3_5_moe")  # the smoke default: one per family
CPU_CONFIGS = ("eager", "ours")
GPU_ONLY = ("ours_graph", "compile", "compile_ro", "liger", "ours_ro", "ours_compile", "liger_compile")


def test_bench_smoke(tmp_path):
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--smoke", "--out", str(tmp_path),
                           "--no-plots"], cwd=ROOT, capture_output=True, text=True, timeout=90,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    wall = time.time() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "bench_train.json").read_text())
    rows = {(r["slice"], r["config"]): r for r in data["results"]}
    for s in SLICES:
        for c in CPU_CONFIGS:
            r = rows.get((s, c))
            assert r is not None, f"missing row {s}/{c}: {sorted(rows)}"
            assert r["status"] == "ok", r
            for key in ("tokens_per_s", "step_ms_median", "peak_mem_GiB", "loss_step1", "loss_last"):
                assert isinstance(r[key], (int, float)) and math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert rows[(s, "ours")]["modules"], "no hubfuse kernel bound"
        # same weights, same batch: step-1 losses agree (bf16 on CPU)
        assert abs(rows[(s, "ours")]["loss_step1"] - rows[(s, "eager")]["loss_step1"]) < 0.05, s
        for c in GPU_ONLY:
            assert rows[(s, c)]["status"] in ("skipped", "unsupported"), rows[(s, c)]
    md = (tmp_path / "bench_train.md").read_text()
    assert md.count("| ok |") == len(SLICES) * len(CPU_CONFIGS)
    assert "] step" in proc.stdout  # progress lines from the subprocesses
    assert wall < 90
