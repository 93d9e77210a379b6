"""Direct writes of a prefill rank's KV shard into a decode rank's pages (same-host CUDA IPC path).

The sender copies its heads ``[h0, h1)`` of a group of layers straight from its own KV
pages into the decode rank's reserved pages (its storage mapped through CUDA IPC,
``cuda_ipc.open_export``): no local pack, no staging buffer, one pass over the bytes,
one kernel launch per group whatever the layouts.

Both storages are ``[layers, pages, 2, heads, page_size, head_dim]`` (HND inside a
page). The token axis is cut into blocks of ``gcd`` of the two page sizes, so a block
lies in one page on each side; a block's bytes are rows that are contiguous on both
sides: with equal page sizes a row is a whole page (all heads, TP=1) or one K/V half of
it (a head-range shard), with unequal page sizes one head's block. The kernel's CTAs
take (layer, block, row) items, look the two page ids up in the page tables on the GPU
and move the row with 16-byte loads and stores, several in flight per thread, the
stores going over NVLink into the peer. The last block is copied whole: its slots past
``num_tokens`` lie in pages reserved for this request on both sides and are never read
before the decode writes them.

The kernel is CUDA C compiled once per process with NVRTC (``cuda-python``) and
launched with the driver API on the caller's stream. Measured on 2x H200
(bench/results/kv_transfer.jsonl, a9596d4384e4): ~370 GB/s over NVLink at 6k and 32k
tokens (the copy engines' peer copy: 378-393), where 2-D copy-engine copies of the same
rows (one ``cudaMemcpy2DAsync`` per page, rows = layers; 25564ebbe612) ran at ~210 GB/s
and cost ~7 us of host time per call; they were dropped.

The torch reference of the kernel is the UCX path's ``shard.pack_layers`` followed by
``shard.scatter_layers`` (the GPU tests compare the two).
"""

from __future__ import annotations

import ctypes
import math
from functools import cache

import numpy as np
import torch

_THREADS = 256  # the kernel's block size (its unrolled loop assumes it)
_CTAS_PER_SM = 8
_modules: list[object] = []  # loaded kernel modules, kept for the life of the process

_KERNEL_SOURCE = r"""
// Items are (layer, block, row); all sizes and strides in vectors of T. The tables hold the
// sequence's page ids on each side; src / dst point at the group's first layer (dst also
// at the shard's first head).
#define KV_DIRECT_COPY(NAME, T)                                                                  \
extern "C" __global__ void __launch_bounds__(256) NAME(                                         \
    const T* __restrict__ src, T* __restrict__ dst,                                             \
    const int* __restrict__ src_table, const int* __restrict__ dst_table,                       \
    long long num_items, long long items_per_layer, int rows, int rows_per_kv, int row_len,     \
    int block, int src_ps, int dst_ps, long long tok,                                           \
    long long src_page, long long src_kv, long long src_head, long long src_layer,              \
    long long dst_page, long long dst_kv, long long dst_head, long long dst_layer) {            \
  for (long long item = blockIdx.x; item < num_items; item += gridDim.x) {                      \
    const long long layer = item / items_per_layer;                                             \
    const int rest = (int)(item - layer * items_per_layer);                                     \
    const int b = rest / rows, r = rest - b * rows;                                             \
    const int kv = r / rows_per_kv, h = r - kv * rows_per_kv;                                   \
    const int t = b * block;                                                                    \
    const T* from = src + src_table[t / src_ps] * src_page + (t % src_ps) * tok                 \
                    + kv * src_kv + h * src_head + layer * src_layer;                           \
    T* to = dst + dst_table[t / dst_ps] * dst_page + (t % dst_ps) * tok                         \
            + kv * dst_kv + h * dst_head + layer * dst_layer;                                   \
    int i = threadIdx.x;                                                                        \
    for (; i + 768 < row_len; i += 1024) {  /* four loads in flight before the first store */  \
      const T a = __ldg(from + i), c = __ldg(from + i + 256);                                   \
      const T d = __ldg(from + i + 512), e = __ldg(from + i + 768);                             \
      to[i] = a; to[i + 256] = c; to[i + 512] = d; to[i + 768] = e;                             \
    }                                                                                           \
    for (; i < row_len; i += 256) to[i] = __ldg(from + i);                                      \
  }                                                                                             \
}
KV_DIRECT_COPY(kv_direct_copy_16, int4)
KV_DIRECT_COPY(kv_direct_copy_8, int2)
KV_DIRECT_COPY(kv_direct_copy_4, int)
KV_DIRECT_COPY(kv_direct_copy_2, short)
"""


