"""A request refused `overloaded` says why no decode rank took it: full batches, or too little free KV
for prompt + max_tokens (reserved up front, where vLLM would queue the request). Before, the answer
was "no capacity within 1000 ms" whatever the cause (helper 85's trial: a 64-prompt batch of
max_tokens 128 on an idle demo stack got just that).

Real nats-server and scheduler; the decode ranks and the prefill instance are heartbeats on the bus."""

from __future__ import annotations

import asyncio
import time

from schemas import subjects
from schemas.internal import Heartbeat, Job, SamplingSpec, SubmitAck, SubmitJob
from services.scheduler.service import Scheduler
from services.submit import final_ack
from shared.bus import Deadline, connect, pack
from shared.settings import SchedulerSettings

from services_helpers import run, until_listened


def _heartbeat(role: str, instance: str, **fields) -> Heartbeat:  # type: ignore[no-untyped-def]
    return Heartbeat(role=role, instance=instance, rank=0, model="m", version="v", started_at=time.time(), page_size=16, **fields)


def _job(request_id: str, prompt_tokens: int, max_tokens: int) -> Job:
    return Job(request_id=request_id, gateway="gw", input_ids=list(range(1, prompt_tokens + 1)), max_tokens=max_tokens,
               sampling=SamplingSpec(temperature=0.0, top_p=1.0, top_k=0, seed=None), stop_token_ids=[], logprobs=False,
               deadline=time.time() + 30)


def _answer(url: str, beats: list[Heartbeat], job: Job) -> SubmitAck:
    """A scheduler (queue_wait_ms 300) that has registered ``beats``: its answer to a submit of ``job``."""

    async def go() -> SubmitAck:
        async with connect(url, "scheduler") as bus, connect(url, "peers") as peers:
            scheduler = Scheduler(SchedulerSettings(nats_url=url, instance="sched-overloaded", queue_wait_ms=300), bus)
            await scheduler.start()
            try:
                await until_listened(peers, subjects.SUBMIT)
                for hb in beats:
                    await peers.publish(subjects.heartbeat(hb.role, hb.instance, 0), pack(hb))
                for _ in range(200):
                    if len(scheduler.registry.members) == len(beats):
                        break
                    await asyncio.sleep(0.01)
                return await final_ack(peers, SubmitJob(job=job), Deadline.after(10))
            finally:
                await scheduler.stop()

    return run(go())


def test_an_overloaded_answer_names_the_full_batches_and_the_short_kv(nats_server) -> None:  # type: ignore[no-untyped-def]
    port, _ = nats_server
    beats = [_heartbeat("decode", "busy", kv_total_pages=1000, kv_free_pages=900, batch_size=8, max_batch=8),
             _heartbeat("decode", "short", kv_total_pages=1000, kv_free_pages=5, batch_size=3, max_batch=8),
             _heartbeat("prefill", "pa")]
    ack = _answer(f"nats://127.0.0.1:{port}", beats, _job("too-big-now", 20, 100))  # 120 tokens: 8 pages of 16
    assert ack.placement is None and ack.error_code == "overloaded", ack
    assert ack.error_message == ("no capacity within 300 ms: 1 of 2 decode ranks at their max batch (8); 1 of 2 without "
                                 "free KV for prompt + max_tokens = 120 tokens, reserved up front (at most 80 tokens free)"), ack


def test_an_overloaded_answer_says_when_ranks_with_room_did_not_take_the_request(nats_server) -> None:  # type: ignore[no-untyped-def]
    """A decode rank whose heartbeat shows room but which does not answer its reservation (nothing
    listens on its reserve subject here): neither a full batch nor short KV is why, and the answer says so."""
    port, _ = nats_server
    beats = [_heartbeat("decode", "silent", kv_total_pages=1000, kv_free_pages=900, batch_size=0, max_batch=8), _heartbeat("prefill", "pa")]
    ack = _answer(f"nats://127.0.0.1:{port}", beats, _job("room-but-silent", 3, 4))
    assert ack.placement is None and ack.error_code == "overloaded", ack
    assert ack.error_message == "no capacity within 300 ms: the decode ranks with room refused the reservation or did not answer it", ack
