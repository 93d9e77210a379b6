"""Client of the public API: an async `Client` for programs and tests, and `moebus request`.

`moebus request --url nats://127.0.0.1:4222 --prompt "hi" [--stream] [--max-tokens N] ...`
prints the completion (streamed as it arrives with --stream) and a usage/timing line
on stderr (with --logprobs / --top-logprobs K also each token's logprob and its K most
likely alternatives, one line per token); `--json` prints the raw replies instead. With
`--tokenize` it prints the prompt's (or chat's) token ids as the model is fed them, and their
count on stderr (with `--input-ids`: their text). The exit status is 1 on an error
reply, with its code and message on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from schemas import subjects
from schemas.api import (CancelRequest, ChatMessage, DetokenizeReply, DetokenizeRequest, DetokenizeResponse, ErrorReply, GenerateChunk, GenerateReply,
                         GenerateRequest, GenerateResponse, Keepalive, ModelList, TokenizeReply, TokenizeRequest, TokenizeResponse, TokenLogprob)
from shared.bus import (CONTENT_TYPE, JSON, KEEPALIVE_HEADER, MSGPACK, Bus, BusError, Deadline, PayloadTooLarge, RequestTimeout, Unreachable,
                        connect, decode_public, encode_public)
from shared.logging import configure_tool_logging
from shared.settings import nats_url_from_env


class GenerateError(Exception):
    """An error reply (or no reply at all) for a request; `code` is the API error code."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


# A gateway silent for this many keepalive intervals is taken for gone (one late keepalive,
# e.g. from a loaded host, is not enough).
SILENT_INTERVALS = 3


class Client:
    """Talks to `llm.*` over an open bus. `timeout` bounds the wait when a request sets no deadline
    (None: no bound of its own, the gateway's default deadline ends the request; needs keepalives).

    `keepalive_s`: the gateway is asked for a keepalive every that many seconds
    (`KEEPALIVE_HEADER`); after `SILENT_INTERVALS` of them without any reply the
    request fails with `unavailable` instead of waiting out its deadline (a gateway that
    died after accepting it). The gateway in turn cancels the request once a keepalive
    finds nobody subscribed to its replies (this process died, or the stream was closed
    early). None: ask for none, wait for the deadline; the request then runs to its end
    even if nobody reads it.
    """

    def __init__(self, bus: Bus, content_type: str = JSON, timeout: float | None = 120.0, keepalive_s: float | None = 2.0) -> None:
        if timeout is None and keepalive_s is None:
            raise ValueError("a client without a timeout needs keepalives: nothing else would tell a gateway that died")
        self.bus = bus
        self.ctype = content_type
        self.timeout = timeout
        self.keepalive_s = keepalive_s

    def _deadline(self, req: GenerateRequest) -> Deadline:
        # The gateway answers `timeout` at the request's own deadline; wait a little longer for that reply.
        if req.timeout_ms:
            return Deadline.after(req.timeout_ms / 1000 + 5.0)
        return Deadline(math.inf) if self.timeout is None else Deadline.after(self.timeout)

    def _headers(self) -> dict[str, str]:
        return {CONTENT_TYPE: self.ctype}

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        """One unary completion; raises GenerateError on an error reply."""
        req = msgspec.structs.replace(req, stream=False)
        async for reply in self._replies(req):
            return reply  # type: ignore[return-value]
        raise AssertionError("unreachable: _replies yields or raises")

    async def stream(self, req: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """The chunks of a streamed completion; raises GenerateError on an error reply."""
        req = msgspec.structs.replace(req, stream=True)
        async for reply in self._replies(req):
            yield reply  # type: ignore[misc]

    async def send_raw(self, payload: bytes, headers: dict[str, str] | None = None, timeout: float = 10.0) -> GenerateReply:
        """Send arbitrary bytes on llm.generate and decode the first reply (for malformed-input checks)."""
        msg = await self.bus.nats_request(subjects.GENERATE, payload, timeout, headers)
        return decode_public(msg.data, GenerateReply, MSGPACK if (headers or {}).get(CONTENT_TYPE) == MSGPACK else JSON)

    async def _replies(self, req: GenerateRequest) -> AsyncIterator[GenerateResponse | GenerateChunk]:
        def is_last(msg: Any) -> bool:
            reply = decode_public(msg.data, GenerateReply, self.ctype)
            return isinstance(reply, (GenerateResponse, ErrorReply)) or (isinstance(reply, GenerateChunk) and reply.finish_reason is not None)

        headers = self._headers()
        silence_s = None
        if self.keepalive_s is not None:
            headers[KEEPALIVE_HEADER] = str(round(self.keepalive_s * 1000))
            silence_s = SILENT_INTERVALS * self.keepalive_s
        next_chunk = 0
        try:
            async for msg in self.bus.stream(subjects.GENERATE, encode_public(req, self.ctype), is_last, self._deadline(req), headers, silence_s):
                reply = decode_public(msg.data, GenerateReply, self.ctype)
                if isinstance(reply, ErrorReply):
                    raise GenerateError(reply.error.code, reply.error.message, reply.request_id)
                if isinstance(reply, GenerateChunk):
                    # NATS delivers at most once (a slow consumer's messages are dropped): a gap
                    # would silently cut text out of the completion.
                    if reply.index != next_chunk:
                        await self.cancel(reply.request_id, "the client lost a chunk of the stream")
                        raise GenerateError("unavailable", f"stream chunk {next_chunk} was lost (chunk {reply.index} arrived next)", reply.request_id)
                    next_chunk += 1
                if not isinstance(reply, Keepalive):
                    yield reply
        except PayloadTooLarge as e:  # the request itself is too big: nothing was sent
            raise GenerateError("invalid_request", str(e), req.request_id) from e
        except RequestTimeout as e:  # this client's own deadline passed before the gateway's answer
            raise GenerateError("timeout", str(e), req.request_id) from e
        except BusError as e:
            raise GenerateError("unavailable", str(e), req.request_id) from e

    async def cancel(self, request_id: str, reason: str = "cancelled by client") -> None:
        await self.bus.publish(subjects.CANCEL, encode_public(CancelRequest(request_id, reason), self.ctype), self._headers())

    async def models(self, timeout: float = 5.0) -> ModelList:
        msg = await self.bus.nats_request(subjects.MODELS, b"", timeout, self._headers())
        return decode_public(msg.data, ModelList, self.ctype)

    async def tokenize(self, req: TokenizeRequest, timeout: float = 30.0) -> TokenizeResponse:
        """The token ids the gateway feeds the model for ``req``'s prompt or chat; GenerateError on an error reply."""
        return await self._ask(subjects.TOKENIZE, req, TokenizeReply, timeout)  # type: ignore[no-any-return]

    async def detokenize(self, req: DetokenizeRequest, timeout: float = 30.0) -> DetokenizeResponse:
        """The text of ``req.tokens``; GenerateError on an error reply."""
        return await self._ask(subjects.DETOKENIZE, req, DetokenizeReply, timeout)  # type: ignore[no-any-return]

    async def _ask(self, subject: str, req: Any, reply_type: Any, timeout: float) -> Any:
        """One request-reply on a public subject; its error reply, or none, as GenerateError with
        the code `llm.generate` gives for it."""
        try:
            msg = await self.bus.checked_request(subject, encode_public(req, self.ctype), timeout, self._headers())
        except PayloadTooLarge as e:  # the request itself is too big: nothing was sent
            raise GenerateError("invalid_request", str(e)) from e
        except RequestTimeout as e:
            raise GenerateError("timeout", str(e)) from e
        except BusError as e:  # no gateway answers, or no connection
            raise GenerateError("unavailable", str(e)) from e
        reply = decode_public(msg.data, reply_type, self.ctype)
        if isinstance(reply, ErrorReply):
            raise GenerateError(reply.error.code, reply.error.message)
        return reply


def _bias_entry(text: str) -> tuple[int, float]:
    token, _, bias = text.partition("=")
    try:
        return int(token), _finite(bias)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"expected ID=BIAS (e.g. 1234=-100), got {text!r}") from None


