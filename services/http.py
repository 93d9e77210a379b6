"""Just enough HTTP/1.1 for the stack's small HTTP faces (`moebus metrics`, `moebus openai`).

One request per connection: the server reads a request line, headers and a body of
``Content-Length`` bytes (or a chunked one), answers, and closes the connection
(``Connection: close``), which every HTTP client handles. A streamed answer (server-sent events) has no length: it ends
when the connection closes. Malformed or oversize requests raise `HttpError` with the
status to answer (413 for a body over the frontend's limit, before reading it); after
answering one, `linger` lets the client finish sending. Nothing here knows about routes.
The frontends' shared command line (``--url``, ``--host``, ``--port``) and life cycle
(listen, print the address, serve until SIGTERM/SIGINT, say "stopped") are here too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import string
import sys
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from services.common import freeze_startup_heap, stop_event
from shared.bus import Unreachable

MAX_HEADER_BYTES = 64 << 10
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
# A refused request's unread input is discarded until the client closes, pauses this long, or
# this much time passed in all (nginx's lingering close, with its default times).
LINGER_PAUSE_S = 5.0
LINGER_TOTAL_S = 30.0

REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout",
           409: "Conflict", 411: "Length Required", 413: "Payload Too Large", 500: "Internal Server Error", 501: "Not Implemented",
           503: "Service Unavailable", 504: "Gateway Timeout"}


class HttpError(Exception):
    """A request the server answers with ``status`` and ``message`` instead of handling it (and
    ``headers``, e.g. the ``Allow`` header a 405 must carry, RFC 9110 15.5.6)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


@dataclass
class Request:
    method: str
    path: str  # without the query string
    headers: dict[str, str]  # names lower-cased
    body: bytes


