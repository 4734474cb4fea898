"""scripts/kernels_benchmark.py: the hub CLI's `kernels benchmark` over a repo's benchmarks/, output kept."""
import json
import os
import subprocess
import sys

from tests.utils import ROOT


def test_kernels_benchmark_runs_and_keeps_json(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernels_benchmark.py"), "load-balancing-loss",
                           "--iterations", "1", "--warmup", "0"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "kernels_benchmark.json").read_text())
    assert list(results) == ["load-balancing-loss"]
    text = json.dumps(results["load-balancing-loss"])
    assert "aux_loss_bf16" in text and "softmax_topk_bf16" in text  # every workload of the repo's benchmark file
    assert "LoadBalancingLossBenchmark" in (tmp_path / "kernels_benchmark.log").read_text()


def test_kernels_benchmark_rejects_unknown_repo(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernels_benchmark.py"), "nope"], cwd=ROOT,
                          env=dict(os.environ, OUT=str(tmp_path)), capture_output=True, text=True)
    assert proc.returncode != 0 and "unknown repo" in proc.stderr
