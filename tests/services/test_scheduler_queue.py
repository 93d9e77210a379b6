"""Requests beyond the running batch queue at the scheduler until capacity frees, as vLLM's do, however
long that takes: before, a request that waited `queue_wait_ms` (1 s by default) was answered `overloaded`
(503), so `vllm bench serve --request-rate inf` against a moebus stack got hundreds of them. The scheduler
now answers a submit it cannot place at once with an interim `SubmitAck.queued_by`, and the gateway waits
for the final answer until the request's deadline, past its `submit_timeout_s`, while that scheduler's
heartbeats go on. Real stack (one decode rank of batch 1) on a real nats-server."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter

import msgspec
import pytest

from schemas import subjects
from schemas.api import ErrorCode, GenerateRequest
from schemas.internal import Cancel, Job, KVReservation, Placement, ReserveKV, SubmitAck, SubmitJob
from services.client import GenerateError
from services.scheduler.service import PLACING_AT_ONCE, Scheduler
from services.submit import final_ack
from shared.bus import Deadline, connect, pack, unpack
from shared.settings import SchedulerSettings

from services_helpers import all_kv_free, log_events, run, session, stack_fixture, until, until_listened
from test_scheduler_spread import _descriptor, _heartbeat, _job

SUBMIT_TIMEOUT_S = 2.0
STAGE_EXPIRY_S = 2.0  # the gateway's default: a scheduler silent this long fails the requests in its queue

stack = stack_fixture("single-node.yml", env={"MOEBUS_DECODE_MAX_BATCH": "1", "MOEBUS_GATEWAY_SUBMIT_TIMEOUT_S": str(SUBMIT_TIMEOUT_S)})


def _queued_at_scheduler(n: int):  # type: ignore[no-untyped-def]
    return lambda w: [hb.queued_requests for hb in w.live("scheduler")] == [n]


async def _hold_the_batch(client, watch, max_tokens: int, request_id: str | None = None) -> asyncio.Future:  # type: ignore[no-untyped-def]
    """A request running on the one decode rank (batch 1), so that the next ones queue."""
    await watch.wait_for(lambda w: len(w.live("decode")) == 1 and all_kv_free(w), 30, "an idle decode rank")
    holder = asyncio.ensure_future(client.generate(GenerateRequest(prompt="holds the batch", max_tokens=max_tokens, ignore_eos=True, temperature=0,
                                                                   request_id=request_id)))
    await watch.wait_for(lambda w: [hb.batch_size for hb in w.live("decode")] == [1], 30, "the holder on the decode rank")
    return holder


def test_a_burst_beyond_the_batch_queues_until_each_request_runs(stack):
    """The burst waits behind a request that holds the batch past the gateway's submit timeout (and the
    old 1 s queue wait), however fast this machine decodes, then each request of it runs in turn."""
    burst, max_tokens = 6, 64

    async def go():
        async with session(stack.url) as (client, watch):
            holder = await _hold_the_batch(client, watch, 4000, request_id="holds-the-burst")
            reqs = [GenerateRequest(prompt=f"queued {i}", max_tokens=max_tokens, ignore_eos=True, temperature=0) for i in range(burst)]
            replies = asyncio.gather(*(client.generate(r) for r in reqs), return_exceptions=True)
            await watch.wait_for(_queued_at_scheduler(burst), 10, "the burst in the scheduler's queue")
            await asyncio.sleep(SUBMIT_TIMEOUT_S + 0.5)
            assert not holder.done() and not replies.done()  # nothing answered while the batch was held
            await client.cancel("holds-the-burst")
            with pytest.raises(GenerateError):
                await holder
            return await replies

    replies = run(go())
    failed = [r for r in replies if isinstance(r, BaseException)]
    assert not failed, failed  # on main: `overloaded` ("no capacity within 1000 ms") for the ones behind
    assert [r.usage.completion_tokens for r in replies] == [max_tokens] * burst
    # Every one waited past the old 1 s and past the gateway's submit timeout before it was placed.
    assert min(r.timing.queue_ms for r in replies) > SUBMIT_TIMEOUT_S * 1000, [r.timing for r in replies]


def test_a_request_cancelled_while_queued_leaves_nothing_behind(stack):
    async def go():
        async with session(stack.url) as (client, watch):
            holder = await _hold_the_batch(client, watch, 400)
            queued = asyncio.ensure_future(client.generate(GenerateRequest(prompt="waits", max_tokens=8, request_id="queued-then-cancelled")))
            await watch.wait_for(_queued_at_scheduler(1), 10, "the request in the scheduler's queue")
            await client.cancel("queued-then-cancelled", "the test cancels it")
            with pytest.raises(GenerateError) as cancelled:
                await queued
            await watch.wait_for(_queued_at_scheduler(0), 5, "the scheduler's queue empty")
            assert not holder.done()  # still running: the queue emptied by the cancel, not by capacity
            await holder
            await watch.wait_for(all_kv_free, 10, "every KV page back")
            return cancelled.value

    error = run(go())
    assert error.code == "cancelled", error
    assert not [e for e in log_events(stack, "placed") if e.get("request_id") == "queued-then-cancelled"]
    refused = [(e["code"], e["reason"]) for e in log_events(stack, "refused") if e.get("request_id") == "queued-then-cancelled"]
    # the refusal names the cancel's reason: the gateway may hear it before its own copy of the cancel
    assert refused == [("cancelled", "cancelled while waiting for capacity: the test cancels it")], refused


def test_a_queued_request_cancelled_twice_is_refused_with_the_first_reason(stack):
    """A gateway passes a client's cancel on, then, the request failed by it, cancels again ("request failed at the
    gateway"): the second reached the scheduler before its waiter woke and took the refusal's reason (a flaky
    failure of the test above in a full run). Two cancels back to back on ctl.cancel: the first one's reason."""
    async def go():
        async with session(stack.url) as (client, watch), connect(stack.url, "test-two-cancels") as bus:
            holder = await _hold_the_batch(client, watch, 400)
            queued = asyncio.ensure_future(client.generate(GenerateRequest(prompt="waits", max_tokens=8, request_id="cancelled-twice")))
            await watch.wait_for(_queued_at_scheduler(1), 10, "the request in the scheduler's queue")
            await bus.publish(subjects.CTL_CANCEL, pack(Cancel("cancelled-twice", "the first cancel")))
            await bus.publish(subjects.CTL_CANCEL, pack(Cancel("cancelled-twice", "the second cancel")))
            with pytest.raises(GenerateError):
                await queued
            await watch.wait_for(_queued_at_scheduler(0), 5, "the scheduler's queue empty")
            await holder

    run(go())
    refused = [e["reason"] for e in log_events(stack, "refused") if e.get("request_id") == "cancelled-twice"]
    assert refused == ["cancelled while waiting for capacity: the first cancel"], refused


