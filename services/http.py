"""Just enough HTTP/1.1 for the stack's small HTTP faces (`moebus metrics`, `moebus openai`).

Connections persist (RFC 9112 9.3), as uvicorn's do, so clients that pool them (the openai SDK
over httpx, aiohttp-based benchmark tools, Prometheus) pay no new connection per request: an
HTTP/1.1 request keeps its connection unless it says ``Connection: close``; an HTTP/1.0 one
closes it unless it says ``Connection: keep-alive`` and its answer has a length (a stream to an
HTTP/1.0 client, which knows no chunked framing, ends by closing the connection). The requests of
one connection are served in order, one at a time: pipelined ones wait in the input buffer. An
answer with a body carries ``Content-Length``; a server-sent-event stream on a kept connection
is sent ``Transfer-Encoding: chunked`` and ends with the zero-length chunk, on one that closes it
ends with the connection. A kept connection is closed after ``KeepAlive.idle_s`` without a new
request, or after ``KeepAlive.max_requests`` requests (that answer says ``Connection: close``).
Every write (`send`) waits until the kernel has the bytes; a client that takes none of them for the
settings' ``send_timeout_s`` (nginx's ``send_timeout``: it stopped reading without closing) has its
connection reset, and the handler's write raises `ClientStalled`.

The server reads a request line, headers and a body of ``Content-Length`` bytes (or a chunked
one). Malformed or oversize requests raise `HttpError` with the status to answer (413 for a body
over the frontend's limit, before reading it); `refuse` answers one and closes the connection,
lingering so that the client can finish sending. At SIGTERM / SIGINT the server stops accepting,
closes the idle connections at once and lets the requests in flight finish (up to the settings' ``drain_timeout_s``),
their answers saying ``Connection: close``; then it tells the handlers of those still running to
end their answers with an error (``Server.cut``). Nothing here knows about routes, nor about who may
call them: a handler gives every answer to a request the headers of its policy (CORS's) through
``Connection.answer_headers``.
The frontends' shared command line (``--config``, ``--url``, ``--host``, ``--port``, the keep-alive
limits, the send timeout: flags over their `shared.settings.FrontendSettings`) and life cycle (listen, print the
address, serve until SIGTERM/SIGINT, drain, say "stopped") are here too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import fcntl
import json
import os
import re
import socket
import string
import struct
import sys
import termios
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from services.common import freeze_startup_heap, load_or_exit, stop_event
from shared.bus import Unreachable
from shared.logging import configure_logging, get_logger
from shared.settings import FrontendSettings

log = get_logger(__name__)

MAX_HEADER_BYTES = 64 << 10
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
# A refused request's unread input is discarded until the client closes, pauses this long, or
# this much time passed in all (nginx's lingering close, with its default times).
LINGER_PAUSE_S = 5.0
LINGER_TOTAL_S = 30.0
# At stop, the handlers of requests still running when the drain ends (`Server.cut`) get this long
# to end their answers with an error (an answer a client does not read is dropped with the process).
CUT_S = 1.5

REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout",
           409: "Conflict", 413: "Payload Too Large", 500: "Internal Server Error", 501: "Not Implemented",
           503: "Service Unavailable", 504: "Gateway Timeout"}


# The ioctl that reads a socket's unacknowledged send bytes (Linux; None where termios lacks it).
_TIOCOUTQ = getattr(termios, "TIOCOUTQ", None) if sys.platform == "linux" else None


class ClientStalled(ConnectionError):
    """The client took no byte of its answer for the server's ``send_timeout_s``: its connection was
    reset (`send`). A ConnectionError, as for a client that hung up: the answer cannot reach it."""

    def __init__(self, send_timeout_s: float) -> None:
        super().__init__(f"the client took no bytes for {send_timeout_s:g} s (send_timeout_s)")


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


@dataclass(frozen=True)
class KeepAlive:
    """How long a kept connection waits for its next request (a new connection's first request gets
    ``HEADER_TIMEOUT_S``), and how many requests it carries before its answer says ``Connection: close``;
    a frontend's from its settings (`FrontendSettings.timeout_keep_alive_s`, ``keep_alive_requests``)."""

    idle_s: float
    max_requests: int


