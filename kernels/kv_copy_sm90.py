"""CuTeDSL kernel of :func:`kernels.kv_copy.kv_copy` (CUDA tensors only).

CTAs take (layer, block, row) items of a ``RowShape`` (grid-stride), read the block's two
page ids from the int32 tables in device memory, and move the row with
``vector_bytes``-wide accesses: every thread issues ``UNROLL`` loads before their stores
(several requests in flight per thread: the stores may cross NVLink into a peer's memory,
mapped through CUDA IPC, and a load-store-load chain would leave the link idle), then a
tail of single copies. Stores are plain ``st.global`` (never ``multimem``). Sizes and
strides (counted in vectors) and addresses (raw bytes) are int64 launch parameters read
from device memory (``kernels.kv_copy.LAUNCH_PARAMS``), so one compiled binary per access
width serves every layout and request, and a launch marshals three scalars.

Deadline guard: every thread reads ``%globaltimer`` once as it starts; past the copy's
``deadline`` (launch parameter, on that clock) it moves nothing and stores the timer's
value into the copy's ``skipped`` word (pinned host memory, read by the host once the
launch completed). A launch queued behind unfinished compute therefore writes nothing
into the destination if it only gets to run after the deadline
(``shared.transfer.cuda_ipc`` says why that matters).
"""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING

import cuda.bindings.driver as cuda_driver
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int16, Int32, Int64

from kernels._cute_comm import gptr, load_i32, load_i64
from kernels._cute_runtime import dummy_stream, launcher
from kernels.kv_copy import LAUNCH_PARAMS, VECTOR_BYTES, KVCopyError

if TYPE_CHECKING:
    from cutlass.base_dsl.jit_executor import JitCompiledFunction

# Launch shape: on 2x H200 every shape from 128 threads x 8 loads to 512 x 4, 1 to 16 CTAs per SM,
# wrote 350-367 GB/s over NVLink at 6k and 32k tokens (TP=1 and 2-head shards; 1024 x 2:
# 346-363; the copy engines' peer copy: ~393); this one was within 0.3% of the best in all
# three cases: the stores, not the launch shape, set the rate. This shape, measured alone
# (bench/kv_copy.py, 2026-11-30, recorded as 21ebb95b7f77+h29-pinned): 364 / 356 / 363 GB/s
# at 6k tokens for 32 KiB / 8 KiB / 4 KiB rows, 369 / 356 / 362 at 32k, peer copy 391-394.
# Moving the rows with the SM's bulk-copy engine (cp.async.bulk global -> shared -> peer, 7
# chunk / stage / CTA shapes, a334c51) wrote 351-368 GB/s, and this kernel run on the decode
# GPU reading over NVLink 370 against 365 writing: SM-issued NVLink traffic tops out there.
THREADS = 128
CTAS_PER_SM = 8  # items are many and short: several CTAs per SM keep every SM's loads going
UNROLL = 8  # loads in flight per thread before their stores


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


@cute.jit
def _param(params: Int64, name: cutlass.Constexpr) -> Int64:
    """Launch parameter ``name`` (``kernels.kv_copy.LAUNCH_PARAMS``) from the block at ``params``."""
    return load_i64(params + 8 * LAUNCH_PARAMS.index(name))


@cute.kernel
def _kv_copy_kernel(params: Int64, first_layer: Int32, num_layers: Int32, vector_bytes: cutlass.Constexpr):
    """Layers ``[first_layer, first_layer + num_layers)`` of the copy described by the launch
    parameters at ``params`` (device memory, ``kernels.kv_copy.LAUNCH_PARAMS``); nothing when
    the thread starts past the deadline (module doc)."""
    now = cute.arch.globaltimer()
    if now > _param(params, "deadline"):
        cute.arch.store(gptr(Int64, _param(params, "skipped"), 8), now)
    else:
        _copy_rows(params, first_layer, num_layers, vector_bytes)


