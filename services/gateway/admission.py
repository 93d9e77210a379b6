"""Admission: a decoded `GenerateRequest` becomes a `Job`, or a typed `Rejected` error.

Everything a client can get wrong is checked here, before any other stage sees the
request: one prompt form, known model, token limits against the context, sampling
parameter domains, deadline bounds, request id syntax.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from schemas.api import ChatMessage, ErrorCode, GenerateRequest, TokenizeRequest, Tool
from schemas.internal import Job, SamplingSpec
from shared.model.config import GenerationConfig, ModelConfig
from shared.model.sampling_params import MAX_TOP_LOGPROBS, InvalidSamplingParams, SamplingParams
from shared.model.tokenizer import RESERVED_TEMPLATE_VARIABLES, InvalidPromptError, Tokenizer
from shared.settings import GatewaySettings

_REQUEST_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
# The ranks look every sampled token up in a request's stop ids (and ban them within min_tokens)
# at each step, so a request may not make that cost its batch's: logit_bias' bound (OpenAI's).
MAX_STOP_TOKEN_IDS = 300
# The gateway looks for every stop string in the text after each token batch, on its event loop: one
# request with 200000 of them (a 4.6 MB body) held every other request of the gateway up (5-token
# answers took 2.2 s instead of 0.1-0.2 on the 2-core CPU box); 300 cost nothing measurable there.
MAX_STOP_STRINGS = 300
# A cache_salt travels in every message of its request and is hashed once per prompt: bounded, at
# 24 times the 43 characters (256 random bits in base64) vLLM advises.
MAX_CACHE_SALT_CHARS = 1024
# A request's priority travels in its Job, msgpack, whose signed integers are 64-bit: beyond, the job
# could not be sent (vLLM takes any Python int; its clients send small ones).
PRIORITY_RANGE = (-(2**63), 2**63 - 1)

# A prompt of at most this many characters (or token ids) is admitted on the event loop: tokenizing
# 256 characters took ~75 us on the 2-core CPU host of bench/control_plane.py, 1024 ~250 us, while
# the worker thread's round trip took ~0.4 ms there (the gateway's threads sleep between requests).
INLINE_ADMISSION_MAX = 512


def cheap(prompt: str | list[int] | None) -> bool:
    """Whether tokenizing ``prompt`` (text, or token ids to check or decode) is cheap enough for the
    gateway's event loop: at most `INLINE_ADMISSION_MAX` long. Chat messages (None) go through the
    chat template, whose cost depends on the template and the tools: a worker thread's, as longer prompts."""
    return prompt is not None and len(prompt) <= INLINE_ADMISSION_MAX


