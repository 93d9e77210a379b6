"""CUDA side streams and host-side waits for the transfer's pack and scatter work.

Pack (prefill) and scatter (decode) run on their own high-priority stream: their few
short, memory-bound kernels are scheduled ahead of queued prefill GEMMs / decode steps
instead of waiting behind them, and they never delay the compute stream's own order.
On CPU there is no stream (``None``) and the work runs inline or in a thread.

``watch_event`` waits for an event whose completion time is unknown (the CUDA IPC path's
landing events, queued behind the prefill's compute) without blocking the event loop:
one watcher thread per process polls every pending event (``EventWatcher``);
``event_spun`` polls an event due about now between the loop's iterations.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import threading
import time
from dataclasses import dataclass

import torch

# Lower numbers are higher priorities in CUDA; -1 is the highest torch exposes on Hopper.
HIGH_PRIORITY = -1


_streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}
_spare_events: dict[torch.device, list[torch.cuda.Event]] = {}
_current_streams: dict[tuple[int, int], torch.cuda.Stream] = {}  # (device index, stream handle) -> its torch object
_CURRENT_STREAMS_KEPT = 64
_SPARE_EVENTS_MADE = 32  # made ahead per device (``prepare_events``): a direct write takes two, a batch has a few transfers


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


def made_event(device: torch.device, *, interprocess: bool = False) -> torch.cuda.Event:
    """A new CUDA event of ``device`` that exists in the driver already: torch creates an event
    at its first record (~40 us on a cold transfer path on 2x H200), so it is recorded once
    here, on the device's current stream."""
    event = torch.cuda.Event(interprocess=interprocess)
    event.record(torch.cuda.current_stream(device))
    return event


def take_event(device: torch.device) -> torch.cuda.Event:
    """A CUDA event of ``device`` that exists already: a spare one (``give_back_event``,
    ``prepare_events``), else a new one (``made_event``)."""
    spare = _spare_events.get(device)
    if spare:
        try:
            return spare.pop()
        except IndexError:  # another thread took the last one
            pass
    return made_event(device)


def current_stream(device_index: int) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(device_index)``, the object kept per stream handle: building it
    took 11-19 us of a 6k-token transfer's issue on 2x H200 (profiled at dc753919bd30); the handle
    is one C call. A handle names one stream for as long as the process can use it (torch's
    pool streams are never destroyed; a wrapped external stream is recorded through its handle)."""
    handle = torch._C._cuda_getCurrentRawStream(device_index)
    stream = _current_streams.get((device_index, handle))
    if stream is None:
        if len(_current_streams) >= _CURRENT_STREAMS_KEPT:
            _current_streams.clear()
        stream = _current_streams[device_index, handle] = torch.cuda.current_stream(device_index)
    return stream


def give_back_event(device: torch.device, event: torch.cuda.Event) -> None:
    """Keep ``event`` (from ``take_event``) for a later ``take_event``. The giver records it no
    more; stream waits already enqueued on it are unaffected by later records (CUDA waits for
    the record made before the wait was enqueued)."""
    _spare_events.setdefault(device, []).append(event)


def prepare_events(device: torch.device) -> None:
    """Make ``device``'s spare events now (a CUDA prefill rank's start), off every transfer's path."""
    spare = _spare_events.setdefault(device, [])
    while len(spare) < _SPARE_EVENTS_MADE:
        spare.append(made_event(device))


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


class EventWatcher:
    """Waits for CUDA events in one daemon thread per process, each wait resolved on its own
    event loop (``loop.call_soon_threadsafe``), so no event loop ever blocks on an event and
    no thread is spent per wait.

    For events whose completion time is unknown, e.g. direct writes still queued behind the
    prefill's compute: the thread queries every pending event at its own cadence
    (``poll_s``) and sleeps in between, releasing the GIL. Its timer slack is set to 1 us
    where Linux allows (``prctl``), so sleeps of tens of microseconds are not stretched by
    the default 50 us slack. Waits that end unresolved (their task cancelled, e.g. by a
    lease) drop their entry.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waits: dict[int, _Wait] = {}
        self._thread: threading.Thread | None = None
        self._pid = 0

    async def wait(self, event: torch.cuda.Event, *, poll_s: float) -> None:
        """Until ``event`` completed (raises ``RuntimeError`` if querying it does: CUDA reported
        an error on it), queried every ``poll_s``."""
        if event.query():
            return
        loop = asyncio.get_running_loop()
        wait = _Wait(event, loop, loop.create_future(), poll_s, 0.0)
        with self._cond:
            self._waits[id(wait)] = wait
            if self._thread is None or self._pid != os.getpid():  # none yet, or inherited through fork
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._run, name="cuda-event-watcher", daemon=True)
                self._thread.start()
            self._cond.notify()
        try:
            await wait.done
        finally:
            with self._cond:
                self._waits.pop(id(wait), None)

    def _run(self) -> None:
        _tight_timer_slack()
        while True:
            with self._cond:
                while not self._waits:
                    self._cond.wait()
                waits = list(self._waits.values())
            now = time.perf_counter()
            for wait in waits:
                if wait.next_poll > now:
                    continue
                try:
                    done, error = wait.event.query(), None
                except Exception as e:  # noqa: BLE001 - the waiter gets it; the thread serves the others on
                    done, error = True, e
                if done:
                    with self._cond:
                        self._waits.pop(id(wait), None)
                    with contextlib.suppress(RuntimeError):  # the waiting loop is closed: nobody waits
                        wait.loop.call_soon_threadsafe(_resolve, wait.done, error)
                else:
                    wait.next_poll = now + wait.poll_s
            with self._cond:
                if self._waits:
                    self._cond.wait(max(0.0, min(w.next_poll for w in self._waits.values()) - time.perf_counter()))


@dataclass
class _Wait:
    event: torch.cuda.Event
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future[None]
    poll_s: float
    next_poll: float


def _resolve(done: asyncio.Future[None], error: BaseException | None) -> None:
    if done.done():
        return
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)


def _tight_timer_slack() -> None:
    """1 us timer slack for the calling thread (Linux ``PR_SET_TIMERSLACK``); elsewhere nothing."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(29, 1000, 0, 0, 0)


_watcher = EventWatcher()


async def watch_event(event: torch.cuda.Event, *, poll_s: float) -> None:
    """``EventWatcher.wait`` on the process's watcher."""
    await _watcher.wait(event, poll_s=poll_s)


async def event_spun(event: torch.cuda.Event, *, until: float) -> bool:
    """Query ``event`` once per event-loop iteration (``asyncio.sleep(0)``: other tasks and I/O
    run between the queries) until it completed (True) or ``until`` (``time.perf_counter``)
    passed (False). For an event due about now: the loop's thread stays busy, so what follows
    the completion runs without a wake-up (on 2x H200 at 6k tokens, with the watcher thread
    alone the decode rank held the pages later: from KV ready 0.84 of peer copy at
    2d4d2820defc, 0.87-0.90 with this at a147946f51b4)."""
    while not event.query():
        if time.perf_counter() > until:
            return False
        await asyncio.sleep(0)
    return True
