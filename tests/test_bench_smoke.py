"""scripts/bench.py --smoke: the training-step benchmark end to end on CPU (tiny dims, bf16): every slice with
the configurations that run on CPU (HF eager, ours), each in its subprocess, and the skipped ones (compile,
Liger: GPU only) recorded with a note."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

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
    # the host's Python speed goes with every run: the eager steps' host time follows it
    assert 0 < data["meta"]["host_yardstick_us"] < 1e4 and f"host yardstick {data['meta']['host_yardstick_us']} us" in md
    assert "] step" in proc.stdout  # progress lines from the subprocesses
    assert wall < 90


def test_bench_distributed_smoke(tmp_path):
    """scripts/bench_distributed.py --smoke on 2 CPU processes (gloo, file rendezvous; what torchrun runs on the
    GPUs): both configurations through transformers' distributed_config (fsdp 2, ep 2), then rank 0 alone
    (--one-gpu-reference, last by default); the table and the JSON with x hf, MFU fields and the scaling
    efficiency, the per-rank host / step medians and the per-rank profile breakdown (--profile 1)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", WORLD_SIZE="2",
               TRITON_INTERPRET="0")  # the kernels' torch path: the script, not the kernels, is under test
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_distributed.py"), "--smoke", "--steps", "1",
           "--out", str(tmp_path), "--model-dir", str(tmp_path / "models"), "--one-gpu-reference",
           "--init-method", f"file://{tmp_path / 'store'}", "--profile", "1", "--trace", str(tmp_path / "traces"), "--back-to-back", "--layers-per-unit", "1", "2",
           "--embedding", "fsdp", "rows"]
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
    data = json.loads((tmp_path / "bench_distributed_qwen3_30b_a3b_2l_2gpu_ep2.json").read_text())
    rows = {(r["gpus"], r["config"]): r for r in data["results"]}
    assert set(rows) == {(g, c) for g in (1, 2) for c in ("hf", "ours")} | {(2, "ours_fsdp")}
    assert [r["gpus"] for r in data["results"]] == [2] * 6 + [1, 1]  # the one-GPU reference after the 2-GPU rows
    # --layers-per-unit 1 2 x --embedding fsdp rows: the hubfuse-sharded config once per pair, its 2 layers in one
    # FSDP unit (tag u2), its input embedding row-sharded by shard_embedding (tag embrows)
    assert [r["row"] for r in data["results"] if r["config"] == "ours_fsdp"] == [
        "ours_fsdp[fixed]", "ours_fsdp[fixed,embrows]", "ours_fsdp[fixed,u2]", "ours_fsdp[fixed,u2,embrows]"]
    assert "2 layers per FSDP unit" in data["results"][4]["sharding"]
    assert "embedding rows sharded" in data["results"][3]["sharding"]
    fsdp_rows = [r for r in data["results"] if r["config"] == "ours_fsdp"]
    assert len({r["loss_step1"] for r in fsdp_rows}) == 1, [r["loss_step1"] for r in fsdp_rows]  # same forward
    for (gpus, config), r in rows.items():
        assert r["status"] == "ok", r
        for key in ("tokens_per_s_per_gpu", "step_ms_median", "loss_step1", "scaling_efficiency", "x_hf"):
            assert isinstance(r[key], (int, float)) and math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert [p["rank"] for p in r["per_rank"]] == list(range(gpus)), r["per_rank"]
        for p in r["per_rank"]:
            assert 0 < p["enqueue_ms"] <= p["step_ms"] * 1.01, p
        if gpus == 2:
            assert r["ep"] == 2
            # --sharding transformers (the default), except ours_fsdp: shard_experts + fully_shard_model
            assert ("distributed_config" in r["sharding"]) == (config != "ours_fsdp"), r["sharding"]
            one = "ours" if config == "ours_fsdp" else config
            want = round(r["tokens_per_s_per_gpu"] / rows[(1, one)]["tokens_per_s_per_gpu"], 3)
            assert r["scaling_efficiency"] == want, (r, want)
    assert "GroupedGemmExperts" in rows[(2, "ours")]["kernels"]
    assert abs(rows[(2, "ours")]["loss_step1"] - rows[(2, "hf")]["loss_step1"]) < 0.05
    assert data["meta"]["flops_per_token"] > 0
    assert "| ours[fixed] | 2 | 2 |" in (tmp_path / "bench_distributed_qwen3_30b_a3b_2l_2gpu_ep2.md").read_text()
    assert "| ours[fixed] | 2 | 2 |" in logs[0]  # rank 0 prints the table (ours: the sync-free EP exchange)
    assert "| ours[fixed] | 2 | 1 |" in logs[0]  # the per-rank table: rank 1 of ours[fixed] on 2 ranks
    profile = json.loads((tmp_path / "bench_distributed_qwen3_30b_a3b_2l_2gpu_ep2_profile.json").read_text())
    assert [p["rank"] for p in profile["ours[fixed] x 2"]] == [0, 1]  # every rank's breakdown
    # the expert load of every MoE layer (2 layers), max / mean over the 2 EP ranks in [1, 2]
    load = rows[(2, "ours")]["expert_load"]
    assert len(load["max_over_mean"]) == 2 and all(1.0 <= x <= 2.0 for x in load["max_over_mean"]), load
    # --back-to-back: every row's rate over steps with no synchronisation between them, and its scaling
    for (gpus, config), r in rows.items():
        assert r["b2b_step_ms"] > 0 and r["b2b_tokens_per_s_per_gpu"] > 0, r
        assert (r["b2b_scaling_efficiency"] == 1.0) == (gpus == 1) and r["b2b_scaling_efficiency"] > 0, r
    assert "Back to back" in (tmp_path / "bench_distributed_qwen3_30b_a3b_2l_2gpu_ep2.md").read_text()
    # --trace: each rank's gzipped chrome trace of the profiled rows
    assert sorted(p.name for p in (tmp_path / "traces").glob("trace_ours*")) == [
        "trace_ours_1gpu_rank0.json.gz", "trace_ours_fixed_2gpu_rank0.json.gz", "trace_ours_fixed_2gpu_rank1.json.gz",
        "trace_ours_fsdp_fixed_2gpu_rank0.json.gz", "trace_ours_fsdp_fixed_2gpu_rank1.json.gz",
        "trace_ours_fsdp_fixed_embrows_2gpu_rank0.json.gz", "trace_ours_fsdp_fixed_embrows_2gpu_rank1.json.gz",
        "trace_ours_fsdp_fixed_u2_2gpu_rank0.json.gz", "trace_ours_fsdp_fixed_u2_2gpu_rank1.json.gz",
        "trace_ours_fsdp_fixed_u2_embrows_2gpu_rank0.json.gz", "trace_ours_fsdp_fixed_u2_embrows_2gpu_rank1.json.gz"]


