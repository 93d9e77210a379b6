"""Assembling a completion from token batches: order, detokenization, stop strings.

Token batches come from two publishers (prefill sends token 0, the decode rank the
rest), so they may arrive out of order; `Completion` releases them by index. The decode
rank publishes its batches in order on one connection, which NATS delivers in order but
at most once: once token 0 is in, a batch that still cannot be taken means one before it
was lost, and the completion fails (`TokensLost`) instead of waiting for it until the
deadline. Text is
released only when it can no longer turn into a stop string: a tail that is a prefix
of some stop string is held back until the next tokens decide it. With ``min_tokens``
(vLLM's), a stop string ends the completion only where it ends after the text of the first
``min_tokens`` tokens, as vLLM checks stop strings only from the next token on. As in vLLM,
the text ends before the stop string, and without the text of a token of the request's
``stop_token_ids`` or the EOS token that ended it (the token still counts, with its logprob),
unless ``include_stop`` (vLLM's ``include_stop_str_in_output``) keeps either; ``stop_reason`` names
that string or token (None when EOS or ``max_tokens`` ended the completion). The EOS token's text
shows only with ``skip_special_tokens`` false (the request's), as vLLM spells special tokens then.

With logprobs, each token also becomes a `TokenLogprob` (its text and bytes alone, its
logprob, its position's top alternatives) as soon as it arrives in order, whether or not
its text is released yet: a streamed chunk carries the tokens it took, not its text's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from schemas.api import FinishReason, PromptLogprob, TokenLogprob, TopLogprob
from schemas.internal import TokenBatch, TopCandidates
from shared.model.tokenizer import IncrementalDetokenizer


@dataclass
class Delta:
    """What became final with one batch: text, the tokens behind it, their logprobs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob] | None = None  # with the first token, when asked for

    def __bool__(self) -> bool:
        return bool(self.text or self.token_ids)


TokenPiece = Callable[[int], tuple[str, bytes]]  # a token id's text and bytes alone (`Tokenizer.token_piece`)


def _named(piece: TokenPiece, token_id: int) -> dict[str, Any]:
    text, raw = piece(token_id)
    return {"token_id": token_id, "token": text, "bytes": list(raw)}


def _alternatives(piece: TokenPiece, tops: list[TopCandidates] | None, i: int) -> list[TopLogprob]:
    """Position ``i``'s most likely tokens, named (none when the batch carries no alternatives)."""
    top = tops[i] if tops is not None else TopCandidates([], [])
    return [TopLogprob(**_named(piece, t), logprob=lp) for t, lp in zip(top.token_ids, top.logprobs, strict=True)]


class TokensLost(Exception):
    """A token batch of the completion never arrived."""


