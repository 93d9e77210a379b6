"""CuTeDSL kernel of :func:`kernels.router.route_topk` (CUDA tensors only).

One warp per token: each lane holds ``experts / 32`` consecutive logits, the softmax's
max and sum are warp shuffle reductions, and each of the k picks is a warp argmax over
(probability, expert id) pairs, after which the lane holding the winner drops it. Lane
``r`` keeps the r-th pick, so the outputs are written by k lanes at once. Launches take
raw device pointers on torch's current stream and never synchronise with the host
(CUDA-graph capturable); one compilation per (experts, k, renormalize) serves every
token count.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import cuda.bindings.driver as cuda_driver
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Int64

from kernels._cute_comm import gptr, load_vec_f32, row_launch, wait_for_previous_kernel, warp_row
from kernels._cute_runtime import dummy_stream, launcher

if TYPE_CHECKING:
    from cutlass.base_dsl.jit_executor import JitCompiledFunction



@cute.jit
def _warp_argmax(p: Float32, idx: Int32):
    """The largest ``p`` across the warp, the lowest ``idx`` among equals; every lane gets it."""
    for s in cutlass.range_constexpr(5):
        offset = 16 >> s
        q = cute.arch.shuffle_sync_bfly(p, offset=offset)
        j = cute.arch.shuffle_sync_bfly(idx, offset=offset)
        if q > p:
            p = q
            idx = j
        elif q == p:
            if j < idx:
                idx = j
    return p, idx


@cute.kernel
def _route_kernel(logits: Int64, weights_out: Int64, ids_out: Int64, rows: Int32,
                  experts: cutlass.Constexpr, top_k: cutlass.Constexpr, renormalize: cutlass.Constexpr):
    wait_for_previous_kernel()
    row, lane = warp_row()
    per_lane = experts // 32
    if row < rows:
        first = lane * per_lane
        v = load_vec_f32(logits + (Int64(row) * experts + first) * 2, BFloat16, per_lane, per_lane, align=per_lane * 2)
        m = v[0]
        for j in cutlass.range_constexpr(1, per_lane):
            m = cute.arch.fmax(m, v[j])
        m = cute.arch.warp_reduction_max(m)
        total = Float32(0.0)
        for j in cutlass.range_constexpr(per_lane):
            v[j] = cute.math.exp(v[j] - m)
            total += v[j]
        total = cute.arch.warp_reduction_sum(total)
        for j in cutlass.range_constexpr(per_lane):
            v[j] = v[j] / total  # the fp32 softmax, as torch.softmax(..., dtype=float32)
        mine_p = Float32(0.0)  # lane r keeps pick r
        mine_id = Int32(0)
        picked_sum = Float32(0.0)
        for r in cutlass.range_constexpr(top_k):
            best_p = Float32(-1.0)
            best_id = Int32(experts)
            for j in cutlass.range_constexpr(per_lane):
                if v[j] > best_p:  # strictly greater: the lowest id among this lane's equals
                    best_p = v[j]
                    best_id = first + j
            best_p, best_id = _warp_argmax(best_p, best_id)
            for j in cutlass.range_constexpr(per_lane):
                if first + j == best_id:
                    v[j] = Float32(-2.0)  # taken
            picked_sum += best_p
            if lane == r:
                mine_p = best_p
                mine_id = best_id
        if lane < top_k:
            w = mine_p
            if cutlass.const_expr(renormalize):
                w = mine_p / picked_sum
            out = Int64(row) * top_k + lane
            cute.make_tensor(gptr(BFloat16, weights_out + out * 2, 2), cute.make_layout(1))[0] = w.to(BFloat16)
            cute.arch.store(gptr(Int64, ids_out + out * 8, 8), Int64(mine_id))


@cute.jit
def _launch_route(logits: Int64, weights_out: Int64, ids_out: Int64, rows: Int32, stream: cuda_driver.CUstream,
                  experts: cutlass.Constexpr, top_k: cutlass.Constexpr, renormalize: cutlass.Constexpr):
    _route_kernel(logits, weights_out, ids_out, rows, experts, top_k, renormalize).launch(**row_launch(rows), stream=stream)


@functools.cache
def compiled_route(experts: int, top_k: int, renormalize: bool) -> JitCompiledFunction:
    """Compiled router for ``experts`` (a multiple of 32, at most 256) and ``top_k`` (cached;
    compiles without a GPU under CUTE_DSL_ARCH)."""
    z = Int64(0)
    return cute.compile(_launch_route, z, z, z, Int32(1), dummy_stream(), experts, top_k, renormalize)


def route_topk_cuda(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous bf16 CUDA ``logits [T, E]`` (checked by :func:`kernels.router.route_topk`)."""
    rows, experts = logits.shape
    weights = torch.empty(rows, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(rows, top_k, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return weights, ids
    launcher(compiled_route(experts, top_k, renormalize), logits.device)(logits.data_ptr(), weights.data_ptr(), ids.data_ptr(), rows)
    return weights, ids