def _bench_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("hubfuse_bench_script", ROOT / "scripts" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_sdpa_backends_smoke(tmp_path):
    """--sdpa-backends: one row per configuration and backend, SDPA held to that backend for the run; the same
    losses as with any other exact backend; GPU-only configurations skipped per backend."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--smoke", "--slices", "qwen3_small",
                           "--configs", "eager", "ours", "ours_graph", "--sdpa-backends", "math", "flash",
                           "--out", str(tmp_path), "--no-plots"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["config"]: r for r in json.loads((tmp_path / "bench_train.json").read_text())["results"]}
    assert set(rows) == {f"{c}@{b}" for c in ("eager", "ours", "ours_graph") for b in ("math", "flash")}
    for c in ("eager@math", "eager@flash", "ours@math", "ours@flash"):
        assert rows[c]["status"] == "ok" and rows[c]["sdpa_backend"] == c.split("@")[1], rows[c]
        assert abs(rows[c]["loss_step1"] - rows["eager@math"]["loss_step1"]) < 0.05, rows[c]
    assert rows["ours_graph@flash"]["status"] == "skipped"
    assert "| qwen3_small | ours@flash | ok |" in proc.stdout  # the compact table at the end
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--dry-run", "--configs", "ours@fast"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "ours@fast" in bad.stderr


def _row(config, step, peak, top=None, **kw):
    return dict(slice="qwen3_0_6b", config=config, status="ok", step_ms_median=step, peak_mem_GiB=peak,
                host_ms=step * 0.9, gpu_ms=step * 0.8, launches_per_step=100.0, top_kernels=top, **kw)


def test_bench_tables_and_report_only(tmp_path, capsys):
    """The summary against the issue's targets, the per-kernel eager / replay table (per SDPA backend), and
    --report-only re-printing them from a saved bench_train.json."""
    bench = _bench_module()
    eager_k = [["sdpa_bwd_kernel", 28.0, 6.2], ["gemm_a", 100.0, 30.0], ["only_in_eager", 5.0, 1.0]]
    replay_k = [["sdpa_bwd_kernel", 28.0, 17.5], ["gemm_a", 100.0, 30.5]]
    rows = [_row("compile", 100.0, 20.0), _row("compile_ro", 98.0, 25.0), _row("ours", 90.0, 10.0, eager_k),
            _row("ours_graph", 80.0, 8.0, replay_k),
            _row("ours_compile", 95.0, 12.0,
                 note="dynamo: 1 graph(s), 0 break(s), 0 recompile(s), 0 cudagraph skip(s)"),
            _row("ours@cudnn", 91.0, 10.0, eager_k), _row("ours_graph@cudnn", 85.0, 8.0, replay_k)]
    summary = "\n".join(bench.summary(rows))
    assert "best hubfuse mode ours_graph 80.0 ms vs best peer compile_ro 98.0 ms: 1.23x" in summary
    assert "plain hubfuse vs HF + compile 1.11x" in summary
    assert "ours_graph vs ours: 1.12x speed, 0.80x peak" in summary
    assert "peak of ours_graph / HF + compile 0.40" in summary
    kernels = bench.kernel_comparison(rows)
    assert sum("(graph replay" in line for line in kernels) == 2  # plain and @cudnn pairs
    assert "| sdpa_bwd_kernel | 6.20 | 17.50 | +11.30 | 28 | 28 |" in kernels
    assert "| only_in_eager | 1.00 |  |  | 5 |  |" in kernels
    assert kernels.index("| sdpa_bwd_kernel | 6.20 | 17.50 | +11.30 | 28 | 28 |") < kernels.index(
        "| only_in_eager | 1.00 |  |  | 5 |  |")  # largest first
    (tmp_path / "bench_train.json").write_text(json.dumps(dict(meta={}, results=rows[::-1])))
    assert bench.main(["--report-only", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    order = [out.index(f"| qwen3_0_6b | {c} |") for c in ("ours", "ours@cudnn", "ours_graph", "compile")]
    assert order == sorted(order)  # CONFIGS' run order, the backend variants after their configuration
    assert "0 recompile(s)" in out and "+11.30" in out


def test_dynamo_stats_counts_breaks_and_recompiles():
    import torch

    bench = _bench_module()
    torch._dynamo.reset()
    from torch._dynamo.utils import counters, guard_failures

    counters.clear()
    guard_failures.clear()

    def f(x, n):
        y = x * n
        torch._dynamo.graph_break()
        return y + 1

    compiled = torch.compile(f, backend="eager", dynamic=False)
    for n in (2, 3):  # a Python int: one recompile on the new value
        compiled(torch.randn(4), n)
    stats = bench.dynamo_stats()
    torch._dynamo.reset()
    assert stats["graph_breaks"] >= 1 and stats["recompiles"] >= 1 and stats["graphs"] >= 2, stats
    assert "recompile(s)" in bench.dynamo_note(stats) and stats["recompile_reasons"]


def test_bench_distributed_profile_breakdown():
    """The per-rank profile of scripts/bench_distributed.py on a hand-made trace: NCCL kernels sorted by kind,
    exposed time = busy time outside compute, idle GPU time, host syncs counted (other runtime calls not)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_distributed

    events = [("kernel", "gemm", 0, 100), ("kernel", "ncclDevKernel_AllGather_RING_LL", 50, 100),
              ("kernel", "ncclDevKernel_SendRecv", 200, 30), ("kernel", "ncclDevKernel_ReduceScatter_Sum", 210, 10),
              ("gpu_memcpy", "Memcpy DtoD", 235, 5), ("cuda_runtime", "cudaStreamSynchronize", 0, 40),
              ("cuda_runtime", "cudaLaunchKernel", 0, 5), ("cpu_op", "aten::tolist", 0, 50),
              ("user_annotation", "route", 0, 60), ("cpu_op", "aten::_local_scalar_dense", 0, 45),
              ("cpu_op", "aten::mm", 100, 5), ("cuda_runtime", "cudaStreamSynchronize", 300, 2)]
    trace = {"traceEvents": [dict(cat=c, name=n, ts=ts, dur=dur, tid=1) for c, n, ts, dur in events]}
    got = bench_distributed.summarize_trace(trace, steps=2)  # per step: half of every time (us -> ms)
    approx = pytest.approx
    # GPU busy: [0, 150] + [200, 230] + [235, 240] of a 240 us span
    assert (got["span_ms"], got["compute_ms"], got["idle_ms"]) == approx((0.12, 0.0525, 0.0275))
    # busy / exposed per step; calls per step, median and min duration of one call
    assert got["all_gather"] == dict(busy_ms=approx(0.05), exposed_ms=approx(0.025),  # half under the GEMM
                                     calls=0.5, median_ms=approx(0.1), min_ms=approx(0.1))
    assert got["all_to_all"] == dict(busy_ms=approx(0.015), exposed_ms=approx(0.015), calls=0.5,
                                     median_ms=approx(0.03), min_ms=approx(0.03))
    assert got["reduce_scatter"] == dict(busy_ms=approx(0.005), exposed_ms=approx(0.005), calls=0.5,
                                         median_ms=approx(0.01), min_ms=approx(0.01))
    assert got["all_reduce"] == dict(busy_ms=0.0, exposed_ms=0.0, calls=0.0, median_ms=0.0, min_ms=0.0)
    assert got["top_kernels"] == [["gemm", approx(0.05), 0.5]]  # compute kernels only (memcpy is not a kernel)
    assert (got["host_syncs"], got["host_sync_ms"]) == approx((1.0, 0.021))
    # the CPU ops around each sync, outermost first (a sync outside every op has none)
    assert got["host_sync_sites"] == {"route > aten::tolist > aten::_local_scalar_dense": 1, "(no CPU op)": 1}


def test_bench_distributed_per_rank_and_contexts(monkeypatch):
    """The straggler view of scripts/bench_distributed.py: nvidia-smi's compute processes mapped to GPU indices
    (by PCI bus id) and to the ranks (by pid), a context on another rank's GPU reported, the per-rank table."""
    import subprocess
    import types

    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_distributed

    smi = {"gpu=index,pci.bus_id": "0, 00000000:18:00.0\n1, 00000000:2A:00.0\n",
           "compute-apps=gpu_bus_id,pid,used_memory,process_name":
               "00000000:18:00.0, 101, 30000, python3\n00000000:18:00.0, 102, 510, python3\n"
               "00000000:2A:00.0, 102, 29000, python3\n00000000:2A:00.0, 777, 300, other, with comma\n"}

    def fake_run(cmd, **kw):
        return types.SimpleNamespace(stdout=smi[cmd[1].removeprefix("--query-")])

    monkeypatch.setattr(subprocess, "run", fake_run)
    ranks = [dict(rank=0, pid=101, device=0, contexts_on=[0]), dict(rank=1, pid=102, device=1, contexts_on=[0, 1])]

    class TwoRanks:  # rank 0 of two, the other rank's answer given
        rank, device, contexts_checked = 0, types.SimpleNamespace(index=0), False

        def gather(self, obj):
            return ranks

    d = TwoRanks()
    got = bench_distributed.gpu_contexts(d)
    assert d.contexts_checked and got["stray"] == ["rank 1 on GPU 0"]
    assert got["nvidia_smi"] == [dict(gpu=0, pid=101, used_MiB=30000, name="python3", rank=0),
                                 dict(gpu=0, pid=102, used_MiB=510, name="python3", rank=1),
                                 dict(gpu=1, pid=102, used_MiB=29000, name="python3", rank=1),
                                 dict(gpu=1, pid=777, used_MiB=300, name="other, with comma", rank="other")]
    row = dict(row="ours[fixed]", gpus=2, gpu_contexts=got,
               per_rank=[dict(rank=0, enqueue_ms=190.0, step_ms=200.0, cuda_mallocs=0, cuda_frees=0, alloc_retries=0),
                         dict(rank=1, enqueue_ms=60.5, step_ms=199.0, cuda_mallocs=2, cuda_frees=1, alloc_retries=1)])
    text = "\n".join(bench_distributed.per_rank_lines([row]))
    assert "| ours[fixed] | 2 | 0 | 190.0 | 200.0 | 0 / 0 / 0 |" in text
    assert "| ours[fixed] | 2 | 1 | 60.5 | 199.0 | 2 / 1 / 1 |" in text
    assert "on another rank's GPU: rank 1 on GPU 0" in text and "GPU 0: rank 1 (pid 102, 510 MiB)" in text
    assert "GPU 1: other (pid 777, 300 MiB)" in text

    def failing_run(cmd, **kw):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(subprocess, "run", failing_run)
    assert bench_distributed.nvidia_smi_apps() == ["nvidia-smi: FileNotFoundError: nvidia-smi"]


def test_checkpoint_without_routed_experts(tmp_path):
    """bench.ensure_model(routed_experts=False) saves every weight but the routed experts; after loading it, HF and
    the kernelized model (whose experts Layout transformers' init skips: garbage without init_routed_experts) get
    the same experts from init_routed_experts, at transformers' scale, and the same loss."""
    import types

    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from hubfuse import KernelConfig, presets
    from tests import utils

    bench = _bench_module()
    args = types.SimpleNamespace(smoke=True, layers=2, batch=None, seq=None)
    bench.ensure_model("qwen3_30b_a3b", tmp_path, args, "cpu", routed_experts=False)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert keys and not any(".experts." in k for k in keys)  # (saved in the per-expert layout of the checkpoints)
    assert "model.layers.1.mlp.gate.weight" in keys and "lm_head.weight" in keys
    utils.register_local_kernels(*presets.kernel_repos("qwen3_moe"))
    cfg = bench.slice_config("qwen3_30b_a3b", 2, True)
    batch = utils.make_batch(cfg.vocab_size, batch=2, seq=16)
    experts, losses = {}, {}
    for config in ("hf", "ours"):
        kw = {} if config == "hf" else dict(use_kernels=True, kernel_config=KernelConfig(
            presets.kernel_mapping("qwen3_moe", revision="v1")))
        model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, **kw)
        bench.init_routed_experts(model, cfg.initializer_range)
        experts[config] = {n: p.detach().clone() for n, p in model.named_parameters() if bench.is_routed_expert(n)}
        assert len(experts[config]) == 4
        for n, p in model.named_parameters():
            assert torch.isfinite(p).all(), (config, n)
        losses[config] = model(**batch).loss.item()
    for n, p in experts["hf"].items():
        torch.testing.assert_close(experts["ours"][n], p, rtol=0, atol=0)
        assert abs(p.std().item() - cfg.initializer_range) < 0.1 * cfg.initializer_range, n
    assert len({p.flatten()[:8].tolist().__repr__() for p in experts["hf"].values()}) == 4  # a seed per parameter
    assert abs(losses["ours"] - losses["hf"]) < 1e-3
    built = (tmp_path / "model.safetensors").stat().st_mtime_ns
    bench.ensure_model("qwen3_30b_a3b", tmp_path, args, "cpu", routed_experts=False)  # the same: kept
    assert (tmp_path / "model.safetensors").stat().st_mtime_ns == built
    bench.ensure_model("qwen3_30b_a3b", tmp_path, args, "cpu")  # with the experts: rebuilt
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert any(".experts." in k for k in f.keys())


def test_bench_interleaved_smoke():
    """scripts/bench_interleaved.py on CPU: the configurations' steps interleaved in one process, one table row each."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_interleaved.py"), "ours", "ours_modules",
                           "eager", "--smoke", "--slice", "qwen3_small", "--rounds", "2", "--warmup", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r.split("|")[1].strip() for r in rows] == ["ours", "ours_modules", "eager"], proc.stdout
    for r in rows:
        median, low, high, speed = (float(c) for c in r.split("|")[2:6])
        assert 0 < low <= median <= high and speed > 0, r
        gc_ms, collections, gen2 = re.fullmatch(r"([\d.]+) \((\d+), (\d+)\)", r.split("|")[6].strip()).groups()
        assert float(gc_ms) >= 0 and int(collections) >= int(gen2) >= 0, r
    assert rows[0].split("|")[5].strip() == "1.000"
