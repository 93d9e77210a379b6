"""OpenAI's completions and chat-completions bodies, and their translation to moebus' API.

Requests decode strictly (msgspec, unknown fields refused with their name); fields that
OpenAI or vLLM define but moebus does not implement are accepted only at their no-op values
(the requests' ``NO_OPS``; null, their default, is one): no ``suffix``, ``best_of`` > 1,
vLLM's ``use_beam_search``, ``length_penalty`` but 1,
``prompt_logprobs``, guided decoding (``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``, ``structured_outputs``); in chat no
response formats, ``store: true``, ``service_tier`` but "auto" or "default", ``modalities`` but
``["text"]``, ``reasoning_effort`` (no faithful mapping), ``prediction``, ``tool_choice``
"required" or a named function, ``parallel_tool_calls: false``, strict tools. Anything else is
an ``invalid_request`` naming the field, never silently ignored. Chat
``tools`` reach the chat template (with the messages' tool calls, tool answers and reasoning,
call arguments parsed to objects as vLLM hands them over); with ``tool_choice`` "auto" (the
default with tools) only on a server started with tool-call parsing, whose answers are then
split into content and ``tool_calls`` (`services.openai.tool_parsing`), as is reasoning into
``reasoning_content`` on a server started with a reasoning parser (vLLM's ``include_reasoning:
false`` drops it: ``reasoning_content`` null, no reasoning deltas). ``user`` and chat's
``metadata`` (tags of a stored completion; none is stored) are accepted and unused, as is
OpenAI's ``prompt_cache_key`` (any string): a hint for OpenAI's routing to its prompt caches,
which moebus' scheduler already does by the prompt itself (prefix affinity: the prefill instance
its first KV page's key picks), the only thing a cached page can be reused for; routing by the
hint instead could only send prompts that share pages to different instances, and the cache's
isolation is ``cache_salt``'s, not this hint's. vLLM's ``cache_salt`` (a non-empty string, the
gateway's bound) isolates a tenant's prefix cache: a request reuses only pages cached by
requests with the same salt (or, without one, without one), its page keys salted
(`shared.prefix_keys`) in prefill's cache and in the scheduler's prefix affinity alike. vLLM's
``request_id`` is the request's id as an ``X-Request-Id`` header would be; the header, when
both are sent, wins (vLLM's precedence; `services.openai.request_ids`). vLLM's
``add_special_tokens`` (default true for completions, false for chat, as in vLLM) is taken at
either value: Qwen3's tokenizer, the only one moebus serves, adds no special token (no BOS; its
post-processor is ByteLevel alone), so both values give the same prompt tokens
(``tests/model/test_tokenizer.py`` checks it).
``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` (token ids as strings, as
OpenAI sends them) are OpenAI's; ``top_k``, ``min_p``, ``min_tokens``,
``seed``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``priority`` (refused by a
scheduler whose ``scheduling_policy`` is "fcfs", vLLM's default, unless 0),
``include_stop_str_in_output`` and chat's ``chat_template_kwargs`` (e.g.
``{"enable_thinking": false}`` for Qwen3), ``add_generation_prompt`` and
``continue_final_message`` (an answer begun by the caller) pass through as in vLLM. A completions request
without ``max_tokens`` gets 16 tokens (OpenAI's and vLLM's default); a chat request without
one, or any with ``max_tokens: null``, may generate what the context leaves after its prompt,
up to the gateway's ``max_tokens_limit`` (vLLM's rule; the native request's ``max_tokens: null``).
vLLM's ``top_k: -1`` (disabled) and negative seeds (int64) are taken as vLLM takes them.
Fields OpenAI's spec lets be ``null`` (``n``, ``stream``, the penalties, ``priority``, ``echo``, chat's
``logprobs``, ``stream_options.include_usage``) take their default when they are.
Log-probabilities: chat's ``logprobs`` / ``top_logprobs`` and completions' ``logprobs: k``
become the request's ``logprobs`` / ``top_logprobs`` (the gateway checks the bound, 20);
`services.openai.logprobs` shapes the answer (vLLM's ``return_tokens_as_token_ids`` names its tokens
``token_id:<id>``). ``n`` choices (1 to the server's ``--max-n``)
of each prompt (completions take a batch: a list of texts or of token-id lists, up to
``--max-prompts``) are requests of their own (`services.openai.choices`), merged here into
one object, choice ``p * n + i`` the ``i``-th of prompt ``p`` as in vLLM.

Responses follow OpenAI's shapes (with vLLM's ``stop_reason`` beside ``finish_reason``):
``text_completion`` / ``chat.completion`` objects, and
for ``stream: true`` their chunk objects as server-sent events ending with ``[DONE]``
(a usage-only chunk before it when ``stream_options.include_usage``, and with vLLM's
``continuous_usage_stats`` too every chunk's choice's usage so far; ``stream_options``
without ``stream: true`` is refused, as vLLM does). Usage counts each
prompt once and the completion tokens of every choice, as OpenAI and vLLM do, with
``prompt_tokens_details.cached_tokens`` (prompt tokens served from prefill's prefix cache). Errors carry
OpenAI's ``{"error": {"message", "type", "param", "code"}}`` (``param`` null) with an HTTP status per moebus code.
"""

