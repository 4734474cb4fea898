#!/usr/bin/env bash
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OUT="${OUT:-$PWD/out}"
bash scripts/gpu_check.sh setup >"$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD/torch-ext HUBFUSE_FLA_SITE=/tmp/site_fla TRITON_CACHE_AUTOTUNING=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python scripts/sweep_gated_delta_net.py --workloads layer long mid packed --variants base recurrence:bwd_stages_waves=2 > "$OUT/sweep_r1.log" 2>&1
grep -v -i warn "$OUT/sweep_r1.log" | grep -E " gpu |error" | cut -c1-230 | tee -a "$OUT/sweep.txt"
(timeout 80 python .jobs/fla_prof.py 1x32768 2x8192 > "$OUT/fla_prof.log" 2>&1; grep -v -i warn "$OUT/fla_prof.log" | grep GPU | cut -c1-200)
(GDN_VARIANT=recurrence:bwd_stages_waves=2 timeout 80 python .jobs/fla_prof.py 2x8192 > "$OUT/fla_prof_variant.log" 2>&1; grep -v -i warn "$OUT/fla_prof_variant.log" | grep -E "GPU|variant" | cut -c1-200)
