"""The gateway's request totals (services/gateway/stats.py), `moebus status`'s rendering of
heartbeats, and the CLIs' answer when no NATS server listens."""

from __future__ import annotations

import random
import socket
import subprocess
import sys

import msgspec
import numpy as np
import pytest

from schemas.api import ErrorInfo, ErrorReply, GenerateChunk, GenerateResponse, Timing, Usage
from schemas.internal import Heartbeat, PrefixCacheStats, TransferStats
from services.gateway.stats import RequestCounters, summarize
from services.status import member_line, summary_lines


def _response(finish: str, prompt: int, completion: int, ttft: float, total: float) -> GenerateResponse:
    return GenerateResponse(request_id="r", model="m", text="", token_ids=[0] * completion, finish_reason=finish,  # type: ignore[arg-type]
                            usage=Usage(prompt, completion), timing=Timing(queue_ms=0.0, ttft_ms=ttft, total_ms=total, compute_ms=0.0))


def test_every_final_reply_is_counted_once_by_outcome():
    counters = RequestCounters()
    counters.reply(_response("length", 5, 4, ttft=10.0, total=40.0))
    counters.reply(GenerateChunk(request_id="s", index=0, text="a", token_ids=[1]))  # not the last chunk
    counters.reply(GenerateChunk(request_id="s", index=1, text="b", token_ids=[2], finish_reason="stop", usage=Usage(3, 2),
                                 timing=Timing(queue_ms=0.0, ttft_ms=5.0, total_ms=7.0, compute_ms=0.0)))
    counters.reply(ErrorReply(error=ErrorInfo("overloaded", "full")))
    counters.reply(ErrorReply(error=ErrorInfo("invalid_request", "bad")))
    counters.reply(ErrorReply(error=ErrorInfo("invalid_request", "worse")))
    stats = counters.stats()
    assert stats.outcomes == {"length": 1, "stop": 1, "overloaded": 1, "invalid_request": 2}
    assert (stats.prompt_tokens, stats.completion_tokens) == (8, 6)
    assert stats.ttft is not None and stats.ttft.count == 2 and stats.ttft.p50_ms == 5.0 and stats.ttft.p99_ms == 10.0
    # time per output token after the first: (40 - 10) / 3 and (7 - 5) / 1
    assert stats.tpot is not None and sorted((stats.tpot.p50_ms, stats.tpot.p99_ms)) == [2.0, 10.0]


def test_latency_percentiles_are_nearest_rank_over_the_latest_window():
    rng = random.Random(7)
    samples = [rng.expovariate(1 / 50) for _ in range(3000)]
    counters = RequestCounters(window=1000)
    for ttft in samples:
        counters.finished("length", 1, 1, ttft, ttft)
    stats = counters.stats()
    window = np.array(samples[-1000:])
    assert stats.ttft is not None and stats.ttft.count == 1000
    for q, got in ((50, stats.ttft.p50_ms), (90, stats.ttft.p90_ms), (99, stats.ttft.p99_ms)):
        assert got == np.percentile(window, q, method="inverted_cdf")
    assert stats.tpot is None  # one-token requests have no time per output token
    assert summarize([]) is None


def test_status_lines_show_each_process_and_the_totals():
    now = 1000.0
    members = [
        Heartbeat(role="gateway", instance="gw", rank=0, model="tiny", version="1", started_at=now - 75, in_flight=2,
                  requests=RequestCounters().stats()),
        Heartbeat(role="decode", instance="d0", rank=1, model="tiny", version="1", started_at=now - 3700, kv_total_pages=100, kv_free_pages=60,
                  batch_size=3, max_batch=32, decode_steps={"graph_replay": 9, "eager": 1},
                  transfer=TransferStats(completed=4, bytes_total=2_000_000_000, seconds_total=0.01, failures={"timeout": 1})),
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
    assert "batch=3/32 kv_pages=40/100" in decode and "kv_received=4 (2.0GB 200.0GB/s) failed[timeout=1]" in decode
    assert "steps[eager=1 graph_replay=9]" in decode
    totals = "\n".join(summary_lines(members))
    assert "requests: 0 answered" in totals and "ttft -" in totals
    assert "decode: 1 ranks, batch 3/32, kv pages 40/100 in use; kv received 4 (2.0GB), transfer failures: timeout=1" in totals


@pytest.mark.parametrize("command", ["request --prompt hi", "status"])
def test_the_clis_fail_fast_and_clearly_when_no_nats_server_listens(command):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, "-m", "services.cli", *command.split(), "--url", f"nats://127.0.0.1:{port}"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert f"no NATS server answered at nats://127.0.0.1:{port} within 5s" in done.stderr
    assert done.stderr.count("nats_error") <= 1  # the retries of the first connect are not logged one by one
