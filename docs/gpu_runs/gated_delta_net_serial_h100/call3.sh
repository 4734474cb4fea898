#!/usr/bin/env bash
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OUT="${OUT:-$PWD/out}"
bash scripts/gpu_check.sh setup >"$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD/torch-ext HUBFUSE_FLA_SITE=/tmp/site_fla TRITON_CACHE_AUTOTUNING=1
nvidia-smi --query-gpu=name --format=csv,noheader
for r in 1 2; do
  timeout 150 python scripts/sweep_gated_delta_net.py --workloads layer long mid packed --variants base recurrence:unmasked=0 > "$OUT/sweep_r$r.log" 2>&1
  grep -v -i warn "$OUT/sweep_r$r.log" | grep -E " gpu |error" | sed "s/^/r$r /" | cut -c1-230 | tee -a "$OUT/sweep.txt"
done
(timeout 80 python .jobs/fla_prof.py 1x32768 2x8192 > "$OUT/fla_prof.log" 2>&1; grep -v -i warn "$OUT/fla_prof.log" | grep GPU | cut -c1-200)
timeout 170 python -m pytest -q -p no:cacheprovider --tb=short -rf kernel_repos/gated-delta-net/tests -k "full_chunk or gpu_bf16 or (rule_vs_float64 and not one-grads and not case4)" > "$OUT/kernels.log" 2>&1
grep -E "^FAILED|^E |passed|failed" "$OUT/kernels.log" | tail -6; tail -c 300 "$OUT/kernels.log"
