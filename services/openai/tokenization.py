"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` bodies and answers, translated to and from
``llm.tokenize`` / ``llm.detokenize`` (`schemas.api`), which the gateway answers with the model's
tokenizer and chat template.

``/tokenize`` takes vLLM's completion body (``prompt``; ``add_special_tokens``, default true) or
its chat body (``messages`` as ``/v1/chat/completions`` takes them; ``add_generation_prompt``,
default true, ``continue_final_message``, ``add_special_tokens``, default false,
``chat_template_kwargs``, ``tools``), each with ``model`` and ``return_token_strs``, and answers
``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` null unless asked: each
token's vocabulary entry). ``/detokenize`` takes ``{"model", "tokens"}`` and answers
``{"prompt"}``, the text with its special tokens. vLLM's chat fields for what moebus does not do
(``chat_template``, a request's own template, which vLLM takes only with ``--trust-request-chat-template``:
the gateway's ``chat_template`` setting replaces the model's instead; ``media_io_kwargs`` and
``mm_processor_kwargs``, multimodal input) are taken only as null. Both ``prompt`` and ``messages``, or neither, an
unknown model, and ids outside the vocabulary are refused by the gateway, as ``llm.generate``
refuses them.
"""

from __future__ import annotations

from typing import Any

import msgspec

from schemas.api import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from services.openai.protocol import ChatMessageIn, InvalidRequest, ToolIn, chat_messages, chat_tools


class TokenizeBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's TokenizeCompletionRequest and TokenizeChatRequest in one: the gateway tells them apart."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool | None = None  # None: vLLM's default of the body's kind (true for prompt, false for messages)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolIn] | None = None
    return_token_strs: bool | None = False
    chat_template: str | None = None  # accepted only as null
    media_io_kwargs: Any = None  # accepted only as null
    mm_processor_kwargs: Any = None  # accepted only as null


class DetokenizeBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    tokens: list[int]


def tokenize_request(body: TokenizeBody) -> TokenizeRequest:
    """The ``llm.tokenize`` request of a ``/tokenize`` body (an empty model name: the served model, as vLLM takes it)."""
    refused = [name for name in ("chat_template", "media_io_kwargs", "mm_processor_kwargs") if getattr(body, name) is not None]
    if refused:
        raise InvalidRequest(f"not supported by moebus: {', '.join(refused)} (accepted only as null)")
    return TokenizeRequest(model=body.model or None, prompt=body.prompt, messages=None if body.messages is None else chat_messages(body.messages),
                           tools=chat_tools(body.tools), chat_template_kwargs=body.chat_template_kwargs,
                           add_generation_prompt=body.add_generation_prompt, continue_final_message=body.continue_final_message,
                           add_special_tokens=body.add_special_tokens, return_token_strs=bool(body.return_token_strs))


def detokenize_request(body: DetokenizeBody) -> DetokenizeRequest:
    return DetokenizeRequest(model=body.model or None, tokens=body.tokens)


def tokenize_answer(r: TokenizeResponse) -> dict[str, Any]:
    return {"count": r.count, "max_model_len": r.max_model_len, "tokens": r.tokens, "token_strs": r.token_strs}


def detokenize_answer(r: DetokenizeResponse) -> dict[str, Any]:
    return {"prompt": r.prompt}
