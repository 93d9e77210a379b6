"""Direct writes of a prefill rank's KV shard into a decode rank's pages (same-host CUDA IPC path).

The sender copies its heads ``[h0, h1)`` of a group of layers straight from its own KV
pages into the decode rank's reserved pages (its storage mapped through CUDA IPC,
``cuda_ipc.open_export``): no local pack, no staging buffer, one pass over the bytes,
one kernel launch per group whatever the layouts.

This module plans and checks (``DirectWriter``) and enqueues a transfer's writes as its
layers are reported, each behind its layer's compute on the GPU (``WriteIssuer``); the
copy is ``kernels.kv_copy`` (a CuTeDSL kernel on CUDA, its torch reference on CPU), which
also enforces the transfer's write deadline on the GPU. Both storages are ``[layers, pages, 2, heads, page_size,
head_dim]`` (HND inside a page). The token axis is cut into blocks of ``gcd`` of the two
page sizes, so a block lies in one page on each side; a block's bytes are rows that are
contiguous on both sides: with equal page sizes a row is a whole page (all heads, TP=1)
or one K/V half of it (a head-range shard), with unequal page sizes one head's block
(``row_shape``, ``plan_rows``). The kernel's CTAs take (layer, block, row) items, look
the two page ids up in the page tables on the GPU and move each row with 16-byte loads
and stores (narrower only for rows that are not a multiple of 16 bytes), several loads
in flight per thread, the stores going over NVLink into the peer. The last block is
copied whole: its slots past ``num_tokens`` lie in pages reserved for this request on
both sides and are never read before the decode writes them.

``prepare_direct_writes`` compiles and loads the kernel for a cache's rows; a CUDA
prefill rank calls it at start, so its first request pays no compile (measured on this
project's 2-core CPU box: ~0.4 s per access width, plus ~1 s to import CuTeDSL where
nothing imported it yet).

Measured on 2x H200 (bench/results/kv_copy.jsonl and kv_transfer.jsonl, 2026-11-30): the
CuTeDSL kernel alone writes 356-369 GB/s over NVLink at 6k and 32k tokens (whole pages,
2-head K/V halves, one head's 4 KiB block), whatever its launch shape (350-367 GB/s) and
whether the rows go through registers or the SM's bulk-copy engine (351-368, a334c51),
against the copy engines' 391-394 for one contiguous peer copy; a copy-engine copy running
next to the kernel adds nothing (367 GB/s together). 2-D copy-engine copies of the same rows
(one ``cudaMemcpy2DAsync`` per page, rows = layers; 25564ebbe612) ran at ~210 GB/s and cost
~7 us of host time per call; they were dropped. Host cost on that machine's CPU: building
the writer ~45 us and a launch ~23 us when timed in a loop (in a fresh process and inside a
sender process alike), but ~280 us and ~140 us once per transfer in a sender up to
488c9f91cf04 (the transfer's set-up runs cold: on the 2-core CPU box a writer takes ~30-70
us in a loop and ~260-330 us after 20 ms of idling); uploading the launch parameters from
pinned memory did not change that. Launching through ``kv_copy_sm90.Launcher`` (arguments
marshalled once) and enqueueing in the reporting thread, a whole 6k-token request's issue
(launch, stream wait, events) took 83 us in the sender at 67be2100317e (160 us at
488c9f91cf04); ``bench/kv_copy.py`` measures a lone ``KVCopy`` 20 ms after idling at
640-785 us to build and 190-215 us to launch (the same run). A profile of the set-up's
pieces on that host, each sequence 20 ms after the last (6k tokens, 2d4d2820defc), put
~0.24 ms in uploading the parameters through a tensor (a stream context 99 us, the
allocation 44, ``torch.from_numpy`` 18, ``copy_`` 81) against 19 + 21 us for a caching-
allocator block and a driver copy, which ``KVCopy`` has used since; the sender's whole
set-up then measured 300-381 us at 6k TP=1 (383-559 before), enqueueing 72-102 us
(a147946f51b4, bench/results/kv_transfer.jsonl). With the launch parameters a pool pair
fixes kept per pair, the storage checks and row shape kept per storage pair (``_route``)
and page lists converted through ``array.array``, it measured 264-373 us, enqueueing
65-89 us (f4e4232480e1; cross-call); a scratch profile in that call, constructions 20 ms
apart, put a sender's set-up at 500 us median against 626 for da02852, spread over many
small steps (the driver copy 69 us, the allocator block 38, the two page lists 26, the
two table checks 20). A step-by-step profile at 06be092c0e76 (same host, 20 ms idle before
each, medians of 30; 490 us from construction to the first write's last event, 192 back to
back): ``KVCopy`` 167 us (pageable upload 70, its allocator block 35, the parameter array
24, launcher 9, skip word 10, device context 11), the event the first report made and
recorded 50 (torch creates a CUDA event at its first record), the launch 63, the stream wait
11, the two page lists 50, the two table checks 41, the cached peer mapping 23, the layout
checks 16, the row plan (then a frozen dataclass) 10; a lone first driver call or numpy op
after idling took 40-120 us. Since 64ddcd5..fab3772 a sender's set-up reuses a kept
parameter slot (``kernels.kv_copy.CopyRoute``: pinned words, device words, launcher; the
page-id lists packed straight into it and checked there, one asynchronous upload) and events
made ahead (the issuer's mark for reports without an event, its writes-done event), and a
transfer that saw its landing event gives the slot back free at once (no event query on the
next set-up). At 0651591c0496 (before the last three of those) the benchmark measured the
set-up at 233-361 us at 6k TP=1 (264-373 at f4e4232480e1) and 435-455 at 32k (608-617),
and the report's event no longer delays the first write (52-82 us before); at fab377215964
187-204 us at 6k, enqueueing 83-126 us (bench/results/kv_transfer.jsonl). Since then the
storages' checks, row shape, fixed launch parameters and slots are one ``CopyRoute`` kept
here per (storage pair, head start, stream) and found by the tensors' identity (before, a
route of this module and one of ``kernels.kv_copy``, keyed by addresses, shapes and row
shape, were looked up in turn, and the pools checked again per copy). A profile of a 6k-token
TP=1 sender in the bench's prefill process at dc753919bd30 (2x H200, section timers, 20 ms idle
before each / back to back) put its set-up at 253 / 166 us and the issue at 136 / 81: the two
page lists 74 / 64 us, the parameter upload 65 / 33, the launch 60 / 36 (the device switches of
the two 16 / 8), ``torch.cuda.current_stream`` for the stream mark 19 / 11, three event records
24 / 14. Since
22378a4ff918 the lists are packed unsigned with one ``max()`` check, the upload calls the driver
through ctypes, upload and launch switch device only when another one is current and the mark's
stream object is kept per handle (``streams.current_stream``): an A/B against dc753919bd30 in one
call (ABAB) measured the issue at 94-105 us against 113-135, the set-up at 210-258 against
191-273, and end to end no change beyond the run-to-run spread.

The GPU tests compare the copy with the UCX path's ``shard.pack_layers`` followed by
``shard.scatter_layers``.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from kernels.kv_copy import VECTOR_BYTES, CopyRoute, KVCopy, RowShape, device_time_ns, prepare_kv_copy
from shared.transfer import cuda_ipc
from shared.transfer.streams import current_stream, give_back_event, prepare_events, take_event


class DirectWriteError(ValueError):
    """No direct-write kernel fits these storages (their rows or addresses are not 2-byte aligned)."""


def row_shape(src_page_size: int, dst_page_size: int, src_heads: int, dst_heads: int) -> tuple[int, int, int]:
    """(tokens per block, rows per block, heads per row) of a transfer (module doc): rows are
    contiguous on both sides; a row covers ``heads per row`` heads of one K/V half (2 rows),
    or all of a page (1 row), or one head (``2 * src_heads`` rows)."""
    block = math.gcd(src_page_size, dst_page_size)
    if block == src_page_size == dst_page_size:
        return (block, 1, 2 * src_heads) if src_heads == dst_heads else (block, 2, src_heads)
    return block, 2 * src_heads, 1


def vector_bytes(row_bytes: int, *addresses: int) -> int | None:
    """The widest kernel access that divides a row of ``row_bytes`` (one token of one head) and
    every address; every other offset the kernel forms is a multiple of a row."""
    for width in VECTOR_BYTES:
        if row_bytes % width == 0 and all(x % width == 0 for x in addresses):
            return width
    return None


def plan_rows(src: torch.Tensor, dst: torch.Tensor, head_start: int) -> RowShape:
    """The rows of writes of all of ``src``'s heads into heads from ``head_start`` of ``dst``
    (both ``[layers, pages, 2, heads, page_size, head_dim]``), whatever the token count."""
    _, _, _, src_heads, src_ps, head_dim = src.shape
    dst_heads, dst_ps = dst.shape[3], dst.shape[4]
    row = head_dim * src.element_size()
    vec = vector_bytes(row, src.data_ptr(), dst.data_ptr())
    if vec is None:
        raise DirectWriteError(f"KV rows of {row} bytes (or the storages) are not 2-byte aligned: no direct-write kernel for them")
    block, rows, heads_per_row = row_shape(src_ps, dst_ps, src_heads, dst_heads)
    return RowShape(vec, block, rows, 1 if rows <= 2 else src_heads, heads_per_row, head_start)


def prepare_direct_writes(device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """Compile, load and run once the copy kernel for KV rows of ``head_dim`` x ``dtype`` on a
    CUDA ``device`` and make the device's landing events (``cuda_ipc.prepare_landing_events``)
    and spare events (``streams.prepare_events``), so a sender's first direct write pays none
    of it (nothing on CPU: no direct writes
    there). KV storages are allocations aligned far beyond 16 bytes, so the row alone
    decides the access width."""
    vec = vector_bytes(head_dim * dtype.itemsize)
    if device.type == "cuda" and device.index is None:  # senders look their events up by an indexed device
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda" and vec is not None:
        prepare_kv_copy(device, vec)
        cuda_ipc.prepare_landing_events(device)
        prepare_events(device)


class DirectWriter:
    """Writes layer groups of one transfer: ``src`` (the sender's storage, heads
    ``[0, src_heads)`` of its own cache) into heads ``[head_start, head_start + src_heads)``
    of ``dst`` (the decode rank's storage, mapped from the peer), tokens ``[0, num_tokens)``.
    Every write runs on ``stream`` (CUDA; default: the current stream at construction), on
    which the kernel's launch parameters and both page tables go to the GPU once, here, in
    one small copy (``kernels.kv_copy.KVCopy``). A write that starts after ``deadline_unix``
    (host wall clock, seconds; None: none) writes nothing and sets ``skipped``: on CUDA the
    kernel itself checks, so a write enqueued behind unfinished compute is covered too.

    Raises ``ValueError`` on a page table that does not fit its storage, ``DirectWriteError``
    (a ``ValueError``) on storages no kernel can copy."""

    def __init__(self, src: torch.Tensor, src_table: Sequence[int] | np.ndarray, dst: torch.Tensor, dst_table: Sequence[int] | np.ndarray, *, head_start: int, num_tokens: int,
                 stream: torch.cuda.Stream | None = None, deadline_unix: float | None = None) -> None:
        if num_tokens <= 0:
            raise ValueError(f"direct write of {num_tokens} tokens: nothing to write")
        route = _route(src, dst, head_start, stream)
        self.device = route.device
        self.num_layers = route.num_layers
        self.rows = route.rows
        deadline_ns = None if deadline_unix is None else device_time_ns(route.device, deadline_unix)
        self._copy = KVCopy(route, src_table, dst_table, num_tokens, deadline_ns)  # checks both tables against their pools

    @property
    def bytes_per_layer(self) -> int:
        rows, src = self.rows, self._copy.src
        return self._copy.blocks * rows.rows * rows.heads_per_row * rows.block * src.shape[5] * src.element_size()

    @property
    def skipped(self) -> bool:
        """Whether a write found the deadline passed and wrote nothing (on CUDA: ask once the
        writes completed)."""
        return self._copy.skipped_at_ns is not None

    def write(self, layers: range) -> None:
        """Enqueue the writes of ``layers`` on the writer's stream (one kernel launch; on CPU, a copy now)."""
        self._copy.copy(layers)

    def release(self, ran: bool = False) -> None:
        """No more writes: the kernel's parameter slot goes back for later transfers
        (``kernels.kv_copy.KVCopy.release``; ``ran``: the writes were seen complete);
        ``skipped`` stays readable."""
        self._copy.release(ran)


_ROUTES_KEPT = 16  # (local storage, decode storage, head start, stream) routes kept per process
# The one cache of per-pair state on the direct-write path: each route holds the storages'
# checks, the row shape, the kernel's fixed launch parameters and its parameter slots.
_routes: dict[tuple[int, int, int, int], CopyRoute] = {}


def _route(src: torch.Tensor, dst: torch.Tensor, head_start: int, stream: torch.cuda.Stream | None) -> CopyRoute:
    """The kept copy route (``kernels.kv_copy.CopyRoute``) of writes from these very storage
    tensors into heads from ``head_start`` on ``stream`` (CUDA; None: the current stream). A
    storage that died and another that took its id (a decode rank's new export) get a new one:
    the route refers to its storages weakly; so does a storage whose memory moved (``set_``),
    whose launch parameters would name the old addresses. Made on the first write of a pair: the storages
    checked against each other (``ValueError``), the rows planned (``plan_rows``), the launch
    parameters fixed; a transfer's set-up runs cold on its host, where planning the rows
    alone took 24 us (2x H200, set-ups 20 ms apart, fe9548763f2a)."""
    if src.is_cuda and stream is None:
        stream = torch.cuda.current_stream(src.device)
    key = (id(src), id(dst), head_start, 0 if stream is None else stream.cuda_stream)
    route = _routes.get(key)
    if route is not None and route.src() is src and route.dst() is dst and route.addresses == (src.data_ptr(), dst.data_ptr()):
        return route
    layers, _, _, src_heads, _, head_dim = src.shape
    dst_layers, _, _, dst_heads, _, dst_dim = dst.shape
    if (layers, head_dim, src.dtype) != (dst_layers, dst_dim, dst.dtype) or not 0 <= head_start <= dst_heads - src_heads:
        raise ValueError(f"direct write from {tuple(src.shape)} {src.dtype} into heads [{head_start}, {head_start + src_heads}) of {tuple(dst.shape)} {dst.dtype}")
    route = CopyRoute(src, dst, plan_rows(src, dst, head_start), stream)
    _routes.pop(key, None)  # a dead pair's route under a reused id
    if len(_routes) >= _ROUTES_KEPT:
        _routes.pop(next(iter(_routes)))  # the oldest: live copies keep it, a collected one retires its pending slots
    _routes[key] = route
    return route


class WriteIssuer:
    """Enqueues one transfer's direct writes as its layers are reported, from any thread.

    ``issue(layers, event)``: the layers not enqueued yet are written by one launch per run of
    consecutive layers on ``stream`` behind ``event`` (the report's CUDA event on the compute
    stream, ``Stream.wait_event``; None: the reporting thread's current stream as it is now,
    marked with the issuer's own event, recorded under the issuer's lock so that concurrent
    reports never wait for each other's marks): the GPU starts the copy as soon as that compute
    is done and no host thread waits for it. An event recorded after every launch (``writes_done``) tells
    when everything enqueued so far ran; the report that completes the layers also records the
    transfer's interprocess landing event (``landing``, ``cuda_ipc.landing_event``), after the
    last write. Nothing is enqueued after ``close()`` or once the host clock passed
    ``deadline`` (``time.monotonic``); the writer's own deadline guard covers writes enqueued
    in time whose compute ends too late. An error while enqueueing is kept in ``error`` for
    the sender, never raised into the reporting thread (the model's forward). ``close()``
    ends it: the writer's parameter slot and the issuer's events (made ahead,
    ``streams.take_event``) go back for later transfers. On CPU (the writer's torch
    reference) each write runs as it is issued: no stream, no events.
    """

    def __init__(self, writer: DirectWriter, stream: torch.cuda.Stream | None, deadline: float) -> None:
        self.writer = writer
        self._stream = stream
        self._deadline = deadline
        self._lock = threading.Lock()
        self._cuda = writer.device.type == "cuda"
        self._enqueued = bytearray(writer.num_layers)  # 1 for each layer whose write is enqueued
        self._left = writer.num_layers  # layers not enqueued yet
        self._closed = False
        self.groups: list[range] = []  # one per launch, in launch order
        self.compute_events: list[torch.cuda.Event] = []  # the distinct events the writes wait for
        self.writes_done: torch.cuda.Event | None = None
        self.landing: tuple[torch.cuda.Event, bytes] | None = None
        self.error: BaseException | None = None
        self.first_issued_at: float | None = None  # perf_counter
        self.issue_s = 0.0  # host time spent enqueueing
        # Marks the reporting thread's stream for reports without an event: an event made ahead
        # (making one cost ~40 us of a cold transfer's path on 2x H200, 06be092c0e76).
        self._mark: torch.cuda.Event | None = take_event(writer.device) if self._cuda else None

    @property
    def complete(self) -> bool:
        """Every layer's write is enqueued."""
        return self._left == 0

    def issue(self, layers: Iterable[int], event: torch.cuda.Event | None) -> None:
        """Enqueue the writes of ``layers`` (those not enqueued yet) behind ``event``."""
        started = time.perf_counter()
        with self._lock:
            if self._closed or self.error is not None or time.monotonic() >= self._deadline:
                return
            runs = self._runs_to_enqueue(layers)
            if not runs:
                return
            if self.first_issued_at is None:
                self.first_issued_at = started
            try:
                if event is None and self._mark is not None:
                    event = self._mark
                    event.record(current_stream(self.writer.device.index))
                self._enqueue(runs, event)
            except Exception as e:  # noqa: BLE001 - surfaced by the sender as a typed error
                self.error = e
            self.issue_s += time.perf_counter() - started

    def _runs_to_enqueue(self, layers: Iterable[int]) -> list[range]:
        """The layers of ``layers`` not enqueued yet, as runs of consecutive layers."""
        num_layers = self.writer.num_layers
        if self._left == num_layers and layers == range(num_layers):
            return [layers]  # every layer in one report, none enqueued before (``mark_all_layers_done``)
        return _runs(sorted({layer for layer in layers if 0 <= layer < num_layers and not self._enqueued[layer]}))

    def _enqueue(self, runs: list[range], event: torch.cuda.Event | None) -> None:
        if event is not None:
            self._stream.wait_event(event)
        for run in runs:
            self.writer.write(run)  # the GPU may start from here: the bookkeeping below overlaps it
            self.groups.append(run)
            self._enqueued[run.start : run.stop] = b"\x01" * len(run)
            self._left -= len(run)
            if self._cuda:
                if self.writes_done is None:
                    self.writes_done = take_event(self.writer.device)
                self.writes_done.record(self._stream)  # after every launch: a failure waits for all of them
        if event is not None and all(e is not event for e in self.compute_events):
            self.compute_events.append(event)
        if self._left == 0 and self._cuda:
            self.landing = cuda_ipc.landing_event(self.writer.device)
            self.landing[0].record(self._stream)

    def close(self, ran: bool = False) -> torch.cuda.Event | None:
        """Enqueue nothing more; the event recorded after the last enqueued write (None: none,
        or given back). The writer's slot and the issuer's mark go back (a stream wait already
        enqueued keeps the mark it was given, whatever the event records later); ``ran``: every
        enqueued write was seen complete (the landing event), so the slot is free at once and
        the writes-done event goes back too (it may record another transfer's writes next)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self.writer.release(ran)
                if self._mark is not None:
                    give_back_event(self.writer.device, self._mark)
                    self._mark = None
                if ran and self.writes_done is not None:  # else the caller may still wait on it
                    give_back_event(self.writer.device, self.writes_done)
                    self.writes_done = None
            return self.writes_done


def _runs(layers: list[int]) -> list[range]:
    """Sorted layer indices as maximal ranges of consecutive layers."""
    if layers and layers[-1] - layers[0] == len(layers) - 1:  # one run (all layers at once, or one layer)
        return [range(layers[0], layers[-1] + 1)]
    runs: list[range] = []
    for layer in layers:
        if runs and runs[-1].stop == layer:
            runs[-1] = range(runs[-1].start, layer + 1)
        else:
            runs.append(range(layer, layer + 1))
    return runs
