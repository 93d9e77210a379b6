"""`moebus metrics`: heartbeats rendered as Prometheus text (units here; the stack test in
test_pipeline.py scrapes a real stack)."""

from __future__ import annotations

import re

from schemas.internal import Heartbeat, LatencySummary, RequestStats, TransferStats
from services.metrics import FAMILIES, render

SERIES = re.compile(r'^([a-z_]+)\{((?:[a-z_]+="(?:[^"\\]|\\.)*",?)*)\} (\S+)$')


def parse(page: str) -> dict[tuple[str, frozenset], float]:
    """Series of a text-format page, checking that every family is announced (HELP, TYPE) before its series."""
    announced: dict[str, list[str]] = {}
    series = {}
    for line in page.splitlines():
        if line.startswith("# "):
            _, what, name, rest = line.split(" ", 3)
            announced.setdefault(name, []).append(what)
            continue
        m = SERIES.match(line)
        assert m, f"not a series line: {line!r}"
        name, labels, value = m.groups()
        assert announced.get(name) == ["HELP", "TYPE"], f"{name} is not announced before its series"
        pairs = frozenset(re.findall(r'([a-z_]+)="((?:[^"\\]|\\.)*)"', labels))
        series[(name, pairs)] = float(value)
    return series


def test_every_heartbeat_field_becomes_a_series_with_the_process_labels():
    gateway = Heartbeat(role="gateway", instance='gw "a"', rank=0, model="tiny", version="0.1", started_at=100.0, in_flight=3,
                        requests=RequestStats(outcomes={"length": 5, "overloaded": 2}, prompt_tokens=40, completion_tokens=90,
                                              ttft=LatencySummary(count=5, p50_ms=20.0, p90_ms=35.0, p99_ms=50.0)))
    decode = Heartbeat(role="decode", instance="d0", rank=1, model="tiny", version="0.1", started_at=90.0, draining=True,
                       kv_total_pages=511, kv_free_pages=500, batch_size=2, max_batch=32, decode_steps={"graph_replay": 7, "eager": 1},
                       transfer=TransferStats(completed=4, bytes_total=123456, seconds_total=0.25, failures={"lease_expired": 1}))
    scheduler = Heartbeat(role="scheduler", instance="s0", rank=0, model="tiny", version="0.1", started_at=150.0, queued_requests=4,
                          suspect_ranks=["d0/1"])
    series = parse(render([gateway, decode, scheduler], now=160.0))
    s0 = frozenset({("role", "scheduler"), ("instance", "s0"), ("rank", "0")})
    assert series[("moebus_scheduler_waiting_requests", s0)] == 4 and series[("moebus_scheduler_suspect_ranks", s0)] == 1
    gw = frozenset({("role", "gateway"), ("instance", 'gw \\"a\\"'), ("rank", "0")})
    d0 = frozenset({("role", "decode"), ("instance", "d0"), ("rank", "1")})
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
    assert render([], now=0.0) == "\n"  # nobody heard: an empty page, not an error
