"""A request's sampling parameters and their checks: what the gateway validates a request
against and what the model ranks' sampler (`shared.model.sampling`) reads.

Plain data, no torch: the gateway, which never imports torch, rejects a request whose
parameters are out of their domain with the field named (`InvalidSamplingParams`) before
it is placed anywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_MAX_SEED = 2**64 - 1
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on the alternatives per position
# A temperature below this is greedy (vLLM's _SAMPLING_EPS): the sampler's float32 logits divided
# by one below ~1e-38 are infinite, and their softmax NaN, which picked token 0 at every step.
GREEDY_BELOW = 1e-5
MAX_LOGIT_BIAS = 300  # tokens one request may bias (OpenAI's bound)
LOGIT_BIAS_RANGE = 100.0  # |bias| at most this (OpenAI's): +-100 forces or bans a token


class InvalidSamplingParams(ValueError):
    """A sampling parameter outside its domain; the message names the field."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request.

    temperature: 0 (or below ``GREEDY_BELOW``) is greedy (argmax); otherwise logits are divided by it.
    top_k: keep the k most likely tokens; 0 disables.
    top_p: keep the smallest set of most likely tokens whose probability reaches
        top_p; 1 disables.
    seed: makes the request's samples reproducible; None draws from a shared stream.
    logprobs: report the log-probability of each chosen token.
    top_logprobs: also report this many most likely tokens per position (0 to MAX_TOP_LOGPROBS).
    prompt_logprobs: -1 for none; else report each prompt token's log-probability given the
        tokens before it (the first has none) and this many most likely tokens at its position
        (0 to MAX_TOP_LOGPROBS), from the prefill's logits (`shared.model.sampling.prompt_logprobs`).
    max_tokens: the most tokens to generate.
    stop_token_ids: ids that end generation (besides EOS, which the caller adds).
    ignore_eos: do not stop at the model's EOS ids (benchmarks: exactly max_tokens tokens
        unless a stop id or stop string ends the sequence).
    presence_penalty, frequency_penalty: OpenAI's, in [-2, 2]; 0 disables.
    repetition_penalty: transformers' / vLLM's, > 0; 1 disables.
    min_p: vLLM's, in [0, 1]: after temperature, drop the tokens whose probability is below
        min_p times the most likely token's; 0 disables.
    logit_bias: (token id, bias) pairs, OpenAI's: the bias (in [-100, 100]) is added to the
        token's logit before sampling, greedy rows included (a dict is accepted too).
    min_tokens: vLLM's: the ending tokens (EOS, stop ids) cannot be picked before this many
        tokens were generated (the runner passes them as `shared.model.sampling.Sampler.sample`'s ``banned``).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: bool = False
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    top_logprobs: int = 0
    ignore_eos: bool = False
    prompt_logprobs: int = -1
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise InvalidSamplingParams(f"temperature must be a number, got {self.temperature!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidSamplingParams(f"temperature must be finite and >= 0, got {self.temperature}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidSamplingParams(f"top_k must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) or not 0 < self.top_p <= 1:
            raise InvalidSamplingParams(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= _MAX_SEED):
            raise InvalidSamplingParams(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if not isinstance(self.logprobs, bool):
            raise InvalidSamplingParams(f"logprobs must be a boolean, got {self.logprobs!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidSamplingParams(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        stop = self.stop_token_ids
        if not isinstance(stop, (tuple, list)) or not all(_is_int(t) and t >= 0 for t in stop):
            raise InvalidSamplingParams(f"stop_token_ids must be non-negative integers, got {stop!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not -2 <= value <= 2:
                raise InvalidSamplingParams(f"{name} must be in [-2, 2], got {value!r}")
        rp = self.repetition_penalty
        if not isinstance(rp, (int, float)) or isinstance(rp, bool) or not (math.isfinite(rp) and rp > 0):
            raise InvalidSamplingParams(f"repetition_penalty must be a finite number > 0, got {rp!r}")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidSamplingParams(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if not _is_int(self.prompt_logprobs) or not -1 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidSamplingParams(f"prompt_logprobs must be -1 (none) or an integer in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs!r}")
        if not isinstance(self.min_p, (int, float)) or isinstance(self.min_p, bool) or not 0 <= self.min_p <= 1:
            raise InvalidSamplingParams(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidSamplingParams(f"min_tokens must be an integer in [0, max_tokens = {self.max_tokens}], got {self.min_tokens!r}")
        # frozen: normalise lists (and the bias dict) to tuples so the params stay hashable
        object.__setattr__(self, "stop_token_ids", tuple(stop))
        object.__setattr__(self, "logit_bias", _logit_bias_pairs(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _logit_bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted (token id, float bias) pairs, checked (`SamplingParams`)."""
    pairs = list(bias.items()) if isinstance(bias, dict) else bias
    if not isinstance(pairs, (tuple, list)) or not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in pairs):
        raise InvalidSamplingParams(f"logit_bias must map token ids to numbers, got {bias!r}")
    if len(pairs) > MAX_LOGIT_BIAS:
        raise InvalidSamplingParams(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, got {len(pairs)}")
    out: dict[int, float] = {}
    for token, value in pairs:
        if not _is_int(token) or token < 0:
            raise InvalidSamplingParams(f"logit_bias: token ids must be integers >= 0, got {token!r}")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
            raise InvalidSamplingParams(f"logit_bias: the bias of token {token} must be in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}], got {value!r}")
        if token in out:
            raise InvalidSamplingParams(f"logit_bias: token {token} given twice")
        out[token] = float(value)
    return tuple(sorted(out.items()))