from __future__ import annotations

import functools
import time
from typing import Any, ClassVar, Literal, TypeVar

import msgspec

from schemas.api import ChatMessage, GenerateChunk, GenerateRequest, GenerateResponse, Tool, ToolCall, ToolCallFunction, ToolFunction, Usage
from services.openai.logprobs import CompletionLogprobs, chat_logprobs
from services.openai.tool_parsing import ChatOutputParser, parse_answer
from shared.model.sampling_params import MAX_TOP_LOGPROBS

# moebus error code -> (HTTP status, OpenAI error type)
ERRORS: dict[str, tuple[int, str]] = {
    "invalid_request": (400, "invalid_request_error"),
    "unknown_model": (404, "invalid_request_error"),
    "overloaded": (503, "overloaded_error"),
    "timeout": (504, "timeout_error"),
    "cancelled": (409, "cancelled_error"),
    "unavailable": (503, "unavailable_error"),
    "internal": (500, "internal_error"),
    # The HTTP layer's refusals (`services.http.HttpError`), before any moebus code applies.
    "invalid_api_key": (401, "invalid_request_error"),  # OpenAI's code for a missing or wrong key (`services.openai.access`)
    "unknown_url": (404, "invalid_request_error"),  # OpenAI's code for a path it does not serve
    "method_not_allowed": (405, "invalid_request_error"),
    "request_timeout": (408, "invalid_request_error"),
    "request_too_large": (413, "invalid_request_error"),
}
# The code of an `HttpError` by its status (a malformed request, 400, is an invalid_request as any other).
HTTP_CODES: dict[int, str] = {400: "invalid_request", 401: "invalid_api_key", 404: "unknown_url", 405: "method_not_allowed", 408: "request_timeout",
                              413: "request_too_large"}


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = False  # null: false (OpenAI's spec lets it be null)
    continuous_usage_stats: bool | None = False  # vLLM's: with include_usage, usage on every chunk too


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: str | None = None
    # The payloads of OpenAI's and vLLM's other part types: decoded so that the refusal of such a
    # part names its type (`_text`), not an "unknown field".
    image_url: Any = None
    input_audio: Any = None
    file: Any = None
    refusal: Any = None
    video_url: Any = None
    audio_url: Any = None


