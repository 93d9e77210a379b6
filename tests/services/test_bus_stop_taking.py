"""`Bus.stop_taking` on one member of a queue group under a steady publisher loses nothing: every
message is handled by exactly one member, the stopping one or the other.

nats-py's own drain wrote its PING before its UNSUB, so the server answered the PING while it still
routed messages to the stopping member, which then dropped them unread once its subscription was
gone: 10 of 20 drains here lost 20-340 messages each. In the stack that was a client's request at a
stopping gateway, or a gateway's submit at a stopping scheduler, waiting out its timeout unanswered
(the rolling-restart test's rare failures).

Real nats-server; the members and the publisher are separate connections."""

from __future__ import annotations

import asyncio
from collections import Counter

from shared.bus import connect

from services_helpers import run

MESSAGES = 4000
DRAINS = 10


async def _one_drain(url: str) -> Counter[str]:
    """A queue group of two; a publisher sends MESSAGES while the first member stops taking."""
    async with connect(url, "stopping") as stopping, connect(url, "staying") as staying, connect(url, "publisher") as publisher:
        handled: Counter[str] = Counter()

        async def on_stopping(msg) -> None:  # type: ignore[no-untyped-def]
            handled["stopping"] += 1

        async def on_staying(msg) -> None:  # type: ignore[no-untyped-def]
            handled["staying"] += 1

        sub = await stopping.subscribe("drain.race", on_stopping, queue="members")
        await staying.subscribe("drain.race", on_staying, queue="members")
        for bus in (stopping, staying, publisher):
            await bus.nc.flush()

        async def publish() -> None:
            for i in range(MESSAGES):
                await publisher.publish("drain.race", b"m")
                if i % 50 == 0:
                    await asyncio.sleep(0)  # let the others run: the stop happens mid-stream
            await publisher.nc.flush()

        sending = asyncio.ensure_future(publish())
        await asyncio.sleep(0.005)
        await stopping.stop_taking(sub)
        await sending
        await staying.nc.flush()  # a round trip: what was routed to the staying member has arrived
        for _ in range(100):
            if sum(handled.values()) >= MESSAGES:
                break
            await asyncio.sleep(0.01)
        return handled


def test_a_queue_member_that_stops_taking_loses_no_message(nats_server) -> None:  # type: ignore[no-untyped-def]
    port, _ = nats_server
    url = f"nats://127.0.0.1:{port}"

    async def go() -> list[Counter[str]]:
        return [await _one_drain(url) for _ in range(DRAINS)]

    drains = run(go())
    lost = [MESSAGES - sum(handled.values()) for handled in drains]
    assert lost == [0] * DRAINS, f"messages lost per drain: {lost}"
    # the stop came mid-stream: both members took a share in every drain
    assert all(handled["stopping"] and handled["staying"] for handled in drains), drains
