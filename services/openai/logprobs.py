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
as vLLM returns them.
"""

from __future__ import annotations

from typing import Any

from schemas.api import PromptLogprob, TokenLogprob, TopLogprob


def _chat_token(t: TopLogprob) -> dict[str, Any]:
    return {"token": t.token, "logprob": t.logprob, "bytes": t.bytes}


def chat_logprobs(entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """A chat choice's (or chunk's) ``logprobs``; None when the request asked for none."""
    if entries is None:
        return None
    return {"content": [_chat_token(e) | {"top_logprobs": [_chat_token(t) for t in e.top_logprobs]} for e in entries]}


class CompletionLogprobs:
    """One completions choice's ``logprobs``, chunk after chunk: the text offsets of a stream's
    chunks continue where the previous chunk's ended."""

    def __init__(self) -> None:
        self.offset = 0

    def __call__(self, entries: list[TokenLogprob] | None, echoed: list[PromptLogprob] | None = None) -> dict[str, Any] | None:
        """The logprobs of ``entries`` (None when the request asked for none), after those of the
        ``echoed`` prompt tokens (``echo``; the first prompt token has no logprob: null)."""
        if entries is None:
            return None
        tokens: list[TokenLogprob | PromptLogprob] = [*(echoed or []), *entries]
        offsets = []
        for e in tokens:
            offsets.append(self.offset)
            self.offset += len(e.token)
        return {
            "tokens": [e.token for e in tokens],
            "token_logprobs": [e.logprob for e in tokens],
            "top_logprobs": [None if e.logprob is None else {t.token: t.logprob for t in e.top_logprobs} | {e.token: e.logprob} for e in tokens],
            "text_offset": offsets,
        }
