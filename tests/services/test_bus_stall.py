"""A caller whose own event loop stalls does not take a responder that kept sending for a silent one.

`Bus.stream` fails a request with `Silent` when the responder sends nothing, not even a keepalive,
for `silence_s`. A stall of the caller's own loop longer than that (CPU starvation, a long
synchronous call) ended its wait's timeout in the same turn of the loop as the keepalives waiting
in its socket, and the timeout ran first: the request failed "no reply on ... the responder stopped
answering" while the responder had answered all along (a suspect in the rolling-restart test's rare
"no reply on llm.generate for 6s" under load on 2 cores).

Real nats-server; the responder runs on its own thread and event loop, so it keeps sending while the
caller's loop is blocked."""

from __future__ import annotations

import asyncio
import threading
import time

from shared.bus import Deadline, Silent, connect

from services_helpers import run, until_listened

SUBJECT = "stall.test"
KEEPALIVE_S = 0.1
REPLIES = 20  # one every KEEPALIVE_S: the last one after 2 s
STALL_S = 1.0  # the caller's loop blocked this long, twice its allowed silence
SILENCE_S = 0.5


def _responder(url: str, listening: threading.Event, done: threading.Event) -> None:
    """Answers one request with REPLIES messages, one every KEEPALIVE_S, the last one b"end"."""

    async def serve() -> None:
        async with connect(url, "responder") as bus:
            answered = asyncio.Event()

            async def on_request(msg) -> None:  # type: ignore[no-untyped-def]
                if msg.data != b"go":
                    return  # `until_listened`'s probe
                for i in range(REPLIES):
                    await msg.respond(b"end" if i == REPLIES - 1 else b"keepalive")
                    await asyncio.sleep(KEEPALIVE_S)
                answered.set()

            await bus.nc.subscribe(SUBJECT, cb=on_request)
            await bus.nc.flush()
            listening.set()
            async with asyncio.timeout(30):
                await answered.wait()
        done.set()

    asyncio.run(serve())


def test_a_stall_of_the_callers_own_loop_is_not_the_responders_silence(nats_server) -> None:  # type: ignore[no-untyped-def]
    port, _ = nats_server
    url = f"nats://127.0.0.1:{port}"
    listening, done = threading.Event(), threading.Event()
    responder = threading.Thread(target=_responder, args=(url, listening, done), daemon=True)
    responder.start()
    assert listening.wait(10)

    async def go() -> list[bytes]:
        async with connect(url, "caller") as caller:
            await until_listened(caller, SUBJECT)
            got: list[bytes] = []
            async for msg in caller.stream(SUBJECT, b"go", lambda m: m.data == b"end", Deadline.after(30), silence_s=SILENCE_S):
                got.append(msg.data)
                if len(got) == 2:
                    # Once the stream waits for the next reply, this loop stalls (another task's synchronous
                    # work): the wait's timeout expires meanwhile and the responder's keepalives pile up in the socket.
                    asyncio.get_running_loop().call_later(0.02, time.sleep, STALL_S)
            return got

    try:
        got = run(go())
    except Silent as e:
        raise AssertionError(f"the caller's own stall was taken for the responder's silence: {e}") from e
    assert got == [b"keepalive"] * (REPLIES - 1) + [b"end"]
    assert done.wait(10)
    responder.join(10)


def test_a_responder_that_stops_is_still_silent(nats_server) -> None:  # type: ignore[no-untyped-def]
    """The round trip that looks for unread replies does not hide a responder that really stopped."""
    port, _ = nats_server
    url = f"nats://127.0.0.1:{port}"

    async def go() -> tuple[list[bytes], float]:
        async with connect(url, "responder") as responder, connect(url, "caller") as caller:
            async def on_request(msg) -> None:  # type: ignore[no-untyped-def]
                if msg.data == b"go":  # not `until_listened`'s probe
                    await msg.respond(b"keepalive")  # one keepalive, then nothing

            await responder.nc.subscribe(SUBJECT, cb=on_request)
            await until_listened(caller, SUBJECT)
            got: list[bytes] = []
            started = time.monotonic()
            try:
                async for msg in caller.stream(SUBJECT, b"go", lambda m: m.data == b"end", Deadline.after(30), silence_s=SILENCE_S):
                    got.append(msg.data)
            except Silent as e:
                assert "the responder stopped answering" in str(e), e
                return got, time.monotonic() - started
            raise AssertionError("the stream ended without an end message")

    got, waited = run(go())
    assert got == [b"keepalive"]
    assert waited >= SILENCE_S, waited
