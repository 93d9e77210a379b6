#!/bin/bash
# One device call on 2x H200 (run kind "nvidia-h200-x2") for the communication kernels.
#   bench/gpu_comm.sh [all]       about 2.5 minutes:
#   1. tests/gpu/test_comm_allreduce.py            all-reduce vs the reference and NCCL, eager + CUDA graph
#   2. bench/allreduce.py                          8 KiB .. 256 MiB: ours (auto, each algorithm + launch-shape
#                                                  variants) vs NCCL vs torch symm-mem one/two-shot, CUDA-graph timed
#   3. tests/gpu/test_comm_parallel_cuda.py and tests/gpu/test_comm_ep_prefill.py
#   4. bench/ep_prefill_layer.py                   one Qwen3-235B MoE layer, TP = EP = 2
#   bench/gpu_comm.sh allreduce   about 1.7 minutes: step 2 at 8 KiB .. 4 MiB (every one-shot variant)
#                                 plus 64 and 256 MiB (default and NCCL only), step 1, then
#                                 tests/gpu/test_comm_parallel_cuda.py
# Logs go to $OUT/*.log, benchmark lines to $OUT/*.jsonl (MOEBUS_RESULTS_DIR=$OUT); append those to
# bench/results/ here. Carry [".gpu/cutedsl-4.8.1-cp312-cu13.tar.xz", ".cache/commit"]; before the call:
#   git rev-parse --short=12 HEAD > .cache/commit
cd "$(dirname "$0")/.." || exit 1
source bench/gpu_common.sh

if [ "${1:-all}" = allreduce ]; then
  step bench_allreduce 45 python3 -m bench.allreduce --max-mib 4 --also-mib 64 256
  step test_allreduce 70 $PYTEST --timeout=60 tests/gpu/test_comm_allreduce.py
  step test_parallel 30 $PYTEST --timeout=25 tests/gpu/test_comm_parallel_cuda.py
else
  step test_allreduce 70 $PYTEST --timeout=60 tests/gpu/test_comm_allreduce.py
  step bench_allreduce 75 python3 -m bench.allreduce
  step test_parallel_ep 60 $PYTEST --timeout=50 tests/gpu/test_comm_parallel_cuda.py tests/gpu/test_comm_ep_prefill.py
  step bench_ep_prefill 35 python3 -m bench.ep_prefill_layer
fi

cat "$OUT/run.log"
echo "--- allreduce table"
grep -A40 "^ *size " "$OUT/bench_allreduce.log"
echo "--- failures"
grep -E "^(FAILED|ERROR)|Error|error:" "$OUT"/test_*.log | head -30
