#!/bin/bash
# Issue 8 (runs on 4 and 8 GPUs) in two device calls per machine kind, on every GPU the machine has
# (W = nvidia-smi -L | wc -l; written for any W >= 2, meant for kinds "nvidia-h200-x4" and "-x8").
#
#   bench/gpu_scale.sh [comm]   CuTeDSL bundle; within a ${SCALE_BUDGET_S:-540} s budget, in this order:
#     test_dispatch_combine   tests/gpu/test_comm_dispatch_combine.py at W ranks (bf16 + FP8, eager + graph)
#     bench_dispatch_combine  bench/dispatch_combine.py --world W       item 2: 1/32/128/256 tokens per rank
#     test_allreduce          tests/gpu/test_comm_allreduce.py at W ranks
#     bench_allreduce         bench/allreduce.py --world W, 8 KiB .. 256 MiB vs NCCL and symm-mem   item 1
#     test_parallel_ep        tests/gpu/test_comm_parallel_cuda.py, tests/gpu/test_comm_ep_prefill.py at W
#     bench_ep_prefill        (W >= 4) bench/ep_prefill_layer.py --world 4, TP = EP = 4      item 3, layer
#     decode_step             (W = 8 only) bench/decode_step.py --ep 8, Qwen3-235B-A22B shapes, FP8
#                             experts, 32/64/128 requests per rank, per-GPU HBM roofline, kernel profile at 128     item 4
#   bench/gpu_scale.sh kv       ucxx bundle instead (ucxx and CuTeDSL together exceed the 64 MiB a call
#                               may carry, so the KV handoff is a second call, issued at once after the
#                               first on the same warm machine: the CUDA IPC path's copy kernel is
#                               CuTeDSL, which the first call left in /tmp/gpu-site; it refuses, exit 3,
#                               when that is missing):
#     bench_kv_transfer       bench/kv_transfer.py --prefill-ranks 1,2,4: the 4 TP ranks on GPUs 0-3 ->
#                             the decode rank on GPU 4 (x8; on x4 the decode rank takes GPU 3 and
#                             prefill rank 3 shares GPU 0), 1k/6k/32k tokens, ucx and cuda_ipc paths   item 3, KV
#
# Device calls (after `git rev-parse --short=12 HEAD > .cache/commit` here), one per kind and mode:
#   run kind "nvidia-h200-x8" (or -x4), timeout_s 600, command "bash bench/gpu_scale.sh",
#       carry [".gpu/cutedsl-4.8.1-cp312-cu13.tar.xz", ".cache/commit"]
#   run (same kind, at once: the machine stays warm ~30 s), timeout_s 600, command "bash bench/gpu_scale.sh kv",
#       carry [".gpu/ucxx-nats-cp312-cu13.tar.xz", ".cache/commit"]
# What comes back (a call returns at most 8 files): run.log (one line and a log tail per step),
# logs.tar.gz (every step's whole log) and the benchmarks' *.jsonl: append those to bench/results/ here.
# Each step has a wall limit, cut to what is left of the budget (a step with under 20 s left is not
# run, and says so in run.log), so the call ends inside its 600 s.
#
# Knobs: SCALE_SKIP="name name" skips steps; SCALE_BUDGET_S; SCALE_GPUS overrides W;
# SCALE_DRY_RUN=1 prints the plan (name, limit, command) without a GPU, bundle or $OUT.
cd "$(dirname "$0")/.." || exit 1
MODE=${1:-comm}
case $MODE in comm | kv) ;; *) echo "usage: bench/gpu_scale.sh [comm|kv]" >&2; exit 2 ;; esac
W=${SCALE_GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}
BUDGET_S=${SCALE_BUDGET_S:-540}
if [ "$W" -lt 2 ]; then echo "gpu_scale.sh needs at least 2 GPUs, found $W" >&2; exit 2; fi

if [ -n "$SCALE_DRY_RUN" ]; then
  PYTEST="python3 -m pytest -q -s -ra -p no:cacheprovider"
  step() { echo "STEP $1 $2 ${*:3}"; }
  collect() { :; }
  note() { echo "NOTE $*"; }
