#!/usr/bin/env bash
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OUT="${OUT:-$PWD/out}"
bash scripts/gpu_check.sh setup >"$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD/torch-ext HUBFUSE_FLA_SITE=/tmp/site_fla TRITON_CACHE_AUTOTUNING=1
nvidia-smi --query-gpu=name --format=csv,noheader
for r in 1 2; do
  timeout 200 python scripts/sweep_gated_delta_net.py --workloads long mid --variants base recurrence:block_v_few=16 recurrence:block_v_few=16,num_warps_few=2 recurrence:num_warps_few=2 recurrence:block_v_few=16,num_warps_few=8 > "$OUT/sweep_r$r.log" 2>&1
  grep -v -i warn "$OUT/sweep_r$r.log" | grep -E " gpu |error" | sed "s/^/r$r /" | cut -c1-220 | tee -a "$OUT/sweep.txt"
done
