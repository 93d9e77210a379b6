"""`moebus metrics`: the stack's heartbeats as a Prometheus scrape target.

`moebus metrics --url nats://127.0.0.1:4222 --port 9464` listens on `ctl.heartbeat.>`
and serves `GET /metrics` in Prometheus' text format (version 0.0.4), one series per
process and field of its latest heartbeat: the same figures `moebus status` prints
(load, KV pages, decode steps by path, KV transfer totals, a prefill instance's prefix cache
lookups, hits and evictions, a gateway's requests by outcome, tokens and latency quantiles), and a gateway's
histograms of its requests since start (time to first token, inter-token latency, time per output token,
end-to-end latency, time to placement, prefill and decode time, prompt and completion tokens) and a prefill
instance's of its tasks' queue time, which sum over replicas and rate over any window:
`histogram_quantile(0.99, sum by (le) (rate(moebus_gateway_time_to_first_token_seconds_bucket[5m])))`.
Every series carries `role`, `instance`, `rank` and `model_name` (the served model, the label vLLM puts on
all of its series); a process silent for `expiry_s` seconds (`--expiry`) is dropped from the page, so a dead
replica's series end instead of freezing. Counters are the processes' own totals since
they started (a restart starts them again, which Prometheus' `rate()` handles).
Configured by `shared.settings.MetricsSettings`: the `[metrics]` table of the TOML file,
`MOEBUS_METRICS_<FIELD>` / `MOEBUS_<FIELD>` variables, the flags over both.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

from nats.aio.msg import Msg

from schemas import subjects
from schemas.internal import Heartbeat, Histogram, LatencySummary, PrefixCacheStats, TransferStats
from services import http
from services.liveness import LatestHeartbeats
from shared.bus import connect, unpack
from shared.settings import MetricsSettings

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PATH = "/metrics"  # the one path served: the scrape page
# (name, type, help) of every family, in page order.
FAMILIES = [
    ("moebus_up", "gauge", "1 for every process heard within the expiry"),
    ("moebus_draining", "gauge", "1 while the process takes no new work"),
    ("moebus_uptime_seconds", "gauge", "seconds since the process started"),
    ("moebus_gateway_in_flight", "gauge", "requests between admission and final reply"),
    ("moebus_gateway_requests_total", "counter", "final replies by outcome (stop, length or the error code)"),
    ("moebus_gateway_prompt_tokens_total", "counter", "prompt tokens of finished requests"),
    ("moebus_gateway_completion_tokens_total", "counter", "completion tokens of finished requests"),
    ("moebus_gateway_ttft_seconds", "gauge", "time to first token over the gateway's latest finished requests, by quantile"),
    ("moebus_gateway_tpot_seconds", "gauge", "time per output token after the first over the latest finished requests, by quantile"),
    ("moebus_gateway_time_to_first_token_seconds", "histogram",
     "arrival at the gateway to first token, counted when it arrives (also for requests that fail later)"),
    ("moebus_gateway_inter_token_latency_seconds", "histogram",
     "gap between consecutive token arrivals of a request at the gateway (one per decode step; tokens that arrive together count once),"
     " counted as they arrive"),
    ("moebus_gateway_request_time_per_output_token_seconds", "histogram",
     "a finished request's mean time per output token after the first (requests of 2+ tokens)"),
    ("moebus_gateway_e2e_request_latency_seconds", "histogram", "arrival at the gateway to final reply, of finished requests"),
    ("moebus_gateway_request_queue_time_seconds", "histogram",
     "arrival at the gateway to placement by a scheduler, of finished requests (not the wait in a prefill instance's queue)"),
    ("moebus_gateway_request_prefill_time_seconds", "histogram",
     "the scheduler's placement reaching the gateway to the first token reaching it, of finished requests: the prefill"
     " instance's queue wait, its prefill pass and the bus hops (time to first token minus queue time)"),
    ("moebus_gateway_request_decode_time_seconds", "histogram",
     "first token to last token reaching the gateway, of finished requests (0 for one token)"),
    ("moebus_gateway_request_prompt_tokens", "histogram", "prompt tokens per finished request"),
    ("moebus_gateway_request_generation_tokens", "histogram", "completion tokens per finished request"),
    ("moebus_scheduler_waiting_requests", "gauge", "requests waiting at a scheduler for capacity"),
    ("moebus_scheduler_suspect_ranks", "gauge", "decode ranks a scheduler skips after a missed reservation reply, until they answer a probe"),
    ("moebus_prefill_queued_requests", "gauge", "requests queued at a prefill instance"),
    ("moebus_prefill_queued_tokens", "gauge", "input tokens queued or running at a prefill instance"),
    ("moebus_prefill_queue_time_seconds", "histogram", "a task's wait at a prefill instance from its arrival until a batch takes it"),
    ("moebus_prefill_prefix_cache_lookups_total", "counter", "requests that looked for cached prefix pages"),
    ("moebus_prefill_prefix_cache_hits_total", "counter", "requests that reused at least one cached prefix page"),
    ("moebus_prefill_prefix_cache_lookup_tokens_total", "counter", "prompt tokens of the requests that looked up the prefix cache"),
    ("moebus_prefill_prefix_cache_hit_tokens_total", "counter", "prompt tokens whose KV came from the prefix cache"),
    ("moebus_prefill_prefix_cache_evictions_total", "counter", "cached prefix pages evicted to make room"),
    ("moebus_prefill_prefix_cache_pages", "gauge", "KV pages holding a cached prefix (held by requests or evictable)"),
    ("moebus_prefill_prefix_cache_evictable_pages", "gauge", "cached prefix pages no request holds"),
    ("moebus_decode_batch_size", "gauge", "running and reserved requests of a decode rank"),
    ("moebus_decode_max_batch", "gauge", "most requests a decode rank takes"),
    ("moebus_decode_kv_pages", "gauge", "KV pages of a decode rank"),
    ("moebus_decode_kv_pages_free", "gauge", "KV pages neither in use nor reserved"),
    ("moebus_decode_steps_total", "counter", "decode forwards by path (graph_replay, graph_capture, eager)"),
    ("moebus_kv_transfers_total", "counter", "completed KV transfers (decode: requests received; prefill: shards sent)"),
    ("moebus_kv_transfer_bytes_total", "counter", "bytes of the completed KV transfers"),
    ("moebus_kv_transfer_seconds_total", "counter", "summed wall time of the completed KV transfers"),
    ("moebus_kv_transfer_failures_total", "counter", "failed KV transfers by cause"),
]
# The family of every series name: a histogram's _bucket, _sum and _count lines belong to it.
FAMILY_OF = {name + suffix: name for name, kind, _ in FAMILIES for suffix in (("_bucket", "_sum", "_count") if kind == "histogram" else ("",))}
Sample = tuple[str, dict[str, str], float]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _quantiles(name: str, labels: dict[str, str], summary: LatencySummary | None) -> Iterator[Sample]:
    if summary is not None:
        for q, ms in (("0.5", summary.p50_ms), ("0.9", summary.p90_ms), ("0.99", summary.p99_ms)):
            yield name, labels | {"quantile": q}, ms / 1000


def _histogram(name: str, labels: dict[str, str], h: Histogram | None) -> Iterator[Sample]:
    """A Prometheus histogram: cumulative `_bucket{le}` lines ending with `+Inf`, then `_sum` and `_count`."""
    if h is None:
        return
    for bound, n in zip(h.bounds, h.buckets, strict=True):  # check_histograms let it in
        yield f"{name}_bucket", labels | {"le": repr(float(bound))}, n
    yield f"{name}_bucket", labels | {"le": "+Inf"}, h.count
    yield f"{name}_sum", labels, h.sum
    yield f"{name}_count", labels, h.count


def check_histograms(hb: Heartbeat) -> None:
    """Raise ValueError unless every histogram of `hb` is one Prometheus accepts: a count per bound,
    bounds ascending, cumulative counts not decreasing and not above the total count."""
    found = {"prefill_queue_seconds": hb.prefill_queue_seconds}
    if hb.requests is not None:
        found |= {f"requests.{f}": getattr(hb.requests, f) for f in hb.requests.__struct_fields__}
    for field, h in found.items():
        if not isinstance(h, Histogram):
            continue
        if len(h.bounds) != len(h.buckets):
            why = f"{len(h.bounds)} bounds but {len(h.buckets)} bucket counts"
        elif any(a >= b for a, b in zip(h.bounds, h.bounds[1:])):
            why = "bounds not ascending"
        elif any(a > b for a, b in zip(h.buckets, [*h.buckets[1:], h.count])):
            why = "bucket counts not cumulative up to the count"
        else:
            continue
        raise ValueError(f"heartbeat of {hb.role} {hb.instance}/{hb.rank}: histogram {field}: {why}")


def _transfers(labels: dict[str, str], t: TransferStats | None) -> Iterator[Sample]:
    if t is None:
        return
    yield "moebus_kv_transfers_total", labels, t.completed
    yield "moebus_kv_transfer_bytes_total", labels, t.bytes_total
    yield "moebus_kv_transfer_seconds_total", labels, t.seconds_total
    for cause, n in t.failures.items():
        yield "moebus_kv_transfer_failures_total", labels | {"cause": cause}, n


def _prefix_cache(labels: dict[str, str], p: PrefixCacheStats | None) -> Iterator[Sample]:
    if p is None:
        return
    yield "moebus_prefill_prefix_cache_lookups_total", labels, p.lookups
    yield "moebus_prefill_prefix_cache_hits_total", labels, p.hits
    yield "moebus_prefill_prefix_cache_lookup_tokens_total", labels, p.lookup_tokens
    yield "moebus_prefill_prefix_cache_hit_tokens_total", labels, p.hit_tokens
    yield "moebus_prefill_prefix_cache_evictions_total", labels, p.evictions
    yield "moebus_prefill_prefix_cache_pages", labels, p.cached_pages
    yield "moebus_prefill_prefix_cache_evictable_pages", labels, p.evictable_pages


def samples(hb: Heartbeat, now: float) -> Iterator[Sample]:
    """Every series of one process's heartbeat (`now`: wall clock, for the uptime)."""
    who = {"role": hb.role, "instance": hb.instance, "rank": str(hb.rank), "model_name": hb.model}
    yield "moebus_up", who | {"model": hb.model, "version": hb.version}, 1
    yield "moebus_draining", who, int(hb.draining)
    yield "moebus_uptime_seconds", who, max(0.0, now - hb.started_at)
    if hb.role == "gateway":
        yield "moebus_gateway_in_flight", who, hb.in_flight
        if hb.requests is not None:
            for outcome, n in hb.requests.outcomes.items():
                yield "moebus_gateway_requests_total", who | {"outcome": outcome}, n
            yield "moebus_gateway_prompt_tokens_total", who, hb.requests.prompt_tokens
            yield "moebus_gateway_completion_tokens_total", who, hb.requests.completion_tokens
            yield from _quantiles("moebus_gateway_ttft_seconds", who, hb.requests.ttft)
            yield from _quantiles("moebus_gateway_tpot_seconds", who, hb.requests.tpot)
            yield from _histogram("moebus_gateway_time_to_first_token_seconds", who, hb.requests.ttft_seconds)
            yield from _histogram("moebus_gateway_inter_token_latency_seconds", who, hb.requests.itl_seconds)
            yield from _histogram("moebus_gateway_request_time_per_output_token_seconds", who, hb.requests.tpot_seconds)
            yield from _histogram("moebus_gateway_e2e_request_latency_seconds", who, hb.requests.e2e_seconds)
            yield from _histogram("moebus_gateway_request_queue_time_seconds", who, hb.requests.queue_seconds)
            yield from _histogram("moebus_gateway_request_prefill_time_seconds", who, hb.requests.prefill_seconds)
            yield from _histogram("moebus_gateway_request_decode_time_seconds", who, hb.requests.decode_seconds)
            yield from _histogram("moebus_gateway_request_prompt_tokens", who, hb.requests.prompt_tokens_per_request)
            yield from _histogram("moebus_gateway_request_generation_tokens", who, hb.requests.completion_tokens_per_request)
    elif hb.role == "scheduler":
        yield "moebus_scheduler_waiting_requests", who, hb.queued_requests
        yield "moebus_scheduler_suspect_ranks", who, len(hb.suspect_ranks)
    elif hb.role == "prefill":
        yield "moebus_prefill_queued_requests", who, hb.queued_requests
        yield "moebus_prefill_queued_tokens", who, hb.queued_tokens
        yield from _histogram("moebus_prefill_queue_time_seconds", who, hb.prefill_queue_seconds)
        yield from _prefix_cache(who, hb.prefix_cache)
    elif hb.role == "decode":
        yield "moebus_decode_batch_size", who, hb.batch_size
        yield "moebus_decode_max_batch", who, hb.max_batch
        yield "moebus_decode_kv_pages", who, hb.kv_total_pages
        yield "moebus_decode_kv_pages_free", who, hb.kv_free_pages
        for path, n in hb.decode_steps.items():
            yield "moebus_decode_steps_total", who | {"path": path}, n
    yield from _transfers(who, hb.transfer)


