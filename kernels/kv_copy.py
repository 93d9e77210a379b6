"""KV page-to-page copy: a group of layers of one sequence's KV, from one paged pool into another.

Both pools are ``[layers, pages, 2 (K/V), heads, page_size, head_dim]`` (HND inside a
page, ``shared.kvcache``). The destination may hold more heads than the source: source
heads ``[0, H)`` land in destination heads ``[head_start, head_start + H)``. Token ``t``
of the sequence lives in page ``table[t // page_size]`` at slot ``t % page_size`` on each
side. The same-host CUDA IPC transfer (``shared.transfer.direct_write``) uses it to write
a prefill rank's KV shard straight into a decode rank's reserved pages, the destination
being the decode's storage mapped through CUDA IPC.

``KVCopy`` sets one sequence's copy up once and copies groups of layers; it picks the
implementation by device:

* CPU: ``kv_copy_reference``, a gather of tokens ``[0, num_tokens)`` by the source table
  and a scatter by the destination table in torch; the definition the kernel is tested
  against.
* CUDA: the CuTeDSL kernel (``kernels.kv_copy_sm90``, imported on this path only). The
  caller cuts the bytes into rows (``RowShape``): the token axis in blocks of ``block``
  tokens that lie in one page on each side, each block in ``rows`` rows contiguous on
  both sides. CTAs take (layer, block, row) items, look the two page ids up in the
  tables on the GPU and move the row with ``vector_bytes``-wide accesses (16 bytes
  wherever the layout allows: every bf16 / fp16 / fp32 / fp8 head_dim that is a multiple
  of 16), several loads in flight per thread before their stores, which are plain global
  stores (to peer memory when the destination is mapped through CUDA IPC; never
  ``multimem``). The last block is copied whole: its slots past ``num_tokens`` lie in the
  sequence's last page on each side, which the caller reserved for it.

The kernel is compiled once per process and access width (``prepare_kv_copy`` compiles
and loads it ahead of the first copy). Every size, stride and address of a sequence's copy
is a launch parameter in device memory (``LAUNCH_PARAMS``, int64); a launch passes only
that block's address and its layer range. One binary serves every layout and request, and
a launch costs a few host microseconds instead of converting some twenty scalars through
the DSL's argument marshalling (~85 us on this project's CPU box). What a pool pair, a row
shape and a stream fix is one ``CopyRoute``, checked and made once by its user and kept
(``shared.transfer.direct_write`` keeps one per storage pair; here only the clock calibration keeps its scratch routes):
the pools checked against each other, the fixed parameters and the parameter slots, each
pinned host words + device words + a launcher bound to them (``kv_copy_sm90.Launcher``,
its arguments marshalled once). A ``KVCopy`` takes a slot, writes its three per-copy
parameters and both page tables into the pinned words (a list of ids packed straight in),
checks the ids against the pools, and uploads them in one asynchronous copy on the
route's stream; ``release()`` gives the slot back. Before 64ddcd5 every ``KVCopy``
allocated a device block, built its parameter array and launcher and uploaded from
pageable memory: ~0.17 ms of a cold 6k-token set-up on 2x H200 (06be092c0e76).

Deadline: a ``KVCopy`` may carry a deadline on the device's clock (``device_time_ns``:
``%globaltimer`` on CUDA, the host's wall clock on CPU). A copy that starts past it moves
nothing and records when it found out (``skipped_at_ns``), so a launch enqueued behind
compute that finishes too late cannot write. On CUDA the clock is related to the host's
by running the kernel once with a deadline in the past, which stores ``%globaltimer`` at
its start, between two host clock readings (redone once a minute in a thread: the two clocks
drift).
"""

from __future__ import annotations

import itertools
import numbers
import struct
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

VECTOR_BYTES = (16, 8, 4, 2)  # access widths the kernel is compiled for, widest first
MAX_ITEMS = 2**31 - 1  # (layer, block, row) items of one launch, counted in int32 by the kernel
NO_DEADLINE = 2**63 - 1
# The kernel's launch parameters, int64 each, in this order (addresses in bytes: the first
# layer of each pool, the destination's at its first head; sizes, strides and ``tok``, one
# token of one head, in vectors; strides of (page, K/V, head, layer); then those of one
# sequence's copy: its two page tables' addresses, its (layer, block, row) items per layer,
# the deadline in ns of the device clock and the address of the pinned word a skipped copy
# stores its clock into). The fixed ones depend only on the two pools and the row shape
# (a ``CopyRoute``'s).
LAUNCH_PARAMS = ("src", "dst", "rows", "rows_per_kv", "row_len", "block", "src_ps", "dst_ps", "tok",
                 "src_page", "src_kv", "src_head", "src_layer", "dst_page", "dst_kv", "dst_head", "dst_layer",
                 "src_table", "dst_table", "items_per_layer", "deadline", "skipped")
