"""bench/serving.py: its workload and statistics by hand, and one small run end to end against a
real stack (nats-server and the services as processes, the tiny checkpoint) and its in-process peer."""

from __future__ import annotations

import json
import math

import pytest

from bench.serving import Timeline, Workload, main, prefill_batches, run_in_process, summarize
from services.launch import ensure_tiny_model
from shared.model.runner import ModelRunner


def test_workload_lengths_arrivals_and_seed():
    work = Workload.random(200, 100, 40, 0.25, rate=50.0, vocab=151_936, seed=3)
    assert all(75 <= len(p) <= 125 for p in work.prompts) and all(30 <= n <= 50 for n in work.output_lens)
    assert all(1000 <= t < 100_000 for p in work.prompts for t in p)
    gaps = [b - a for a, b in zip(work.arrivals, work.arrivals[1:])]
    assert work.arrivals[0] == 0 and min(gaps) >= 0
    assert 1 / 50 * 0.7 < sum(gaps) / len(gaps) < 1 / 50 * 1.3  # Poisson at 50/s: mean gap 20 ms
    assert Workload.random(200, 100, 40, 0.25, 50.0, 151_936, seed=3) == work
    assert Workload.random(5, 8, 4, 0.0, math.inf, 151_936, seed=1).arrivals == [0.0] * 5
    assert all(0 <= t < 97 for p in Workload.random(5, 8, 4, 0.0, math.inf, 97, seed=1).prompts for t in p)  # a tiny vocabulary
    shared = Workload.random(6, 10, 4, 0.0, math.inf, 151_936, seed=1, prefix_len=20).prompts
    assert all(len(p) == 30 and p[:20] == shared[0][:20] for p in shared) and len({tuple(p[20:]) for p in shared}) == 6


def test_summary_of_hand_made_timelines():
    a = Timeline(sent=10.0)
    for now, tokens in ((10.1, 1), (10.3, 2), (10.4, 1)):  # 4 tokens: first at +100 ms, last at +400 ms
        a.add(now, tokens)
    b = Timeline(sent=10.0)
    b.add(10.2, 1)
    b.add(10.5, 1)
    failed = Timeline(sent=10.0, error="timeout")
    m = summarize([a, b, failed], input_tokens=30, elapsed_s=2.0)
    assert (m["completed"], m["failed"], m["output_tokens"]) == (2, 1, 6)
    assert m["requests_per_s"] == 1.0 and m["output_tokens_per_s"] == 3.0 and m["total_tokens_per_s"] == 18.0
    assert m["ttft_p50_ms"] == pytest.approx(100) and m["ttft_p99_ms"] == pytest.approx(200)
    assert m["tpot_mean_ms"] == pytest.approx((100 + 300) / 2)  # a: 300 ms over 3 gaps; b: 300 ms over 1
    assert sorted([m["itl_p50_ms"], m["itl_p99_ms"]]) == pytest.approx([200, 300])  # gaps 200, 100 (a) and 300 (b)
    assert m["e2e_p99_ms"] == pytest.approx(500)


def test_prefill_batch_summary_counts_the_measured_batches_only(tmp_path):
    def event(ts: str, requests: int, computed: int, forward_ms: float) -> str:
        return json.dumps({"event": "prefill_batch", "timestamp": ts, "requests": requests, "computed_tokens": computed, "cached_tokens": 0,
                           "forward_ms": forward_ms, "plan_ms": 1.0})

    log = tmp_path / "prefill-0.log"
    log.write_text("\n".join([
        event("2026-01-01T00:00:00.000000Z", 1, 8, 99.0),  # the client's first-use request, before the run
        "moebus prefill: not a JSON line",
        json.dumps({"event": "prefilled", "timestamp": "2026-01-01T00:00:05Z", "prompt_tokens": 3}),
        event("2026-01-01T00:00:02.500000Z", 3, 300, 10.0),
        event("2026-01-01T00:00:03.000000Z", 5, 100, 20.0),
    ]))
    since = 1767225601.0  # 2026-01-01T00:00:01Z
    got = prefill_batches([log], since)
    assert got["prefill_batches"] == 2 and got["prefill_batch_requests_mean"] == 4 and got["prefill_batch_computed_tokens_mean"] == 200
    assert got["prefill_forward_ms_mean"] == 15 and got["prefill_plan_ms_mean"] == 1
    assert prefill_batches([log], since + 10) == {}


