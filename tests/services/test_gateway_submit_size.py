"""A request whose job is over the NATS server's max_payload cannot reach the scheduler: the client
gets `invalid_request` naming the limit at once (it got `unavailable`, "the scheduler did not
answer", as for a scheduler that is down). Real nats-server with max_payload 8 KiB, so that a
3000-token prompt's job (msgpack, ~3 bytes an id) is over it while the request's JSON text is
not; a real gateway on the tiny checkpoint's tokenizer; no scheduler is needed, as the job is
refused before it is sent."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from schemas import subjects
from schemas.api import GenerateRequest
from services.client import Client, GenerateError
from services.gateway.admission import Admission, ModelInfo
from services.gateway.service import Gateway
from services.launch import spawn_nats_server
from services.ranks import free_port
from shared.bus import connect
from shared.model.tokenizer import Tokenizer
from shared.settings import GatewaySettings

from services_helpers import until_listened

MAX_PAYLOAD = 8192


def test_a_job_over_the_bus_payload_limit_is_an_invalid_request(tmp_path: Path, tiny_model: Path, tokenizer: Tokenizer):
    config = tmp_path / "nats.conf"
    config.write_text(f"max_payload: {MAX_PAYLOAD}\n")
    port = free_port()
    server = spawn_nats_server(port, config, tmp_path / "nats-server.log")  # below what NatsServerSettings allows
    url = f"nats://127.0.0.1:{port}"
    settings = GatewaySettings(model=str(tiny_model), model_name="tiny", nats_url=url, instance="gw-size")
    prompt = "a" + " a" * 2999  # 3000 tokens, " a" is id 264: 3 bytes of msgpack each, 2 bytes of text

    async def go():  # type: ignore[no-untyped-def]
        async with connect(url, "gateway") as bus, connect(url, "client") as client_bus:
            gateway = Gateway(settings, bus, Admission(settings, ModelInfo.load(settings), tokenizer), tokenizer)
            await gateway.start()
            await until_listened(client_bus, subjects.GENERATE)
            started = time.monotonic()
            try:
                await Client(client_bus, keepalive_s=None).generate(GenerateRequest(prompt=prompt, max_tokens=4, timeout_ms=30_000))
            except GenerateError as e:
                return e, time.monotonic() - started, len(tokenizer.encode(prompt))
            finally:
                await gateway.drain()
            raise AssertionError("the request was answered")

    try:
        error, elapsed, prompt_tokens = asyncio.run(go())
    finally:
        server.kill()
        server.wait()
    assert len(prompt) < MAX_PAYLOAD < 3 * (prompt_tokens - 1), prompt_tokens
    assert error.code == "invalid_request" and "too large for the bus" in error.message and str(MAX_PAYLOAD) in error.message, error
    assert elapsed < 2.0
