"""Prefill expert-parallel exchange inside a TP group (DESIGN §6, "prefill MoE").

Every rank of the group holds the same tokens (inputs are replicated) and a
contiguous range of experts. Per MoE layer:

1. `ep_select` gathers the rows of the tokens routed to this rank's experts into
   the grouped-GEMM *contiguous* layout: ``rows[capacity, H]`` grouped by local
   expert, group ``e`` at ``rows[offsets[e]:offsets[e] + counts[e]]`` (``offsets``
   int32 ``[E_local + 1]`` on the GPU, group starts rounded up to ``align`` rows),
   plus ``row_of[T, topk]`` (the row of each (token, slot), -1 where the expert is
   remote). ``capacity = T*topk + E_local*(align-1)`` rows is fixed by the shapes,
   so nothing waits for the host and the step can be graph-captured.
2. the expert GEMMs run on ``rows`` (grouped GEMM, another module).
3. `ep_combine` accumulates ``out[t] = sum_j w[t, j] * y[row_of[t, j]]`` in fp32 in
   slot order j = 0..topk-1 (remote slots contribute nothing) and writes bf16.
4. an all-reduce over the group (`kernels.allreduce`) sums the partial outputs.

Row order inside an expert's group comes from atomics and may differ between
runs; results do not, because the combine walks (token, slot) pairs, not rows.

GPU path: three CuTeDSL kernels for the selection (count, offsets, scatter) and
one for the combine. The scatter moves rows as bytes: bf16 rows, or FP8 rows
quantized before the gather with their scale rows beside them (``x_scale``, what
FP8 experts take). CPU path and reference: the torch functions below.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import cuda.bindings.driver as cuda_driver
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64

from kernels._cute_comm import (VEC_BYTES, gptr, grid_stride, load_i32, load_vec, load_vec_f32, store_i32, store_vec,
                                store_vec_f32, wait_for_previous_kernel)
from kernels.act_quant import QUANT_BLOCK, scale_row_stride

if TYPE_CHECKING:
    from cutlass.base_dsl.jit_executor import JitCompiledFunction

THREADS = 256
MAX_LOCAL_EXPERTS = 1024
COUNT_CTAS = 32  # the count kernel's most CTAs: each adds up to E_local counts to the global ones at its end


class EpExchangeError(ValueError):
    """Bad routing tensors or shapes for the prefill expert exchange."""


@dataclass
class SelectedRows:
    """Output of `ep_select`: the grouped-GEMM input and how to undo it."""

    rows: torch.Tensor  # [capacity, H], grouped by local expert
    offsets: torch.Tensor  # int32 [E_local + 1], group starts (aligned); offsets[-1] = rows in use
    counts: torch.Tensor  # int32 [E_local], rows of each group (without padding)
    row_of: torch.Tensor  # int32 [T, topk], row of each (token, slot) or -1
    scales: torch.Tensor | None = None  # fp32 [capacity, H/128]: FP8 rows' scales, moved with them (``x_scale``)


def capacity(num_tokens: int, topk: int, num_local_experts: int, align: int) -> int:
    return num_tokens * topk + num_local_experts * (align - 1)


def _check(x: torch.Tensor, topk_ids: torch.Tensor, expert_start: int, num_local_experts: int, align: int,
           x_scale: torch.Tensor | None = None) -> None:
    if x.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise EpExchangeError(f"x must be [T, H] and topk_ids [T, topk], got {tuple(x.shape)} and {tuple(topk_ids.shape)}")
    if x_scale is not None and (x.dtype != torch.float8_e4m3fn or x_scale.dtype != torch.float32
                                or tuple(x_scale.shape) != (x.shape[0], -(-x.shape[1] // QUANT_BLOCK))
                                or x_scale.device != x.device):
        raise EpExchangeError(f"x_scale goes with float8_e4m3fn rows: float32 [T, H/{QUANT_BLOCK}] on x's device, got "
                              f"x {x.dtype} {tuple(x.shape)} and x_scale {x_scale.dtype} {tuple(x_scale.shape)}")
    if not 1 <= num_local_experts <= MAX_LOCAL_EXPERTS or expert_start < 0 or align < 1:
        raise EpExchangeError(f"bad expert range start={expert_start} count={num_local_experts} align={align}")
    if x.device != topk_ids.device:
        raise EpExchangeError(f"x on {x.device} but topk_ids on {topk_ids.device}")


# --------------------------------------------------------------------------- reference


def ep_select_reference(
    x: torch.Tensor, topk_ids: torch.Tensor, expert_start: int, num_local_experts: int, align: int = 1,
    x_scale: torch.Tensor | None = None,
) -> SelectedRows:
    """Torch definition of `ep_select`; rows inside a group ordered by (token, slot)."""
    _check(x, topk_ids, expert_start, num_local_experts, align, x_scale)
    t, k = topk_ids.shape
    local = topk_ids.long() - expert_start
    is_local = (local >= 0) & (local < num_local_experts)
    counts = torch.zeros(num_local_experts, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, local[is_local], torch.ones_like(local[is_local]))
    padded = (counts + align - 1) // align * align
    offsets = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=x.device)
    offsets[1:] = torch.cumsum(padded, 0)
    flat_local = local.reshape(-1)
    flat_is_local = is_local.reshape(-1)
    order = torch.argsort(torch.where(flat_is_local, flat_local, num_local_experts), stable=True)
    n_sel = int(flat_is_local.sum())
    sel = order[:n_sel]
    sel_expert = flat_local[sel]
    group_start_in_order = torch.cumsum(counts, 0) - counts  # where each expert's entries begin in `order`
    rank_in_group = torch.arange(n_sel, device=x.device) - group_start_in_order[sel_expert]
    pos = offsets[sel_expert] + rank_in_group
    row_of = torch.full((t * k,), -1, dtype=torch.int64, device=x.device)
    row_of[sel] = pos
    rows = torch.zeros(capacity(t, k, num_local_experts, align), x.shape[1], dtype=x.dtype, device=x.device)
    rows[pos] = x[sel // k]
    scales = None
    if x_scale is not None:
        scales = torch.zeros(rows.shape[0], x_scale.shape[1], dtype=x_scale.dtype, device=x.device)
        scales[pos] = x_scale[sel // k]
    return SelectedRows(rows, offsets.int(), counts.int(), row_of.view(t, k).int(), scales)


def ep_combine_reference(y: torch.Tensor, row_of: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Torch definition of `ep_combine`: fp32 sum over slots in order, cast to ``y.dtype``."""
    t, k = row_of.shape
    acc = torch.zeros(t, y.shape[1], dtype=torch.float32, device=y.device)
    for j in range(k):
        rows = row_of[:, j].long()
        mask = rows >= 0
        contrib = topk_weights[:, j : j + 1].float() * y[rows.clamp(min=0)].float()
        acc = acc + torch.where(mask[:, None], contrib, torch.zeros_like(contrib))
    return acc.to(y.dtype)


