#!/usr/bin/env bash
# The check on a 4-GPU machine (device tool kinds nvidia-h100-x4 / nvidia-h200-x4): two calls on one warm machine.
#   bash scripts/gpu_x4.sh scale [part ...]   FSDP2 + expert parallelism on all four GPUs (gpu_check.sh scale)
#   bash scripts/gpu_x4.sh ab [args]          scripts/bench_distributed.py on all four GPUs with the same args,
#                                             OLD_TREE first, then this tree (same machine, one after the other)
#   bash scripts/gpu_x4.sh single   four one-GPU jobs side by side, one per GPU, each comparing its configurations
#                                   on its own GPU: the dense step (gpu_check.sh dense), the GPU tests, the bitwise
#                                   A/B against OLD_TREE then the gated-delta-net op case, the Qwen3.5-MoE step
#                                   against HF + FLA (+ Liger)
# Carry `.whl` (gpu_check.sh's header lists the wheels) and, for the A/B, OLD_TREE (default `.old`, a `git archive`
# of the tree to compare with, git-ignored). Logs and tables: $OUT/x4_<step>.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OUT="${OUT:-$PWD/out}" NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
mkdir -p "$OUT"
bash scripts/gpu_check.sh setup || exit 1
step="${1:-single}"
work="/tmp/x4_$step"; rm -rf "$work"; mkdir -p "$work"
case "$step" in
  scale)
    shift; OUT="$work" NPROC=4 bash scripts/gpu_check.sh scale "$@"; status=$? ;;
  ab)
    shift; old="${OLD_TREE:-.old}"; status=0
    [ -e "$old/.whl" ] || ln -s "$PWD/.whl" "$old/.whl"
    for tree in "$old" .; do
      name=$([ "$tree" = . ] && echo new || echo old); echo "=== $name ($tree): bench_distributed.py $*"
      ( cd "$tree" && OUT="$work/$name" NPROC=4 NCCL_NVLS_ENABLE=0 bash scripts/gpu_check.sh dist "$@" ) || status=1
    done ;;
  single)
    job() {  # gpu name command...: the job's output in $work/<name>.log, its files in $work/<name>/
      local gpu="$1" name="$2"; shift 2
      ( export CUDA_VISIBLE_DEVICES="$gpu" OUT="$work/$name"; mkdir -p "$OUT"
        timeout --kill-after=15 "${X4_JOB_S:-520}" "$@" >"$work/$name.log" 2>&1; echo "=== exit $?" >>"$work/$name.log" ) &
    }
    job 0 dense env DENSE_PEERS_S="${DENSE_PEERS_S:-250}" DENSE_ATTN_S="${DENSE_ATTN_S:-90}" \
      DENSE_MOE_S="${DENSE_MOE_S:-140}" bash scripts/gpu_check.sh dense
    job 1 tests env TEST_TIMEOUT="${TEST_TIMEOUT:-480}" bash scripts/gpu_check.sh tests
    job 2 ab bash -c "bash scripts/gpu_check.sh ab '${OLD_TREE:-.old}'; bash scripts/gpu_check.sh ops gated_delta_net"
    job 3 qwen35 bash scripts/gpu_check.sh train --slices qwen3_5_moe --configs ours ours_graph liger_fla fla \
      --budget-s 470 --no-plots
    wait; status=0
    for name in tests ab qwen35 dense; do
      echo "=== $name"; grep -vE "^\s*$|warm-up|^\[.*\] step" "$work/$name.log" | tail -n 30
    done ;;
  *) echo "gpu_x4.sh: unknown step '$step' (scale, ab, single)" >&2; exit 2 ;;
esac
tar czf "$OUT/x4_$step.tgz" -C "$work" .
exit "$status"
