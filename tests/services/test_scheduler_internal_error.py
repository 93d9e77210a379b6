"""Scheduler faults reach the client as `internal` at once. The scheduler answers every submit:
an exception of its own while placing (a bug) is an `internal` error naming it (without that
answer the gateway would wait out its submit timeout, 10 s, and then report the scheduler gone);
and an answer the gateway cannot read is `internal` too. Real nats-server, scheduler and gateway;
faults injected by a subclass or a stand-in peer."""

from __future__ import annotations

import time
from pathlib import Path

from schemas import subjects
from schemas.api import ErrorReply
from schemas.internal import Job, SamplingSpec, SubmitAck, SubmitJob
from services.client import Client
from services.gateway.admission import Admission, ModelInfo
from services.gateway.service import Gateway
from services.scheduler.service import Scheduler
from shared.bus import connect, pack, unpack
from shared.model.tokenizer import Tokenizer
from shared.settings import GatewaySettings, SchedulerSettings

from services_helpers import run, until_listened


class BrokenScheduler(Scheduler):
    async def _try_place(self, job: Job):  # type: ignore[no-untyped-def]
        raise RuntimeError("placement bug")


def test_an_exception_while_placing_is_answered_internal_at_once(nats_server) -> None:  # type: ignore[no-untyped-def]
    port, _ = nats_server
    url = f"nats://127.0.0.1:{port}"
    job = Job(request_id="bug", gateway="gw", input_ids=[1, 2, 3], max_tokens=4,
              sampling=SamplingSpec(temperature=0.0, top_p=1.0, top_k=0, seed=None), stop_token_ids=[], logprobs=False,
              deadline=time.time() + 30)

    async def go() -> tuple[SubmitAck, float]:
        async with connect(url, "scheduler") as bus, connect(url, "client") as client:
            scheduler = BrokenScheduler(SchedulerSettings(nats_url=url, instance="sched-bug"), bus)
            await scheduler.start()
            try:
                await until_listened(client, subjects.SUBMIT)
                started = time.monotonic()
                msg = await client.nc.request(subjects.SUBMIT, pack(SubmitJob(job=job)), timeout=5)
                return unpack(msg.data, SubmitAck), time.monotonic() - started
            finally:
                await scheduler.stop()

    ack, elapsed = run(go())
    assert ack.placement is None and ack.error_code == "internal", ack
    assert "RuntimeError: placement bug" in ack.error_message, ack
    assert elapsed < 2.0


def test_a_scheduler_answer_the_gateway_cannot_read_is_internal(nats_server, tiny_model: Path, tokenizer: Tokenizer) -> None:  # type: ignore[no-untyped-def]
    """A scheduler of another version answers the submit with bytes that are no SubmitAck (a test
    stands in for it). Waiting or retrying will not help: the client hears `internal` naming the
    bad answer, not `unavailable` ("the scheduler did not answer")."""
    port, _ = nats_server
    url = f"nats://127.0.0.1:{port}"
    settings = GatewaySettings(model=str(tiny_model), model_name="tiny", nats_url=url, instance="gw-bad-ack")

    async def answer_badly(msg) -> None:  # type: ignore[no-untyped-def]
        await msg.respond(b"\xc1")

    async def go() -> ErrorReply | object:
        async with connect(url, "gateway") as bus, connect(url, "scheduler") as sched_bus, connect(url, "client") as client_bus:
            await sched_bus.subscribe(subjects.SUBMIT, answer_badly, queue=subjects.SCHEDULER_QUEUE)
            gateway = Gateway(settings, bus, Admission(settings, ModelInfo.load(settings), tokenizer), tokenizer)
            await gateway.start()
            try:
                await until_listened(client_bus, subjects.GENERATE)
                await until_listened(bus, subjects.SUBMIT)
                return await Client(client_bus, keepalive_s=None).send_raw(b'{"prompt": "hi", "request_id": "bad-ack", "max_tokens": 2}', timeout=10)
            finally:
                await gateway.drain()

    reply = run(go())
    assert isinstance(reply, ErrorReply) and reply.error.code == "internal", reply
    assert "could not be read" in reply.error.message, reply
