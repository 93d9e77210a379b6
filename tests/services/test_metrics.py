"""`moebus metrics`: heartbeats rendered as Prometheus text (units here; the stack test in
test_pipeline.py scrapes a real stack)."""

from __future__ import annotations

import asyncio
import math

import msgspec

from schemas.internal import Heartbeat, Histogram, LatencySummary, RequestStats, TransferStats
from services.gateway.stats import RequestCounters
from services.metrics import FAMILIES, Exporter, render

from services_helpers import histogram_buckets, parse_metrics as parse


def who(role: str, instance: str, rank: int = 0, model: str = "tiny") -> frozenset[tuple[str, str]]:
    """The labels every series of a process carries."""
    return frozenset({("role", role), ("instance", instance), ("rank", str(rank)), ("model_name", model)})


def test_every_heartbeat_field_becomes_a_series_with_the_process_labels():
    gateway = Heartbeat(role="gateway", instance='gw "a"', rank=0, model="tiny", version="0.1", started_at=100.0, in_flight=3,
                        requests=RequestStats(outcomes={"length": 5, "overloaded": 2}, prompt_tokens=40, completion_tokens=90,
                                              ttft=LatencySummary(count=5, p50_ms=20.0, p90_ms=35.0, p99_ms=50.0)))
    decode = Heartbeat(role="decode", instance="d0", rank=1, model="tiny-2", version="0.1", started_at=90.0, draining=True,
                       kv_total_pages=511, kv_free_pages=500, batch_size=2, max_batch=32, decode_steps={"graph_replay": 7, "eager": 1},
                       transfer=TransferStats(completed=4, bytes_total=123456, seconds_total=0.25, failures={"lease_expired": 1}))
    scheduler = Heartbeat(role="scheduler", instance="s0", rank=0, model="tiny", version="0.1", started_at=150.0, queued_requests=4,
                          suspect_ranks=["d0/1"])
    series = parse(render([gateway, decode, scheduler], now=160.0))
    s0 = who("scheduler", "s0")
    assert series[("moebus_scheduler_waiting_requests", s0)] == 4 and series[("moebus_scheduler_suspect_ranks", s0)] == 1
    gw = who("gateway", 'gw \\"a\\"')
    d0 = who("decode", "d0", 1, model="tiny-2")
    assert series[("moebus_up", gw | {("model", "tiny"), ("version", "0.1")})] == 1
    assert series[("moebus_uptime_seconds", gw)] == 160.0 - gateway.started_at
    assert series[("moebus_gateway_in_flight", gw)] == gateway.in_flight
    for outcome, n in gateway.requests.outcomes.items():
        assert series[("moebus_gateway_requests_total", gw | {("outcome", outcome)})] == n
    assert series[("moebus_gateway_completion_tokens_total", gw)] == gateway.requests.completion_tokens
    assert series[("moebus_gateway_ttft_seconds", gw | {("quantile", "0.99")})] == gateway.requests.ttft.p99_ms / 1000
    assert not any(name == "moebus_gateway_tpot_seconds" for name, _ in series)  # no summary, no series
    assert series[("moebus_draining", d0)] == 1
    assert series[("moebus_decode_kv_pages_free", d0)] == decode.kv_free_pages
    assert series[("moebus_decode_steps_total", d0 | {("path", "graph_replay")})] == 7
    assert series[("moebus_kv_transfer_bytes_total", d0)] == decode.transfer.bytes_total
    assert series[("moebus_kv_transfer_failures_total", d0 | {("cause", "lease_expired")})] == 1
    assert {name for name, _ in series} <= {name for name, _, _ in FAMILIES}
    # every series names the model its process serves, as vLLM's carry model_name
    assert {dict(labels)["model_name"] for _, labels in series} == {"tiny", "tiny-2"}
    assert render([], now=0.0) == "\n"  # nobody heard: an empty page, not an error


def test_gateway_histograms_render_as_prometheus_histograms_per_process():
    def gateway(instance: str, ttft: Histogram) -> Heartbeat:
        return Heartbeat(role="gateway", instance=instance, rank=0, model="tiny", version="0.1", started_at=0.0,
                         requests=RequestStats(outcomes={"length": ttft.count}, ttft_seconds=ttft))

    a = Histogram(bounds=[0.1, 0.5, 1.0], buckets=[1, 3, 3], count=4, sum=3.2)
    b = Histogram(bounds=[0.1, 0.5, 1.0], buckets=[0, 2, 5], count=5, sum=4.0)
    page = render([gateway("g0", a), gateway("g1", b)], now=1.0)
    assert "# TYPE moebus_gateway_time_to_first_token_seconds histogram" in page.splitlines()
    series = parse(page)  # checks the histogram rules too
    g0 = who("gateway", "g0")
    buckets = histogram_buckets(series, "moebus_gateway_time_to_first_token_seconds")
    assert buckets[g0] == [(0.1, 1), (0.5, 3), (1.0, 3), (math.inf, 4)]
    assert series[("moebus_gateway_time_to_first_token_seconds_sum", g0)] == 3.2
    assert series[("moebus_gateway_time_to_first_token_seconds_count", g0)] == 4
    assert 'le="+Inf"' in page and 'le="1.0"' in page  # the spelling prometheus_client uses
    # what `sum by (le)` over the replicas gives: the buckets of both gateways' requests together
    summed = [sum(counts) for counts in zip(*([c for _, c in buckets[labels]] for labels in buckets))]
    assert summed == [1, 5, 8, 9]
    # a heartbeat of a gateway that has no histograms (an older version) still renders, without them
    old = Heartbeat(role="gateway", instance="g2", rank=0, model="tiny", version="0.0", started_at=0.0,
                    requests=RequestStats(outcomes={"stop": 1}))
    assert not any(name.startswith("moebus_gateway_time_to_first_token_seconds") for name, _ in parse(render([old], now=1.0)))