async def read_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_body: int,
                       limit: str = "this server's limit") -> Request:
    """The next request on ``reader``; `HttpError` for a malformed, slow or oversize one (a body
    over ``max_body``: 413 naming ``limit``). A client that waits for ``100 Continue`` before its
    body (``Expect: 100-continue``, curl for larger bodies) gets it once the announced length is accepted."""
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEADER_TIMEOUT_S)
    except asyncio.LimitOverrunError:
        raise HttpError(413, "request headers too large") from None
    except asyncio.IncompleteReadError:
        raise HttpError(400, "connection closed before the request's headers ended") from None
    except TimeoutError:
        raise HttpError(408, f"no complete request headers within {HEADER_TIMEOUT_S:g} s") from None
    if len(head) > MAX_HEADER_BYTES:
        raise HttpError(413, "request headers too large")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise HttpError(400, f"malformed request line {lines[0][:100]!r}")
    headers = {}
    for line in lines[1:]:
        if line:
            name, sep, value = line.partition(":")
            if not sep:
                raise HttpError(400, f"malformed header line {line[:100]!r}")
            headers[name.strip().lower()] = value.strip()
    body = b""
    chunked = "chunked" in headers.get("transfer-encoding", "").lower()  # it overrides Content-Length (RFC 9112 6.3)
    if chunked or parts[0] in ("POST", "PUT", "PATCH"):
        length = None if chunked else _content_length(headers)
        if length is not None and length > max_body:
            raise HttpError(413, _too_large(length, max_body, limit))
        if headers.get("expect", "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
        read = reader.readexactly(length) if length is not None else _chunked_body(reader, max_body, limit)
        try:
            body = await asyncio.wait_for(read, BODY_TIMEOUT_S)
        except asyncio.IncompleteReadError:
            raise HttpError(400, "connection closed before the request body ended") from None
        except asyncio.LimitOverrunError:
            raise HttpError(400, "malformed chunked body: a chunk size line without its CRLF") from None
        except TimeoutError:
            raise HttpError(408, f"request body not received within {BODY_TIMEOUT_S:g} s") from None
    return Request(parts[0], parts[1].split("?", 1)[0], headers, body)


def _content_length(headers: dict[str, str]) -> int:
    length_text = headers.get("content-length")
    if length_text is None:
        raise HttpError(411, "a request body needs Content-Length (or Transfer-Encoding: chunked)")
    if not (length_text.isascii() and length_text.isdigit()):  # isdigit alone takes '²', which int() refuses
        raise HttpError(400, f"bad Content-Length {length_text[:40]!r}")
    return int(length_text)


def _too_large(length: int, max_body: int, limit: str, at_least: bool = False) -> str:
    """``at_least``: ``length`` counts a chunked body only up to the chunk that crossed the limit."""
    mib = f" ({max_body / (1 << 20):g} MiB)" if max_body >= 1 << 20 else ""
    return f"request body of {'at least ' if at_least else ''}{length} bytes exceeds {limit} of {max_body} bytes{mib}"


async def _chunked_body(reader: asyncio.StreamReader, max_body: int, limit: str) -> bytes:
    """A ``Transfer-Encoding: chunked`` body (what a client or proxy streaming its upload sends:
    uvicorn, hence vLLM, takes it): hex-sized chunks up to a zero one, then optional trailers
    (dropped). Past ``max_body`` bytes it is a 413, the body left unread."""
    body = bytearray()
    while True:
        size_text = (await reader.readuntil(b"\r\n"))[:-2].split(b";", 1)[0].strip().decode("latin-1")  # a chunk extension after ";" is ignored
        # A size past 16 hex digits (leading zeros aside) is no real chunk, and its 413 message would
        # spell it in decimal, past Python's limit on the digits of an int's string.
        if not size_text or len(size_text.lstrip("0")) > 16 or size_text.strip(string.hexdigits):
            raise HttpError(400, f"malformed chunk size {size_text[:40]!r}")
        size = int(size_text, 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailer fields, then the empty line
                pass
            return bytes(body)
        if len(body) + size > max_body:
            raise HttpError(413, _too_large(len(body) + size, max_body, limit, at_least=True))
        body += await reader.readexactly(size)
        if await reader.readexactly(2) != b"\r\n":
            raise HttpError(400, "malformed chunked body: a chunk does not end with CRLF")


async def linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """After answering a refused request: say no more is coming, then read and drop what the
    client still sends (see ``LINGER_*``). Its body may be unread (a 413 is answered before it):
    a connection closed with unread input is reset, and a client still sending its body (one
    that does not wait for ``100 Continue``: Python's http.client, httpx and so the openai SDK)
    would get the reset instead of the answer."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LINGER_TOTAL_S
    with contextlib.suppress(ConnectionError, TimeoutError):
        writer.write_eof()
        while (left := deadline - loop.time()) > 0 and await asyncio.wait_for(reader.read(1 << 16), min(LINGER_PAUSE_S, left)):
            pass


def _header_lines(headers: dict[str, str] | None) -> str:
    return "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())


async def respond(writer: asyncio.StreamWriter, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
    """A complete response with its length (and ``headers``, whose values hold no line breaks)."""
    head = (f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n{_header_lines(headers)}Connection: close\r\n\r\n")
    writer.write(head.encode() + body)
    await writer.drain()


async def respond_json(writer: asyncio.StreamWriter, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
    await respond(writer, status, json.dumps(payload).encode(), "application/json", headers)


async def start_events(writer: asyncio.StreamWriter, headers: dict[str, str] | None = None) -> None:
    """The head of a server-sent-events stream; `send_event` writes its events."""
    writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n{_header_lines(headers)}"
                 "Connection: close\r\n\r\n".encode())
    await writer.drain()


async def send_event(writer: asyncio.StreamWriter, data: str) -> None:
    """One ``data:`` event (``data`` holds no newline: JSON or a marker such as ``[DONE]``)."""
    writer.write(f"data: {data}\n\n".encode())
    await writer.drain()


async def close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def frontend_arguments(ap: argparse.ArgumentParser, default_port: int) -> None:
    """``--url``, ``--host`` and ``--port`` of a frontend (`parse_frontend` checks the port)."""
    ap.add_argument("--url", default=os.environ.get("MOEBUS_NATS_URL", "nats://127.0.0.1:4222"),
                    help="NATS URL (printed by `moebus up`; default $MOEBUS_NATS_URL, else the local default)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    ap.add_argument("--port", type=int, default=default_port, help="TCP port (0: any free one, printed at start)")


def parse_frontend(ap: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    a = ap.parse_args(argv)
    if not 0 <= a.port <= 65535:
        ap.error(f"--port must be in [0, 65535], got {a.port}")
    return a


async def listen(name: str, handler: Handler, host: str, port: int, path: str, url: str) -> None:
    """Serve ``handler`` on ``host:port`` until SIGTERM / SIGINT; print the address first
    (`moebus up` and tests read it from there)."""
    stop = stop_event()
    freeze_startup_heap()
    server = await asyncio.start_server(handler, host, port)
    async with server:
        bound = server.sockets[0].getsockname()
        print(f"moebus {name}: serving http://{bound[0]}:{bound[1]}{path} for the stack on {url}", flush=True)
        await stop.wait()


def run_frontend(name: str, serve: Coroutine[Any, Any, None], host: str, port: int) -> int:
    """Run a frontend's ``serve`` to its end: 0 after a clean stop, 1 (with the reason on stderr)
    when NATS does not answer or the port cannot be bound."""
    try:
        asyncio.run(serve)
    except Unreachable as e:
        print(f"moebus {name}: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # the port is taken or not ours to bind
        print(f"moebus {name}: cannot listen on {host}:{port}: {e}", file=sys.stderr)
        return 1
    print(f"moebus {name}: stopped", flush=True)
    return 0