def render(members: list[Heartbeat], now: float) -> str:
    """The scrape page: HELP and TYPE, then the series, for every family that has one."""
    by_family: dict[str, list[str]] = {name: [] for name, _, _ in FAMILIES}
    for hb in members:
        for name, labels, value in samples(hb, now):
            label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            by_family[FAMILY_OF[name]].append(f"{name}{{{label_text}}} {value!r}")
    lines = []
    for name, kind, help_ in FAMILIES:
        if by_family[name]:
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *by_family[name]]
    return "\n".join(lines) + "\n"


class Exporter:
    """The latest heartbeat of every process heard within `expiry_s`, and the HTTP side."""

    def __init__(self, expiry_s: float) -> None:
        self.heartbeats = LatestHeartbeats(expiry_s)

    async def on_heartbeat(self, msg: Msg) -> None:
        """Keep `msg`'s heartbeat as its process's latest; one that is malformed raises (the bus logs
        `handler_failed`) and the process keeps its previous one, so the page always renders."""
        hb = unpack(msg.data, Heartbeat)
        check_histograms(hb)
        self.heartbeats.record(hb, time.monotonic())

    def page(self) -> str:
        return render(self.heartbeats.live(time.monotonic()), time.time())

    async def handle(self, conn: http.Connection) -> None:
        """One request of ``conn`` (Prometheus keeps its connection between scrapes): GET /metrics
        gets the page (HEAD its head), anything else 404/405."""
        try:
            try:
                req = await http.read_request(conn, max_body=0)
                allowed = http.methods(("GET",))
                if req.method not in allowed:
                    raise http.HttpError(405, f"only GET {PATH}", {"Allow": ", ".join(allowed)})
                if req.path != PATH:
                    raise http.HttpError(404, f"see {PATH}")
                await http.respond(conn, 200, self.page().encode(), CONTENT_TYPE)
            except http.HttpError as e:
                await http.refuse(conn, e.status, f"{e.message}\n".encode(), "text/plain", e.headers)
        except ConnectionError:
            conn.keep = False  # a client that went away


