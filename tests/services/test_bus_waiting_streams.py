"""Streams that wait for replies cost nothing until something happens, and still notice it.

A gateway holds one `Bus.stream` per request queued at a scheduler, each with a `gone` check of that
scheduler. Each stream used to wake on its own timer every 0.25 s to ask it (and to look for a
reconnect): 4096 queued requests took a third of a core of the gateway's event loop doing nothing
(`bench/stream_waiters.py`). One watch task now asks every stream's `gone` in turn, a reconnect
wakes the streams directly, and a stream's own timer is its deadline or its silence. These tests
count the timers the event loop schedules while 200 streams wait, and check that a `gone` naming a
reason, a deadline and a reply each still end or wake the right stream. Real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from shared.bus import GONE_CHECK_S, Bus, Deadline, RequestTimeout, Silent, connect

from services_helpers import run, until_listened

SUBJECT = "waiting.test"
STREAMS = 200


@contextlib.asynccontextmanager
async def _caller(url: str) -> AsyncIterator[Bus]:
    """A bus whose requests on SUBJECT a responder on another connection takes, answering only b"answer"
    (with b"done")."""

    async def on_request(msg) -> None:  # type: ignore[no-untyped-def]
        if msg.data == b"answer":
            await msg.respond(b"done")

    async with connect(url, "responder") as responder, connect(url, "caller") as caller:
        await responder.nc.subscribe(SUBJECT, cb=on_request)
        await until_listened(caller, SUBJECT)
        yield caller


def test_waiting_streams_schedule_no_timer_per_stream_per_check(nats_server) -> None:  # type: ignore[no-untyped-def]
    port, _ = nats_server
    url = f"nats://127.0.0.1:{port}"

    async def go() -> tuple[int, int]:
        async with _caller(url) as caller:
            asked = 0

            def gone() -> str:
                nonlocal asked
                asked += 1
                return ""

            async def wait() -> None:
                async for _ in caller.stream(SUBJECT, b"wait", lambda _m: True, Deadline.after(60), gone=gone):
                    pass

            tasks = [asyncio.create_task(wait()) for _ in range(STREAMS)]
            await asyncio.sleep(0.5)  # every stream subscribed and waiting
            loop = asyncio.get_running_loop()
            timers = 0
            call_at = loop.call_at

            def counting_call_at(*args, **kwargs):  # type: ignore[no-untyped-def]
                nonlocal timers
                timers += 1
                return call_at(*args, **kwargs)

            loop.call_at = counting_call_at  # type: ignore[method-assign]  # call_later and asyncio.timeout go through it
            asked, window = 0, 1.0
            try:
                await asyncio.sleep(window)
            finally:
                del loop.call_at
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return timers, asked

    timers, asked = run(go())
    checks = 1.0 / GONE_CHECK_S
    # Every stream's gone was asked about once per check (up to 5 checks in the window; fewer on a loaded box) ...
    assert asked % STREAMS == 0 and STREAMS <= asked <= STREAMS * (checks + 1), asked
    # ... but the loop scheduled a timer per check (the watch task's sleep, our own), not one per stream per check
    assert timers <= 4 * (checks + 1), f"{timers} timers in 1 s for {STREAMS} waiting streams"


def test_gone_ends_only_the_stream_it_names_and_a_reply_still_arrives(nats_server) -> None:  # type: ignore[no-untyped-def]
    port, _ = nats_server
    url = f"nats://127.0.0.1:{port}"

    async def go() -> tuple[float, list[bool], bytes]:
        async with _caller(url) as caller:
            dead: set[int] = set()

            async def wait(i: int) -> None:
                gone = lambda: f"stream {i}'s responder is gone" if i in dead else ""  # noqa: E731
                async for _ in caller.stream(SUBJECT, b"wait", lambda _m: True, Deadline.after(60), gone=gone):
                    pass

            tasks = [asyncio.create_task(wait(i)) for i in range(10)]
            await asyncio.sleep(0.3)
            dead.add(3)
            started = time.monotonic()
            with pytest.raises(Silent, match="stream 3's responder is gone"):
                await tasks[3]
            noticed = time.monotonic() - started
            await asyncio.sleep(2 * GONE_CHECK_S)
            still_waiting = [not t.done() for i, t in enumerate(tasks) if i != 3]
            # a stream with a gone check beside them still gets its reply at once
            replies = [m.data async for m in caller.stream(SUBJECT, b"answer", lambda _m: True, Deadline.after(5), gone=lambda: "")]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return noticed, still_waiting, b"".join(replies)

    noticed, still_waiting, reply = run(go())
    assert noticed <= 2 * GONE_CHECK_S + 1.0, noticed  # at the next check (slack for a loaded box)
    assert all(still_waiting)
    assert reply == b"done"


def test_an_error_of_gone_is_raised_by_its_own_stream_only(nats_server) -> None:  # type: ignore[no-untyped-def]
    port, _ = nats_server
    url = f"nats://127.0.0.1:{port}"

    async def go() -> bool:
        async with _caller(url) as caller:

            def broken() -> str:
                raise KeyError("no such scheduler")

            async def wait(gone) -> None:  # type: ignore[no-untyped-def]
                async for _ in caller.stream(SUBJECT, b"wait", lambda _m: True, Deadline.after(60), gone=gone):
                    pass

            other = asyncio.create_task(wait(lambda: ""))
            with pytest.raises(KeyError, match="no such scheduler"):
                await asyncio.wait_for(wait(broken), 5)
            await asyncio.sleep(2 * GONE_CHECK_S)
            alive = not other.done()
            other.cancel()
            await asyncio.gather(other, return_exceptions=True)
            return alive

    assert run(go())


def test_a_waiting_stream_ends_at_its_deadline(nats_server) -> None:  # type: ignore[no-untyped-def]
    port, _ = nats_server
    url = f"nats://127.0.0.1:{port}"

    async def go() -> float:
        async with _caller(url) as caller:
            started = time.monotonic()
            with pytest.raises(RequestTimeout):
                async for _ in caller.stream(SUBJECT, b"wait", lambda _m: True, Deadline.after(0.7), gone=lambda: ""):
                    pass
            return time.monotonic() - started

    waited = run(go())
    assert 0.6 <= waited <= 3.0, waited  # at its deadline (0.7 s), not at the 60 s of the other tests
