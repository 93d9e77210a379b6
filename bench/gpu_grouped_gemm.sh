#!/bin/bash
# One device call on 2x H200 (kind "nvidia-h200-x2") for the grouped GEMM, the two GPUs in parallel:
#   GPU 0: tests/gpu/test_gemm_grouped.py and tests/gpu/test_model_kernels.py (correctness), then
#          bench/grouped_gemm.py once per variant in GG_VARIANTS ('|'-separated argument lists, e.g.
#          "--dtypes bf16,fp8|--tile-n 128 --dtypes bf16 --only gemm:qwen3-30b:down:prefill");
#   GPU 1: bench/grouped_gemm.py with GG_BENCH_ARGS (default: all cases).
#   Each bench case measures ours and torch._grouped_mm / torch._scaled_grouped_mm in the same process.
#   Add --timing both (or burst) to GG_BENCH_ARGS / a variant for burst figures beside the sustained ones
#   (the H200 lowers its clock at its 700 W cap under sustained load; see bench/grouped_gemm.py).
# Logs: $OUT/*.log; bench lines: $OUT/gpu0/grouped_gemm.jsonl and $OUT/gpu1/grouped_gemm.jsonl (append both
# to bench/results/grouped_gemm.jsonl here). Every step has a wall limit, every test a pytest-timeout.
# Carry: [".gpu/cutedsl-4.8.1-cp312-cu13.tar.xz", ".cache/commit"]; before the call:
#   git rev-parse --short=12 HEAD > .cache/commit
cd "$(dirname "$0")/.." || exit 1
source bench/gpu_common.sh
mkdir -p "$OUT/gpu0" "$OUT/gpu1"

(
  export CUDA_VISIBLE_DEVICES=0 MOEBUS_RESULTS_DIR=$OUT/gpu0
  step gemm_tests "${GG_TEST_LIMIT:-180}" $PYTEST --timeout=90 tests/gpu/test_gemm_grouped.py \
    tests/gpu/test_model_kernels.py
  i=0
  IFS='|' read -ra variants <<< "${GG_VARIANTS:-}"
  for v in "${variants[@]}"; do
    i=$((i + 1))
    step "bench_variant$i" "${GG_VARIANT_LIMIT:-90}" python3 -m bench.grouped_gemm $v
  done
) &
gpu0=$!
(
  export CUDA_VISIBLE_DEVICES=1 MOEBUS_RESULTS_DIR=$OUT/gpu1
  step bench "${GG_BENCH_LIMIT:-200}" python3 -m bench.grouped_gemm ${GG_BENCH_ARGS:-}
) &
gpu1=$!
wait $gpu0 $gpu1
echo "=== done $(date -u +%T), ${SECONDS}s" >> "$OUT/run.log"
cat "$OUT/run.log"
grep -h -E "passed|failed|FAILED|Error|rel_fro" "$OUT/gemm_tests.log" | tail -45
grep -h -E "^\[|ceilings|quantize_act" "$OUT"/bench*.log | cut -c1-150  # bench.log and any bench_variant*.log
