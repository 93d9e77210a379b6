"""Leaving `connect` while the NATS server is away ends nats-py's reconnect loop, even when the loop
loses the cancel meant to end it.

nats-py 2.16's `close` cancels its reconnection task once and waits `reconnect_time_wait` (0.25 s).
On Python 3.11 a cancel that meets a connect attempt as it fails comes out of `asyncio.wait_for` as
the attempt's own error (ConnectionRefusedError), which the loop catches and retries: the task runs
on, and so does the process. Helper 87 saw a gateway stopped by SIGTERM with its NATS server gone
log `gateway_stopped` and then retry NATS every 0.25 s for good, deaf to SIGTERM and SIGINT:
`asyncio.run`'s last step cancels the leftover task once more and waits for it.

The race is one turn of the event loop wide; here a connect attempt that swallows the first cancel
as that race does stands in for it (a real nats-server, stopped; the rest of nats-py as it is)."""

from __future__ import annotations

import asyncio

from shared.bus import connect

from services_helpers import run


def test_leaving_connect_ends_a_reconnect_loop_that_lost_its_cancel(nats_server) -> None:  # type: ignore[no-untyped-def]
    port, procs = nats_server
    url = f"nats://127.0.0.1:{port}"

    async def go() -> tuple[bool, int]:
        swallowed = 0

        async def attempt_swallowing_the_first_cancel(server) -> None:  # type: ignore[no-untyped-def]
            nonlocal swallowed
            try:
                await asyncio.sleep(3600)  # a connect attempt under way when the cancel comes
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed += 1
                raise ConnectionRefusedError(111, "Connect call failed (in place of the cancel, as wait_for's race gives it)") from None

        async with connect(url, "leaving", drain_timeout=0.5) as bus:
            nc = bus.nc
            nc._connect_to_server = attempt_swallowing_the_first_cancel  # each reconnect attempt
            procs[0].kill()
            procs[0].wait()
            for _ in range(200):  # until nats-py noticed and is reconnecting
                if nc._reconnection_task is not None and not nc._reconnection_task.done():
                    break
                await asyncio.sleep(0.02)
            assert nc.is_reconnecting, nc._status
            await asyncio.sleep(0.5)  # its backoff over: the loop waits in an attempt
        task = nc._reconnection_task
        ended = task.done()
        if not ended:  # let the test end: a second cancel gets through
            task.cancel()
            await asyncio.wait([task], timeout=5)
        return ended, swallowed

    ended, swallowed = run(go())
    assert swallowed == 1  # the stand-in did lose a cancel
    assert ended, "nats-py's reconnect loop outlived connect(): the process would not exit"
