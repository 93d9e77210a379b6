"""A burst of submits spreads over the prefill instances. Placements run concurrently (each waits
for its decode reservation), so the scheduler must count a prompt in its prefill instance's queue
when it picks the instance, not once placed: before, every request of a burst went to the
instance that looked least loaded when the burst began (seen on 2x H200 in
tests/services/test_services_gpu.py: nine of nine on one of two prefill instances). Real
nats-server and scheduler; the prefill instances and the decode rank are stand-ins on the bus."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from schemas import subjects
from schemas.internal import Heartbeat, Job, KVReservation, PrefillTask, ReserveKV, SamplingSpec, SubmitAck, SubmitJob
from schemas.transfer import KVTransferDescriptor, KVTransferLayout
from services.scheduler.service import Scheduler
from shared.bus import connect, pack, unpack
from shared.settings import SchedulerSettings

from services_helpers import run, until_listened

PREFILL = ("pa", "pb")
BURST = 8


def _heartbeat(role: str, instance: str, **fields) -> Heartbeat:  # type: ignore[no-untyped-def]
    return Heartbeat(role=role, instance=instance, rank=0, model="m", version="v", started_at=time.time(), page_size=16, **fields)


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
        layout = KVTransferLayout(num_layers=1, page_size=16, kv_heads=1, head_dim=8, dtype="float32")
        descriptor = KVTransferDescriptor(worker_address=b"stand-in", request_id=req.request_id, transfer_id=1, page_ids=[0],
                                          num_tokens=req.prompt_tokens, layout=layout, lease_deadline_unix=req.lease_until,
                                          max_chunk_bytes=1 << 20)
        await msg.respond(pack(KVReservation(request_id=req.request_id, ok=True, descriptor=descriptor)))

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
                replies = await asyncio.gather(*(peers.nc.request(subjects.SUBMIT, pack(SubmitJob(job=_job(i))), timeout=5) for i in range(BURST)))
                await peers.nc.flush()
                return [unpack(r.data, SubmitAck) for r in replies]
            finally:
                await scheduler.stop()

    acks = run(go())
    assert all(a.placement is not None for a in acks), acks
    by_instance = Counter(a.placement.prefill_instance for a in acks if a.placement is not None)
    assert by_instance == dict.fromkeys(PREFILL, BURST // 2), by_instance
    assert tasks == by_instance
