"""A gateway's request totals for its heartbeats (`Heartbeat.requests`, shown by `moebus status`).

Every final reply the gateway sends is counted once, under its outcome: the finish
reason of a completed request ("stop", "length") or the error code of a failed one
(including the typed rejections of malformed input). Latencies are kept for the most
recent `window` requests only, so the percentiles describe the stack as it
runs now rather than since it started; they are computed when a heartbeat is built
(twice a second), not per request.

The same requests also go into cumulative histograms since start (shared/histogram.py,
which has their bucket bounds), which Prometheus can add up over gateway replicas and over any
time window (`moebus metrics` renders them). Time to first token is counted when the first
token reaches the gateway, as vLLM counts it: a long generation's shows while it runs, and a
request cancelled or failed after its first token has one. So are the inter-token gaps, each as
its tokens arrive (`TokenTimes`). Everything else is counted at the final reply of a completed
request, including its prefill time (placement to first token) and decode time (first token to
last), vLLM's `request_prefill_time_seconds` and `request_decode_time_seconds` as the gateway
sees them.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

from schemas.api import ErrorReply, GenerateChunk, GenerateResponse
from schemas.internal import LatencySummary, RequestStats
from shared.histogram import (DECODE_BOUNDS_S, E2E_BOUNDS_S, ITL_BOUNDS_S, PREFILL_BOUNDS_S, QUEUE_BOUNDS_S, TPOT_BOUNDS_S, TTFT_BOUNDS_S,
                              Buckets, one_two_five)

WINDOW = 1024  # completed requests the latency percentiles cover


def summarize(samples_ms: deque[float] | list[float]) -> LatencySummary | None:
    """p50 / p90 / p99 (nearest rank) of `samples_ms`; None when there are none."""
    if not samples_ms:
        return None
    ordered = sorted(samples_ms)

    def rank(q: float) -> float:
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    return LatencySummary(count=len(ordered), p50_ms=rank(0.50), p90_ms=rank(0.90), p99_ms=rank(0.99))


@dataclass
class TokenTimes:
    """When one request's tokens reached its completion at the gateway (`time.monotonic()`): the
    first and the latest arrival that brought tokens. Tokens that arrive together (a batch that
    waited for the one before it) are one arrival, as vLLM takes the tokens of one engine step."""

    first: float | None = None
    last: float | None = None

    def decode_s(self) -> float | None:
        """First token to last (0 for one arrival); None before any."""
        return None if self.first is None or self.last is None else self.last - self.first


class RequestCounters:
    """Outcome counts, token totals and histograms since start; latency windows of recent requests.

    `max_context` (the model's prompt + completion limit) is where the token-count bounds stop."""

    def __init__(self, max_context: int, window: int = WINDOW) -> None:
        self.outcomes: Counter[str] = Counter()
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.ttft_ms: deque[float] = deque(maxlen=window)
        self.tpot_ms: deque[float] = deque(maxlen=window)
        self.ttft_s = Buckets(TTFT_BOUNDS_S)
        self.tpot_s = Buckets(TPOT_BOUNDS_S)
        self.e2e_s = Buckets(E2E_BOUNDS_S)
        self.queue_s = Buckets(QUEUE_BOUNDS_S)
        self.itl_s = Buckets(ITL_BOUNDS_S)
        self.prefill_s = Buckets(PREFILL_BOUNDS_S)
        self.decode_s = Buckets(DECODE_BOUNDS_S)
        self.prompt_hist = Buckets(one_two_five(max_context))
        self.completion_hist = Buckets(one_two_five(max_context))

    def reply(self, obj: Any, tokens: TokenTimes) -> None:
        """Count `obj` if it is a final reply: an error, a unary response or a stream's last chunk
        (`tokens`: when its request's tokens arrived)."""
        if isinstance(obj, ErrorReply):
            self.failed(obj.error.code)
        elif isinstance(obj, (GenerateResponse, GenerateChunk)) and obj.finish_reason is not None and obj.usage and obj.timing:
            decode_s = tokens.decode_s()
            self.finished(obj.finish_reason, obj.usage.prompt_tokens, obj.usage.completion_tokens, obj.timing.ttft_ms, obj.timing.total_ms,
                          obj.timing.queue_ms, None if decode_s is None else decode_s * 1000)

    def first_token(self, ttft_ms: float) -> None:
        """A request's first token reached the gateway, `ttft_ms` after the request did."""
        self.ttft_ms.append(ttft_ms)
        self.ttft_s.observe(ttft_ms / 1000)

    def tokens_arrived(self, tokens: TokenTimes, now: float) -> None:
        """Tokens of a request reached its completion at `now`: after its first arrival, the gap
        since the one before is an inter-token latency (vLLM's, one per engine step: here one per
        decode step, as a decode rank sends each step's token at once)."""
        if tokens.last is None:
            tokens.first = now
        else:
            self.itl_s.observe(now - tokens.last)
        tokens.last = now

    def finished(self, finish_reason: str, prompt_tokens: int, completion_tokens: int, ttft_ms: float, total_ms: float,
                 queue_ms: float, decode_ms: float | None) -> None:
        """A completed request: its finish reason, token counts, time to first token (for the time
        per output token after it and the prefill time; `first_token` counted it), total time and
        time to placement (`Timing`'s fields), and its first token to its last (`TokenTimes`; None
        if it got no token, and then it has no prefill time either: `Timing` gives it a TTFT of its
        total time)."""
        self.outcomes[finish_reason] += 1
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.e2e_s.observe(total_ms / 1000)
        self.queue_s.observe(queue_ms / 1000)
        if decode_ms is not None:
            self.prefill_s.observe((ttft_ms - queue_ms) / 1000)
            self.decode_s.observe(decode_ms / 1000)
        self.prompt_hist.observe(prompt_tokens)
        self.completion_hist.observe(completion_tokens)
        if completion_tokens > 1 and decode_ms is not None:
            # vLLM's request TPOT: its first token to its last over the tokens after the first. Not
            # (total - TTFT): that adds the time from the last token to the reply (its detokenization,
            # a stop string's check, the reply's encoding) to every request's decode rate.
            tpot_ms = decode_ms / (completion_tokens - 1)
            self.tpot_ms.append(tpot_ms)
            self.tpot_s.observe(tpot_ms / 1000)

    def failed(self, code: str) -> None:
        """A request answered with an error reply of `code`."""
        self.outcomes[code] += 1

    def stats(self) -> RequestStats:
        return RequestStats(outcomes=dict(self.outcomes), prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                            ttft=summarize(self.ttft_ms), tpot=summarize(self.tpot_ms), ttft_seconds=self.ttft_s.snapshot(),
                            tpot_seconds=self.tpot_s.snapshot(), e2e_seconds=self.e2e_s.snapshot(), queue_seconds=self.queue_s.snapshot(),
                            itl_seconds=self.itl_s.snapshot(), prefill_seconds=self.prefill_s.snapshot(), decode_seconds=self.decode_s.snapshot(),
                            prompt_tokens_per_request=self.prompt_hist.snapshot(),
                            completion_tokens_per_request=self.completion_hist.snapshot())