class _Reader(asyncio.StreamReader):
    """A StreamReader whose ``ended`` event says that the client's input ended (its close, a
    half-close, or a reset) without reading what it sent before: a request pipelined behind the
    one being answered stays in the buffer for its turn."""

    def __init__(self) -> None:
        super().__init__()
        self.ended = asyncio.Event()

    def feed_eof(self) -> None:
        super().feed_eof()
        self.ended.set()

    def set_exception(self, exc: BaseException) -> None:
        super().set_exception(exc)
        self.ended.set()


class Connection:
    """One client connection, between its requests and during one: ``keep`` says whether it stays
    open after the answer being written (the request asked so, the server is not stopping, the
    connection's request limit is not reached), ``chunked`` whether that answer is a chunked
    stream, ``head_sent`` whether its head is out (an error can then no longer be answered),
    ``stalled`` whether the client stopped taking its answer (`send` reset the connection)."""

    def __init__(self, reader: _Reader, writer: asyncio.StreamWriter, server: Server) -> None:
        self.reader = reader
        self.writer = writer
        self.server = server
        # A write waits until the transport handed every byte to the kernel (the default lets 64 KiB
        # wait in the process): an answer is out when its handler returns, and the close has nothing
        # left to send (`close`).
        writer.transport.set_write_buffer_limits(high=0)
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)  # host:port, for the access log
        self.keep = False
        self.http10 = False
        self.chunked = False
        self.head_sent = False
        self.head_only = False  # the request is a HEAD: its answer is the head a GET gets, without the body (`respond`)
        self.served = 0  # requests answered before the current one
        self.idle = False  # waiting for its next request: the server closes it at once when it stops
        self.start = b""  # the next request's first byte, read while waiting for it
        self.stalled = False
        # Headers every answer to the current request carries besides its own (a policy's, say CORS's:
        # set by the handler once it read the request; `read_request` clears them).
        self.answer_headers: dict[str, str] = {}
        # What `send` measures a client's progress by: bytes written, bytes it took (acknowledged) as
        # last seen, and since when it has taken nothing of what is written (the event loop's clock).
        self.written = 0
        self.taken = 0
        self.taken_at = 0.0

    def keeps(self) -> bool:
        """Whether the answer being written may keep the connection (decided as its head goes out:
        a stop that began while the request ran makes it ``Connection: close``)."""
        self.keep = self.keep and not self.server.closing
        return self.keep

    async def next_request(self, wait_s: float) -> bool:
        """Waits for the first byte of the next request, skipping the empty lines before it
        (RFC 9112 2.2: a stray CRLF after a body); False when the client closed the connection or
        sent nothing for ``wait_s`` seconds, or the server stops."""
        self.idle = True
        try:
            async with asyncio.timeout(wait_s):
                while (byte := await self.reader.read(1)) in (b"\r", b"\n"):
                    pass
        except (TimeoutError, ConnectionError):
            return False
        finally:
            self.idle = False
        self.start = byte
        return bool(byte) and not self.server.closing  # closed by the stop while its byte was on the way: dropped with it


