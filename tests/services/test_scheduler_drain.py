"""A scheduler stopped (SIGTERM) while a submit waits for capacity answers it `unavailable` once
its `drain_timeout_s` runs out, before it exits, even when `queue_wait_ms` is longer. Before, the
bus drain cancelled the waiting submit's handler at its timeout and the scheduler exited without
answering: the gateway waited out its submit timeout (10 s) and then reported the scheduler gone.

A real nats-server and a real scheduler process; the decode rank and the prefill instance are
stand-ins on the bus: the rank takes one reservation, then refuses (its batch is full)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

from schemas import subjects
from schemas.internal import Heartbeat, Job, KVReservation, ReserveKV, SamplingSpec, SubmitAck, SubmitJob
from schemas.transfer import KVTransferDescriptor, KVTransferLayout
from services.submit import final_ack
from shared.bus import Deadline, RequestTimeout, connect, pack, unpack

from services_helpers import run, until_listened

DRAIN_TIMEOUT_S = 1.0


def _heartbeat(role: str, instance: str, **fields) -> Heartbeat:  # type: ignore[no-untyped-def]
    return Heartbeat(role=role, instance=instance, rank=0, model="m", version="v", started_at=time.time(), page_size=16, **fields)


def _job(request_id: str) -> Job:
    return Job(request_id=request_id, gateway="gw", input_ids=[1, 2, 3, 4, 5], max_tokens=4,
               sampling=SamplingSpec(temperature=0.0, top_p=1.0, top_k=0, seed=None), stop_token_ids=[], logprobs=False,
               deadline=time.time() + 120)


def _grant(req: ReserveKV) -> KVReservation:
    layout = KVTransferLayout(num_layers=1, page_size=16, kv_heads=1, head_dim=8, dtype="float32")
    descriptor = KVTransferDescriptor(worker_address=b"stand-in", request_id=req.request_id, transfer_id=1, page_ids=[0],
                                      num_tokens=req.prompt_tokens, layout=layout, lease_deadline_unix=req.lease_until, max_chunk_bytes=1 << 20)
    return KVReservation(request_id=req.request_id, ok=True, descriptor=descriptor)


def test_a_submit_waiting_for_capacity_when_the_scheduler_stops_is_answered_unavailable(nats_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    port, _ = nats_server
    url = f"nats://127.0.0.1:{port}"
    settings = [f"--set={field}" for field in ("queue_wait_ms=60000", f"drain_timeout_s={DRAIN_TIMEOUT_S}", "heartbeat_expiry_s=60")]
    stderr = open(tmp_path / "scheduler.log", "wb")
    scheduler = subprocess.Popen([sys.executable, "-m", "services.scheduler", "--nats-url", url, "--instance", "sched-stop", *settings], stderr=stderr)
    reserved: list[str] = []

    async def reserve(msg) -> None:  # type: ignore[no-untyped-def]
        req = unpack(msg.data, ReserveKV)
        reserved.append(req.request_id)
        full = KVReservation(request_id=req.request_id, ok=False, reason="batch full (1)")
        await msg.respond(pack(_grant(req) if len(reserved) == 1 else full))

    async def go() -> tuple[SubmitAck, SubmitAck | None, float]:
        async with connect(url, "peers") as peers:
            queued = asyncio.Event()

            async def on_scheduler_beat(msg) -> None:  # type: ignore[no-untyped-def]
                if unpack(msg.data, Heartbeat).queued_requests == 1:
                    queued.set()

            await peers.subscribe(subjects.decode_reserve("dx", 0), reserve, concurrent=False)
            await peers.subscribe(subjects.prefill_task("pa"), lambda msg: asyncio.sleep(0), concurrent=False)
            await peers.subscribe(subjects.heartbeat("scheduler", "sched-stop"), on_scheduler_beat, concurrent=False)
            await until_listened(peers, subjects.SUBMIT, timeout=30)
            await peers.publish(subjects.heartbeat("decode", "dx", 0), pack(_heartbeat("decode", "dx", kv_total_pages=1000, kv_free_pages=1000,
                                                                                     batch_size=0, max_batch=1)))
            await peers.publish(subjects.heartbeat("prefill", "pa", 0), pack(_heartbeat("prefill", "pa")))
            first = await final_ack(peers, SubmitJob(job=_job("fills")), Deadline.after(10))
            waiting = asyncio.ensure_future(final_ack(peers, SubmitJob(job=_job("waits")), Deadline.after(10)))
            async with asyncio.timeout(10):
                await queued.wait()  # the scheduler's heartbeat: one submit waits for capacity
            scheduler.send_signal(signal.SIGTERM)
            stopped = time.monotonic()
            try:
                second: SubmitAck | None = await waiting
            except RequestTimeout:
                second = None
            return first, second, time.monotonic() - stopped

    try:
        first, second, answered_s = run(go())
        assert scheduler.wait(timeout=10) == 0
    finally:
        scheduler.kill()
        scheduler.wait()
        stderr.close()
    assert first.placement is not None, first
    assert reserved == ["fills", "waits"]  # the second was asked for and refused: capacity is full
    assert second is not None, f"no SubmitAck within {answered_s:.1f} s of the SIGTERM"
    assert second.placement is None and second.error_code == "unavailable", second
    assert "stopped before capacity came" in second.error_message, second
    assert answered_s < DRAIN_TIMEOUT_S + 2.0, answered_s  # at the drain's end, not at queue_wait_ms (60 s)
