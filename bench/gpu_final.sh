#!/bin/bash
# One device call on 2x H200 (run kind "nvidia-h200-x2"), about 2-2.5 minutes of wall time:
#   1. tests/gpu/test_comm_parallel_cuda.py                 both GPUs (CudaCollectives all-reduce)
#   2. in parallel, one GPU each:
#      GPU 0: tests/gpu/test_gemm_grouped.py                 grouped GEMM + FP8 quantizer, full file
#      GPU 1: tests/gpu/test_model_kernels.py and the cuda parameters of
#             tests/model/runtime/test_kernel_path.py        model kernel path vs reference ops (-m gpu)
#             then bench/decode_step.py at batch 1/16/64:   torch-reference vs kernels vs kernels+cuda-graph
# Logs go to $OUT/*.log, benchmark lines to $OUT/decode_step.jsonl (MOEBUS_RESULTS_DIR=$OUT); append that
# file to bench/results/decode_step.jsonl here. Every step has a wall limit, every test a pytest-timeout.
#
# Carry: [".gpu/cutedsl-4.8.1-cp312-cu13.tar.xz", ".cache/commit"], plus if they fit (64 MiB in all)
# ".cache/tiny/kernel_shapes" and ".cache/tiny/kernel_shapes_fp8" (5.8 MB; written by running
# tests/model/runtime/test_kernel_path.py with MOEBUS_TINY_DIR=$PWD/.cache/tiny). Without them the test
# writes the tiny checkpoint on the device with transformers (make_tiny). Before the call:
#   git rev-parse --short=12 HEAD > .cache/commit
# Environment knobs: BENCH_LAYERS (default 48, the real depth; fewer to save time, recorded in the case).
cd "$(dirname "$0")/.." || exit 1
source bench/gpu_common.sh
export MOEBUS_TINY_DIR=$PWD/.cache/tiny

step comm_parallel_cuda 75 $PYTEST --timeout=60 tests/gpu/test_comm_parallel_cuda.py

( export CUDA_VISIBLE_DEVICES=0; step gemm_grouped 120 $PYTEST --timeout=60 tests/gpu/test_gemm_grouped.py ) &
gemm_pid=$!
(
  export CUDA_VISIBLE_DEVICES=1
  step model_kernels 110 $PYTEST --timeout=90 -m gpu tests/gpu/test_model_kernels.py tests/model/runtime/test_kernel_path.py
  step decode_step 150 python3 -m bench.decode_step --batches 1 16 64 --layers "${BENCH_LAYERS:-48}"
) &
model_pid=$!
wait $gemm_pid $model_pid
echo "=== done $(date -u +%T), ${SECONDS}s" >> "$OUT/run.log"
cat "$OUT/run.log"
grep -h -E "^(tokens|fp8|bf16|impl|torch-reference|kernels)|rel_fro|median token|PASS|FAIL|Error|passed|failed" \
  "$OUT"/model_kernels.log "$OUT"/decode_step.log 2>/dev/null | tail -60