async def read_request(conn: Connection, max_body: int, limit: str = "this server's limit") -> Request:
    """The request on ``conn`` whose first byte `Connection.next_request` read; `HttpError` for a
    malformed, slow or oversize one (a body over ``max_body``: 413 naming ``limit``). A client that
    waits for ``100 Continue`` before its body (``Expect: 100-continue``, curl for larger bodies)
    gets it once the announced length is accepted. Sets ``conn.keep`` (see `Connection`)."""
    reader = conn.reader
    conn.keep = conn.chunked = conn.head_sent = conn.head_only = False  # an error before the request is whole closes the connection
    conn.answer_headers = {}
    first, conn.start = conn.start, b""
    try:
        # The first byte is no CR or LF, so the end of the head cannot straddle it. (asyncio.timeout,
        # not wait_for: no task per read, on the path of every request once its first byte is in.)
        async with asyncio.timeout(HEADER_TIMEOUT_S):
            head = first + await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise HttpError(413, "request headers too large") from None
    except asyncio.IncompleteReadError:
        raise HttpError(400, "connection closed before the request's headers ended") from None
    except TimeoutError:
        raise HttpError(408, f"no complete request headers within {HEADER_TIMEOUT_S:g} s") from None
    if len(head) > MAX_HEADER_BYTES:
        raise HttpError(413, "request headers too large")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or _FORBIDDEN_IN_HEAD.search(lines[0]):
        raise HttpError(400, f"malformed request line {lines[0][:100]!r}")
    conn.head_only = parts[0] == "HEAD"
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, sep, value = line.partition(":")
            # RFC 9112 5.1 / 5.2 / 2.2, RFC 9110 5.5: a field name is a token (no whitespace before the
            # colon), no line folding, no bare CR or LF, no NUL. Refused, never repaired: a proxy in front
            # that read such a line otherwise ("Transfer-Encoding : chunked" as no framing, a bare LF as a
            # line end) would frame the body otherwise than we do (request smuggling).
            if not sep or not _TOKEN.fullmatch(name) or _FORBIDDEN_IN_HEAD.search(value):
                raise HttpError(400, f"malformed header line {line[:100]!r}")
            name, value = name.lower(), value.strip(" \t")
            if name in headers and name in _FRAMING_HEADERS:
                value = _repeated_framing_header(name, headers[name], value)
            headers[name] = value
    body = b""
    chunked = _chunked(headers)
    # A body is read whenever one is announced, whatever the method: on a kept connection, one left
    # unread would be taken for the next request. A request that announces none has none (RFC 9112
    # 6.3), a POST too: `curl -X POST .../ping` (vLLM's probe) sends no Content-Length, and was a 411.
    if chunked or "content-length" in headers:
        length = None if chunked else _content_length(headers["content-length"])
        if length is not None and length > max_body:
            raise HttpError(413, _too_large(length, max_body, limit))
        if headers.get("expect", "").lower() == "100-continue":
            await send(conn, b"HTTP/1.1 100 Continue\r\n\r\n")
        read = reader.readexactly(length) if length is not None else _chunked_body(reader, max_body, limit)
        try:
            async with asyncio.timeout(BODY_TIMEOUT_S):
                body = await read
        except asyncio.IncompleteReadError:
            raise HttpError(400, "connection closed before the request body ended") from None
        except asyncio.LimitOverrunError:
            raise HttpError(400, "malformed chunked body: a chunk size line without its CRLF") from None
        except TimeoutError:
            raise HttpError(408, f"request body not received within {BODY_TIMEOUT_S:g} s") from None
    options = {token.strip().lower() for token in headers.get("connection", "").split(",")}
    conn.http10 = parts[2] == "HTTP/1.0"
    wants = "keep-alive" in options if conn.http10 else "close" not in options
    # Both framings at once may be a smuggling attempt (a proxy in front may have framed the body by
    # Content-Length, and would take the rest for a next request): RFC 9112 6.3 has the server close
    # the connection after answering it.
    smuggled = chunked and "content-length" in headers
    conn.keep = wants and not smuggled and conn.served + 1 < conn.server.keep_alive.max_requests
    return Request(parts[0], parts[1].split("?", 1)[0], headers, body)


# The headers that frame a request's body: when sent twice, the copies must agree (Content-Length)
# or form one list (Transfer-Encoding), never the last one silently winning.
_FRAMING_HEADERS = ("content-length", "transfer-encoding")
# A field name (RFC 9110 5.1: a token), and what no line of a request head may hold: a bare CR or LF
# (the head is split at CRLF only) and NUL (RFC 9110 5.5).
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_FORBIDDEN_IN_HEAD = re.compile(r"[\r\n\x00]")


