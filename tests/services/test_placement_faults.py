"""Placement faults on a real stack (compose/single-node.yml, decode scaled to two instances,
`decode-0` and `decode-1`): a decode rank that answers late, and submits the scheduler cannot
place for reasons other than capacity, which must still get a typed answer at once.

A rank answers a reservation late when its process stalls (here: SIGSTOP) or its answer is
lost. The scheduler has then moved on, so pages the late rank reserves would be held for
nobody until the lease ends (30 s), and counted in its batch. Such a rank must refuse the
stale request (`ReserveKV.reply_by`) and free what it reserved when the scheduler releases
it (a `ctl.cancel` targeted at that rank alone), while the request runs on another rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import msgspec
import nats.errors
import pytest

from schemas import subjects
from schemas.api import GenerateRequest
from schemas.internal import Cancel, Job, KVReservation, Placement, PrefillTask, ReserveKV, SamplingSpec, SubmitAck, SubmitJob, TokenBatch, TokenMessage
from services.common import decode_stage
from shared.bus import pack, unpack

from services_helpers import HeartbeatWatch, all_kv_free, log_events, run, session, stack_fixture

pytestmark = pytest.mark.slow

stack = stack_fixture("single-node.yml", scale={"decode": 2})

RESERVE_TIMEOUT_S = 0.5  # the scheduler's default reserve_timeout_ms
PROMPT = "The capital of France is"


def _decode(watch: HeartbeatWatch, instance: str):  # type: ignore[no-untyped-def]
    return watch.latest[("decode", instance, 0)]


async def _scheduler_logged(stack, event: str, request_id: str, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    """Until the scheduler logged `event` for the request (while a decode rank is stopped: its
    wait does not depend on how loaded this box is)."""
    deadline = time.monotonic() + timeout
    while not any(e.get("request_id") == request_id and e["replica"].startswith("scheduler") for e in log_events(stack, event)):
        assert time.monotonic() < deadline, f"the scheduler logged no {event} for {request_id} within {timeout}s"
        await asyncio.sleep(0.05)


def _reserve(instance: str, request_id: str, gateway: str, reply_by: float) -> tuple[str, ReserveKV]:
    now = time.time()
    return subjects.decode_reserve(instance, 0), ReserveKV(request_id=request_id, gateway=gateway, prompt_tokens=20, max_tokens=20,
                                                           lease_until=now + 30, reply_by=reply_by)


def test_a_rank_that_answers_a_reservation_too_late_holds_nothing_and_the_request_runs_elsewhere(stack, tokenizer, hf_greedy):
    """decode-0 (tried first: both ranks are empty and its name sorts first) is stopped for
    longer than the scheduler waits for its answer, so the request goes to decode-1. Once
    decode-0 runs again it gets to the reservation request: within a second or so its pages
    must all be free and its batch empty (before the fix it held them for the whole 30 s
    lease), and the request, on decode-1, must be served in full."""
    late = next(r for r in stack.replicas if r.instance == "decode-0")

    async def go():
        async with session(stack.url) as (client, watch):
            await watch.wait_for(lambda w: len(w.live("decode")) == 2 and all_kv_free(w), 10, "both decode ranks idle")
            os.killpg(late.proc.pid, signal.SIGSTOP)
            try:
                answer = asyncio.ensure_future(client.generate(GenerateRequest(prompt=PROMPT, max_tokens=16, temperature=0, request_id="late-answer")))
                await _scheduler_logged(stack, "reserve_failed", "late-answer")  # its wait for decode-0 is over
            finally:
                os.killpg(late.proc.pid, signal.SIGCONT)
            resumed = time.monotonic()
            response = await answer
            await asyncio.sleep(max(0.0, resumed + 1.5 - time.monotonic()))  # the late rank reached the request long ago
            await watch.wait_for(lambda w: w.seen_at[("decode", "decode-0", 0)] > resumed + 1.0, 5, "a fresh heartbeat of decode-0")
            return response, _decode(watch, "decode-0")

    response, late_hb = run(go())
    assert late_hb.kv_free_pages == late_hb.kv_total_pages and late_hb.batch_size == 0, late_hb
    assert response.token_ids == hf_greedy(tuple(tokenizer.encode(PROMPT)), 16)
    reserve_failed = [e["decode"] for e in log_events(stack, "reserve_failed") if e.get("request_id") == "late-answer"]
    placed = [e["decode"] for e in log_events(stack, "placed") if e.get("request_id") == "late-answer" and e["replica"].startswith("scheduler")]
    assert reserve_failed == ["decode-0/0"] and placed == ["decode-1/0"], (reserve_failed, placed)


def test_a_rank_that_beats_but_misses_reservations_costs_one_reserve_timeout_not_one_per_request(stack):
    """decode-0 stalls (SIGSTOP) while its heartbeats keep coming (the test publishes its last
    real one every 0.25 s: a heartbeat sent by a thread the stall does not reach). Three requests,
    the last after a probe of decode-0 went unanswered: only the first may wait out a reservation
    timeout on decode-0, the others go straight to decode-1 (the scheduler's heartbeat names
    decode-0 suspect meanwhile). Once decode-0 runs again it answers a later probe and takes
    requests again. Before the fix the mark of the missed reply was lost with the next heartbeat
    (which replaced the registry entry during the wait), so every request asked decode-0 first
    and waited its 0.5 s."""
    stalled = next(r for r in stack.replicas if r.instance == "decode-0")
    ids = [f"beating-stalled-{n}" for n in range(3)]

    async def go():  # type: ignore[no-untyped-def]
        async with session(stack.url) as (client, watch):
            bus = client.bus
            await watch.wait_for(lambda w: len(w.live("decode")) == 2 and all_kv_free(w), 10, "both decode ranks idle")
            last_beat = _decode(watch, "decode-0")
            earlier_backs = len(log_events(stack, "decode_rank_back"))  # the stack is the module's: earlier tests stalled decode-0 too

            async def beat() -> None:
                while True:
                    await bus.publish(subjects.heartbeat("decode", "decode-0", 0), pack(last_beat))
                    await asyncio.sleep(0.25)

            os.killpg(stalled.proc.pid, signal.SIGSTOP)
            beating = asyncio.ensure_future(beat())
            try:
                for n, request_id in enumerate(ids):
                    if n == 2:
                        await asyncio.sleep(1.5)  # a probe of decode-0 goes out and misses meanwhile (0.5 s after the miss, for 0.5 s)
                    await client.generate(GenerateRequest(prompt=PROMPT, max_tokens=4, temperature=0, request_id=request_id))
                asked = [e["request_id"] for e in log_events(stack, "reserve_failed") if e.get("request_id") in ids and e["decode"] == "decode-0/0"]
                placed = [e["decode"] for e in log_events(stack, "placed") if e.get("request_id") in ids and e["replica"].startswith("scheduler")]
                assert asked == ids[:1] and placed == ["decode-1/0"] * 3, (asked, placed)
                await watch.wait_for(lambda w: [hb.suspect_ranks for hb in w.live("scheduler")] == [["decode-0/0"]], 5,
                                     "the scheduler's heartbeat naming decode-0 suspect")
            finally:
                beating.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await beating
                os.killpg(stalled.proc.pid, signal.SIGCONT)
            deadline = time.monotonic() + 15
            while not (back := [e for e in log_events(stack, "decode_rank_back")[earlier_backs:] if e["decode"] == "decode-0/0"]):
                assert time.monotonic() < deadline, "decode-0 was not taken back within 15 s of running again"
                await asyncio.sleep(0.1)
            assert back[0]["why"] == "answered a probe" and back[0]["probes"] >= 2, back  # the first probe went out while it was stopped
            await watch.wait_for(all_kv_free, 10, "both decode ranks idle again")
            await client.generate(GenerateRequest(prompt=PROMPT, max_tokens=4, temperature=0, request_id="beating-stalled-back"))

    run(go())
    placed = [e["decode"] for e in log_events(stack, "placed") if e.get("request_id") == "beating-stalled-back" and e["replica"].startswith("scheduler")]
    assert placed == ["decode-0/0"], placed  # both idle: the first by name, no longer skipped


def test_a_reservation_request_past_its_reply_by_is_refused(stack):
    async def go():
        async with session(stack.url) as (client, watch):
            await watch.wait_for(lambda w: len(w.live("gateway")) == 1 and all_kv_free(w), 10, "an idle stack")
            gateway = watch.live("gateway")[0].instance
            subject, stale = _reserve("decode-0", "stale", gateway, reply_by=time.time() - 0.01)
            try:
                return await client.bus.request(subject, stale, KVReservation, timeout=5)
            finally:
                await client.bus.publish(subjects.CTL_CANCEL, pack(Cancel("stale", "the test is over")))  # should it have reserved

    reply = run(go())
    assert not reply.ok and reply.descriptor is None and "stopped waiting" in reply.reason, reply


def test_a_release_targeted_at_one_rank_frees_only_its_reservation(stack):
    """The same request holds a reservation on both ranks (as when decode-0's answer was lost and
    decode-1 then reserved): a cancel targeted at decode-0 frees decode-0's pages, and
    decode-1's reservation stays until an ordinary cancel."""

    async def go():
        async with session(stack.url) as (client, watch):
            bus = client.bus
            await watch.wait_for(lambda w: len(w.live("gateway")) == 1 and all_kv_free(w), 10, "an idle stack")
            gateway = watch.live("gateway")[0].instance
            for instance in ("decode-0", "decode-1"):
                subject, request = _reserve(instance, "twin", gateway, reply_by=time.time() + 5)
                assert (await bus.request(subject, request, KVReservation, timeout=5)).ok
            await watch.wait_for(lambda w: all(hb.batch_size == 1 for hb in w.live("decode")), 5, "both reservations in the heartbeats")
            await bus.publish(subjects.CTL_CANCEL, pack(Cancel("twin", "released by the test", stage=decode_stage("decode-0", 0))))
            await watch.wait_for(lambda w: _decode(w, "decode-0").batch_size == 0, 5, "decode-0's reservation freed")
            freed_at = time.monotonic()
            await watch.wait_for(lambda w: w.seen_at[("decode", "decode-1", 0)] > freed_at + 0.6, 5, "a later heartbeat of decode-1")
            kept = _decode(watch, "decode-1")
            await bus.publish(subjects.CTL_CANCEL, pack(Cancel("twin", "done")))
            await watch.wait_for(all_kv_free, 5, "every page back after the untargeted cancel")
            return _decode(watch, "decode-0"), kept

    released, kept = run(go())
    assert released.kv_free_pages == released.kv_total_pages
    assert kept.batch_size == 1 and kept.kv_free_pages < kept.kv_total_pages, kept


