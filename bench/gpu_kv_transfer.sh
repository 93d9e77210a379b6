#!/bin/bash
# Issue 3 on 2x H200 (run kind "nvidia-h200-x2"), about 3-4 minutes of wall time:
#   1. CUDA unit tests of the transfer (the CuTeDSL KV copy kernel vs its torch reference and vs
#      pack/scatter, every access width; pack/scatter)
#   2. tests/transfer/test_transfer_gpu.py: two processes on two GPUs over CUDA IPC + UCX
#   3. bench/kv_transfer.py at 1k / 6k / 32k tokens: TP=1 and 2 ranks, prefill page 16 and 32 against
#      decode page 16, ucx (256 and 1024 MiB chunks) and cuda_ipc, overlap behind a layer-by-layer prefill
# The direct writes run a CuTeDSL kernel (kernels/kv_copy.py) and UCX needs the ucxx bundle; both
# bundles together exceed what one call may carry, so it takes two calls back to back on one machine:
#   call 1: carry [".gpu/cutedsl-4.8.1-cp312-cu13.tar.xz"], command "bash bench/gpu_kv_transfer.sh cutedsl"
#           (unpacks CuTeDSL into /tmp/gpu-site, which the warm machine keeps for the next call)
#   call 2: carry [".gpu/ucxx-nats-cp312-cu13.tar.xz", ".cache/commit"], command "bash bench/gpu_kv_transfer.sh"
#           (refuses to start, exit 3, when /tmp/gpu-site holds no CuTeDSL: the machine was not kept)
# Before call 2: git rev-parse --short=12 HEAD > .cache/commit
# Logs go to $OUT/*.log, benchmark lines to $OUT/kv_transfer.jsonl: append that file to
# bench/results/kv_transfer.jsonl here. Every step has a wall limit, every test a pytest-timeout.
# Environment knobs: KV_TOKENS (default 1024,6144,32768), KV_ITERS (5), KV_CHUNKS (UCX chunk MiB, 256,1024;
# the staging slots take the largest), KV_STEPS (units,gpu_tests,bench).
cd "$(dirname "$0")/.." || exit 1
if [ "$1" = cutedsl ]; then
  mkdir -p /tmp/gpu-site && xz -dc .gpu/cutedsl-4.8.1-cp312-cu13.tar.xz | tar x -C /tmp/gpu-site || exit 1
  echo "CuTeDSL unpacked into /tmp/gpu-site"; ls -d /tmp/gpu-site/nvidia_cutlass_dsl; exit $?
fi
if [ ! -d /tmp/gpu-site/nvidia_cutlass_dsl ]; then
  echo "NOT WARM: /tmp/gpu-site/nvidia_cutlass_dsl is missing (run 'bash bench/gpu_kv_transfer.sh cutedsl' first, same machine)"; exit 3
fi
GPU_BUNDLE=.gpu/ucxx-nats-cp312-cu13.tar.xz
source bench/gpu_common.sh
STEPS=${KV_STEPS:-units,gpu_tests,bench}
{ nvidia-smi topo -m; python3 -c "import cuda.bindings, torch, cutlass; print('cuda-bindings', cuda.bindings.__version__, 'torch', torch.__version__, 'cutlass-dsl', cutlass.__version__)"; } >> "$OUT/run.log" 2>&1

[[ $STEPS == *units* ]] && step units 120 $PYTEST --timeout=60 -m gpu tests/kernels/test_kv_copy.py tests/transfer/test_direct_write.py tests/transfer/test_transfer_units.py
[[ $STEPS == *gpu_tests* ]] && step gpu_tests 150 $PYTEST --timeout=60 tests/transfer/test_transfer_gpu.py
[[ $STEPS == *bench* ]] && step bench 240 python3 -m bench.kv_transfer --device cuda --tokens "${KV_TOKENS:-1024,6144,32768}" \
  --iters "${KV_ITERS:-5}" --overlap-iters 2 --chunk-mib "${KV_CHUNKS:-256,1024}"
echo "=== done $(date -u +%T), ${SECONDS}s" >> "$OUT/run.log"
cat "$OUT/run.log"
grep -h -E "passed|failed|Error|FAILED" "$OUT"/units.log "$OUT"/gpu_tests.log 2>/dev/null | tail -20
grep -A80 -E "^tokens" "$OUT/bench.log" 2>/dev/null | cut -c1-230
