"""A scheduler that has just started has not heard every member yet: a role none of whose members it has
heard from is not absent until it has listened for `heartbeat_expiry_s` (every live member beats within
it). Before, a request that reached a scheduler restarted a moment ago waited `queue_wait_ms` and was
answered `unavailable: no prefill instance is registered` while the prefill instances' beats were on
their way (the rolling-restart test, once, under load on 2 cores).

Real nats-server and scheduler; the decode rank and the prefill instance are heartbeats on the bus."""

from __future__ import annotations

import asyncio
import time

from schemas import subjects
from schemas.internal import Heartbeat, Job, SamplingSpec, SubmitAck, SubmitJob
from services.scheduler.service import Scheduler
from services.submit import final_ack
from shared.bus import Bus, Deadline, connect, pack
from shared.settings import SchedulerSettings

from services_helpers import run, until_listened

EXPIRY_S = 1.5  # the scheduler's heartbeat_expiry_s: its roll call


def _heartbeat(role: str, instance: str, **fields) -> Heartbeat:  # type: ignore[no-untyped-def]
    return Heartbeat(role=role, instance=instance, rank=0, model="m", version="v", started_at=time.time(), page_size=16, **fields)


# A decode rank with a full batch: the scheduler asks it for no reservation, so a request that finds both
# roles registered is answered `overloaded` once its queue_wait_ms is over.
FULL_DECODE = _heartbeat("decode", "busy", kv_total_pages=1000, kv_free_pages=900, batch_size=8, max_batch=8)


def _job(request_id: str) -> Job:
    return Job(request_id=request_id, gateway="gw", input_ids=[1, 2, 3], max_tokens=4,
               sampling=SamplingSpec(temperature=0.0, top_p=1.0, top_k=0, seed=None), stop_token_ids=[], logprobs=False,
               deadline=time.time() + 30)


async def _submit(peers: Bus, request_id: str) -> tuple[SubmitAck, float]:
    """The scheduler's answer and how long it took."""
    started = time.monotonic()
    ack = await final_ack(peers, SubmitJob(job=_job(request_id)), Deadline.after(10))
    return ack, time.monotonic() - started


def test_a_role_heard_late_after_a_scheduler_starts_is_waited_for(nats_server) -> None:  # type: ignore[no-untyped-def]
    port, _ = nats_server
    url = f"nats://127.0.0.1:{port}"

    async def go() -> SubmitAck:
        async with connect(url, "scheduler") as bus, connect(url, "peers") as peers:
            scheduler = Scheduler(SchedulerSettings(nats_url=url, instance="sched-new", queue_wait_ms=100, heartbeat_expiry_s=EXPIRY_S), bus)
            await scheduler.start()
            try:
                await until_listened(peers, subjects.SUBMIT)
                await peers.publish(subjects.heartbeat("decode", "busy", 0), pack(FULL_DECODE))
                answer = asyncio.ensure_future(_submit(peers, "early"))
                await asyncio.sleep(0.5)  # past queue_wait_ms, within the roll call: the prefill instance's beat arrives
                prefill = _heartbeat("prefill", "pa")
                await peers.publish(subjects.heartbeat("prefill", "pa", 0), pack(prefill))
                ack, _ = await answer
                return ack
            finally:
                await scheduler.stop()

    ack = run(go())
    # Both roles heard: the decode rank's full batch is why (not "no prefill instance is registered")
    assert ack.placement is None and ack.error_code == "overloaded", ack
    assert "1 of 1 decode ranks at their max batch (8)" in ack.error_message, ack


def test_a_role_never_heard_is_absent_after_the_roll_call(nats_server) -> None:  # type: ignore[no-untyped-def]
    port, _ = nats_server
    url = f"nats://127.0.0.1:{port}"

    async def go() -> tuple[tuple[SubmitAck, float], tuple[SubmitAck, float], float]:
        async with connect(url, "scheduler") as bus, connect(url, "peers") as peers:
            started = time.monotonic()
            scheduler = Scheduler(SchedulerSettings(nats_url=url, instance="sched-alone", queue_wait_ms=100, heartbeat_expiry_s=EXPIRY_S), bus)
            await scheduler.start()
            try:
                await until_listened(peers, subjects.SUBMIT)
                await peers.publish(subjects.heartbeat("decode", "busy", 0), pack(FULL_DECODE))
                first = await _submit(peers, "during-roll-call")
                since_start = time.monotonic() - started
                await peers.publish(subjects.heartbeat("decode", "busy", 0), pack(FULL_DECODE))  # still alive, still no prefill
                later = await _submit(peers, "after-roll-call")
                return first, later, since_start
            finally:
                await scheduler.stop()

    (first, _), (later, later_s), since_start = run(go())
    for ack in (first, later):
        assert ack.error_code == "unavailable" and ack.error_message == "no prefill instance is registered", ack
    # The first answer waited out the roll call; once it is over, a role still missing is answered at once.
    assert since_start >= EXPIRY_S, since_start
    assert later_s < EXPIRY_S, later_s
