"""Cumulative histograms for the Prometheus export (`moebus metrics`), and their bucket bounds.

A process keeps a `Buckets` per measure since it starts and puts its `snapshot` in its
heartbeats; Prometheus adds such histograms up over replicas and rates them over any window,
which quantiles over a recent window cannot do. The bounds are vLLM's for the same measures
(vllm/v1/metrics/loggers.py, `PrometheusStatLogger`), so dashboards and alert thresholds carry
over, extended below vLLM's smallest bound where moebus's values sit below it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from schemas.internal import Histogram

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
# capacity is a few bus round trips (7-22 ms on the 2-core CPU test stack), and the waits before prefill
# (the gateway's until placement, the prefill instance's queue) are the first part of the time to first
# token, so they take the TTFT's bounds.
QUEUE_BOUNDS_S = TTFT_BOUNDS_S
# vLLM's inter_token_latency_seconds bounds are its request_time_per_output_token_seconds ones; so are
# these (a request's TPOT is about the mean of its inter-token gaps: its reply follows its last token).
ITL_BOUNDS_S = TPOT_BOUNDS_S
# vLLM's request_prefill_time_seconds uses the e2e bounds; the gateway's prefill time is the rest of
# the time to first token after placement (milliseconds for a short prompt), so it takes the TTFT's.
PREFILL_BOUNDS_S = TTFT_BOUNDS_S
# vLLM's request_decode_time_seconds uses the e2e bounds, and a request's decode time is most of its e2e.
DECODE_BOUNDS_S = E2E_BOUNDS_S


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
