"""One UCX worker per rank: its address, an endpoint cache, tagged send/recv.

Wire protocol (all on the decode worker's tag space, scoped by the reservation's
``transfer_id``): a sender first sends a fixed-size frame holding a msgpack
``ShardHeader`` on ``header_tag(transfer_id)``, then the packed chunk it announces
on ``data_tag(transfer_id, head_start, layer_start)``. The receiver posts
worker-level receives (it needs no endpoint back to the sender). Tagged messages
go eager for the small header and rendezvous for chunks, which UCX moves
zero-copy where a transport allows it (cuda_ipc between GPUs of one host).

Progress runs in ucxx's progress thread. Completions reach the asyncio loop that
created the worker through ucxx's notifier thread (Python futures): an awaiting
coroutine sleeps until its request completes. (ucxx's other mode polls every pending
request with ``asyncio.sleep(0)``: the loop then never idles and holds the GIL, so
every other thread of the process - the prefill forward, CUDA-event waits - waits up
to the 5 ms GIL switch interval each time it needs the interpreter.) Call every
coroutine here from that loop.

The worker also owns the rank's send staging pool per device (``staging_pool``):
senders pack into the same long-lived arena every time, so the peer maps its CUDA-IPC
handle once, not once per request.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import struct

import msgspec
import numpy as np
import structlog
import torch
from ucxx._lib.libucxx import UCXAddress
from ucxx._lib_async import ApplicationContext, Endpoint
from ucxx.exceptions import UCXError

from schemas.transfer import ShardHeader
from shared.transfer.staging import StagingPool

log = structlog.get_logger(__name__)

HEADER_FRAME_BYTES = 512
# Large chunks: UCX pays a fixed ~0.3-0.5 ms per rendezvous message (measured, CUDA IPC).
DEFAULT_SEND_SLOT_BYTES = 256 << 20
DEFAULT_SEND_SLOTS = 4
_LEN = struct.Struct("<I")
_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(ShardHeader)

# Tag layout: [transfer_id:32][is_data:1][head_start:15][layer_start:16].
MAX_TRANSFER_ID = (1 << 32) - 1


def header_tag(transfer_id: int) -> int:
    return transfer_id << 32


def data_tag(transfer_id: int, head_start: int, layer_start: int) -> int:
    if not (0 <= head_start < 1 << 15 and 0 <= layer_start < 1 << 16):
        raise ValueError(f"head_start {head_start} / layer_start {layer_start} do not fit the tag layout")
    return (transfer_id << 32) | (1 << 31) | (head_start << 16) | layer_start


def encode_header(header: ShardHeader) -> np.ndarray:
    """A fixed-size frame: 4-byte length, then the msgpack header, zero padded."""
    body = _header_encoder.encode(header)
    if len(body) + _LEN.size > HEADER_FRAME_BYTES:
        raise ValueError(f"shard header of {len(body)} bytes does not fit a {HEADER_FRAME_BYTES}-byte frame (request id too long?)")
    frame = np.zeros(HEADER_FRAME_BYTES, dtype=np.uint8)
    frame[: _LEN.size] = np.frombuffer(_LEN.pack(len(body)), dtype=np.uint8)
    frame[_LEN.size : _LEN.size + len(body)] = np.frombuffer(body, dtype=np.uint8)
    return frame


def decode_header(frame: np.ndarray) -> ShardHeader:
    """Inverse of ``encode_header``; raises ``msgspec.ValidationError``/``DecodeError`` on bad bytes."""
    (n,) = _LEN.unpack(frame[: _LEN.size].tobytes())
    if n > HEADER_FRAME_BYTES - _LEN.size:
        raise msgspec.DecodeError(f"shard header frame claims {n} bytes")
    return _header_decoder.decode(frame[_LEN.size : _LEN.size + n].tobytes())


def ucx_buffer(t: torch.Tensor) -> object:
    """What ucxx accepts for a contiguous uint8 tensor: numpy on CPU, the tensor (CUDA array interface) on GPU."""
    return t.numpy() if t.device.type == "cpu" else t


class TransferWorker:
    """A rank's UCX worker. Create it inside the running event loop (``await TransferWorker.create()``)."""

    def __init__(self, ctx: ApplicationContext, send_slot_bytes: int = DEFAULT_SEND_SLOT_BYTES, send_slots: int = DEFAULT_SEND_SLOTS) -> None:
        self._ctx = ctx
        self._address = bytes(ctx.worker_address.tobytes())  # asking UCX each time costs ~1 ms
        self._endpoints: dict[bytes, Endpoint] = {}
        self._connecting: dict[bytes, asyncio.Lock] = {}
        self._transfer_ids = itertools.count(1)
        self._send_slot_bytes = send_slot_bytes
        self._send_slots = send_slots
        self._pools: dict[torch.device, StagingPool] = {}

    @classmethod
    async def create(cls, progress_mode: str | None = None, *, python_future: bool = True, send_slot_bytes: int = DEFAULT_SEND_SLOT_BYTES, send_slots: int = DEFAULT_SEND_SLOTS) -> TransferWorker:
        """Start the worker and its progress thread (transports from the UCX_* environment).

        ``progress_mode``: ucxx's ``"thread"`` (the progress thread sleeps in epoll and wakes
        on transport events or after 1 ms) or ``"thread-polling"`` (it spins on one core:
        lowest latency, e.g. for CUDA-IPC copies whose completion raises no event). None
        reads ``UCXPY_PROGRESS_MODE``, else takes "thread-polling" where CUDA is available
        (measured faster on 2x H200, bench/results/kv_transfer.jsonl) and "thread" elsewhere. ``python_future=False`` selects ucxx's polling
        wait (see the module docstring; kept for comparison in the benchmark).
        ``send_slot_bytes`` x ``send_slots``: the send staging pool per device (a slot is
        the largest chunk a sender packs; it grows to one layer of a request if needed).
        """
        if progress_mode is None and "UCXPY_PROGRESS_MODE" not in os.environ and torch.cuda.is_available():
            progress_mode = "thread-polling"  # CUDA-IPC completions raise no event: "thread" sees them up to 1 ms late
        ctx = ApplicationContext(progress_mode=progress_mode, enable_python_future=python_future)
        return cls(ctx, send_slot_bytes, send_slots)

    @property
    def address(self) -> bytes:
        """This worker's UCX address, for peers to connect to (goes into the descriptor)."""
        return self._address

    def staging_pool(self, device: torch.device, min_slot_bytes: int) -> StagingPool:
        """The rank's long-lived send staging pool on ``device``, with slots of at least
        ``min_slot_bytes`` (a larger pool replaces a smaller one; senders holding the old
        one keep it until they finish)."""
        pool = self._pools.get(device)
        if pool is None or pool.slot_bytes < min_slot_bytes:
            pool = StagingPool(max(self._send_slot_bytes, min_slot_bytes), self._send_slots, device)
            self._pools[device] = pool
            log.info("kv.send_staging", device=str(device), slot_bytes=pool.slot_bytes, slots=pool.num_slots)
        return pool

    @property
    def staging_pools(self) -> list[StagingPool]:
        """The current send staging pool of each device (for heartbeats and leak checks)."""
        return list(self._pools.values())

    def new_transfer_id(self) -> int:
        """A transfer id unique on this worker (it scopes the tags of one reservation)."""
        return (next(self._transfer_ids) - 1) % MAX_TRANSFER_ID + 1

    async def endpoint(self, address: bytes) -> Endpoint:
        """The cached endpoint to a peer worker, created on first use."""
        ep = self._endpoints.get(address)
        if ep is not None and not ep.closed:
            return ep
        lock = self._connecting.setdefault(address, asyncio.Lock())
        async with lock:
            ep = self._endpoints.get(address)
            if ep is None or ep.closed:
                ep = await self._ctx.create_endpoint_from_worker_address(UCXAddress.create_from_buffer(address))
                self._endpoints[address] = ep
        return ep

    def evict(self, address: bytes) -> None:
        """Drop and abort the endpoint to a peer (after an error): cancels its in-flight requests."""
        ep = self._endpoints.pop(address, None)
        if ep is not None:
            ep.abort(period=10**8)  # 100 ms: a dead peer must not stall the caller for the 10 s default

    async def send(self, address: bytes, tag: int, buf: object) -> None:
        """Tagged send to a peer worker; raises ``UCXError`` on endpoint failure."""
        ep = await self.endpoint(address)
        await ep.send(buf, tag=tag, force_tag=True)

    async def send_pair(self, address: bytes, first: tuple[int, object], second: tuple[int, object]) -> None:
        """Post two tagged sends back to back (e.g. a header and its chunk: one round of
        completions instead of two) and wait for both; raises ``UCXError`` on failure."""
        ep = await self.endpoint(address)
        sends = [asyncio.ensure_future(ep.send(buf, tag=tag, force_tag=True)) for tag, buf in (first, second)]
        try:
            await asyncio.gather(*sends)
        finally:
            for send in sends:
                send.cancel()  # no-op once done; a failed pair leaves no orphan task
            await asyncio.wait(sends)

    async def recv(self, tag: int, buf: object) -> None:
        """Worker-level tagged receive (from any peer) into ``buf``."""
        await self._ctx.recv(buf, tag)

    def close(self) -> None:
        """Abort all endpoints and stop ucxx's notifier thread; the progress thread ends with
        the worker object (ucxx finalizer) or the process."""
        for address in list(self._endpoints):
            self.evict(address)
        self._ctx.stop_notifier_thread()


__all__ = ["TransferWorker", "UCXError", "header_tag", "data_tag", "encode_header", "decode_header", "ucx_buffer", "HEADER_FRAME_BYTES"]
