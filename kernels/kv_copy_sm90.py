"""CuTeDSL kernel of :func:`kernels.kv_copy.kv_copy` (CUDA tensors only).

CTAs take (layer, block, row) items of a ``RowPlan`` (grid-stride), read the block's two
page ids from the int32 tables in device memory, and move the row with
``vector_bytes``-wide accesses: every thread issues ``UNROLL`` loads before their stores
(several requests in flight per thread: the stores may cross NVLink into a peer's memory,
mapped through CUDA IPC, and a load-store-load chain would leave the link idle), then a
tail of single copies. Stores are plain ``st.global`` (never ``multimem``). Sizes and
strides are runtime scalars counted in vectors, addresses raw ``Int64`` bytes, so one
compiled binary per access width serves every layout and request.
"""

from __future__ import annotations

import functools

import cuda.bindings.driver as cuda_driver
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int16, Int32, Int64

from kernels._cute_comm import gptr, load_i32
from kernels.kv_copy import VECTOR_BYTES, KVCopyError

THREADS = 256
CTAS_PER_SM = 8  # items are many and short: several CTAs per SM keep every SM's loads going
UNROLL = 4  # loads in flight per thread before their stores


def _words(vector_bytes: int) -> tuple[type, int]:
    """(word type, words) of one ``vector_bytes``-wide access."""
    return (Int16, 1) if vector_bytes == 2 else (Int32, vector_bytes // 4)


@cute.jit
def _load(addr: Int64, vector_bytes: cutlass.Constexpr):
    word, n = _words(vector_bytes)
    return cute.make_tensor(gptr(word, addr, vector_bytes), cute.make_layout(n)).load()


@cute.jit
def _store(addr: Int64, value, vector_bytes: cutlass.Constexpr):
    word, n = _words(vector_bytes)
    cute.make_tensor(gptr(word, addr, vector_bytes), cute.make_layout(n)).store(value)


@cute.kernel
def _kv_copy_kernel(
    src: Int64, dst: Int64, src_table: Int64, dst_table: Int64,
    num_items: Int32, items_per_layer: Int32, rows: Int32, rows_per_kv: Int32, row_len: Int32,
    block: Int32, src_ps: Int32, dst_ps: Int32, tok: Int64,
    src_page: Int64, src_kv: Int64, src_head: Int64, src_layer: Int64,
    dst_page: Int64, dst_kv: Int64, dst_head: Int64, dst_layer: Int64,
    vector_bytes: cutlass.Constexpr,
):
    """``src`` / ``dst``: byte addresses of the group's first layer (``dst`` also of the first
    destination head); ``tok`` and the strides count vectors (``tok``: one token of one head)."""
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    nblk, _, _ = cute.arch.grid_dim()
    unrolled = row_len // (UNROLL * THREADS) * (UNROLL * THREADS)  # the part every thread moves UNROLL at a time
    for item in cutlass.range(bid, num_items, nblk):
        layer = item // items_per_layer
        rest = item - layer * items_per_layer
        b = rest // rows
        r = rest - b * rows
        kv = r // rows_per_kv
        h = r - kv * rows_per_kv
        t = b * block
        src_at = (Int64(load_i32(src_table + Int64(t // src_ps) * 4)) * src_page + Int64(t % src_ps) * tok
                  + Int64(kv) * src_kv + Int64(h) * src_head + Int64(layer) * src_layer)
        dst_at = (Int64(load_i32(dst_table + Int64(t // dst_ps) * 4)) * dst_page + Int64(t % dst_ps) * tok
                  + Int64(kv) * dst_kv + Int64(h) * dst_head + Int64(layer) * dst_layer)
        row_src = src + src_at * vector_bytes
        row_dst = dst + dst_at * vector_bytes
        for i in cutlass.range(tid, unrolled, UNROLL * THREADS):
            values = [_load(row_src + Int64(i + u * THREADS) * vector_bytes, vector_bytes) for u in range(UNROLL)]
            for u in cutlass.range_constexpr(UNROLL):
                _store(row_dst + Int64(i + u * THREADS) * vector_bytes, values[u], vector_bytes)
        for i in cutlass.range(unrolled + tid, row_len, THREADS):
            _store(row_dst + Int64(i) * vector_bytes, _load(row_src + Int64(i) * vector_bytes, vector_bytes), vector_bytes)


@cute.jit
def _launch_kv_copy(
    src: Int64, dst: Int64, src_table: Int64, dst_table: Int64,
    num_items: Int32, items_per_layer: Int32, rows: Int32, rows_per_kv: Int32, row_len: Int32,
    block: Int32, src_ps: Int32, dst_ps: Int32, tok: Int64,
    src_page: Int64, src_kv: Int64, src_head: Int64, src_layer: Int64,
    dst_page: Int64, dst_kv: Int64, dst_head: Int64, dst_layer: Int64,
    grid: Int32, stream: cuda_driver.CUstream, vector_bytes: cutlass.Constexpr,
):
    _kv_copy_kernel(
        src, dst, src_table, dst_table, num_items, items_per_layer, rows, rows_per_kv, row_len, block, src_ps, dst_ps, tok,
        src_page, src_kv, src_head, src_layer, dst_page, dst_kv, dst_head, dst_layer, vector_bytes,
    ).launch(grid=[grid, 1, 1], block=[THREADS, 1, 1], stream=stream)


def compile_args(stream: cuda_driver.CUstream) -> tuple:
    """Placeholder runtime arguments of ``_launch_kv_copy`` (only their types matter), then the stream."""
    z, i = Int64(0), Int32(1)
    return (z, z, z, z, i, i, i, i, i, i, i, i, z, z, z, z, z, z, z, z, z, i, stream)


@functools.cache
def compile_kv_copy(vector_bytes: int):
    """The kernel for ``vector_bytes``-wide accesses, compiled once per process (no GPU needed)."""
    from kernels._cute_runtime import dummy_stream

    if vector_bytes not in VECTOR_BYTES:
        raise KVCopyError(f"no KV copy kernel for {vector_bytes}-byte accesses (compiled widths: {VECTOR_BYTES})")
    return cute.compile(_launch_kv_copy, *compile_args(dummy_stream()), vector_bytes)


@functools.cache
def _max_ctas(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count * CTAS_PER_SM


def launch(device: torch.device, stream: torch.cuda.Stream, vector_bytes: int, addresses: tuple[int, int, int, int],
           items: int, items_per_layer: int, shape: tuple[int, ...], src_strides: tuple[int, ...], dst_strides: tuple[int, ...]) -> None:
    """One launch on ``stream``: ``addresses`` (src, dst, src table, dst table), ``shape`` (rows,
    rows per K/V half, row length, block, src page size, dst page size, token), strides
    (page, K/V, head, layer) in vectors. Arguments are checked by ``kv_copy``."""
    with torch.cuda.device(device):  # the launch runs in the pools' device's primary context
        compile_kv_copy(vector_bytes)(
            *addresses, items, items_per_layer, *shape, *src_strides, *dst_strides,
            min(items, _max_ctas(device)), cuda_driver.CUstream(stream.cuda_stream),
        )
