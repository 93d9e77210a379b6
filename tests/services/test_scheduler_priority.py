"""vLLM's priority scheduling: a request's `priority` (lower first, ties first come) orders the scheduler's
queue under `scheduler.scheduling_policy` "priority"; under "fcfs", the default, a priority other than 0 is
refused `invalid_request` naming the setting, as vLLM refuses it. Before, moebus' OpenAI frontend refused
any priority but 0 and its native API had none. Real nats-server, real Scheduler (and Gateway), stand-in
decode and prefill peers as in test_scheduler_queue.py."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from schemas import subjects
from schemas.api import GenerateRequest
from schemas.internal import Job, SamplingSpec
from services.client import Client, GenerateError
from services.gateway.admission import Admission, ModelInfo
from services.gateway.service import Gateway
from services.scheduler.service import PLACING_AT_ONCE, Scheduler
from shared.bus import connect, pack, unpack
from shared.model.tokenizer import Tokenizer
from shared.settings import GatewaySettings, SchedulerSettings

from services_helpers import run, until_listened
from test_scheduler_queue import one_slot_per_heartbeat
from test_scheduler_spread import _job


def test_waiting_requests_are_placed_by_priority_then_arrival(nats_server) -> None:  # type: ignore[no-untyped-def]
    """30 requests with priorities -2..2 wait behind a decode rank of batch 1; each heartbeat then shows one
    free slot, which the stand-in rank grants once. The slots go out in (priority, arrival) order, and each
    heartbeat still sets off reservations from the first `PLACING_AT_ONCE` in that order only."""
    port, _ = nats_server
    url = f"nats://127.0.0.1:{port}"
    priorities = [(7 * i) % 5 - 2 for i in range(30)]  # every value comes back every 5 arrivals, none in a row
    settings = SchedulerSettings(nats_url=url, instance="sched-prio", heartbeat_expiry_s=60, scheduling_policy="priority")
    jobs = [msgspec.structs.replace(_job(i), priority=p) for i, p in enumerate(priorities)]
    acks, granted, asks = run(one_slot_per_heartbeat(url, settings, jobs))
    assert all(a.placement is not None for a in acks), acks
    in_order = sorted(range(len(priorities)), key=lambda i: (priorities[i], i))
    assert granted == [f"burst-{i}" for i in in_order], granted  # main: in arrival order (burst-0, burst-1, ...)
    assert max(asks.values()) <= PLACING_AT_ONCE + 1, asks


def test_fcfs_refuses_a_priority_naming_the_setting_through_the_gateway(nats_server, tiny_model: Path, tokenizer: Tokenizer):
    """vLLM's default policy, and moebus': a priority other than 0 is an `invalid_request` (vLLM: "priority
    scheduling is not enabled") at once, not a wait in a queue that would ignore it."""
    port, _ = nats_server
    url = f"nats://127.0.0.1:{port}"
    settings = GatewaySettings(model=str(tiny_model), model_name="tiny", nats_url=url, instance="gw-prio")

    async def go() -> GenerateError:
        async with connect(url, "gateway") as gw_bus, connect(url, "scheduler") as sched_bus, connect(url, "client") as client_bus:
            scheduler = Scheduler(SchedulerSettings(nats_url=url, instance="sched-fcfs"), sched_bus)
            await scheduler.start()
            gateway = Gateway(settings, gw_bus, Admission(settings, ModelInfo.load(settings), tokenizer), tokenizer)
            await gateway.start()
            try:
                await until_listened(client_bus, subjects.GENERATE)
                await until_listened(client_bus, subjects.SUBMIT)
                with pytest.raises(GenerateError) as refused:
                    await Client(client_bus, keepalive_s=None).generate(GenerateRequest(input_ids=[5, 6], max_tokens=2, priority=-1,
                                                                                        timeout_ms=10_000))
                return refused.value
            finally:
                await gateway.drain()
                await scheduler.stop()

    error = run(go())
    assert error.code == "invalid_request", error
    assert "priority -1: priority scheduling is not enabled (scheduler.scheduling_policy is 'fcfs'" in error.message, error


def test_a_job_without_priority_still_decodes():
    class OldJob(msgspec.Struct, kw_only=True):  # Job before `priority`: a gateway of the version before
        request_id: str
        gateway: str
        input_ids: list[int]
        max_tokens: int
        sampling: SamplingSpec
        stop_token_ids: list[int]
        logprobs: bool
        deadline: float
        top_logprobs: int = 0
        ignore_eos: bool = False
        prompt_logprobs: int = -1
        cache_salt: str | None = None

    new = _job(0)
    old = OldJob(**{f: getattr(new, f) for f in OldJob.__struct_fields__})
    assert unpack(pack(old), Job) == new and new.priority == 0