class FunctionCallIn(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str | dict[str, Any] | None = None  # OpenAI sends JSON text


class ToolCallIn(msgspec.Struct, forbid_unknown_fields=True):
    function: FunctionCallIn
    id: str | None = None
    type: Literal["function"] = "function"


class ChatMessageIn(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    reasoning_content: str | None = None  # assistant (vLLM's field)


class FunctionIn(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolIn(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionIn


class _Sampling(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields both endpoints share. OpenAI's spec lets a client send ``null`` for the fields in
    ``NULL_IS_DEFAULT`` (SDK wrappers that send every field do), meaning their default, as
    OpenAI and vLLM take it: `__post_init__` puts the default in, so they are never None after
    decoding."""

    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = ("n", "stream", "presence_penalty", "frequency_penalty", "priority",
                                                  "skip_special_tokens")
    # Fields taken only at the values that ask for nothing moebus does not do (null: unset), any
    # other value refused naming the field (`_check_no_ops`): vLLM's extensions, here those that
    # vLLM's completions and chat requests both have.
    NO_OPS: ClassVar[dict[str, tuple[Any, ...]]] = {
        "use_beam_search": (None, False), "length_penalty": (None, 1.0), "prompt_logprobs": (None,),
        "guided_json": (None,),
        "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,), "structured_outputs": (None,)}

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's extension
    include_stop_str_in_output: bool = False  # vLLM's extension
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model's EOS
    min_p: float | None = None  # vLLM's extension
    min_tokens: int = 0  # vLLM's extension
    logit_bias: dict[int, float] | None = None  # OpenAI sends the token ids as JSON object keys: msgspec reads them as ints
    user: str | None = None
    prompt_cache_key: str | None = None  # OpenAI's routing hint for its prompt caches: taken, unused (module doc)
    cache_salt: str | None = None  # vLLM's: the prefix cache shared only with requests of the same salt (the gateway checks it)
    request_id: str | None = None  # vLLM's: the request's id when no X-Request-Id header gives one (`services.openai.request_ids`)
    priority: int | None = 0  # vLLM's: the order of waiting requests under the scheduler's "priority" policy (the gateway checks it)
    # NO_OPS' vLLM fields (vLLM's types; guided decoding's any, so that every value is refused by name)
    skip_special_tokens: bool | None = True  # vLLM's: false spells special tokens in the text
    # vLLM's; taken either way, unused: with the Qwen3 tokenizers moebus serves, transformers' decode spells
    # special tokens the same with or without it (tests/model/test_tokenizer.py)
    spaces_between_special_tokens: bool | None = True
    use_beam_search: bool | None = False
    length_penalty: float | None = 1.0  # beam search's
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name tokens "token_id:<id>" (null: false)
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last this-many tokens (-1: the context)
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    def __post_init__(self) -> None:
        for name, default in _null_defaults(type(self)).items():
            if getattr(self, name) is None:
                setattr(self, name, default)


@functools.cache
def _null_defaults(kind: type[_Sampling]) -> dict[str, Any]:
    """The defaults of ``kind.NULL_IS_DEFAULT``'s fields, once per class: `msgspec.structs.fields`
    resolves the class's type hints, 0.2-0.6 ms on the 2-core CPU host of bench/control_plane.py,
    which every request body paid while `__post_init__` called it."""
    defaults = {f.name: f.default for f in msgspec.structs.fields(kind)}
    return {name: defaults[name] for name in kind.NULL_IS_DEFAULT}


class CompletionRequest(_Sampling, kw_only=True):
    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = (*_Sampling.NULL_IS_DEFAULT, "echo")
    NO_OPS: ClassVar[dict[str, tuple[Any, ...]]] = {**_Sampling.NO_OPS, "suffix": (None,), "best_of": (None, 1)}

    prompt: str | list[Any]  # text, token ids, or a batch of either (checked by `completion_prompts`)
    # OpenAI's and vLLM's default for completions (chat has none); null: what the context leaves
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    add_special_tokens: bool = True  # vLLM's; Qwen3's tokenizer adds none either way (module doc)
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = (*_Sampling.NULL_IS_DEFAULT, "logprobs")
    # OpenAI's chat fields for what moebus does not do (its legacy completions have none of them).
    # reasoning_effort has no faithful mapping: Qwen3's template reads no effort, only
    # chat_template_kwargs' enable_thinking, a switch, not a level.
    NO_OPS: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_Sampling.NO_OPS, "store": (None, False), "service_tier": (None, "auto", "default"), "modalities": (None, ["text"]),
        "reasoning_effort": (None,), "prediction": (None,)}

    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[ToolIn] | None = None
    tool_choice: str | dict[str, Any] | None = None  # None: "auto" with tools, else "none" (OpenAI's default)
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension, e.g. {"enable_thinking": false} for Qwen3
    add_generation_prompt: bool = True  # vLLM's extension
    continue_final_message: bool = False  # vLLM's extension: the answer continues the last message (with add_generation_prompt false)
    add_special_tokens: bool = False  # vLLM's (the template's text has its special tokens); Qwen3's tokenizer adds none either way (module doc)
    include_reasoning: bool = True  # vLLM's: false leaves reasoning_content out of the answer (with a reasoning parser)
    store: bool | None = None
    metadata: dict[str, str] | None = None  # OpenAI's tags of a stored completion: none is stored, so it is taken and unused
    service_tier: str | None = None
    modalities: list[str] | None = None
    reasoning_effort: Any = None
    prediction: Any = None  # a predicted output (speculation on given text)


Body = TypeVar("Body", bound=msgspec.Struct)


class InvalidRequest(ValueError):
    """A body this frontend refuses (message names the field); answered as ``invalid_request``."""


def decode(body: bytes, kind: type[Body]) -> Body:
    """A request body as ``kind``, strictly; else `InvalidRequest` saying what is wrong."""
    if not body:  # msgspec would say "Input data was truncated"
        raise InvalidRequest("request body: empty; send the endpoint's JSON object (with Content-Length, or chunked)")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.DecodeError as e:
        raise InvalidRequest(f"request body: {e}") from None
    except RecursionError as e:  # msgspec's answer to a value of a free-form field nested a thousand deep
        raise InvalidRequest(f"request body: nested too deeply ({e})") from None


def _check_no_ops(req: _Sampling, others: dict[str, str]) -> None:
    """Refuses, naming them, the fields of ``req.NO_OPS`` sent with a value other than their no-op
    ones, and ``others`` (name -> what is accepted of it, for fields the caller found used)."""
    refused = {name: " or ".join(msgspec.json.encode(v).decode() for v in accepted)
               for name, accepted in req.NO_OPS.items() if getattr(req, name) not in accepted} | others
    if refused:
        raise InvalidRequest("not supported by moebus: " + "; ".join(f"{name} (accepted only as {ok})" for name, ok in refused.items()))


def check_n(req: _Sampling, max_n: int) -> int:
    """The number of choices asked for, within [1, max_n]."""
    if not 1 <= req.n <= max_n:
        raise InvalidRequest(f"n must be in [1, {max_n}] (this server's --max-n), got {req.n}")
    return req.n


def _common(req: _Sampling, request_id: str) -> dict[str, Any]:
    if req.stream_options is not None and not req.stream:  # vLLM's check and words: options of a stream that is not one
        raise InvalidRequest("Stream options can only be defined when `stream=True`.")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    # vLLM's conventions, which its clients send: top_k -1 disables it (moebus' 0); a seed is any
    # int64, a negative one taken modulo 2**64 (two's complement) so it stays a fixed seed of its own.
    if req.seed is not None and not -(2**63) <= req.seed < 2**64:
        raise InvalidRequest(f"seed must be an integer in [-2**63, 2**64), got {req.seed}")
    seed = None if req.seed is None else req.seed % 2**64
    top_k = 0 if req.top_k == -1 else req.top_k
    # An empty model name is the served model, as vLLM takes it (clients left unconfigured send "").
    return {"model": req.model or None, "max_tokens": req.max_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "top_k": top_k, "seed": seed, "stop": stop,
            "stream": req.stream, "request_id": request_id, "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty, "repetition_penalty": req.repetition_penalty,
            "ignore_eos": req.ignore_eos, "min_p": req.min_p, "min_tokens": req.min_tokens, "logit_bias": req.logit_bias,
            "stop_token_ids": list(req.stop_token_ids or []), "include_stop_str_in_output": req.include_stop_str_in_output,
            "skip_special_tokens": req.skip_special_tokens, "truncate_prompt_tokens": req.truncate_prompt_tokens,
            "cache_salt": req.cache_salt, "priority": req.priority}


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


def echo_only(req: CompletionRequest) -> bool:
    """``echo`` with ``max_tokens: 0``: the prompt and its logprobs alone, nothing generated
    (how older lm-evaluation-harness and HELM score a text; vLLM serves it so): moebus generates
    one token, which the answer leaves out (`Shapes`) and usage counts, as vLLM's does."""
    return bool(req.echo) and req.max_tokens == 0


def completion_requests(req: CompletionRequest, request_id: str, max_prompts: int) -> list[GenerateRequest]:
    """The moebus requests of a ``/v1/completions`` body, one per prompt (a token-id prompt as
    ``input_ids``; ``logprobs: k`` asks for the k most likely tokens too; ``echo`` for the
    prompt's tokens and, with ``logprobs``, their logprobs: ``prompt_logprobs``)."""
    _check_no_ops(req, {})
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:  # named as the client sent it, not as moebus's top_logprobs
        raise InvalidRequest(f"logprobs (alternatives per token) must be an integer in [0, {MAX_TOP_LOGPROBS}], got {req.logprobs}")
    logprobs = {} if req.logprobs is None else {"logprobs": True, "top_logprobs": req.logprobs}
    if req.echo:
        logprobs["prompt_logprobs"] = req.logprobs or 0
    common = _common(req, request_id)
    if echo_only(req):
        common["max_tokens"] = 1
    return [GenerateRequest(**prompt, **logprobs, **common) for prompt in completion_prompts(req.prompt, max_prompts)]


def calls_tools(req: ChatCompletionRequest) -> bool:
    """Whether the answer is parsed for tool calls: tools given and ``tool_choice`` "auto"
    (explicit or by default); with "none" the tools are still in the prompt, as in vLLM."""
    return bool(req.tools) and req.tool_choice in (None, "auto")


def _check_tools(req: ChatCompletionRequest, auto_tools: bool) -> None:
    """``tool_choice`` "none" or "auto" ("auto" with tools only where this frontend parses tool
    calls). "required", a named function, ``parallel_tool_calls: false`` and strict schemas
    would need decoding constrained to a call or a schema, which moebus does not have, so they
    are refused rather than hoped for."""
    choice = req.tool_choice
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        raise InvalidRequest(f"tool_choice: a named function ({name!r}) is not supported by moebus: it cannot force the model to call it "
                             "(no guided decoding); use \"auto\" or \"none\"")
    if choice == "required":
        raise InvalidRequest("tool_choice: \"required\" is not supported by moebus: it cannot force the model to call a tool "
                             "(no guided decoding); use \"auto\" or \"none\"")
    if choice not in (None, "none", "auto"):
        raise InvalidRequest(f"tool_choice: \"none\" or \"auto\", got {choice!r}")
    if calls_tools(req) and not auto_tools:
        raise InvalidRequest("tools with tool_choice \"auto\" need tool-call parsing, off on this server (start moebus openai with "
                             "--enable-auto-tool-choice --tool-call-parser hermes, as vLLM); tool_choice \"none\" sends the tools unparsed")
    if req.parallel_tool_calls is False:
        raise InvalidRequest("parallel_tool_calls: false is not supported by moebus (it cannot stop the model calling several tools)")
    strict = [t.function.name for t in req.tools or [] if t.function.strict]
    if strict:
        raise InvalidRequest(f"tools: strict function schemas ({', '.join(strict)}) are not supported by moebus (no guided decoding)")


def _text(content: str | list[ContentPart] | None, where: str) -> str:
    """A message's text: its text parts one per line, as vLLM joins them for a chat template that
    takes a string (Qwen3's)."""
    if isinstance(content, list):
        if other := [p.type for p in content if p.type != "text" or p.text is None]:
            raise InvalidRequest(f"{where}: only text parts are supported, got {', '.join(map(repr, other))}")
        return "\n".join(p.text or "" for p in content)
    return content or ""


def _arguments(arguments: str | dict[str, Any] | None, where: str) -> dict[str, Any]:
    """A call's arguments as an object, as vLLM hands them to the chat template (OpenAI sends
    JSON text; none is {}). Parsed as strictly as the body: ``json.loads`` let a lone surrogate
    (``"\\ud800"``) through, which no request to the stack can encode (a 500)."""
    if isinstance(arguments, dict):
        return arguments
    if not arguments:
        return {}
    try:
        parsed = msgspec.json.decode(arguments)
    except (msgspec.DecodeError, RecursionError) as e:
        raise InvalidRequest(f"{where}: not JSON ({e})") from None
    if not isinstance(parsed, dict):
        raise InvalidRequest(f"{where}: must be a JSON object, got {type(parsed).__name__}")
    return parsed


def _message(m: ChatMessageIn, i: int) -> ChatMessage:
    """A message for the chat template: text parts joined, ``developer`` a system message
    (OpenAI's newer name); tool calls, the answered call's id and reasoning only where they belong."""
    where = f"messages[{i}]"
    misplaced = [name for name, role in (("tool_calls", "assistant"), ("reasoning_content", "assistant"), ("tool_call_id", "tool"))
                 if getattr(m, name) is not None and m.role != role]
    if misplaced:
        raise InvalidRequest(f"{where}.{misplaced[0]}: not allowed on a {m.role} message")
    calls = None if m.tool_calls is None else [
        ToolCall(id=c.id, function=ToolCallFunction(c.function.name, _arguments(c.function.arguments, f"{where}.tool_calls[{j}].function.arguments")))
        for j, c in enumerate(m.tool_calls)]
    return ChatMessage("system" if m.role == "developer" else m.role, _text(m.content, f"{where}.content"), name=m.name, tool_calls=calls,
                       tool_call_id=m.tool_call_id, reasoning_content=m.reasoning_content)


def chat_messages(messages: list[ChatMessageIn]) -> list[ChatMessage]:
    """The messages of a chat body for the chat template (`_message`); ``/tokenize`` takes them too."""
    return [_message(m, i) for i, m in enumerate(messages)]


def chat_tools(tools: list[ToolIn] | None) -> list[Tool] | None:
    """The tools of a chat body for the chat template (none: None, as an empty list)."""
    return [Tool(function=ToolFunction(t.function.name, t.function.description, t.function.parameters)) for t in tools] if tools else None


def chat_request(req: ChatCompletionRequest, request_id: str, auto_tools: bool = False) -> GenerateRequest:
    """The moebus request of a ``/v1/chat/completions`` body (``auto_tools``: this frontend parses
    tool calls, so ``tool_choice`` "auto" is served)."""
    text = (req.response_format or {}).get("type", "text") == "text"
    _check_no_ops(req, {} if text else {"response_format": 'null or {"type": "text"}'})
    _check_tools(req, auto_tools)
    fields = _common(req, request_id)
    if req.max_completion_tokens is not None:
        fields["max_tokens"] = req.max_completion_tokens
    return GenerateRequest(messages=chat_messages(req.messages), tools=chat_tools(req.tools), logprobs=req.logprobs,
                           top_logprobs=req.top_logprobs or 0, chat_template_kwargs=req.chat_template_kwargs,
                           add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message, **fields)


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

    def __init__(self, chat: bool, request_id: str, model: str, n: int = 1, prompts: int = 1, echo: list[str | None] | None = None,
                 reasoning: bool = False, tool_calls: bool = False, echo_only: bool = False, continuous_usage: bool = False,
                 drop_reasoning: bool = False, token_ids_as_names: bool = False) -> None:
        """``echo`` (completions): per prompt, its text as given (None for a token-id prompt,
        spelled from its tokens' bytes), put before each of its choices' text; ``echo_only``: the
        choices are the echoed prompt alone, their generated token left out (`echo_only`). ``reasoning`` and
        ``tool_calls`` (chat): each choice's text is split into reasoning, content and tool calls
        (`services.openai.tool_parsing`); ``drop_reasoning`` (vLLM's ``include_reasoning: false``,
        with ``reasoning``): the reasoning is split off and left out, its chunks not sent.
        ``continuous_usage`` (vLLM's ``continuous_usage_stats`` with ``include_usage``): every chunk
        carries its choice's usage so far, as vLLM's do. ``token_ids_as_names`` (vLLM's
        ``return_tokens_as_token_ids``): logprobs name tokens ``token_id:<id>``."""
        self.continuous_usage = continuous_usage
        self.token_ids_as_names = token_ids_as_names
        self.chat = chat
        self.reasoning = reasoning
        self.drop_reasoning = drop_reasoning
        self.tool_calls = tool_calls
        self._parsers = [ChatOutputParser(reasoning, tool_calls) for _ in range(n)] if chat and (reasoning or tool_calls) else None
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.model = model
        self.n = n
        self.echo = echo
        self.echo_only = echo_only
        self.created = int(time.time())
        self._completion_logprobs = [CompletionLogprobs(token_ids_as_names) for _ in range(n * prompts)]  # per choice: a stream's text offsets go on

    def _object(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _logprobs(self, index: int, r: GenerateResponse | GenerateChunk) -> dict[str, Any] | None:
        if self.chat:
            return chat_logprobs(r.token_logprobs, self.token_ids_as_names)
        generated = [] if self.echo_only and r.token_logprobs is not None else r.token_logprobs
        return self._completion_logprobs[index](generated, r.prompt_logprobs if self.echo else None)

    def _text(self, index: int, r: GenerateResponse | GenerateChunk) -> str:
        """A completions choice's text (or chunk's), after the echoed prompt where it comes."""
        generated = "" if self.echo_only else r.text
        if self.echo is None or r.prompt_logprobs is None:
            return generated
        given = self.echo[index // self.n]
        prompt = given if given is not None else bytes(b for e in r.prompt_logprobs for b in e.bytes).decode("utf-8", errors="replace")
        return prompt + generated

    def response(self, responses: list[GenerateResponse]) -> dict[str, Any]:
        """The answer of choices ``responses`` (in choice order)."""
        choices = []
        for i, r in enumerate(responses):
            finish_reason: str = r.finish_reason
            if not self.chat:
                content: dict[str, Any] = {"text": self._text(i, r)}
            elif self._parsers is None:
                content = {"message": {"role": "assistant", "content": r.text}}
            else:
                parsed = parse_answer(r.text, self.reasoning, self.tool_calls)
                message: dict[str, Any] = {"role": "assistant", "content": parsed.content or None}
                if self.reasoning:
                    message["reasoning_content"] = None if self.drop_reasoning else parsed.reasoning or None
                if parsed.tool_calls:
                    message["tool_calls"] = [call.openai() for call in parsed.tool_calls]
                    finish_reason = "tool_calls"  # whatever ended the text, as vLLM reports it
                content = {"message": message}
            choices.append({"index": i, **content, "logprobs": self._logprobs(i, r), **_ending(finish_reason, r.stop_reason)})
        body = self._object("chat.completion" if self.chat else "text_completion", choices)
        body["model"] = responses[0].model
        return body | {"usage": _usage(merged_usage([r.usage for r in responses], self.n))}

    def first_chunk(self, index: int, usage: Usage | None) -> dict[str, Any] | None:
        """Chat streams open each choice with the assistant's role (completions have no such chunk);
        ``usage``: the first chunk's to come, whose prompt it counts (the chat's one prompt)."""
        if not self.chat:
            return None
        return self._with_usage(self._object("chat.completion.chunk", [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                                        "logprobs": None, "finish_reason": None}]),
                                None if usage is None else Usage(usage.prompt_tokens, 0, usage.cached_tokens))

    def _with_usage(self, event: dict[str, Any], usage: Usage | None) -> dict[str, Any]:
        return event | {"usage": _usage(usage)} if self.continuous_usage and usage is not None else event

    def chunk(self, c: GenerateChunk, index: int) -> dict[str, Any] | None:
        """Choice ``index``'s chunk ``c``, with the logprobs of the tokens it took; None when a
        parsed chat choice has nothing to send yet (its text held back, no logprobs asked for)."""
        if self._parsers is not None:
            return self._parsed_chunk(c, index)
        if self.chat:
            delta = {"content": c.text} if c.text or c.finish_reason is None else {}
            return self._with_usage(self._object("chat.completion.chunk", [{"index": index, "delta": delta, "logprobs": self._logprobs(index, c),
                                                                            **_ending(c.finish_reason, c.stop_reason)}]), c.usage)
        return self._with_usage(self._object("text_completion", [{"index": index, "text": self._text(index, c), "logprobs": self._logprobs(index, c),
                                                                  **_ending(c.finish_reason, c.stop_reason)}]), c.usage)

    def _parsed_chunk(self, c: GenerateChunk, index: int) -> dict[str, Any] | None:
        """A chat chunk of a parsed choice: ``delta`` holds the reasoning, content and whole tool
        calls (each with its index in the choice) that ``c``'s text completes; the last chunk
        also what was held back, and finish reason "tool_calls" once a call was made."""
        parser = self._parsers[index]  # type: ignore[index]
        parsed = parser.feed(c.text)
        if c.finish_reason is not None:
            parsed.extend(parser.finish())
        delta: dict[str, Any] = {}
        if parsed.reasoning and not self.drop_reasoning:
            delta["reasoning_content"] = parsed.reasoning
        if parsed.content:
            delta["content"] = parsed.content
        if parsed.tool_calls:
            first = parser.tool_calls - len(parsed.tool_calls)
            delta["tool_calls"] = [{"index": first + k, **call.openai()} for k, call in enumerate(parsed.tool_calls)]
        finish_reason = "tool_calls" if c.finish_reason is not None and parser.tool_calls else c.finish_reason
        logprobs = self._logprobs(index, c)
        if not delta and finish_reason is None and logprobs is None:
            return None
        return self._with_usage(self._object("chat.completion.chunk", [{"index": index, "delta": delta, "logprobs": logprobs,
                                                                        **_ending(finish_reason, c.stop_reason)}]), c.usage)

    def usage_chunk(self, u: Usage) -> dict[str, Any]:
        return self._object("chat.completion.chunk" if self.chat else "text_completion", []) | {"usage": _usage(u)}


def _ending(finish_reason: str | None, stop_reason: str | int | None) -> dict[str, Any]:
    """A choice's ``finish_reason`` and, once it has one, vLLM's ``stop_reason``: the stop string
    or ``stop_token_ids`` token that ended it (null for EOS or the length limit)."""
    return {"finish_reason": finish_reason} if finish_reason is None else {"finish_reason": finish_reason, "stop_reason": stop_reason}


def error_body(code: str, message: str) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI error object) of a moebus error code."""
    status, kind = ERRORS.get(code, ERRORS["internal"])
    return status, {"error": {"message": message, "type": kind, "param": None, "code": code}}


def http_error_body(status: int, message: str) -> dict[str, Any]:
    """The OpenAI error object of the HTTP layer's refusal with ``status`` (one with no code of its
    own, were the HTTP layer to add one, is an invalid_request: the request was refused as sent)."""
    return error_body(HTTP_CODES.get(status, "invalid_request"), message)[1]
