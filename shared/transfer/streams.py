"""CUDA side streams and host-side waits for the transfer's pack and scatter work.

Pack (prefill) and scatter (decode) run on their own high-priority stream: their few
short, memory-bound kernels are scheduled ahead of queued prefill GEMMs / decode steps
instead of waiting behind them, and they never delay the compute stream's own order.
On CPU there is no stream (``None``) and the work runs inline or in a thread.
"""

from __future__ import annotations

import asyncio
import time

import torch

# Lower numbers are higher priorities in CUDA; -1 is the highest torch exposes on Hopper.
HIGH_PRIORITY = -1


_streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}


def side_stream(device: torch.device, purpose: str = "copy") -> torch.cuda.Stream | None:
    """The process's high-priority transfer stream on ``device`` (one per device and purpose,
    shared by every sender and receiver: the caching allocator keeps its blocks per stream,
    so a new stream per transfer would open new memory segments), or None on CPU.
    ``purpose`` "peer_write": the CUDA IPC path's direct writes into the decode rank (its
    landing events are all recorded on it, see ``cuda_ipc.landing_event``)."""
    if device.type != "cuda":
        return None
    stream = _streams.get((device, purpose))
    if stream is None:
        stream = _streams[device, purpose] = torch.cuda.Stream(device, priority=HIGH_PRIORITY)
    return stream


async def event_done(event: torch.cuda.Event, *, short: bool) -> None:
    """Wait for ``event`` (recorded on a side stream) without stalling the event loop for long.

    ``short``: only our own copy kernels (pack or scatter, a fraction of a millisecond) are
    ahead of it, so block the loop on it: cheaper than handing the wait to a thread, whose
    wake-up and GIL hand-back cost more than the copy on a busy host. Otherwise (e.g. a pack
    behind the prefill's compute) wait in a thread.
    """
    if event.query():
        return
    if short:
        event.synchronize()
    else:
        await asyncio.to_thread(event.synchronize)


async def event_polled(event: torch.cuda.Event, *, spin_s: float, poll_s: float = 1e-3) -> None:
    """Wait for ``event`` expected to complete about now: query it in a tight loop (blocking the
    event loop) for at most ``spin_s``, then every ``poll_s`` without blocking it. For work that
    may, rarely, wait far longer (queued behind other work): the loop's timeouts still fire."""
    spin_until = time.perf_counter() + spin_s
    while not event.query():
        if time.perf_counter() > spin_until:
            await asyncio.sleep(poll_s)
