"""A gateway's request totals for its heartbeats (`Heartbeat.requests`, shown by `moebus status`).

Every final reply the gateway sends is counted once, under its outcome: the finish
reason of a completed request ("stop", "length") or the error code of a failed one
(including the typed rejections of malformed input). Latencies are kept for the most
recent `window` completed requests only, so the percentiles describe the stack as it
runs now rather than since it started; they are computed when a heartbeat is built
(twice a second), not per request.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from typing import Any

from schemas.api import ErrorReply, GenerateChunk, GenerateResponse
from schemas.internal import LatencySummary, RequestStats

WINDOW = 1024  # completed requests the latency percentiles cover


def summarize(samples_ms: deque[float] | list[float]) -> LatencySummary | None:
    """p50 / p90 / p99 (nearest rank) of `samples_ms`; None when there are none."""
    if not samples_ms:
        return None
    ordered = sorted(samples_ms)

    def rank(q: float) -> float:
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    return LatencySummary(count=len(ordered), p50_ms=rank(0.50), p90_ms=rank(0.90), p99_ms=rank(0.99))


class RequestCounters:
    """Outcome counts and token totals since start; latency windows of recent requests."""

    def __init__(self, window: int = WINDOW) -> None:
        self.outcomes: Counter[str] = Counter()
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.ttft_ms: deque[float] = deque(maxlen=window)
        self.tpot_ms: deque[float] = deque(maxlen=window)

    def reply(self, obj: Any) -> None:
        """Count `obj` if it is a final reply: an error, a unary response or a stream's last chunk."""
        if isinstance(obj, ErrorReply):
            self.failed(obj.error.code)
        elif isinstance(obj, (GenerateResponse, GenerateChunk)) and obj.finish_reason is not None and obj.usage and obj.timing:
            self.finished(obj.finish_reason, obj.usage.prompt_tokens, obj.usage.completion_tokens, obj.timing.ttft_ms, obj.timing.total_ms)

    def finished(self, finish_reason: str, prompt_tokens: int, completion_tokens: int, ttft_ms: float, total_ms: float) -> None:
        """A completed request: its finish reason, token counts, time to first token and total time."""
        self.outcomes[finish_reason] += 1
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.ttft_ms.append(ttft_ms)
        if completion_tokens > 1:
            self.tpot_ms.append((total_ms - ttft_ms) / (completion_tokens - 1))

    def failed(self, code: str) -> None:
        """A request answered with an error reply of `code`."""
        self.outcomes[code] += 1

    def stats(self) -> RequestStats:
        return RequestStats(outcomes=dict(self.outcomes), prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                            ttft=summarize(self.ttft_ms), tpot=summarize(self.tpot_ms))