def _token_ids(text: str) -> list[int]:
    """``--input-ids``: comma-separated token ids (a lambda here made argparse say "invalid <lambda> value")."""
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids (e.g. 9707,1879), got {text!r}") from None


def _finite(text: str) -> float:
    """A number argument; nan and inf are refused here: JSON has no such numbers, and msgspec would
    send them as null, the field's default, so ``--temperature nan`` ran at the default temperature."""
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _utf8(text: str) -> str:
    """A text argument. Python hands over bytes that are no UTF-8 (a shell in another encoding) as
    lone surrogates, which no request can encode (a UnicodeEncodeError traceback)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"not UTF-8 text: {text!r} (use a UTF-8 locale, or --input-ids)") from None
    return text


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="moebus request", description="send one request to a running moebus stack")
    ap.add_argument("--url", default=nats_url_from_env(), help="NATS URL (printed by `moebus up`; default: $MOEBUS_NATS_URL, else nats://127.0.0.1:4222)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", type=_utf8, help="raw prompt text")
    src.add_argument("--chat", type=_utf8, help="one user message; the model's chat template is applied")
    src.add_argument("--input-ids", type=_token_ids, help="comma-separated token ids")
    ap.add_argument("--model", type=_utf8)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=_finite)
    ap.add_argument("--top-p", type=_finite)
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--presence-penalty", type=_finite, default=0.0)
    ap.add_argument("--frequency-penalty", type=_finite, default=0.0)
    ap.add_argument("--repetition-penalty", type=_finite)
    ap.add_argument("--min-p", type=_finite)
    ap.add_argument("--min-tokens", type=int, default=0, help="EOS and stop strings cannot end generation before this many tokens")
    ap.add_argument("--logit-bias", action="append", default=[], type=_bias_entry, metavar="ID=BIAS",
                    help="add BIAS (-100..100) to token ID's logit (repeatable)")
    ap.add_argument("--ignore-eos", action="store_true", help="generate --max-tokens tokens whatever the model's end-of-sequence token")
    ap.add_argument("--stop", action="append", default=[], type=_utf8, help="stop string (repeatable)")
    ap.add_argument("--logprobs", action="store_true", help="show each generated token's log-probability")
    ap.add_argument("--top-logprobs", type=int, default=0, metavar="K", help="also the K most likely tokens at each position (implies --logprobs)")
    ap.add_argument("--timeout-ms", type=int)
    ap.add_argument("--tokenize", action="store_true",
                    help="print the prompt's token ids as the model is fed them (with --input-ids: their text) instead of generating")
    ap.add_argument("--msgpack", action="store_true", help="send msgpack instead of JSON")
    ap.add_argument("--json", action="store_true", help="print the raw replies as JSON lines")
    return ap.parse_args(argv)


async def _run(a: argparse.Namespace) -> int:
    req = GenerateRequest(
        model=a.model,
        prompt=a.prompt,
        messages=[ChatMessage("user", a.chat)] if a.chat is not None else None,
        input_ids=a.input_ids,
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        seed=a.seed,
        presence_penalty=a.presence_penalty,
        frequency_penalty=a.frequency_penalty,
        repetition_penalty=a.repetition_penalty,
        min_p=a.min_p,
        min_tokens=a.min_tokens,
        logit_bias=dict(a.logit_bias) or None,
        ignore_eos=a.ignore_eos,
        stop=a.stop,
        logprobs=a.logprobs or a.top_logprobs > 0,
        top_logprobs=a.top_logprobs,
        timeout_ms=a.timeout_ms,
    )
    async with connect(a.url, "moebus-request") as bus:
        client = Client(bus, MSGPACK if a.msgpack else JSON)
        try:
            if a.tokenize:
                await _tokenize(client, a, req)
            elif a.stream:
                token_logprobs: list[TokenLogprob] = []
                async for chunk in client.stream(req):
                    if a.json:
                        print(msgspec.json.encode(chunk).decode(), flush=True)
                    else:
                        print(chunk.text, end="", flush=True)
                    token_logprobs += chunk.token_logprobs or []
                    last = chunk
                if not a.json:
                    print()
                    _print_logprobs(token_logprobs)
                    _summary(last.finish_reason, last.usage, last.timing)
            else:
                resp = await client.generate(req)
                if a.json:
                    print(msgspec.json.encode(resp).decode())
                else:
                    print(resp.text)
                    _print_logprobs(resp.token_logprobs or [])
                    _summary(resp.finish_reason, resp.usage, resp.timing)
        except GenerateError as e:
            if a.json:
                print(json.dumps({"type": "error", "error": {"code": e.code, "message": e.message}, "request_id": e.request_id}))
            print(f"moebus request: error {e.code}: {e.message}", file=sys.stderr)
            return 1
    return 0


async def _tokenize(client: Client, a: argparse.Namespace, req: GenerateRequest) -> None:
    """``--tokenize``: the prompt's ids (``llm.tokenize``), or the text of ``--input-ids`` (``llm.detokenize``)."""
    if req.input_ids is not None:
        text = await client.detokenize(DetokenizeRequest(model=req.model, tokens=req.input_ids))
        print(msgspec.json.encode(text).decode() if a.json else text.prompt)
        return
    tokenized = await client.tokenize(TokenizeRequest(model=req.model, prompt=req.prompt, messages=req.messages))
    print(msgspec.json.encode(tokenized).decode() if a.json else ",".join(map(str, tokenized.tokens)))
    if not a.json:
        print(f"[count={tokenized.count} max_model_len={tokenized.max_model_len}]", file=sys.stderr)


def _print_logprobs(entries: list[TokenLogprob]) -> None:
    """One stderr line per generated token: the token, its logprob, then its alternatives."""
    for e in entries:
        alternatives = "  ".join(f"{t.token!r} {t.logprob:.4f}" for t in e.top_logprobs)
        print(f"{e.token!r} {e.logprob:.4f}" + (f"  | {alternatives}" if alternatives else ""), file=sys.stderr)


def _summary(finish_reason: Any, usage: Any, timing: Any) -> None:
    print(
        f"[finish={finish_reason} prompt_tokens={usage.prompt_tokens} completion_tokens={usage.completion_tokens} "
        f"ttft={timing.ttft_ms:.1f}ms total={timing.total_ms:.1f}ms]",
        file=sys.stderr,
    )


def main(argv: list[str]) -> int:
    configure_tool_logging("moebus-request")
    try:
        return asyncio.run(_run(_parse(argv)))
    except Unreachable as e:
        print(f"moebus request: {e}", file=sys.stderr)
        return 1