def _repeated_framing_header(name: str, first: str, again: str) -> str:
    """The value of framing header ``name`` sent again (``first``, then ``again``); `HttpError` 400
    for two different Content-Lengths: the body's end is ambiguous (RFC 9112 6.3, an unrecoverable
    error), and the frontend used the last one where a proxy may have used the first."""
    if name == "transfer-encoding":
        return f"{first}, {again}"  # one list, in order (RFC 9110 5.3)
    if first != again:
        raise HttpError(400, f"conflicting Content-Length headers ({first[:40]!r} and {again[:40]!r})")
    return first


def _chunked(headers: dict[str, str]) -> bool:
    """Whether the body is chunked (Transfer-Encoding, which overrides Content-Length, RFC 9112 6.3);
    `HttpError` 400 for any other transfer coding: this server decodes none, and a body whose final
    coding is not chunked has no length it could read (RFC 9112 6.3: 400, then close)."""
    value = headers.get("transfer-encoding")
    if value is None:
        return False
    codings = [c.strip().lower() for c in value.split(",") if c.strip()]
    if codings != ["chunked"]:
        raise HttpError(400, f"Transfer-Encoding {value[:60]!r}: only chunked is supported")
    return True


def _content_length(length_text: str) -> int:
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


async def linger(conn: Connection) -> None:
    """After answering a refused request: say no more is coming, then read and drop what the
    client still sends (see ``LINGER_*``). Its body may be unread (a 413 is answered before it):
    a connection closed with unread input is reset, and a client still sending its body (one
    that does not wait for ``100 Continue``: Python's http.client, httpx and so the openai SDK)
    would get the reset instead of the answer."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LINGER_TOTAL_S
    # OSError, not only ConnectionError: shutting down the write side of a socket the client already
    # reset raises ENOTCONN, a plain OSError (a client that sent part of a request and left).
    with contextlib.suppress(OSError, TimeoutError):
        conn.writer.write_eof()
        while (left := deadline - loop.time()) > 0:
            async with asyncio.timeout(min(LINGER_PAUSE_S, left)):
                if not await conn.reader.read(1 << 16):
                    break


def methods(allowed: tuple[str, ...]) -> tuple[str, ...]:
    """The methods a resource that takes ``allowed`` answers: HEAD too wherever GET (RFC 9110 9.1: every
    general-purpose server supports both), as HTTP load balancers' health checks (HAProxy's
    ``option httpchk HEAD /health``), uptime monitors and ``curl -I`` send HEAD. (Starlette adds it to GET
    routes; FastAPI's, hence vLLM's, do not: fastapi/fastapi#1773, open.)"""
    return (*allowed, "HEAD") if "GET" in allowed and "HEAD" not in allowed else allowed


async def refuse(conn: Connection, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
    """Answer a request that failed (an `HttpError`) and close the connection, lingering: what
    follows the request in its input (its unread body, say) cannot be told from a next request."""
    conn.keep = False
    await respond(conn, status, body, content_type, headers)
    await linger(conn)


def _header_lines(conn: Connection, headers: dict[str, str] | None) -> str:
    """The answer's own ``headers`` and the request's `Connection.answer_headers`, as head lines."""
    return "".join(f"{name}: {value}\r\n" for name, value in (conn.answer_headers | (headers or {})).items())


async def respond(conn: Connection, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
    """A complete response with its length (and ``headers``, whose values hold no line breaks, after the
    connection's `Connection.answer_headers`); to a HEAD
    request the same head, Content-Length included, without the body (RFC 9110 9.3.2)."""
    head = (f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n{_header_lines(conn, headers)}Connection: {'keep-alive' if conn.keeps() else 'close'}\r\n\r\n")
    conn.head_sent = True
    await send(conn, head.encode() + (b"" if conn.head_only else body))


async def respond_json(conn: Connection, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
    await respond(conn, status, json.dumps(payload).encode(), "application/json", headers)


async def start_events(conn: Connection, headers: dict[str, str] | None = None) -> None:
    """The head of a server-sent-events stream; `send_event` writes its events, `end_events` ends
    it. Chunked on a connection that stays open (HTTP/1.0 has no chunked framing: such a stream
    ends with the connection)."""
    conn.keep = conn.keep and not conn.http10
    conn.chunked = conn.keeps()
    framing = "Transfer-Encoding: chunked\r\nConnection: keep-alive" if conn.chunked else "Connection: close"
    conn.head_sent = True
    await send(conn, f"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n{_header_lines(conn, headers)}"
                     f"{framing}\r\n\r\n".encode())


async def send_event(conn: Connection, data: str) -> None:
    """One ``data:`` event (``data`` holds no newline: JSON or a marker such as ``[DONE]``)."""
    event = f"data: {data}\n\n".encode()
    await send(conn, b"%x\r\n%b\r\n" % (len(event), event) if conn.chunked else event)


async def end_events(conn: Connection) -> None:
    """The end of a stream: its zero-length chunk, when chunked (else the connection's close ends it)."""
    if conn.chunked:
        await send(conn, b"0\r\n\r\n")


async def send(conn: Connection, data: bytes) -> None:
    """Write ``data`` and wait until the kernel has it, however slowly the client reads;
    `ClientStalled`, the connection reset, once bytes written wait untaken for the server's
    ``send_timeout_s``: nginx's ``send_timeout``, counted from the last byte the client took (its
    acknowledgement), not for a write nor the whole answer. The kernel's send buffer grows to MiBs
    (4 MiB, Linux's default tcp_wmem), more than a stream of thousands of tokens: a client that takes
    nothing is seen by the writes after it, whether or not they have to wait for room."""
    loop = asyncio.get_running_loop()
    if conn.taken == conn.written:  # it had taken everything: its time runs from these bytes
        conn.taken_at = loop.time()
    conn.writer.write(data)
    conn.written += len(data)
    while True:
        unsent = _unsent(conn.writer)
        now = loop.time()
        if conn.written - unsent > conn.taken:
            conn.taken, conn.taken_at = conn.written - unsent, now
        waited = now - conn.taken_at
        if unsent and waited >= conn.server.send_timeout_s:
            break
        if not conn.writer.transport.get_write_buffer_size():
            await conn.writer.drain()  # the kernel has it all: no wait, but the error of a lost connection
            return
        try:
            async with asyncio.timeout(conn.server.send_timeout_s - waited):
                await conn.writer.drain()
            return
        except TimeoutError:
            pass
    conn.stalled = True
    # A reset, not a close: the close of a socket whose unsent bytes nobody takes keeps them, and the
    # socket, in the kernel until its retries run out (nginx's reset_timedout_connection).
    with contextlib.suppress(OSError):
        conn.writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.writer.transport.abort()
    raise ClientStalled(conn.server.send_timeout_s)


def _unsent(writer: asyncio.StreamWriter) -> int:
    """The bytes written that the client did not take: the transport's buffer, and the kernel's
    send queue (TIOCOUTQ, Linux: bytes it sent or holds that the client did not acknowledge).
    Where the kernel does not say (other systems), only the transport's buffer counts: a stalled
    client is then seen once the kernel's buffer is full and the writes wait."""
    queued = 0
    fd = writer.get_extra_info("socket").fileno()  # -1 once the connection is lost: its next drain raises
    if fd >= 0 and _TIOCOUTQ is not None:
        with contextlib.suppress(OSError):
            queued = struct.unpack("i", fcntl.ioctl(fd, _TIOCOUTQ, b"\0\0\0\0"))[0]
    return writer.transport.get_write_buffer_size() + queued


async def close(writer: asyncio.StreamWriter) -> None:
    """Close the connection; one whose answer is still in the transport's buffer (its handler
    cancelled in `send`, at the end of the stop's drain) is aborted: a close would wait for a client
    that may never take it."""
    if writer.transport.get_write_buffer_size():
        writer.transport.abort()
    else:
        writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()


Handler = Callable[[Connection], Awaitable[None]]  # reads one request on the connection (read_request) and answers it


class Server:
    """Runs ``handle`` for each request of each connection, in order, one at a time per connection,
    while the connection is kept (see `KeepAlive`); `drain` stops it."""

    def __init__(self, handle: Handler, keep_alive: KeepAlive, send_timeout_s: float) -> None:
        """``send_timeout_s``: a client that takes no byte of its answer this long is cut (`send`)."""
        self.handle = handle
        self.keep_alive = keep_alive
        self.send_timeout_s = send_timeout_s
        self.closing = False
        self.cut = asyncio.Event()  # set when the drain ran out: the requests still running end now (`drain`)
        self.connections: dict[Connection, asyncio.Task[None]] = {}

    def protocol(self) -> asyncio.StreamReaderProtocol:
        """A new connection's protocol (what `asyncio.start_server` makes, with a `_Reader`)."""
        return asyncio.StreamReaderProtocol(_Reader(), self._serve)

    async def _serve(self, reader: _Reader, writer: asyncio.StreamWriter) -> None:
        conn = Connection(reader, writer, self)
        self.connections[conn] = asyncio.current_task()  # type: ignore[assignment]
        try:
            wait_s = HEADER_TIMEOUT_S  # a new connection's first request, then the keep-alive time between requests
            while await conn.next_request(wait_s):
                await self.handle(conn)
                if not conn.keep:
                    break
                conn.served += 1
                wait_s = self.keep_alive.idle_s
        except asyncio.CancelledError:
            pass  # the end of the drain (`drain`): the connection closes, nothing to report (asyncio logs a cancelled one's task)
        finally:
            del self.connections[conn]
            await close(writer)

    async def drain(self, timeout_s: float) -> None:
        """Stop keeping connections: close the idle ones now, let the requests in flight finish
        (their answers say ``Connection: close``) for up to ``timeout_s``; then set ``cut``, for
        their handlers to end their answers with an error (a client gets an answer, not a closed
        connection), and after `CUT_S` more cancel what still runs."""
        self.closing = True
        for conn in list(self.connections):
            if conn.idle:
                conn.writer.close()  # its wait for a request ends (end of input)
        if self.connections:
            _, running = await asyncio.wait(list(self.connections.values()), timeout=timeout_s)
            if running:  # their handlers end each answer with an error now: a client gets one, not a closed connection
                log.warning("drain_timed_out", requests_in_flight=len(running), timeout_s=timeout_s)
                self.cut.set()
                await asyncio.wait(running, timeout=CUT_S)
        left = list(self.connections.values())
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)


F = TypeVar("F", bound=FrontendSettings)

# The exit status of a frontend that cannot listen on its address (another process has the port, the host
# is none of this machine's, a port below 1024 without the right): sysexits' EX_CONFIG, the address being a
# setting to change. `moebus up` tells it from other exits by this status alone: such a frontend fails the
# start, and is not restarted (a restart meets the same address: `services.launch.restarts`).
CANNOT_LISTEN = 78


class CannotListen(Exception):
    """The frontend's listening socket could not be bound to ``host``:``port`` (``error``)."""

    def __init__(self, host: str, port: int, error: OSError) -> None:
        super().__init__(host, port, error)
        self.host, self.port, self.error = host, port, error

    def describe(self, name: str) -> str:
        """One line: the address, why, and for a port in use what to do (frontend ``name``'s settings)."""
        # asyncio words the OS error as "error while attempting to bind on address ...": the plain reason reads better
        reason = os.strerror(self.error.errno) if self.error.errno else str(self.error)
        where = f"cannot listen on {self.host}:{self.port}: {reason}"
        if self.error.errno != errno.EADDRINUSE:
            return where
        # A second `moebus up` meets the first one's frontends on the compose files' ports (8000, 9464), or vLLM's
        # server has 8000. (`moebus up --port` is the NATS port; 0 moves the frontends whose port is not set too.)
        return (f"{where}; another process listens there (`ss -ltnp 'sport = :{self.port}'` names it): free the port, or set "
                f"MOEBUS_{name.upper()}_PORT=N (0: any free port; `moebus {name} --port N` when run alone); "
                f"`moebus up --port 0` puts NATS and every frontend whose port is not set on free ports")


def frontend_arguments(ap: argparse.ArgumentParser, cls: type[FrontendSettings]) -> None:
    """``--config`` and the flags every frontend has. A flag's ``dest`` is its settings field and
    its default None: absent, the file, the environment or the field's default decides (`parse_frontend`)."""
    default = {f.name: f.default for f in msgspec.structs.fields(cls)}
    ap.add_argument("--config", metavar="FILE", help="TOML settings file (see shared/settings.py)")
    ap.add_argument("--url", dest="nats_url", metavar="URL", help=f"NATS URL (printed by `moebus up`; default: nats_url of $MOEBUS_NATS_URL or the TOML file, else {default['nats_url']})")
    ap.add_argument("--host", dest="http_host", metavar="HOST", help=f"address to listen on (0.0.0.0 for every interface; default {default['http_host']})")
    ap.add_argument("--port", type=int, help=f"TCP port (0: any free one, printed at start; default {default['port']})")
    ap.add_argument("--timeout-keep-alive", dest="timeout_keep_alive_s", type=float, metavar="SECONDS",
                    help=f"close a kept connection after this long without a request (uvicorn's flag and default, {default['timeout_keep_alive_s']:g}, as vLLM's)")
    ap.add_argument("--keep-alive-requests", type=int, metavar="N",
                    help=f"close a connection after its N-th request (nginx's keepalive_requests, default {default['keep_alive_requests']}; 1: no keep-alive)")
    ap.add_argument("--drain-timeout", dest="drain_timeout_s", type=float, metavar="SECONDS",
                    help=f"at SIGTERM / SIGINT, how long the requests in flight may take to finish (default {default['drain_timeout_s']:g})")
    ap.add_argument("--send-timeout", dest="send_timeout_s", type=float, metavar="SECONDS",
                    help=f"reset a connection whose client takes no byte of its answer this long, and cancel its request "
                         f"(nginx's send_timeout and default, {default['send_timeout_s']:g})")


def parse_frontend(ap: argparse.ArgumentParser, cls: type[F], service: str, argv: list[str]) -> F:
    """The frontend's settings: its flags (every one a field, `frontend_arguments`) over
    ``MOEBUS_<SERVICE>_<FIELD>`` / ``MOEBUS_<FIELD>`` over the TOML file, as every service reads
    them (a bad one: a usage error, exit 2); its logging configured from them."""
    flags = vars(ap.parse_args(argv))
    settings = load_or_exit(ap, cls, service, flags.pop("config"), flags)
    configure_logging(service, settings.log_level, settings.log_json)
    return settings


async def listen(name: str, handle: Handler, path: str, settings: FrontendSettings) -> None:
    """Serve ``handle`` on ``settings``' host and port until SIGTERM / SIGINT, then drain (`Server.drain`);
    print the address first (`moebus up` and tests read it from there)."""
    stop = stop_event()
    freeze_startup_heap()
    server = Server(handle, KeepAlive(settings.timeout_keep_alive_s, settings.keep_alive_requests), settings.send_timeout_s)
    try:
        listening = await asyncio.get_running_loop().create_server(server.protocol, settings.http_host, settings.port)
    except OSError as e:
        raise CannotListen(settings.http_host, settings.port, e) from e
    try:
        bound = listening.sockets[0].getsockname()
        print(f"moebus {name}: serving http://{bound[0]}:{bound[1]}{path} for the stack on {settings.nats_url}", flush=True)
        await stop.wait()
    finally:
        listening.close()  # no new connections
    await server.drain(settings.drain_timeout_s)


def run_frontend(name: str, serve: Coroutine[Any, Any, None]) -> int:
    """Run a frontend's ``serve`` to its end: 0 after a clean stop; 1 (the reason on stderr) when NATS
    does not answer; `CANNOT_LISTEN` (the reason and what to do, one line on stderr) when its address
    cannot be bound."""
    try:
        asyncio.run(serve)
    except Unreachable as e:
        print(f"moebus {name}: {e}", file=sys.stderr)
        return 1
    except CannotListen as e:
        print(f"moebus {name}: {e.describe(name)}", file=sys.stderr)
        return CANNOT_LISTEN
    print(f"moebus {name}: stopped", flush=True)
    return 0
