#!/usr/bin/env bash
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OUT="${OUT:-$PWD/out}"
bash scripts/gpu_check.sh setup >"$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD/torch-ext TRITON_CACHE_AUTOTUNING=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 110 python scripts/sweep_gated_delta_net.py --workloads layer long mid --variants base wu:split=1 > "$OUT/sweep_r1.log" 2>&1
grep -v -i warn "$OUT/sweep_r1.log" | grep -E " gpu |error" | cut -c1-230 | tee -a "$OUT/sweep.txt"
