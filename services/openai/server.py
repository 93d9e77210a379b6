"""`moebus openai`: an OpenAI-compatible HTTP API in front of a running stack.

`moebus openai --url nats://127.0.0.1:4222 --port 8000` serves

* ``POST /v1/completions`` and ``POST /v1/chat/completions`` (unary, or server-sent
  events with ``"stream": true``), translated to ``llm.generate`` by
  `services.openai.protocol` and answered through `services.client.Client`, ``n``
  choices of each prompt (completions take a batch of up to ``--max-prompts``) as requests
  of their own (`services.openai.choices`, ``n`` up to ``--max-n``);
* with ``--enable-auto-tool-choice --tool-call-parser hermes`` and ``--reasoning-parser qwen3``
  (vLLM's flags), chat answers split into ``tool_calls``, ``reasoning_content`` and content
  (`services.openai.tool_parsing`); without them ``tools`` need ``tool_choice`` "none";
* ``GET /v1/models`` from ``llm.models`` (vLLM's model cards, ``max_model_len`` the context);
* ``GET /health`` and vLLM's ``GET``/``POST /ping``: 200 when the stack can serve (a gateway
  answers ``llm.models``, and a scheduler, a prefill instance and a decode rank that take new
  work were heard within ``--health-expiry`` seconds: `services.openai.readiness`), else 503
  naming what is missing; ``GET /version``: moebus' version;
* vLLM's ``POST /tokenize`` (a prompt, or chat messages through the chat template: the token ids a
  completion of it is fed, their count and the context) and ``POST /detokenize`` (ids to text), in
  vLLM's shapes (`services.openai.tokenization`), answered by a gateway on ``llm.tokenize`` /
  ``llm.detokenize``.

The frontend is stateless (run as many as needed; each is one more NATS client): every
request gets its own moebus request id (one per choice), so a client that closes its
connection before the answer ends cancels the request (``llm.cancel``, every choice)
instead of leaving it to run. As in vLLM, a request's ``X-Request-Id`` header, when given (else
its body's ``request_id``), is that id (``cmpl-<id>`` / ``chatcmpl-<id>``, and in the stack's logs; a value the stack's id
syntax does not take gives an id made from it, `services.openai.request_ids`), and every answer of
the completion endpoints has an ``X-Request-Id`` header, errors included: the client's, else the id.
Errors are OpenAI error objects with an HTTP status per moebus error code, and headers that tell
OpenAI's SDK whether to retry them (``Retry-After`` for ``overloaded``, ``x-should-retry: false`` for
``timeout``, ``cancelled`` and ``internal``: `services.openai.retries`); one that arrives
after a stream started is sent as a last ``data:`` event, as vLLM does.
Access is vLLM's (`services.openai.access`): with ``--api-key`` (one key or several) the ``/v1`` paths need
``Authorization: Bearer <key>`` (else a 401 ``invalid_api_key``; the probes, ``/tokenize``,
``/detokenize`` and ``OPTIONS`` requests stay open, as in vLLM), and
``--allowed-origins`` (none by default, where vLLM allows every origin), ``--allow-credentials``,
``--allowed-methods``, ``--allowed-headers`` say which web pages may call it: their preflights are
answered without the key, and every answer to an allowed origin names it, errors and streams included.
Configured by `shared.settings.OpenAISettings`: the ``[openai]`` table of the TOML file,
``MOEBUS_OPENAI_<FIELD>`` / ``MOEBUS_<FIELD>`` variables, the flags over both.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable
from typing import Literal

from schemas import subjects
from schemas.api import Usage
from services import http
from services.client import Client, GenerateError
from services.common import moebus_version
from services.openai import protocol, request_ids, tokenization
from services.openai.access import ApiKey, Cors
from services.openai.choices import Choices, choice_requests
from services.openai.readiness import StackReadiness
from services.openai.retries import retry_headers
from services.openai.tool_parsing import REASONING_PARSERS, TOOL_CALL_PARSERS, reasoning_on
from shared.bus import connect
from shared.logging import get_logger
from shared.settings import OpenAISettings
from shared.tasks import cancel_and_wait

log = get_logger(__name__)

MAX_BODY_BYTES = 8 << 20
ROUTES: dict[str, tuple[str, ...]] = {
    "/v1/completions": ("POST",), "/v1/chat/completions": ("POST",), "/v1/models": ("GET",), "/health": ("GET",),
    "/version": ("GET",), "/ping": ("GET", "POST"),  # vLLM's: POST too, as SageMaker probes it
    "/tokenize": ("POST",), "/detokenize": ("POST",),  # vLLM's, outside /v1
}
# vLLM serves these on its API port; a client or scraper pointed here from vLLM is told where they are.
ELSEWHERE: dict[str, str] = {
    "/metrics": "Prometheus metrics are served by `moebus metrics` on a port of its own (9464 by default, `moebus up` runs one)",
}
# Logged status of a request whose client closed the connection first (nginx's convention), or
# stopped taking its answer (http.ClientStalled): either way the client left the answer unread.
CLIENT_GONE = 499


class OpenAIFrontend:
    """Routes each HTTP request of a connection to the stack through ``client``."""

    def __init__(self, client: Client, readiness: StackReadiness, cors: Cors, api_key: ApiKey | None = None, max_n: int = 16,
                 max_prompts: int = 64, tool_call_parser: str | None = None, reasoning_parser: str | None = None, max_choices: int = 256) -> None:
        """``readiness``: the heartbeats heard (``/health``); ``cors``: which web pages may call it;
        ``api_key``: the keys the ``/v1`` paths need (None: none); ``tool_call_parser`` ("hermes") /
        ``reasoning_parser`` ("qwen3"): chat answers are parsed for tool calls (requests may then use
        ``tools`` with ``tool_choice`` "auto") / reasoning."""
        self.client = client
        self.readiness = readiness
        self.cors = cors
        self.api_key = api_key
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self.max_n = max_n
        self.max_prompts = max_prompts
        self.max_choices = max_choices
        self._served_model: str | None = None  # from llm.models, once it answered
        # The model cards' `created` (vLLM's is a Unix time; 0 read as 1970): when this frontend began
        # to serve, the same in every answer.
        self.started = int(time.time())

    async def served_model(self) -> str:
        """The served model's id, for streamed chunks of requests that name none (their
        unary answers carry it from the gateway)."""
        if self._served_model is None:
            models = await self.client.models(timeout=2.0)
            self._served_model = models.models[0].id
        return self._served_model

    async def handle(self, conn: http.Connection) -> None:
        """One request of ``conn`` (`services.http` calls it for each, in order), logged once
        answered (``http_request``: path, status, request id and the client's X-Request-Id it was made
        from, milliseconds from its first byte; status 499 when the client left first or stopped
        reading, the latter logged as ``openai_client_stalled`` too)."""
        started = time.perf_counter()
        method = path = request_id = client_request_id = None
        id_header: dict[str, str] | None = None
        status = 0
        try:
            try:
                req = await http.read_request(conn, *self._body_limit())
                method, path = req.method, req.path
                if (preflight := self.cors.preflight(req)) is not None:  # before the key: a browser sends it without one
                    await http.respond(conn, preflight.status, preflight.body, "text/plain", preflight.headers)
                    status = preflight.status
                    return
                conn.answer_headers = self.cors.answer_headers(req)
                if self.api_key is not None:
                    self.api_key.check(req)
                if req.path not in ROUTES:
                    elsewhere = f" ({ELSEWHERE[req.path]})" if req.path in ELSEWHERE else ""
                    raise http.HttpError(404, f"no route {req.path!r}{elsewhere}; routes: {', '.join(ROUTES)}")
                allowed = http.methods(ROUTES[req.path])
                if req.method not in allowed:
                    raise http.HttpError(405, f"{req.path} takes {' or '.join(allowed)}", {"Allow": ", ".join(allowed)})
                if req.path == "/v1/models":
                    status = await self._models(conn)
                elif req.path in ("/health", "/ping"):
                    status = await self._health(conn)
                elif req.path == "/version":
                    await http.respond_json(conn, 200, {"version": moebus_version()})
                    status = 200
                elif req.path in ("/tokenize", "/detokenize"):
                    status = await self._tokenization(conn, req)
                else:
                    chat = req.path == "/v1/chat/completions"
                    body = _decoded(req.body, chat)
                    body_id = None if isinstance(body, protocol.InvalidRequest) else body.request_id
                    ids = request_ids.of_request(req.headers.get("x-request-id"), body_id)
                    request_id, client_request_id, id_header = ids.id, ids.client, {"X-Request-Id": ids.header}
                    status = await self._generate(conn, chat, body, request_id, id_header)
            except http.HttpError as e:
                status = e.status
                error = protocol.http_error_body(e.status, e.message)
                await http.refuse(conn, e.status, json.dumps(error).encode(), "application/json", e.headers)
        except ConnectionError:
            status = CLIENT_GONE  # a running generation was cancelled in _generate
            conn.keep = False
        except Exception as e:  # noqa: BLE001 - a bug here: answer 500 and log it instead of dropping the connection
            status = 500
            log.exception("http_request_failed", path=path, request_id=request_id)
            conn.keep = False
            if not conn.head_sent:  # else the answer (a stream) is cut short: the client sees it unfinished
                with contextlib.suppress(Exception):
                    await _error(conn, "internal", f"{type(e).__name__}: {e}", id_header)
        finally:
            if conn.stalled:
                log.warning("openai_client_stalled", request_id=request_id, path=path, client=conn.peer, send_timeout_s=conn.server.send_timeout_s)
            log.info("http_request", method=method, path=path, status=status, request_id=request_id, client_request_id=client_request_id,
                     client=conn.peer, ms=round((time.perf_counter() - started) * 1e3, 2))

    def _body_limit(self) -> tuple[int, str]:
        """The largest body this frontend reads, and what sets it: ``MAX_BODY_BYTES``, or the NATS
        server's max_payload (as it announced it) when lower: a request of about the body's size
        would be refused on the bus anyway (400), and this says what it is, too large (413)."""
        bus_limit = self.client.bus.nc.max_payload
        return (MAX_BODY_BYTES, "this server's limit") if MAX_BODY_BYTES <= bus_limit else (bus_limit, "the NATS server's max_payload")

    async def _models(self, conn: http.Connection) -> int:
        try:
            models = await self.client.models()
        except Exception as e:  # noqa: BLE001 - no model list (timeout, no responders): the stack is not answering
            return await _error(conn, "unavailable", f"llm.models did not answer: {e}")
        data = [_model_card(m.id, m.max_context, self.started) for m in models.models]
        await http.respond_json(conn, 200, {"object": "list", "data": data})
        return 200

    async def _tokenization(self, conn: http.Connection, req: http.Request) -> int:
        """vLLM's ``/tokenize`` or ``/detokenize``, answered by a gateway (`services.openai.tokenization`)."""
        try:
            if req.path == "/tokenize":
                tokenized = await self.client.tokenize(tokenization.tokenize_request(protocol.decode(req.body, tokenization.TokenizeBody)))
                answer = tokenization.tokenize_answer(tokenized)
            else:
                text = await self.client.detokenize(tokenization.detokenize_request(protocol.decode(req.body, tokenization.DetokenizeBody)))
                answer = tokenization.detokenize_answer(text)
        except protocol.InvalidRequest as e:
            return await _error(conn, "invalid_request", str(e))
        except GenerateError as e:
            return await _error(conn, e.code, e.message)
        await http.respond_json(conn, 200, answer)
        return 200

    async def _health(self, conn: http.Connection) -> int:
        missing = self.readiness.missing(time.monotonic())
        if missing:
            why = f"no {', '.join(missing)} heard in the last {self.readiness.expiry_s:g} s that takes new work"
            await http.respond(conn, 503, f"unavailable: {why}\n".encode(), "text/plain")
            return 503
        try:
            await self.client.models(timeout=2.0)
        except Exception as e:  # noqa: BLE001 - any failure means not healthy
            await http.respond(conn, 503, f"unavailable: {e}\n".encode(), "text/plain")
            return 503
        await http.respond(conn, 200, b"ok\n", "text/plain")
        return 200

    async def _generate(self, conn: http.Connection, chat: bool, body: protocol.CompletionRequest | protocol.ChatCompletionRequest | protocol.InvalidRequest,
                        request_id: str, headers: dict[str, str]) -> int:
        """Answer a completions or chat request (``chat``) of ``body`` (or the refusal of its
        body, `_decoded`) as ``request_id``, every answer with ``headers``."""
        if isinstance(body, protocol.InvalidRequest):
            return await _error(conn, "invalid_request", str(body), headers)
        try:
            if chat:
                gens = [protocol.chat_request(body, request_id, self.tool_call_parser is not None)]  # type: ignore[arg-type]
            else:
                gens = protocol.completion_requests(body, request_id, self.max_prompts)  # type: ignore[arg-type]
            n = protocol.check_n(body, self.max_n)
            if n * len(gens) > self.max_choices:
                raise protocol.InvalidRequest(f"n x prompts = {n} x {len(gens)} = {n * len(gens)} choices; this server takes at most "
                                              f"{self.max_choices} per request (its max_choices, --max-choices): each choice is a request to the stack")
        except protocol.InvalidRequest as e:
            return await _error(conn, "invalid_request", str(e), headers)
        gen = gens[0]
        model = gen.model
        if model is None and gen.stream:
            try:
                model = await self.served_model()
            except Exception as e:  # noqa: BLE001 - the stack does not answer: the request would fail the same way
                return await _error(conn, "unavailable", f"llm.models did not answer: {e}", headers)
        # A truncated prompt is echoed as the model saw it: spelled from its tokens (None), not as given.
        truncated = body.truncate_prompt_tokens is not None
        echo = [None if truncated else g.prompt for g in gens] if not chat and body.echo else None  # type: ignore[union-attr]
        parse_tools = chat and self.tool_call_parser is not None and protocol.calls_tools(body)  # type: ignore[arg-type]
        # An answer that continues the caller's last message is content (Qwen3's template closes the
        # think block before that message's text), so it is not parsed for reasoning.
        reasoning = (chat and self.reasoning_parser is not None and reasoning_on(body.chat_template_kwargs)  # type: ignore[union-attr]
                     and not body.continue_final_message)  # type: ignore[union-attr]
        # vLLM's include_reasoning: false still splits the reasoning off, and drops it.
        drop_reasoning = reasoning and not body.include_reasoning  # type: ignore[union-attr]
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        # vLLM's rule: usage on every chunk only with include_usage too.
        continuous_usage = include_usage and bool(body.stream_options.continuous_usage_stats)  # type: ignore[union-attr]
        shapes = protocol.Shapes(chat, request_id, model or "", n, len(gens), echo, reasoning=reasoning, tool_calls=parse_tools, drop_reasoning=drop_reasoning,
                                 echo_only=not chat and protocol.echo_only(body), continuous_usage=continuous_usage,  # type: ignore[arg-type]
                                 token_ids_as_names=bool(body.return_tokens_as_token_ids))
        choices = Choices(self.client, choice_requests(gens, n))
        answer = self._stream(conn, choices, shapes, include_usage, headers) if gen.stream else self._unary(conn, choices, shapes, headers)
        status = await _unless_ended(conn, answer)
        if status in ("gone", "stalled"):
            conn.keep = False
            why = ("the HTTP client closed its connection" if status == "gone"
                   else f"the HTTP client took no bytes of its answer for {conn.server.send_timeout_s:g} s (send_timeout_s)")
            for choice_id in choices.ids:
                await self.client.cancel(choice_id, why)
            if status == "gone":  # a stalled client is logged by `handle`, as on every route
                log.info("openai_client_gone", request_id=request_id)
            return CLIENT_GONE
        if status == "cut":
            for choice_id in choices.ids:
                await self.client.cancel(choice_id, "moebus openai is stopping")
            log.info("openai_request_cut", request_id=request_id)
            return await _cut(conn, headers)
        return status

    async def _unary(self, conn: http.Connection, choices: Choices, shapes: protocol.Shapes, headers: dict[str, str]) -> int:
        try:
            responses = await choices.responses()
        except GenerateError as e:
            return await _error(conn, e.code, e.message, headers)
        await http.respond_json(conn, 200, shapes.response(responses), headers)
        return 200

    async def _stream(self, conn: http.Connection, choices: Choices, shapes: protocol.Shapes, include_usage: bool,
                      headers: dict[str, str]) -> int:
        """200 once the stream began (a later error is its last event), else the error's status.
        The choices' chunks interleave as they come, each naming its choice's index."""
        started = False
        usages: dict[int, Usage] = {}
        try:
            async for index, chunk in choices.chunks():
                if not started:
                    await http.start_events(conn, headers)
                    started = True
                    for i in range(len(choices.ids)):
                        if (first := shapes.first_chunk(i, chunk.usage)) is not None:
                            await http.send_event(conn, json.dumps(first))
                if (event := shapes.chunk(chunk, index)) is not None:
                    await http.send_event(conn, json.dumps(event))
                if chunk.usage is not None:
                    usages[index] = chunk.usage
            if include_usage:
                await http.send_event(conn, json.dumps(shapes.usage_chunk(protocol.merged_usage([usages[i] for i in sorted(usages)], shapes.n))))
        except GenerateError as e:
            return await _fail(conn, e.code, e.message, headers)
        await _end_stream(conn)
        return 200


