"""A task stopping a service's loops (`Scheduler.stop`: its heartbeat and expiry loops, its probes;
every service's `Heartbeater.stop`) that is itself cancelled meanwhile ends cancelled, once the
loop it waits on ended. The stops cancelled each loop and awaited it under
``suppress(CancelledError)``: a cancel of the stopping task reaches the loop it awaits and comes
back as that loop's CancelledError, which was swallowed, so the stop carried on to its end as if
never cancelled (an `asyncio.timeout` around it could not end it). `shared.tasks.cancel_and_wait`
raises it. A real scheduler on a real nats-server; deterministic: the cancel is sent while the
stop waits on its heartbeat loop."""

from __future__ import annotations

import asyncio

from services.scheduler.service import Scheduler
from shared.bus import connect
from shared.settings import SchedulerSettings


def test_a_stop_that_is_cancelled_while_it_waits_for_a_loop_ends_cancelled(nats_server):
    port, _ = nats_server
    url = f"nats://127.0.0.1:{port}"

    async def scenario() -> tuple[bool, bool]:
        async with connect(url, "scheduler") as bus:
            scheduler = Scheduler(SchedulerSettings(nats_url=url, instance="s0", model_name="m"), bus)
            await scheduler.start()
            beating = scheduler.heartbeater._task
            assert beating is not None
            stopping = asyncio.ensure_future(scheduler.stop())
            while not beating.cancelling():  # the stop cancelled the heartbeat loop and now waits for it to end
                await asyncio.sleep(0)
            stopping.cancel()
            await asyncio.wait({stopping}, timeout=10.0)
            return stopping.cancelled(), beating.done()

    cancelled, loop_ended = asyncio.run(scenario())
    assert loop_ended, "the heartbeat loop still runs"
    assert cancelled, "Scheduler.stop swallowed the cancel of the task running it and ran on to its end"