# --------------------------------------------------------------------------- kernels


@cute.kernel
def _count_kernel(topk_ids: Int64, n_entries: Int32, expert_start: Int32, num_local: Int32, counts: Int64,
                  id_bytes: cutlass.Constexpr):
    # Each CTA counts its entries in shared memory and adds its non-zero counts to the global ones: a prefill
    # step's 65536 (token, slot) entries over 128 experts made 512 same-address global atomics per counter.
    # One H200, bench.moe_layer (grouped_moe, FP8 experts), H N N H: Qwen3-30B at 4096 / 16384 tokens
    # 498.5, 492.9 / 1804, 1797 us -> 487.7, 487.2 / 1787, 1754 ([f4403c1e7f22+cnt] against [f4403c1e7f22]); at 64
    # tokens (decode) level, 164.6, 165.0 against 164.9, 166.2 us ([bde834ced79d] against [f4403c1e7f22], another call).
    tid, _, _ = cute.arch.thread_idx()
    hist = cutlass.memory.SmemAllocator().allocate_tensor(Int32, cute.make_layout(MAX_LOCAL_EXPERTS), 16)
    for e in cutlass.range(tid, num_local, THREADS):
        hist[e] = Int32(0)
    cute.arch.sync_threads()
    wait_for_previous_kernel()
    first, stride = grid_stride()
    for i in cutlass.range(first, n_entries, stride):
        le = load_i32(topk_ids + Int64(i) * id_bytes) - expert_start
        if le >= 0 and le < num_local:
            cute.arch.atomic_add(hist.iterator + le, Int32(1), sem="relaxed", scope="cta")
    cute.arch.sync_threads()
    for e in cutlass.range(tid, num_local, THREADS):
        n = hist[e]
        if n > 0:
            cute.arch.atomic_add(gptr(Int32, counts + Int64(e) * 4, 4), n, sem="relaxed", scope="gpu")


