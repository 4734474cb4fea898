#!/usr/bin/env bash
# The whole GPU check in one call (device tool): install carried wheels, build, GPU tests, side-by-side bench.
#   bash scripts/gpu_check.sh [tests] [bench [case ...]]     (default: tests and every bench case)
#   BUILD_REPOS, TEST_PATHS, MODEL_TEST_PATHS narrow the builds and the kernel / model test selection.
# Carry `.whl` (transformers 5.22.2, kernels 0.17.2, liger-kernel 0.8.5 wheels; see docs/benchmarks.md).
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
  # kernel numerics run on CUDA at every shape (no interpreter); model tests: the gpu-marked ones
  python3 -m pytest -q --timeout=600 ${TEST_PATHS:-kernel_repos} 2>&1 | tee "$OUT/gpu_tests_kernels.log" | tail -n 40 || status=1
  python3 -m pytest -q -m gpu ${MODEL_TEST_PATHS:-tests} 2>&1 | tee "$OUT/gpu_tests_models.log" | tail -n 40 || status=1
  [ "$mode" = tests ] && [ "${1:-}" = bench ] && { mode=bench; shift; }
fi
if [ "$mode" = all ] || [ "$mode" = bench ]; then
  python3 scripts/bench_ops.py "$@" 2>&1 | tee "$OUT/bench_ops.log" | grep -v "^{" || status=1
fi
exit $status
