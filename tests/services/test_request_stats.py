"""The gateway's request totals (services/gateway/stats.py), `moebus status`'s rendering of
heartbeats, and the CLIs' answer when no NATS server listens."""

from __future__ import annotations

import random
import socket
import subprocess
import sys
import typing

import msgspec
import numpy as np
import pytest

from schemas.api import ErrorCode, ErrorInfo, ErrorReply, FinishReason, GenerateChunk, GenerateResponse, Timing, Usage
from schemas.internal import Heartbeat, Histogram, LatencySummary, PrefixCacheStats, RequestStats, TransferStats
from services.gateway.stats import RequestCounters, TokenTimes, summarize
from services.status import member_line, summary_lines
from shared.histogram import (DECODE_BOUNDS_S, E2E_BOUNDS_S, ITL_BOUNDS_S, PREFILL_BOUNDS_S, QUEUE_BOUNDS_S, TPOT_BOUNDS_S, TTFT_BOUNDS_S,
                              Buckets, one_two_five)


def _response(finish: str, prompt: int, completion: int, ttft: float, total: float, queue: float = 0.0) -> GenerateResponse:
    return GenerateResponse(request_id="r", model="m", text="", token_ids=[0] * completion, finish_reason=finish,  # type: ignore[arg-type]
                            usage=Usage(prompt, completion), timing=Timing(queue_ms=queue, ttft_ms=ttft, total_ms=total, compute_ms=0.0))


def test_every_final_reply_is_counted_once_by_outcome():
    counters = RequestCounters(max_context=4096)
    counters.first_token(10.0)
    counters.first_token(5.0)
    counters.reply(_response("length", 5, 4, ttft=10.0, total=40.0), TokenTimes(0.01, 0.04))
    counters.reply(GenerateChunk(request_id="s", index=0, text="a", token_ids=[1]), TokenTimes(0.005, 0.005))  # not the last chunk
    counters.reply(GenerateChunk(request_id="s", index=1, text="b", token_ids=[2], finish_reason="stop", usage=Usage(3, 2),
                                 timing=Timing(queue_ms=0.0, ttft_ms=5.0, total_ms=7.0, compute_ms=0.0)), TokenTimes(0.005, 0.007))
    counters.reply(ErrorReply(error=ErrorInfo("overloaded", "full")), TokenTimes())
    counters.reply(ErrorReply(error=ErrorInfo("invalid_request", "bad")), TokenTimes())
    counters.reply(ErrorReply(error=ErrorInfo("invalid_request", "worse")), TokenTimes())
    stats = counters.stats()
    assert stats.outcomes == {"length": 1, "stop": 1, "overloaded": 1, "invalid_request": 2}
    assert (stats.prompt_tokens, stats.completion_tokens) == (8, 6)
    # time to first token comes from first_token only (not again from the final replies' timing)
    assert stats.ttft is not None and stats.ttft.count == 2 and stats.ttft.p50_ms == 5.0 and stats.ttft.p99_ms == 10.0
    # time per output token after the first: (40 - 10) / 3 and (7 - 5) / 1
    assert stats.tpot is not None and sorted((stats.tpot.p50_ms, stats.tpot.p99_ms)) == [2.0, 10.0]


def test_time_per_output_token_is_the_first_token_to_the_last_not_to_the_reply():
    """vLLM's request TPOT: the last token's arrival less the first's, over the tokens after the first. The
    40 ms from the last token to the reply (detokenization, encoding) are not decode time."""
    counters = RequestCounters(max_context=4096)
    counters.first_token(10.0)
    counters.reply(_response("length", 5, 4, ttft=10.0, total=80.0), TokenTimes(0.01, 0.04))
    stats = counters.stats()
    assert stats.tpot is not None and stats.tpot.p50_ms == pytest.approx(10.0)  # (40 - 10) / 3, not (80 - 10) / 3
    assert stats.tpot_seconds is not None and stats.tpot_seconds.sum == pytest.approx(0.01)