@cute.kernel
def _offsets_kernel(counts: Int64, num_local: Int32, align: Int32, offsets: Int64, cursors: Int64):
    # One warp: lane l owns a run of ceil(E_local / 32) experts, sums their aligned counts, and a warp scan
    # turns the runs' sums into their starts.  At most 32 loads a lane (E_local <= 1024), where one thread
    # per expert summing every count before its own took 7 us for 128 experts on an H200 (a decode step
    # runs this once per MoE layer).
    wait_for_previous_kernel()
    lane = cute.arch.lane_idx()
    per = (num_local + 31) // 32
    first = lane * per
    last = first + per
    if last > num_local:
        last = num_local
    run = Int32(0)
    for e in cutlass.range(first, last, 1):
        run = run + (load_i32(counts + Int64(e) * 4) + align - 1) // align * align
    end = run  # inclusive scan over the lanes: where lane l's run ends
    for step in cutlass.range_constexpr(5):
        other = cute.arch.shuffle_sync_up(end, 1 << step)
        if lane >= (1 << step):
            end = end + other
    start = end - run
    for e in cutlass.range(first, last, 1):
        store_i32(offsets + Int64(e) * 4, start)
        store_i32(cursors + Int64(e) * 4, Int32(0))
        start = start + (load_i32(counts + Int64(e) * 4) + align - 1) // align * align
    if lane == 31:
        store_i32(offsets + Int64(num_local) * 4, end)


@cute.jit
def _copy_row(src: Int64, dst_rows: Int64, row_bytes: Int32, dests, tid: Int32, nthr: Int32, topk: cutlass.Constexpr):
    """Row ``src`` (``row_bytes``, a multiple of 16) to row ``dests[j]`` of ``dst_rows`` for every ``dests[j] >= 0``:
    bytes as they are, whatever they encode."""
    words = VEC_BYTES // 4
    for b in cutlass.range(tid * VEC_BYTES, row_bytes, nthr * VEC_BYTES):
        v = load_vec(src + Int64(b), Int32, words, words)
        for j in cutlass.range_constexpr(topk):
            if dests[j] >= 0:
                store_vec(dst_rows + Int64(dests[j]) * row_bytes + Int64(b), v, Int32, words, words)


@cute.kernel
def _scatter_kernel(
    x: Int64, topk_ids: Int64, n_tokens: Int32, row_bytes: Int32, expert_start: Int32, num_local: Int32,
    offsets: Int64, cursors: Int64, row_of: Int64, rows: Int64, scales: Int64, scale_rows: Int64, scale_bytes: Int32,
    topk: cutlass.Constexpr, id_bytes: cutlass.Constexpr,
):
    wait_for_previous_kernel()
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    nthr, _, _ = cute.arch.block_dim()
    nblk, _, _ = cute.arch.grid_dim()
    for t in cutlass.range(bid, n_tokens, nblk):
        if tid < topk:
            entry = Int64(t) * topk + tid
            le = load_i32(topk_ids + entry * id_bytes) - expert_start
            pos = Int32(-1)
            if le >= 0 and le < num_local:
                slot = cute.arch.atomic_add(gptr(Int32, cursors + Int64(le) * 4, 4), Int32(1), sem="relaxed", scope="gpu")
                pos = load_i32(offsets + Int64(le) * 4) + slot
            store_i32(row_of + entry * 4, pos)
        cute.arch.sync_threads()
        dests = [load_i32(row_of + (Int64(t) * topk + j) * 4) for j in range(topk)]
        _copy_row(x + Int64(t) * Int64(row_bytes), rows, row_bytes, dests, tid, nthr, topk)
        _copy_row(scales + Int64(t) * Int64(scale_bytes), scale_rows, scale_bytes, dests, tid, nthr, topk)  # none: 0 bytes
        cute.arch.sync_threads()