def test_a_request_finished_at_its_first_token_frees_only_its_placed_ranks_reservation(stack):
    """The same request holds a reservation on both ranks (as above); the prefill instance runs it,
    placed on decode-1, and it ends at its first token (max_tokens=1). Prefill's release of
    decode-1's reservation is a cancel targeted at decode-1: decode-0's reservation stays, and no
    cancel reaches the gateway or anyone else. Before the fix prefill published an untargeted
    cancel, which freed decode-0's reservation as well (and was the gateway's to act on)."""

    async def go():
        async with session(stack.url) as (client, watch):
            bus = client.bus
            await watch.wait_for(lambda w: len(w.live("gateway")) == 1 and len(w.live("prefill")) == 1 and all_kv_free(w), 10, "an idle stack")
            gateway, prefill = watch.live("gateway")[0].instance, watch.live("prefill")[0].instance
            reservations = {}
            for instance in ("decode-0", "decode-1"):
                subject, request = _reserve(instance, "first-only", gateway, reply_by=time.time() + 5)
                reservations[instance] = await bus.request(subject, request, KVReservation, timeout=5)
                assert reservations[instance].ok and reservations[instance].descriptor is not None
            cancels: list[Cancel] = []
            tokens: asyncio.Queue[TokenMessage] = asyncio.Queue()

            async def on_cancel(msg) -> None:  # type: ignore[no-untyped-def]
                cancels.append(unpack(msg.data, Cancel))

            async def on_tokens(msg) -> None:  # type: ignore[no-untyped-def]
                tokens.put_nowait(unpack(msg.data, TokenMessage))

            await bus.subscribe(subjects.CTL_CANCEL, on_cancel, concurrent=False)
            await bus.subscribe(subjects.tokens(gateway, "first-only"), on_tokens, concurrent=False)
            await watch.wait_for(lambda w: all(hb.batch_size == 1 for hb in w.live("decode")), 5, "both reservations in the heartbeats")
            job = Job(request_id="first-only", gateway=gateway, input_ids=list(range(100, 120)), max_tokens=1,  # the 20 tokens `_reserve` reserves
                      sampling=SamplingSpec(temperature=0.0, top_p=1.0, top_k=0, seed=None), stop_token_ids=[], logprobs=False, deadline=time.time() + 30)
            placement = Placement(decode_instance="decode-1", decode_rank=0, prefill_instance=prefill)
            await bus.publish(subjects.prefill_task(prefill), pack(PrefillTask(job=job, placement=placement, descriptor=reservations["decode-1"].descriptor)))
            first = await asyncio.wait_for(tokens.get(), 10)
            await watch.wait_for(lambda w: _decode(w, "decode-1").batch_size == 0, 5, "decode-1's reservation freed")
            freed_at = time.monotonic()
            await watch.wait_for(lambda w: w.seen_at[("decode", "decode-0", 0)] > freed_at + 0.6, 5, "a later heartbeat of decode-0")
            kept, seen = _decode(watch, "decode-0"), list(cancels)
            await bus.publish(subjects.CTL_CANCEL, pack(Cancel("first-only", "done")))
            await watch.wait_for(all_kv_free, 5, "every page back after the untargeted cancel")
            return first, kept, seen

    first, kept, cancels = run(go())
    assert isinstance(first, TokenBatch) and first.finish_reason == "length" and len(first.token_ids) == 1, first
    assert kept.batch_size == 1 and kept.kv_free_pages < kept.kv_total_pages, kept
    assert [(c.request_id, c.stage) for c in cancels] == [("first-only", decode_stage("decode-1", 0))], cancels


