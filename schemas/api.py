"""The public API on `llm.generate`, `llm.models`, `llm.cancel`, `llm.tokenize` and
`llm.detokenize` (DESIGN §2).

JSON by default, msgpack when the request carries `Content-Type: application/msgpack`.
Replies are tagged by a `type` field ("response", "chunk", "error", "models", "tokenized",
"detokenized") so a client decodes one union and never guesses.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

FinishReason = Literal["stop", "length"]

# Error codes a client can receive, with their meaning:
ErrorCode = Literal[
    "invalid_request",  # the request itself is wrong (field, type, range, length)
    "unknown_model",  # `model` names a model this deployment does not serve
    "overloaded",  # no capacity within the scheduler's bounded wait; retry later
    "timeout",  # the request's deadline passed before it finished
    "cancelled",  # cancelled through llm.cancel
    "unavailable",  # a stage serving the request died or no stage of a role is up
    "internal",  # a bug or an unexpected failure inside moebus
]


class ToolCallFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: dict[str, Any] | str  # an object, or JSON text the chat template renders verbatim (as transformers does)


class ToolCall(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A function call an assistant message made (OpenAI's shape)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    """One message of a chat; the fields past `content` reach the chat template when given."""

    role: str  # "system", "user", "assistant", "tool", or whatever else the model's template knows
    content: str = ""
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers
    reasoning_content: str | None = None  # assistant: its reasoning (Qwen3's template renders it in <think>)


class ToolFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON Schema of the arguments


class Tool(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A function the model may call (OpenAI's shape); the chat template lists it in the prompt."""

    type: Literal["function"] = "function"
    function: ToolFunction


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """One completion. Exactly one of `prompt`, `messages`, `input_ids` is given.

    Encoded without the fields at their defaults (``omit_defaults``): the gateway refuses unknown
    fields, and `moebus openai` and the native client send this to it, so a request that uses no
    field newer than the gateway's code still reads there during a rolling upgrade."""

    model: str | None = None  # optional while one model is served
    prompt: str | None = None  # raw text, tokenized as is
    messages: list[ChatMessage] | None = None  # chat; the model's chat template is applied
    tools: list[Tool] | None = None  # with messages: functions the chat template offers the model
    chat_template_kwargs: dict[str, Any] | None = None  # with messages: template variables, e.g. {"enable_thinking": false} (vLLM's)
    add_generation_prompt: bool = True  # with messages: the prompt ends with the header of the assistant's answer (vLLM's)
    continue_final_message: bool = False  # with messages: the prompt ends inside the last message, whose text the answer continues (vLLM's)
    input_ids: list[int] | None = None  # pre-tokenized prompt
    max_tokens: int | None = 64  # None: as many as the context leaves after the prompt, at most the gateway's limit
    temperature: float | None = None  # None: the model's generation_config default; 0 = greedy
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None  # same seed + same request -> same tokens
    presence_penalty: float = 0.0  # OpenAI's, in [-2, 2]: minus this from the logit of every token generated so far
    frequency_penalty: float = 0.0  # OpenAI's, in [-2, 2]: minus this times the token's count so far
    repetition_penalty: float | None = None  # transformers'/vLLM's, > 0 (prompt and output tokens); None: the model's default
    min_p: float | None = None  # vLLM's, in [0, 1]: drop tokens less likely than min_p x the most likely; None: the model's default
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100] added to its logit (OpenAI's; at most 300 tokens)
    min_tokens: int = 0  # vLLM's: EOS, stop ids and stop strings cannot end generation within the first this-many tokens
    stop: list[str] = []  # generation ends before the first occurrence of any of these strings
    stop_token_ids: list[int] = []  # vLLM's: generation ends at any of these tokens (besides EOS; also with ignore_eos)
    include_stop_str_in_output: bool = False  # vLLM's: the text keeps the stop string or stop token that ended it
    # vLLM's: the text leaves out special tokens (<|im_start|>, <|im_end|>, ...); false spells them, except an EOS
    # or stop token that ended the completion (kept only with include_stop_str_in_output), as vLLM does
    skip_special_tokens: bool = True
    # vLLM's: the model sees only the prompt's last this-many tokens (left truncation, after the chat template);
    # -1: the last max_context of them
    truncate_prompt_tokens: int | None = None
    stream: bool = False  # True: a stream of GenerateChunk replies, the last one terminal
    logprobs: bool = False  # include the log-probability of each generated token
    top_logprobs: int = 0  # with logprobs: also the this-many most likely tokens at each position (0..20)
    ignore_eos: bool = False  # keep generating past the model's end-of-sequence token (benchmarks: exactly max_tokens)
    prompt_logprobs: int | None = None  # 0..20: each prompt token's log-probability given the ones before it, and this many alternatives
    timeout_ms: int | None = None  # client deadline, relative to arrival at the gateway
    request_id: str | None = None  # optional client-chosen id (letters, digits, '-', '_'), e.g. to cancel
    # vLLM's: prefix-cache isolation between tenants. Requests share cached prompt pages only with
    # requests of the same salt (or, without one, with others without one); 1-1024 characters.
    cache_salt: str | None = None
    # vLLM's: with the scheduler's scheduling_policy "priority", waiting requests are placed lowest
    # priority first (ties: first come); under "fcfs" (the default) anything but 0 is refused. An int64.
    priority: int = 0


class Usage(msgspec.Struct, forbid_unknown_fields=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt tokens, those whose KV the prefill instance reused from its prefix cache


class Token(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A token of the prompt or the completion, named."""

    token_id: int
    token: str  # the token decoded on its own; U+FFFD where its bytes are not whole UTF-8 characters alone
    bytes: list[int]  # the token's raw bytes (a character split over tokens is whole in their concatenation)


class TopLogprob(Token, kw_only=True):
    """A token and its log-probability at one position (of the raw logits, before penalties
    and temperature)."""

    logprob: float


class TokenLogprob(TopLogprob, kw_only=True):
    """A generated token with its log-probability and the `top_logprobs` most likely tokens
    at its position (most likely first; the generated token is among them only if it ranks)."""

    top_logprobs: list[TopLogprob] = []


class PromptLogprob(Token, kw_only=True):
    """A prompt token with its log-probability given the prompt tokens before it (None for the
    first) and the `prompt_logprobs` most likely tokens at its position."""

    logprob: float | None
    top_logprobs: list[TopLogprob] = []


class Timing(msgspec.Struct, forbid_unknown_fields=True):
    queue_ms: float  # arrival at the gateway -> placed by the scheduler
    ttft_ms: float  # arrival at the gateway -> first token at the gateway
    total_ms: float  # arrival at the gateway -> reply
    compute_ms: float  # model compute spent on this request (prefill pass + the decode steps it was in)


class GenerateResponse(msgspec.Struct, forbid_unknown_fields=True, tag="response", tag_field="type", kw_only=True):
    request_id: str
    model: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    timing: Timing
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop_token_ids token that ended it (None: EOS or length)
    logprobs: list[float] | None = None  # with logprobs: each generated token's log-probability
    token_logprobs: list[TokenLogprob] | None = None  # with logprobs: the same per token, with its text, bytes and top alternatives
    prompt_logprobs: list[PromptLogprob] | None = None  # with prompt_logprobs: one per prompt token


class GenerateChunk(msgspec.Struct, forbid_unknown_fields=True, tag="chunk", tag_field="type", kw_only=True):
    """One piece of a streamed reply; the last chunk has `finish_reason` and `timing`. Every chunk
    has `usage`: the prompt's tokens and the completion's so far (the last: the whole completion's)."""

    request_id: str
    index: int  # 0, 1, 2... per request
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    token_logprobs: list[TokenLogprob] | None = None  # as in GenerateResponse, for this chunk's tokens
    prompt_logprobs: list[PromptLogprob] | None = None  # as in GenerateResponse, on the first chunk
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # as in GenerateResponse, on the last chunk
    usage: Usage | None = None
    timing: Timing | None = None


class ErrorInfo(msgspec.Struct, forbid_unknown_fields=True):
    code: ErrorCode
    message: str


class ErrorReply(msgspec.Struct, forbid_unknown_fields=True, tag="error", tag_field="type", kw_only=True):
    """Terminal: nothing follows an error on the same reply subject."""

    error: ErrorInfo
    request_id: str | None = None


class Keepalive(msgspec.Struct, forbid_unknown_fields=True, tag="keepalive", tag_field="type", kw_only=True):
    """Not a result: the gateway still serves the request. Sent only to a client that asked for
    it (header ``Moebus-Keepalive-Ms``), once per that interval."""

    request_id: str


GenerateReply = GenerateResponse | GenerateChunk | ErrorReply | Keepalive


class ModelCard(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    max_context: int  # prompt + completion tokens
    max_tokens: int  # the largest `max_tokens` accepted


class ModelList(msgspec.Struct, forbid_unknown_fields=True, tag="models", tag_field="type"):
    models: list[ModelCard]


class CancelRequest(msgspec.Struct, forbid_unknown_fields=True):
    request_id: str
    reason: str = "cancelled by client"


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The token ids the gateway would feed the model for a prompt (vLLM's ``/tokenize``): exactly
    one of `prompt` and `messages`, tokenized and templated as `GenerateRequest`'s."""

    model: str | None = None  # optional while one model is served
    prompt: str | None = None  # raw text
    messages: list[ChatMessage] | None = None  # chat; the model's chat template is applied
    tools: list[Tool] | None = None  # with messages, as in GenerateRequest
    chat_template_kwargs: dict[str, Any] | None = None  # with messages, as in GenerateRequest
    add_generation_prompt: bool = True  # with messages, as in GenerateRequest
    continue_final_message: bool = False  # with messages, as in GenerateRequest
    add_special_tokens: bool | None = None  # the tokenizer's own (e.g. BOS); None: vLLM's default, true for prompt, false for messages
    return_token_strs: bool = False  # also each token's vocabulary entry (transformers' convert_ids_to_tokens)


class TokenizeResponse(msgspec.Struct, forbid_unknown_fields=True, tag="tokenized", tag_field="type", kw_only=True):
    count: int  # len(tokens)
    max_model_len: int  # the context (prompt + completion tokens), as ModelCard.max_context
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The text of token ids (vLLM's ``/detokenize``), special tokens included."""

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct, forbid_unknown_fields=True, tag="detokenized", tag_field="type", kw_only=True):
    prompt: str  # vLLM's name for the text


TokenizeReply = TokenizeResponse | ErrorReply
DetokenizeReply = DetokenizeResponse | ErrorReply
