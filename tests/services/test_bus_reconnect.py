"""`Bus` against a real nats-server that restarts: the connection comes back by itself, and a
stream of replies that was due meanwhile fails with `Reconnected` at once instead of
waiting out its deadline (NATS delivers at most once: replies sent while the client was
disconnected are gone)."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.launch import start_nats_server
from services.ranks import free_port
from services_helpers import until, until_listened
from shared.bus import Deadline, PayloadTooLarge, Reconnected, Silent, connect
from shared.settings import NatsServerSettings


def test_a_stream_due_across_a_server_restart_fails_with_reconnected(nats_server, tmp_path):
    port, procs = nats_server
    url = f"nats://127.0.0.1:{port}"

    async def scenario() -> tuple[list[bytes], float, int, bytes]:
        async with connect(url, "responder") as responder, connect(url, "caller") as caller:

            async def answer_once(msg) -> None:  # type: ignore[no-untyped-def]
                await msg.respond(b"first")  # then nothing: the rest would have been lost

            await responder.subscribe("svc.work", answer_once)
            await until_listened(caller, "svc.work")  # the server routes the request to it
            got: list[bytes] = []
            stream = caller.stream("svc.work", b"go", lambda m: m.data == b"last", Deadline.after(60.0))
            got.append((await stream.__anext__()).data)
            procs[0].kill()
            procs[0].wait()
            procs.append(start_nats_server(port, NatsServerSettings(), tmp_path))
            restarted = time.monotonic()
            with pytest.raises(Reconnected):
                async for msg in stream:
                    got.append(msg.data)
            failed_after = time.monotonic() - restarted
            # The connection itself is back: a plain request round trip works again (once the
            # responder, which may reconnect after the caller, is back as well).
            await until(lambda: responder.reconnects == 1, "the responder reconnected")
            await responder.subscribe("svc.echo", lambda m: m.respond(m.data))
            await until_listened(caller, "svc.echo")
            echo = (await caller.nc.request("svc.echo", b"ping", timeout=5.0)).data
            return got, failed_after, caller.reconnects, echo

    got, failed_after, reconnects, echo = asyncio.run(scenario())
    assert got == [b"first"]
    assert reconnects == 1
    assert failed_after < 5.0  # the stream's deadline was 60 s
    assert echo == b"ping"


def test_a_stream_silent_because_the_server_is_gone_says_so(nats_server):
    """With the NATS server gone (moebus openai in front of a stack whose nats-server stopped), every
    request failed after its keepalive silence with 'the responder stopped answering': the
    gateway was blamed for this process's own lost connection."""
    port, procs = nats_server

    async def scenario() -> str:
        async with connect(f"nats://127.0.0.1:{port}", "caller") as caller:
            procs[0].kill()
            procs[0].wait()
            await until(lambda: not caller.nc.is_connected, "the connection noticed the server gone")
            with pytest.raises(Silent) as failed:
                async for _ in caller.stream("llm.generate", b"{}", lambda m: True, Deadline.after(30.0), silence_s=0.5):
                    pass
            return str(failed.value)

    assert asyncio.run(scenario()) == "no reply on llm.generate for 0.5s: this process's NATS connection is down (reconnecting)"


def test_a_message_above_max_payload_is_refused_with_a_typed_error_and_the_connection_stays(nats_server):
    """nats-server refuses messages above its max_payload (8 MiB as moebus starts it by default);
    the bus says so (PayloadTooLarge, a BusError), naming the limit the server announced, for
    streams, requests and publishes alike, and the connection keeps working."""
    port, _ = nats_server
    big = b"x" * (9 << 20)

    async def scenario() -> list[str]:
        async with connect(f"nats://127.0.0.1:{port}", "echo") as echo, connect(f"nats://127.0.0.1:{port}", "caller") as caller:
            await echo.subscribe("echo", lambda msg: msg.respond(msg.data))
            await until_listened(caller, "echo")
            errors = []
            with pytest.raises(PayloadTooLarge) as streamed:
                async for _ in caller.stream("echo", big, lambda m: True, Deadline.after(5)):
                    pass
            errors.append(str(streamed.value))
            with pytest.raises(PayloadTooLarge) as published:
                await caller.publish("echo", big)
            errors.append(str(published.value))
            replies = [m.data async for m in caller.stream("echo", b"small", lambda m: True, Deadline.after(5))]
            assert replies == [b"small"]
            return errors

    errors = asyncio.run(scenario())
    assert all(f"{9 << 20} bytes on echo exceeds the NATS server's max_payload of {8 << 20} bytes" in e for e in errors), errors


def test_a_server_started_with_a_raised_max_payload_carries_larger_messages(tmp_path):
    """``max_payload`` reaches nats-server through its config file: at 16 MiB a 9 MiB request and
    its 9 MiB reply go through, the client reads the limit from the server, and above it the
    typed error names 16 MiB."""
    port = free_port()
    server = start_nats_server(port, NatsServerSettings(max_payload=16 << 20), tmp_path)
    url = f"nats://127.0.0.1:{port}"

    async def scenario() -> tuple[int, list[bytes], str]:
        async with connect(url, "echo") as echo, connect(url, "caller") as caller:
            await echo.subscribe("echo", lambda msg: msg.respond(msg.data))
            await until_listened(caller, "echo")
            replies = [m.data async for m in caller.stream("echo", b"y" * (9 << 20), lambda m: True, Deadline.after(30))]
            with pytest.raises(PayloadTooLarge) as refused:
                await caller.publish("echo", b"z" * (17 << 20))
            return caller.nc.max_payload, replies, str(refused.value)

    try:
        limit, replies, refused = asyncio.run(scenario())
    finally:
        server.kill()
        server.wait()
    assert limit == 16 << 20 and replies == [b"y" * (9 << 20)]
    assert f"exceeds the NATS server's max_payload of {16 << 20} bytes" in refused