def test_a_request_cancelled_while_the_scheduler_reserves_is_let_go_once_placed(stack):
    """A gateway whose submit timed out cancels the request (ctl.cancel) and forgets it (the test
    stands in for it). The scheduler, still waiting for decode-0 (stopped), then places the
    request on decode-1: it must cancel that placement itself, as nobody else will. Before the
    fix decode-1 ran the request's 4000 tokens for nobody."""
    late = next(r for r in stack.replicas if r.instance == "decode-0")

    async def go():
        async with session(stack.url) as (client, watch):
            bus = client.bus
            await watch.wait_for(lambda w: len(w.live("decode")) == 2 and len(w.live("gateway")) == 1 and all_kv_free(w), 10, "an idle stack")
            job = Job(request_id="given-up", gateway=watch.live("gateway")[0].instance, input_ids=list(range(10, 18)), max_tokens=4000,
                      sampling=SamplingSpec(temperature=0.0, top_p=1.0, top_k=0, seed=None), stop_token_ids=[], logprobs=False,
                      ignore_eos=True, deadline=time.time() + 60)
            os.killpg(late.proc.pid, signal.SIGSTOP)
            try:
                with pytest.raises(nats.errors.TimeoutError):
                    await bus.nc.request(subjects.SUBMIT, pack(SubmitJob(job=job)), timeout=RESERVE_TIMEOUT_S / 2)
                await bus.publish(subjects.CTL_CANCEL, pack(Cancel(job.request_id, "the scheduler did not answer")))
                await _scheduler_logged(stack, "refused", job.request_id)
            finally:
                os.killpg(late.proc.pid, signal.SIGCONT)
            await watch.wait_for(all_kv_free, 5, "every page free and no request running")

    run(go())
    placed = [e["decode"] for e in log_events(stack, "placed") if e.get("request_id") == "given-up"]
    refused = [e["code"] for e in log_events(stack, "refused") if e.get("request_id") == "given-up"]
    assert placed == ["decode-1/0"] and refused == ["cancelled"], (placed, refused)  # placed after the cancel, then let go