def test_latency_percentiles_are_nearest_rank_over_the_latest_window():
    rng = random.Random(7)
    samples = [rng.expovariate(1 / 50) for _ in range(3000)]
    counters = RequestCounters(max_context=4096, window=1000)
    for ttft in samples:
        counters.first_token(ttft)
        counters.finished("length", 1, 1, ttft, ttft, 0.0, 0.0)
    stats = counters.stats()
    window = np.array(samples[-1000:])
    assert stats.ttft is not None and stats.ttft.count == 1000
    for q, got in ((50, stats.ttft.p50_ms), (90, stats.ttft.p90_ms), (99, stats.ttft.p99_ms)):
        assert got == np.percentile(window, q, method="inverted_cdf")
    assert stats.tpot is None  # one-token requests have no time per output token
    assert summarize([]) is None


def test_histogram_buckets_are_cumulative_with_values_on_a_bound_in_its_bucket():
    buckets = Buckets([0.1, 0.5, 1.0])
    assert buckets.snapshot() == Histogram(bounds=[0.1, 0.5, 1.0], buckets=[0, 0, 0], count=0, sum=0.0)
    for value in (0.0, 0.1, 0.1000001, 0.5, 1.0, 1.0000001, 1000.0):
        buckets.observe(value)
    h = buckets.snapshot()
    # le is "less or equal": 0.1 counts under 0.1, 1.0 under 1.0; above the last bound only +Inf (count) has it
    assert h.buckets == [2, 4, 5] and h.count == 7
    assert h.sum == pytest.approx(0.0 + 0.1 + 0.1000001 + 0.5 + 1.0 + 1.0000001 + 1000.0)
    buckets.observe(0.3)
    assert buckets.snapshot().buckets == [2, 5, 6] and buckets.snapshot().count == 8  # totals since start, never reset


def test_finished_requests_fill_the_histograms_first_tokens_the_ttft_one_and_failures_nothing():
    counters = RequestCounters(max_context=4096)
    counters.first_token(10.0)
    counters.reply(_response("length", 5, 4, ttft=10.0, total=40.0, queue=1.0), TokenTimes(0.01, 0.04))  # tpot (40 - 10) / 3 = 10 ms: on the 0.01 bound
    counters.first_token(2560_000.0)
    counters.reply(_response("stop", 300, 1, ttft=2560_000.0, total=7680_001.0, queue=2560_001.0), TokenTimes(2560.0, 2560.0))  # one token: no tpot
    counters.reply(ErrorReply(error=ErrorInfo("overloaded", "full")), TokenTimes())
    counters.first_token(1.0)  # a request that got its first token and then failed: its TTFT counts, nothing else
    counters.reply(ErrorReply(error=ErrorInfo("cancelled", "client left")), TokenTimes(0.001, 0.001))
    stats = counters.stats()

    def at(h: Histogram | None, bound: float) -> int:
        assert h is not None
        return h.buckets[h.bounds.index(bound)]

    assert stats.e2e_seconds.count == stats.queue_seconds.count == 2 and stats.ttft_seconds.count == 3  # type: ignore[union-attr]
    assert at(stats.ttft_seconds, 0.001) == 1 and at(stats.ttft_seconds, 0.005) == 1 and at(stats.ttft_seconds, 0.01) == 2
    assert at(stats.ttft_seconds, 2560.0) == 3 and stats.ttft_seconds.sum == pytest.approx(0.001 + 0.01 + 2560.0)  # type: ignore[union-attr]
    assert at(stats.e2e_seconds, 0.3) == 1 and at(stats.e2e_seconds, 7680.0) == 1  # 7680.001 s: only in +Inf
    assert at(stats.queue_seconds, 0.001) == 1 and at(stats.queue_seconds, 2560.0) == 1 and stats.queue_seconds.sum == pytest.approx(2560.002)  # type: ignore[union-attr]
    assert stats.tpot_seconds is not None and stats.tpot_seconds.count == 1
    assert at(stats.tpot_seconds, 0.0075) == 0 and at(stats.tpot_seconds, 0.01) == 1 and stats.tpot_seconds.sum == pytest.approx(0.01)
    assert at(stats.prompt_tokens_per_request, 5.0) == 1 and at(stats.prompt_tokens_per_request, 500.0) == 2
    assert stats.prompt_tokens_per_request.sum == 305 and stats.completion_tokens_per_request.sum == 5  # type: ignore[union-attr]
    assert at(stats.completion_tokens_per_request, 1.0) == 1 and at(stats.completion_tokens_per_request, 5.0) == 2
    # the histograms travel in the heartbeat; a heartbeat of a gateway without them still decodes
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(stats), type=RequestStats) == stats
    old = msgspec.msgpack.decode(msgspec.msgpack.encode({"outcomes": {"stop": 1}}), type=RequestStats)
    assert old.ttft_seconds is None and old.tpot_seconds is None


