"""The benchmarks' client of an OpenAI-compatible server (``moebus openai``, vLLM's, SGLang's):
blocking, one HTTP/1.1 connection kept from request to request, as the clients users measure
with keep theirs (the openai SDK's httpx pool; aiohttp's connector under a shared session, as in
the serving benchmarks of vLLM and SGLang). ``keep_alive=False`` asks for a new connection per
request instead (``Connection: close``: what curl or a client without a pool costs), for the
frontend's per-request overhead both ways (`bench.control_plane`).

A connection the server closed while it was idle (its keep-alive timeout, 5 s in uvicorn and
``moebus openai``) is noticed only when the next request finds it gone before any answer byte;
that request is sent again once on a new connection, as urllib3 and the openai SDK retry it
(the server never read it)."""

from __future__ import annotations

import http.client
import json
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

# A reused connection that the server closed: the request meets a reset or a close before any answer.
STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)


class OpenAIError(Exception):
    """A refused request (``code``: ``http_<status>``) or a stream's error event (its ``code``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class OpenAIConnection:
    """Requests to the server at ``base_url`` (``http[s]://host:port/v1``), one at a time."""

    def __init__(self, base_url: str, timeout_s: float, keep_alive: bool = True) -> None:
        url = urllib.parse.urlsplit(base_url)
        connection = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        self.conn = connection(url.hostname or "127.0.0.1", url.port, timeout=timeout_s)
        self.prefix = url.path.rstrip("/")  # the API's, e.g. /v1
        self.keep_alive = keep_alive
        self.connections = 0  # TCP connections opened so far

    def models(self) -> list[dict[str, Any]]:
        """``GET /models``' model cards."""
        return self._request("GET", self.prefix + "/models", None, lambda resp: json.loads(resp.read())["data"])

    def version(self) -> str:
        """vLLM's ``GET /version`` (at the server's root): the cheapest request, which a frontend
        answers without the engine behind it (`bench.control_plane` times its HTTP cost with it)."""
        return self._request("GET", "/version", None, lambda resp: json.loads(resp.read())["version"])

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """A unary ``POST /completions``' answer."""
        return self._request("POST", self.prefix + "/completions", body, lambda resp: json.loads(resp.read()))

    def stream(self, body: dict[str, Any], on_event: Callable[[dict[str, Any]], None]) -> None:
        """A streamed ``POST /completions`` (``body`` says ``"stream": true``): ``on_event`` gets each
        event as it arrives; an error event raises `OpenAIError`."""

        def events(resp: http.client.HTTPResponse) -> None:
            for event in _events(resp):
                if "error" in event:
                    raise OpenAIError(str(event["error"].get("code") or "error"), str(event["error"].get("message")))
                on_event(event)

        self._request("POST", self.prefix + "/completions", body, events)

    def close(self) -> None:
        self.conn.close()

    def _request(self, method: str, path: str, body: dict[str, Any] | None, read: Callable[[http.client.HTTPResponse], T]) -> T:
        headers = {"Content-Type": "application/json"} | ({} if self.keep_alive else {"Connection": "close"})
        payload = None if body is None else json.dumps(body).encode()
        for attempt in (0, 1):
            reused = self.conn.sock is not None
            if not reused:
                self.connections += 1
            try:
                self.conn.request(method, path, payload, headers)
                resp = self.conn.getresponse()
            except STALE:
                self.conn.close()
                if reused and attempt == 0:
                    continue
                raise
            break
        # (An answer that says Connection: close has closed self.conn already: the next request opens a new one.)
        try:
            if resp.status != 200:
                raise OpenAIError(f"http_{resp.status}", resp.read()[:300].decode(errors="replace"))
            return read(resp)
        except BaseException:
            self.conn.close()  # the answer may not have been read to its end: the connection cannot carry another
            raise


def _events(resp: http.client.HTTPResponse) -> Iterator[dict[str, Any]]:
    """The JSON ``data:`` events of a server-sent-events answer, up to ``[DONE]``."""
    for line in resp:  # one "data: ..." line each (http.client undoes the chunked framing)
        data = line.removeprefix(b"data: ").strip()
        if not line.startswith(b"data: "):
            continue
        if data == b"[DONE]":
            resp.read()  # the rest (the last chunk), so that the connection can carry the next request
            return
        yield json.loads(data)
