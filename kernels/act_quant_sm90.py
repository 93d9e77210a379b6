"""CuTeDSL kernel of :func:`kernels.act_quant.quantize_act` (CUDA tensors only).

A 128-channel block is quantized by 16 lanes, eight channels (16 bytes of bf16) each: a
16-lane shuffle max-reduction gives its scale, and the scale and rounding follow
:func:`kernels.act_quant.quantize_act_reference` (``max(amax, floor) * fl(1/448)``, an IEEE
division, so the results match it bit for bit); each lane then stores its eight E4M3 values
as one 8-byte word.  `quantize_group` is that step, shared with the decode dispatch kernel
(`kernels.dispatch_combine`), which quantizes the rows it sends the same way.

Plain layout: a warp takes 2 or 8 (`blocks_per_warp`) consecutive (row, block) pairs of
the flattened ``[rows, K/128]`` grid, two at a time (one per half-warp), and loads all of
them before reducing any.  The kernel is bound by the bytes it keeps in flight: one warp per
block with four 2-byte loads a lane (256 bytes in flight a warp) moved 1.92 TB/s on an H200
at 48000 x 4096, under half the copy rate; this layout 3.42 TB/s, 0.80 of the copy kernel's rate in
the same runs (bench.grouped_gemm's quantize_act line, [fd1a4a3+s49-quant16] against [fd1a4a369e8c]).  The masked variant
takes ``[E, capacity, K]`` rows with per-group counts on the GPU and quantizes only the
rows below each count (a grid over groups and row chunks, a warp per row taking its
blocks two at a time): a decode MoE's intermediate lives in such a buffer sized for the
worst routing (``capacity`` = all tokens of all ranks), of which a step fills a few
percent.  Scale rows are written :func:`kernels.act_quant.scale_row_stride` floats apart
(16-byte rows, the layout the FP8 grouped GEMM's 16-byte scale copies read); the padding
stays unwritten.  Rows must start 16-byte aligned (`quantize_cuda` copies a tensor that
does not).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64
from cutlass.cute.runtime import make_fake_stream, make_ptr

from kernels._cute_comm import load_vec_f32, store_f32, store_vec_f32, wait_for_previous_kernel
from kernels._cute_runtime import launcher, sm_count
from kernels.act_quant import AMAX_FLOOR, FP8_MAX, INV_FP8_MAX, QUANT_BLOCK, ActQuantError, scale_row_stride

if TYPE_CHECKING:
    from cutlass.base_dsl.jit_executor import JitCompiledFunction

WARPS_PER_CTA = 8
LANE_VALUES = 8  # channels a lane quantizes: 16 bytes of bf16 in, 8 bytes of E4M3 out
GROUP_LANES = QUANT_BLOCK // LANE_VALUES  # lanes of one 128-channel block: a half-warp
# Plain layout: (row, block) pairs a warp loads before it reduces any.  Eight keep the bytes in flight where the
# grid holds at least MIN_CTAS_PER_SM CTAs an SM; smaller inputs (decode) take two, so that their few blocks
# spread over more SMs.  A Qwen3-30B decode step (16 layers, FP8 experts, batch 16 / 64 / 128, one H200, two
# runs an arm in one call): eight a warp everywhere 2.75 / 3.73 / 4.18 ms, this rule 2.69 / 3.67 / 4.12, the
# warp-per-block quantizer before 2.69-2.70 / 3.68-3.69 / 4.12-4.13 ([27027b788d11], [2730d28b7d89], [fd1a4a369e8c]).
BLOCKS_PER_WARP = (2, 8)
MIN_CTAS_PER_SM = 4


@cute.jit
def quantize_group(v) -> tuple:
    """Lane's ``LANE_VALUES`` fp32 values of a 128-channel block spread over ``GROUP_LANES`` aligned lanes:
    (the lane's values divided by the block's scale and clamped to the E4M3 range, still fp32; the scale).
    Every lane of the half-warp must call it (the xor shuffles stay inside it)."""
    amax = Float32(0.0)
    for i in cutlass.range_constexpr(LANE_VALUES):
        amax = cute.arch.fmax(amax, cute.arch.fmax(v[i], -v[i]))
    for off in cutlass.range_constexpr(4):
        amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=(GROUP_LANES // 2) >> off))
    scale = cute.arch.fmax(amax, Float32(AMAX_FLOOR)) * Float32(INV_FP8_MAX)
    q = cute.make_rmem_tensor((LANE_VALUES,), Float32)
    for i in cutlass.range_constexpr(LANE_VALUES):
        q[i] = cute.arch.fmin(cute.arch.fmax(v[i] / scale, Float32(-FP8_MAX)), Float32(FP8_MAX))
    return q, scale


class ActQuantKernel:
    """Plain: warp ``w`` takes (row, block) pairs ``w * blocks_per_warp ..`` of the flattened grid, a
    half-warp each.  Masked: CTA ``(chunk, group)`` gives a warp to each of the group's rows
    ``chunk * 8 ..`` below its count, the warp taking the row's blocks two at a time; CTAs wholly
    past the count exit at once (a decode step fills a few rows of each group's capacity, and a
    warp per (row, block) of the whole capacity cost 29 us at 64 x 256 x 768)."""

    def __init__(self, k: int, masked: bool = False, blocks_per_warp: int = BLOCKS_PER_WARP[-1]):
        self.k = k
        self.k_blocks = math.ceil(k / QUANT_BLOCK)
        self.masked = masked
        self.blocks_per_warp = blocks_per_warp

    @cute.jit
    def __call__(self, x_ptr: Int64, q_ptr: Int64, s_ptr: Int64, counts_ptr: cute.Pointer, rows: Int32,
                 capacity: Int32, stream: cuda.CUstream):
        groups = (rows + capacity - 1) // capacity
        mCounts = cute.make_tensor(counts_ptr, cute.make_layout((groups,)))
        if cutlass.const_expr(self.masked):
            grid = [(capacity + WARPS_PER_CTA - 1) // WARPS_PER_CTA, groups, 1]
        else:
            per_cta = WARPS_PER_CTA * self.blocks_per_warp
            grid = [(rows * self.k_blocks + per_cta - 1) // per_cta, 1, 1]
        self.kernel(x_ptr, q_ptr, s_ptr, mCounts, rows, capacity).launch(grid=grid, block=[32 * WARPS_PER_CTA, 1, 1],
                                                                         stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, x_ptr: Int64, q_ptr: Int64, s_ptr: Int64, mCounts: cute.Tensor, rows: Int32, capacity: Int32):
        wait_for_previous_kernel()
        tidx, _, _ = cute.arch.thread_idx()
        bidx, gidx, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = bidx * WARPS_PER_CTA + tidx // 32
        half = lane // GROUP_LANES
        kb = self.k_blocks
        if cutlass.const_expr(self.masked):
            if warp < mCounts[gidx]:
                row = gidx * capacity + warp
                for pair in cutlass.range_constexpr((kb + 1) // 2):
                    self.quantize_blocks(x_ptr, q_ptr, s_ptr, [row * kb + 2 * pair + half],
                                         [2 * pair + half < kb], lane)
        else:
            first = warp * self.blocks_per_warp + half
            flat = [first + 2 * j for j in range(self.blocks_per_warp // 2)]
            self.quantize_blocks(x_ptr, q_ptr, s_ptr, flat, [f < rows * kb for f in flat], lane)

    @cute.jit
    def quantize_blocks(self, x_ptr: Int64, q_ptr: Int64, s_ptr: Int64, flat: list, valid: list, lane: Int32):
        """This half-warp's (row, block) pairs ``flat`` (``row * K/128 + block``; those whose ``valid`` is false
        are skipped): every load first, then each block's scale, its E4M3 values and its scale entry."""
        kb = self.k_blocks
        sub = lane % GROUP_LANES
        rows, blocks, elems, live, vals = [], [], [], [], []
        for j in cutlass.range_constexpr(len(flat)):
            row = flat[j] // kb
            block = flat[j] - row * kb
            col = block * QUANT_BLOCK + sub * LANE_VALUES
            n = Int32(0)  # K % 16 == 0: a lane's eight channels lie wholly inside K or wholly past it
            if valid[j] and col < self.k:
                n = Int32(LANE_VALUES)
            elem = Int64(row) * self.k + col
            rows.append(row)
            blocks.append(block)
            elems.append(elem)
            live.append(n)
            vals.append(load_vec_f32(x_ptr + elem * 2, cutlass.BFloat16, LANE_VALUES, n))
        for j in cutlass.range_constexpr(len(flat)):
            q, scale = quantize_group(vals[j])
            store_vec_f32(q_ptr + elems[j], q, cutlass.Float8E4M3FN, LANE_VALUES, live[j], align=8)
            if live[j] > 0 and sub == 0:
                store_f32(s_ptr + (Int64(rows[j]) * scale_row_stride(kb) + blocks[j]) * 4, scale)