@pytest.mark.parametrize("payload", [b"\xc1", pack({"job": {"request_id": "x"}})], ids=["not-msgpack", "missing-fields"])
def test_a_malformed_submit_gets_invalid_request(stack, payload):
    async def go():
        async with session(stack.url) as (client, _):
            return unpack((await client.bus.nc.request(subjects.SUBMIT, payload, timeout=5)).data, SubmitAck)

    ack = run(go())
    assert ack.placement is None and ack.error_code == "invalid_request" and "malformed SubmitJob" in ack.error_message, ack


def test_a_prefill_task_over_the_bus_payload_limit_is_refused_and_its_reservation_freed(stack):
    """A SubmitJob just under the NATS server's max_payload fits on the bus, the PrefillTask built
    from it (the job plus the decode rank's descriptor) does not: publishing it fails after the
    reservation was made. Before the fix the submit got no answer at all."""

    async def go():
        async with session(stack.url) as (client, watch):
            await watch.wait_for(lambda w: len(w.live("gateway")) == 1 and all_kv_free(w), 10, "an idle stack")
            job = Job(request_id="huge", gateway=watch.live("gateway")[0].instance, input_ids=[1, 2, 3], max_tokens=4,
                      sampling=SamplingSpec(temperature=0.0, top_p=1.0, top_k=0, seed=None), stop_token_ids=[], logprobs=False,
                      deadline=time.time() + 30)
            padding = client.bus.nc.max_payload - 64 - len(pack(SubmitJob(job=job)))
            job.stop_token_ids = [0] * (padding - 4)  # msgpack: one byte per 0, a 5-byte array header instead of 1
            payload = pack(SubmitJob(job=job))
            assert client.bus.nc.max_payload - 64 <= len(payload) < client.bus.nc.max_payload
            started = time.monotonic()
            ack = unpack((await client.bus.nc.request(subjects.SUBMIT, payload, timeout=5)).data, SubmitAck)
            answered_s = time.monotonic() - started
            await watch.wait_for(all_kv_free, 3, "the reservation made for the task freed")
            return ack, answered_s

    ack, answered_s = run(go())
    assert ack.placement is None and ack.error_code == "invalid_request" and "max_payload" in ack.error_message, ack
    assert answered_s < 2.0