@cute.jit
def _copy_rows(params: Int64, first_layer: Int32, num_layers: Int32, vector_bytes: cutlass.Constexpr):
    """The grid-stride copy of the layers' (layer, block, row) items."""
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    nblk, _, _ = cute.arch.grid_dim()
    src, dst = _param(params, "src"), _param(params, "dst")
    src_table, dst_table = _param(params, "src_table"), _param(params, "dst_table")
    items_per_layer, rows, rows_per_kv = Int32(_param(params, "items_per_layer")), Int32(_param(params, "rows")), Int32(_param(params, "rows_per_kv"))
    row_len, block = Int32(_param(params, "row_len")), Int32(_param(params, "block"))
    src_ps, dst_ps, tok = Int32(_param(params, "src_ps")), Int32(_param(params, "dst_ps")), _param(params, "tok")
    src_page, src_kv, src_head, src_layer = (_param(params, n) for n in ("src_page", "src_kv", "src_head", "src_layer"))
    dst_page, dst_kv, dst_head, dst_layer = (_param(params, n) for n in ("dst_page", "dst_kv", "dst_head", "dst_layer"))
    unrolled = row_len // (UNROLL * THREADS) * (UNROLL * THREADS)  # the part every thread moves UNROLL at a time
    for item in cutlass.range(bid, num_layers * items_per_layer, nblk):
        layer_in_group = item // items_per_layer
        rest = item - layer_in_group * items_per_layer
        layer = Int64(first_layer + layer_in_group)
        b = rest // rows
        r = rest - b * rows
        kv = r // rows_per_kv
        h = r - kv * rows_per_kv
        t = b * block
        src_at = (Int64(load_i32(src_table + Int64(t // src_ps) * 4)) * src_page + Int64(t % src_ps) * tok
                  + Int64(kv) * src_kv + Int64(h) * src_head + layer * src_layer)
        dst_at = (Int64(load_i32(dst_table + Int64(t // dst_ps) * 4)) * dst_page + Int64(t % dst_ps) * tok
                  + Int64(kv) * dst_kv + Int64(h) * dst_head + layer * dst_layer)
        row_src = src + src_at * vector_bytes
        row_dst = dst + dst_at * vector_bytes
        for i in cutlass.range(tid, unrolled, UNROLL * THREADS):
            values = [_load(row_src + Int64(i + u * THREADS) * vector_bytes, vector_bytes) for u in range(UNROLL)]
            for u in cutlass.range_constexpr(UNROLL):
                _store(row_dst + Int64(i + u * THREADS) * vector_bytes, values[u], vector_bytes)
        for i in cutlass.range(unrolled + tid, row_len, THREADS):
            _store(row_dst + Int64(i) * vector_bytes, _load(row_src + Int64(i) * vector_bytes, vector_bytes), vector_bytes)


@cute.jit
def _launch_kv_copy(params: Int64, first_layer: Int32, num_layers: Int32, grid: Int32, stream: cuda_driver.CUstream,
                    vector_bytes: cutlass.Constexpr):
    _kv_copy_kernel(params, first_layer, num_layers, vector_bytes).launch(grid=[grid, 1, 1], block=[THREADS, 1, 1], stream=stream)


def compile_args(stream: cuda_driver.CUstream) -> tuple:
    """Placeholder runtime arguments of ``_launch_kv_copy`` (only their types matter), then the stream."""
    return (Int64(0), Int32(0), Int32(1), Int32(1), stream)


@functools.cache
def compile_kv_copy(vector_bytes: int) -> JitCompiledFunction:
    """The kernel for ``vector_bytes``-wide accesses, compiled once per process (no GPU needed)."""
    if vector_bytes not in VECTOR_BYTES:
        raise KVCopyError(f"no KV copy kernel for {vector_bytes}-byte accesses (compiled widths: {VECTOR_BYTES})")
    return cute.compile(_launch_kv_copy, *compile_args(dummy_stream()), vector_bytes)


def upload(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Copy ``nbytes`` from host address ``src`` (pinned: the copy runs asynchronously, in stream
    order) to device address ``dst`` on the CUDA stream whose handle is ``stream``, in the calling
    thread's current CUDA context."""
    err = _memcpy_htod_async()(dst, src, nbytes, stream)
    if err:
        raise KVCopyError(f"uploading the KV copy's launch parameters ({nbytes} bytes) failed: CUresult {err}")


@functools.cache
def _memcpy_htod_async() -> ctypes._CFuncPtr:
    """The driver's ``cuMemcpyHtoDAsync`` through ctypes, its argument types declared once, rather
    than through cuda-python's wrapper, which converts every argument into its own types per call:
    the copy is on every transfer's set-up path (the upload took 33-65 us of a 6k-token set-up on
    2x H200 at dc753919bd30, its device switch included)."""
    function = ctypes.CDLL("libcuda.so.1").cuMemcpyHtoDAsync_v2
    function.argtypes = (ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    function.restype = ctypes.c_int
    return function


@functools.cache
def _max_ctas(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count * CTAS_PER_SM


class Launcher:
    """Launches from one parameter slot (``kernels.kv_copy._ParamSlot``, used by one copy at a
    time, then by the next) on the slot's stream: the kernel's parameter block and stream are
    fixed here, so a launch passes three integers (`kernels._cute_runtime.Launcher`: calling the
    compiled function instead converted every argument through the DSL's adapters, ~23 us in a
    loop and ~140 us once per transfer on 2x H200, 488c9f91cf04)."""

    def __init__(self, device_index: int, stream: torch.cuda.Stream, vector_bytes: int, params: int) -> None:
        self._launch = launcher(compile_kv_copy(vector_bytes), device_index)
        self._params, self._stream = params, stream.cuda_stream
        self._max_ctas = _max_ctas(device_index)

    def launch(self, first_layer: int, num_layers: int, items: int) -> None:
        """One launch of layers ``[first_layer, first_layer + num_layers)``, ``items`` (layer, block,
        row) items (``kernels.kv_copy.KVCopy`` checks everything)."""
        self._launch(self._params, first_layer, num_layers, min(items, self._max_ctas), stream=self._stream)