def _model_card(model: str, max_context: int, created: int) -> dict[str, object]:
    """vLLM's model card: ``max_model_len`` (the context, which clients such as Open WebUI, LiteLLM
    and guidellm read), ``root`` (vLLM's model path; here the served name, the gateway names no
    checkpoint directory to clients), ``parent`` (a LoRA's base: none) and its one permission;
    ``created`` a Unix time."""
    permission = {"id": f"modelperm-{model}", "object": "model_permission", "created": created, "allow_create_engine": False,
                  "allow_sampling": True, "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                  "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}
    return {"id": model, "object": "model", "created": created, "owned_by": "moebus", "root": model, "parent": None,
            "max_model_len": max_context, "permission": [permission]}


def _decoded(raw: bytes, chat: bool) -> protocol.CompletionRequest | protocol.ChatCompletionRequest | protocol.InvalidRequest:
    """A completions or chat (``chat``) body, or why it is refused: decoded before its request has
    an id, which its ``request_id`` may give (answered once the id is known, with it)."""
    try:
        return protocol.decode(raw, protocol.ChatCompletionRequest if chat else protocol.CompletionRequest)
    except protocol.InvalidRequest as e:
        return e


async def _error(conn: http.Connection, code: str, message: str, headers: dict[str, str] | None = None) -> int:
    """Answer with the OpenAI error object of a moebus error code, with the headers that tell a client
    whether (and when) to retry it (`services.openai.retries`); its HTTP status."""
    status, body = protocol.error_body(code, message)
    await http.respond_json(conn, status, body, (headers or {}) | retry_headers(code))
    return status


