#!/usr/bin/env bash
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OUT="${OUT:-$PWD/out}"
bash scripts/gpu_check.sh setup >"$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD/torch-ext HUBFUSE_FLA_SITE=/tmp/site_fla TRITON_CACHE_AUTOTUNING=1
nvidia-smi --query-gpu=name --format=csv,noheader
for r in 1 2; do
  timeout 220 python scripts/sweep_gated_delta_net.py --workloads layer long packed --variants base recurrence:form_m=0 recurrence:fuse_u=1 recurrence:form_m=0,fuse_u=1 > "$OUT/sweep_r$r.log" 2>&1
  grep -v -i warn "$OUT/sweep_r$r.log" | grep " gpu " | sed "s/^/r$r /" | cut -c1-300 | tee -a "$OUT/sweep.txt"
done
timeout 120 python -m pytest -q -p no:cacheprovider --tb=short -rf kernel_repos/gated-delta-net/tests -k "recurrence_variants" > "$OUT/variants.log" 2>&1
grep -E "^FAILED|^E |passed|failed" "$OUT/variants.log" | tail -6
