"""A gateway's request totals for its heartbeats (`Heartbeat.requests`, shown by `moebus status`).

Every final reply the gateway sends is counted once, under its outcome: the finish
reason of a completed request ("stop", "length") or the error code of a failed one
(including the typed rejections of malformed input). Latencies are kept for the most
recent `window` completed requests only, so the percentiles describe the stack as it
runs now rather than since it started; they are computed when a heartbeat is built
(twice a second), not per request.

The same finished requests also go into cumulative histograms since start (`Buckets`), which
Prometheus can add up over gateway replicas and over any time window (`moebus metrics` renders
them). Their bounds are vLLM's for the same measures (vllm/v1/metrics/loggers.py,
`PrometheusStatLogger`), so dashboards and alert thresholds carry over, extended below vLLM's
smallest bound where moebus's values sit below it.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any

from schemas.api import ErrorReply, GenerateChunk, GenerateResponse
from schemas.internal import Histogram, LatencySummary, RequestStats

WINDOW = 1024  # completed requests the latency percentiles cover

# vLLM's time_to_first_token_seconds bounds (1 ms .. 2560 s).
TTFT_BOUNDS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
                 160.0, 640.0, 2560.0)
# vLLM's request_time_per_output_token_seconds bounds start at 10 ms; bench.serving on one H200 measured
# 4.4-4.8 ms per token (README, Qwen3-30B-A3B shapes cut to 4 layers), so 1, 2.5, 5 and 7.5 ms come first.
TPOT_BOUNDS_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0)
# vLLM's e2e_request_latency_seconds bounds (0.3 s .. 7680 s).
E2E_BOUNDS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
                7680.0)
# vLLM's request_queue_time_seconds uses the e2e bounds, whose first is 0.3 s; a placement with free
# capacity is a few bus round trips (7-22 ms on the 2-core CPU test stack) and the queue wait is the first
# part of the time to first token, so it takes the TTFT's bounds.
QUEUE_BOUNDS_S = TTFT_BOUNDS_S


def one_two_five(top: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `top` (vLLM's `build_1_2_5_buckets`, its bounds for token counts)."""
    bounds: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > top:
                return tuple(bounds)
            bounds.append(float(m * scale))
        scale *= 10


class Buckets:
    """A cumulative histogram since start: observation counts per fixed bucket, their sum and count.

    An observation equal to a bound counts in that bound's bucket (Prometheus' `le`: less or
    equal); one above every bound only in `+Inf` (the count)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = list(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket, not cumulative; the last one is above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> Histogram:
        cumulative, running = [], 0
        for n in self.counts[:-1]:
            running += n
            cumulative.append(running)
        return Histogram(bounds=self.bounds, buckets=cumulative, count=running + self.counts[-1], sum=self.sum)


def summarize(samples_ms: deque[float] | list[float]) -> LatencySummary | None:
    """p50 / p90 / p99 (nearest rank) of `samples_ms`; None when there are none."""
    if not samples_ms:
        return None
    ordered = sorted(samples_ms)

    def rank(q: float) -> float:
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    return LatencySummary(count=len(ordered), p50_ms=rank(0.50), p90_ms=rank(0.90), p99_ms=rank(0.99))


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
        self.prompt_hist = Buckets(one_two_five(max_context))
        self.completion_hist = Buckets(one_two_five(max_context))

    def reply(self, obj: Any) -> None:
        """Count `obj` if it is a final reply: an error, a unary response or a stream's last chunk."""
        if isinstance(obj, ErrorReply):
            self.failed(obj.error.code)
        elif isinstance(obj, (GenerateResponse, GenerateChunk)) and obj.finish_reason is not None and obj.usage and obj.timing:
            self.finished(obj.finish_reason, obj.usage.prompt_tokens, obj.usage.completion_tokens, obj.timing.ttft_ms, obj.timing.total_ms,
                          obj.timing.queue_ms)

    def finished(self, finish_reason: str, prompt_tokens: int, completion_tokens: int, ttft_ms: float, total_ms: float,
                 queue_ms: float) -> None:
        """A completed request: its finish reason, token counts, time to first token, total time and
        time to placement (`Timing`'s fields)."""
        self.outcomes[finish_reason] += 1
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.ttft_ms.append(ttft_ms)
        self.ttft_s.observe(ttft_ms / 1000)
        self.e2e_s.observe(total_ms / 1000)
        self.queue_s.observe(queue_ms / 1000)
        self.prompt_hist.observe(prompt_tokens)
        self.completion_hist.observe(completion_tokens)
        if completion_tokens > 1:
            tpot_ms = (total_ms - ttft_ms) / (completion_tokens - 1)
            self.tpot_ms.append(tpot_ms)
            self.tpot_s.observe(tpot_ms / 1000)

    def failed(self, code: str) -> None:
        """A request answered with an error reply of `code`."""
        self.outcomes[code] += 1

    def stats(self) -> RequestStats:
        return RequestStats(outcomes=dict(self.outcomes), prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                            ttft=summarize(self.ttft_ms), tpot=summarize(self.tpot_ms), ttft_seconds=self.ttft_s.snapshot(),
                            tpot_seconds=self.tpot_s.snapshot(), e2e_seconds=self.e2e_s.snapshot(), queue_seconds=self.queue_s.snapshot(),
                            prompt_tokens_per_request=self.prompt_hist.snapshot(),
                            completion_tokens_per_request=self.completion_hist.snapshot())
