#!/usr/bin/env bash
# The GPU check (device tool), one step per call of this script; several calls share one wheel install.
#   bash scripts/gpu_check.sh setup                  install the carried wheels, build every repo, print versions
#   bash scripts/gpu_check.sh autotune-save          Triton's autotuning results of this machine into
#                                                    $OUT/autotune/<GPU>.tgz; put it in .whl/autotune/ and later
#                                                    calls start from them (FLA's peers then fit their slots)
#   bash scripts/gpu_check.sh tests                  GPU tests: every kernel repo (all shapes on CUDA) and the
#                                                    gpu-marked model tests, one pytest process each, in parallel
#                                                    (the bad-input matrix's GPU cells in one of their own, -v;
#                                                    the real-width Gated DeltaNet gradient test, ~210 s alone on
#                                                    an H200, in another). With pytest-xdist (carried in .whl) the
#                                                    whole run takes ~550 s on one H200: TEST_TIMEOUT=560 fits a
#                                                    600 s call; without it split the run with TEST_PATHS /
#                                                    MODEL_TEST_PATHS
#   bash scripts/gpu_check.sh ab OLD_TREE [case ...] bitwise A/B: every hubfuse row of bench_ops on fixed inputs,
#                                                    this tree against OLD_TREE (another checkout)
#   bash scripts/gpu_check.sh ops [case ...]         bench_ops: per-op side by side with the peers
#   bash scripts/gpu_check.sh train [bench.py args]  the training-step benchmark (scripts/bench.py)
#   bash scripts/gpu_check.sh dense [PART [args]]    dense models, every configuration in one call (~9 min, one
#                                                    GPU): Qwen3-0.6B with every peer and hubfuse mode (peers), its
#                                                    SDPA backends flash / cudnn / efficient, eager and graph
#                                                    replay, with per-kernel tables (attn), the Qwen3-30B-A3B
#                                                    8-layer slice (moe), then the compact table (report). PART
#                                                    runs one of them, args going to its bench.py (e.g. `dense
#                                                    peers --configs ours_compile`); rows add up in $OUT/dense.
#                                                    A part stops launching runs after its budget (DENSE_PEERS_S,
#                                                    DENSE_ATTN_S, DENSE_MOE_S seconds); rows left say so.
#   bash scripts/gpu_check.sh interleaved [args]     training steps of several configurations in one process,
#                                                    interleaved (scripts/bench_interleaved.py; e.g. `interleaved
#                                                    ours ours_modules compile`)
#   bash scripts/gpu_check.sh host [args]            host time and launches of one Qwen3-0.6B decoder layer, fwd and
#                                                    bwd, HF against hubfuse (scripts/host_per_layer.py; e.g.
#                                                    `host --configs eager ours ours@cudnn ours@flash --table 25`)
#   bash scripts/gpu_check.sh sweep [args]           per-kernel GPU time of the Gated DeltaNet kernels for each launch
#                                                    setting (scripts/sweep_gated_delta_net.py)
#   bash scripts/gpu_check.sh gdn                    the Gated DeltaNet check (~8 min): kernel + GPU model tests, then
#                                                    the sweep's base row and bench_ops gated_delta_net (with FLA)
#   bash scripts/gpu_check.sh kernels-benchmark      `kernels benchmark` over every repo
#   bash scripts/gpu_check.sh demo                   scripts/demo.py
#   bash scripts/gpu_check.sh adamw [args]           hubfuse.optim.AdamW: its GPU tests, then the optimizer step alone
#                                                    against torch's (scripts/bench_adamw.py; e.g. `adamw --optimizers
#                                                    torch_fused hubfuse hubfuse:2048x4`)
#   bash scripts/gpu_check.sh dist [args]            Qwen3-30B-A3B under FSDP2 + EP (scripts/bench_distributed.py):
#                                                    NPROC=1 (default) the --single-gpu proxy, NPROC=N torchrun
#   bash scripts/gpu_check.sh scale [part ...]       issue 34 on NPROC (default 4) GPUs, one command, each part with
#                                                    its own timeout (T_SLICE8 200, T_QWEN35 160, T_DEEP 200 s) within
#                                                    SCALE_BUDGET_S (default 500 s): slice8 (8 layers: HF, ours
#                                                    sharded by transformers and by hubfuse (ours_fsdp, with 8
#                                                    decoder layers per FSDP unit, the embedding in FSDP or
#                                                    row-sharded by shard_embedding, reshard after forward or
#                                                    not), then the
#                                                    1-GPU reference, every row profiled and also timed back to
#                                                    back (--back-to-back), traces in
#                                                    $OUT/traces; SLICE8_ARGS adds bench args, e.g. --ep-dispatch
#                                                    fixed fixed2 --fsdp default prefetch2), qwen35 (Qwen3.5-MoE,
#                                                    8 layers, the same three configs, the embedding both ways),
#                                                    deep (48 layers: hubfuse sharding above 100 GB a GPU (8
#                                                    layers per FSDP unit, shard_embedding, no reshard,
#                                                    expandable segments), else transformers' with
#                                                    per-layer AC; DEEP_ARGS adds bench args), titan
#                                                    (torchtitan 0.3.0 from .whl/titan/*.whl, if this torch can);
#                                                    ep, only when named (T_EP 200 s): the NCCL test of the chunked
#                                                    EP exchange, one layer's experts timed by chunk count
# Carry `.whl` (the device image's Python 3.12), made with:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     transformers==5.22.2 kernels==0.17.2 liger-kernel==0.8.5 tabulate tomlkit \
#     flash-linear-attention==0.6.0 fla-core==0.6.0 pytest-xdist execnet
# (`kernels benchmark` also needs sigstore, cryptography, cffi, pycparser). Logs go to $OUT (default ./out).
# TEST_PATHS / MODEL_TEST_PATHS narrow the test selection, TEST_TIMEOUT (s) caps each pytest process: at the cap
# pytest is interrupted (SIGINT), so its log still ends with the summary of what ran and names each failure;
# TEST_CASE_TIMEOUT (s, where pytest-timeout is installed) fails a single test that overruns, with every
# thread's stack in the log (a hang shows where it waits).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
# run_pytest LIMIT LOG ARGS...: pytest capped at LIMIT seconds (SIGINT first: the log keeps pytest's summary), -rfE
run_pytest() {
  local limit="$1" log="$2"; shift 2
  local per_test=()
  if [ -n "${TEST_CASE_TIMEOUT:-}" ] && python3 -c "import pytest_timeout" 2>/dev/null; then
    per_test=(--timeout "$TEST_CASE_TIMEOUT" --timeout-method thread)
  fi
  timeout -s INT -k 30 "$limit" python3 -m pytest -p no:cacheprovider -rfE "${per_test[@]}" "$@" >"$log" 2>&1
}
if [ -d .whl ]; then
  if [ ! -f /tmp/site/.hubfuse_wheels ]; then
    # flash-linear-attention stays out of the common site: with it installed transformers runs FLA's gated delta
    # rule for Qwen3.5, whose backward refuses triton < 3.7.1 on Hopper; the gated-delta-net bench imports it
    # from /tmp/site_fla (HUBFUSE_FLA_SITE) as a timing peer
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      $(ls .whl/*.whl | grep -v -e flash_linear_attention -e fla_core) || exit 1
    if ls .whl/fla_core*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_fla \
        .whl/fla_core*.whl .whl/flash_linear_attention*.whl || exit 1
    fi
    touch /tmp/site/.hubfuse_wheels
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
  fi
  export PYTHONPATH="/tmp/site:$PWD/torch-ext${PYTHONPATH:+:$PYTHONPATH}" HUBFUSE_FLA_SITE=/tmp/site_fla
fi
# Triton autotuning results kept on disk (FLA's kernels autotune for minutes at each new shape, longer than a
# peer's time slot): those of earlier calls on the same GPU model come back from .whl/autotune/<GPU>.tgz (made by
# the autotune-save step, carried with .whl); only the timings, the chosen configs still compile here
export TRITON_CACHE_AUTOTUNING=1
triton_cache="${TRITON_CACHE_DIR:-$HOME/.triton/cache}"
gpu_model="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr -c 'A-Za-z0-9\n' '_')"
gpu_model="${gpu_model:-no_gpu}"
if [ -n "$gpu_model" ] && [ -f ".whl/autotune/$gpu_model.tgz" ] && [ ! -f "$triton_cache/.hubfuse_autotune" ]; then
  mkdir -p "$triton_cache" && tar xzf ".whl/autotune/$gpu_model.tgz" -C "$triton_cache" && touch "$triton_cache/.hubfuse_autotune"
fi
step="${1:-tests}"; shift || true
python3 scripts/build.py >/dev/null || exit 1
case "$step" in
  autotune-save)  # this machine's autotuning results -> $OUT/autotune/<GPU>.tgz (put it in .whl/autotune/)
    mkdir -p "$OUT/autotune"
    (cd "$triton_cache" && find . -name '*.autotune.json' -print0 | tar czf "$OUT/autotune/$gpu_model.tgz" --null -T -)
    echo "$(tar tzf "$OUT/autotune/$gpu_model.tgz" | wc -l) autotuning results -> $OUT/autotune/$gpu_model.tgz" ;;
  setup)
    python3 -c "import torch, triton, transformers, kernels; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'kernels', kernels.__version__)" ;;
  tests)
    logs=$(mktemp -d); pids=(); status=0
    limit="${TEST_TIMEOUT:-600}"
    # the gated-delta-net repo, the model tests and the matrix are compile-bound (~25 s a gated-delta-net case on
    # an H200 host): their cases over pytest-xdist workers where xdist is installed (GDN_WORKERS, MODEL_WORKERS,
    # MATRIX_WORKERS), on the cores the other repos leave once they are done. Under xdist the matrix writes no
    # report file (its cells run in the workers); its log still has a line a cell
    gdn_workers=(); model_workers=(); matrix_workers=()
    if python3 -c "import xdist" 2>/dev/null; then
      gdn_workers=(-n "${GDN_WORKERS:-8}"); model_workers=(-n "${MODEL_WORKERS:-4}")
      matrix_workers=(-n "${MATRIX_WORKERS:-6}")
    fi
    for path in ${TEST_PATHS:-$(ls -d kernel_repos/*/tests | sed "s|/tests$|/|")}; do
      workers=()
      case "$path" in *gated-delta-net*) workers=("${gdn_workers[@]}") ;; esac
      run_pytest "$limit" "$logs/$(basename "$path").log" -q "${workers[@]}" "$path" & pids+=($!)
    done
    if [ -n "${MODEL_TEST_PATHS:-}" ]; then
      run_pytest "$limit" "$logs/models.log" -q "${model_workers[@]}" -m gpu $MODEL_TEST_PATHS & pids+=($!)
    else
      # the bad-input matrix's ~2,000 GPU cells in a process of their own, one line per cell; the real-width
      # gradient test in another (-s: its ratio tables); the other gpu-marked model tests beside them
      real_width=tests/test_gated_delta_net_models.py::test_gradients_at_real_widths_as_accurate_as_eager
      run_pytest "$limit" "$logs/models.log" -q "${model_workers[@]}" -m gpu tests \
        --deselect tests/test_bad_input_matrix.py --deselect "$real_width" & pids+=($!)
      run_pytest "$limit" "$logs/real_width.log" -q -s -m gpu "$real_width" & pids+=($!)
      run_pytest "$limit" "$logs/matrix.log" -v "${matrix_workers[@]}" -m gpu tests/test_bad_input_matrix.py & pids+=($!)
    fi
    for pid in "${pids[@]}"; do wait "$pid" || status=1; done
    for f in "$logs"/*.log; do echo "=== $(basename "$f" .log)"; cat "$f"; echo; done >"$OUT/gpu_tests.log"
    for f in "$logs"/*.log; do
      echo "=== $(basename "$f" .log)"
      grep -E "^(FAILED|ERROR)| FAILED| ERROR|passed|failed|error|KeyboardInterrupt|Timeout|over batches" "$f" | tail -n 15
    done
    exit $status ;;
  ab)
    old="$1"; shift
    python3 scripts/bench_ops.py --fingerprint "$OUT/ab_new.json" "$@" >"$OUT/ab_new.log" 2>&1 &
    python3 scripts/bench_ops.py --fingerprint "$OUT/ab_old.json" --root "$old" "$@" >"$OUT/ab_old.log" 2>&1
    wait
    tail -n 1 "$OUT/ab_old.log" "$OUT/ab_new.log"
    python3 scripts/bench_ops.py --compare "$OUT/ab_old.json" "$OUT/ab_new.json" ;;
  ops)
    python3 scripts/bench_ops.py "$@" 2>&1 | tee "$OUT/bench_ops.log" | grep -v "^{" ;;
  train)
    python3 scripts/bench.py "$@" 2>&1 | tee "$OUT/bench_train.log" | grep -v "^\s*$" | tail -n 60 ;;
  dense)
    part="${1:-all}"; shift || true
    dense_out="$OUT/dense"; mkdir -p "$dense_out"
    [ "$part" = all ] && rm -f "$dense_out/bench_train.json"
    common=(--out "$dense_out" --model-dir /tmp/hubfuse_dense_models --no-plots --append --steps 10 --warmup 3
            --host-steps 3 --profile-steps 2)
    run_part() {  # name, then bench.py args; progress lines only (the whole log: $OUT/dense.log)
      echo "=== dense $1 ($(date +%T))"; shift
      python3 scripts/bench.py "${common[@]}" "$@" 2>&1 | tee -a "$OUT/dense.log" |
        grep -E "^\(|TIMEOUT|dynamo:|\] (ok|error|oom):"
    }
    status=0
    if [ "$part" = all ] || [ "$part" = peers ]; then
      run_part "peers: Qwen3-0.6B, every configuration" --slices qwen3_0_6b --budget-s "${DENSE_PEERS_S:-270}" \
        "$@" || status=1
    fi
    if [ "$part" = all ] || [ "$part" = attn ]; then
      run_part "attn: Qwen3-0.6B, SDPA backends, eager and graph replay" --slices qwen3_0_6b --configs ours ours_graph \
        --sdpa-backends flash cudnn efficient --budget-s "${DENSE_ATTN_S:-90}" "$@" || status=1
    fi
    if [ "$part" = all ] || [ "$part" = moe ]; then
      run_part "moe: Qwen3-30B-A3B widths, 8 layers" --slices qwen3_30b_a3b_8l --configs ours ours_graph compile \
        --budget-s "${DENSE_MOE_S:-150}" "$@" || status=1
    fi
    echo "=== dense report ($(date +%T))"
    python3 scripts/bench.py --report-only --out "$dense_out" || status=1
    exit $status ;;
  sweep)
    python3 scripts/sweep_gated_delta_net.py "$@" 2>&1 | grep -v -i "warn" ;;
  gdn)
    # the Gated DeltaNet check in one call (~8 min, one GPU): its kernel tests in three pytest processes side by
    # side and its GPU model tests (real-width gradients included; their status is not this step's), then, alone
    # on the GPU, the per-kernel sweep's base row and the bench_ops case against FLA
    logs="$OUT/gdn_tests"; mkdir -p "$logs"; status=0; pids=()
    k=0
    for sel in "rule_vs_float64 or v_blocks or views or gate_parameter or softplus" \
               "conv or decode or cu_seqlens or packed or compile" \
               "fused_core or qwen3_5_gates or output_as_accurate or gpu_bf16 or reference or bad_inputs"; do
      k=$((k + 1))
      run_pytest "${TEST_TIMEOUT:-300}" "$logs/kernels_$k.log" -q --tb=short kernel_repos/gated-delta-net/tests \
        -k "$sel" & pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || status=1; done
    # -s: the real-width gradient test prints its per-batch and three-batch ratio tables
    run_pytest "${TEST_TIMEOUT:-300}" "$logs/models.log" -q -s --tb=short -rA -m gpu tests/test_gated_delta_net_models.py
    for f in "$logs"/*.log; do echo "=== $(basename "$f" .log)"; grep -E "^(FAILED|ERROR)|passed|failed|error|xfail|KeyboardInterrupt|Timeout|over batches|ratio 1\.[1-9]" "$f" | tail -n 12; done
    timeout "${GDN_SWEEP_S:-80}" python3 scripts/sweep_gated_delta_net.py --variants base --workloads layer long dense packed \
      2>&1 | grep -v -i "warn"
    timeout "${GDN_OPS_S:-280}" python3 scripts/bench_ops.py gated_delta_net 2>&1 | tee "$OUT/bench_ops.log" | grep -v "^{"
    exit $status ;;
  interleaved)
    python3 scripts/bench_interleaved.py "$@" 2>&1 | tee "$OUT/interleaved.log" | grep -v "^Loading" | tail -n 20 ;;
  host)
    python3 scripts/host_per_layer.py "$@" 2>&1 | tee "$OUT/host_per_layer.log" | grep -v "^\s*$" | tail -n 120 ;;
  kernels-benchmark)
    timeout 150 python3 scripts/kernels_benchmark.py --iterations 50 --warmup 5 >/dev/null 2>&1
    tail -n 3 "$OUT/kernels_benchmark.log" ;;
  demo)
    python3 scripts/demo.py 2>&1 | tee "$OUT/demo.log" | tail -n 60 ;;
  adamw)
    python3 -m pytest -v -p no:cacheprovider tests/test_optim.py >"$OUT/test_optim.log" 2>&1
    grep -E "FAIL|ERROR|passed|failed" "$OUT/test_optim.log" | tail -n 12
    python3 scripts/bench_adamw.py --out "$OUT" "$@" 2>&1 | tail -n 16 ;;
  dist)
    if [ "${NPROC:-1}" = 1 ]; then
      python3 scripts/bench_distributed.py --single-gpu "$@"
    else
      python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC" scripts/bench_distributed.py "$@"
    fi 2>&1 | tee "$OUT/bench_distributed.log" | grep -v "^\[.*\] \(warm-up\|step\)" | tail -n 30
    exit "${PIPESTATUS[0]}" ;;
  scale)
    # multicast (NVLS) off: see KINDS.md of the device tool
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    nproc="${NPROC:-4}"; budget="${SCALE_BUDGET_S:-500}"; start=$SECONDS; status=0
    parts="${*:-slice8 qwen35 deep titan}"
    torchrun=(python3 -m torch.distributed.run --standalone --nproc-per-node "$nproc")
    bench=("${torchrun[@]}" scripts/bench_distributed.py --ep "$nproc")
    run_part() {  # name timeout_s command...: a part's log in $OUT/scale_<name>.log, its table and verdict here
      local name="$1" limit="$2"; shift 2
      local left=$(( budget - (SECONDS - start) ))
      if [ "$left" -lt 40 ]; then echo "=== $name: skipped (SCALE_BUDGET_S spent)"; return 1; fi
      [ "$limit" -gt "$left" ] && limit="$left"
      echo "=== $name (timeout ${limit} s): $*"
      timeout --kill-after=20 "$limit" "$@" >"$OUT/scale_$name.log" 2>&1
      local rc=$?
      grep -E "^\||^\[.*\] (ok|oom|error)|^bench_|Error|error:|did not run forward|^CUDA contexts|tokens per rank, forward|[0-9]+ (passed|failed)" "$OUT/scale_$name.log" | tail -n 60
      echo "=== $name: exit $rc ($(( SECONDS - start )) s so far)"
      return $rc
    }
    for part in $parts; do
      case "$part" in
        slice8) run_part slice8 "${T_SLICE8:-200}" "${bench[@]}" --layers 8 --one-gpu-reference last --profile 1 \
                  --trace "$OUT/traces" --back-to-back --layers-per-unit 8 --steps 8 --warmup 3 \
                  --head-unit own --embedding fsdp rows --fsdp default noreshard --configs hf ours ours_fsdp \
                  ${SLICE8_ARGS:-} \
                  || status=1 ;;
        ep)     run_part ep "${T_EP:-200}" python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_distributed.py \
                  -k pipelined_exchange_nccl || status=1 ;;
        qwen35) run_part qwen35 "${T_QWEN35:-160}" "${bench[@]}" --model qwen3_5_moe --layers 8 --steps 3 \
                  --warmup 2 --profile 1 --configs hf ours ours_fsdp --embedding fsdp rows || status=1 ;;
        deep)   # within 141 GB (H200): 48 layers sharded by hubfuse (each GPU loads the whole model first), no
          # recompute; within 80 GB: transformers' sharding (each rank reads its shard) and per-layer checkpointing
          if [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -gt 100000 ]; then
            PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}" run_part deep48 \
              "${T_DEEP:-200}" "${bench[@]}" --layers 48 --configs ours_fsdp --steps 5 --warmup 2 \
              --layers-per-unit 8 --embedding rows --fsdp noreshard ${DEEP_ARGS:-}
          else
            false
          fi || run_part deep48ac "${T_DEEP:-200}" "${bench[@]}" --layers 48 --activation-checkpointing \
            --configs ours --steps 2 --warmup 1 || status=1 ;;
        titan)
          if ls .whl/titan/*.whl >/dev/null 2>&1; then
            [ -f /tmp/site_titan/.hubfuse_wheels ] || { python3 -m pip install -q --no-index --no-deps --no-compile \
              --no-cache-dir --target /tmp/site_titan .whl/titan/*.whl && touch /tmp/site_titan/.hubfuse_wheels; }
            site="$PYTHONPATH"; export PYTHONPATH="/tmp/site_titan:$site"
            # --preflight: exit 3 and the reason when this torch lacks what torchtitan 0.3.0 needs (not a failure)
            if python3 scripts/bench_torchtitan.py --preflight 2>&1 | tee "$OUT/scale_titan_preflight.log" | tail -n 3 \
                && [ "${PIPESTATUS[0]}" = 0 ]; then
              run_part titan "${T_TITAN:-120}" "${torchrun[@]}" scripts/bench_torchtitan.py --layers 8 --ep "$nproc" \
                --steps 4 --warmup 3 || status=1
            else
              echo "=== titan: not runnable here (above; $OUT/scale_titan_preflight.log)"
            fi
            export PYTHONPATH="$site"
          else
            echo "=== titan: skipped (no .whl/titan/*.whl)"
          fi ;;
        *) echo "gpu_check.sh scale: unknown part '$part' (slice8 qwen35 deep titan ep)" >&2; status=2 ;;
      esac
    done
    ls "$OUT"/bench_distributed_*.json "$OUT"/bench_torchtitan_*.json 2>/dev/null
    exit $status ;;
  *)
    echo "gpu_check.sh: unknown step '$step' (tests, ab, ops, train, dense, host, kernels-benchmark, demo, dist, scale)" >&2
    exit 2 ;;
esac