_FIXED_PARAMS = LAUNCH_PARAMS.index("src_table")
_REQUEST_PARAMS = slice(LAUNCH_PARAMS.index("items_per_layer"), len(LAUNCH_PARAMS))  # set per copy; the tables' addresses are a slot's
# A copy's set-up writes host words with ``struct`` only, never numpy: on 2x H200 the first numpy
# operation after the process idled took 40-120 us (06be092c0e76), and a set-up runs after idling.
_REQUEST_WORDS = struct.Struct(f"<{_REQUEST_PARAMS.stop - _REQUEST_PARAMS.start}q")
_WORD = struct.Struct("<q")
_SLOT_MIN_IDS = 1024  # page ids per side of the smallest parameter slot (slots come in powers of two)
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}  # by item size
_CLOCK_MAX_AGE_S = 60.0  # the device clock is related to the host's again after this long (in a thread)
_clock: dict[torch.device, tuple[float, int]] = {}  # device -> (monotonic time of the calibration, device ns - host ns)
_clock_width: dict[torch.device, int] = {}  # device -> the access width its calibration runs (prepare_kv_copy's)
_probes: dict[tuple[torch.device, int], tuple[torch.Tensor, CopyRoute]] = {}  # (device, width) -> calibration pool, its route (own stream)
_recalibrating: set[torch.device] = set()
# Skip words: the pinned host words copies store their skip time into, one per copy, taken in
# turn from one array per device (allocated once: a pinned allocation per copy cost the copy's
# set-up). A word comes round again after _SKIP_WORDS later copies on its device; a copy still
# pending then (queued for longer than its deadline allows) could only make the newer copy read
# a skip it did not have: its sender fails, never the other way round.
_SKIP_WORDS = 4096
_skip_words: dict[int, tuple[torch.Tensor, np.ndarray, itertools.count, int]] = {}  # CUDA device index -> words, their address
_skip_words_lock = threading.Lock()


class KVCopyError(ValueError):
    """A copy the kernel cannot do (pools, tables, alignment, width, size); the message says which."""


class RowShape(NamedTuple):
    """How every copy of a pool pair splits its KV bytes into rows (planned by
    ``shared.transfer.direct_write.plan_rows``; part of a ``CopyRoute``).

    ``block`` tokens per block (it divides both page sizes); a copy of ``num_tokens`` covers
    ``ceil(num_tokens / block)`` blocks. Each block is ``rows`` rows, contiguous on both
    sides and moved with ``vector_bytes``-wide accesses: ``heads_per_row`` consecutive heads
    of one K/V half (``rows_per_kv`` rows per half), or with ``rows == 1`` both halves of a
    whole page (``rows_per_kv == 1``). Destination heads start at ``head_start``.
    """

    vector_bytes: int
    block: int
    rows: int
    rows_per_kv: int
    heads_per_row: int
    head_start: int


