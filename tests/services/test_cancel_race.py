"""A cancel that arrives while the scheduler is still placing the request is never lost.

The stack is a real nats-server, gateway and scheduler, and no prefill or decode: the test's
heartbeats stand in for a decode rank whose batch is full and a prefill instance, so the
scheduler can never place a request and would hold one for its whole queue wait (5 s), then
answer `overloaded` (with no decode rank at all it answers `unavailable` at once). Each request is published with its cancel right behind
it on the same connection, so the cancel reaches the scheduler before (or together
with) the request, which it then ignores: the ordering that once let a waiting request
end in `overloaded` instead of `cancelled`. Destructive test last (file order).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from schemas import subjects
from schemas.api import ErrorReply, GenerateReply, GenerateRequest
from schemas.internal import Cancel, Heartbeat, Placement, SubmitAck, SubmitJob
from shared.bus import Bus, decode_public, encode_public, pack, unpack

from services_helpers import run, session, stack_fixture

pytestmark = pytest.mark.slow

QUEUE_WAIT_S = 5.0

stack = stack_fixture("single-node.yml", scale={"prefill": 0, "decode": 0}, env={"MOEBUS_SCHEDULER_QUEUE_WAIT_MS": str(int(QUEUE_WAIT_S * 1000))})


@contextlib.asynccontextmanager
async def _full_decode_rank(bus: Bus, model: str) -> AsyncIterator[None]:
    """Heartbeats of a decode rank whose batch is full and of a prefill instance of ``model``, every 0.5 s."""
    beats = [Heartbeat(role="decode", instance="full", rank=0, model=model, version="v", started_at=1.0, kv_total_pages=64, kv_free_pages=64,
                       batch_size=1, max_batch=1, page_size=16),
             Heartbeat(role="prefill", instance="idle", rank=0, model=model, version="v", started_at=1.0)]

    async def beat() -> None:
        while True:
            for hb in beats:
                await bus.publish(subjects.heartbeat(hb.role, hb.instance, 0), pack(hb))
            await asyncio.sleep(0.5)

    beating = asyncio.ensure_future(beat())
    try:
        await asyncio.sleep(1.0)  # heard, and the scheduler's roll call over
        yield
    finally:
        beating.cancel()


async def _request_then_cancel(client, request_id: str):  # type: ignore[no-untyped-def]
    """Publish a request and its cancel right behind it; returns the subscription for the reply."""
    nc = client.bus.nc
    replies = await nc.subscribe(nc.new_inbox())
    request = GenerateRequest(prompt="hi", max_tokens=4, temperature=0, request_id=request_id)
    await nc.publish(subjects.GENERATE, encode_public(request), reply=replies.subject)
    await client.cancel(request_id)  # same connection: arrives right behind the request
    return replies


def test_cancel_right_behind_the_request_is_answered_at_once(stack):
    async def go():
        async with session(stack.url) as (client, _), _full_decode_rank(client.bus, (await client.models()).models[0].id):
            for i in range(6):
                started = time.monotonic()
                replies = await _request_then_cancel(client, f"race-{i}")
                reply = decode_public((await replies.next_msg(timeout=2 * QUEUE_WAIT_S)).data, GenerateReply)
                elapsed = time.monotonic() - started
                await replies.unsubscribe()
                assert isinstance(reply, ErrorReply) and reply.error.code == "cancelled", reply
                assert elapsed < QUEUE_WAIT_S / 2, f"race-{i} answered after {elapsed:.2f}s"

    run(go())


@pytest.mark.parametrize("queued_first", [False, True], ids=["unanswered", "queued"])
def test_a_placement_made_after_the_cancel_is_cancelled_once_the_scheduler_answers(stack, queued_first: bool):
    """The scheduler missed the cancel and places the request later: its KV must be freed.

    The ordering is forced by standing in for the scheduler (the real one is stopped): the
    cancel is sent once the submit has arrived, and the submit is held until the client has
    its `cancelled`, then answered with a placement; ``queued_first``: after an interim answer
    that it waits in the stand-in's queue (`SubmitAck.queued_by`), sent at once.
    """
    scheduler = next(r for r in stack.replicas if r.role == "scheduler")
    stack.stop_replica(scheduler)

    async def go():
        async with session(stack.url) as (client, _):
            bus = client.bus
            submits: asyncio.Queue = asyncio.Queue()
            cancels: list[tuple[float, Cancel]] = []

            async def on_cancel(msg) -> None:  # type: ignore[no-untyped-def]
                cancels.append((time.monotonic(), unpack(msg.data, Cancel)))

            await bus.subscribe(subjects.SUBMIT, submits.put, queue=subjects.SCHEDULER_QUEUE, concurrent=False)
            await bus.subscribe(subjects.CTL_CANCEL, on_cancel, concurrent=False)
            # The cancel goes out once the submit has arrived: sent right behind the request, it could reach
            # the gateway before the request left admission (a loaded machine), and nothing was submitted.
            nc = bus.nc
            replies = await nc.subscribe(nc.new_inbox())
            request = GenerateRequest(prompt="hi", max_tokens=4, temperature=0, request_id="late")
            await nc.publish(subjects.GENERATE, encode_public(request), reply=replies.subject)
            submit = await asyncio.wait_for(submits.get(), 5)
            job = unpack(submit.data, SubmitJob).job
            if queued_first:
                await submit.respond(pack(SubmitAck(request_id=job.request_id, queued_by="stand-in")))
            await client.cancel("late")
            reply = decode_public((await replies.next_msg(timeout=5)).data, GenerateReply)  # the submit is unanswered
            answered_at = time.monotonic()
            placement = Placement(decode_instance="decode-x", decode_rank=0, prefill_instance="prefill-x")
            await submit.respond(pack(SubmitAck(request_id=job.request_id, placement=placement)))
            deadline = time.monotonic() + 5
            while not any(at > answered_at and c.request_id == "late" for at, c in cancels) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            return job, reply, [(at > answered_at, c.request_id) for at, c in cancels]

    job, reply, cancels = run(go())
    assert job.request_id == "late"
    assert isinstance(reply, ErrorReply) and reply.error.code == "cancelled", reply
    assert (True, "late") in cancels, cancels  # a ctl.cancel after the placement was answered