class Completion:
    def __init__(self, detokenizer: IncrementalDetokenizer, stop: list[str], max_tokens: int, token_piece: TokenPiece | None = None,
                 prompt_ids: list[int] | None = None, min_tokens: int = 0, stop_token_ids: frozenset[int] = frozenset(),
                 include_stop: bool = False, eos_token_ids: frozenset[int] = frozenset()) -> None:
        """``token_piece``: names the tokens of `token_logprobs` and `prompt_logprobs` (needed when
        batches carry logprobs); ``prompt_ids``: the prompt, when the request asks for its logprobs;
        ``min_tokens``: no stop string ends the completion before this many tokens;
        ``stop_token_ids``: the request's own stop tokens (not EOS); ``include_stop``: the text
        keeps the stop string or stop token that ended it (module doc); ``eos_token_ids``: the EOS
        tokens in effect, whose text is cut as a stop token's (it shows only where the detokenizer
        spells special tokens)."""
        self.detokenizer = detokenizer
        self.stop = stop
        self.stop_token_ids = stop_token_ids
        self.include_stop = include_stop
        self.eos_token_ids = eos_token_ids
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.token_piece = token_piece
        self.prompt_ids = prompt_ids
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.token_logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[PromptLogprob] | None = None
        self.text = ""  # everything decoded so far (may run past a stop string)
        self.released = 0  # characters of `text` handed to the client
        self.stop_floor: int | None = 0 if min_tokens == 0 else None  # a stop string must end past this (None: min_tokens not reached)
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None  # the stop string or the request's stop token that ended it (vLLM's)
        self.compute_ms = 0.0
        self.cached_tokens = 0  # prompt tokens prefill took from its prefix cache (token 0's batch says)
        self._early: dict[int, TokenBatch] = {}

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def final_text(self) -> str:
        return self.text[: self.released]

    def add(self, batch: TokenBatch) -> Delta:
        """Take a batch (token 0 and the rest in either order); returns what is now final.
        Raises TokensLost when a batch before this one was lost (module doc)."""
        self.compute_ms += batch.compute_ms
        self._early[batch.start] = batch
        delta = Delta()
        while not self.finished and (nxt := self._early.pop(len(self.token_ids), None)) is not None:
            self._take(nxt, delta)
        if self._early and self.token_ids and not self.finished:
            raise TokensLost(f"tokens {len(self.token_ids)}..{min(self._early) - 1} of the completion never arrived")
        return delta

    def _take(self, batch: TokenBatch, delta: Delta) -> None:
        if batch.start == 0:
            self.cached_tokens = batch.cached_tokens
        if batch.start == 0 and self.prompt_ids and self.token_piece is not None:
            self.prompt_logprobs = delta.prompt_logprobs = self._prompt_logprobs(self.token_piece, self.prompt_ids, batch)
        room = self.max_tokens - len(self.token_ids)
        ids = batch.token_ids[:room]
        self.token_ids += ids
        delta.token_ids += ids
        if batch.logprobs is not None:
            lp = batch.logprobs[: len(ids)]
            self.logprobs += lp
            delta.logprobs += lp
            if self.token_piece is not None:
                entries = self._token_logprobs(self.token_piece, ids, lp, batch.top_logprobs)
                self.token_logprobs += entries
                delta.token_logprobs += entries
        short = self.min_tokens - (len(self.token_ids) - len(ids))  # tokens still below min_tokens before this batch
        ended_by = ids[-1] if batch.finish_reason == "stop" and ids and ids == batch.token_ids else None
        if ended_by is not None and (ended_by in self.stop_token_ids or ended_by in self.eos_token_ids):
            if ended_by in self.stop_token_ids:
                self.stop_reason = ended_by  # vLLM names the request's stop token, not EOS
            if not self.include_stop:
                # The request's stop token ended the batch: counted, not spelled. The ranks ban it within
                # min_tokens, so it comes after the first `short` tokens and the split below stays.
                ids = ids[:-1]
        if self.stop_floor is None and len(ids) >= short:
            self.text += self.detokenizer.add(ids[:short])
            self.stop_floor = len(self.text)
            ids = ids[short:]
        self.text += self.detokenizer.add(ids)
        finish = batch.finish_reason or ("length" if len(self.token_ids) >= self.max_tokens else None)
        if finish is not None:
            self.text += self.detokenizer.flush()

        hit = self._stop_at()
        if hit is not None:
            cut, self.stop_reason = hit
            self.finish_reason = "stop"
            delta.text += self.text[self.released : cut]
            self.released = cut
            return
        end = len(self.text) if finish is not None else len(self.text) - self._held_back()
        if end > self.released:
            delta.text += self.text[self.released : end]
            self.released = end
        self.finish_reason = finish

    @staticmethod
    def _token_logprobs(piece: TokenPiece, ids: list[int], logprobs: list[float], tops: list[TopCandidates] | None) -> list[TokenLogprob]:
        return [TokenLogprob(**_named(piece, token_id), logprob=logprob, top_logprobs=_alternatives(piece, tops, i))
                for i, (token_id, logprob) in enumerate(zip(ids, logprobs, strict=True))]

    @staticmethod
    def _prompt_logprobs(piece: TokenPiece, prompt: list[int], batch: TokenBatch) -> list[PromptLogprob]:
        """One entry per prompt token: the first has no logprob; token j's is the batch's j - 1th
        (a one-token prompt has only the first, and prefill sends no logprobs for it)."""
        logprobs = batch.prompt_logprobs or []
        return [PromptLogprob(**_named(piece, prompt[0]), logprob=None)] + [
            PromptLogprob(**_named(piece, token_id), logprob=logprob, top_logprobs=_alternatives(piece, batch.prompt_top_logprobs, i))
            for i, (token_id, logprob) in enumerate(zip(prompt[1:], logprobs, strict=True))]

    def _stop_at(self) -> tuple[int, str] | None:
        """The earliest stop string that ends past the release point (and past `stop_floor`), if
        any, and where the text ends at it: where it starts, or with `include_stop` where it ends."""
        if not self.stop or self.stop_floor is None:
            return None
        floor = max(self.released, self.stop_floor)
        # Found from floor - len(s) + 1 on, a hit ends past the floor (it may straddle it).
        hits = [(i, len(s)) for s in self.stop if (i := self.text.find(s, max(0, floor - len(s) + 1))) != -1]
        if not hits:
            return None
        start, length = min(hits)
        return start + length if self.include_stop else start, self.text[start : start + length]

    def _held_back(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text) - self.released), longest, -1):
                if self.text.endswith(s[:n]):
                    longest = n
                    break
        return longest
