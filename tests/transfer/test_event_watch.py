"""The CUDA event watcher (``shared.transfer.streams.EventWatcher``): waits for events in one
thread and resolves each wait on its own event loop, which keeps running meanwhile.

On CPU the events are ``_Flag`` objects (a ``query()`` that turns true when a timer thread
sets it: all the watcher ever calls on an event); on a GPU a real CUDA event recorded behind
a GPU sleep."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from shared.transfer.streams import EventWatcher


class _Flag:
    """Completes ``after_s`` from its creation; counts the queries; ``error`` raised by query()."""

    def __init__(self, after_s: float, error: Exception | None = None) -> None:
        self._set = threading.Event()
        timer = threading.Timer(after_s, self._set.set)
        timer.daemon = True
        timer.start()
        self.error = error
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        if self.error is not None and self._set.is_set():
            raise self.error
        return self._set.is_set()


async def _ticks_during(coro) -> tuple[int, float]:
    """Loop iterations another task got while ``coro`` ran, and the seconds it took."""
    ticks = 0
    stop = False

    async def tick() -> None:
        nonlocal ticks
        while not stop:
            ticks += 1
            await asyncio.sleep(0.001)

    ticker = asyncio.create_task(tick())
    started = time.perf_counter()
    await asyncio.wait_for(coro, 10.0)
    elapsed = time.perf_counter() - started
    stop = True
    await ticker
    return ticks, elapsed


def test_waits_resolve_once_the_event_completes_and_the_loop_runs_meanwhile():
    async def main() -> None:
        watcher = EventWatcher()
        created = time.perf_counter()  # the flags' timers run from here, a little before the timed wait starts
        flags = [_Flag(0.05), _Flag(0.15)]
        ticks, elapsed = await _ticks_during(asyncio.gather(*(watcher.wait(f, poll_s=25e-6) for f in flags)))
        assert all(f.query() for f in flags)
        assert time.perf_counter() - created >= 0.15 and elapsed < 2.0
        assert ticks >= 20, "the event loop was blocked during the wait"
        assert not watcher._waits

    asyncio.run(main())


def test_a_query_error_fails_the_wait_and_a_cancelled_wait_leaves_nothing_behind():
    async def main() -> None:
        watcher = EventWatcher()
        with pytest.raises(RuntimeError, match="illegal address"):
            await asyncio.wait_for(watcher.wait(_Flag(0.02, RuntimeError("CUDA error: illegal address")), poll_s=1e-4), 10.0)
        never = _Flag(3600.0)
        task = asyncio.create_task(watcher.wait(never, poll_s=1e-4))
        await asyncio.sleep(0.05)
        assert never.queries > 0 and len(watcher._waits) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not watcher._waits
        polled = never.queries
        await asyncio.sleep(0.05)
        assert never.queries == polled  # no longer polled

    asyncio.run(main())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_event_behind_gpu_work_is_seen_done_without_blocking_the_loop():
    async def main() -> None:
        watcher = EventWatcher()
        torch.cuda._sleep(int(0.3 * 2e9))  # ~0.3 s of GPU time on the current stream
        event = torch.cuda.Event()
        event.record()
        assert not event.query()
        ticks, elapsed = await _ticks_during(watcher.wait(event, poll_s=25e-6))
        assert event.query() and ticks >= 20 and elapsed < 10.0

    asyncio.run(main())
