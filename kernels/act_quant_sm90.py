"""CuTeDSL kernel of :func:`kernels.act_quant.quantize_act` (CUDA tensors only).

One warp per (row, 128-channel block), four channels per lane, a shuffle
max-reduction; the scale and rounding follow :func:`kernels.act_quant.quantize_act_reference`
(``max(amax, floor) * fl(1/448)``, so scales match it bit for bit). The masked variant
takes ``[E, capacity, K]`` rows with per-group counts on the GPU and quantizes only the
rows below each count (a grid over groups and row chunks): a decode MoE's intermediate
lives in such a buffer sized for the worst routing (``capacity`` = all tokens of all
ranks), of which a step fills a few percent.  Scale rows are written
:func:`kernels.act_quant.scale_row_stride` floats apart (16-byte rows, the
layout the FP8 grouped GEMM's 16-byte scale copies read); the padding stays unwritten.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import make_fake_stream, make_ptr

from kernels._cute_comm import wait_for_previous_kernel
from kernels._cute_runtime import launch_stream
from kernels.act_quant import AMAX_FLOOR, FP8_MAX, INV_FP8_MAX, QUANT_BLOCK, scale_row_stride

if TYPE_CHECKING:
    from cutlass.base_dsl.jit_executor import JitCompiledFunction

WARPS_PER_CTA = 8


class ActQuantKernel:
    """Plain: one warp per (row, 128-channel block), each lane owning four channels.
    Masked: CTA ``(chunk, group)`` gives a warp to each of the group's rows ``chunk * 8 ..``
    below its count, the warp taking the row's blocks one after another; CTAs wholly past
    the count exit at once (a decode step fills a few rows of each group's capacity, and a
    warp per (row, block) of the whole capacity cost 29 us at 64 x 256 x 768)."""

    def __init__(self, k: int, masked: bool = False):
        self.k = k
        self.k_blocks = math.ceil(k / QUANT_BLOCK)
        self.masked = masked

    @cute.jit
    def __call__(self, x_ptr: cute.Pointer, q_ptr: cute.Pointer, s_ptr: cute.Pointer, counts_ptr: cute.Pointer,
                 rows: cutlass.Int32, capacity: cutlass.Int32, stream: cuda.CUstream):
        K, kb = self.k, self.k_blocks
        mX = cute.make_tensor(x_ptr, cute.make_layout((rows, K), stride=(K, 1)))
        mQ = cute.make_tensor(q_ptr, cute.make_layout((rows, K), stride=(K, 1)))
        mS = cute.make_tensor(s_ptr, cute.make_layout((rows, kb), stride=(scale_row_stride(kb), 1)))
        groups = (rows + capacity - 1) // capacity
        mCounts = cute.make_tensor(counts_ptr, cute.make_layout((groups,)))
        if cutlass.const_expr(self.masked):
            grid = [(capacity + WARPS_PER_CTA - 1) // WARPS_PER_CTA, groups, 1]
        else:
            grid = [(rows * kb + WARPS_PER_CTA - 1) // WARPS_PER_CTA, 1, 1]
        self.kernel(mX, mQ, mS, mCounts, rows, capacity).launch(grid=grid, block=[32 * WARPS_PER_CTA, 1, 1], stream=stream,
                                                                use_pdl=True)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, mCounts: cute.Tensor, rows: cutlass.Int32,
               capacity: cutlass.Int32):
        wait_for_previous_kernel()
        tidx, _, _ = cute.arch.thread_idx()
        bidx, gidx, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = bidx * WARPS_PER_CTA + tidx // 32
        if cutlass.const_expr(self.masked):
            if warp < mCounts[gidx]:
                for block in cutlass.range_constexpr(self.k_blocks):
                    self.quantize_block(mX, mQ, mS, gidx * capacity + warp, block, lane)
        else:
            if warp < rows * self.k_blocks:
                row = warp // self.k_blocks
                self.quantize_block(mX, mQ, mS, row, warp - row * self.k_blocks, lane)

    @cute.jit
    def quantize_block(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, row: cutlass.Int32, block: cutlass.Int32,
                       lane: cutlass.Int32):
        """One warp: channels ``block * 128 ..`` of ``row``, four per lane, and their scale."""
        col0 = block * QUANT_BLOCK + lane * 4
        vals = cute.make_rmem_tensor((4,), cutlass.Float32)
        amax = cutlass.Float32(0.0)
        for j in cutlass.range_constexpr(4):
            v = cutlass.Float32(0.0)
            if col0 + j < self.k:
                v = mX[(row, col0 + j)].to(cutlass.Float32)
            vals[j] = v
            amax = cute.arch.fmax(amax, cute.math.absf(v))
        amax = cute.arch.warp_reduction_max(amax)
        scale = cute.arch.fmax(amax, cutlass.Float32(AMAX_FLOOR)) * cutlass.Float32(INV_FP8_MAX)
        for j in cutlass.range_constexpr(4):
            if col0 + j < self.k:
                y = vals[j] / scale
                y = cute.arch.fmin(cute.arch.fmax(y, cutlass.Float32(-FP8_MAX)), cutlass.Float32(FP8_MAX))
                mQ[(row, col0 + j)] = y.to(cutlass.Float8E4M3FN)
        if lane == 0:
            mS[(row, block)] = scale


_GMEM = cute.AddressSpace.gmem
_COMPILED: dict[tuple[int, bool], object] = {}


def compiled_quantizer(k: int, masked: bool = False) -> JitCompiledFunction:
    """Compiled quantizer for rows of ``k`` channels, plain or masked (cached; compiles without a
    GPU under CUTE_DSL_ARCH)."""
    key = (k, masked)
    if key not in _COMPILED:
        _COMPILED[key] = cute.compile(
            ActQuantKernel(k, masked),
            make_ptr(cutlass.BFloat16, 0, _GMEM, assumed_align=2),
            make_ptr(cutlass.Float8E4M3FN, 0, _GMEM, assumed_align=1),
            make_ptr(cutlass.Float32, 0, _GMEM, assumed_align=4),
            make_ptr(cutlass.Int32, 0, _GMEM, assumed_align=4),
            cutlass.Int32(1),
            cutlass.Int32(1),
            make_fake_stream(),
        )
    return _COMPILED[key]


def quantize_cuda(x: torch.Tensor, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize contiguous bf16 CUDA ``x[..., K]`` on its device's current stream; with ``counts``
    (int32 ``[E]`` on x's GPU, x ``[E, capacity, K]``) only each group's first ``counts[e]`` rows,
    the others left unwritten (inputs checked by the caller).  ``scale`` is a ``[..., K/128]`` view of
    rows padded to ``scale_row_stride`` floats."""
    K = x.shape[-1]
    kb = math.ceil(K / QUANT_BLOCK)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(*x.shape[:-1], scale_row_stride(kb), dtype=torch.float32, device=x.device)[..., :kb]
    rows = x.numel() // K
    if rows == 0:
        return q, scale
    capacity = rows if counts is None else x.shape[1]
    with launch_stream(x.device) as stream:  # any calling thread: x's GPU, its current stream
        compiled_quantizer(K, counts is not None)(
            make_ptr(cutlass.BFloat16, x.data_ptr(), _GMEM, assumed_align=2),
            make_ptr(cutlass.Float8E4M3FN, q.data_ptr(), _GMEM, assumed_align=1),
            make_ptr(cutlass.Float32, scale.data_ptr(), _GMEM, assumed_align=4),
            make_ptr(cutlass.Int32, 0 if counts is None else counts.data_ptr(), _GMEM, assumed_align=4),
            cutlass.Int32(rows),
            cutlass.Int32(capacity),
            stream,
        )
    return q, scale
