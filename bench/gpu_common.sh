# Shared set-up of the bench/gpu_*.sh scripts, each one device call run from the checkout root
# (`source bench/gpu_common.sh`): unpacks the CuTeDSL bundle (or $GPU_BUNDLE, e.g. the ucxx one:
# the two together exceed what a call may carry) into /tmp/gpu-site, exports the
# environment every GPU process gets (NVLink multicast stays off: NCCL NVLS, torch symm-mem and
# NVSHMEM multicast disabled), writes the header of $OUT/run.log and defines `step`.
set -o pipefail
mkdir -p /tmp/gpu-site && xz -dc "${GPU_BUNDLE:-.gpu/cutedsl-4.8.1-cp312-cu13.tar.xz}" | tar x -C /tmp/gpu-site || exit 1
COMMIT=${MOEBUS_COMMIT:-$(cat .cache/commit 2>/dev/null || git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
export PYTHONPATH=$PWD:/tmp/gpu-site:/tmp/gpu-site/nvidia_cutlass_dsl/dsl_packages NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 UCX_WARN_UNUSED_ENV_VARS=n \
  MOEBUS_COMMIT=$COMMIT MOEBUS_RESULTS_DIR=$OUT
PYTEST="python3 -m pytest -q -s -ra -p no:cacheprovider"

{ date -u; echo "commit $COMMIT"; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv; } > "$OUT/run.log" 2>&1

# step NAME LIMIT_S COMMAND...: run with a wall limit, log to $OUT/NAME.log, one summary line
# (and the log's last lines) in run.log; returns the command's exit status.
step() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc $((SECONDS - t0))s (limit ${limit}s): $*" >> "$OUT/run.log"
  tail -4 "$OUT/$name.log" | sed 's/^/    /' >> "$OUT/run.log"
  return $rc
}
