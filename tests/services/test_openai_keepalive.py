"""Persistent connections of `moebus openai` against a real stack (compose/single-node.yml, tiny
model, real nats-server), as clients that pool connections use them (the openai SDK over httpx,
aiohttp-based benchmark tools): several requests, unary and streamed, over one connection (a
stream then chunked), ``Connection: close`` and HTTP/1.0 honoured, pipelined requests answered
in order, the idle timeout and the request limit, a client that leaves mid-stream on a kept
connection still cancelling its request, and the stop (SIGTERM) closing idle connections at once
while the request in flight finishes, its answer saying ``Connection: close``."""

from __future__ import annotations

import http.client
import io
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from services_helpers import cancelled_requests, frontend_address, log_events, run, stack_fixture, until, written_lines

pytestmark = pytest.mark.slow

stack = stack_fixture("single-node.yml")

PROMPT = [785, 6722, 315]


@pytest.fixture(scope="module")
def frontend(stack) -> tuple[str, int]:
    """The compose file's `openai` service (default keep-alive settings)."""
    return frontend_address(stack)


class Frontend:
    """A `moebus openai` process of its own, with the given flags, logging JSON to ``log``."""

    def __init__(self, url: str, log: Path, *flags: str) -> None:
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-m", "services.cli", "openai", "--url", url, "--port", "0", *flags],
                                     stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env=os.environ | {"MOEBUS_LOG_JSON": "1"})
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        match = re.search(r"http://([\d.]+):(\d+)/v1", line)
        assert match, f"no address printed: {line!r} ({log.read_text()[-2000:]})"
        self.addr = match.group(1), int(match.group(2))

    def events(self, event: str) -> list[dict]:
        return [e for line in written_lines(self.log) if line.startswith("{") and (e := json.loads(line)).get("event") == event]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


@pytest.fixture
def own_frontend(stack, tmp_path) -> Iterator[Callable[..., Frontend]]:
    started: list[Frontend] = []

    def start(*flags: str) -> Frontend:
        started.append(Frontend(stack.url, tmp_path / f"openai-{len(started)}.log", *flags))
        return started[-1]

    yield start
    for f in started:
        f.stop()


def request_bytes(path: str, body: dict, headers: str = "", version: str = "HTTP/1.1") -> bytes:
    payload = json.dumps(body).encode()
    return f"POST {path} {version}\r\nHost: x\r\nContent-Type: application/json\r\n{headers}Content-Length: {len(payload)}\r\n\r\n".encode() + payload


class _Unclosable(io.BytesIO):
    def close(self) -> None:  # http.client closes a response's file once read: the next answers follow in it
        pass


def answers(raw: bytes, count: int) -> list[tuple[int, dict[str, str], bytes]]:
    """``count`` answers read one after another from ``raw`` by http.client (its framing:
    Content-Length, chunked, or to the end), each (status, headers, body)."""
    buffer = _Unclosable(raw)

    class Sock:
        def makefile(self, mode: str) -> io.BytesIO:
            return buffer

    out = []
    for _ in range(count):
        resp = http.client.HTTPResponse(Sock())  # type: ignore[arg-type]
        resp.begin()
        out.append((resp.status, dict(resp.getheaders()), resp.read()))
    assert buffer.read() == b"", "bytes after the last answer"
    return out


def read_to_close(s: socket.socket) -> bytes:
    raw = b""
    while data := s.recv(65536):
        raw += data
    return raw


def sse(raw: bytes) -> list[str]:
    chunks = raw.decode().split("\n\n")
    assert chunks[-1] == "" and all(c.startswith("data: ") for c in chunks[:-1]), raw[:300]
    return [c.removeprefix("data: ") for c in chunks[:-1]]


