"""moebus' per-token logprobs (`schemas.api.TokenLogprob`) in OpenAI's two formats.

Chat completions (``logprobs: true``, ``top_logprobs: k``): ``{"content": [{"token",
"logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}``, the k
most likely tokens at each position, most likely first.

Completions (``logprobs: k``, OpenAI's legacy format): ``{"tokens", "token_logprobs",
"top_logprobs", "text_offset"}``: per position a ``{token: logprob}`` dict of the k most
likely tokens plus the generated one (so up to k + 1 entries, as OpenAI and vLLM return
them; tokens whose text is the same, e.g. two partial UTF-8 pieces both shown as U+FFFD,
share one key), and each token's offset in the completion's text, counted in the token
texts before it (which is the text itself unless a character is split over tokens).
With ``echo`` the prompt's tokens come first, the first of them without a logprob (null),
as vLLM returns them. vLLM's ``return_tokens_as_token_ids`` names every token, chosen and
alternative, ``"token_id:<id>"`` instead of by its text (a token that is part of a UTF-8
character has no text of its own); the chat format's ``bytes`` stay the token's own.
"""

from __future__ import annotations

from typing import Any

from schemas.api import PromptLogprob, TokenLogprob, TopLogprob


def token_name(t: TopLogprob | TokenLogprob | PromptLogprob, as_ids: bool) -> str:
    """How a logprobs entry names its token: its text, or with ``as_ids`` vLLM's ``token_id:<id>``."""
    return f"token_id:{t.token_id}" if as_ids else t.token


def _chat_token(t: TopLogprob | TokenLogprob, as_ids: bool) -> dict[str, Any]:
    return {"token": token_name(t, as_ids), "logprob": t.logprob, "bytes": t.bytes}


def chat_logprobs(entries: list[TokenLogprob] | None, as_ids: bool = False) -> dict[str, Any] | None:
    """A chat choice's (or chunk's) ``logprobs``; None when the request asked for none."""
    if entries is None:
        return None
    return {"content": [_chat_token(e, as_ids) | {"top_logprobs": [_chat_token(t, as_ids) for t in e.top_logprobs]}
                        for e in entries]}


class CompletionLogprobs:
    """One completions choice's ``logprobs``, chunk after chunk: the text offsets of a stream's
    chunks continue where the previous chunk's ended."""

    def __init__(self, as_ids: bool = False) -> None:
        self.offset = 0
        self.as_ids = as_ids  # tokens named token_id:<id> (vLLM's return_tokens_as_token_ids)

    def __call__(self, entries: list[TokenLogprob] | None, echoed: list[PromptLogprob] | None = None) -> dict[str, Any] | None:
        """The logprobs of ``entries`` (None when the request asked for none), after those of the
        ``echoed`` prompt tokens (``echo``; the first prompt token has no logprob: null)."""
        if entries is None:
            return None
        tokens: list[TokenLogprob | PromptLogprob] = [*(echoed or []), *entries]
        names = [token_name(e, self.as_ids) for e in tokens]
        offsets = []
        for name in names:  # counted in the names, as vLLM counts them
            offsets.append(self.offset)
            self.offset += len(name)
        return {
            "tokens": names,
            "token_logprobs": [e.logprob for e in tokens],
            "top_logprobs": [None if e.logprob is None else {token_name(t, self.as_ids): t.logprob for t in e.top_logprobs} | {name: e.logprob}
                             for e, name in zip(tokens, names, strict=True)],
            "text_offset": offsets,
        }
