"""The gateway admits requests on a worker thread (tokenizing a long prompt takes up to ~0.5 s):
meanwhile it keeps answering, and a cancel, a duplicate id or a shutdown that arrives while a
request is still being admitted is not lost. Real nats-server and gateway; the admission of one
request id waits on a gate the test opens, so every ordering below is forced, not timed. A short
prompt is admitted on the event loop (the thread's round trip costs more than its tokenizing)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from pathlib import Path

from schemas import subjects
from schemas.api import ErrorReply, GenerateRequest
from services.client import Client
from services.gateway.admission import INLINE_ADMISSION_MAX, Admission, Admitted, ModelInfo
from services.gateway.service import Gateway
from shared.bus import connect
from shared.model.tokenizer import Tokenizer
from shared.settings import GatewaySettings

from services_helpers import until, until_listened

GATED = "gated"
LONG_PROMPT = "hi " * (INLINE_ADMISSION_MAX // 3 + 1)  # admitted on the worker thread


class GatedAdmission(Admission):
    """Admission that holds request ``GATED`` on its worker thread until ``gate`` is set."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def admit(self, req: GenerateRequest, gateway_id: str, arrival: float | None = None) -> Admitted:
        if req.request_id == GATED and not self.gate.wait(timeout=30):
            raise TimeoutError("the test never opened the gate")
        return super().admit(req, gateway_id, arrival)


@contextlib.asynccontextmanager
async def _gated_request(nats_server, tiny_model: Path, tokenizer: Tokenizer, instance: str, drain_timeout_s: float = 10.0,  # type: ignore[no-untyped-def]
                         keepalive_s: float | None = None):
    """A real gateway whose admission of request ``GATED``, sent at once, is held on its worker thread:
    yields (gateway, its admission, a client, the task awaiting ``GATED``'s reply: a plain NATS request,
    or with ``keepalive_s`` a `Client` asking for keepalives that often, whose `generate` it awaits)."""
    port, _ = nats_server
    url = f"nats://127.0.0.1:{port}"
    settings = GatewaySettings(model=str(tiny_model), model_name="tiny", nats_url=url, instance=instance, drain_timeout_s=drain_timeout_s)
    admission = GatedAdmission(settings, ModelInfo.load(settings), tokenizer)
    async with connect(url, "gateway") as bus, connect(url, "client") as client_bus:
        gateway = Gateway(settings, bus, admission, tokenizer)
        await gateway.start()
        await until_listened(client_bus, subjects.GENERATE)
        client = Client(client_bus, keepalive_s=None)
        if keepalive_s is None:
            gated = asyncio.create_task(client.send_raw(json.dumps({"prompt": LONG_PROMPT, "request_id": GATED}).encode(), timeout=20))
        else:
            keeping = Client(client_bus, timeout=None, keepalive_s=keepalive_s)
            gated = asyncio.create_task(keeping.generate(GenerateRequest(prompt=LONG_PROMPT, request_id=GATED)))
        await until(lambda: GATED in gateway.admitting, "the gated request is in admission")
        yield gateway, admission, client, gated


def test_a_cancel_during_admission_is_answered_and_the_gateway_keeps_answering(nats_server, tiny_model: Path, tokenizer: Tokenizer):
    async def go():  # type: ignore[no-untyped-def]
        async with _gated_request(nats_server, tiny_model, tokenizer, "gw-thread") as (gateway, admission, client, gated):
            # While its admission thread waits, the gateway's loop still serves others.
            models = await client.models(timeout=5)
            other = await client.send_raw(b'{"prompt": "hi", "request_id": "other", "max_tokens": 0}')
            duplicate = await client.send_raw(b'{"prompt": "hi", "request_id": "gated"}')
            await client.cancel(GATED, "changed my mind")
            await until(lambda: gateway.admitting.get(GATED) is not None, "the cancel reached the request in admission")
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
            await until(lambda: gateway.admitting.get(GATED) is not None, "the shutdown reached the request in admission")
            admission.gate.set()
            reply = await gated
            await asyncio.wait_for(draining, 10)
            return reply, len(gateway.flights) + len(gateway.admitting)

    reply, in_flight = asyncio.run(go())
    assert isinstance(reply, ErrorReply) and reply.error.code == "unavailable" and "shut down" in reply.error.message, reply
    assert in_flight == 0