def kv_copy_reference(src: torch.Tensor, src_table: torch.Tensor, dst: torch.Tensor, dst_table: torch.Tensor,
                      layers: range, head_start: int, num_tokens: int) -> None:
    """Copy tokens ``[0, num_tokens)`` of every source head of ``layers`` into destination heads
    ``[head_start, head_start + src heads)``: gather by ``src_table``, scatter by ``dst_table``."""
    src_ps, dst_ps, heads = src.shape[4], dst.shape[4], src.shape[3]
    tokens = torch.arange(num_tokens, device=src.device)
    src_pages, dst_pages = src_table.to(src.device, torch.long)[tokens // src_ps], dst_table.to(src.device, torch.long)[tokens // dst_ps]
    # Advanced indices split by slices put the token axis first: [tokens, layers, 2, heads, head_dim].
    values = src[layers.start : layers.stop][:, src_pages, :, :, tokens % src_ps]
    dst[layers.start : layers.stop, :, :, head_start : head_start + heads][:, dst_pages, :, :, tokens % dst_ps] = values


class CopyRoute:
    """What every copy from pool ``src`` into pool ``dst`` with row shape ``rows`` on one CUDA
    stream (``stream``, default the current one now; none on CPU) shares, checked and made
    once: the two pools checked against each other (``KVCopyError``), their page sizes and
    counts, and on CUDA the fixed launch parameters and the parameter slots (``_ParamSlot``)
    copies take in turn, per capacity (page ids per side, a power of two). The route refers to
    its pools weakly (a kept route never keeps a decode rank's mapped storage alive); a copy
    holds them while it may run. Keep one per pool pair: a transfer's set-up runs cold on its
    host (2x H200, 20 ms idle before each: ~0.5 ms for a 6k-token sender at 06be092c0e76),
    where making a launch's parameters afresh (an allocation, a pageable host-to-device copy,
    a launcher) cost ~0.15 ms of it, and checking the pools and looking a kept route up by
    their shapes, addresses and row shape a few tens of microseconds more (the lookup that
    ``shared.transfer.direct_write`` keeps by the tensors' identity replaced it).

    Slots: one given back with its copy's work known to have run (the transfer saw its
    landing event) is free at once; one given back with work maybe still queued gets an event
    recorded behind that work and is taken again once the event completed: the pinned words
    are no longer read and the device words no longer used. Every use of a slot is on the
    route's one stream, so the oldest pending slot's event completes first: ``take`` asks it
    alone.
    """

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, rows: RowShape, stream: torch.cuda.Stream | None = None) -> None:
        if src.dim() != 6 or dst.dim() != 6 or src.dtype != dst.dtype or src.shape[0] != dst.shape[0]:
            raise KVCopyError(f"KV copy from {tuple(src.shape)} {src.dtype} into {tuple(dst.shape)} {dst.dtype}: "
                              "needs two [layers, pages, 2, heads, page_size, head_dim] pools of one dtype and layer count")
        self.src, self.dst = weakref.ref(src), weakref.ref(dst)
        self.addresses = (src.data_ptr(), dst.data_ptr())  # what the launch parameters were made for
        self.device = src.device
        self.rows = rows
        self.num_layers = src.shape[0]
        self.page_sizes = (src.shape[4], dst.shape[4])
        self.num_pages = (src.shape[1], dst.shape[1])
        self.stream: torch.cuda.Stream | None = None
        if not src.is_cuda:
            if dst.device != src.device:
                raise KVCopyError(f"KV copy from {src.device} into {dst.device}: the reference copies within one device")
            return
        if not dst.is_cuda or not src.is_contiguous() or not dst.is_contiguous():
            raise KVCopyError(f"the KV copy kernel needs two contiguous CUDA pools, got {src.device} and {dst.device}")
        self.stream = stream or torch.cuda.current_stream(src.device)
        self.fixed = _fixed_launch_params(src, dst, rows)
        self.device_index = src.get_device()
        self._lock = threading.Lock()  # copies are set up on one thread and released on another
        self._free: dict[int, deque[_ParamSlot]] = {}  # capacity -> slots given back: known free first, then pending oldest first
        weakref.finalize(self, _retire, self._free).atexit = False

    def take(self, ids: int) -> _ParamSlot:
        """A slot for tables of up to ``ids`` page ids per side: the first given back, if free
        (its work ran), else a new one."""
        capacity = max(_SLOT_MIN_IDS, 1 << (ids - 1).bit_length())
        with self._lock:
            free = self._free.get(capacity)
            if free and (not free[0].pending or free[0].idle.query()):
                return free.popleft()
        return _ParamSlot(self, capacity)

    def give_back(self, slot: _ParamSlot, ran: bool) -> None:
        """Keep ``slot`` for later copies; ``ran``: its copy's work is known to have completed."""
        slot.pending = not ran
        if slot.pending:
            slot.idle.record(self.stream)  # behind every launch of the copy that held it
        with self._lock:
            free = self._free.setdefault(slot.capacity, deque())
            if ran:
                free.appendleft(slot)
            else:
                free.append(slot)


_retiring: set[_ParamSlot] = set()  # pending slots of collected routes, kept until their work ran