class Rejected(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ModelInfo:
    """What admission needs to know about the served model."""

    name: str
    max_context: int
    vocab_size: int
    generation: GenerationConfig

    @classmethod
    def load(cls, settings: GatewaySettings) -> ModelInfo:
        config = ModelConfig.from_dir(settings.model)
        return cls(
            name=settings.model_name,
            max_context=settings.max_context or config.max_position_embeddings,
            vocab_size=config.vocab_size,
            generation=GenerationConfig.from_dir(settings.model),
        )


@dataclass(frozen=True)
class Admitted:
    job: Job
    stop: list[str]
    timeout_s: float
    stop_token_ids: frozenset[int] = frozenset()  # the request's own (not EOS): their text is cut unless include_stop
    include_stop: bool = False  # the text keeps the stop string or stop token that ended it
    skip_special_tokens: bool = True  # the text leaves out special tokens
    eos_token_ids: frozenset[int] = frozenset()  # the model's EOS tokens in effect (none with ignore_eos): cut as stop tokens are


class Admission:
    """Checks a request and turns it into a `Job`. The gateway runs `admit` on a worker thread
    (tokenizing a long prompt takes up to ~0.5 s): it must read only its settings, model and
    tokenizer, never gateway state."""

    def __init__(self, settings: GatewaySettings, model: ModelInfo, tokenizer: Tokenizer) -> None:
        self.settings = settings
        self.model = model
        self.tokenizer = tokenizer

    @property
    def max_tokens_limit(self) -> int:
        return min(self.settings.max_tokens_limit, self.model.max_context - 1)

    def admit(self, req: GenerateRequest, gateway: str, arrival: float | None = None) -> Admitted:
        arrival = time.time() if arrival is None else arrival
        self.check_model(req.model)
        if req.request_id is not None and not _REQUEST_ID.match(req.request_id):
            raise Rejected("invalid_request", "request_id: use 1-128 letters, digits, '-' or '_'")
        if req.max_tokens is not None and req.max_tokens < 1:
            raise Rejected("invalid_request", f"max_tokens must be in [1, {self.max_tokens_limit}], got {req.max_tokens}")
        # Past the setting say which knob it is: vLLM has no such bound, so its clients ask for more.
        # Past the context (where it binds first), `_max_tokens` refuses it once the prompt is counted,
        # in the words clients match (LiteLLM's ContextWindowExceededError), as vLLM does.
        by_setting = self.max_tokens_limit == self.settings.max_tokens_limit
        if req.max_tokens is not None and req.max_tokens > self.max_tokens_limit and by_setting:
            raise Rejected("invalid_request", f"max_tokens must be in [1, {self.max_tokens_limit}] (gateway.max_tokens_limit: a decode rank "
                                              f"reserves KV for prompt + max_tokens up front), got {req.max_tokens}")
        if req.timeout_ms is not None and not 0 < req.timeout_ms <= self.settings.max_timeout_ms:
            raise Rejected("invalid_request", f"timeout_ms must be in [1, {self.settings.max_timeout_ms}], got {req.timeout_ms}")
        if any(not s for s in req.stop):
            raise Rejected("invalid_request", "stop: strings must not be empty")
        if len(req.stop) > MAX_STOP_STRINGS:
            raise Rejected("invalid_request", f"stop: at most {MAX_STOP_STRINGS} strings, got {len(req.stop)}")
        if len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise Rejected("invalid_request", f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} tokens, got {len(req.stop_token_ids)}")
        outside = [t for t in req.stop_token_ids if not 0 <= t < self.model.vocab_size]
        if outside:
            raise Rejected("invalid_request", f"stop_token_ids: {outside[:5]} outside the vocabulary [0, {self.model.vocab_size})")
        if req.top_logprobs and not req.logprobs:
            raise Rejected("invalid_request", "top_logprobs needs logprobs: true")
        if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise Rejected("invalid_request", f"prompt_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {req.prompt_logprobs}")
        if req.cache_salt is not None and not 0 < len(req.cache_salt) <= MAX_CACHE_SALT_CHARS:  # vLLM refuses an empty one too
            raise Rejected("invalid_request", f"cache_salt: a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters, "
                                              f"got {len(req.cache_salt)} characters")
        if not PRIORITY_RANGE[0] <= req.priority <= PRIORITY_RANGE[1]:
            raise Rejected("invalid_request", f"priority must be an integer in [-2**63, 2**63 - 1], got {req.priority}")

        input_ids = self._truncated(req, self.prompt_ids(req))
        max_tokens = self._max_tokens(req, len(input_ids))
        sampling = self._sampling(req, max_tokens)
        timeout_s = (req.timeout_ms or self.settings.default_timeout_ms) / 1000
        job = Job(
            request_id=req.request_id or uuid.uuid4().hex,
            gateway=gateway,
            input_ids=input_ids,
            max_tokens=max_tokens,
            sampling=sampling,
            stop_token_ids=list(dict.fromkeys([*([] if req.ignore_eos else self.model.generation.eos_token_ids), *req.stop_token_ids])),
            logprobs=req.logprobs,
            top_logprobs=req.top_logprobs,
            ignore_eos=req.ignore_eos,
            prompt_logprobs=-1 if req.prompt_logprobs is None else req.prompt_logprobs,
            cache_salt=req.cache_salt,
            priority=req.priority,
            deadline=arrival + timeout_s,
        )
        eos = frozenset(() if req.ignore_eos else self.model.generation.eos_token_ids)
        return Admitted(job=job, stop=list(req.stop), timeout_s=timeout_s, stop_token_ids=frozenset(req.stop_token_ids),
                        include_stop=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens,
                        eos_token_ids=eos)

    def _max_tokens(self, req: GenerateRequest, prompt_tokens: int) -> int:
        """The request's ``max_tokens``, or where it sets none what the context leaves after the
        prompt, at most ``max_tokens_limit`` (vLLM's rule: a request without a limit is not
        refused for the length of its prompt, nor cut at an arbitrary default)."""
        room = self.model.max_context - prompt_tokens
        # The messages start with OpenAI's and vLLM's words, which clients match to tell a request
        # too long for the context (LiteLLM's ContextWindowExceededError, CrewAI) from other 400s.
        too_long = f"This model's maximum context length is {self.model.max_context} tokens. However, "
        if req.max_tokens is None:
            if room < 1:
                raise Rejected("invalid_request", f"{too_long}the prompt has {prompt_tokens} tokens, which leaves no room to generate. "
                                                  "Please reduce the length of the prompt.")
            return min(room, self.max_tokens_limit)
        if req.max_tokens > room:
            raise Rejected("invalid_request", f"{too_long}you requested {prompt_tokens + req.max_tokens} tokens ({prompt_tokens} in the prompt, "
                                              f"{req.max_tokens} for max_tokens). Please reduce the length of the prompt or max_tokens.")
        return req.max_tokens

    def check_model(self, model: str | None) -> None:
        """`unknown_model` unless ``model`` is None or names the served model."""
        if model is not None and model != self.model.name:
            raise Rejected("unknown_model", f"model {model!r} is not served here; available: [{self.model.name!r}]")

    def prompt_ids(self, req: GenerateRequest | TokenizeRequest) -> list[int]:
        """The token ids the model is fed for ``req``'s prompt: `admit`'s, and `llm.tokenize`'s answer
        (one path, so that a count taken there is the one a completion's usage reports)."""
        forms = ("prompt", "messages", "input_ids") if isinstance(req, GenerateRequest) else ("prompt", "messages")
        given = [name for name in forms if getattr(req, name) is not None]
        if len(given) != 1:
            raise Rejected("invalid_request", f"give exactly one of {', '.join(forms)} (got {given or 'none'})")
        if req.tools is not None and req.messages is None:
            raise Rejected("invalid_request", "tools: only with messages (the chat template puts them in the prompt)")
        if req.chat_template_kwargs is not None and req.messages is None:
            raise Rejected("invalid_request", "chat_template_kwargs: only with messages")
        if (req.continue_final_message or not req.add_generation_prompt) and req.messages is None:
            raise Rejected("invalid_request", "add_generation_prompt and continue_final_message: only with messages")
        reserved = sorted(RESERVED_TEMPLATE_VARIABLES.intersection(req.chat_template_kwargs or {}))
        if reserved:
            raise Rejected("invalid_request", f"chat_template_kwargs: {', '.join(reserved)} are set by moebus, not by the request")
        # The tokenizer's own special tokens (e.g. BOS): on a prompt, not on a chat template's text,
        # which carries its own (vLLM's defaults); a TokenizeRequest may say otherwise.
        asked = req.add_special_tokens if isinstance(req, TokenizeRequest) else None
        special = req.prompt is not None if asked is None else asked
        try:
            if req.prompt is not None:
                ids = self.tokenizer.encode(req.prompt, add_special_tokens=special)
            elif req.messages is not None:
                tools = None if req.tools is None else [_template_tool(t) for t in req.tools]
                text = self.tokenizer.apply_chat_template([_template_message(m) for m in req.messages], add_generation_prompt=req.add_generation_prompt,
                                                          tools=tools, continue_final_message=req.continue_final_message,
                                                          **(req.chat_template_kwargs or {}))
                ids = self.tokenizer.encode(text, add_special_tokens=special)
            else:
                ids = list(req.input_ids or [])  # type: ignore[union-attr]
                bad = [t for t in ids if not 0 <= t < self.model.vocab_size]
                if bad:
                    raise Rejected("invalid_request", f"input_ids: {bad[:5]} outside the vocabulary [0, {self.model.vocab_size})")
        except InvalidPromptError as e:
            raise Rejected("invalid_request", str(e)) from e
        if not ids:
            raise Rejected("invalid_request", "the prompt is empty")
        return ids

    def _truncated(self, req: GenerateRequest, ids: list[int]) -> list[int]:
        """The prompt's last ``truncate_prompt_tokens`` tokens (vLLM's left truncation; -1: max_context)."""
        keep = req.truncate_prompt_tokens
        if keep is None:
            return ids
        if keep == -1:
            keep = self.model.max_context
        if not 0 < keep <= self.model.max_context:
            raise Rejected("invalid_request", f"truncate_prompt_tokens must be -1 (the context, {self.model.max_context} tokens) or "
                                              f"in [1, {self.model.max_context}], got {req.truncate_prompt_tokens}")
        return ids[-keep:]

    def _sampling(self, req: GenerateRequest, max_tokens: int) -> SamplingSpec:
        gen = self.model.generation
        temperature = req.temperature if req.temperature is not None else (gen.temperature if gen.do_sample else 0.0)
        try:
            params = SamplingParams(
                temperature=temperature,
                top_p=req.top_p if req.top_p is not None else gen.top_p,
                top_k=req.top_k if req.top_k is not None else gen.top_k,
                seed=req.seed,
                max_tokens=max_tokens,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty if req.repetition_penalty is not None else gen.repetition_penalty,
                top_logprobs=req.top_logprobs,  # checked here, carried on the Job
                min_p=req.min_p if req.min_p is not None else gen.min_p,
                logit_bias=req.logit_bias or (),
                min_tokens=req.min_tokens,
            )
        except InvalidSamplingParams as e:
            raise Rejected("invalid_request", str(e)) from e
        outside = [t for t, _ in params.logit_bias if t >= self.model.vocab_size]
        if outside:
            raise Rejected("invalid_request", f"logit_bias: tokens {outside[:5]} outside the vocabulary [0, {self.model.vocab_size})")
        # A k at or past the vocabulary keeps every token: top-k off (0), as vLLM takes any int. Carried
        # as given, a k past 2**63 overflowed the ranks' int64 tensors and failed its whole prefill batch.
        top_k = params.top_k if params.top_k < self.model.vocab_size else 0
        return SamplingSpec(temperature=float(params.temperature), top_p=float(params.top_p), top_k=top_k, seed=params.seed,
                            presence_penalty=float(params.presence_penalty), frequency_penalty=float(params.frequency_penalty),
                            repetition_penalty=float(params.repetition_penalty), min_p=float(params.min_p), logit_bias=params.logit_bias,
                            min_tokens=params.min_tokens)


def _template_message(m: ChatMessage) -> dict[str, Any]:
    """A message as transformers hands it to a chat template: OpenAI's keys, the absent ones left
    out (a template tests ``message.tool_calls is defined``), tool calls with ``id``, ``type``
    and ``function`` (arguments an object, or text the template renders verbatim)."""
    message: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.name is not None:
        message["name"] = m.name
    if m.tool_calls is not None:
        message["tool_calls"] = [{**({"id": c.id} if c.id is not None else {}), "type": c.type,
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}} for c in m.tool_calls]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    if m.reasoning_content is not None:
        message["reasoning_content"] = m.reasoning_content
    return message


def _template_tool(t: Tool) -> dict[str, Any]:
    """A tool in OpenAI's key order (``type``, then ``function``: ``name``, ``description``,
    ``parameters``), absent keys left out: templates render it with ``tojson``."""
    function: dict[str, Any] = {"name": t.function.name}
    if t.function.description is not None:
        function["description"] = t.function.description
    if t.function.parameters is not None:
        function["parameters"] = t.function.parameters
    return {"type": t.type, "function": function}
