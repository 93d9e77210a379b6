"""A bug in the gateway's admission (an exception that is not a typed refusal) still answers
the client: an ``internal`` error naming it, on a real nats-server, and the gateway keeps
nothing in flight and goes on answering. The bug is injected (an admission that raises for one
request id): no real input reaches that path unless admission itself is wrong."""

from __future__ import annotations

import asyncio
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


class BuggyAdmission(Admission):
    def admit(self, req: GenerateRequest, gateway_id: str, arrival: float | None = None) -> Admitted:
        if req.request_id == "boom":
            raise KeyError("a bug in admission")
        return super().admit(req, gateway_id, arrival)


def test_an_admission_bug_is_answered_internal_and_nothing_stays_in_flight(nats_server, tiny_model: Path, tokenizer: Tokenizer):
    port, _ = nats_server
    url = f"nats://127.0.0.1:{port}"
    settings = GatewaySettings(model=str(tiny_model), model_name="tiny", nats_url=url, instance="gw-bug")

    async def go() -> tuple[ErrorReply, ErrorReply, int]:
        async with connect(url, "gateway") as bus, connect(url, "client") as client_bus:
            gateway = Gateway(settings, bus, BuggyAdmission(settings, ModelInfo.load(settings), tokenizer), tokenizer)
            await gateway.start()
            await until_listened(client_bus, subjects.GENERATE)
            client = Client(client_bus, keepalive_s=None)
            bug = await client.send_raw(b'{"prompt": "hi", "request_id": "boom"}')
            refused = await client.send_raw(b'{"prompt": "hi", "request_id": "fine", "max_tokens": 0}')  # still answering, typed
            in_flight = len(gateway.flights)
            await gateway.drain()
            return bug, refused, in_flight

    bug, refused, in_flight = asyncio.run(go())
    assert isinstance(bug, ErrorReply) and bug.error.code == "internal" and bug.request_id == "boom"
    assert "admission failed: KeyError" in bug.error.message and "a bug in admission" in bug.error.message
    assert isinstance(refused, ErrorReply) and refused.error.code == "invalid_request" and "max_tokens" in refused.error.message
    assert in_flight == 0
