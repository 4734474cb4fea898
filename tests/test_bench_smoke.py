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
SLICES = ("qwen3_8b", "qwen3_30b_a3b", "qwen3_5_moe")
CPU_CONFIGS = ("eager", "ours")
GPU_ONLY = ("compile", "liger")


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


def test_bench_distributed_smoke(tmp_path):
    """scripts/bench_distributed.py --smoke on 2 CPU processes (gloo, file rendezvous; what torchrun runs on the
    GPUs): both configurations through transformers' distributed_config (fsdp 2, ep 2), the table, the JSON with
    MFU / scaling-efficiency fields (against a given one-process reference)."""
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps(dict(meta=dict(layers=2, seq=32, batch=2), results=[
        dict(config="hf", status="ok", tokens_per_s_per_gpu=100.0),
        dict(config="ours", status="ok", tokens_per_s_per_gpu=100.0)])))
    env = dict(os.environ, PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", WORLD_SIZE="2",
               TRITON_INTERPRET="0")  # the kernels' torch path: the script, not the kernels, is under test
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_distributed.py"), "--smoke", "--steps", "1",
           "--out", str(tmp_path), "--model-dir", str(tmp_path / "models"), "--reference", str(ref),
           "--init-method", f"file://{tmp_path / 'store'}"]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        logs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for p in procs:  # only the two started above
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    data = json.loads((tmp_path / "bench_distributed_2gpu_ep2.json").read_text())
    rows = {r["config"]: r for r in data["results"]}
    assert set(rows) == {"hf", "ours"}
    for r in rows.values():
        assert r["status"] == "ok", r
        assert r["gpus"] == 2 and r["ep"] == 2 and "distributed_config" in r["sharding"]
        for key in ("tokens_per_s_per_gpu", "step_ms_median", "loss_step1", "scaling_efficiency", "x_hf"):
            assert isinstance(r[key], (int, float)) and math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert r["scaling_efficiency"] == round(r["tokens_per_s_per_gpu"] / 100.0, 3)
    assert "GroupedGemmExperts" in rows["ours"]["kernels"]
    assert abs(rows["ours"]["loss_step1"] - rows["hf"]["loss_step1"]) < 0.05
    assert data["meta"]["flops_per_token"] > 0
    assert "| ours | 2 | 2 |" in (tmp_path / "bench_distributed_2gpu_ep2.md").read_text()
    assert "| ours | 2 | 2 |" in logs[0]  # rank 0 prints the table