@cute.kernel
def _combine_kernel(
    y: Int64, row_of: Int64, weights: Int64, n_tokens: Int32, hidden: Int32, out: Int64,
    dtype: cutlass.Constexpr, topk: cutlass.Constexpr, weight_dtype: cutlass.Constexpr,
):
    wait_for_previous_kernel()
    vec = VEC_BYTES * 8 // dtype.width
    esz = dtype.width // 8
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    nthr, _, _ = cute.arch.block_dim()
    nblk, _, _ = cute.arch.grid_dim()
    row_bytes = Int64(hidden) * esz
    for t in cutlass.range(bid, n_tokens, nblk):
        srcs = [load_i32(row_of + (Int64(t) * topk + j) * 4) for j in range(topk)]
        w_bytes = weight_dtype.width // 8
        ws = [load_vec_f32(weights + (Int64(t) * topk + j) * w_bytes, weight_dtype, 1, 1, w_bytes)[0] for j in range(topk)]
        for h in cutlass.range(tid * vec, hidden, nthr * vec):
            acc = cute.make_rmem_tensor((vec,), Float32)
            acc.fill(0.0)
            for j in cutlass.range_constexpr(topk):
                if srcs[j] >= 0:
                    v = load_vec_f32(y + Int64(srcs[j]) * row_bytes + Int64(h) * esz, dtype, vec, vec)
                    acc.store(acc.load() + v.load() * ws[j])
            store_vec_f32(out + Int64(t) * row_bytes + Int64(h) * esz, acc, dtype, vec, vec)