class DirectWriteError(RuntimeError):
    """A CUDA call of the direct write failed (the message names the call and the error)."""


def row_shape(src_page_size: int, dst_page_size: int, src_heads: int, dst_heads: int) -> tuple[int, int, int]:
    """(tokens per block, rows per block, heads per row) of a transfer (module doc): rows are
    contiguous on both sides; a row covers ``heads per row`` heads of one K/V half (2 rows),
    or all of a page (1 row), or one head (``2 * src_heads`` rows)."""
    block = math.gcd(src_page_size, dst_page_size)
    if block == src_page_size == dst_page_size:
        return (block, 1, 2 * src_heads) if src_heads == dst_heads else (block, 2, src_heads)
    return block, 2 * src_heads, 1


def check_table(side: str, table: np.ndarray, num_tokens: int, page_size: int, num_pages: int) -> None:
    """Raise ``ValueError`` unless ``table`` covers ``num_tokens`` with pages inside ``0..num_pages-1``
    (a write elsewhere would land in another request's pages or kill the CUDA context)."""
    need = -(-num_tokens // page_size)
    if len(table) < need:
        raise ValueError(f"{side} page table has {len(table)} pages, {num_tokens} tokens at page size {page_size} need {need}")
    if need and (int(table[:need].min()) < 0 or int(table[:need].max()) >= num_pages):
        raise ValueError(f"{side} page table names pages outside 0..{num_pages - 1}")


class DirectWriter:
    """Writes layer groups of one transfer: ``src`` (the sender's storage, heads
    ``[0, src_heads)`` of its own cache) into heads ``[head_start, head_start + src_heads)``
    of ``dst`` (the decode rank's storage, mapped from the peer), tokens ``[0, num_tokens)``.

    Raises ``ValueError`` on a page table that does not fit its storage."""

    def __init__(self, src: torch.Tensor, src_table: np.ndarray, dst: torch.Tensor, dst_table: np.ndarray, *, head_start: int, num_tokens: int) -> None:
        layers, src_pages, _, src_heads, src_ps, head_dim = src.shape
        dst_layers, dst_pages, _, dst_heads, dst_ps, dst_dim = dst.shape
        if (layers, head_dim, src.dtype) != (dst_layers, dst_dim, dst.dtype) or not 0 <= head_start <= dst_heads - src_heads or num_tokens <= 0:
            raise ValueError(f"direct write of {num_tokens} tokens from {tuple(src.shape)} {src.dtype} into heads [{head_start}, {head_start + src_heads}) of {tuple(dst.shape)} {dst.dtype}")
        check_table("source", src_table, num_tokens, src_ps, src_pages)
        check_table("decode", dst_table, num_tokens, dst_ps, dst_pages)
        self.device = src.device
        self.num_layers = layers
        self._src, self._dst = src, dst  # keep the storages alive while writes may run
        row = head_dim * src.element_size()  # one token of one head, bytes
        layer_bytes = (src[0].numel() * src.element_size(), dst[0].numel() * dst.element_size())
        vec = next((v for v in (16, 8, 4, 2) if all(x % v == 0 for x in (row, src.data_ptr(), dst.data_ptr(), *layer_bytes))), None)
        if vec is None:
            raise DirectWriteError(f"KV rows of {row} bytes (or the storages) are not 2-byte aligned: no direct-write kernel for them")
        self._vec = vec
        block, self._rows, heads_per_row = row_shape(src_ps, dst_ps, src_heads, dst_heads)
        tok = row // self._vec
        self._blocks = -(-num_tokens // block)
        self._rows_per_kv = 1 if self._rows <= 2 else src_heads
        self._row_len = heads_per_row * block * tok
        self._geometry = (block, src_ps, dst_ps, tok,
                          2 * src_heads * src_ps * tok, src_heads * src_ps * tok, src_ps * tok, layer_bytes[0] // self._vec,
                          2 * dst_heads * dst_ps * tok, dst_heads * dst_ps * tok, dst_ps * tok, layer_bytes[1] // self._vec)
        self._dst_head_offset = head_start * dst_ps * tok * self._vec  # bytes
        n_src, n_dst = -(-num_tokens // src_ps), -(-num_tokens // dst_ps)
        self._tables = torch.from_numpy(np.concatenate([src_table[:n_src], dst_table[:n_dst]]).astype(np.int32))
        self._n_src = n_src
        self._uploaded: torch.Tensor | None = None

    @property
    def bytes_per_layer(self) -> int:
        return self._blocks * self._rows * self._row_len * self._vec

    def write(self, layers: range, stream: torch.cuda.Stream) -> None:
        """Enqueue the writes of ``layers`` on ``stream`` (one kernel launch)."""
        from cuda.bindings import driver

        if self._uploaded is None:
            with torch.cuda.stream(stream):  # read by this stream's kernels only
                self._uploaded = self._tables.to(self.device, non_blocking=True)
        vec, geometry = self._vec, self._geometry
        src = self._src.data_ptr() + layers.start * geometry[7] * vec
        dst = self._dst.data_ptr() + layers.start * geometry[11] * vec + self._dst_head_offset
        tables = self._uploaded.data_ptr()
        items_per_layer = self._blocks * self._rows
        items = items_per_layer * len(layers)
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        function, ctas = _kernel_function(index, vec)
        ll, ptr, i32 = ctypes.c_longlong, ctypes.c_void_p, ctypes.c_int
        params = (
            (src, dst, tables, tables + 4 * self._n_src, items, items_per_layer, self._rows, self._rows_per_kv, self._row_len, *geometry),
            (ptr, ptr, ptr, ptr, ll, ll, i32, i32, i32, i32, i32, i32, ll, ll, ll, ll, ll, ll, ll, ll, ll),
        )
        with torch.cuda.device(self.device):  # the launch runs in the current (primary) context
            (err,) = driver.cuLaunchKernel(function, min(items, ctas), 1, 1, _THREADS, 1, 1, 0, driver.CUstream(stream.cuda_stream), params, 0)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise DirectWriteError(f"launching the KV direct copy ({items} items) failed: {err!r}")


@cache
def _kernel_function(device: int, vector_bytes: int) -> tuple[object, int]:
    """The copy kernel for ``vector_bytes`` accesses on ``device`` (compiled once per process
    and device; its module stays loaded for the process), and the number of CTAs to launch."""
    from cuda.bindings import driver, nvrtc

    major, minor = torch.cuda.get_device_capability(device)
    err, program = nvrtc.nvrtcCreateProgram(_KERNEL_SOURCE.encode(), b"kv_direct_copy.cu", 0, [], [])
    _check(err == nvrtc.nvrtcResult.NVRTC_SUCCESS, "nvrtcCreateProgram", err)
    try:
        options = [f"--gpu-architecture=sm_{major}{minor}".encode()]
        (err,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, size = nvrtc.nvrtcGetProgramLogSize(program)
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(program, log)
            raise DirectWriteError(f"NVRTC could not compile the KV direct copy: {log.decode(errors='replace')}")
        err, size = nvrtc.nvrtcGetCUBINSize(program)
        _check(err == nvrtc.nvrtcResult.NVRTC_SUCCESS, "nvrtcGetCUBINSize", err)
        cubin = b" " * size
        (err,) = nvrtc.nvrtcGetCUBIN(program, cubin)
        _check(err == nvrtc.nvrtcResult.NVRTC_SUCCESS, "nvrtcGetCUBIN", err)
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    with torch.cuda.device(device):  # load into the primary context torch uses
        err, module = driver.cuModuleLoadData(cubin)
        _check(err == driver.CUresult.CUDA_SUCCESS, "cuModuleLoadData", err)
        _modules.append(module)
        err, function = driver.cuModuleGetFunction(module, f"kv_direct_copy_{vector_bytes}".encode())
        _check(err == driver.CUresult.CUDA_SUCCESS, "cuModuleGetFunction", err)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return function, sms * _CTAS_PER_SM


def _check(ok: bool, call: str, err: object) -> None:
    if not ok:
        raise DirectWriteError(f"{call} failed: {err!r}")