def test_a_reservation_reply_the_scheduler_cannot_read_is_released_and_the_request_runs_elsewhere(stack, tokenizer, hf_greedy):
    """A decode rank that answers its reservation with bytes that are no KVReservation (a rank of
    another version; a test stands in for it: a heartbeat with the most free KV, so it is asked
    first) may have reserved pages. The scheduler must release them there (a `ctl.cancel`
    targeted at that rank) and place the request on a real rank. Before the fix placing raised:
    the request failed with `internal` although two good ranks were idle, and the stand-in's
    pages stayed reserved until its lease ended."""

    async def go():
        async with session(stack.url) as (client, watch):
            bus = client.bus
            await watch.wait_for(lambda w: len(w.live("decode")) == 2 and all_kv_free(w), 10, "both decode ranks idle")
            real = watch.live("decode")[0]
            fake = msgspec.structs.replace(real, instance="broken", started_at=time.time(), kv_total_pages=10**6, kv_free_pages=10**6)
            cancels: list[Cancel] = []

            async def beat() -> None:
                while True:
                    await bus.publish(subjects.heartbeat("decode", "broken", 0), pack(fake))
                    await asyncio.sleep(0.25)

            async def answer_badly(msg) -> None:  # type: ignore[no-untyped-def]
                await msg.respond(b"\xc1")

            async def on_cancel(msg) -> None:  # type: ignore[no-untyped-def]
                cancels.append(unpack(msg.data, Cancel))

            await bus.subscribe(subjects.decode_reserve("broken", 0), answer_badly)
            await bus.subscribe(subjects.CTL_CANCEL, on_cancel, concurrent=False)
            beating = asyncio.ensure_future(beat())
            try:
                await watch.wait_for(lambda w: any(hb.instance == "broken" for hb in w.live("decode")), 5, "the stand-in's heartbeat")
                response = await client.generate(GenerateRequest(prompt=PROMPT, max_tokens=8, temperature=0, request_id="bad-answer"))
            finally:
                beating.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await beating
            await bus.nc.flush()
            return response, [c for c in cancels if c.request_id == "bad-answer"]

    response, cancels = run(go())
    assert response.token_ids == hf_greedy(tuple(tokenizer.encode(PROMPT)), 8)
    assert [c.stage for c in cancels] == [decode_stage("broken", 0)], cancels
    reserve_failed = [e["decode"] for e in log_events(stack, "reserve_failed") if e.get("request_id") == "bad-answer"]
    placed = [e["decode"] for e in log_events(stack, "placed") if e.get("request_id") == "bad-answer" and e["replica"].startswith("scheduler")]
    assert reserve_failed == ["broken/0"] and placed[0] in ("decode-0/0", "decode-1/0") and len(placed) == 1, (reserve_failed, placed)
