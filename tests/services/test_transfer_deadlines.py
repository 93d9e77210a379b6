"""A request whose deadline passes while its KV is reserved or on the way ends as `timeout`
(DESIGN §1: a deadline that passes is `timeout`), not `unavailable`, at every stage that
reports it. Real stack (compose/single-node.yml: one prefill and one decode instance); the
test stands in for the scheduler and the prefill where it needs to (reservations, tasks and
starts sent as those would), and reads the stages' errors on the request's token subject
(the gateway has no such request and ignores them).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from schemas import subjects
from schemas.internal import Job, KVReservation, Placement, PrefillTask, ReserveKV, SamplingSpec, StageError, StartDecode, TokenMessage
from services.common import decode_stage, prefill_stage
from shared.bus import Bus, unpack, pack

from services_helpers import all_kv_free, run, session, stack_fixture

pytestmark = pytest.mark.slow

stack = stack_fixture("single-node.yml")

DECODE = "decode-0"


def _job(request_id: str, gateway: str, deadline: float, prompt_tokens: int = 8) -> Job:
    return Job(request_id=request_id, gateway=gateway, input_ids=list(range(1, prompt_tokens + 1)), max_tokens=8,
               sampling=SamplingSpec(temperature=0.0, top_p=1.0, top_k=0, seed=None), stop_token_ids=[], logprobs=False, deadline=deadline)


async def _reserve(bus: Bus, job: Job, lease_until: float) -> KVReservation:
    request = ReserveKV(request_id=job.request_id, gateway=job.gateway, prompt_tokens=len(job.input_ids), max_tokens=job.max_tokens,
                        lease_until=lease_until, reply_by=time.time() + 5, deadline=job.deadline)
    reply = await bus.request(subjects.decode_reserve(DECODE, 0), request, KVReservation, timeout=5)
    assert reply.ok and reply.descriptor is not None, reply
    return reply


async def _errors(bus: Bus, gateway: str) -> dict[str, list[StageError]]:
    """The stage errors published to `gateway`'s token subjects from now on, by request id."""
    errors: dict[str, list[StageError]] = {}

    async def on_message(msg) -> None:  # type: ignore[no-untyped-def]
        message = unpack(msg.data, TokenMessage)
        if isinstance(message, StageError):
            errors.setdefault(message.request_id, []).append(message)

    await bus.subscribe(subjects.tokens_all(gateway), on_message, concurrent=False)
    await bus.nc.flush()
    return errors


async def _wait(errors: dict[str, list[StageError]], request_ids: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(errors.get(rid) for rid in request_ids):
        assert time.monotonic() < deadline, f"no stage error for {[rid for rid in request_ids if not errors.get(rid)]}: {errors}"
        await asyncio.sleep(0.05)


def test_a_reservation_whose_lease_ends_at_the_deadline_ends_as_timeout(stack):
    """No prefill ever delivers: the lease ends. Bounded by the request's deadline, that is the
    deadline passing (`timeout`; it was `unavailable`); a lease shorter than the deadline stays
    `unavailable`."""

    async def go():
        async with session(stack.url) as (client, watch):
            await watch.wait_for(lambda w: len(w.live("gateway")) == 1 and all_kv_free(w), 10, "an idle stack")
            gateway = watch.live("gateway")[0].instance
            errors = await _errors(client.bus, gateway)
            now = time.time()
            await _reserve(client.bus, _job("at-deadline", gateway, deadline=now + 0.8), lease_until=now + 0.8)
            await _reserve(client.bus, _job("short-lease", gateway, deadline=now + 30), lease_until=now + 0.8)
            await _wait(errors, ["at-deadline", "short-lease"], 5)
            await watch.wait_for(all_kv_free, 3, "the pages back")
            return errors

    errors = run(go())
    assert [(e.code, e.stage) for e in errors["at-deadline"]] == [("timeout", decode_stage(DECODE, 0))], errors
    assert [e.code for e in errors["short-lease"]] == ["unavailable"], errors


def test_a_kv_transfer_still_awaited_at_the_deadline_ends_as_timeout(stack):
    """Decode was told to start, and its KV never lands: the decode rank waits for it until the
    request's deadline, then fails the request as `timeout` (it was `unavailable`)."""

    async def go():
        async with session(stack.url) as (client, watch):
            await watch.wait_for(lambda w: len(w.live("gateway")) == 1 and all_kv_free(w), 10, "an idle stack")
            gateway = watch.live("gateway")[0].instance
            errors = await _errors(client.bus, gateway)
            job = _job("kv-never-lands", gateway, deadline=time.time() + 0.8)
            await _reserve(client.bus, job, lease_until=time.time() + 30)
            start = StartDecode(job=job, first_token=1, first_logprob=None, generator_state=None)
            await client.bus.publish(subjects.decode_start(DECODE, 0), pack(start))
            await _wait(errors, [job.request_id], 5)
            await watch.wait_for(all_kv_free, 3, "the pages back")
            return errors[job.request_id]

    errors = run(go())
    assert [(e.code, e.stage) for e in errors] == [("timeout", decode_stage(DECODE, 0))], errors
    assert "KV not complete" in errors[0].message


def test_a_kv_send_cut_off_by_the_deadline_ends_as_timeout(stack):
    """The prefill sends KV into a reservation whose lease ends at the request's deadline, to a
    decode rank that is stopped (SIGSTOP) until after it: the send cannot complete, and both
    the prefill (its send ran into the lease) and the decode rank (the lease ended) report
    `timeout` (both said `unavailable`)."""
    decode = next(r for r in stack.replicas if r.instance == DECODE)

    async def go():
        async with session(stack.url) as (client, watch):
            await watch.wait_for(lambda w: len(w.live("gateway")) == 1 and len(w.live("prefill")) == 1 and all_kv_free(w), 10, "an idle stack")
            gateway = watch.live("gateway")[0].instance
            prefill = watch.live("prefill")[0].instance
            errors = await _errors(client.bus, gateway)
            deadline = time.time() + 1.0
            job = _job("send-cut-off", gateway, deadline=deadline, prompt_tokens=300)  # 150 kB of KV: more than UCX sends eagerly
            reservation = await _reserve(client.bus, job, lease_until=deadline)
            assert reservation.descriptor is not None
            os.killpg(decode.proc.pid, signal.SIGSTOP)
            try:
                task = PrefillTask(job=job, placement=Placement(decode_instance=DECODE, decode_rank=0, prefill_instance=prefill),
                                   descriptor=reservation.descriptor)
                await client.bus.publish(subjects.prefill_task(prefill), pack(task))
                await asyncio.sleep(max(0.0, deadline + 0.3 - time.time()))
            finally:
                os.killpg(decode.proc.pid, signal.SIGCONT)
            await _wait(errors, [job.request_id], 5)
            await asyncio.sleep(1.0)  # the other stage's error too
            await watch.wait_for(all_kv_free, 5, "the pages back")
            return prefill, errors[job.request_id]

    prefill, errors = run(go())
    assert sorted((e.stage, e.code) for e in errors) == sorted([(prefill_stage(prefill), "timeout"), (decode_stage(DECODE, 0), "timeout")]), errors