@cute.jit
def _launch_select(
    x: Int64, topk_ids: Int64, n_tokens: Int32, row_bytes: Int32, expert_start: Int32, num_local: Int32, align: Int32,
    counts: Int64, offsets: Int64, cursors: Int64, row_of: Int64, rows: Int64, scales: Int64, scale_rows: Int64,
    scale_bytes: Int32, grid: Int32, stream: cuda_driver.CUstream, topk: cutlass.Constexpr, id_bytes: cutlass.Constexpr,
):
    n_entries = n_tokens * topk
    _count_kernel(topk_ids, n_entries, expert_start, num_local, counts, id_bytes).launch(
        grid=[cutlass.min((n_entries + THREADS - 1) // THREADS, COUNT_CTAS), 1, 1], block=[THREADS, 1, 1],
        stream=stream, use_pdl=True
    )
    _offsets_kernel(counts, num_local, align, offsets, cursors).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream,
                                                                       use_pdl=True)
    _scatter_kernel(
        x, topk_ids, n_tokens, row_bytes, expert_start, num_local, offsets, cursors, row_of, rows, scales, scale_rows,
        scale_bytes, topk, id_bytes,
    ).launch(grid=[grid, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=True)


@cute.jit
def _launch_combine(
    y: Int64, row_of: Int64, weights: Int64, n_tokens: Int32, hidden: Int32, out: Int64, grid: Int32,
    stream: cuda_driver.CUstream, dtype: cutlass.Constexpr, topk: cutlass.Constexpr, weight_dtype: cutlass.Constexpr,
):
    _combine_kernel(y, row_of, weights, n_tokens, hidden, out, dtype, topk, weight_dtype).launch(
        grid=[grid, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=True
    )


_CUTE_DTYPES = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16, torch.float32: cutlass.Float32}
_ROW_DTYPES = (*_CUTE_DTYPES, torch.float8_e4m3fn)  # what ep_select moves (as bytes); the combine sums _CUTE_DTYPES


# Routing tensors as the router gives them (int64 ids, weights in the activation dtype) or narrower: the kernels
# read them at their own width, so no conversion kernel runs before them (in a decode step of Qwen3-30B shapes at
# batch 64 the two conversions took 2.8 + 1.6 us per MoE layer, more than the select or the combine kernel).
_ID_BYTES = {torch.int32: 4, torch.int64: 8}  # ids are read as their low 32 bits (little-endian)


@functools.cache
def compile_select(topk: int, ids_dtype: torch.dtype = torch.int64) -> JitCompiledFunction:
    """The selection kernels: rows (and scale rows) are moved as bytes, so one build serves every row dtype."""
    from kernels._cute_runtime import dummy_stream

    z, i = Int64(0), Int32(0)
    return cute.compile(_launch_select, z, z, i, i, i, i, i, z, z, z, z, z, z, z, i, Int32(1), dummy_stream(), topk,
                        _ID_BYTES[ids_dtype])


@functools.cache
def compile_combine(dtype: torch.dtype, topk: int, weights_dtype: torch.dtype = torch.bfloat16) -> JitCompiledFunction:
    from kernels._cute_runtime import dummy_stream

    z, i = Int64(0), Int32(0)
    return cute.compile(_launch_combine, z, z, z, i, i, z, Int32(1), dummy_stream(), _CUTE_DTYPES[dtype], topk,
                        _CUTE_DTYPES[weights_dtype])


def _grid(n_tokens: int) -> int:
    return max(1, min(n_tokens, 132 * 8))


# --------------------------------------------------------------------------- public ops


def ep_select(
    x: torch.Tensor, topk_ids: torch.Tensor, expert_start: int, num_local_experts: int, align: int = 1,
    x_scale: torch.Tensor | None = None,
) -> SelectedRows:
    """Gather the rows routed to experts ``[expert_start, expert_start + num_local_experts)``.

    ``x`` bf16, fp16, fp32 or, quantized before the gather, E4M3 with its per-token scales ``x_scale``
    (`kernels.act_quant.quantize_act`), which then move with their rows (``SelectedRows.scales``, rows padded
    as the quantizer pads them on CUDA).  CUDA tensors use the CuTeDSL kernels (no host synchronisation), others
    the torch reference.
    """
    if not x.is_cuda:
        return ep_select_reference(x, topk_ids, expert_start, num_local_experts, align, x_scale)
    from kernels._cute_runtime import launcher

    _check(x, topk_ids, expert_start, num_local_experts, align, x_scale)
    if x.dtype not in _ROW_DTYPES or x.shape[1] * x.element_size() % VEC_BYTES or not x.is_contiguous():
        raise EpExchangeError(f"x must be contiguous {list(_ROW_DTYPES)} with rows a multiple of {VEC_BYTES} bytes")
    scale_stride = 0 if x_scale is None else scale_row_stride(x_scale.shape[1])
    if x_scale is not None and (x_scale.stride() != (scale_stride, 1) or x_scale.data_ptr() % VEC_BYTES):
        raise EpExchangeError(f"x_scale must be the quantizer's rows, {scale_stride} floats apart and 16-byte aligned")
    t, k = topk_ids.shape
    ids = (topk_ids if topk_ids.dtype in _ID_BYTES else topk_ids.to(torch.int32)).contiguous()
    # counts (zeroed: the count kernel adds to them; with no tokens all three stay zero), offsets and cursors
    # in one allocation: each tensor allocated costs the host microseconds, on a path the host's issue rate bounds
    words = torch.zeros(3 * num_local_experts + 1, dtype=torch.int32, device=x.device)
    counts, offsets, cursors = words.split((num_local_experts, num_local_experts + 1, num_local_experts))
    row_of = torch.empty(t, k, dtype=torch.int32, device=x.device)
    rows = torch.empty(capacity(t, k, num_local_experts, align), x.shape[1], dtype=x.dtype, device=x.device)
    scales = None if x_scale is None else torch.empty(rows.shape[0], scale_stride, dtype=torch.float32,
                                                      device=x.device)
    if t > 0:
        launcher(compile_select(k, ids.dtype), x.device)(
            x.data_ptr(), ids.data_ptr(), t, x.shape[1] * x.element_size(), expert_start, num_local_experts, align,
            counts.data_ptr(), offsets.data_ptr(), cursors.data_ptr(), row_of.data_ptr(), rows.data_ptr(),
            0 if x_scale is None else x_scale.data_ptr(), 0 if scales is None else scales.data_ptr(), scale_stride * 4, _grid(t))
    return SelectedRows(rows, offsets, counts, row_of, None if scales is None else scales[:, :x_scale.shape[1]])


def ep_combine(y: torch.Tensor, row_of: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum of each token's local expert outputs: ``[T, H]`` in ``y.dtype``."""
    if not y.is_cuda:
        return ep_combine_reference(y, row_of, topk_weights)
    from kernels._cute_runtime import launcher

    if row_of.shape != topk_weights.shape or y.dim() != 2 or not y.is_contiguous():
        raise EpExchangeError(f"y must be contiguous [rows, H]; row_of {tuple(row_of.shape)} vs weights {tuple(topk_weights.shape)}")
    if y.dtype not in _CUTE_DTYPES or y.shape[1] * y.element_size() % VEC_BYTES:
        raise EpExchangeError(f"y must be {list(_CUTE_DTYPES)} with rows a multiple of {VEC_BYTES} bytes")
    t, k = row_of.shape
    out = torch.empty(t, y.shape[1], dtype=y.dtype, device=y.device)
    if t > 0:
        w = (topk_weights if topk_weights.dtype in _CUTE_DTYPES else topk_weights.to(torch.float32)).contiguous()
        ro = row_of.to(torch.int32).contiguous()
        launcher(compile_combine(y.dtype, k, w.dtype), y.device)(
            y.data_ptr(), ro.data_ptr(), w.data_ptr(), t, y.shape[1], out.data_ptr(), _grid(t))
    return out
