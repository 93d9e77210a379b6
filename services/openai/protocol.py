"""OpenAI's completions and chat-completions bodies, and their translation to moebus' API.

Requests decode strictly (msgspec, unknown fields refused with their name); fields that
OpenAI defines but moebus does not implement are accepted only at their no-op values
(no ``suffix``, ``best_of`` > 1, tools or response formats),
anything else is an ``invalid_request`` naming the field, never silently ignored. ``user``
is accepted and unused. ``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` (token
ids as strings, as OpenAI sends them) are OpenAI's; ``top_k``, ``min_p``, ``min_tokens``,
``seed``, ``repetition_penalty`` and ``ignore_eos`` pass through as in vLLM. Without
``max_tokens`` a request gets ``default_max_tokens`` (the server's ``--default-max-tokens``).
Log-probabilities: chat's ``logprobs`` / ``top_logprobs`` and completions' ``logprobs: k``
become the request's ``logprobs`` / ``top_logprobs`` (the gateway checks the bound, 20);
`services.openai.logprobs` shapes the answer. ``n`` choices (1 to the server's ``--max-n``)
of each prompt (completions take a batch: a list of texts or of token-id lists, up to
``--max-prompts``) are requests of their own (`services.openai.choices`), merged here into
one object, choice ``p * n + i`` the ``i``-th of prompt ``p`` as in vLLM.

Responses follow OpenAI's shapes: ``text_completion`` / ``chat.completion`` objects, and
for ``stream: true`` their chunk objects as server-sent events ending with ``[DONE]``
(a usage-only chunk before it when ``stream_options.include_usage``). Usage counts each
prompt once and the completion tokens of every choice, as OpenAI and vLLM do, with
``prompt_tokens_details.cached_tokens`` (prompt tokens served from prefill's prefix cache). Errors carry
OpenAI's ``{"error": {"message", "type", "code"}}`` with an HTTP status per moebus code.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import msgspec

from schemas.api import ChatMessage, GenerateChunk, GenerateRequest, GenerateResponse, Usage
from services.openai.logprobs import CompletionLogprobs, chat_logprobs

# moebus error code -> (HTTP status, OpenAI error type)
ERRORS: dict[str, tuple[int, str]] = {
    "invalid_request": (400, "invalid_request_error"),
    "unknown_model": (404, "invalid_request_error"),
    "overloaded": (503, "overloaded_error"),
    "timeout": (504, "timeout_error"),
    "cancelled": (409, "cancelled_error"),
    "unavailable": (503, "unavailable_error"),
    "internal": (500, "internal_error"),
}


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: str | None = None


class ChatMessageIn(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class _Sampling(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model's EOS
    min_p: float | None = None  # vLLM's extension
    min_tokens: int = 0  # vLLM's extension
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[Any]  # text, token ids, or a batch of either (checked by `completion_prompts`)
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class InvalidRequest(ValueError):
    """A body this frontend refuses (message names the field); answered as ``invalid_request``."""


def decode(body: bytes, kind: type[CompletionRequest] | type[ChatCompletionRequest]) -> CompletionRequest | ChatCompletionRequest:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.DecodeError as e:
        raise InvalidRequest(f"request body: {e}") from None


def _check_unsupported(unsupported: dict[str, bool]) -> None:
    bad = [name for name, used in unsupported.items() if used]
    if bad:
        raise InvalidRequest(f"not supported by moebus: {', '.join(bad)} (no suffix, best_of > 1, tools or response formats)")


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys) with integer ids; the gateway
    checks the ids against the vocabulary and the values' range."""
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise InvalidRequest(f"logit_bias: keys must be token ids (decimal strings), got {key!r}")
        out[int(key)] = value
    return out


def check_n(req: _Sampling, max_n: int) -> int:
    """The number of choices asked for, within [1, max_n]."""
    if not 1 <= req.n <= max_n:
        raise InvalidRequest(f"n must be in [1, {max_n}] (this server's --max-n), got {req.n}")
    return req.n


def _common(req: _Sampling, request_id: str, default_max_tokens: int) -> dict[str, Any]:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return {"model": req.model, "max_tokens": default_max_tokens if req.max_tokens is None else req.max_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "seed": req.seed, "stop": stop,
            "stream": req.stream, "request_id": request_id, "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty, "repetition_penalty": req.repetition_penalty,
            "ignore_eos": req.ignore_eos, "min_p": req.min_p, "min_tokens": req.min_tokens, "logit_bias": _logit_bias(req.logit_bias)}


def completion_prompts(prompt: str | list[Any], max_prompts: int) -> list[dict[str, Any]]:
    """The prompts of a ``/v1/completions`` body as moebus prompt fields (``prompt`` text or
    ``input_ids``): OpenAI's text, token ids, or a batch (list) of texts or of token-id lists."""
    def token_ids(ids: list[Any]) -> bool:
        return bool(ids) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)

    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if token_ids(prompt):
        return [{"input_ids": prompt}]
    if prompt and all(isinstance(p, str) for p in prompt):
        batch = [{"prompt": p} for p in prompt]
    elif prompt and all(isinstance(p, list) and token_ids(p) for p in prompt):
        batch = [{"input_ids": p} for p in prompt]
    else:
        raise InvalidRequest("prompt: a string, a list of token ids, or a non-empty list of either (strings, or lists of token ids)")
    if len(batch) > max_prompts:
        raise InvalidRequest(f"prompt: at most {max_prompts} prompts per request (this server's --max-prompts), got {len(batch)}")
    return batch