def test_unary_and_streamed_requests_share_one_connection(stack, frontend):
    """Chat and completions, unary and streamed, a model list, over ONE http.client connection:
    every answer right (each stream's text is its unary answer's), streams chunked and ended by
    the zero-length chunk (http.client reads them whole), the client's socket never replaced, and
    the frontend's access log names the same client address and port for every request."""
    conn = http.client.HTTPConnection(*frontend, timeout=60)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    completion = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    sock = None
    texts: dict[str, list[str]] = {}
    try:
        for n, (path, body, stream) in enumerate([("/v1/completions", completion, False), ("/v1/chat/completions", chat, True),
                                                  ("/v1/completions", completion, True), ("/v1/chat/completions", chat, False),
                                                  ("/v1/models", None, False), ("/v1/completions", completion, False)]):
            headers = {"Content-Type": "application/json", "X-Request-Id": f"keep-{n}"}
            payload = None if body is None else json.dumps(body | ({"stream": True} if stream else {})).encode()
            conn.request("GET" if body is None else "POST", path, body=payload, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
            assert resp.status == 200 and resp.getheader("Connection") == "keep-alive", (path, resp.status, raw[:300])
            assert resp.getheader("Transfer-Encoding") == ("chunked" if stream else None)
            assert resp.getheader("Content-Length") == (None if stream else str(len(raw)))
            sock = sock or conn.sock
            assert conn.sock is sock, f"request {n} ({path}) went over a new connection"
            if body is None:
                assert json.loads(raw)["object"] == "list"
                continue
            if stream:
                events = sse(raw)
                assert events[-1] == "[DONE]"
                deltas = [json.loads(e)["choices"][0] for e in events[:-1]]
                text = "".join(d.get("text") or d.get("delta", {}).get("content") or "" for d in deltas)
            else:
                choice = json.loads(raw)["choices"][0]
                text = choice.get("text", choice.get("message", {}).get("content"))
            texts.setdefault(path, []).append(text)
    finally:
        conn.close()
    assert all(len(set(t)) == 1 and t[0] for t in texts.values()), texts  # greedy: the stream says what the unary answer says
    def logged() -> dict[str, str]:
        return {e["request_id"]: e["client"] for e in log_events(stack, "http_request") if str(e.get("request_id")).startswith("keep-")}

    run(until(lambda: len(logged()) == 5, "the frontend logged the 5 completions (each once answered)"))
    assert set(logged()) == {f"keep-{n}" for n in (0, 1, 2, 3, 5)} and len(set(logged().values())) == 1, logged()


def test_connection_close_and_http_1_0_are_honoured(frontend):
    """A kept connection's request that says ``Connection: close`` gets its answer, then the
    close; HTTP/1.0 closes unless it asks ``keep-alive``, and a stream to it is not chunked (HTTP/1.0
    has no chunked framing) and ends with the connection."""
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    with socket.create_connection(frontend, timeout=30) as s:
        s.sendall(request_bytes("/v1/completions", body))
        first = http.client.HTTPResponse(s)  # nothing follows its answer before the next request: it reads no further
        first.begin()
        assert (first.status, first.getheader("Connection")) == (200, "keep-alive") and json.loads(first.read())["choices"]
        s.sendall(request_bytes("/v1/completions", body, "Connection: close\r\n"))
        [(status, headers, raw)] = answers(read_to_close(s), 1)
        assert (status, headers["Connection"]) == (200, "close") and json.loads(raw)["choices"]

    with socket.create_connection(frontend, timeout=30) as s:
        s.sendall(request_bytes("/v1/completions", body, version="HTTP/1.0"))
        [(status, headers, raw)] = answers(read_to_close(s), 1)
        assert (status, headers["Connection"]) == (200, "close")

    with socket.create_connection(frontend, timeout=30) as s:
        s.sendall(request_bytes("/v1/completions", body, "Connection: keep-alive\r\n", version="HTTP/1.0"))
        first = http.client.HTTPResponse(s)
        first.begin()
        assert (first.status, first.getheader("Connection")) == (200, "keep-alive") and json.loads(first.read())["choices"]
        s.sendall(request_bytes("/v1/completions", body | {"stream": True}, "Connection: keep-alive\r\n", version="HTTP/1.0"))
        raw = read_to_close(s)
        assert b"Transfer-Encoding" not in raw.split(b"\r\n\r\n", 1)[0] and b"Connection: close\r\n" in raw, raw[:300]
        assert sse(raw.split(b"\r\n\r\n", 1)[1])[-1] == "[DONE]"


def sole_answer(addr: tuple[str, int], raw: bytes) -> tuple[int, str, dict]:
    """The one answer to ``raw`` sent on a new connection, which then closes (nothing of it read as a
    next request): its status, its Connection header and its JSON body."""
    with socket.create_connection(addr, timeout=30) as s:
        s.sendall(raw)
        [(status, headers, body)] = answers(read_to_close(s), 1)
    return status, headers["Connection"], json.loads(body)


def test_an_ambiguous_body_length_is_refused_or_closes_the_connection(frontend):
    """Bodies a proxy in front could frame otherwise than the frontend (request smuggling, RFC 9112
    6.3): two different Content-Lengths were framed by the last one and the rest of the body read as a
    next request on the kept connection; Content-Length with chunked kept the connection; a transfer
    coding other than chunked was a 411 (with a Content-Length, the body was framed by it)."""
    payload = json.dumps({"prompt": PROMPT, "max_tokens": 2, "temperature": 0}).encode()
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    chunked = f"{len(payload):x}\r\n".encode() + payload + b"\r\n0\r\n\r\n"
    sent = {
        "two lengths": f"{head}Content-Length: {len(payload)}\r\nContent-Length: 5\r\n\r\n".encode() + payload,
        "gzip": f"{head}Transfer-Encoding: gzip\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload,
        "chunked, then gzip": f"{head}Transfer-Encoding: chunked\r\nTransfer-Encoding: gzip\r\n\r\n".encode() + chunked,
        "length and chunked": f"{head}Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n".encode() + chunked,
    }
    got = {name: sole_answer(frontend, raw) for name, raw in sent.items()}
    assert got["two lengths"][:2] == (400, "close") and "conflicting Content-Length headers" in got["two lengths"][2]["error"]["message"]
    for name in ("gzip", "chunked, then gzip"):
        assert got[name][:2] == (400, "close") and "only chunked is supported" in got[name][2]["error"]["message"], got[name]
    assert got["length and chunked"][:2] == (200, "close") and got["length and chunked"][2]["usage"]["completion_tokens"] == 2  # framed by chunked


def test_a_head_a_proxy_could_read_otherwise_is_refused(frontend):
    """Header lines that a proxy in front may parse otherwise than the frontend (RFC 9112 5.1, 5.2,
    2.2; RFC 9110 5.5) are a 400 that closes the connection: whitespace before the colon (a proxy
    ignoring "Transfer-Encoding : chunked" frames the body by Content-Length), a folded line, a bare LF
    or CR inside a line (a proxy may end the line there: the rest becomes a header of its own), a NUL,
    a field name that is no token, a request line with extra spaces. Each was taken: the first one
    framed the body as chunked and kept the connection."""
    payload = json.dumps({"prompt": PROMPT, "max_tokens": 2, "temperature": 0}).encode()
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    chunked = f"{len(payload):x}\r\n".encode() + payload + b"\r\n0\r\n\r\n"
    length = f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload
    sent = {
        "space before the colon": f"{head}Transfer-Encoding : chunked\r\n\r\n".encode() + chunked,
        "folded line": f"{head}X-Trace: a\r\n b: c\r\n".encode() + length,
        "bare LF": f"{head}X-Trace: a\nContent-Length: 5\r\n".encode() + length,
        "bare CR": f"{head}X-Trace: a\rContent-Length: 5\r\n".encode() + length,
        "NUL": f"{head}X-Trace: a\x00b\r\n".encode() + length,
        "name not a token": f"{head}X(Trace): a\r\n".encode() + length,
        "request line with two spaces": "POST  /v1/completions HTTP/1.1\r\nHost: x\r\n".encode() + length,
    }
    got = {name: sole_answer(frontend, raw) for name, raw in sent.items()}
    assert {name: (status, connection) for name, (status, connection, _) in got.items() if (status, connection) != (400, "close")} == {}, got
    assert all("malformed" in answer["error"]["message"] for _, _, answer in got.values()), got
    # the same request, well formed, is served
    status, _, answer = sole_answer(frontend, f"{head}X-Trace: a b\r\nConnection: close\r\n".encode() + length)
    assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer


def test_pipelined_requests_are_answered_in_order(frontend):
    """Three requests written at once (unary, streamed, unary with ``Connection: close``): three
    answers, in the requests' order, nothing lost; the stream's chunked framing parsed by http.client."""
    bodies = [{"prompt": PROMPT, "max_tokens": 3, "temperature": 0}, {"prompt": "Count:", "max_tokens": 5, "temperature": 0, "stream": True},
              {"prompt": "Hello", "max_tokens": 2, "temperature": 0}]
    with socket.create_connection(frontend, timeout=60) as s:
        s.sendall(request_bytes("/v1/completions", bodies[0], "X-Request-Id: pipe-0\r\n")
                  + request_bytes("/v1/completions", bodies[1], "X-Request-Id: pipe-1\r\n")
                  + request_bytes("/v1/completions", bodies[2], "X-Request-Id: pipe-2\r\nConnection: close\r\n"))
        got = answers(read_to_close(s), 3)
    assert [(status, headers["X-Request-Id"]) for status, headers, _ in got] == [(200, "pipe-0"), (200, "pipe-1"), (200, "pipe-2")]
    assert [headers.get("Transfer-Encoding") for _, headers, _ in got] == [None, "chunked", None]
    assert json.loads(got[0][2])["usage"]["completion_tokens"] == 3 and json.loads(got[2][2])["usage"]["completion_tokens"] == 2
    assert sse(got[1][2])[-1] == "[DONE]"


@pytest.mark.parametrize("leaving", ["close", "reset"])
def test_client_leaving_mid_stream_on_a_kept_connection_cancels_its_request(stack, frontend, leaving):
    """A stream (chunked: its first chunk's size line precedes the event) on a connection that
    already carried a request: the client closing it, or resetting it (SO_LINGER 0: an RST, which
    the frontend's writes can see before its watch does), cancels the request, logged 499."""
    before = run(cancelled_requests(stack.url))
    with socket.create_connection(frontend, timeout=30) as s:
        s.sendall(request_bytes("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}))
        first = http.client.HTTPResponse(s)
        first.begin()
        assert first.status == 200 and json.loads(first.read())["choices"]
        s.sendall(request_bytes("/v1/completions", {"prompt": "Count slowly:", "max_tokens": 3000, "temperature": 0, "stream": True},
                                f"X-Request-Id: keep-gone-{leaving}\r\n"))
        received = b""
        while b"data: " not in received:
            data = s.recv(65536)
            assert data, f"connection closed before any event: {received!r}"
            received += data
        assert b"Transfer-Encoding: chunked\r\n" in received and re.search(rb"\r\n\r\n[0-9a-f]+\r\ndata: ", received), received[:500]
        if leaving == "reset":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    deadline = time.monotonic() + 20
    while run(cancelled_requests(stack.url)) == before:
        assert time.monotonic() < deadline, "the gateway never counted the request cancelled"
        time.sleep(0.5)
    def gone() -> list[int]:  # logged after the cancel went out, so maybe after the gateway counted it
        return [e["status"] for e in log_events(stack, "http_request") if e.get("request_id") == f"keep-gone-{leaving}"]

    run(until(lambda: bool(gone()), "the frontend logged the request"))
    assert gone() == [499]
    assert f"keep-gone-{leaving}" in [e["request_id"] for e in log_events(stack, "openai_client_gone")]


def test_idle_timeout_and_request_limit_close_a_kept_connection(own_frontend):
    """``--timeout-keep-alive 1``: a kept connection still takes a request after 0.3 s idle, and is
    closed by the server about 1 s after its last answer; ``--keep-alive-requests 3``: the third
    of three pipelined requests is answered ``Connection: close`` and the connection ends."""
    f = own_frontend("--timeout-keep-alive", "1", "--keep-alive-requests", "3")
    with socket.create_connection(f.addr, timeout=30) as s:
        s.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
        resp = http.client.HTTPResponse(s)
        resp.begin()
        assert (resp.status, resp.getheader("Connection")) == (200, "keep-alive") and resp.read()
        time.sleep(0.3)
        s.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
        resp = http.client.HTTPResponse(s)
        resp.begin()
        assert (resp.status, resp.getheader("Connection")) == (200, "keep-alive") and resp.read()
        answered = time.monotonic()
        assert s.recv(1) == b""  # the server closes the idle connection
        idle = time.monotonic() - answered
    assert 0.8 < idle < 4.0, idle
    with socket.create_connection(f.addr, timeout=30) as s:
        s.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n" * 3)
        got = answers(read_to_close(s), 3)
    assert [(status, headers["Connection"]) for status, headers, _ in got] == [(200, "keep-alive"), (200, "keep-alive"), (200, "close")]


def test_stop_closes_idle_connections_and_finishes_the_request_in_flight(own_frontend):
    """SIGTERM: an idle kept connection is closed at once; a unary request in flight is answered
    (200, ``Connection: close``), then the process exits 0."""
    f = own_frontend("--timeout-keep-alive", "60")
    idle = socket.create_connection(f.addr, timeout=30)
    busy = socket.create_connection(f.addr, timeout=60)
    body = {"prompt": "Count slowly:", "max_tokens": 50, "temperature": 0, "ignore_eos": True}
    try:
        started = time.monotonic()
        idle.sendall(request_bytes("/v1/completions", body))
        resp = http.client.HTTPResponse(idle)
        resp.begin()
        assert resp.status == 200 and resp.getheader("Connection") == "keep-alive" and resp.read()
        # The request in flight at the stop: about 2.5 s of tokens at this box's pace (timed just now),
        # so that it has not ended 0.5 s later and ends within the frontend's 10 s of drain (drain_timeout_s).
        tokens = min(3000, max(100, round(50 * 2.5 / (time.monotonic() - started))))
        busy.sendall(request_bytes("/v1/completions", body | {"max_tokens": tokens}, "X-Request-Id: drained\r\n"))
        time.sleep(0.5)
        f.proc.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        assert idle.recv(1) == b"" and time.monotonic() - stopped < 2.0  # closed at once, not after 60 s
        [(status, headers, raw)] = answers(read_to_close(busy), 1)
        assert (status, headers["Connection"]) == (200, "close"), raw[:300]
        assert json.loads(raw)["usage"]["completion_tokens"] == tokens
        assert f.proc.wait(30) == 0 and "stopped" in f.proc.stdout.read()  # type: ignore[union-attr]
        assert [e["status"] for e in f.events("http_request") if e.get("request_id") == "drained"] == [200]
    finally:
        idle.close()
        busy.close()


def test_a_request_outlasting_the_drain_timeout_is_cut_with_an_error_and_logged(stack, own_frontend):
    """``--drain-timeout 1`` (the setting ``drain_timeout_s``), two requests that would run minutes more:
    about 1 s after SIGTERM they are cut, the cut is logged as ``drain_timed_out`` and the process exits
    0 -- it does not wait for them. Cut, a unary request got no answer at all (the connection closed:
    'Remote end closed connection without response'), a stream stopped mid-chunk, and the frontend's
    log had a CancelledError traceback per request (Ctrl-C of `moebus up` did that to every request in
    flight). Now the unary one is a 503 `unavailable`, the stream's last event that error before
    [DONE], and both requests are cancelled at the stack."""
    f = own_frontend("--drain-timeout", "1")
    body = {"prompt": "Count slowly:", "max_tokens": 3000, "temperature": 0, "ignore_eos": True}  # minutes of tokens on this box
    unary = socket.create_connection(f.addr, timeout=60)
    streamed = socket.create_connection(f.addr, timeout=60)
    try:
        unary.sendall(request_bytes("/v1/completions", body, "X-Request-Id: cut-unary\r\n"))
        streamed.sendall(request_bytes("/v1/completions", body | {"stream": True}, "X-Request-Id: cut-stream\r\n"))
        received = b""
        while b"data: " not in received:  # the stream has begun
            data = streamed.recv(65536)
            assert data, received
            received += data
        f.proc.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        [(status, headers, raw)] = answers(read_to_close(unary), 1)
        assert (status, headers["Connection"], headers["X-Request-Id"]) == (503, "close", "cut-unary"), raw[:300]
        error = json.loads(raw)["error"]
        assert error["code"] == "unavailable" and error["message"].startswith("moebus openai stopped before this request ended"), error
        [(status, headers, raw)] = answers(received + read_to_close(streamed), 1)  # chunked to its last chunk
        cut_after = time.monotonic() - stopped
        assert status == 200 and headers["Transfer-Encoding"] == "chunked"
        events = sse(raw)
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "unavailable", events[-3:]
    finally:
        unary.close()
        streamed.close()
    assert 0.8 < cut_after < 5.0, cut_after
    assert f.proc.wait(30) == 0 and "stopped" in f.proc.stdout.read()  # type: ignore[union-attr]
    assert [(e["requests_in_flight"], e["timeout_s"]) for e in f.events("drain_timed_out")] == [(2, 1.0)]
    assert "Traceback" not in f.log.read_text()
    assert sorted((e["request_id"], e["status"]) for e in f.events("http_request")) == [("cut-stream", 200), ("cut-unary", 503)]

    def cancelled() -> set[str]:
        return {e["request_id"] for e in log_events(stack, "request_failed") if e["code"] == "cancelled"}

    run(until(lambda: {"cut-unary", "cut-stream"} <= cancelled(), "the gateway ending both requests cancelled"))


def test_the_benchmarks_client_keeps_its_connection_and_reopens_one_closed_idle(own_frontend):
    """`bench.openai_client` (bench.serving's and bench.control_plane's client): back-to-back
    requests share one connection; after the server closed it idle (``--timeout-keep-alive 0.3``),
    the next request is sent again on a new one instead of failing."""
    from bench.openai_client import OpenAIConnection

    f = own_frontend("--timeout-keep-alive", "0.3")
    conn = OpenAIConnection(f"http://{f.addr[0]}:{f.addr[1]}/v1", 60.0)
    try:
        body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
        texts = [conn.complete(body)["choices"][0]["text"] for _ in range(3)]
        events: list[dict] = []
        conn.stream(body | {"stream": True}, events.append)
        assert conn.connections == 1 and len(set(texts)) == 1
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == texts[0]
        time.sleep(1.0)  # the server closes the idle connection
        assert conn.complete(body)["choices"][0]["text"] == texts[0] and conn.connections == 2
    finally:
        conn.close()


def test_a_request_without_a_length_has_no_body(frontend):
    """RFC 9112 6.3: a request with neither Content-Length nor Transfer-Encoding has an empty body. A
    POST so sent (`curl -X POST http://host:8000/ping`, vLLM's probe) was refused 411 Length Required
    and its connection closed; now /ping answers it, and a completions request is a 400 naming the
    empty body, the connection kept for the next request."""
    with socket.create_connection(frontend, timeout=30) as s:
        s.sendall(b"POST /ping HTTP/1.1\r\nHost: x\r\n\r\n"
                  b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n"
                  b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        got = answers(read_to_close(s), 3)
    assert [(status, headers["Connection"]) for status, headers, _ in got] == [(200, "keep-alive"), (400, "keep-alive"), (200, "close")]
    assert json.loads(got[1][2])["error"]["message"].startswith("request body: empty;"), got[1][2]


def test_a_client_leaving_mid_headers_logs_no_error(own_frontend):
    """A client that sends part of a request and closes (a TLS hello to the plain port, a port scanner,
    a load balancer's half-open probe): its 400 was written, then the lingering close's shutdown hit
    the peer's reset (OSError ENOTCONN, no ConnectionError), and the frontend logged
    http_request_failed with a traceback at error level. Some of 20 such clients hit it on main."""
    f = own_frontend()
    for _ in range(20):
        with socket.create_connection(f.addr, timeout=10) as s:
            s.sendall(bytes.fromhex("16030100a5010000a10303") + bytes(100))  # a TLS ClientHello's start: no request line end
            s.shutdown(socket.SHUT_WR)
    assert version_status(f.addr) == 200  # and it serves on
    assert f.events("http_request_failed") == [] and "Traceback" not in f.log.read_text()


def version_status(addr: tuple[str, int]) -> int:
    with socket.create_connection(addr, timeout=30) as s:
        s.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        [(status, _, _)] = answers(read_to_close(s), 1)
    return status


def stalled_client(addr: tuple[str, int], request: bytes, rcvbuf: int = 4096) -> socket.socket:
    """A client that sends ``request`` and reads nothing yet (or never: a hung process, a laptop asleep
    behind a NAT): its receive buffer, set before it connects, is the window it offers."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(30)
    s.connect(addr)
    s.sendall(request)
    return s


def ended(s: socket.socket) -> bool:
    """Whether the server ended the connection (its close, or a reset), read to its end."""
    try:
        while s.recv(1 << 20):
            pass
    except ConnectionResetError:
        pass
    return True


def test_a_client_that_stops_reading_is_cut_after_send_timeout_and_its_request_cancelled(stack, own_frontend):
    """``--send-timeout 1``: a stream that would run 15 s and more, then a unary answer larger than the
    kernel's largest send buffer (echoed prompt logprobs, n choices of about 650 kB each), each to a
    client that never reads. The stream's whole answer went into the kernel's send buffer (it grows to
    MiBs) and was logged 200, the connection left to the kernel; the unary answer's write waited for
    the client forever, its connection and handler held, nothing logged. Now each is reset once the
    client took no byte for 1 s, logged ``openai_client_stalled`` with its request id and 499 in the
    access log, the stream's request cancelled at the stack; other clients are served meanwhile."""
    f = own_frontend("--send-timeout", "1")
    before = run(cancelled_requests(stack.url))
    stream = {"prompt": "Count slowly:", "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True}  # 15 s and more here
    wmem_max = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])  # the kernel's largest send buffer (Linux)
    # After the stream, whose KV would leave too little for these choices.
    unary = {"prompt": list(range(10, 910)), "max_tokens": 1, "temperature": 0, "logprobs": 20, "echo": True, "n": wmem_max // 600_000 + 2}

    def stalled() -> list[str]:
        return [e["request_id"] for e in f.events("openai_client_stalled")]

    with stalled_client(f.addr, request_bytes("/v1/completions", stream, "X-Request-Id: stalled-stream\r\n")) as s:
        with socket.create_connection(f.addr, timeout=60) as other:  # meanwhile
            other.sendall(request_bytes("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}, "Connection: close\r\n"))
            [(status, _, raw)] = answers(read_to_close(other), 1)
            assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 4
        assert version_status(f.addr) == 200
        run(until(lambda: stalled() == ["stalled-stream"], "the frontend cut the stream's client", timeout=30))
        assert ended(s)
    with stalled_client(f.addr, request_bytes("/v1/completions", unary, "X-Request-Id: stalled-unary\r\n")) as s:
        run(until(lambda: stalled() == ["stalled-stream", "stalled-unary"], "the frontend cut the unary answer's client", timeout=30))
        assert ended(s)
    assert [e["send_timeout_s"] for e in f.events("openai_client_stalled")] == [1.0, 1.0]
    assert [(e["request_id"], e["status"]) for e in f.events("http_request") if str(e["request_id"]).startswith("stalled-")] == \
        [("stalled-stream", 499), ("stalled-unary", 499)]

    def cancelled() -> set[str]:
        return {e["request_id"] for e in log_events(stack, "request_failed") if e["code"] == "cancelled"}

    run(until(lambda: "stalled-stream" in cancelled(), "the gateway ending the stalled stream's request cancelled", timeout=20))
    deadline = time.monotonic() + 10  # and its heartbeats counting it
    while run(cancelled_requests(stack.url)) == before:
        assert time.monotonic() < deadline, "the gateway never counted the request cancelled"
        time.sleep(0.2)
    assert version_status(f.addr) == 200 and f.events("http_request_failed") == [] and "Traceback" not in f.log.read_text()


def test_a_client_reading_slowly_is_not_cut(own_frontend):
    """``--send-timeout 1`` and clients that read a piece, then pause 0.1 s: a stream of 400 tokens
    through a 4 KiB receive buffer, read over seconds (the client takes bytes, with pauses, all along),
    and a 650 kB unary answer, one write. Both come whole, nothing cut: the timeout runs from the last
    byte the client took, not for a write nor an answer."""
    f = own_frontend("--send-timeout", "1")
    stream = {"prompt": "Count slowly:", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    unary = {"prompt": list(range(10, 910)), "max_tokens": 1, "temperature": 0, "logprobs": 20, "echo": True}
    got = {}
    for request_id, body, rcvbuf in [("slow-stream", stream, 4096), ("slow-unary", unary, 1 << 17)]:
        raw = b""
        with stalled_client(f.addr, request_bytes("/v1/completions", body, f"X-Request-Id: {request_id}\r\nConnection: close\r\n"), rcvbuf) as s:
            while data := s.recv(rcvbuf):
                raw += data
                time.sleep(0.1)
        [got[request_id]] = answers(raw, 1)
    status, _, raw = got["slow-stream"]
    events = sse(raw)
    assert status == 200 and events[-1] == "[DONE]" and sum(bool(json.loads(e)["choices"]) for e in events[:-1]) == 400, events[-3:]
    status, _, raw = got["slow-unary"]
    assert status == 200 and len(raw) > 500_000 and len(json.loads(raw)["choices"][0]["logprobs"]["tokens"]) == 901
    assert f.events("openai_client_stalled") == []
    assert sorted((e["request_id"], e["status"]) for e in f.events("http_request")) == [("slow-stream", 200), ("slow-unary", 200)]


def test_the_stop_ends_though_a_client_stopped_reading(stack, own_frontend):
    """``--drain-timeout 1`` (send_timeout_s its 60 s): SIGTERM while a unary answer larger than the
    kernel's largest send buffer waits for a client that never reads. The drain ran out, the handler
    was cancelled mid-write, and the connection's close waited for the client to take the rest of
    the answer: the process never exited. Now that connection is aborted and the process exits 0."""
    f = own_frontend("--drain-timeout", "1")
    wmem_max = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    n = wmem_max // 600_000 + 2
    body = {"prompt": list(range(10, 910)), "max_tokens": 1, "temperature": 0, "logprobs": 20, "echo": True, "n": n}
    with stalled_client(f.addr, request_bytes("/v1/completions", body, "X-Request-Id: stop-stalled\r\n")):
        def completed() -> int:
            return sum(str(e.get("request_id")).startswith("stop-stalled-") for e in log_events(stack, "completed"))

        run(until(lambda: completed() == n, "the stack answered every choice", timeout=60))
        time.sleep(2)  # the frontend builds the answer and writes it: its write waits for the client
        f.proc.send_signal(signal.SIGTERM)
        assert f.proc.wait(30) == 0 and "stopped" in f.proc.stdout.read()  # type: ignore[union-attr]
    assert [e["requests_in_flight"] for e in f.events("drain_timed_out")] == [1]
