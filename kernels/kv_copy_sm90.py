"""CuTeDSL kernel of :func:`kernels.kv_copy.kv_copy` (CUDA tensors only).

CTAs take (layer, block, row) items of a ``RowPlan`` (grid-stride), read the block's two
page ids from the int32 tables in device memory, and move the row with
``vector_bytes``-wide accesses: every thread issues ``UNROLL`` loads before their stores
(several requests in flight per thread: the stores may cross NVLink into a peer's memory,
mapped through CUDA IPC, and a load-store-load chain would leave the link idle), then a
tail of single copies. Stores are plain ``st.global`` (never ``multimem``). Sizes and
strides (counted in vectors) and addresses (raw bytes) are int64 launch parameters read
from device memory (``kernels.kv_copy.LAUNCH_PARAMS``), so one compiled binary per access
width serves every layout and request, and a launch marshals three scalars.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import cuda.bindings.driver as cuda_driver
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int16, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from kernels._cute_comm import gptr, load_i32, load_i64
from kernels.kv_copy import LAUNCH_PARAMS, MAX_ITEMS, VECTOR_BYTES, KVCopyError

# Launch shape: on 2x H200 every shape from 128 threads x 8 loads to 512 x 4, 1 to 16 CTAs per SM,
# wrote 350-367 GB/s over NVLink at 6k and 32k tokens (TP=1 and 2-head shards; 1024 x 2:
# 346-363; the copy engines' peer copy: ~393); this one was within 0.3% of the best in all
# three cases: the stores, not the launch shape, set the rate.
THREADS = 128
CTAS_PER_SM = 8  # items are many and short: several CTAs per SM keep every SM's loads going
UNROLL = 8  # loads in flight per thread before their stores


@dataclass(frozen=True)
class BulkShape:
    """Launch shape of the bulk path: chunks of ``chunk`` bytes through ``stages`` shared
    buffers per CTA (one warp), ``ctas_per_sm`` CTAs per SM."""

    chunk: int
    stages: int
    ctas_per_sm: int

    def __post_init__(self) -> None:
        # A buffer is refilled one chunk behind its store, so one stage would wait on a load
        # never issued; more than 48 KiB of shared memory per CTA needs an opt-in we do not make.
        if self.chunk % 16 or self.chunk <= 0 or self.stages < 2 or self.chunk * self.stages + 8 * self.stages > 48 << 10 or self.ctas_per_sm < 1:
            raise KVCopyError(f"bulk KV copy shape {self}: chunks a positive multiple of 16 bytes, at least 2 stages, "
                              "at most 48 KiB of buffers, at least 1 CTA per SM")


BULK = BulkShape(chunk=8192, stages=4, ctas_per_sm=4)


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


def _layout(params: Int64, first_layer: Int32) -> dict:
    """The copy's launch parameters (``kernels.kv_copy.LAUNCH_PARAMS``) read from device memory,
    as the values ``_row`` needs (traced inline: read once per thread, at the kernel's top)."""
    p = {name: _param(params, name) for name in LAUNCH_PARAMS}
    for name in ("items_per_layer", "rows", "rows_per_kv", "row_len", "block", "src_ps", "dst_ps"):
        p[name] = Int32(p[name])
    p["first_layer"] = first_layer
    return p


def _row(p: dict, item: Int32, vector_bytes: int) -> tuple[Int64, Int64]:
    """Source and destination byte addresses of (layer, block, row) item ``item``."""
    items_per_layer, rows = p["items_per_layer"], p["rows"]
    layer_in_group = item // items_per_layer
    rest = item - layer_in_group * items_per_layer
    layer = Int64(p["first_layer"] + layer_in_group)
    b = rest // rows
    r = rest - b * rows
    kv = r // p["rows_per_kv"]
    h = r - kv * p["rows_per_kv"]
    t = b * p["block"]
    src_at = (Int64(load_i32(p["src_table"] + Int64(t // p["src_ps"]) * 4)) * p["src_page"] + Int64(t % p["src_ps"]) * p["tok"]
              + Int64(kv) * p["src_kv"] + Int64(h) * p["src_head"] + layer * p["src_layer"])
    dst_at = (Int64(load_i32(p["dst_table"] + Int64(t // p["dst_ps"]) * 4)) * p["dst_page"] + Int64(t % p["dst_ps"]) * p["tok"]
              + Int64(kv) * p["dst_kv"] + Int64(h) * p["dst_head"] + layer * p["dst_layer"])
    return p["src"] + src_at * vector_bytes, p["dst"] + dst_at * vector_bytes


@cute.kernel
def _kv_copy_kernel(params: Int64, first_layer: Int32, num_layers: Int32, vector_bytes: cutlass.Constexpr):
    """Register path: layers ``[first_layer, first_layer + num_layers)`` of the copy described by
    the launch parameters at ``params``, each thread moving ``vector_bytes`` at a time."""
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    nblk, _, _ = cute.arch.grid_dim()
    p = _layout(params, first_layer)
    row_len = p["row_len"]
    unrolled = row_len // (UNROLL * THREADS) * (UNROLL * THREADS)  # the part every thread moves UNROLL at a time
    for item in cutlass.range(bid, num_layers * p["items_per_layer"], nblk):
        row_src, row_dst = _row(p, item, vector_bytes)
        for i in cutlass.range(tid, unrolled, UNROLL * THREADS):
            values = [_load(row_src + Int64(i + u * THREADS) * vector_bytes, vector_bytes) for u in range(UNROLL)]
            for u in cutlass.range_constexpr(UNROLL):
                _store(row_dst + Int64(i + u * THREADS) * vector_bytes, values[u], vector_bytes)
        for i in cutlass.range(unrolled + tid, row_len, THREADS):
            _store(row_dst + Int64(i) * vector_bytes, _load(row_src + Int64(i) * vector_bytes, vector_bytes), vector_bytes)


@dsl_user_op
def _bulk_load(smem: Int32, src: Int64, size: Int32, bar: Int32, *, loc=None, ip=None) -> None:
    """``size`` bytes global -> shared by the SM's bulk-copy engine, completing on mbarrier ``bar``."""
    llvm.inline_asm(None, [Int32(smem).ir_value(loc=loc, ip=ip), Int64(src).ir_value(loc=loc, ip=ip), Int32(size).ir_value(loc=loc, ip=ip),
                           Int32(bar).ir_value(loc=loc, ip=ip)],
                    "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
                    "r,l,r,r,~{memory}", has_side_effects=True, asm_dialect=0, loc=loc, ip=ip)


@dsl_user_op
def _bulk_store(dst: Int64, smem: Int32, size: Int32, *, loc=None, ip=None) -> None:
    """``size`` bytes shared -> global (a peer's memory too) by the bulk-copy engine, in the
    thread's current bulk group."""
    llvm.inline_asm(None, [Int64(dst).ir_value(loc=loc, ip=ip), Int32(smem).ir_value(loc=loc, ip=ip), Int32(size).ir_value(loc=loc, ip=ip)],
                    "cp.async.bulk.global.shared::cta.bulk_group [$0], [$1], $2;",
                    "l,r,r,~{memory}", has_side_effects=True, asm_dialect=0, loc=loc, ip=ip)


def _chunk(p: dict, c: Int32, per_row: Int32, chunk: int) -> tuple[Int64, Int64, Int32]:
    """Source, destination and size in bytes of chunk ``c``: chunk ``c % per_row`` of item ``c // per_row``."""
    item = c // per_row
    j = c - item * per_row
    row_src, row_dst = _row(p, item, 16)
    offset = j * chunk
    return row_src + Int64(offset), row_dst + Int64(offset), cutlass.min(p["row_len"] * 16 - offset, chunk)


@cute.kernel
def _kv_copy_bulk_kernel(params: Int64, first_layer: Int32, num_layers: Int32, chunk: cutlass.Constexpr, stages: cutlass.Constexpr):
    """Bulk path (16-byte-aligned rows): the rows cut into chunks of at most ``chunk`` bytes, which
    the CTAs take grid-stride; one thread per CTA moves its chunks through ``stages`` shared
    buffers with the bulk-copy engine: global -> shared (``stages`` loads ahead, on one
    mbarrier per buffer), shared -> destination (one bulk group per chunk; a buffer is
    reloaded once the store before the latest has read it)."""
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    nblk, _, _ = cute.arch.grid_dim()
    smem = cutlass.memory.SmemAllocator()
    bars = smem.allocate_array(Int64, stages, byte_alignment=8)
    buf = smem.allocate(stages * chunk, byte_alignment=128).toint()
    if tid == 0:
        for s in cutlass.range_constexpr(stages):
            cute.arch.mbarrier_init(bars + s, 1)
        cute.arch.mbarrier_init_fence()
        p = _layout(params, first_layer)
        per_row = (p["row_len"] * 16 + (chunk - 1)) // chunk
        total = num_layers * p["items_per_layer"] * per_row
        n = (total - bid + nblk - 1) // nblk  # this CTA's chunks: bid, bid + nblk, ...
        for k in cutlass.range_constexpr(stages):
            if k < n:
                src, _, size = _chunk(p, bid + k * nblk, per_row, chunk)
                cute.arch.mbarrier_arrive_and_expect_tx(bars + k, size)
                _bulk_load(buf + k * chunk, src, size, (bars + k).toint())
        for k in cutlass.range(0, n):
            s = k % stages
            cute.arch.mbarrier_wait(bars + s, (k // stages) % 2)
            _, dst, size = _chunk(p, bid + k * nblk, per_row, chunk)
            _bulk_store(dst, buf + s * chunk, size)
            cute.arch.cp_async_bulk_commit_group()
            refill = k - 1 + stages  # into the buffer of chunk k - 1, once its store has read it
            if k >= 1 and refill < n:
                cute.arch.cp_async_bulk_wait_group(1, read=True)
                r = (k - 1) % stages
                src, _, size = _chunk(p, bid + refill * nblk, per_row, chunk)
                cute.arch.mbarrier_arrive_and_expect_tx(bars + r, size)
                _bulk_load(buf + r * chunk, src, size, (bars + r).toint())
        cute.arch.cp_async_bulk_wait_group(0)  # every write done before the kernel ends


@cute.jit
def _launch_kv_copy(params: Int64, first_layer: Int32, num_layers: Int32, grid: Int32, stream: cuda_driver.CUstream,
                    vector_bytes: cutlass.Constexpr, bulk: cutlass.Constexpr):
    if cutlass.const_expr(bulk is None):
        _kv_copy_kernel(params, first_layer, num_layers, vector_bytes).launch(grid=[grid, 1, 1], block=[THREADS, 1, 1], stream=stream)
    else:
        _kv_copy_bulk_kernel(params, first_layer, num_layers, bulk.chunk, bulk.stages).launch(grid=[grid, 1, 1], block=[32, 1, 1], stream=stream)


def compile_args(stream: cuda_driver.CUstream) -> tuple:
    """Placeholder runtime arguments of ``_launch_kv_copy`` (only their types matter), then the stream."""
    return (Int64(0), Int32(0), Int32(1), Int32(1), stream)


def path_for(vector_bytes: int) -> BulkShape | None:
    """The bulk path's shape for rows of ``vector_bytes``-wide accesses (16: the bulk-copy engine
    takes 16-byte-aligned sizes and addresses), or None: the register path."""
    return BULK if vector_bytes == 16 else None


def compile_kv_copy(vector_bytes: int, bulk: BulkShape | None | str = "default"):
    """The kernel for ``vector_bytes``-wide rows on path ``bulk`` (a ``BulkShape``, None: the
    register path, ``"default"``: ``path_for``), compiled once per process (no GPU needed)."""
    if vector_bytes not in VECTOR_BYTES:
        raise KVCopyError(f"no KV copy kernel for {vector_bytes}-byte accesses (compiled widths: {VECTOR_BYTES})")
    bulk = path_for(vector_bytes) if bulk == "default" else bulk
    if bulk is not None and vector_bytes != 16:
        raise KVCopyError(f"the bulk KV copy needs 16-byte rows, not {vector_bytes}-byte ones")
    return _compiled(vector_bytes, bulk)


@functools.cache
def _compiled(vector_bytes: int, bulk: BulkShape | None):
    from kernels._cute_runtime import dummy_stream

    return cute.compile(_launch_kv_copy, *compile_args(dummy_stream()), vector_bytes, bulk)


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch(device: torch.device, stream: torch.cuda.Stream, vector_bytes: int, params: int, first_layer: int, num_layers: int, items: int,
           row_bytes: int, bulk: BulkShape | None | str = "default") -> None:
    """One launch on ``stream`` of layers ``[first_layer, first_layer + num_layers)``, ``items``
    (layer, block, row) items of ``row_bytes`` each, of the copy whose launch parameters are
    at device address ``params`` (``kernels.kv_copy.KVCopy``, which checks everything)."""
    bulk = path_for(vector_bytes) if bulk == "default" else bulk
    units = items if bulk is None else items * -(-row_bytes // bulk.chunk)  # what the CTAs take grid-stride
    if units > MAX_ITEMS:
        raise KVCopyError(f"KV copy of {units} work items (rows or chunks) in one launch, above the kernel's {MAX_ITEMS}")
    grid = min(units, _sms(device) * (CTAS_PER_SM if bulk is None else bulk.ctas_per_sm))
    with torch.cuda.device(device):  # the launch runs in the pools' device's primary context
        compile_kv_copy(vector_bytes, bulk)(params, first_layer, num_layers, grid, cuda_driver.CUstream(stream.cuda_stream))
