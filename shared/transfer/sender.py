"""Prefill side: send one TP rank's KV shard of one request into a decode rank's pages.

The rank's KV heads ``[start, end)`` of a group of consecutive layers are packed into
one staging chunk (``shard.pack_layers``) and sent as one tagged UCX message after a
small header, so a request moves in a few large transfers. Groups are formed as the
layers are computed (``on_layer_done``): whenever a staging slot is free, the next
chunk takes every consecutive layer ready by then, up to the chunk limit. KV that is
all there goes in a few full-size chunks (UCX costs a fixed time per message); KV that
trickles in from a forward goes out as it comes, in small chunks while the wire keeps
up, so the transfer overlaps the prefill of later layers and little is left to send
after the last one. Several chunks can be on the wire at once, bounded by the staging
slots.

Each finished transfer's ``TransferRecord.phases_s`` says where its time went
(seconds, summed over chunks): ``setup`` (constructor), ``first_ready`` (until layer 0
was reported: prefill compute, not transfer cost), ``start`` (layer 0 reported -> the
first chunk posted: staging, pack, endpoint), ``staging_wait``, ``pack`` (enqueued ->
packed, on CUDA behind the group's compute), ``endpoint`` (connecting, 0 once cached),
``wire`` (header + chunk posted -> UCX completed), ``tail`` (last layer reported ->
finished: what the transfer adds after the forward's last layer).

Same-host fast path (``cuda_ipc``): when the descriptor carries the decode rank's KV
storage exported through CUDA IPC and this process can open it, no chunk is packed:
each report (``on_layer_done`` / ``mark_all_layers_done``) enqueues, in the reporting
thread and at once, the kernel that writes its layers straight from the local pages into
the decode rank's reserved pages on a side stream behind the report's CUDA event
(``direct_write.WriteIssuer``): the copy starts on the GPU the moment the layer's compute
is done, with no host wake-up or launch in between. The kernel checks a deadline itself
(the reservation's lease + ``cuda_ipc.WRITE_GUARD_AFTER_LEASE_S``, on the GPU's clock): a
write enqueued in time whose compute ends later writes nothing and the sender fails with
``TransferTimeout``. Once every layer is reported (its write enqueued, the landing event
recorded behind it), one ``"landed"`` header for all layers goes out at once, carrying an
interprocess CUDA event recorded after the last write: its trip to the decode rank
overlaps the compute and the writes still running on the GPU, and the decode rank counts
the cells landed when the event completes (its watcher thread polls it,
``streams.watch_event``); when the compute is already done, the header also says when the
writes can have ended at the earliest, so the decode rank polls closely only from then.
Otherwise (another host, CPU, ``MOEBUS_KV_CUDA_IPC=0`` on the decode side, the open
failing: logged as ``kv.cuda_ipc_unavailable`` with the reason) the UCX path above is
taken. ``TransferRecord.path`` and the log events say which; on the direct path the
phases are ``issue`` (host time enqueueing, in the reporting threads), ``write`` (first
write enqueued -> all seen complete, compute included) and ``wire`` (the header's send). On a failure the direct
sender enqueues nothing more, waits (in a thread) for the writes it enqueued to run or be
skipped, then tells the decode rank ``"stopped"`` (the safety rules are in
``shared.transfer.cuda_ipc``).

Every outcome is explicit: ``finish()`` returns a ``TransferRecord`` or raises
``TransferTimeout`` (deadline: the sender's timeout or the reservation's lease,
whichever is first), ``PeerFailed`` (UCX endpoint error: decode rank died),
``Cancelled`` (``cancel()``). Staging is released on every path; after a failure with
sends in flight the endpoint to that decode rank is aborted (which cancels the UCX
requests still reading the staging memory) and dropped from the cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog
import torch

from schemas.transfer import KVTransferDescriptor, KVTransferLayout, ShardHeader
from shared.kvcache import KVLayout, PagedKVCache
from shared.transfer import cuda_ipc
from shared.transfer.errors import Cancelled, LayoutMismatch, PeerFailed, TransferError, TransferTimeout
from shared.transfer.metrics import PhaseTimes, TransferMetrics, TransferRecord
from kernels.kv_copy import page_ids
from shared.transfer.direct_write import DirectWriter, WriteIssuer
from shared.transfer.shard import KVHeadShard, chunk_nbytes, chunk_view, pack_layers
from shared.transfer.staging import StagingPool
from shared.transfer.streams import event_done, side_stream, watch_event
from shared.transfer.worker import TransferWorker, UCXError, data_tag, encode_header, header_tag, ucx_buffer

log = structlog.get_logger(__name__)

DEFAULT_CHUNK_BYTES = 256 << 20  # a few large UCX messages per request (each costs a fixed ~0.3-0.5 ms)
_STOPPED_NOTICE_S = 1.0  # how long a failed direct sender tries to tell the decode rank it stopped
# The direct path's "landed" header tells the decode rank the earliest time its writes can have
# ended when the prefill's compute is done already (``_writes_done_hint``): the writes cannot
# outrun this rate, above the direct-write kernel's measured ~365 GB/s over NVLink (2x H200,
# bench/results/kv_transfer.jsonl), so the hint errs early (the decode rank then polls a
# little longer) rather than late.
_PEAK_WRITE_BYTES_PER_S = 400e9
_SENDER_POLL_S = 2e-4  # the sender's own wait for its writes: nothing waits on it but the caller's finish()


class KVSender:
    """Sends ``heads`` of every layer of one request, layer group by layer group.

    Construct inside the running event loop; call ``on_layer_done(layer)`` after each
    layer's KV is in ``kvcache`` (from any thread), or ``mark_all_layers_done()`` when the
    KV is already computed, then ``await finish()``. On CUDA each report records an event
    on the caller's current stream and a chunk's pack (on a high-priority side stream)
    waits for its layers' events on the GPU.
    ``page_table`` lists the request's pages in the local cache, which holds exactly
    the local heads (``kvcache.layout.kv_heads == heads.num_heads``). The caller keeps
    those pages untouched until ``finish()`` returns or raises. On the UCX path a chunk
    holds at most as many whole layers as fit ``chunk_bytes``, the decode side's
    ``max_chunk_bytes`` and a staging slot; chunks are packed into ``staging`` (default:
    the worker's long-lived send pool for the cache's device, whose arena stays
    registered with UCX); ``held_buffers`` counts the slots this sender holds (0 once
    ``finish()`` is over). The direct path uses no staging (``staging`` is None).
    """

    def __init__(
        self,
        worker: TransferWorker,
        kvcache: PagedKVCache,
        descriptor: KVTransferDescriptor,
        page_table: Sequence[int] | torch.Tensor,
        heads: KVHeadShard,
        *,
        timeout_s: float,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        staging: StagingPool | None = None,
        metrics: TransferMetrics | None = None,
    ) -> None:
        created = time.perf_counter()
        self._created_unix = time.time()
        self._worker = worker
        self._cache = kvcache
        self._desc = descriptor
        self._heads = heads
        self._metrics = metrics
        _check_layouts(kvcache, descriptor, heads, len(page_table))
        layout, device = kvcache.layout, kvcache.device
        self._peer_storage = None if descriptor.cuda_ipc is None else _open_peer_storage(descriptor, device)
        self.path = "ucx" if self._peer_storage is None else "cuda_ipc"
        self.staging: StagingPool | None = None
        if self._peer_storage is None:
            if descriptor.cuda_ipc is not None:
                _check_decode_page_ids(descriptor)  # an inconsistent descriptor is refused whichever path is taken
            layer_bytes = chunk_nbytes(1, heads.num_heads, descriptor.num_tokens, layout.head_dim, layout.dtype)
            self.staging = staging or worker.staging_pool(device, layer_bytes)
            limit = min(chunk_bytes, self.staging.slot_bytes, descriptor.max_chunk_bytes)  # chunks land in the decode rank's staging slots
            self._max_layers = _layers_per_chunk(layer_bytes, limit, descriptor.request_id)
            self._side_stream = side_stream(device)  # packs
            with torch.cuda.stream(self._side_stream) if self._side_stream is not None else contextlib.nullcontext():
                # Uploaded on the pack stream, which is where it is read: no wait behind the compute stream.
                self._page_table = torch.as_tensor(page_table, dtype=torch.long).to(device, non_blocking=True)
        self._loop = asyncio.get_running_loop()
        lease_left = descriptor.lease_deadline_unix - time.time()
        self._deadline = self._loop.time() + min(timeout_s, lease_left)  # the loop's clock is time.monotonic
        self._issuer: WriteIssuer | None = None
        if self._peer_storage is not None:
            self._side_stream = side_stream(device, "peer_write")  # the writes (CUDA only)
            writer = _direct_writer(kvcache, descriptor, page_table, heads, self._peer_storage, self._side_stream,
                                    descriptor.lease_deadline_unix + cuda_ipc.WRITE_GUARD_AFTER_LEASE_S)
            self._issuer = WriteIssuer(writer, self._side_stream, self._deadline)
        self._loop_thread = threading.get_ident()
        self._num_layers = layout.num_layers
        self._layer_events: list[torch.cuda.Event | None] = [None] * layout.num_layers  # written by the forward's thread (CUDA)
        self._ready_at: list[float | None] = [None] * layout.num_layers  # written on the event loop
        self._sent_groups: list[range] = []
        self._progress = asyncio.Event()
        self._sends: list[asyncio.Task[None]] = []
        self._held = 0
        self._in_flight = 0
        self._nbytes = 0
        self._first_send_at: float | None = None
        self._phases = PhaseTimes()
        self._task = self._loop.create_task(self._run())
        self._created = time.perf_counter()  # setup, first_ready and start follow each other
        self._phases.add("setup", self._created - created)

    @property
    def request_id(self) -> str:
        return self._desc.request_id

    @property
    def metrics(self) -> TransferMetrics:
        """The metrics this transfer's outcome is recorded into: those given, else its own
        (made on first use: nothing on the way to the first write needs them)."""
        if self._metrics is None:
            self._metrics = TransferMetrics()
        return self._metrics

    @property
    def layer_groups(self) -> list[range]:
        """The layer ranges packed into one chunk each so far (formed as layers become ready), or
        written by one launch each on the direct path (one per report)."""
        return list(self._sent_groups if self._issuer is None else self._issuer.groups)

    @property
    def held_buffers(self) -> int:
        """Staging slots this sender holds now (packing or on the wire)."""
        return self._held

    def on_layer_done(self, layer: int, event: torch.cuda.Event | None = None) -> None:
        """Layer ``layer``'s KV is written (or queued, on CUDA); thread-safe, never blocks.
        ``event``: a CUDA event already recorded after the layer's KV writes (default: one
        recorded now on the caller's current stream), for reports made after the fact."""
        if not 0 <= layer < self._num_layers:
            raise ValueError(f"layer {layer} outside 0..{self._num_layers - 1}")
        if self._issuer is not None:
            self._issuer.issue((layer,), event)  # None: the issuer marks the current stream itself
        else:
            self._layer_events[layer] = self._stream_position() if event is None else event  # before the loop learns of the layer
        self._schedule(self._mark_ready, layer)

    def mark_all_layers_done(self, event: torch.cuda.Event | None = None) -> None:
        """Every layer's KV is written (or queued on the caller's current CUDA stream; ``event``
        as in ``on_layer_done``)."""
        if self._issuer is not None:
            self._issuer.issue(range(self._num_layers), event)
        else:
            self._layer_events[:] = [self._stream_position() if event is None else event] * self._num_layers
        self._schedule(self._mark_ready, *range(self._num_layers))

    async def finish(self) -> TransferRecord:
        """Wait until every chunk is sent; typed errors as in the module docstring."""
        return await asyncio.shield(self._task)

    async def send_all(self) -> TransferRecord:
        """Send a request whose KV is already complete."""
        self.mark_all_layers_done()
        return await self.finish()

    def cancel(self) -> None:
        """Stop sending; ``finish()`` raises ``Cancelled``."""
        self._task.cancel()

    # -- internals -------------------------------------------------------------------

    def _schedule(self, callback: Callable[..., None], *args: int) -> None:
        """Run ``callback`` on the event loop: at once when called from the loop's own thread
        (no wake-up, no extra loop iteration before the first group forms)."""
        if threading.get_ident() == self._loop_thread:
            callback(*args)
        else:
            self._loop.call_soon_threadsafe(callback, *args)

    def _stream_position(self) -> torch.cuda.Event | None:
        """On CUDA, an event at the caller's current stream position (packs wait for it)."""
        if self._side_stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._cache.device))
        return event

    def _mark_ready(self, *layers: int) -> None:
        now = time.perf_counter()
        for layer in layers:
            self._ready_at[layer] = now
        self._progress.set()

    async def _run(self) -> TransferRecord:
        rid = self.request_id
        try:
            async with asyncio.timeout_at(self._deadline):
                if self._issuer is not None:
                    await self._write_directly(self._issuer)
                else:
                    await self._send_chunks()
                await asyncio.gather(*self._sends)
        except BaseException as e:
            await self._abort_sends()
            error = _as_transfer_error(rid, e)
            if self._issuer is not None:
                await self._stop_direct_writes(self._issuer, error)
            self.metrics.record_failure(error.cause)
            log.warning("kv.send_failed", request_id=rid, cause=error.cause, error=str(error), heads=(self._heads.start, self._heads.end), path=self.path)
            raise error from e
        done = time.perf_counter()
        assert self._first_send_at is not None
        self._phases.add("tail", done - max(t for t in self._ready_at if t is not None))
        record = TransferRecord(rid, self._nbytes, done - self._first_send_at, len(self._sent_groups), self._created_unix, self._phases.seconds, self.path)
        self.metrics.record_ok(record)
        log.info("kv.sent", request_id=rid, bytes=record.nbytes, wall_s=record.wall_s, gbps=record.gbps, chunks=record.chunks, heads=(self._heads.start, self._heads.end), phases_s=record.phases_s, path=self.path)
        return record

    async def _reported(self, layer: int) -> None:
        """Until ``on_layer_done(layer)`` (or ``mark_all_layers_done``) reached the loop."""
        while self._ready_at[layer] is None:
            self._progress.clear()
            await self._progress.wait()

    async def _send_chunks(self) -> None:
        """UCX path: pack groups of ready layers into staging slots and send each as a chunk."""
        next_layer, num_layers = 0, self._num_layers
        while next_layer < num_layers:
            await self._reported(next_layer)
            buf = await self._acquire(self._nbytes_of(range(next_layer, min(next_layer + self._max_layers, num_layers))))
            end = next_layer + 1  # every consecutive layer ready by now, up to the chunk limit
            while end < num_layers and end - next_layer < self._max_layers and self._ready_at[end] is not None:
                end += 1
            group = range(next_layer, end)
            self._sent_groups.append(group)
            buf = buf[: self._nbytes_of(group)]
            packed = await self._pack(group, buf)
            self._sends.append(self._loop.create_task(self._send_chunk(group, buf, packed)))
            next_layer = end

    async def _write_directly(self, issuer: WriteIssuer) -> None:
        """Direct path: the reports enqueue the writes (``WriteIssuer``); once all layers are
        reported, announce every cell with one ``"landed"`` header at once (its trip overlaps
        whatever compute and writes are still running on the GPU), then wait for the writes
        and check that none found the deadline passed."""
        for layer in range(self._num_layers):
            await self._reported(layer)
            if issuer.error is not None:
                raise issuer.error
        if not issuer.complete:  # a report came after the deadline: nothing enqueued for it
            raise TimeoutError
        self._phases.add("issue", issuer.issue_s)
        assert issuer.landing is not None and issuer.first_issued_at is not None
        self._first_send_at = issuer.first_issued_at
        self._phases.add("first_ready", issuer.first_issued_at - self._created)
        nbytes = self._nbytes_of(range(self._num_layers))
        landing, handle = issuer.landing
        # The other TP ranks write their heads of the same layers at the same time into the same
        # decode GPU: the estimate counts every head's bytes on the link.
        link_share = self._desc.layout.kv_heads / self._heads.num_heads
        header = self._header(range(self._num_layers), nbytes, "landed", event=handle, writes_done_unix=_writes_done_hint(issuer, nbytes, link_share))
        await self._post((header_tag(self._desc.transfer_id), encode_header(header)))
        await watch_event(landing, poll_s=_SENDER_POLL_S)  # a thread polls: the loop stays free
        self._phases.add("write", time.perf_counter() - issuer.first_issued_at)
        if issuer.writer.skipped:
            raise TransferTimeout(self.request_id, "direct writes reached the GPU after the lease deadline and wrote nothing")
        issuer.close(ran=True)  # the landing event completed: its slot and event go back, free at once
        self._sent_groups = list(issuer.groups)
        self._nbytes = nbytes

    async def _acquire(self, nbytes: int) -> torch.Tensor:
        assert self.staging is not None
        started = time.perf_counter()
        buf = await self.staging.acquire(nbytes)
        self._held += 1
        self._phases.add("staging_wait", time.perf_counter() - started)
        return buf

    def _release(self, buf: torch.Tensor) -> None:
        assert self.staging is not None
        self._held -= 1
        self.staging.release(buf)

    def _nbytes_of(self, group: range) -> int:
        layout = self._cache.layout
        return chunk_nbytes(len(group), self._heads.num_heads, self._desc.num_tokens, layout.head_dim, layout.dtype)

    async def _pack(self, group: range, buf: torch.Tensor) -> _Packed | None:
        """Pack ``group`` into ``buf``; on CUDA enqueue it on the pack stream behind the group's event."""
        layout = self._cache.layout
        out = chunk_view(buf, len(group), self._heads.num_heads, self._desc.num_tokens, layout.head_dim, layout.dtype)
        if self._side_stream is None:
            started = time.perf_counter()
            # Memory-bound copy that releases the GIL: keep the event loop (and UCX completions) running.
            pack = asyncio.ensure_future(asyncio.to_thread(pack_layers, self._cache, group, self._page_table, self._desc.num_tokens, out))
            try:
                await asyncio.shield(pack)
            except BaseException:
                await asyncio.wait([pack])  # the thread still writes into the slot: let it finish first
                self._release(buf)
                raise
            self._phases.add("pack", time.perf_counter() - started)
            return None
        computed = {id(e): e for e in (self._layer_events[layer] for layer in group) if e is not None}.values()
        with torch.cuda.stream(self._side_stream):
            for event in computed:
                self._side_stream.wait_event(event)
            pack_layers(self._cache, group, self._page_table, self._desc.num_tokens, out)
            done = torch.cuda.Event()
            done.record(self._side_stream)
        return _Packed(done, behind_compute=not all(event.query() for event in computed))

    async def _stop_direct_writes(self, issuer: WriteIssuer, error: TransferError) -> None:
        """After a failure: enqueue no more writes, wait for those enqueued to run (or be skipped
        by their deadline guard; a thread waits, as they may still wait for the prefill's
        compute), then tell the decode rank these heads get no more writes, so it can reuse the
        pages before the lease grace. Not to a dead peer."""
        last_write = issuer.close()
        if last_write is not None:
            await asyncio.to_thread(last_write.synchronize)
        desc = self._desc
        if issuer.writer.skipped:
            log.warning("kv.direct_writes_skipped", request_id=desc.request_id, reason="the kernel started past the lease deadline + guard")
        if isinstance(error, PeerFailed):
            assert desc.cuda_ipc is not None
            cuda_ipc.forget(desc.cuda_ipc)  # the peer is gone: never touch its mapping again
            return
        header = ShardHeader(desc.request_id, desc.transfer_id, self._heads.start, self._heads.end, 0, desc.layout.num_layers, desc.num_tokens, 0, desc.layout.dtype, kind="stopped")
        try:
            async with asyncio.timeout(_STOPPED_NOTICE_S):
                await self._worker.send(desc.worker_address, header_tag(desc.transfer_id), encode_header(header))
        except (TimeoutError, UCXError) as e:
            log.warning("kv.stopped_notice_failed", request_id=desc.request_id, error=f"{type(e).__name__}: {e}")

    def _header(self, group: range, nbytes: int, kind: str, event: bytes | None = None, writes_done_unix: float = 0.0) -> ShardHeader:
        desc = self._desc
        return ShardHeader(desc.request_id, desc.transfer_id, self._heads.start, self._heads.end, group.start, group.stop, desc.num_tokens, nbytes, desc.layout.dtype,
                           kind=kind, event=event, writes_done_unix=writes_done_unix, sender_pid=os.getpid() if event is not None else 0)

    async def _post(self, *messages: tuple[int, object]) -> None:
        """Send the header (and its chunk) to the decode rank; phase bookkeeping around it."""
        address = self._desc.worker_address
        posted = time.perf_counter()
        if self._first_send_at is None:
            self._first_send_at = posted
            ready_at = self._ready_at[0]
            assert ready_at is not None
            self._phases.add("first_ready", ready_at - self._created)
            self._phases.add("start", posted - ready_at)
        await self._worker.endpoint(address)  # cached after the first transfer to this peer
        self._phases.add("endpoint", time.perf_counter() - posted)
        self._in_flight += 1
        if len(messages) == 1:
            await self._worker.send(address, *messages[0])
        else:
            await self._worker.send_pair(address, *messages)
        self._in_flight -= 1
        self._phases.add("wire", time.perf_counter() - posted)

    async def _send_chunk(self, group: range, buf: torch.Tensor, packed: _Packed | None) -> None:
        """UCX path: once packed, send the header and the chunk."""
        tid = self._desc.transfer_id
        try:
            if packed is not None:
                started = time.perf_counter()
                await event_done(packed.done, short=not packed.behind_compute)
                self._phases.add("pack", time.perf_counter() - started)
            header = encode_header(self._header(group, buf.numel(), "chunk"))
            await self._post((header_tag(tid), header), (data_tag(tid, self._heads.start, group.start), ucx_buffer(buf)))
            self._nbytes += buf.numel()
        finally:
            if packed is not None:
                packed.done.synchronize()  # a cancelled chunk's pack may still be writing into the slot
            self._release(buf)

    async def _abort_sends(self) -> None:
        """Cancel UCX requests still reading staging (by aborting the endpoint), then reap the tasks."""
        if self._in_flight:
            self._worker.evict(self._desc.worker_address)
        for task in self._sends:
            task.cancel()
        await asyncio.gather(*self._sends, return_exceptions=True)


