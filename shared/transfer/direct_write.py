"""Direct writes of a prefill rank's KV shard into a decode rank's pages (same-host CUDA IPC path).

The sender copies its heads ``[h0, h1)`` of a group of layers straight from its own KV
pages into the decode rank's reserved pages (its storage mapped through CUDA IPC,
``cuda_ipc.open_export``): no local pack, no staging buffer, one pass over the bytes.

``plan_segments`` computes once per transfer, on the host, the byte segments that are
contiguous on both sides for the first layer; every other layer is the same list
shifted by each side's layer stride (the storage is ``[layers, pages, 2, heads,
page_size, head_dim]``, HND inside a page). The token axis is cut at every page
boundary of either side (blocks of ``gcd`` of the two page sizes), each block gives one
row per (K/V, head) of ``block * head_dim`` elements, and rows that follow each other on
both sides are merged: with equal page sizes and all heads (TP=1) a page is one
segment and a run of consecutive pages on both sides one longer segment; a head-range
shard of TP>1 gives one segment per page and K/V; a page-size mismatch one per
(block, K/V, head). The last block is copied whole: its slots past ``num_tokens`` lie
in pages reserved for this request on both sides and are never read before the decode
writes them.

Two executors of a plan (``DirectWriter``):

* ``copy_engine``: one ``cudaMemcpy2DAsync`` per segment whose rows are the group's
  layers (pitch = each side's layer stride): DMA over NVLink, no SMs used. Each call
  costs the host a few microseconds, so it pays when calls move a lot each (wide
  segments, many layers in the group).
* ``kernel``: one launch per group of a copy kernel (compiled once per process with
  NVRTC through ``cuda-python``) whose CTAs take (segment piece, layer) items and move
  them with 16-byte loads and stores, the stores going over NVLink into the peer.

``auto`` (the default) takes the copy engines when the average segment is at least
``CE_MIN_SEGMENT_BYTES`` and each call would move at least ``CE_MIN_CALL_BYTES``, the
kernel otherwise (narrow rows of a page-size mismatch or a TP>1 shard, small groups of
layers sent while a forward is still running). ``reference_write`` is the torch
reference of both, for any device.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

WRITE_METHODS = ("auto", "copy_engine", "kernel")
CE_MIN_SEGMENT_BYTES = 16 << 10  # narrower rows: per-row DMA overhead, take the kernel
CE_MIN_CALL_BYTES = 1 << 20  # host cost per call ~2-4 us; at ~390 GB/s a call must move ~1 MiB to keep ahead
KERNEL_PIECE_BYTES = 32 << 10  # segments are cut into pieces of at most this for the kernel's CTAs
_THREADS = 256  # the kernel's block size (its unrolled loop assumes it)
_CTAS_PER_SM = 8
_modules: list[object] = []  # loaded kernel modules, kept for the life of the process

_KERNEL_SOURCE = r"""
// pieces: [num_pieces, 3] int64 = (src offset, dst offset, length) in vectors of T for the
// group's first layer; layer l adds l * src_layer / dst_layer. Items are (piece, layer).
#define KV_SEGMENT_COPY(NAME, T)                                                              \
extern "C" __global__ void __launch_bounds__(256) NAME(                                      \
    const T* __restrict__ src, T* __restrict__ dst, const long long* __restrict__ pieces,    \
    long long num_pieces, long long num_items, long long src_layer, long long dst_layer) {   \
  for (long long item = blockIdx.x; item < num_items; item += gridDim.x) {                   \
    const long long piece = item % num_pieces, layer = item / num_pieces;                    \
    const T* from = src + pieces[3 * piece] + layer * src_layer;                             \
    T* to = dst + pieces[3 * piece + 1] + layer * dst_layer;                                 \
    const int n = (int)pieces[3 * piece + 2];                                                \
    int i = threadIdx.x;                                                                     \
    for (; i + 768 < n; i += 1024) {  /* four loads in flight before the first store */      \
      const T a = __ldg(from + i), b = __ldg(from + i + 256);                                \
      const T c = __ldg(from + i + 512), d = __ldg(from + i + 768);                          \
      to[i] = a; to[i + 256] = b; to[i + 512] = c; to[i + 768] = d;                          \
    }                                                                                        \
    for (; i < n; i += 256) to[i] = __ldg(from + i);                                         \
  }                                                                                          \
}
KV_SEGMENT_COPY(kv_segment_copy_16, int4)
KV_SEGMENT_COPY(kv_segment_copy_8, int2)
KV_SEGMENT_COPY(kv_segment_copy_4, int)
KV_SEGMENT_COPY(kv_segment_copy_2, short)
"""


class DirectWriteError(RuntimeError):
    """A CUDA call of the direct write failed (the message names the call and the error)."""


@dataclass(frozen=True)
class SegmentPlan:
    """Byte segments copied for every layer: offsets from the start of layer 0 of each storage."""

    src_offsets: np.ndarray  # int64
    dst_offsets: np.ndarray  # int64
    lengths: np.ndarray  # int64
    src_layer_bytes: int  # layer stride of the source storage
    dst_layer_bytes: int

    @property
    def num_segments(self) -> int:
        return len(self.lengths)

    @property
    def bytes_per_layer(self) -> int:
        return int(self.lengths.sum())

    @property
    def mean_segment_bytes(self) -> float:
        return self.bytes_per_layer / max(1, self.num_segments)

    def pieces(self, max_bytes: int) -> np.ndarray:
        """``[n, 3]`` (src offset, dst offset, length) with every segment cut into pieces of at most ``max_bytes``."""
        if self.num_segments == 0 or self.lengths.max() <= max_bytes:
            return np.stack([self.src_offsets, self.dst_offsets, self.lengths], axis=1)
        counts = -(-self.lengths // max_bytes)
        seg = np.repeat(np.arange(self.num_segments), counts)
        first = np.repeat(np.cumsum(counts) - counts, counts)
        skip = (np.arange(len(seg)) - first) * max_bytes
        length = np.minimum(self.lengths[seg] - skip, max_bytes)
        return np.stack([self.src_offsets[seg] + skip, self.dst_offsets[seg] + skip, length], axis=1)


def plan_segments(
    *,
    num_tokens: int,
    head_dim: int,
    itemsize: int,
    src_page_size: int,
    src_heads: int,
    src_num_pages: int,
    src_table: np.ndarray,
    dst_page_size: int,
    dst_heads: int,
    dst_num_pages: int,
    dst_table: np.ndarray,
    head_start: int,
) -> SegmentPlan:
    """Segments moving tokens ``[0, num_tokens)`` of the source's ``src_heads`` heads into
    heads ``[head_start, head_start + src_heads)`` of the destination's pages (module doc).

    ``src_table`` / ``dst_table``: each side's page ids of the sequence, in order. Raises
    ``ValueError`` when a table is too short or names a page outside its storage (a
    copy there would write another request's memory)."""
    if num_tokens <= 0 or not 0 <= head_start <= dst_heads - src_heads:
        raise ValueError(f"direct write of {num_tokens} tokens into heads [{head_start}, {head_start + src_heads}) of {dst_heads}")
    src_table, dst_table = np.asarray(src_table, dtype=np.int64), np.asarray(dst_table, dtype=np.int64)
    for side, table, page_size, num_pages in (("source", src_table, src_page_size, src_num_pages), ("decode", dst_table, dst_page_size, dst_num_pages)):
        need = -(-num_tokens // page_size)
        if len(table) < need:
            raise ValueError(f"{side} page table has {len(table)} pages, {num_tokens} tokens at page size {page_size} need {need}")
        if need and (table[:need].min() < 0 or table[:need].max() >= num_pages):
            raise ValueError(f"{side} page table names pages outside 0..{num_pages - 1}")
    row = head_dim * itemsize  # one token of one head
    block = math.gcd(src_page_size, dst_page_size)  # tokens of a block lie in one page on each side
    starts = np.arange(-(-num_tokens // block), dtype=np.int64) * block
    src_head, dst_head = src_page_size * row, dst_page_size * row
    src_page, dst_page = 2 * src_heads * src_head, 2 * dst_heads * dst_head
    src_base = src_table[starts // src_page_size] * src_page + starts % src_page_size * row
    dst_base = dst_table[starts // dst_page_size] * dst_page + starts % dst_page_size * row
    kv, head = np.divmod(np.arange(2 * src_heads, dtype=np.int64), src_heads)
    src = (src_base[:, None] + kv * src_heads * src_head + head * src_head).ravel()
    dst = (dst_base[:, None] + kv * dst_heads * dst_head + (head_start + head) * dst_head).ravel()
    length = block * row
    follows = (src[1:] == src[:-1] + length) & (dst[1:] == dst[:-1] + length)
    first = np.flatnonzero(np.concatenate(([True], ~follows)))
    lengths = np.diff(np.append(first, len(src))) * length
    return SegmentPlan(src[first], dst[first], lengths.astype(np.int64), src_num_pages * src_page, dst_num_pages * dst_page)


def reference_write(plan: SegmentPlan, layers: range, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Torch reference of the executors: ``plan`` applied to ``layers`` of two storages (any device)."""
    src_bytes, dst_bytes = src.view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
    for layer in layers:
        for s, d, n in zip(plan.src_offsets.tolist(), plan.dst_offsets.tolist(), plan.lengths.tolist()):
            s, d = s + layer * plan.src_layer_bytes, d + layer * plan.dst_layer_bytes
            dst_bytes[d : d + n].copy_(src_bytes[s : s + n])


class DirectWriter:
    """Writes layer groups of one transfer from ``src`` into the peer storage ``dst`` (both
    ``[layers, pages, 2, heads, page_size, head_dim]`` on CUDA, ``dst`` mapped from the peer)."""

    def __init__(self, plan: SegmentPlan, src: torch.Tensor, dst: torch.Tensor, method: str = "auto") -> None:
        if method not in WRITE_METHODS:
            raise ValueError(f"direct write method {method!r} is not one of {WRITE_METHODS}")
        self.plan, self.method = plan, method
        self._src, self._dst = src, dst
        self._device = src.device
        self._pieces: torch.Tensor | None = None  # the kernel's piece table, uploaded on first use
        self._vector = _vector_bytes(plan, src.data_ptr(), dst.data_ptr())
        self._max_pitch = _max_pitch(self._device.index if self._device.index is not None else torch.cuda.current_device())

    def method_for(self, layers: range) -> str:
        """``copy_engine`` or ``kernel`` for a group of ``layers`` (``choose_method``)."""
        return choose_method(self.method, self.plan, len(layers), self._max_pitch)

    def write(self, layers: range, stream: torch.cuda.Stream) -> str:
        """Enqueue the writes of ``layers`` on ``stream``; returns the method used."""
        method = self.method_for(layers)
        src = self._src.data_ptr() + layers.start * self.plan.src_layer_bytes
        dst = self._dst.data_ptr() + layers.start * self.plan.dst_layer_bytes
        if method == "copy_engine":
            self._copy_engines(src, dst, len(layers), stream)
        else:
            self._kernel(src, dst, len(layers), stream)
        return method

    def _copy_engines(self, src: int, dst: int, num_layers: int, stream: torch.cuda.Stream) -> None:
        from cuda.bindings import runtime

        plan, handle = self.plan, runtime.cudaStream_t(stream.cuda_stream)
        kind, ok = runtime.cudaMemcpyKind.cudaMemcpyDeviceToDevice, runtime.cudaError_t.cudaSuccess
        with torch.cuda.device(self._device):  # the stream's device must be the current one
            for s, d, n in zip(plan.src_offsets.tolist(), plan.dst_offsets.tolist(), plan.lengths.tolist()):
                (err,) = runtime.cudaMemcpy2DAsync(dst + d, plan.dst_layer_bytes, src + s, plan.src_layer_bytes, n, num_layers, kind, handle)
                if err != ok:
                    raise DirectWriteError(f"cudaMemcpy2DAsync({n} bytes x {num_layers} layers) failed: {err!r}")

    def _kernel(self, src: int, dst: int, num_layers: int, stream: torch.cuda.Stream) -> None:
        from cuda.bindings import driver

        vec = self._vector
        if self._pieces is None:
            with torch.cuda.stream(stream):  # read by this stream's kernels only
                self._pieces = torch.from_numpy(self.plan.pieces(KERNEL_PIECE_BYTES) // vec).to(self._device, non_blocking=True)
        num_pieces = self._pieces.shape[0]
        items = num_pieces * num_layers
        function, ctas = _kernel_function(self._device.index if self._device.index is not None else torch.cuda.current_device(), vec)
        params = (
            (src, dst, self._pieces.data_ptr(), num_pieces, items, self.plan.src_layer_bytes // vec, self.plan.dst_layer_bytes // vec),
            (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_longlong),
        )
        with torch.cuda.device(self._device):  # the launch runs in the current (primary) context
            (err,) = driver.cuLaunchKernel(function, min(items, ctas), 1, 1, _THREADS, 1, 1, 0, driver.CUstream(stream.cuda_stream), params, 0)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise DirectWriteError(f"launching the KV segment copy ({items} items) failed: {err!r}")


def choose_method(method: str, plan: SegmentPlan, num_layers: int, max_pitch: int) -> str:
    """The executor of a group of ``num_layers`` layers: ``method`` unless it is ``auto``
    (module doc); copy engines never when a layer stride exceeds the 2-D copy's
    ``max_pitch`` (the device's cudaDevAttrMaxPitch)."""
    if max(plan.src_layer_bytes, plan.dst_layer_bytes) > max_pitch:
        return "kernel"
    if method != "auto":
        return method
    wide = plan.mean_segment_bytes >= CE_MIN_SEGMENT_BYTES
    return "copy_engine" if wide and plan.mean_segment_bytes * num_layers >= CE_MIN_CALL_BYTES else "kernel"


def _vector_bytes(plan: SegmentPlan, src_ptr: int, dst_ptr: int) -> int:
    """The widest access (16, 8, 4 or 2 bytes) dividing every offset, length, stride and base."""
    values = np.concatenate([plan.src_offsets, plan.dst_offsets, plan.lengths, [plan.src_layer_bytes, plan.dst_layer_bytes, src_ptr, dst_ptr]])
    common = int(np.bitwise_or.reduce(values))
    return next(v for v in (16, 8, 4, 2, 1) if common % v == 0)


@cache
def _max_pitch(device: int) -> int:
    from cuda.bindings import runtime

    err, pitch = runtime.cudaDeviceGetAttribute(runtime.cudaDeviceAttr.cudaDevAttrMaxPitch, device)
    if err != runtime.cudaError_t.cudaSuccess:
        raise DirectWriteError(f"cudaDeviceGetAttribute(MaxPitch) failed: {err!r}")
    return int(pitch)


@cache
def _kernel_function(device: int, vector_bytes: int) -> tuple[object, int]:
    """The segment-copy kernel for ``vector_bytes`` accesses on ``device`` (compiled once per
    process, device and width; its module stays loaded for the process), and the number
    of CTAs to launch."""
    from cuda.bindings import driver, nvrtc

    if vector_bytes == 1:
        raise DirectWriteError("KV rows are not 2-byte aligned: no direct-write kernel for them")
    major, minor = torch.cuda.get_device_capability(device)
    err, program = nvrtc.nvrtcCreateProgram(_KERNEL_SOURCE.encode(), b"kv_segment_copy.cu", 0, [], [])
    _check_nvrtc(err, "nvrtcCreateProgram")
    try:
        options = [f"--gpu-architecture=sm_{major}{minor}".encode()]
        (err,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, size = nvrtc.nvrtcGetProgramLogSize(program)
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(program, log)
            raise DirectWriteError(f"NVRTC could not compile the KV segment copy: {log.decode(errors='replace')}")
        err, size = nvrtc.nvrtcGetCUBINSize(program)
        _check_nvrtc(err, "nvrtcGetCUBINSize")
        cubin = b" " * size
        (err,) = nvrtc.nvrtcGetCUBIN(program, cubin)
        _check_nvrtc(err, "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    with torch.cuda.device(device):  # load into the primary context torch uses
        err, module = driver.cuModuleLoadData(cubin)
        _check_driver(err, "cuModuleLoadData")
        _modules.append(module)
        err, function = driver.cuModuleGetFunction(module, f"kv_segment_copy_{vector_bytes}".encode())
        _check_driver(err, "cuModuleGetFunction")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return function, sms * _CTAS_PER_SM


def _check_nvrtc(err: object, call: str) -> None:
    from cuda.bindings import nvrtc

    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise DirectWriteError(f"{call} failed: {err!r}")


def _check_driver(err: object, call: str) -> None:
    from cuda.bindings import driver

    if err != driver.CUresult.CUDA_SUCCESS:
        raise DirectWriteError(f"{call} failed: {err!r}")