def test_inter_token_gaps_count_as_tokens_arrive_and_a_completed_request_adds_its_prefill_and_decode_time():
    counters = RequestCounters(max_context=4096)

    def at(h: Histogram | None, bound: float) -> int:
        assert h is not None
        return h.buckets[h.bounds.index(bound)]

    tokens = TokenTimes()
    for now in (0.0, 0.003, 0.010, 3.010):  # four arrivals: the gaps are 3 ms, 7 ms and 3 s
        counters.tokens_arrived(tokens, now)
    stats = counters.stats()
    itl = stats.itl_seconds
    assert itl is not None and itl.count == 3 and itl.sum == pytest.approx(3.010)
    assert (at(itl, 0.0025), at(itl, 0.005), at(itl, 0.0075), at(itl, 2.5), at(itl, 5.0)) == (0, 1, 2, 2, 3)
    assert stats.prefill_seconds.count == stats.decode_seconds.count == 0  # type: ignore[union-attr]  # counted at the final reply
    assert tokens.decode_s() == pytest.approx(3.010) and TokenTimes().decode_s() is None
    counters.reply(_response("length", 7, 4, ttft=30.0, total=3100.0, queue=12.0), tokens)
    stats = counters.stats()
    prefill, decode = stats.prefill_seconds, stats.decode_seconds
    assert prefill is not None and prefill.count == 1 and prefill.sum == pytest.approx(0.018)  # ttft - queue
    assert (at(prefill, 0.01), at(prefill, 0.02)) == (0, 1)
    assert decode is not None and decode.count == 1 and decode.sum == pytest.approx(3.010)  # first token to last
    assert (at(decode, 2.5), at(decode, 5.0)) == (0, 1)
    # a request that fails after its tokens: its gaps count as they came, no prefill or decode time
    failed = TokenTimes()
    counters.tokens_arrived(failed, 10.0)
    counters.tokens_arrived(failed, 10.5)
    counters.reply(ErrorReply(error=ErrorInfo("cancelled", "client left")), failed)
    # a one-token request: no gap, a decode time of 0
    one = TokenTimes()
    counters.tokens_arrived(one, 20.0)
    counters.reply(_response("stop", 3, 1, ttft=5.0, total=6.0, queue=1.0), one)
    stats = counters.stats()
    assert stats.itl_seconds.count == 4 and stats.itl_seconds.sum == pytest.approx(3.510)  # type: ignore[union-attr]
    assert stats.prefill_seconds.count == 2 and stats.prefill_seconds.sum == pytest.approx(0.022)  # type: ignore[union-attr]
    assert stats.decode_seconds.count == 2 and at(stats.decode_seconds, 0.3) == 1  # type: ignore[union-attr]


def test_a_gateway_heartbeat_stays_a_few_kib_however_long_it_runs():
    """Every process gets every heartbeat, two a second from each process, and the gateway's, with
    its histograms, is the largest: at its largest (every count past 2**32, every outcome, a context
    of 1M tokens for the token-count bounds) it is 4737 bytes, 3356 before the inter-token, prefill
    and decode time histograms came."""
    stats = RequestCounters(max_context=1 << 20).stats()
    full = {field: msgspec.structs.replace(h, buckets=[2**40] * len(h.bounds), count=2**40, sum=1.2345678e12)
            for field in stats.__struct_fields__ if isinstance(h := getattr(stats, field), Histogram)}
    assert len(full) == 9
    summary = LatencySummary(count=1024, p50_ms=123.456789, p90_ms=234.567891, p99_ms=345.678912)
    outcomes = {name: 2**40 for name in typing.get_args(FinishReason) + typing.get_args(ErrorCode)}
    stats = msgspec.structs.replace(stats, outcomes=outcomes, prompt_tokens=2**50, completion_tokens=2**50, ttft=summary, tpot=summary, **full)
    hb = Heartbeat(role="gateway", instance="gateway-0", rank=0, model="Qwen/Qwen3-30B-A3B-Instruct-2507", version="0.1.0",
                   started_at=1.0e9, in_flight=1000, requests=stats)
    assert len(msgspec.msgpack.encode(hb)) <= 6 * 1024


