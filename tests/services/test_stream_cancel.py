"""A task reading a reply stream (`Client.stream` over `Bus.stream`), or waiting for one reply
(`Bus.nats_request`, under `Bus.request` and `Client.models`), stops when it is cancelled, also
when a reply arrives in the same turn of the event loop as the cancel. nats-py's `next_msg`, which
`Bus.stream` used, waits with `asyncio.wait_for`; on Python 3.11 that returns such a reply and drops
the cancel, so the reader went on to the stream's end: the OpenAI frontend, cancelling the stream of
a client that hung up, waited for the whole answer before it told the stack (seen under load: the
hung-up request of test_openai generated all its 3000 tokens). Against a real nats-server and a
stand-in gateway that streams as fast as it can, where nearly every cancel meets a reply."""

from __future__ import annotations

import asyncio
import random

from schemas import subjects
from schemas.api import GenerateChunk, GenerateRequest
from services.client import Client
from services_helpers import until_listened
from shared.bus import Bus, connect, decode_public, encode_public

CHUNKS = 20_000  # far more than a reader gets through before its cancel: only a reader that missed it reads on
TRIALS = 40


def test_a_cancelled_stream_reader_stops_even_when_a_reply_arrives_with_the_cancel(nats_server):
    port, _ = nats_server
    url = f"nats://127.0.0.1:{port}"

    async def scenario() -> list[int]:
        async with connect(url, "gateway") as gateway, connect(url, "client") as bus:
            ended: set[str] = set()  # requests whose stand-in stream stops

            async def serve(msg) -> None:  # type: ignore[no-untyped-def]
                if not msg.data:  # until_listened's probe
                    return
                req = decode_public(msg.data, GenerateRequest)
                for i in range(CHUNKS):
                    if req.request_id in ended:
                        return
                    chunk = GenerateChunk(request_id=req.request_id, index=i, text="x", token_ids=[i])
                    await gateway.nc.publish(msg.reply, encode_public(chunk))
                    if i % 64 == 0:
                        await asyncio.sleep(0)

            await gateway.subscribe(subjects.GENERATE, serve)
            await until_listened(bus, subjects.GENERATE)
            client = Client(bus, keepalive_s=None)
            rng = random.Random(7)
            missed = []
            for trial in range(TRIALS):
                request_id = f"r{trial}"

                async def read() -> None:
                    async for _ in client.stream(GenerateRequest(prompt="x", request_id=request_id)):  # noqa: B023 - awaited below
                        pass

                reader = asyncio.ensure_future(read())
                await asyncio.sleep(rng.uniform(0.005, 0.05))  # replies are streaming by now
                reader.cancel()
                done, _ = await asyncio.wait({reader}, timeout=2.0)
                ended.add(request_id)
                if not done:
                    missed.append(trial)
                    reader.cancel()
                    await asyncio.wait({reader}, timeout=5.0)
            return missed

    missed = asyncio.run(scenario())
    assert missed == [], f"cancelled readers that read on: trials {missed} of {TRIALS}"


def test_a_cancelled_requester_stops_even_when_the_reply_arrives_with_the_cancel(nats_server):
    """A task that asks again and again (a poll loop) and is cancelled: nats-py's request() waits with
    asyncio.wait_for too, and a cancel that met a reply was dropped, so the loop went on forever."""
    port, _ = nats_server
    url = f"nats://127.0.0.1:{port}"

    async def scenario() -> list[int]:
        async with connect(url, "responder") as responder, connect(url, "caller") as bus:
            async def echo(msg) -> None:  # type: ignore[no-untyped-def]
                await msg.respond(b"pong")

            await responder.subscribe("test.echo", echo)
            await until_listened(bus, "test.echo")
            rng = random.Random(11)
            missed = []
            for trial in range(TRIALS):
                async def poll(caller: Bus) -> None:
                    while True:
                        await caller.nats_request("test.echo", b"ping", 5.0)

                poller = asyncio.ensure_future(poll(bus))
                await asyncio.sleep(rng.uniform(0.005, 0.05))
                poller.cancel()
                done, _ = await asyncio.wait({poller}, timeout=2.0)
                if not done:
                    missed.append(trial)
                    while not poller.done():
                        poller.cancel()
                        await asyncio.wait({poller}, timeout=0.5)
            return missed

    missed = asyncio.run(scenario())
    assert missed == [], f"cancelled pollers that went on asking: trials {missed} of {TRIALS}"
