#!/usr/bin/env bash
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OUT="${OUT:-$PWD/out}"
bash scripts/gpu_check.sh setup >"$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD/torch-ext HUBFUSE_FLA_SITE=/tmp/site_fla TRITON_CACHE_AUTOTUNING=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 230 python -m pytest -q -p no:cacheprovider --tb=short -rf kernel_repos/gated-delta-net/tests -k "full_chunk or gpu_bf16 or recurrence_launch" > "$OUT/kernels.log" 2>&1
grep -E "^FAILED|^E |passed|failed" "$OUT/kernels.log" | tail -6; tail -c 300 "$OUT/kernels.log"
timeout 130 python scripts/sweep_gated_delta_net.py --workloads long mid --variants base wu:num_warps=8 wu:block_v=64 wu:block_v=64,num_stages=2 recurrence:num_stages=2 recurrence:num_warps_few=8 > "$OUT/sweep_r1.log" 2>&1
grep -v -i warn "$OUT/sweep_r1.log" | grep -E " gpu |error" | cut -c1-230 | tee -a "$OUT/sweep.txt"
