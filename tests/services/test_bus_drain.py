"""`Bus.drain` with a handler that outlives the drain timeout: the handler is cancelled, logged
(`handler_cancelled`, its subject) and waited for, so its cleanup runs while the connection is
still open, before the drain returns. Before, the drain cancelled it without waiting and closed
the connection: the handler's `finally` ran (if ever) after `drain` had returned, where nothing
it sends goes out. Real nats-server; the handler answers its requester from its `finally`."""

from __future__ import annotations

import asyncio

import nats.errors
import structlog

from shared.bus import connect
from services_helpers import run, until_listened

DRAIN_TIMEOUT_S = 0.5


def test_a_handler_that_outlives_the_drain_is_cancelled_logged_and_ended_before_the_drain_returns(nats_server) -> None:  # type: ignore[no-untyped-def]
    port, _ = nats_server
    url = f"nats://127.0.0.1:{port}"
    steps: list[str] = []

    async def slow(msg) -> None:  # type: ignore[no-untyped-def]
        if msg.data != b"work":
            return  # until_listened's probe
        steps.append("handling")
        try:
            await asyncio.sleep(3600)  # ignores the drain: only a cancel ends it
        finally:
            steps.append("finally")
            await asyncio.sleep(0.3)  # a cleanup that takes a while (e.g. a release over the bus)
            await msg.respond(b"cut short")  # the requester hears, if the connection is still open
            steps.append("cleaned up")

    async def go() -> tuple[bytes | None, asyncio.Task[None] | None]:
        async with connect(url, "caller") as caller:
            async with connect(url, "server", drain_timeout=DRAIN_TIMEOUT_S) as server:
                await server.subscribe("svc.slow", slow)
                await until_listened(caller, "svc.slow")
                reply = asyncio.ensure_future(caller.nats_request("svc.slow", b"work", timeout=3))
                while "handling" not in steps:
                    await asyncio.sleep(0.01)
                handler = next(iter(server._tasks), None)
                steps.append("drain")
            steps.append("drained")  # the drain (leaving `connect`) returned
            try:
                return (await reply).data, handler
            except nats.errors.TimeoutError:
                return None, handler

    with structlog.testing.capture_logs() as logs:
        data, handler = run(go())
    assert steps == ["handling", "drain", "finally", "cleaned up", "drained"], steps
    assert handler is not None and handler.cancelled(), handler
    assert data == b"cut short"  # sent from the handler's finally, before the connection closed
    cancelled = [e for e in logs if e["event"] == "handler_cancelled"]
    assert [(e["client"], e["subject"], e["drain_timeout_s"]) for e in cancelled] == [("server", "svc.slow", DRAIN_TIMEOUT_S)], logs
