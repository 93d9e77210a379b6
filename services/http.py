"""Just enough HTTP/1.1 for the stack's small HTTP faces (`moebus metrics`, `moebus openai`).

One request per connection: the server reads a request line, headers and a body of
``Content-Length`` bytes, answers, and closes the connection (``Connection: close``), which
every HTTP client handles. A streamed answer (server-sent events) has no length: it ends
when the connection closes. Malformed or oversize requests raise `HttpError` with the
status to answer; nothing here knows about routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Any

MAX_HEADER_BYTES = 64 << 10
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0

REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout",
           411: "Length Required", 413: "Payload Too Large", 500: "Internal Server Error", 501: "Not Implemented",
           503: "Service Unavailable", 504: "Gateway Timeout"}


class HttpError(Exception):
    """A request the server answers with ``status`` and ``message`` instead of handling it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Request:
    method: str
    path: str  # without the query string
    headers: dict[str, str]  # names lower-cased
    body: bytes


async def read_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_body: int) -> Request:
    """The next request on ``reader``; `HttpError` for a malformed, slow or oversize one. A client
    that waits for ``100 Continue`` before its body (``Expect: 100-continue``, curl for larger
    bodies) gets it once the announced length is accepted."""
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
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise HttpError(501, "chunked request bodies are not accepted: send Content-Length")
    body = b""
    if parts[0] in ("POST", "PUT", "PATCH"):
        length_text = headers.get("content-length")
        if length_text is None:
            raise HttpError(411, "a request body needs Content-Length")
        if not length_text.isdigit():
            raise HttpError(400, f"bad Content-Length {length_text[:40]!r}")
        length = int(length_text)
        if length > max_body:
            raise HttpError(413, f"request body of {length} bytes exceeds {max_body}")
        if headers.get("expect", "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
        try:
            body = await asyncio.wait_for(reader.readexactly(length), BODY_TIMEOUT_S)
        except asyncio.IncompleteReadError:
            raise HttpError(400, "connection closed before the request body ended") from None
        except TimeoutError:
            raise HttpError(408, f"request body not received within {BODY_TIMEOUT_S:g} s") from None
    return Request(parts[0], parts[1].split("?", 1)[0], headers, body)


async def respond(writer: asyncio.StreamWriter, status: int, body: bytes, content_type: str) -> None:
    """A complete response with its length."""
    head = (f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    writer.write(head.encode() + body)
    await writer.drain()


async def respond_json(writer: asyncio.StreamWriter, status: int, payload: Any) -> None:
    await respond(writer, status, json.dumps(payload).encode(), "application/json")


async def start_events(writer: asyncio.StreamWriter) -> None:
    """The head of a server-sent-events stream; `send_event` writes its events."""
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nConnection: close\r\n\r\n")
    await writer.drain()


async def send_event(writer: asyncio.StreamWriter, data: str) -> None:
    """One ``data:`` event (``data`` holds no newline: JSON or a marker such as ``[DONE]``)."""
    writer.write(f"data: {data}\n\n".encode())
    await writer.drain()


async def close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()