def test_the_peer_times_requests_from_when_they_are_sent_not_from_their_prefill(tmp_path):
    """All four arrive at once and are in flight (concurrency 4), but the prefill budget takes one
    prompt per iteration: a later one's TTFT includes the iterations it waited, as in the stack."""
    runner = ModelRunner.from_dir(ensure_tiny_model(tmp_path), num_pages=64, page_size=16)
    work = Workload.random(4, 12, 3, 0.0, math.inf, runner.model.config.vocab_size, seed=2)
    timelines, _ = run_in_process(runner, work, max_concurrency=4, prefill_tokens=12)
    ttft = [t.first - t.sent for t in timelines]
    assert all(t.tokens == 3 for t in timelines)
    assert ttft == sorted(ttft) and ttft[3] > ttft[0]
    assert max(t.sent for t in timelines) - min(t.sent for t in timelines) < ttft[1]  # sent together, served in turn


@pytest.mark.slow
@pytest.mark.parametrize("api", ["native", "openai"])
def test_a_small_run_through_a_real_stack_and_the_in_process_peer(api, tmp_path, monkeypatch):
    """The stack's native API with the peer; its `openai` frontend over HTTP (the client any
    OpenAI-compatible server gets) without it."""
    monkeypatch.setenv("MOEBUS_RESULTS_DIR", str(tmp_path))
    monkeypatch.setenv("MOEBUS_PREFILL_PREFIX_CACHING", "true")  # the stack's prefill serves the shared prefix from its cache
    monkeypatch.setenv("MOEBUS_PREFILL_LOG_LEVEL", "info")  # its prefill_batch events: the run's batch summary
    requests, output_len = 12, 8
    args = ["--up", "--api", api, "--requests", str(requests), "--input-len", "24", "--prefix-len", "32", "--output-len", str(output_len),
            "--max-concurrency", "4", "--rate", "40"]
    assert main(args + (["--no-peer"] if api == "openai" else [])) == 0
    line = json.loads((tmp_path / "serving.jsonl").read_text().splitlines()[-1])
    # the line says what the stack's decode ran with, peer or not (a run without one recorded nothing)
    decode = line["case"]["decode"]
    assert decode["device"] == "auto" and decode["max_batch"] > 0 and decode["kv_pages"] > 0 and decode["dtype"]
    server = line["metrics"]
    measured = [server] + ([line["peers"]["in_process_runner"]] if api == "native" else [])
    for m in measured:
        assert m["completed"] == requests and m["failed"] == 0
        assert m["output_tokens"] == requests * output_len  # ignore_eos: every request its full length
        assert 0 < m["ttft_p50_ms"] <= m["ttft_p99_ms"] <= m["e2e_p99_ms"]
    # the shared 32-token prefix is two KV pages: the prefill's prefix cache serves them once cached
    assert 0 < server["cached_share"] <= 32 / 56
    if api == "native":
        assert measured[1]["cached_share"] == 0  # the in-process runner caches nothing
        assert server["throughput_ratio"] == pytest.approx(server["output_tokens_per_s"] / measured[1]["output_tokens_per_s"])
        assert line["case"]["decode"]["device"] in ("auto", "cpu")
    assert line["case"]["api"] == api and line["case"]["rate"] == 40.0
    # Every measured request ran in one of the summarized prefill batches, the client's first-use one in none.
    assert server["prefill_batches"] * server["prefill_batch_requests_mean"] == pytest.approx(requests)
    assert server["prefill_forward_ms_mean"] > 0