def test_a_prefill_instance_exports_its_queue_time_histogram():
    prefill = Heartbeat(role="prefill", instance="p0", rank=0, model="tiny", version="0.1", started_at=0.0, queued_requests=1,
                        prefill_queue_seconds=Histogram(bounds=[0.001, 0.01], buckets=[2, 2], count=3, sum=0.5))
    series = parse(render([prefill], now=1.0))
    p0 = who("prefill", "p0")
    assert histogram_buckets(series, "moebus_prefill_queue_time_seconds")[p0] == [(0.001, 2), (0.01, 2), (math.inf, 3)]
    assert series[("moebus_prefill_queue_time_seconds_sum", p0)] == 0.5 and series[("moebus_prefill_queue_time_seconds_count", p0)] == 3


# RequestStats' histogram fields and the families they render as (vLLM's names after `moebus_gateway_`)
GATEWAY_HISTOGRAMS = {"ttft_seconds": "time_to_first_token_seconds", "itl_seconds": "inter_token_latency_seconds",
                      "tpot_seconds": "request_time_per_output_token_seconds", "e2e_seconds": "e2e_request_latency_seconds",
                      "queue_seconds": "request_queue_time_seconds", "prefill_seconds": "request_prefill_time_seconds",
                      "decode_seconds": "request_decode_time_seconds", "prompt_tokens_per_request": "request_prompt_tokens",
                      "completion_tokens_per_request": "request_generation_tokens"}


def test_each_gateway_histogram_renders_as_its_own_family():
    assert set(GATEWAY_HISTOGRAMS) == {f for f in RequestStats.__struct_fields__ if f.endswith(("_seconds", "_per_request"))}
    stats = RequestStats(**{field: Histogram(bounds=[1.0, i + 2.0], buckets=[i, i], count=i + 1, sum=i + 0.5)
                            for i, field in enumerate(GATEWAY_HISTOGRAMS)})
    hb = Heartbeat(role="gateway", instance="g", rank=0, model="tiny", version="0.1", started_at=0.0, requests=stats)
    series = parse(render([hb], now=1.0))
    for i, short in enumerate(GATEWAY_HISTOGRAMS.values()):
        family = f"moebus_gateway_{short}"
        assert histogram_buckets(series, family) == {who("gateway", "g"): [(1.0, i), (i + 2.0, i), (math.inf, i + 1)]}, family
        assert series[(f"{family}_sum", who("gateway", "g"))] == i + 0.5, family


def test_a_fresh_gateway_exports_every_histogram_empty():
    hb = Heartbeat(role="gateway", instance="g", rank=0, model="tiny", version="0.1", started_at=0.0,
                   requests=RequestCounters(max_context=4096).stats())
    series = parse(render([hb], now=1.0))
    histograms = [name for name, kind, _ in FAMILIES if kind == "histogram" and name.startswith("moebus_gateway_")]
    assert len(histograms) == len(GATEWAY_HISTOGRAMS)
    for family in histograms:
        assert series[(f"{family}_count", who("gateway", "g"))] == 0


def test_a_heartbeat_with_a_malformed_histogram_is_refused_and_the_page_still_renders():
    class Msg:
        def __init__(self, hb: Heartbeat) -> None:
            self.data = msgspec.msgpack.encode(hb)

    def gateway(ttft: Histogram) -> Heartbeat:
        return Heartbeat(role="gateway", instance="g", rank=0, model="tiny", version="0.1", started_at=0.0,
                         requests=RequestStats(outcomes={"stop": ttft.count}, ttft_seconds=ttft))

    exporter = Exporter(expiry_s=60.0)
    good = Histogram(bounds=[0.1, 0.5], buckets=[1, 2], count=3, sum=1.0)
    asyncio.run(exporter.on_heartbeat(Msg(gateway(good))))
    bad = [Histogram(bounds=[0.1, 0.5], buckets=[1], count=1, sum=0.1),  # a count missing
           Histogram(bounds=[0.5, 0.1], buckets=[1, 2], count=2, sum=0.2),  # bounds out of order
           Histogram(bounds=[0.1, 0.5], buckets=[3, 2], count=3, sum=0.3),  # not cumulative
           Histogram(bounds=[0.1, 0.5], buckets=[1, 4], count=3, sum=0.3)]  # buckets past the count
    for h in bad:
        try:
            asyncio.run(exporter.on_heartbeat(Msg(gateway(h))))
        except ValueError as e:
            assert "ttft_seconds" in str(e)
        else:
            raise AssertionError(f"{h} was accepted")
    g = who("gateway", "g")
    series = parse(exporter.page())  # the previous, valid heartbeat is still the one on the page
    assert histogram_buckets(series, "moebus_gateway_time_to_first_token_seconds")[g] == [(0.1, 1), (0.5, 2), (math.inf, 3)]