_GMEM = cute.AddressSpace.gmem
_COMPILED: dict[tuple[int, bool, int], object] = {}


def compiled_quantizer(k: int, masked: bool = False, blocks_per_warp: int = BLOCKS_PER_WARP[-1]) -> JitCompiledFunction:
    """Compiled quantizer for rows of ``k`` channels, plain or masked (cached; compiles without a
    GPU under CUTE_DSL_ARCH)."""
    key = (k, masked, blocks_per_warp)
    if key not in _COMPILED:
        z = Int64(0)
        _COMPILED[key] = cute.compile(ActQuantKernel(k, masked, blocks_per_warp), z, z, z,
                                      make_ptr(cutlass.Int32, 0, _GMEM, assumed_align=4), Int32(1), Int32(1),
                                      make_fake_stream())
    return _COMPILED[key]


def warp_blocks_for(blocks: int, sms: int) -> int:
    """The plain layout's (row, block) pairs a warp for ``blocks`` of them on ``sms`` SMs: the most of
    `BLOCKS_PER_WARP` that still gives every SM `MIN_CTAS_PER_SM` CTAs."""
    fits = [b for b in BLOCKS_PER_WARP if blocks >= sms * MIN_CTAS_PER_SM * WARPS_PER_CTA * b]
    return max(fits, default=BLOCKS_PER_WARP[0])