def test_bucket_bounds_ascend_and_token_bounds_stop_at_the_context():
    for bounds in (TTFT_BOUNDS_S, TPOT_BOUNDS_S, E2E_BOUNDS_S, QUEUE_BOUNDS_S, ITL_BOUNDS_S, PREFILL_BOUNDS_S, DECODE_BOUNDS_S):
        assert list(bounds) == sorted(set(bounds))
    assert one_two_five(4096) == (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0)
    assert one_two_five(5000)[-1] == 5000.0 and one_two_five(0) == ()


def test_status_lines_show_each_process_and_the_totals():
    now = 1000.0
    members = [
        Heartbeat(role="gateway", instance="gw", rank=0, model="tiny", version="1", started_at=now - 75, in_flight=2,
                  requests=RequestCounters(max_context=4096).stats()),
        Heartbeat(role="decode", instance="d0", rank=1, model="tiny", version="1", started_at=now - 3700, kv_total_pages=100, kv_free_pages=60,
                  batch_size=3, max_batch=32, decode_steps={"graph_replay": 9, "eager": 1},
                  transfer=TransferStats(completed=4, bytes_total=2_000_000_000, seconds_total=0.01, failures={"timeout": 1, "cancelled": 2})),
        Heartbeat(role="prefill", instance="p0", rank=0, model="tiny", version="1", started_at=now - 5, queued_requests=1, queued_tokens=30,
                  prefix_cache=PrefixCacheStats(lookups=4, hits=3, lookup_tokens=400, hit_tokens=300, evictions=2, cached_pages=12, evictable_pages=9)),
    ]
    gateway, decode, prefill = (member_line(hb, now) for hb in members)
    scheduler = Heartbeat(role="scheduler", instance="s0", rank=0, model="tiny", version="1", started_at=now - 5, queued_requests=2,
                          suspect_ranks=["d0/1", "d1/0"])
    assert member_line(scheduler, now).endswith("waiting=2 suspect[d0/1 d1/0]")
    assert member_line(msgspec.structs.replace(scheduler, suspect_ranks=[]), now).endswith("waiting=2")
    assert "queued=1 (30 tok)  prefix_hits=3/4 75% tok cached_pages=12 (9 evictable) evicted=2" in prefill
    assert gateway.split()[:5] == ["gateway", "gw", "0", "tiny", "1m15s"] and "in_flight=2" in gateway
    assert decode.split()[:6] == ["decode", "d0", "1", "tiny", "1h01m", "serving"]
    assert "batch=3/32 kv_pages=40/100" in decode and "kv_received=4 (2.0GB 200.0GB/s) failed[timeout=1] cancelled=2" in decode
    assert "steps[eager=1 graph_replay=9]" in decode
    totals = "\n".join(summary_lines(members))
    assert "requests: 0 answered" in totals and "ttft -" in totals
    assert "decode: 1 ranks, batch 3/32, kv pages 40/100 in use; kv received 4 (2.0GB), transfer failures: timeout=1, cancelled: 2" in totals
    # cancels alone are no failures
    only_cancels = msgspec.structs.replace(members[1], transfer=msgspec.structs.replace(members[1].transfer, failures={"cancelled": 3}))
    assert "kv_received=4 (2.0GB 200.0GB/s) cancelled=3" in member_line(only_cancels, now)
    assert "transfer failures: -, cancelled: 3" in "\n".join(summary_lines([only_cancels]))


@pytest.mark.parametrize("command", ["request --prompt hi", "status"])
def test_the_clis_fail_fast_and_clearly_when_no_nats_server_listens(command):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, "-m", "services.cli", *command.split(), "--url", f"nats://127.0.0.1:{port}"],
                          capture_output=True, text=True, timeout=60)
    # Its own message only: the `nats_error` warning of the refused connect came first, and on stdout.
    assert (done.returncode, done.stdout, done.stderr) == (1, "", f"moebus {command.split()[0]}: no NATS server answered at nats://127.0.0.1:{port} within 5s\n")