def _retire(free: dict[int, deque[_ParamSlot]]) -> None:
    """A collected route's slots: those whose work may still be queued stay alive until their
    ``idle`` event completed. Dropped at once, a slot's pinned words would go back to torch's
    host allocator, which hands a block out again at once unless a stream use was recorded on
    it (the driver's upload records none): the next slot could rewrite them before the queued
    upload read them. Set operations only (atomic under the GIL), as a finalizer may run
    within another."""
    _retiring.update(slot for slots in free.values() for slot in slots if slot.pending)
    for slot in list(_retiring):
        if slot.idle.query():
            _retiring.discard(slot)


class KVCopy:
    """One sequence's copy of tokens ``[0, num_tokens)`` along ``route`` (its pools, row shape
    and stream), set up once; ``copy(layers)`` moves a group of layers: the CuTeDSL kernel on
    CUDA (one launch on the route's stream), the torch reference elsewhere.

    ``src_table`` / ``dst_table``: the sequence's page ids on each side (host sequences,
    arrays or tensors), checked here against the pools (``KVCopyError`` on an id outside its
    pool, negative ones included: the kernel trusts them). On CUDA they go, with the copy's
    launch parameters, into a parameter slot of the route and from its pinned memory to the
    GPU in one asynchronous copy on the route's stream, here; the slot is the copy's until
    ``release()`` (or until the copy is collected). ``deadline_ns`` (device clock,
    ``device_time_ns``; None: none): a copy starting later writes nothing and sets
    ``skipped_at_ns``. Raises ``KVCopyError`` on tables the copy cannot take, or a route whose
    pools are gone. One thread at a time calls ``copy``.
    """

    def __init__(self, route: CopyRoute, src_table: Sequence[int] | np.ndarray | torch.Tensor, dst_table: Sequence[int] | np.ndarray | torch.Tensor,
                 num_tokens: int, deadline_ns: int | None = None) -> None:
        self.src, self.dst = route.src(), route.dst()  # held while copies may run
        if self.src is None or self.dst is None:
            raise KVCopyError("KV copy along a route whose pools were freed")
        self._route, self._slot = route, None
        self.num_tokens = num_tokens
        self.blocks = -(-num_tokens // route.rows.block)
        self.deadline_ns = NO_DEADLINE if deadline_ns is None else deadline_ns
        (src_ps, dst_ps), (src_pages, dst_pages) = route.page_sizes, route.num_pages
        src_need, dst_need = -(-num_tokens // src_ps), -(-num_tokens // dst_ps)  # pages the tokens cover
        if route.stream is None:
            self._tables = (torch.from_numpy(page_ids("source", src_table, src_need, src_pages).astype(np.int64)),
                            torch.from_numpy(page_ids("destination", dst_table, dst_need, dst_pages).astype(np.int64)))
            self._skipped_at = 0
            return
        slot = route.take(max(src_need, dst_need))
        try:
            _fill_page_ids("source", src_table, src_need, src_pages, slot.src_ids)
            _fill_page_ids("destination", dst_table, dst_need, dst_pages, slot.dst_ids)
        except KVCopyError:
            route.give_back(slot, ran=True)  # nothing of it was enqueued
            raise
        self._skip_words, self._skip_index, skip_at = _take_skip_word(route.device_index)  # the kernel stores to it through its host address (UVA)
        self._grid_items = self.blocks * route.rows.rows  # items of one layer
        _REQUEST_WORDS.pack_into(slot.host, 8 * _REQUEST_PARAMS.start, self._grid_items, self.deadline_ns, skip_at)
        slot.upload(dst_need)
        self._launcher = slot.launcher
        self._slot = slot

    @property
    def skipped_at_ns(self) -> int | None:
        """When (device clock) a copy found its deadline passed and wrote nothing, or None; on
        CUDA read it once the copies completed (an event recorded after them)."""
        at = self._skipped_at if self._route.stream is None else int(self._skip_words[self._skip_index])  # pinned memory
        return at or None

    def copy(self, layers: range) -> None:
        """Enqueue the copy of ``layers`` (on CPU: copy now)."""
        if not 0 <= layers.start < layers.stop <= self._route.num_layers:
            raise KVCopyError(f"KV copy of layers {layers}: the pools hold layers 0..{self._route.num_layers - 1}")
        if self._route.stream is None:
            now = time.time_ns()
            if now > self.deadline_ns:
                self._skipped_at = now
            else:
                kv_copy_reference(self.src, self._tables[0], self.dst, self._tables[1], layers, self._route.rows.head_start, self.num_tokens)
            return
        if self._slot is None:
            raise KVCopyError("KV copy released: its parameter slot may belong to another copy now")
        items = self._grid_items * len(layers)
        if items > MAX_ITEMS:
            raise KVCopyError(f"KV copy of {items} (layer, block, row) items, above the kernel's {MAX_ITEMS}")
        self._launcher.launch(layers.start, len(layers), items)

    def release(self, ran: bool = False) -> None:
        """No more ``copy`` calls: the copy's parameter slot goes back to its route, for a copy
        set up once the ones enqueued so far ran: ``ran`` says the caller saw them complete
        (an event recorded after them), else an event recorded behind them here tells later.
        ``skipped_at_ns`` stays readable. Nothing on CPU; a second call does nothing."""
        slot, self._slot = getattr(self, "_slot", None), None
        if slot is not None:
            self._route.give_back(slot, ran)

    def __del__(self) -> None:
        if not sys.is_finalizing():  # at exit nothing waits for the slot
            self.release()


def page_ids(name: str, table: Sequence[int] | np.ndarray | torch.Tensor, need: int, pages: int) -> np.ndarray:
    """The first ``need`` ids of ``table`` (``name`` it in errors) as an integer array, each checked
    to name one of a pool's ``pages`` pages (``KVCopyError``: a write elsewhere would land in
    another request's pages or kill the CUDA context)."""
    ids = np.asarray(table.cpu() if isinstance(table, torch.Tensor) else table)
    if ids.ndim != 1 or ids.dtype.kind not in "iu" or len(ids) < need:
        raise KVCopyError(f"{name} page table must list at least {need} integer page ids, got {ids.dtype} {ids.shape}")
    ids = ids[:need]
    _check_page_ids(name, ids, pages)
    return ids


def _check_page_ids(name: str, ids: np.ndarray, pages: int) -> None:
    # Negative ids read as unsigned are above any page count: one reduction checks both ends.
    if len(ids) and int((ids.view(_UNSIGNED[ids.itemsize]) if ids.dtype.kind == "i" else ids).max()) >= pages:
        raise KVCopyError(f"{name} page table names pages outside 0..{pages - 1}")


def _fill_page_ids(name: str, table: Sequence[int] | np.ndarray | torch.Tensor, need: int, pages: int, out: np.ndarray) -> None:
    """Write the first ``need`` ids of ``table`` into ``out`` (a slot's int32 words) and check them
    as ``page_ids`` does. A list (the allocator's tables, a descriptor's ids) is packed straight
    in (``struct.pack_into`` converts and range-checks each id): building an array from it first
    cost more than the rest of the check on a transfer's cold set-up path."""
    if not isinstance(table, list):
        out[:need] = page_ids(name, table, need, pages)
        return
    if len(table) < need:
        raise KVCopyError(f"{name} page table must list at least {need} integer page ids, got {len(table)}")
    ids = table if len(table) == need else table[:need]
    try:
        # Packed as unsigned, struct refuses negative ids, so one pass (max) checks the rest: the
        # two tables' packing and checks took 64-74 us of a 6k-token set-up on 2x H200 (dc753919bd30).
        struct.pack_into(f"{need}I", out, 0, *ids)
    except struct.error as e:
        if all(isinstance(i, numbers.Integral) for i in ids):  # negative or past 2**32: outside any pool
            raise KVCopyError(f"{name} page table names pages outside 0..{pages - 1}") from None
        raise KVCopyError(f"{name} page table must hold integer page ids ({e})") from None
    if ids and max(ids) >= pages:  # a builtin over the packed ints: no numpy on the set-up path
        raise KVCopyError(f"{name} page table names pages outside 0..{pages - 1}")


def _fixed_launch_params(src: torch.Tensor, dst: torch.Tensor, rows: RowShape) -> np.ndarray:
    """The launch parameters before ``src_table`` (``LAUNCH_PARAMS``): fixed by the two contiguous
    pools (addresses, shapes, dtype) and the row shape (kept with a ``CopyRoute``)."""
    vec, esz = rows.vector_bytes, src.element_size()
    src_at = src.data_ptr()
    dst_at = dst.data_ptr() + rows.head_start * dst.stride(3) * esz
    row_bytes = src.shape[5] * esz  # one token of one head
    if vec not in VECTOR_BYTES or any(x % vec for x in (src_at, dst_at, row_bytes)):
        raise KVCopyError(f"KV copy with {vec}-byte accesses: rows of {row_bytes} bytes at {src_at:#x} / {dst_at:#x} "
                          f"are not {vec}-byte aligned (kernel widths: {VECTOR_BYTES})")
    tok = row_bytes // vec
    # Contiguous pools: every stride is a multiple of a row, so of the vector too.
    src_strides, dst_strides = (tuple(s * esz // vec for s in (t.stride(1), t.stride(2), t.stride(3), t.stride(0))) for t in (src, dst))
    return np.array((src_at, dst_at, rows.rows, rows.rows_per_kv, rows.heads_per_row * rows.block * tok, rows.block, src.shape[4], dst.shape[4], tok,
                     *src_strides, *dst_strides), dtype=np.int64)


class _ParamSlot:
    """A copy's launch parameters and page tables: pinned host words (the parameters, then
    ``capacity`` int32 page ids per side) that the set-up fills and one asynchronous copy
    moves into the slot's device words, which the kernel reads; the launcher bound to those
    (``kv_copy_sm90.Launcher``); ``idle``, recorded behind the last work of the copy that held
    the slot when that work may still be ``pending``. The tables' addresses and the pools'
    parameters are written once, here."""

    def __init__(self, route: CopyRoute, capacity: int) -> None:
        from kernels import kv_copy_sm90  # CuTeDSL is imported only on the GPU path

        self.capacity = capacity
        words = len(LAUNCH_PARAMS) + capacity  # 2 * capacity int32 ids in `capacity` int64 words
        self._pinned = torch.empty(words, dtype=torch.int64, pin_memory=True)
        host = self._pinned.numpy()
        self._device = _DeviceBlock(route.device_index, 8 * words, route.stream)
        tables_at = self._device.ptr + 8 * len(LAUNCH_PARAMS)
        host[:_FIXED_PARAMS] = route.fixed
        host[_FIXED_PARAMS:_REQUEST_PARAMS.start] = (tables_at, tables_at + 4 * capacity)
        self.host = host  # the pinned words: launch parameters, then the two tables' ids
        ids = host[len(LAUNCH_PARAMS) :].view(np.int32)
        self.src_ids, self.dst_ids = ids[:capacity], ids[capacity:]
        self.idle = torch.cuda.Event()
        self.pending = False
        self.launcher = kv_copy_sm90.Launcher(route.device_index, route.stream, route.rows.vector_bytes, self._device.ptr)
        self._stream_handle = route.stream.cuda_stream  # passed to the driver as it is
        self._device_index = route.device_index
        self._host_at = self._pinned.data_ptr()
        self._upload = kv_copy_sm90.upload

    def upload(self, dst_ids: int) -> None:
        """Copy the parameters, the source table and the first ``dst_ids`` destination ids to
        the device on the route's stream (asynchronous: the host words are pinned)."""
        nbytes = 8 * len(LAUNCH_PARAMS) + 4 * (self.capacity + dst_ids)
        if torch.cuda.current_device() == self._device_index:  # the usual case: no device switch to pay for
            self._upload(self._device.ptr, self._host_at, nbytes, self._stream_handle)
            return
        with torch.cuda.device(self._device_index):  # the driver's copy in the device's primary context
            self._upload(self._device.ptr, self._host_at, nbytes, self._stream_handle)


class _DeviceBlock:
    """Device memory from torch's caching allocator for work on one stream, given back when
    the block is collected: like a tensor's, its memory is reused only by work ordered after
    everything already enqueued on that stream (the copies that read it)."""

    def __init__(self, device_index: int, nbytes: int, stream: torch.cuda.Stream) -> None:
        self.ptr = torch.cuda.caching_allocator_alloc(nbytes, device_index, stream.cuda_stream)
        weakref.finalize(self, torch.cuda.caching_allocator_delete, self.ptr)


def prepare_kv_copy(device: torch.device, vector_bytes: int) -> None:
    """Compile the kernel for ``vector_bytes``-wide accesses and, on CUDA, run it once on a scratch
    pool and relate the device's clock to the host's (``device_time_ns``), so the first real
    copy on ``device`` pays neither the compile, the module load nor the calibration."""
    from kernels import kv_copy_sm90

    kv_copy_sm90.compile_kv_copy(vector_bytes)
    if device.type != "cuda":
        return
    pool, rows = _scratch(device, vector_bytes)
    KVCopy(CopyRoute(pool, pool, rows), [0], [1], 1).copy(range(1))  # page 0 -> page 1 (and the device's skip words made)
    torch.cuda.synchronize(device)
    _clock_width.setdefault(device, vector_bytes)
    _clock[device] = (time.monotonic(), _calibrate(device))


def device_time_ns(device: torch.device, unix_s: float) -> int:
    """Host wall-clock time ``unix_s`` (seconds, ``time.time()``) on ``device``'s clock in ns, the
    clock of ``KVCopy``'s deadline: ``%globaltimer`` on CUDA (related to the host clock within
    tens of microseconds, once a minute), the host clock itself on CPU."""
    ns = int(unix_s * 1e9)
    if device.type != "cuda":
        return ns
    calibrated = _clock.get(device)
    if calibrated is None:
        offset = _calibrate(device)
        _clock[device] = (time.monotonic(), offset)
        return ns + offset
    calibrated_at, offset = calibrated
    if time.monotonic() - calibrated_at >= _CLOCK_MAX_AGE_S and device not in _recalibrating:
        # Off the caller's path (a transfer's set-up): this offset is a minute old, its drift far
        # inside the deadline guard's slack (``shared.transfer.cuda_ipc.WRITE_GUARD_AFTER_LEASE_S``).
        _recalibrating.add(device)
        threading.Thread(target=_recalibrate, args=(device,), name="kv-copy-clock", daemon=True).start()
    return ns + offset


def _recalibrate(device: torch.device) -> None:
    try:
        _clock[device] = (time.monotonic(), _calibrate(device))
    finally:
        _recalibrating.discard(device)


def _take_skip_word(device_index: int) -> tuple[np.ndarray, int, int]:
    """The next skip word of CUDA device ``device_index`` (module state above), zeroed: the
    device's words, its index among them and its address."""
    words = _skip_words.get(device_index)
    if words is None:
        with _skip_words_lock:
            words = _skip_words.get(device_index)
            if words is None:
                pinned = torch.zeros(_SKIP_WORDS, dtype=torch.int64, pin_memory=True)
                words = _skip_words[device_index] = (pinned, pinned.numpy(), itertools.count(), pinned.data_ptr())
    _, view, counter, address = words
    i = next(counter) % _SKIP_WORDS  # itertools.count: one increment per call, whichever thread
    _WORD.pack_into(view, 8 * i, 0)
    return view, i, address + 8 * i


def _scratch(device: torch.device, vector_bytes: int) -> tuple[torch.Tensor, RowShape]:
    """A two-page pool of one layer, one head and one vector per token, and the row shape of a
    one-token copy from its page 0 into its page 1."""
    pool = torch.zeros(1, 2, 2, 1, 1, vector_bytes, dtype=torch.uint8, device=device)  # [layer, 2 pages, K/V, head, slot, dim]
    return pool, RowShape(vector_bytes, block=1, rows=1, rows_per_kv=1, heads_per_row=2, head_start=0)


def _calibrate(device: torch.device) -> int:
    """Device clock minus host clock (ns): a copy with a deadline in the past stores
    ``%globaltimer`` as it starts, between two host clock readings (on a stream of its
    own, never queued behind transfer writes that wait for compute)."""
    width = _clock_width.get(device, VECTOR_BYTES[0])
    kept = _probes.get((device, width))
    if kept is None:  # one stream, scratch pool and copy route per device, kept for every calibration
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            pool, rows = _scratch(device, width)
        kept = _probes[(device, width)] = (pool, CopyRoute(pool, pool, rows, stream))
    _, route = kept
    probe = KVCopy(route, [0], [1], 1, deadline_ns=0)
    done = torch.cuda.Event()
    before = time.time_ns()
    probe.copy(range(1))
    done.record(route.stream)
    done.synchronize()
    after = time.time_ns()
    device_ns = probe.skipped_at_ns
    if device_ns is None:
        raise KVCopyError(f"clock calibration on {device}: the probe copy did not report its start")
    return device_ns - (before + after) // 2