async def serve(settings: MetricsSettings) -> None:
    exporter = Exporter(settings.expiry_s)
    async with connect(settings.nats_url, "moebus-metrics", connect_timeout=settings.connect_timeout_s) as bus:
        await bus.subscribe(subjects.HEARTBEAT_ALL, exporter.on_heartbeat, concurrent=False)
        await http.listen("metrics", exporter.handle, PATH, settings)


def arguments() -> argparse.ArgumentParser:
    """The command line of `moebus metrics`: every flag sets the `MetricsSettings` field of its ``dest``."""
    ap = argparse.ArgumentParser(prog="moebus metrics", description="serve a running stack's heartbeats as Prometheus metrics")
    http.frontend_arguments(ap, MetricsSettings)
    ap.add_argument("--expiry", dest="expiry_s", type=float, metavar="SECONDS",
                    help=f"seconds after its last heartbeat a process leaves the page (default {MetricsSettings().expiry_s:g})")
    return ap


def _parse(argv: list[str]) -> MetricsSettings:
    """`MetricsSettings` from the flags over the environment and the TOML file (every flag sets its field)."""
    return http.parse_frontend(arguments(), MetricsSettings, "metrics", argv)


def main(argv: list[str]) -> int:
    settings = _parse(argv)
    return http.run_frontend("metrics", serve(settings))
