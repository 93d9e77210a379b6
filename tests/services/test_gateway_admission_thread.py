"""The gateway admits requests on a worker thread (tokenizing a long prompt takes up to ~0.5 s):
meanwhile it keeps answering, and a cancel, a duplicate id or a shutdown that arrives while a
request is still being admitted is not lost. Real nats-server and gateway; the admission of one
request id waits on a gate the test opens, so every ordering below is forced, not timed."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path

from schemas import subjects
from schemas.api import ErrorReply, GenerateRequest
from services.client import Client
from services.gateway.admission import Admission, Admitted, ModelInfo
from services.gateway.service import Gateway
from shared.bus import connect
from shared.model.tokenizer import Tokenizer
from shared.settings import GatewaySettings

from services_helpers import until_listened

GATED = "gated"


class GatedAdmission(Admission):
    """Admission that holds request ``GATED`` on its worker thread until ``gate`` is set."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def admit(self, req: GenerateRequest, gateway_id: str, arrival: float | None = None) -> Admitted:
        if req.request_id == GATED and not self.gate.wait(timeout=30):
            raise TimeoutError("the test never opened the gate")
        return super().admit(req, gateway_id, arrival)


async def _until(condition, what: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


@contextlib.asynccontextmanager
async def _gated_request(nats_server, tiny_model: Path, tokenizer: Tokenizer, instance: str, drain_timeout_s: float = 10.0):  # type: ignore[no-untyped-def]
    """A real gateway whose admission of request ``GATED``, sent at once, is held on its worker thread:
    yields (gateway, its admission, a client, the task awaiting ``GATED``'s reply)."""
    port, _ = nats_server
    url = f"nats://127.0.0.1:{port}"
    settings = GatewaySettings(model=str(tiny_model), model_name="tiny", nats_url=url, instance=instance, drain_timeout_s=drain_timeout_s)
    admission = GatedAdmission(settings, ModelInfo.load(settings), tokenizer)
    async with connect(url, "gateway") as bus, connect(url, "client") as client_bus:
        gateway = Gateway(settings, bus, admission, tokenizer)
        await gateway.start()
        await until_listened(client_bus, subjects.GENERATE)
        client = Client(client_bus, keepalive_s=None)
        gated = asyncio.create_task(client.send_raw(b'{"prompt": "hi", "request_id": "gated"}', timeout=20))
        await _until(lambda: GATED in gateway.admitting, "the gated request is in admission")
        yield gateway, admission, client, gated


def test_a_cancel_during_admission_is_answered_and_the_gateway_keeps_answering(nats_server, tiny_model: Path, tokenizer: Tokenizer):
    async def go():  # type: ignore[no-untyped-def]
        async with _gated_request(nats_server, tiny_model, tokenizer, "gw-thread") as (gateway, admission, client, gated):
            # While its admission thread waits, the gateway's loop still serves others.
            models = await client.models(timeout=5)
            other = await client.send_raw(b'{"prompt": "hi", "request_id": "other", "max_tokens": 0}')
            duplicate = await client.send_raw(b'{"prompt": "hi", "request_id": "gated"}')
            await client.cancel(GATED, "changed my mind")
            await _until(lambda: gateway.admitting.get(GATED) is not None, "the cancel reached the request in admission")
            admission.gate.set()
            reply = await gated
            in_flight = len(gateway.flights) + len(gateway.admitting)
            await gateway.drain()
            return models, other, duplicate, reply, in_flight

    models, other, duplicate, reply, in_flight = asyncio.run(go())
    assert [m.id for m in models.models] == ["tiny"]
    assert isinstance(other, ErrorReply) and other.error.code == "invalid_request" and "max_tokens" in other.error.message
    assert isinstance(duplicate, ErrorReply) and duplicate.error.code == "invalid_request" and "already in flight" in duplicate.error.message
    assert isinstance(reply, ErrorReply) and reply.error.code == "cancelled" and reply.request_id == GATED, reply
    assert "changed my mind" in reply.error.message
    assert in_flight == 0


def test_a_shutdown_during_admission_answers_unavailable(nats_server, tiny_model: Path, tokenizer: Tokenizer):
    async def go():  # type: ignore[no-untyped-def]
        async with _gated_request(nats_server, tiny_model, tokenizer, "gw-thread-drain", drain_timeout_s=0.2) as (gateway, admission, _, gated):
            draining = asyncio.create_task(gateway.drain())
            await _until(lambda: gateway.admitting.get(GATED) is not None, "the shutdown reached the request in admission")
            admission.gate.set()
            reply = await gated
            await asyncio.wait_for(draining, 10)
            return reply, len(gateway.flights) + len(gateway.admitting)

    reply, in_flight = asyncio.run(go())
    assert isinstance(reply, ErrorReply) and reply.error.code == "unavailable" and "shut down" in reply.error.message, reply
    assert in_flight == 0
