"""Decode side: reserve pages for a request, receive its KV shards, say when all landed.

Lifecycle of one reservation (keyed by request id)::

    reserve() -> RECEIVING --all (layer, head) cells landed--> COMPLETE --wait_complete()--> claimed
                     |                                            |
                     +-- cancel() --> CANCELLED (drains)          +-- lease ends --> EXPIRED
                     +-- cancel(once_landed=True): stays RECEIVING, goes COMPLETE -> CANCELLED
                     +-- lease ends / bad chunk / UCX error --> FAILED

Pages are freed on every path except a successful ``wait_complete``, which hands
them to the caller (free them with ``kvcache.allocator.free`` when the request ends).

Same-host fast path: on CUDA the receiver exports its KV storage once through CUDA IPC
(``cuda_ipc.export_storage``; off with ``cuda_ipc=False`` or ``MOEBUS_KV_CUDA_IPC=0``)
and every descriptor carries it. A sender that can open it writes straight into the
pages and sends ``"landed"`` headers (no data message) as it issues the writes, each
with an interprocess CUDA event recorded after them; the cells are marked landed,
exactly as after a scatter, once that event completed (``_await_landing``) before the
lease deadline (after it, the kernel's deadline guard may have skipped them). Because
such a writer bypasses this process, a cancelled,
expired or failed reservation that may have one does not free its pages at once: they
stay quarantined until every head is quiet (all its layers landed, its sender sent
``"stopped"``, or its sender sends chunks over UCX, so never writes directly) or until
the lease deadline + ``DIRECT_WRITE_GRACE_S`` (senders issue no write after the lease
deadline; see ``shared.transfer.cuda_ipc`` for the whole argument).
``num_quarantined_pages`` counts them. A ``"stopped"`` header for a request still
receiving fails it with ``PeerFailed``.
The decode side does not know the prefill TP size: each chunk announces its head
and layer range, and the request is complete when every (layer, head) cell has
landed exactly once.

A completed request's ``TransferRecord.phases_s`` (seconds, summed over chunks):
``first_header`` (reservation -> first header: the prefill's compute and start-up),
``post`` (header arrived -> its chunk's receive posted: staging wait; UCX path), ``wire``
(receive posted -> chunk in staging), ``scatter`` (in staging -> in the pages), ``tail``
(last chunk in staging -> request complete). ``wait_complete`` logs ``kv.claimed``
with ``notify_s``, the time from completion to the waiter having the pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec
import numpy as np
import structlog
import torch

from schemas.transfer import KVTransferDescriptor, KVTransferLayout, ShardHeader
from shared.kvcache import PagedKVCache
from shared.tasks import spawn
from shared.transfer.cuda_ipc import CudaIpcUnavailable, enabled_by_env, export_storage, open_landing_event
from shared.transfer.errors import Cancelled, LeaseExpired, PeerFailed, ProtocolError, TransferError, TransferTimeout, UnknownTransfer
from shared.transfer.metrics import PhaseTimes, TransferMetrics, TransferRecord
from shared.transfer.shard import chunk_nbytes, chunk_view, scatter_layers
from shared.transfer.staging import StagingPool
from shared.transfer.streams import event_done, event_spun, side_stream, watch_event
from shared.transfer.worker import HEADER_FRAME_BYTES, TransferWorker, UCXError, data_tag, decode_header, header_tag, ucx_buffer

log = structlog.get_logger(__name__)

_ENDED_KEPT = 1024
DEFAULT_STAGING_SLOT_BYTES = 256 << 20  # the largest chunk senders may send (max_chunk_bytes)
# Senders stop at the lease deadline; a receive abandoned earlier keeps its staging slot
# until then plus this margin (messages already on the wire, clock skew between hosts).
_ABANDONED_RECV_GRACE_S = 2.0
# Pages a direct (CUDA IPC) writer may still write stay quarantined until the lease deadline
# plus this margin: the writer's last kernels, issued before the deadline, end within ms.
DIRECT_WRITE_GRACE_S = 2.0
# Waiting for a sender's landing event with its estimate: wake this long before it (the loop's
# timers fire up to 1 ms late), poll between loop iterations until this long after it plus a
# quarter of the time it was ahead (the estimate takes the link's peak rate; two sender processes
# sharing a GPU copy ~15% slower on 2x H200: their peer copies at once 327-336 GB/s against one
# process's 383-393), then hand over to the watcher thread, which
# polls this often (also for a header without estimate: the sender's compute still ran).
_LANDING_WAKE_EARLY_S = 1.5e-3
_LANDING_SPIN_S = 2e-3
_LANDING_SLOW_FRACTION = 0.25
_LANDING_POLL_S = 25e-6


class _State(enum.Enum):
    RECEIVING = "receiving"
    COMPLETE = "complete"
    CANCELLED = "cancelled"
    FAILED = "failed"
    EXPIRED = "expired"


@dataclass
class _Reservation:
    request_id: str
    transfer_id: int
    page_ids: list[int]
    page_table: torch.Tensor
    num_tokens: int
    announced: np.ndarray  # [layers, heads] bool: a header claimed the cell
    landed: np.ndarray  # [layers, heads] bool: the cell is in the pages
    done: asyncio.Future[list[int]]
    lease_ends_at: float  # event-loop time
    lease: asyncio.TimerHandle | None = None
    waiters: list[asyncio.Future[None]] = field(default_factory=list)  # wait_complete calls, woken with ``done``
    state: _State = _State.RECEIVING
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    nbytes: int = 0
    chunks: int = 0
    first_header_at: float | None = None
    reserved_at: float = 0.0  # perf_counter
    reserved_unix: float = 0.0
    last_landed_at: float = 0.0  # perf_counter: the latest chunk in staging
    completed_at: float | None = None  # perf_counter, once COMPLETE
    phases: PhaseTimes = field(default_factory=PhaseTimes)
    error: TransferError | None = None  # why it ended, once cancelled / failed / expired
    direct: bool = False  # the descriptor offered CUDA IPC: a sender may write the pages directly
    no_direct_writer: np.ndarray | None = None  # [heads] bool: the head's sender stopped, or sends over UCX
    direct_chunks: int = 0  # landed through direct writes ("landed" headers)
    quarantine: asyncio.TimerHandle | None = None  # pending free of pages a direct writer may write
    pages_freed: bool = False
    cancel_once_landed: bool = False  # cancelled while its (fully sent) KV was arriving: dropped when it lands


class KVReceiver:
    """Receives KV shards into a decode rank's ``PagedKVCache`` over its ``TransferWorker``.

    ``staging`` holds chunks between arrival and scatter (default: 4 slots of 256 MiB on
    the cache's device); its slot size is the largest chunk senders may send
    (``max_chunk_bytes``) and must hold one layer of a request (all heads), which
    ``reserve`` checks.
    """

    def __init__(self, worker: TransferWorker, kvcache: PagedKVCache, *, staging: StagingPool | None = None, metrics: TransferMetrics | None = None, cuda_ipc: bool | None = None) -> None:
        self._worker = worker
        self._cache = kvcache
        self.staging = staging or StagingPool(DEFAULT_STAGING_SLOT_BYTES, 4, kvcache.device)
        self.metrics = metrics or TransferMetrics()
        self._reservations: dict[str, _Reservation] = {}
        # Outcome of recently ended reservations, so a late wait_complete gets the real reason.
        self._ended: OrderedDict[str, TransferError] = OrderedDict()
        self._reapers: set[asyncio.Task[None]] = set()  # slots waiting on abandoned receives
        self._quarantined: dict[int, _Reservation] = {}  # id -> ended reservation whose pages wait
        self._scatter_stream = side_stream(kvcache.device)
        layout = kvcache.layout
        self._layout = KVTransferLayout(layout.num_layers, layout.page_size, layout.kv_heads, layout.head_dim, str(layout.dtype).removeprefix("torch."))
        self.cuda_ipc_export = None  # CudaIpcExport of the KV storage, offered in every descriptor
        if (enabled_by_env() if cuda_ipc is None else cuda_ipc) and kvcache.device.type == "cuda":
            try:
                self.cuda_ipc_export = export_storage(kvcache.storage)
                log.info("kv.cuda_ipc_exported", device=str(kvcache.device), bytes=self.cuda_ipc_export.storage_size_bytes)
            except (CudaIpcUnavailable, RuntimeError) as e:
                log.warning("kv.cuda_ipc_unavailable", reason=f"export failed: {e}")

    @property
    def num_free_pages(self) -> int:
        return self._cache.allocator.num_free

    @property
    def num_reservations(self) -> int:
        """Reservations holding pages (cancelled ones still draining their chunks are not counted)."""
        return sum(res.state in (_State.RECEIVING, _State.COMPLETE) for res in self._reservations.values())

    @property
    def num_quarantined_pages(self) -> int:
        """Pages of ended reservations held back because a direct writer may still write them."""
        return sum(len(res.page_ids) for res in self._quarantined.values())

    def reserve(self, request_id: str, num_tokens: int, lease_s: float) -> KVTransferDescriptor:
        """Allocate pages for ``num_tokens`` and start listening for their KV.

        Raises ``OutOfPages`` (nothing allocated), ``ValueError`` on bad arguments or
        when one layer of this request would not fit the staging budget.
        """
        if request_id in self._reservations:
            raise ValueError(f"request {request_id!r} already has a KV reservation")
        if num_tokens <= 0 or lease_s <= 0:
            raise ValueError(f"reserve({request_id!r}): num_tokens ({num_tokens}) and lease_s ({lease_s}) must be positive")
        layout = self._cache.layout
        one_layer = chunk_nbytes(1, layout.kv_heads, num_tokens, layout.head_dim, layout.dtype)
        if one_layer > self.staging.slot_bytes:
            raise ValueError(f"reserve({request_id!r}): one layer of {num_tokens} tokens is {one_layer} bytes, more than a {self.staging.slot_bytes}-byte staging slot")
        page_ids = self._cache.allocator.alloc(layout.pages_for(num_tokens))
        transfer_id = self._worker.new_transfer_id()
        loop = asyncio.get_running_loop()
        with torch.cuda.stream(self._scatter_stream) if self._scatter_stream is not None else contextlib.nullcontext():
            # Uploaded on the scatter stream, which reads it: no wait behind a decode step.
            page_table = torch.tensor(page_ids, dtype=torch.long).to(self._cache.device, non_blocking=True)
        res = _Reservation(
            request_id=request_id,
            transfer_id=transfer_id,
            page_ids=page_ids,
            page_table=page_table,
            num_tokens=num_tokens,
            announced=np.zeros((layout.num_layers, layout.kv_heads), dtype=bool),
            landed=np.zeros((layout.num_layers, layout.kv_heads), dtype=bool),
            done=loop.create_future(),
            lease_ends_at=loop.time() + lease_s,
            reserved_at=time.perf_counter(),
            reserved_unix=time.time(),
            direct=self.cuda_ipc_export is not None,
            no_direct_writer=np.zeros(layout.kv_heads, dtype=bool),
        )
        # A failed request nobody waits for must not log "exception never retrieved".
        res.done.add_done_callback(lambda f: f.cancelled() or f.exception())
        res.lease = loop.call_later(lease_s, self._end_lease, res)
        self._reservations[request_id] = res
        spawn(res.tasks, self._receive_headers(res))
        log.info("kv.reserved", request_id=request_id, transfer_id=transfer_id, num_tokens=num_tokens, pages=len(page_ids), lease_s=lease_s)
        return KVTransferDescriptor(
            worker_address=self._worker.address,
            request_id=request_id,
            transfer_id=transfer_id,
            page_ids=page_ids,
            num_tokens=num_tokens,
            layout=self._layout,
            lease_deadline_unix=time.time() + lease_s,
            max_chunk_bytes=self.staging.slot_bytes,
            cuda_ipc=self.cuda_ipc_export,
        )

    async def wait_complete(self, request_id: str, timeout: float) -> list[int]:
        """The request's page ids once every shard landed; the caller then owns the pages.

        Raises ``TransferTimeout`` (the reservation stays, cancel it or wait again),
        ``LeaseExpired``, ``PeerFailed``, ``ProtocolError``, ``Cancelled``, ``UnknownTransfer``.
        """
        res = self._reservations.get(request_id)
        if res is None:
            if request_id in self._ended:
                raise self._ended[request_id]
            raise UnknownTransfer(f"no KV reservation for request {request_id!r} (never made, or already claimed)")
        if not res.done.done():
            # A waiter of our own that _complete / _terminate set directly: the caller resumes in the
            # next loop iteration (shielding ``done`` instead, which a timeout must not cancel, costs
            # one more hop through its done-callback).
            waiter = asyncio.get_running_loop().create_future()
            res.waiters.append(waiter)
            try:
                async with asyncio.timeout(timeout):
                    await waiter
            except TimeoutError:
                raise TransferTimeout(request_id, f"KV not complete after {timeout:.3g}s ({int(res.landed.sum())}/{res.landed.size} layer-heads landed)") from None
            finally:
                res.waiters.remove(waiter)
        pages = res.done.result()  # raises the reservation's error
        if res.error is not None:  # completed, then cancelled or expired before this call
            raise res.error
        self._retire(res)
        assert res.completed_at is not None
        _log_soon("kv.claimed", request_id=request_id, notify_s=time.perf_counter() - res.completed_at)
        return pages

    def cancel(self, request_id: str, *, once_landed: bool = False) -> bool:
        """Drop the request's transfer and free its pages; False if unknown or already finished.

        Chunks still on the wire are drained (received and discarded) until the lease
        ends, so senders complete instead of stalling on a vanished receiver.

        ``once_landed``: every sender finished, so what is still on its way is the rest of the
        KV (the request ended at its first token). It lands first, counted as a completed
        transfer, then the pages are freed; a lease that ends before fails it as ever. A plain
        cancel here would count a failure for KV that did arrive: a sender's send completes
        before the receiver has seen its chunk, so the cancel can overtake the last chunks.
        """
        res = self._reservations.get(request_id)
        if res is None or res.state not in (_State.RECEIVING, _State.COMPLETE):
            return False
        if once_landed and res.state is _State.RECEIVING:
            res.cancel_once_landed = True
            return True
        self._terminate(res, _State.CANCELLED, Cancelled(request_id, "cancelled by the decode side"))
        return True

    async def close(self) -> None:
        """Cancel every reservation and wait for its tasks (pages freed, staging returned).

        Quarantined pages are freed at once too: close only when no prefill rank can still
        write this cache (the decode rank is shutting down)."""
        for res in list(self._reservations.values()):
            self._terminate(res, _State.CANCELLED, Cancelled(res.request_id, "receiver closed"))
            self._retire(res)
            await asyncio.gather(*res.tasks, return_exceptions=True)
        for res in list(self._quarantined.values()):
            self._free_pages(res)
        for reaper in list(self._reapers):
            reaper.cancel()
        await asyncio.gather(*self._reapers, return_exceptions=True)

    # -- internals -------------------------------------------------------------------

    async def _receive_headers(self, res: _Reservation) -> None:
        """Take chunk headers until every cell is announced; each announced chunk gets a receive task."""
        tag = header_tag(res.transfer_id)
        try:
            while not res.announced.all():
                frame = np.empty(HEADER_FRAME_BYTES, dtype=np.uint8)
                await self._worker.recv(tag, frame)
                header = self._check_header(res, frame)
                if header.kind == "chunk":
                    # One sender per head range, one path per sender: these heads are never written directly.
                    res.no_direct_writer[header.head_start : header.head_end] = True
                if header.kind == "stopped":
                    self._sender_stopped(res, header)
                elif res.state is _State.RECEIVING:
                    if res.first_header_at is None:
                        res.first_header_at = time.perf_counter()
                        res.phases.add("first_header", res.first_header_at - res.reserved_at)
                    if header.kind == "landed" and header.event is None:
                        self._landed(res, header, direct=True)
                    elif header.kind == "landed":
                        spawn(res.tasks, self._await_landing(res, header))
                    else:
                        spawn(res.tasks, self._receive_chunk(res, header, time.perf_counter()))
                elif header.kind == "landed" and header.event is None:
                    res.landed[header.layer_start : header.layer_end, header.head_start : header.head_end] = True
                elif header.kind == "landed":
                    # Cancelled (draining): the cells are quiet once their writes completed.
                    spawn(res.tasks, self._await_landing(res, header))
                else:
                    spawn(res.tasks, self._drain_chunk(res, header))
                self._lift_quarantine_if_quiet(res)
        except ProtocolError as e:
            self._terminate(res, _State.FAILED, e)
        except UCXError as e:
            self._terminate(res, _State.FAILED, PeerFailed(res.request_id, f"header receive failed: {e}"))

    def _check_header(self, res: _Reservation, frame: np.ndarray) -> ShardHeader:
        try:
            h = decode_header(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ProtocolError(res.request_id, f"undecodable shard header: {e}") from None
        layout = self._cache.layout
        problem = None
        if h.request_id != res.request_id or h.transfer_id != res.transfer_id:
            problem = f"header is for request {h.request_id!r} / transfer {h.transfer_id}"
        elif not (0 <= h.head_start < h.head_end <= layout.kv_heads and 0 <= h.layer_start < h.layer_end <= layout.num_layers):
            problem = f"heads [{h.head_start}, {h.head_end}) x layers [{h.layer_start}, {h.layer_end}) outside {layout.kv_heads} heads x {layout.num_layers} layers"
        elif h.kind != "chunk" and not res.direct:
            problem = f"a {h.kind!r} header, but this reservation offered no CUDA IPC export"
        elif h.kind == "stopped":
            return h
        elif h.num_tokens != res.num_tokens or h.dtype != self._layout.dtype:
            problem = f"chunk has {h.num_tokens} tokens of {h.dtype}, reserved {res.num_tokens} of {self._layout.dtype}"
        elif h.nbytes != chunk_nbytes(h.layer_end - h.layer_start, h.head_end - h.head_start, h.num_tokens, layout.head_dim, layout.dtype):
            problem = f"chunk size {h.nbytes} does not match its shape"
        elif h.kind == "chunk" and h.nbytes > self.staging.slot_bytes:
            problem = f"chunk of {h.nbytes} bytes exceeds max_chunk_bytes {self.staging.slot_bytes}"
        elif res.announced[h.layer_start : h.layer_end, h.head_start : h.head_end].any():
            problem = f"heads [{h.head_start}, {h.head_end}) x layers [{h.layer_start}, {h.layer_end}) overlap a chunk already announced"
        if problem:
            raise ProtocolError(res.request_id, problem)
        res.announced[h.layer_start : h.layer_end, h.head_start : h.head_end] = True
        return h

    async def _receive_chunk(self, res: _Reservation, h: ShardHeader, announced_at: float) -> None:
        buf: torch.Tensor | None = await self.staging.acquire(h.nbytes)
        scattered: torch.cuda.Event | None = None
        posted = time.perf_counter()
        res.phases.add("post", posted - announced_at)
        recv = asyncio.ensure_future(self._worker.recv(data_tag(res.transfer_id, h.head_start, h.layer_start), ucx_buffer(buf)))
        try:
            try:
                await asyncio.shield(recv)
            except asyncio.CancelledError:
                # The posted UCX receive still owns the slot: hand it back only once that
                # receive is over, so a late chunk can never land in another request's slot.
                spawn(self._reapers, self._release_after(recv, buf, res.lease_ends_at))
                buf = None
                raise
            if res.state is not _State.RECEIVING:
                return  # dropped while on the wire: its pages are gone, discard
            landed = time.perf_counter()
            res.phases.add("wire", landed - posted)
            layers, heads = range(h.layer_start, h.layer_end), range(h.head_start, h.head_end)
            chunk = chunk_view(buf, len(layers), len(heads), h.num_tokens, self._cache.layout.head_dim, self._cache.layout.dtype)
            if self._scatter_stream is None:
                scatter_layers(self._cache, layers, heads, res.page_table, h.num_tokens, chunk)
            else:
                # Own stream: the scatter neither waits behind nor delays the decode steps on the
                # default stream; the pages are not read before wait_complete, which follows it.
                with torch.cuda.stream(self._scatter_stream):
                    scatter_layers(self._cache, layers, heads, res.page_table, h.num_tokens, chunk)
                    scattered = torch.cuda.Event()
                    scattered.record(self._scatter_stream)
                await event_done(scattered, short=True)  # the scatter stream runs copies only
            res.phases.add("scatter", time.perf_counter() - landed)
            res.last_landed_at = max(res.last_landed_at, landed)
        except UCXError as e:
            self._terminate(res, _State.FAILED, PeerFailed(res.request_id, f"chunk receive failed: {e}"))
            return
        finally:
            if buf is not None:
                if scattered is not None:
                    scattered.synchronize()  # cancelled mid-scatter: the kernels still read the slot
                self.staging.release(buf)
        self._landed(res, h, direct=False)

    def _lift_quarantine_if_quiet(self, res: _Reservation) -> None:
        if res.quarantine is not None and self._quiet(res):
            log.info("kv.quarantine_lifted", request_id=res.request_id, pages=len(res.page_ids))
            self._free_pages(res)

    async def _await_landing(self, res: _Reservation, h: ShardHeader) -> None:
        """A ``"landed"`` header sent once the writes were enqueued (they may still wait for the
        prefill's compute): the cells land when the sender's interprocess event completes, if
        that is seen before the lease deadline. With the sender's estimate (its compute was
        done), sleep through most of it, then poll the event between the loop's iterations
        (``streams.event_spun``) for a while; otherwise, or past that, the process's watcher
        thread polls it every ``_LANDING_POLL_S`` (``streams.watch_event``). The loop never
        blocks on it; a sender that died before its writes ended never completes the event,
        and the lease ends the wait."""
        assert h.event is not None
        try:
            event = open_landing_event(h.event, h.sender_pid, self._cache.device)
        except CudaIpcUnavailable as e:
            self._terminate(res, _State.FAILED, PeerFailed(res.request_id, str(e)))
            return
        try:
            # Past the lease + grace no write can come any more (a cancelled reservation keeps
            # this task, and its pages are freed then): stop polling an event that may never complete.
            async with asyncio.timeout_at(res.lease_ends_at + DIRECT_WRITE_GRACE_S):
                seen = False
                if h.writes_done_unix:
                    ahead = max(0.0, h.writes_done_unix - time.time())
                    due = time.perf_counter() + ahead
                    await asyncio.sleep(max(0.0, ahead - _LANDING_WAKE_EARLY_S))
                    seen = await event_spun(event, until=due + _LANDING_SPIN_S + _LANDING_SLOW_FRACTION * ahead)
                if not seen:
                    await watch_event(event, poll_s=_LANDING_POLL_S)
        except TimeoutError:
            return
        except RuntimeError as e:  # CUDA reported an error on the sender's event: the cells never land
            self._terminate(res, _State.FAILED, PeerFailed(res.request_id, f"landing event of process {h.sender_pid} failed: {e}"))
            return
        if res.state is _State.RECEIVING and asyncio.get_running_loop().time() < res.lease_ends_at:
            self._landed(res, h, direct=True)
            return
        # Writes seen done only after the lease deadline may have been skipped by the kernel's
        # deadline guard (``cuda_ipc``): never counted as KV, but the sender is quiet now.
        res.landed[h.layer_start : h.layer_end, h.head_start : h.head_end] = True
        if res.state is _State.RECEIVING:
            self._end_lease(res)
        self._lift_quarantine_if_quiet(res)

    def _landed(self, res: _Reservation, h: ShardHeader, *, direct: bool) -> None:
        """The header's cells are in the pages (scattered from staging, or written directly)."""
        if direct:
            res.last_landed_at = time.perf_counter()
            res.direct_chunks += 1
        res.landed[h.layer_start : h.layer_end, h.head_start : h.head_end] = True
        res.nbytes += h.nbytes
        res.chunks += 1
        if res.landed.all():
            self._complete(res)

    def _sender_stopped(self, res: _Reservation, h: ShardHeader) -> None:
        """A direct sender gave up on heads [head_start, head_end): it writes nothing more."""
        assert res.no_direct_writer is not None
        res.no_direct_writer[h.head_start : h.head_end] = True
        if res.state is _State.RECEIVING:
            self._terminate(res, _State.FAILED, PeerFailed(res.request_id, f"the prefill rank sending heads [{h.head_start}, {h.head_end}) stopped"))

    @staticmethod
    def _quiet(res: _Reservation) -> bool:
        """No direct writer can still write the pages: every head fully landed, stopped, or sent over UCX."""
        return bool((res.landed.all(axis=0) | res.no_direct_writer).all())

    def _free_pages(self, res: _Reservation) -> None:
        if res.pages_freed:
            return
        res.pages_freed = True
        if res.quarantine is not None:
            res.quarantine.cancel()
            res.quarantine = None
        self._quarantined.pop(id(res), None)
        self._cache.allocator.free(res.page_ids)

    async def _release_after(self, recv: asyncio.Future[None], buf: torch.Tensor, lease_ends_at: float) -> None:
        """Release a slot once its abandoned receive finished, or once no sender can still
        be sending into it (the lease ended, plus a margin)."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(max(lease_ends_at, loop.time()) + _ABANDONED_RECV_GRACE_S):
                await recv
        except (TimeoutError, UCXError, asyncio.CancelledError):
            pass
        finally:
            self.staging.release(buf)

    async def _drain_chunk(self, res: _Reservation, h: ShardHeader) -> None:
        """Receive a dropped request's chunk into a 1-byte sink: UCX completes the sender
        and reports truncation here, which is the expected outcome."""
        try:
            await self._worker.recv(data_tag(res.transfer_id, h.head_start, h.layer_start), np.empty(1, dtype=np.uint8))
        except UCXError:
            pass

    def _complete(self, res: _Reservation) -> None:
        assert res.first_header_at is not None
        res.completed_at = time.perf_counter()
        res.phases.add("tail", res.completed_at - res.last_landed_at)
        path = "ucx" if res.direct_chunks == 0 else "cuda_ipc" if res.direct_chunks == res.chunks else "cuda_ipc+ucx"
        record = TransferRecord(res.request_id, res.nbytes, res.completed_at - res.first_header_at, res.chunks, res.reserved_unix, res.phases.seconds, path)
        res.state = _State.COMPLETE
        self.metrics.record_ok(record)
        res.done.set_result(list(res.page_ids))
        _wake(res)
        _log_soon("kv.received", request_id=res.request_id, bytes=record.nbytes, wall_s=record.wall_s, gbps=record.gbps, chunks=record.chunks, phases_s=record.phases_s, path=path)
        if res.cancel_once_landed:
            self._terminate(res, _State.CANCELLED, Cancelled(res.request_id, "cancelled by the decode side once its KV landed"))

    def _terminate(self, res: _Reservation, state: _State, error: TransferError) -> None:
        """Fail/cancel/expire: free the pages once, count the cause, wake the waiter.

        A reservation whose KV had all landed (counted as a completed transfer) and is let
        go unclaimed - the request finished at its first token, was cancelled, or its lease
        ran out before decode started - ends the request, not a transfer: it is logged as
        ``kv.released_unclaimed``, not counted as a transfer failure."""
        if res.state not in (_State.RECEIVING, _State.COMPLETE):
            return
        landed = res.state is _State.COMPLETE
        res.state = state
        res.error = error
        if res.direct and not self._quiet(res):
            loop = asyncio.get_running_loop()
            until = max(res.lease_ends_at, loop.time()) + DIRECT_WRITE_GRACE_S
            res.quarantine = loop.call_at(until, self._free_pages, res)
            self._quarantined[id(res)] = res
            log.info("kv.pages_quarantined", request_id=res.request_id, pages=len(res.page_ids), for_s=until - loop.time())
        else:
            self._free_pages(res)
        if not landed:
            self.metrics.record_failure(error.cause)
        if not res.done.done():
            res.done.set_exception(error)
            _wake(res)
        if landed:
            log.info("kv.released_unclaimed", request_id=res.request_id, cause=error.cause, reason=str(error))
        elif state is _State.CANCELLED:  # its owner ended the request (a client that hung up): not a fault to warn of
            log.info("kv.receive_cancelled", request_id=res.request_id, reason=str(error))
        else:
            log.warning("kv.receive_failed", request_id=res.request_id, cause=error.cause, error=str(error))
        if state is not _State.CANCELLED:
            # Nothing more to drain: stop listening now.
            current = asyncio.current_task()
            for task in res.tasks:
                if task is not current:
                    task.cancel()

    def _end_lease(self, res: _Reservation) -> None:
        if res.lease is not None:  # ended early (a landing seen past the deadline): the timer is moot
            res.lease.cancel()
        res.lease = None
        self._terminate(res, _State.EXPIRED, LeaseExpired(res.request_id, "lease ended before all KV shards landed"))
        self._retire(res)

    def _retire(self, res: _Reservation) -> None:
        """Forget the reservation: stop its lease timer and any task still listening."""
        if res.lease is not None:
            res.lease.cancel()
            res.lease = None
        for task in res.tasks:
            task.cancel()
        if self._reservations.get(res.request_id) is res:
            del self._reservations[res.request_id]
        if res.error is not None:
            self._ended[res.request_id] = res.error
            while len(self._ended) > _ENDED_KEPT:
                self._ended.popitem(last=False)


def _log_soon(event: str, **fields: object) -> None:
    """Log ``event`` at info level once the event loop ran what is ready now (the waiters a
    completion just woke): a log call costs tens of microseconds (more when rendered), which
    would otherwise sit between a request's KV landing and its decode holding the pages (the
    benchmark's ``notify_us``, 58-86 us at 6k tokens on 2x H200, fab377215964)."""
    asyncio.get_running_loop().call_soon(_log_info, event, fields)


def _log_info(event: str, fields: dict[str, object]) -> None:
    log.info(event, **fields)  # the logger is looked up here: structlog's lazy proxy binds on attribute access


def _wake(res: _Reservation) -> None:
    """Wake the reservation's ``wait_complete`` callers (``done`` has its outcome)."""
    for waiter in res.waiters:
        if not waiter.done():
            waiter.set_result(None)
