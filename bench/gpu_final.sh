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
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
mkdir -p /tmp/gpu-site && xz -dc .gpu/cutedsl-4.8.1-cp312-cu13.tar.xz | tar x -C /tmp/gpu-site || exit 1
COMMIT=${MOEBUS_COMMIT:-$(cat .cache/commit 2>/dev/null || git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
export PYTHONPATH=$PWD:/tmp/gpu-site:/tmp/gpu-site/nvidia_cutlass_dsl/dsl_packages NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 MOEBUS_RESULTS_DIR=$OUT \
  UCX_WARN_UNUSED_ENV_VARS=n MOEBUS_COMMIT=$COMMIT MOEBUS_TINY_DIR=$PWD/.cache/tiny
PYTEST="python3 -m pytest -q -s -ra -p no:cacheprovider"

{ date -u; echo "commit $COMMIT"; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv; } > "$OUT/run.log" 2>&1

# step NAME LIMIT_S COMMAND...: run with a wall limit, log to $OUT/NAME.log, one summary line in run.log.
step() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc $((SECONDS - t0))s (limit ${limit}s): $*" >> "$OUT/run.log"
  tail -3 "$OUT/$name.log" | sed 's/^/    /' >> "$OUT/run.log"
  return $rc
}

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
