"""How the scheduler's estimate of its members between their heartbeats steers placements. Real
nats-server and scheduler; the prefill instances and the decode rank are stand-ins on the bus.

A burst of submits spreads over the prefill instances. Placements run concurrently (each waits
for its decode reservation), so the scheduler must count a prompt in its prefill instance's queue
when it picks the instance, not once placed: before, every request of a burst went to the
instance that looked least loaded when the burst began (seen on 2x H200 in
tests/services/test_services_gpu.py: nine of nine on one of two prefill instances).

The estimate of a decode rank only grows between its heartbeats: short requests that finish
before the next one still count. A rank it counts full is still asked while its last heartbeat
shows room, until it refuses: before, requests waited for the rank's next heartbeat although it
had room (up to 0.19 s at concurrency 16 in bench/control_plane.py, traced), or failed
`overloaded` when that took longer than the scheduler's queue_wait_ms."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from schemas import subjects
from schemas.internal import Heartbeat, Job, KVReservation, PrefillTask, ReserveKV, SamplingSpec, SubmitAck, SubmitJob
from schemas.transfer import KVTransferDescriptor, KVTransferLayout
from services.scheduler.service import Scheduler
from services.submit import final_ack
from shared.bus import Deadline, connect, pack, unpack
from shared.settings import SchedulerSettings

from services_helpers import run, until_listened

PREFILL = ("pa", "pb")
BURST = 8


def _heartbeat(role: str, instance: str, **fields) -> Heartbeat:  # type: ignore[no-untyped-def]
    return Heartbeat(role=role, instance=instance, rank=0, model="m", version="v", started_at=time.time(), page_size=16, **fields)


def _descriptor(req: ReserveKV) -> KVTransferDescriptor:
    layout = KVTransferLayout(num_layers=1, page_size=16, kv_heads=1, head_dim=8, dtype="float32")
    return KVTransferDescriptor(worker_address=b"stand-in", request_id=req.request_id, transfer_id=1, page_ids=[0],
                                num_tokens=req.prompt_tokens, layout=layout, lease_deadline_unix=req.lease_until, max_chunk_bytes=1 << 20)


def _job(i: int) -> Job:
    return Job(request_id=f"burst-{i}", gateway="gw", input_ids=[1, 2, 3, 4, 5], max_tokens=4,
               sampling=SamplingSpec(temperature=0.0, top_p=1.0, top_k=0, seed=None), stop_token_ids=[], logprobs=False,
               deadline=time.time() + 30)


def test_a_burst_of_submits_spreads_over_the_prefill_instances(nats_server) -> None:  # type: ignore[no-untyped-def]
    port, _ = nats_server
    url = f"nats://127.0.0.1:{port}"
    tasks: Counter[str] = Counter()

    async def reserve(msg) -> None:  # type: ignore[no-untyped-def]
        req = unpack(msg.data, ReserveKV)
        await asyncio.sleep(0.05)  # a decode rank's round trip: the burst's placements overlap
        await msg.respond(pack(KVReservation(request_id=req.request_id, ok=True, descriptor=_descriptor(req))))

    def on_task(instance: str):  # type: ignore[no-untyped-def]
        async def record(msg) -> None:  # type: ignore[no-untyped-def]
            unpack(msg.data, PrefillTask)
            tasks[instance] += 1
        return record

    async def go() -> list[SubmitAck]:
        async with connect(url, "scheduler") as bus, connect(url, "peers") as peers:
            scheduler = Scheduler(SchedulerSettings(nats_url=url, instance="sched-spread"), bus)
            await scheduler.start()
            try:
                await peers.subscribe(subjects.decode_reserve("dx", 0), reserve)
                for instance in PREFILL:
                    await peers.subscribe(subjects.prefill_task(instance), on_task(instance), concurrent=False)
                await until_listened(peers, subjects.SUBMIT)
                # One heartbeat each (none during the burst: a heartbeat restarts a member's count).
                await peers.publish(subjects.heartbeat("decode", "dx", 0), pack(_heartbeat("decode", "dx", kv_total_pages=1000, kv_free_pages=1000, max_batch=64)))
                for instance in PREFILL:
                    await peers.publish(subjects.heartbeat("prefill", instance, 0), pack(_heartbeat("prefill", instance)))
                for _ in range(200):
                    if len(scheduler.registry.members) == 1 + len(PREFILL):
                        break
                    await asyncio.sleep(0.01)
                return list(await asyncio.gather(*(final_ack(peers, SubmitJob(job=_job(i)), Deadline.after(5)) for i in range(BURST))))
            finally:
                await scheduler.stop()

    acks = run(go())
    assert all(a.placement is not None for a in acks), acks
    by_instance = Counter(a.placement.prefill_instance for a in acks if a.placement is not None)
    assert by_instance == dict.fromkeys(PREFILL, BURST // 2), by_instance
    assert tasks == by_instance


def test_a_decode_rank_counted_full_between_heartbeats_is_asked_until_it_refuses(nats_server) -> None:  # type: ignore[no-untyped-def]
    port, _ = nats_server
    url = f"nats://127.0.0.1:{port}"
    asked: list[str] = []
    room = 4  # reservations the stand-in grants (its requests finish at once), then it is full

    async def reserve(msg) -> None:  # type: ignore[no-untyped-def]
        req = unpack(msg.data, ReserveKV)
        asked.append(req.request_id)
        ok = len(asked) <= room
        await msg.respond(pack(KVReservation(request_id=req.request_id, ok=ok, descriptor=_descriptor(req) if ok else None,
                                             reason="" if ok else "batch full (2)")))

    async def go() -> list[SubmitAck]:
        async with connect(url, "scheduler") as bus, connect(url, "peers") as peers:
            # No heartbeat after the first (a heartbeat restarts a member's count): a long expiry.
            settings = SchedulerSettings(nats_url=url, instance="sched-room", heartbeat_expiry_s=60, queue_wait_ms=300)
            scheduler = Scheduler(settings, bus)
            await scheduler.start()
            try:
                await peers.subscribe(subjects.decode_reserve("dx", 0), reserve, concurrent=False)
                await peers.subscribe(subjects.prefill_task("pa"), lambda msg: asyncio.sleep(0), concurrent=False)
                await until_listened(peers, subjects.SUBMIT)
                await peers.publish(subjects.heartbeat("decode", "dx", 0), pack(_heartbeat("decode", "dx", kv_total_pages=1000, kv_free_pages=1000,
                                                                                         batch_size=0, max_batch=2)))
                await peers.publish(subjects.heartbeat("prefill", "pa", 0), pack(_heartbeat("prefill", "pa")))
                for _ in range(200):
                    if len(scheduler.registry.members) == 2:
                        break
                    await asyncio.sleep(0.01)
                acks = []
                for i in range(room + 2):  # one at a time: each finds the rank as the previous left it
                    acks.append(await final_ack(peers, SubmitJob(job=_job(i)), Deadline.after(5)))
                return acks
            finally:
                await scheduler.stop()

    acks = run(go())
    # Placed although the scheduler counted the rank's batch (2) full from the third one on.
    assert [a.placement is not None for a in acks[:room]] == [True] * room, acks
    # Then the rank refuses: that request waits out queue_wait_ms, the next is not even asked.
    assert [a.error_code for a in acks[room:]] == ["overloaded", "overloaded"], acks
    assert asked == [f"burst-{i}" for i in range(room + 1)]