def test_the_requests_queued_at_a_scheduler_that_dies_fail_unavailable_within_its_expiry(stack):
    """Last here: the scheduler is started again afterwards, but the others need not wait for it."""
    scheduler = next(r for r in stack.replicas if r.role == "scheduler")

    async def go() -> tuple[list[BaseException | object], float]:
        async with session(stack.url) as (client, watch):
            holder = await _hold_the_batch(client, watch, 400)
            reqs = [GenerateRequest(prompt=f"stranded {i}", max_tokens=8, timeout_ms=60_000) for i in range(3)]
            queued = [asyncio.ensure_future(client.generate(r)) for r in reqs]
            await watch.wait_for(_queued_at_scheduler(3), 10, "three requests in the scheduler's queue")
            os.kill(scheduler.proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            results = await asyncio.gather(*queued, return_exceptions=True)
            answered_s = time.monotonic() - killed
            await holder  # placed before: runs on
            return results, answered_s

    try:
        results, answered_s = run(go())
    finally:
        scheduler.proc.wait()
        stack.restart_replica(scheduler)
    codes: list[ErrorCode] = [r.code for r in results if isinstance(r, GenerateError)]
    assert codes == ["unavailable"] * 3, results
    assert all("stopped responding" in str(r) for r in results), results
    assert answered_s < 3 * STAGE_EXPIRY_S, answered_s  # not at their 60 s deadline


def test_a_submit_ack_of_a_scheduler_without_queued_by_still_decodes():
    class OldSubmitAck(msgspec.Struct, kw_only=True):  # SubmitAck before `queued_by`
        request_id: str
        placement: Placement | None = None
        error_code: str | None = None
        error_message: str = ""

    placed = Placement(decode_instance="d", decode_rank=0, prefill_instance="p")
    ack = unpack(pack(OldSubmitAck(request_id="old", placement=placed)), SubmitAck)
    assert ack == SubmitAck(request_id="old", placement=placed) and ack.queued_by == "", ack


async def one_slot_per_heartbeat(url: str, settings: SchedulerSettings, jobs: list[Job]) -> tuple[list[SubmitAck], list[str], Counter[int]]:
    """A real Scheduler with `settings`; `jobs` submitted one at a time (so the order they came in is known)
    wait behind a stand-in decode rank of batch 1; each heartbeat then shows one free slot, which the rank
    grants once, until every job is placed. Returns the final answers, the requests granted in turn, and
    how many reservations each heartbeat round set off.

    Each slot opens only once no placement attempt is in flight: the scheduler's own attempts are
    counted around its real `_try_place`. Opened while the last round's reservations were still on
    their way, it went to whichever came first, and a request idle when the one placed left the
    line (it moved up into the head window) could ask before an older one whose refused attempt was
    still being answered: a full run once granted burst-34 before burst-19. The queue promises the
    head window's order only among attempts a heartbeat sets off together (`PLACING_AT_ONCE`)."""
    slots = [0]
    attempts_in_flight = [0]
    asks: Counter[int] = Counter()  # heartbeat round -> reservations asked for in it
    granted: list[str] = []

    async def reserve(msg) -> None:  # type: ignore[no-untyped-def]
        req = unpack(msg.data, ReserveKV)
        asks[len(granted)] += 1
        ok = slots[0] > 0
        if ok:
            slots[0] -= 1
            granted.append(req.request_id)
        await msg.respond(pack(KVReservation(request_id=req.request_id, ok=ok, descriptor=_descriptor(req) if ok else None,
                                             reason="" if ok else "batch full (1)")))

    def decode_beat(batch_size: int) -> bytes:
        return pack(_heartbeat("decode", "dx", kv_total_pages=1000, kv_free_pages=1000, batch_size=batch_size, max_batch=1))

    async with connect(url, "scheduler") as bus, connect(url, "peers") as peers:
        scheduler = Scheduler(settings, bus)
        try_place = scheduler._try_place

        async def counted_try_place(job: Job) -> Placement | None:
            attempts_in_flight[0] += 1
            try:
                return await try_place(job)
            finally:
                attempts_in_flight[0] -= 1

        scheduler._try_place = counted_try_place  # type: ignore[method-assign]
        await scheduler.start()
        try:
            await peers.subscribe(subjects.decode_reserve("dx", 0), reserve, concurrent=False)
            await peers.subscribe(subjects.prefill_task("pa"), lambda msg: asyncio.sleep(0), concurrent=False)
            await until_listened(peers, subjects.SUBMIT)
            await peers.publish(subjects.heartbeat("decode", "dx", 0), decode_beat(1))
            await peers.publish(subjects.heartbeat("prefill", "pa", 0), pack(_heartbeat("prefill", "pa")))
            await until(lambda: len(scheduler.registry.members) == 2, "both members registered")
            answers = []
            for i, job in enumerate(jobs):
                answers.append(asyncio.ensure_future(final_ack(peers, SubmitJob(job=job), Deadline.after(60))))
                await until(lambda: len(scheduler.queue) == i + 1, f"request {i} in the queue")
            for placed in range(len(jobs)):
                await until(lambda: attempts_in_flight[0] == 0, f"the attempts before slot {placed} answered")
                slots[0] = 1
                await peers.publish(subjects.heartbeat("decode", "dx", 0), decode_beat(0))
                await until(lambda: len(granted) == placed + 1, f"slot {placed} granted")
            return list(await asyncio.gather(*answers)), granted, asks
        finally:
            await scheduler.stop()


def test_the_queue_is_served_first_come_first_served_and_only_its_oldest_try(nats_server) -> None:  # type: ignore[no-untyped-def]
    """40 requests wait behind a decode rank of batch 1; each heartbeat then shows one free slot, which the
    stand-in rank grants once. The slots go out in the order the requests came, and each heartbeat sets off
    reservations from the oldest `PLACING_AT_ONCE` (and the one moving up as the placed one leaves), not
    from all 40: woken all, each waiter asked (and a queue of 4096 kept the event loop busy)."""
    port, _ = nats_server
    url = f"nats://127.0.0.1:{port}"
    waiting = 40
    settings = SchedulerSettings(nats_url=url, instance="sched-fifo", heartbeat_expiry_s=60)
    acks, granted, asks = run(one_slot_per_heartbeat(url, settings, [_job(i) for i in range(waiting)]))
    assert all(a.placement is not None for a in acks), acks
    assert granted == [f"burst-{i}" for i in range(waiting)], granted
    assert max(asks.values()) <= PLACING_AT_ONCE + 1, asks