def test_a_request_in_admission_gets_keepalives_and_is_dropped_once_its_client_left(nats_server, tiny_model: Path, tokenizer: Tokenizer):
    """A client that asks for keepalives hears them from the moment its request is taken, admission
    included: they started only once admission ended, so a prompt whose tokenizing outlasted three
    intervals (one near the 8 MiB body limit took 4-7 s on the 2-core CPU host) was given up as
    `unavailable` by the OpenAI frontend's client (2 s keepalives) while the gateway was about to
    refuse it (400). And a client that leaves meanwhile is noticed then, as when its request runs."""
    async def go():  # type: ignore[no-untyped-def]
        async with _gated_request(nats_server, tiny_model, tokenizer, "gw-thread-keepalive", keepalive_s=0.2) as (gateway, admission, _, gated):
            try:
                await asyncio.sleep(2.0)  # ten intervals in admission; without keepalives the client gives up after three
                assert not gated.done(), f"the client gave up during admission: {gated.exception()!r}"
                gated.cancel()  # the client leaves: nothing listens on its reply subject any more
                with contextlib.suppress(asyncio.CancelledError):
                    await gated
                await until(lambda: gateway.admitting.get(GATED) is not None, "the gateway saw the client leave during admission")
                left = gateway.admitting[GATED]
            finally:
                admission.gate.set()
            await gateway.drain()
            return left, len(gateway.flights) + len(gateway.admitting)

    left, in_flight = asyncio.run(go())
    assert left is not None and left.code == "cancelled" and "the client went away" in left.message, left
    assert in_flight == 0


class ThreadRecordingAdmission(Admission):
    """Admission that records on which thread it ran, by request id."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.threads: dict[str, int] = {}

    def admit(self, req: GenerateRequest, gateway_id: str, arrival: float | None = None) -> Admitted:
        self.threads[req.request_id or ""] = threading.get_ident()
        return super().admit(req, gateway_id, arrival)


def test_a_short_prompt_is_admitted_on_the_event_loop_a_long_one_and_chat_on_a_worker_thread(nats_server, tiny_model: Path, tokenizer: Tokenizer):
    port, _ = nats_server
    url = f"nats://127.0.0.1:{port}"
    settings = GatewaySettings(model=str(tiny_model), model_name="tiny", nats_url=url, instance="gw-inline")
    admission = ThreadRecordingAdmission(settings, ModelInfo.load(settings), tokenizer)
    requests = {
        "short": {"prompt": "hi" * (INLINE_ADMISSION_MAX // 2)},  # at the bound
        "ids": {"input_ids": [1, 2, 3]},
        "long": {"prompt": "h" * (INLINE_ADMISSION_MAX + 1)},
        "chat": {"messages": [{"role": "user", "content": "hi"}]},
    }

    async def go():  # type: ignore[no-untyped-def]
        async with connect(url, "gateway") as bus, connect(url, "client") as client_bus:
            gateway = Gateway(settings, bus, admission, tokenizer)
            await gateway.start()
            await until_listened(client_bus, subjects.GENERATE)
            client = Client(client_bus, keepalive_s=None)
            # No scheduler runs: each admitted request is then refused `unavailable`.
            replies = {rid: await client.send_raw(json.dumps({**body, "request_id": rid}).encode()) for rid, body in requests.items()}
            await gateway.drain()
            return replies

    loop_thread = threading.get_ident()  # asyncio.run runs the gateway's loop on this thread
    replies = asyncio.run(go())
    for rid, reply in replies.items():
        assert isinstance(reply, ErrorReply) and reply.error.code == "unavailable", (rid, reply)
    on_loop = {rid: admission.threads[rid] == loop_thread for rid in requests}
    assert on_loop == {"short": True, "ids": True, "long": False, "chat": False}