def completion_requests(req: CompletionRequest, request_id: str, default_max_tokens: int, max_prompts: int) -> list[GenerateRequest]:
    """The moebus requests of a ``/v1/completions`` body, one per prompt (a token-id prompt as
    ``input_ids``; ``logprobs: k`` asks for the k most likely tokens too; ``echo`` for the
    prompt's tokens and, with ``logprobs``, their logprobs: ``prompt_logprobs``)."""
    _check_unsupported({"suffix": req.suffix is not None, "best_of": req.best_of not in (None, 1)})
    logprobs = {} if req.logprobs is None else {"logprobs": True, "top_logprobs": req.logprobs}
    if req.echo:
        logprobs["prompt_logprobs"] = req.logprobs or 0
    common = _common(req, request_id, default_max_tokens)
    return [GenerateRequest(**prompt, **logprobs, **common) for prompt in completion_prompts(req.prompt, max_prompts)]


def chat_request(req: ChatCompletionRequest, request_id: str, default_max_tokens: int) -> GenerateRequest:
    """The moebus request of a ``/v1/chat/completions`` body: text parts of a message are joined;
    ``developer`` messages are system messages (OpenAI's newer name)."""
    _check_unsupported({"tools": bool(req.tools), "tool_choice": req.tool_choice not in (None, "none"),
                             "response_format": (req.response_format or {}).get("type", "text") != "text"})
    messages = []
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list):
            if any(p.type != "text" or p.text is None for p in m.content):
                raise InvalidRequest(f"messages[{i}].content: only text parts are supported")
            text = "".join(p.text or "" for p in m.content)
        else:
            text = m.content or ""
        messages.append(ChatMessage("system" if m.role == "developer" else m.role, text))
    fields = _common(req, request_id, default_max_tokens)
    if req.max_completion_tokens is not None:
        fields["max_tokens"] = req.max_completion_tokens
    return GenerateRequest(messages=messages, logprobs=req.logprobs, top_logprobs=req.top_logprobs or 0, **fields)


def merged_usage(usages: list[Usage], n: int) -> Usage:
    """The usage of the choices of one request, ``n`` per prompt in prompt order: each prompt
    once (its cached tokens those of its first choice), every choice's completion."""
    firsts = usages[::n]
    return Usage(sum(u.prompt_tokens for u in firsts), sum(u.completion_tokens for u in usages), sum(u.cached_tokens for u in firsts))


def _usage(u: Usage) -> dict[str, Any]:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


class Shapes:
    """The response objects of one request of ``prompts`` x ``n`` choices, choice ``p * n + i`` the
    ``i``-th of prompt ``p`` (``chat``: chat completions, one prompt; else completions)."""

    def __init__(self, chat: bool, request_id: str, model: str, n: int = 1, prompts: int = 1, echo: list[str | None] | None = None) -> None:
        """``echo`` (completions): per prompt, its text as given (None for a token-id prompt,
        spelled from its tokens' bytes), put before each of its choices' text."""
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.model = model
        self.n = n
        self.echo = echo
        self.created = int(time.time())
        self._completion_logprobs = [CompletionLogprobs() for _ in range(n * prompts)]  # per choice: a stream's text offsets go on

    def _object(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _logprobs(self, index: int, r: GenerateResponse | GenerateChunk) -> dict[str, Any] | None:
        if self.chat:
            return chat_logprobs(r.token_logprobs)
        return self._completion_logprobs[index](r.token_logprobs, r.prompt_logprobs if self.echo else None)

    def _text(self, index: int, r: GenerateResponse | GenerateChunk) -> str:
        """A completions choice's text (or chunk's), after the echoed prompt where it comes."""
        if self.echo is None or r.prompt_logprobs is None:
            return r.text
        given = self.echo[index // self.n]
        prompt = given if given is not None else bytes(b for e in r.prompt_logprobs for b in e.bytes).decode("utf-8", errors="replace")
        return prompt + r.text

    def response(self, responses: list[GenerateResponse]) -> dict[str, Any]:
        """The answer of choices ``responses`` (in choice order)."""
        choices = []
        for i, r in enumerate(responses):
            content = {"message": {"role": "assistant", "content": r.text}} if self.chat else {"text": self._text(i, r)}
            choices.append({"index": i, **content, "logprobs": self._logprobs(i, r), "finish_reason": r.finish_reason})
        body = self._object("chat.completion" if self.chat else "text_completion", choices)
        body["model"] = responses[0].model
        return body | {"usage": _usage(merged_usage([r.usage for r in responses], self.n))}

    def first_chunk(self, index: int) -> dict[str, Any] | None:
        """Chat streams open each choice with the assistant's role (completions have no such chunk)."""
        if not self.chat:
            return None
        return self._object("chat.completion.chunk", [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                                       "finish_reason": None}])

    def chunk(self, c: GenerateChunk, index: int) -> dict[str, Any]:
        """Choice ``index``'s chunk ``c``, with the logprobs of the tokens it took."""
        if self.chat:
            delta = {"content": c.text} if c.text or c.finish_reason is None else {}
            return self._object("chat.completion.chunk", [{"index": index, "delta": delta, "logprobs": self._logprobs(index, c),
                                                           "finish_reason": c.finish_reason}])
        return self._object("text_completion", [{"index": index, "text": self._text(index, c), "logprobs": self._logprobs(index, c),
                                                 "finish_reason": c.finish_reason}])

    def usage_chunk(self, u: Usage) -> dict[str, Any]:
        return self._object("chat.completion.chunk" if self.chat else "text_completion", []) | {"usage": _usage(u)}


def error_body(code: str, message: str) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI error object) of a moebus error code."""
    status, kind = ERRORS.get(code, ERRORS["internal"])
    return status, {"error": {"message": message, "type": kind, "code": code}}
