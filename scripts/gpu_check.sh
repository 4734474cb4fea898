#!/usr/bin/env bash
# The whole GPU check in one call (device tool): install carried wheels, build, GPU tests, side-by-side bench.
#   bash scripts/gpu_check.sh [tests] [bench [case ...]]     (default: tests and every bench case)
#   bash scripts/gpu_check.sh e2e [bench.py args ...]        (issue 8: training-step benchmark of the model
#        slices, then `kernels benchmark` on every repo; BENCH_BUDGET_S caps bench.py, default 420 s;
#        KERNELS_BENCH=0 skips `kernels benchmark`)
#   bash scripts/gpu_check.sh dist [bench_distributed.py args ...]   (issue 29: FSDP2 + EP throughput of
#        Qwen3-30B-A3B; NPROC=1 (default) runs the --single-gpu proxy, NPROC=N torchrun on N GPUs)
#   BUILD_REPOS, TEST_PATHS, MODEL_TEST_PATHS narrow the builds and the kernel / model test selection.
# Carry `.whl` (transformers 5.22.2, kernels 0.17.2, liger-kernel 0.8.5, tabulate wheels; see docs/benchmarks.md).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD/torch-ext${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers, kernels; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'kernels', kernels.__version__)"
python3 scripts/build.py ${BUILD_REPOS:-} || exit 1
mode="${1:-all}"; shift || true
status=0
if [ "$mode" = all ] || [ "$mode" = tests ]; then
  # kernel numerics run on CUDA at every shape (no interpreter); model tests: the gpu-marked ones.
  # One pytest process per kernel repo and one for the models, in parallel: the small-shape tests are
  # bound by Triton compilation (CPU), not by the GPU. TEST_TIMEOUT (s) caps each process.
  logs=$(mktemp -d); pids=()
  for path in ${TEST_PATHS:-kernel_repos/*}; do
    timeout "${TEST_TIMEOUT:-900}" python3 -m pytest -q -p no:cacheprovider "$path" >"$logs/$(basename "$path").log" 2>&1 &
    pids+=($!)
  done
  timeout "${TEST_TIMEOUT:-900}" python3 -m pytest -q -p no:cacheprovider -m gpu ${MODEL_TEST_PATHS:-tests} \
    >"$logs/models.log" 2>&1 & pids+=($!)
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  for f in "$logs"/*.log; do echo "=== $(basename "$f" .log)"; cat "$f"; done >"$OUT/gpu_tests.log"
  for f in "$logs"/*.log; do echo "=== $(basename "$f" .log)"; grep -E "^(FAILED|ERROR)|passed|failed|error" "$f" | tail -n 15; done
  [ "$mode" = tests ] && [ "${1:-}" = bench ] && { mode=bench; shift; }
fi
if [ "$mode" = all ] || [ "$mode" = bench ]; then
  python3 scripts/bench_ops.py "$@" 2>&1 | tee "$OUT/bench_ops.log" | grep -v "^{" || status=1
fi
if [ "$mode" = e2e ]; then
  python3 scripts/bench.py --budget-s "${BENCH_BUDGET_S:-420}" "$@" 2>&1 | tee "$OUT/bench_train.log" | tail -n 40 || status=1
  if [ "${KERNELS_BENCH:-1}" = 1 ]; then
    timeout 150 python3 scripts/kernels_benchmark.py --iterations 50 --warmup 5 >/dev/null 2>&1 || status=1
    tail -n 3 "$OUT/kernels_benchmark.log" 2>/dev/null
  fi
fi
if [ "$mode" = dist ]; then
  if [ "${NPROC:-1}" = 1 ]; then
    python3 scripts/bench_distributed.py --single-gpu "$@"
  else
    python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC" scripts/bench_distributed.py "$@"
  fi 2>&1 | tee "$OUT/bench_distributed.log" | grep -v "^\[.*\] \(warm-up\|step\)" | tail -n 30
  status=${PIPESTATUS[0]}
fi
exit $status
