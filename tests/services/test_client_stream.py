"""`Client.stream` against a real nats-server and a stand-in gateway that drops a chunk: NATS
delivers at most once (a slow consumer's messages are dropped), so the client checks the
chunk indices and fails the request with `unavailable` — and cancels it at the gateway —
instead of yielding a completion with text silently missing."""

from __future__ import annotations

import asyncio

import pytest

from schemas import subjects
from schemas.api import CancelRequest, GenerateChunk, GenerateRequest, Keepalive, Usage
from services.client import Client, GenerateError
from services_helpers import until_listened
from shared.bus import connect, decode_public, encode_public


def test_a_lost_chunk_fails_the_stream_and_cancels_the_request(nats_server):
    port, _ = nats_server
    url = f"nats://127.0.0.1:{port}"

    async def scenario() -> tuple[list[str], GenerateError, CancelRequest, list[str]]:
        async with connect(url, "gateway") as gateway, connect(url, "client") as bus:
            cancels: asyncio.Queue[CancelRequest] = asyncio.Queue()

            async def serve(msg) -> None:  # type: ignore[no-untyped-def]
                req = decode_public(msg.data, GenerateRequest)
                indices = [0, 1, 2] if req.request_id == "whole" else [0, 2]  # "gappy" loses chunk 1
                for i in indices:
                    last = i == 2
                    chunk = GenerateChunk(request_id=req.request_id, index=i, text=f"<{i}>", token_ids=[i],
                                          finish_reason="length" if last else None, usage=Usage(1, 3) if last else None)
                    await msg.respond(encode_public(chunk))

            async def on_cancel(msg) -> None:  # type: ignore[no-untyped-def]
                cancels.put_nowait(decode_public(msg.data, CancelRequest))

            await gateway.subscribe(subjects.CANCEL, on_cancel)
            await gateway.subscribe(subjects.GENERATE, serve)
            await until_listened(bus, subjects.GENERATE)  # (the cancel subscription went first on the same connection)
            client = Client(bus, keepalive_s=None)
            whole = [c.text async for c in client.stream(GenerateRequest(prompt="x", request_id="whole"))]
            got: list[str] = []
            with pytest.raises(GenerateError) as lost:
                async for c in client.stream(GenerateRequest(prompt="x", request_id="gappy")):
                    got.append(c.text)
            cancel = await asyncio.wait_for(cancels.get(), 5.0)
            return whole, lost.value, cancel, got

    whole, error, cancel, got = asyncio.run(scenario())
    assert whole == ["<0>", "<1>", "<2>"]
    assert got == ["<0>"]
    assert error.code == "unavailable" and "chunk 1 was lost" in error.message and error.request_id == "gappy"
    assert cancel.request_id == "gappy"


def test_a_client_without_a_deadline_of_its_own_waits_out_a_long_answer_while_keepalives_come(nats_server):
    """The OpenAI frontend's client (`timeout=None`) sets no deadline of its own: a gateway that keeps
    sending keepalives for longer than a bounded client would wait still gets its answer through (the
    gateway's deadline is the one that ends a request); a bounded client's own deadline is `timeout`,
    not `unavailable`; and a client with neither a deadline nor keepalives is refused."""
    port, _ = nats_server
    url = f"nats://127.0.0.1:{port}"

    async def scenario() -> tuple[list[str], GenerateError]:
        async with connect(url, "gateway") as gateway, connect(url, "client") as bus:
            async def serve(msg) -> None:  # type: ignore[no-untyped-def]
                req = decode_public(msg.data, GenerateRequest)
                for _ in range(6):  # 1.2 s of keepalives before the answer
                    await msg.respond(encode_public(Keepalive(request_id=req.request_id)))
                    await asyncio.sleep(0.2)
                await msg.respond(encode_public(GenerateChunk(request_id=req.request_id, index=0, text="done", token_ids=[1],
                                                              finish_reason="length", usage=Usage(1, 1))))

            await gateway.subscribe(subjects.GENERATE, serve)
            await until_listened(bus, subjects.GENERATE)
            patient = [c.text async for c in Client(bus, timeout=None, keepalive_s=0.5).stream(GenerateRequest(prompt="x", request_id="patient"))]
            with pytest.raises(GenerateError) as bounded:
                async for _ in Client(bus, timeout=0.6, keepalive_s=0.5).stream(GenerateRequest(prompt="x", request_id="bounded")):
                    pass
            return patient, bounded.value

    patient, bounded = asyncio.run(scenario())
    assert patient == ["done"]
    assert bounded.code == "timeout" and "deadline" in bounded.message
    with pytest.raises(ValueError, match="needs keepalives"):
        Client(None, timeout=None, keepalive_s=None)  # type: ignore[arg-type]