@dataclass(frozen=True)
class _Packed:
    """A chunk's pack on the CUDA side stream: its end event, and whether the pack still
    waits behind the prefill's compute (then a thread waits for it, not the event loop)."""

    done: torch.cuda.Event
    behind_compute: bool


def _writes_done_hint(issuer: WriteIssuer, nbytes: int, link_share: float) -> float:
    """When (host wall clock) a transfer's ``nbytes`` of direct writes can have landed at the
    earliest, the link shared with the other ranks writing ``link_share`` times as many bytes
    in all, or 0.0 (unknown) while the compute they wait for still runs. Reports come from
    one stream in layer order, so the last report's compute done means all of it is."""
    last = issuer.compute_events[-1] if issuer.compute_events else None
    if last is not None and not last.query():
        return 0.0
    assert issuer.first_issued_at is not None
    return time.time() - (time.perf_counter() - issuer.first_issued_at) + nbytes * link_share / _PEAK_WRITE_BYTES_PER_S


def _check_decode_page_ids(desc: KVTransferDescriptor) -> None:
    """Refuse a descriptor whose page ids do not fit the storage it exports (``LayoutMismatch``)."""
    assert desc.cuda_ipc is not None
    try:
        page_ids("decode", desc.page_ids, -(-desc.num_tokens // desc.layout.page_size), desc.cuda_ipc.num_pages)
    except ValueError as e:
        raise LayoutMismatch(f"KV transfer {desc.request_id!r}: decode page ids: {e}") from None


def _open_peer_storage(desc: KVTransferDescriptor, device: torch.device) -> torch.Tensor | None:
    """The decode rank's storage mapped through CUDA IPC, or None (UCX path; logged why)."""
    assert desc.cuda_ipc is not None
    try:
        return cuda_ipc.open_export(desc.cuda_ipc, desc.layout, device)
    except cuda_ipc.CudaIpcUnavailable as e:
        same_host = desc.cuda_ipc.host_id == cuda_ipc.host_identity()  # then it is unexpected: louder
        (log.warning if same_host else log.info)("kv.cuda_ipc_unavailable", request_id=desc.request_id, reason=str(e))
        return None


def _direct_writer(cache: PagedKVCache, desc: KVTransferDescriptor, page_table: Sequence[int] | torch.Tensor, heads: KVHeadShard,
                   peer: torch.Tensor, stream: torch.cuda.Stream | None, deadline_unix: float) -> DirectWriter:
    """The writer of this transfer's direct writes into the decode pages of ``desc`` (its page
    tables uploaded on ``stream``, where the writes run; none starts after ``deadline_unix``); it
    checks both page tables against their storage (a bad one: ``LayoutMismatch``; the copy
    names the local table "source" and the decode's "destination")."""
    table = page_table.cpu().numpy() if isinstance(page_table, torch.Tensor) else page_table
    try:
        return DirectWriter(cache.storage, table, peer, desc.page_ids, head_start=heads.start, num_tokens=desc.num_tokens, stream=stream, deadline_unix=deadline_unix)
    except ValueError as e:
        raise LayoutMismatch(f"KV transfer {desc.request_id!r}: {e}") from None


_LAYOUTS_KEPT = 64
# (local layout's id, heads' id, decode layout) -> (local layout, heads) found to fit: the entry holds
# both objects, so their ids name them while it lives (hashing them by value cost more, cold).
_layouts_fit: dict[tuple[int, int, KVTransferLayout], tuple[KVLayout, KVHeadShard]] = {}


def _check_layouts(cache: PagedKVCache, desc: KVTransferDescriptor, heads: KVHeadShard, table_len: int) -> None:
    """Refuse (``LayoutMismatch``) a shard or local layout that does not map onto the decode's, or
    a page table too short for the request. The layouts' verdict is kept per (local layout,
    decode layout, heads): a transfer's set-up runs cold (module doc of ``direct_write``); the
    page table is checked every time."""
    mine, theirs = cache.layout, desc.layout
    key = (id(mine), id(heads), theirs)
    if key in _layouts_fit and table_len >= mine.pages_for(desc.num_tokens):
        return
    dtype = str(mine.dtype).removeprefix("torch.")
    problems = []
    if not heads.sends:
        problems.append(f"heads [{heads.start}, {heads.end}) are a replica this rank must not send")
    if (mine.num_layers, mine.head_dim, dtype) != (theirs.num_layers, theirs.head_dim, theirs.dtype):
        problems.append(f"local (layers, head_dim, dtype) {(mine.num_layers, mine.head_dim, dtype)} != decode {(theirs.num_layers, theirs.head_dim, theirs.dtype)}")
    if not 0 <= heads.start < heads.end <= theirs.kv_heads:
        problems.append(f"heads [{heads.start}, {heads.end}) outside the decode rank's {theirs.kv_heads} KV heads")
    if mine.kv_heads != heads.num_heads:
        problems.append(f"local cache holds {mine.kv_heads} KV heads, shard [{heads.start}, {heads.end}) has {heads.num_heads}")
    if table_len < mine.pages_for(desc.num_tokens):
        problems.append(f"page table of {table_len} pages cannot hold {desc.num_tokens} tokens at page size {mine.page_size}")
    if problems:
        raise LayoutMismatch(f"KV transfer {desc.request_id!r}: " + "; ".join(problems))
    if len(_layouts_fit) >= _LAYOUTS_KEPT:
        _layouts_fit.clear()
    _layouts_fit[key] = (mine, heads)


def _layers_per_chunk(layer_bytes: int, chunk_bytes: int, request_id: str) -> int:
    """Most consecutive layers one chunk may hold within ``chunk_bytes`` (at least one)."""
    if layer_bytes > chunk_bytes:
        raise LayoutMismatch(f"KV transfer {request_id!r}: one layer's shard is {layer_bytes} bytes, above the {chunk_bytes}-byte chunk limit")
    return chunk_bytes // layer_bytes


def _as_transfer_error(request_id: str, e: BaseException) -> TransferError:
    if isinstance(e, TransferError):
        return e
    if isinstance(e, asyncio.CancelledError):
        return Cancelled(request_id, "send cancelled")
    if isinstance(e, TimeoutError):
        return TransferTimeout(request_id, "send deadline (timeout or reservation lease) passed")
    if isinstance(e, UCXError):
        return PeerFailed(request_id, f"UCX error talking to the decode rank: {type(e).__name__}: {e}")
    return TransferError(request_id, f"internal error: {type(e).__name__}: {e}")