async def _unless_ended(conn: http.Connection, answer: Awaitable[int]) -> int | Literal["gone", "stalled", "cut"]:
    """Run ``answer`` (its status); stop it if the client closes its connection first ("gone":
    end of input, or a reset), stops taking the answer ("stalled": its connection reset, `http.send`)
    or the server's drain at stop runs out ("cut", `http.Server.drain`).
    What the client sends meanwhile (a pipelined next request, a stray CRLF after the body) stays
    unread, for the connection's next turn.
    A cancel of the connection's task (the last resort of `http.Server.drain`, `CUT_S` after the
    cut) ends the answer too and is raised once the answer ended: a plain ``await`` of the cancelled
    answer took that cancel for the answer's own CancelledError and swallowed it, and the handler
    carried on as if only cut."""
    answering = asyncio.ensure_future(answer)
    gone = asyncio.ensure_future(conn.reader.ended.wait())
    cut = asyncio.ensure_future(conn.server.cut.wait())
    try:
        await asyncio.wait({answering, gone, cut}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        cut.cancel()
        answered = answering.done()
        if not answered:  # the client left, the drain cut it, or this task is cancelled: the answer ends here
            await cancel_and_wait(answering)
    if answered:
        # A reset wakes the answer's write and the watch in the same turn of the loop: an answer that
        # failed writing is a client gone too (its requests must be cancelled, not left to the stack).
        if isinstance(answering.exception(), ConnectionError):
            return "stalled" if conn.stalled else "gone"
        return answering.result()
    return "gone" if conn.reader.ended.is_set() else "cut"


async def _cut(conn: http.Connection, headers: dict[str, str]) -> int:
    """End the answer of a request the frontend's stop cut (its drain ran out): a 503 ``unavailable``,
    or, for a stream already under way, that error as its last event before ``[DONE]``, as for an
    error from the stack. The client can tell it from an answer cut short, and retry elsewhere."""
    return await _fail(conn, "unavailable", "moebus openai stopped before this request ended (its drain_timeout_s ran out); retry it", headers)


async def _fail(conn: http.Connection, code: str, message: str, headers: dict[str, str]) -> int:
    """End an answer with an error: its own status while nothing was sent, else (a stream under way)
    the error as the stream's last event, as vLLM does; the status the answer got."""
    if not conn.head_sent:
        return await _error(conn, code, message, headers)
    await http.send_event(conn, json.dumps(protocol.error_body(code, message)[1]))
    await _end_stream(conn)
    return 200


async def _end_stream(conn: http.Connection) -> None:
    await http.send_event(conn, "[DONE]")
    await http.end_events(conn)


async def serve(settings: OpenAISettings) -> None:
    async with connect(settings.nats_url, "moebus-openai", connect_timeout=settings.connect_timeout_s) as bus:
        readiness = StackReadiness(settings.health_expiry_s)
        await bus.subscribe(subjects.HEARTBEAT_ALL, readiness.on_message, concurrent=False)
        # No deadline of the frontend's own: the gateway's (a request's timeout_ms, else its
        # default_timeout_ms) ends a request, and keepalives tell a gateway that died.
        api_key = ApiKey(settings.api_keys()) if settings.api_key is not None else None
        frontend = OpenAIFrontend(Client(bus, timeout=None), readiness, Cors.of(settings), api_key, settings.max_n, settings.max_prompts,
                                  settings.tool_call_parser, settings.reasoning_parser, settings.max_choices)
        await http.listen("openai", frontend.handle, "/v1", settings)


def arguments() -> argparse.ArgumentParser:
    """The command line of `moebus openai`: every flag sets the `OpenAISettings` field of its ``dest``."""
    ap = argparse.ArgumentParser(prog="moebus openai", description="serve an OpenAI-compatible HTTP API for a running stack")
    http.frontend_arguments(ap, OpenAISettings)
    default = OpenAISettings()
    ap.add_argument("--max-n", type=int, metavar="N", help=f"the most choices (n) one request may ask for, each a request to the stack (default {default.max_n})")
    ap.add_argument("--max-prompts", type=int, metavar="N", help=f"the most prompts one /v1/completions request may batch (default {default.max_prompts})")
    ap.add_argument("--max-choices", type=int, metavar="N",
                    help=f"the most choices (n x prompts) one request may ask for, each a request to the stack (default {default.max_choices})")
    ap.add_argument("--health-expiry", dest="health_expiry_s", type=float, metavar="SECONDS",
                    help="/health fails once no scheduler, prefill instance or decode rank was heard this long "
                         f"(default {default.health_expiry_s:g}: the gateway's stage_expiry_s)")
    # vLLM's flags and names, so a vLLM command line for Qwen3 carries over
    ap.add_argument("--enable-auto-tool-choice", action="store_true", default=None,
                    help="parse chat answers for tool calls, so requests may give tools (tool_choice \"auto\"); needs --tool-call-parser")
    ap.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, help="the model's tool-call format (hermes: Qwen3's <tool_call> JSON blocks)")
    ap.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                    help="give the model's reasoning as reasoning_content (qwen3: text up to </think>); default off")
    # vLLM's access flags (`services.openai.access`); the lists are JSON, as vLLM takes them
    ap.add_argument("--api-key", nargs="+", metavar="KEY",
                    help="the key every /v1 request must send as 'Authorization: Bearer KEY', or several, any of which it may send (vLLM's, "
                         "for key rotation; default: none; MOEBUS_OPENAI_API_KEY, a key or a JSON list, keeps them out of the process list)")
    ap.add_argument("--allowed-origins", type=_json_list, metavar="JSON",
                    help='origins whose web pages may call this server, e.g. \'["https://app.example"]\' or \'["*"]\' (default []: none, where vLLM allows "*")')
    ap.add_argument("--allow-credentials", action="store_true", default=None, help="allow cross-origin requests with credentials (default off)")
    ap.add_argument("--allowed-methods", type=_json_list, metavar="JSON", help='methods cross-origin requests may use (default ["*"])')
    ap.add_argument("--allowed-headers", type=_json_list, metavar="JSON", help='headers cross-origin requests may send (default ["*"])')
    return ap


def _parse(argv: list[str]) -> OpenAISettings:
    """`OpenAISettings` from the flags over the environment and the TOML file (every flag sets its field)."""
    return http.parse_frontend(arguments(), OpenAISettings, "openai", argv)


def _json_list(text: str) -> list[str]:
    """A flag's JSON list of strings; else a usage error naming the flag (argparse's)."""
    with contextlib.suppress(json.JSONDecodeError):
        value = json.loads(text)
        if isinstance(value, list) and all(isinstance(item, str) for item in value):
            return value
    raise argparse.ArgumentTypeError(f"expected a JSON list of strings, e.g. '[\"https://app.example\"]', got {text!r}")


def main(argv: list[str]) -> int:
    settings = _parse(argv)
    return http.run_frontend("openai", serve(settings))