def quantize_cuda(x: torch.Tensor, counts: torch.Tensor | None = None,
                  blocks_per_warp: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize contiguous bf16 CUDA ``x[..., K]`` on its device's current stream; with ``counts``
    (int32 ``[E]`` on x's GPU, x ``[E, capacity, K]``) only each group's first ``counts[e]`` rows,
    the others left unwritten (inputs checked by the caller).  ``scale`` is a ``[..., K/128]`` view of
    rows padded to ``scale_row_stride`` floats.  ``blocks_per_warp`` (plain layout, one of
    `BLOCKS_PER_WARP`) overrides `warp_blocks_for`'s choice (tests run both)."""
    if blocks_per_warp not in (None, *BLOCKS_PER_WARP):
        raise ActQuantError(f"blocks_per_warp is one of {BLOCKS_PER_WARP}, got {blocks_per_warp}")
    K = x.shape[-1]
    kb = math.ceil(K / QUANT_BLOCK)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(*x.shape[:-1], scale_row_stride(kb), dtype=torch.float32, device=x.device)[..., :kb]
    rows = x.numel() // K
    if rows == 0:
        return q, scale
    masked = counts is not None
    capacity = x.shape[1] if masked else rows
    if masked:
        blocks_per_warp = BLOCKS_PER_WARP[-1]  # the masked kernel has one layout: one compiled variant
    elif blocks_per_warp is None:
        blocks_per_warp = warp_blocks_for(rows * kb, sm_count(x.device))
    if x.data_ptr() % 16:  # a view starting off a 16-byte boundary: the kernel's loads need one
        x = x.clone()
    launcher(compiled_quantizer(K, masked, blocks_per_warp), x.device)(  # any calling thread: x's GPU, its current stream
        x.data_ptr(), q.data_ptr(), scale.data_ptr(), 0 if counts is None else counts.data_ptr(), rows, capacity)
    return q, scale