else
  # Steps log into a scratch folder; `collect` copies run.log, the results and one archive of the
  # logs into $OUT after every step (a call brings back at most 8 files).
  RESULTS=$OUT
  OUT=/tmp/gpu-scale-out
  rm -rf "$OUT" && mkdir -p "$OUT"
  if [ "$MODE" = kv ]; then
    if [ ! -d /tmp/gpu-site/nvidia_cutlass_dsl ]; then
      echo "NOT WARM: /tmp/gpu-site/nvidia_cutlass_dsl is missing (run 'bash bench/gpu_scale.sh' first, same machine)"; exit 3
    fi
    GPU_BUNDLE=.gpu/ucxx-nats-cp312-cu13.tar.xz
  fi
  source bench/gpu_common.sh
  collect() {
    cp "$OUT"/run.log "$RESULTS"/
    cp "$OUT"/*.jsonl "$RESULTS"/ 2>/dev/null
    (cd "$OUT" && tar czf "$RESULTS/logs.tar.gz" ./*.log)
  }
  note() { echo "=== $*" >> "$OUT/run.log"; }
  note "gpu_scale.sh $MODE: W=$W GPUs, budget ${BUDGET_S}s, skip: ${SCALE_SKIP:-none}"
fi

# run NAME LIMIT_S COMMAND...: `step` with the limit cut to what is left of the budget.
FAILED=""
run() {
  local name=$1 limit=$2 left=$((BUDGET_S - SECONDS))
  shift 2
  case " $SCALE_SKIP " in *" $name "*) note "$name skipped (SCALE_SKIP)"; return 0 ;; esac
  if [ "$left" -lt 20 ]; then note "$name not run: ${left}s left of the ${BUDGET_S}s budget"; return 0; fi
  [ "$limit" -gt "$left" ] && limit=$left
  step "$name" "$limit" "$@" || FAILED="$FAILED $name"
  collect
}

if [ "$MODE" = kv ]; then
  run bench_kv_transfer 420 python3 -m bench.kv_transfer --device cuda --prefill-ranks 1,2,4 \
    --tokens 1024,6144,32768 --prefill-page-size 16 --chunk-mib 256 --iters 3 --overlap-iters 2
else
  run test_dispatch_combine 90 $PYTEST --timeout=80 tests/gpu/test_comm_dispatch_combine.py
  run bench_dispatch_combine 90 python3 -m bench.dispatch_combine --world "$W"
  run test_allreduce 150 $PYTEST --timeout=140 tests/gpu/test_comm_allreduce.py  # 35 s at 4 ranks before the fourth algorithm
  run bench_allreduce 100 python3 -m bench.allreduce --world "$W"
  run test_parallel_ep 60 $PYTEST --timeout=50 tests/gpu/test_comm_parallel_cuda.py tests/gpu/test_comm_ep_prefill.py
  if [ "$W" -ge 4 ]; then
    run bench_ep_prefill 45 python3 -m bench.ep_prefill_layer --world 4
  fi
  # Last: the longest step (compiles, 94 layers); it records each row as measured, so a cut keeps them.
  if [ "$W" -eq 8 ]; then
    run decode_step 240 python3 -m bench.decode_step --ep 8 --model qwen3-235b-a22b --weights fp8 --batches 32 64 128 --profile 5
  fi
fi

[ -n "$SCALE_DRY_RUN" ] && exit 0
note "done $(date -u +%T), ${SECONDS}s; failed:${FAILED:- none}"
collect
cat "$OUT/run.log"
echo "--- tables"
grep -h -A12 -E "^ *(size|tokens|impl|path) " "$OUT"/bench_*.log "$OUT"/decode_step.log 2>/dev/null | cut -c1-220 | head -120
echo "--- failures"
grep -h -E "^(FAILED|ERROR)|Error|error:" "$OUT"/*.log | head -30
[ -z "$FAILED" ]
