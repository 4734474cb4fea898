#!/usr/bin/env bash
# The gated-delta-net GPU check in one device call: build, the repo's tests on CUDA (two pytest processes in
# the background: they are bound by Triton compilation on the CPU), then the probe (timings, per-kernel times,
# accuracy vs float64, launch-settings sweep, transformers' torch path, FLA) and optionally bench_ops.
#   bash scripts/gpu_gated_delta_net.sh [probe sections] [bench]
# PROBE_BUDGET (s, default 330) caps the probe; TEST_TIMEOUT (s, default 420) each test process.
# Expects PYTHONPATH to hold the carried wheels (transformers 5.22.2, kernels 0.17.2, FLA 0.6.0) and torch-ext.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton, transformers, kernels; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'kernels', kernels.__version__)"
python3 scripts/build.py gated-delta-net >"$OUT/build.log" 2>&1 || { cat "$OUT/build.log"; exit 1; }
logs=$(mktemp -d)
t=kernel_repos/gated-delta-net
# kernel_repos/conftest.py re-assembles .staged/ at every session start: start the processes 20 s apart (the
# first has imported every module of the package by then)
run_tests() {
  local pids=() status=0
  for sel in "gpu" "not gpu"; do
    name=$(echo "$sel" | cut -c1-12 | tr -c 'a-z0-9\n' '_')
    timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider "$t" -k "$sel" >"$logs/$name.log" 2>&1 &
    pids+=($!)
    sleep 20
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  return $status
}
run_tests & tests_pid=$!
python3 scripts/probe_gated_delta_net.py --budget "${PROBE_BUDGET:-330}" ${1:+--sections "$1"} 2>&1 | tee "$OUT/probe.log" | grep -v "^{" | tail -n 60
if [ "${2:-}" = bench ]; then python3 scripts/bench_ops.py gated_delta_net 2>&1 | tee "$OUT/bench_ops.log" | grep -v "^{"; fi
status=0
wait "$tests_pid" || status=1
for f in "$logs"/*.log; do echo "=== $(basename "$f" .log)"; cat "$f"; done >"$OUT/gpu_tests.log"
for f in "$logs"/*.log; do echo "=== $(basename "$f" .log)"; grep -E "^(FAILED|ERROR)|passed|failed|error|Error" "$f" | tail -n 12; done
exit $status
