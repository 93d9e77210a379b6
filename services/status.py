"""`moebus status`: what a running stack reports about itself, read from its heartbeats.

`moebus status --url nats://127.0.0.1:4222` listens on `ctl.heartbeat.>` for `--wait`
seconds (every service beats every `heartbeat_interval_s`, 0.5 s by default) and prints
one line per process: role, instance, rank, model, uptime, whether it drains, and its
load (gateway: requests in flight; scheduler: requests waiting for capacity, and the decode ranks it
skips after a missed reservation reply; prefill: queued requests and tokens, prefix cache hits; decode: batch
and KV pages in use), its KV transfer totals and a decode rank's steps by path. Below
come the totals over all gateways (requests by outcome, tokens, time to first token and
time per output token, percentiles over each gateway's recent requests; with several
gateways, the worst gateway's percentile) and over all decode ranks (KV pages, transfers).
`--json` prints the heartbeats themselves, one JSON object per line.

The exit status is 1 when no process was heard (nothing serves on that bus), and, after the
listing (`--json` too), when a role of the stack (`ROLES`) has no serving process for a model the bus
serves: no instance of it was heard, or only draining ones, which take no new work; the stack cannot
answer that model's requests then, and stderr says which role is missing, one line per such model
(naming the model when the heartbeats name more than one).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time

import msgspec

from schemas import subjects
from schemas.internal import Heartbeat, LatencySummary, TransferStats
from services.compose import ROLES
from services.liveness import takes_new_work
from shared.bus import Unreachable, connect, unpack
from shared.logging import configure_tool_logging
from shared.settings import nats_url_from_env


async def collect(url: str, wait_s: float) -> list[Heartbeat]:
    """The latest heartbeat of every (role, instance, rank) heard within `wait_s`, in display order."""
    latest: dict[tuple[str, str, int], Heartbeat] = {}

    async def on_heartbeat(msg) -> None:  # type: ignore[no-untyped-def]
        hb = unpack(msg.data, Heartbeat)
        latest[(hb.role, hb.instance, hb.rank)] = hb

    async with connect(url, "moebus-status") as bus:
        await bus.subscribe(subjects.HEARTBEAT_ALL, on_heartbeat, concurrent=False)
        await asyncio.sleep(wait_s)
    return [latest[key] for key in sorted(latest, key=lambda k: (ROLES.index(k[0]), k[1], k[2]))]


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def _counts(counts: dict[str, int]) -> str:
    return " ".join(f"{name}={n}" for name, n in sorted(counts.items())) or "-"


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _failed_and_cancelled(failures: dict[str, int]) -> tuple[dict[str, int], int]:
    """A transfer's failures by cause, apart from those cancelled (a client that hung up, a request that
    ended): those are shown on their own, so that a healthy stack under normal cancels does not look faulty."""
    return {cause: n for cause, n in failures.items() if cause != "cancelled"}, failures.get("cancelled", 0)


def _transfers(role: str, t: TransferStats | None) -> str:
    if t is None:
        return ""
    rate = f" {_bytes(t.bytes_total / t.seconds_total)}/s" if t.seconds_total > 0 else ""
    failures, cancelled = _failed_and_cancelled(t.failures)
    failed = (f" failed[{_counts(failures)}]" if failures else "") + (f" cancelled={cancelled}" if cancelled else "")
    return f"kv_{'sent' if role == 'prefill' else 'received'}={t.completed} ({_bytes(t.bytes_total)}{rate}){failed}"


def _prefix_cache(hb: Heartbeat) -> str:
    """A prefill leader's prefix cache: requests that reused pages, the share of looked-up prompt
    tokens that came from the cache, the pages it holds (evictable ones in brackets)."""
    p = hb.prefix_cache
    if p is None:
        return ""
    share = f" {100 * p.hit_tokens / p.lookup_tokens:.0f}% tok" if p.lookup_tokens else ""
    return f"prefix_hits={p.hits}/{p.lookups}{share} cached_pages={p.cached_pages} ({p.evictable_pages} evictable) evicted={p.evictions}"


def _load(hb: Heartbeat) -> str:
    if hb.role == "gateway":
        return f"in_flight={hb.in_flight}"
    if hb.role == "scheduler":
        return f"waiting={hb.queued_requests}" + (f" suspect[{' '.join(hb.suspect_ranks)}]" if hb.suspect_ranks else "")
    if hb.role == "prefill":
        return f"queued={hb.queued_requests} ({hb.queued_tokens} tok)"
    if hb.role == "decode":
        used = hb.kv_total_pages - hb.kv_free_pages
        return f"batch={hb.batch_size}/{hb.max_batch} kv_pages={used}/{hb.kv_total_pages}"
    return ""


def member_line(hb: Heartbeat, now: float) -> str:
    """One process: who it is, how long it has run, its load and totals."""
    state = "draining" if hb.draining else "serving"
    steps = f"steps[{_counts(hb.decode_steps)}]" if hb.decode_steps else ""
    parts = [f"{hb.role:<9}", f"{hb.instance:<14}", f"{hb.rank:>2}", f"{hb.model:<16}", f"{_duration(now - hb.started_at):>7}", f"{state:<8}",
             _load(hb), _prefix_cache(hb), _transfers(hb.role, hb.transfer), steps]
    return "  ".join(p for p in parts if p).rstrip()


def _latency(name: str, summaries: list[LatencySummary]) -> str:
    if not summaries:
        return f"{name} -"
    worst = {q: max(getattr(s, q) for s in summaries) for q in ("p50_ms", "p90_ms", "p99_ms")}
    return f"{name} p50={worst['p50_ms']:.1f}ms p90={worst['p90_ms']:.1f}ms p99={worst['p99_ms']:.1f}ms (last {sum(s.count for s in summaries)})"


def summary_lines(members: list[Heartbeat]) -> list[str]:
    """Totals over the gateways' requests and over the decode ranks' KV pages and transfers."""
    lines = []
    stats = [hb.requests for hb in members if hb.role == "gateway" and hb.requests is not None]
    if stats:
        outcomes: dict[str, int] = {}
        for s in stats:
            for name, n in s.outcomes.items():
                outcomes[name] = outcomes.get(name, 0) + n
        finished = outcomes.get("stop", 0) + outcomes.get("length", 0)
        lines.append(f"requests: {sum(outcomes.values())} answered, {finished} finished; by outcome: {_counts(outcomes)}; "
                     f"tokens in={sum(s.prompt_tokens for s in stats)} out={sum(s.completion_tokens for s in stats)}")
        lines.append("latency: " + _latency("ttft", [s.ttft for s in stats if s.ttft]) + "; " + _latency("tpot", [s.tpot for s in stats if s.tpot]))
    decode = [hb for hb in members if hb.role == "decode"]
    if decode:
        total = sum(hb.kv_total_pages for hb in decode)
        used = total - sum(hb.kv_free_pages for hb in decode)
        received = [hb.transfer for hb in decode if hb.transfer is not None]
        every: dict[str, int] = {}
        for t in received:
            for cause, n in t.failures.items():
                every[cause] = every.get(cause, 0) + n
        failures, cancelled = _failed_and_cancelled(every)
        lines.append(f"decode: {len(decode)} ranks, batch {sum(hb.batch_size for hb in decode)}/{sum(hb.max_batch for hb in decode)}, "
                     f"kv pages {used}/{total} in use; kv received {sum(t.completed for t in received)} "
                     f"({_bytes(sum(t.bytes_total for t in received))}), transfer failures: {_counts(failures)}, cancelled: {cancelled}")
    return lines


def missing_roles(members: list[Heartbeat]) -> dict[str, list[str]]:
    """For each model served among ``members`` (the ``model`` their heartbeats name), the roles without a
    serving process of that model (`takes_new_work`: of a prefill instance its leader), each as the warning
    names it; models that lack none are left out. A
    request needs one of each (a gateway, a scheduler, a prefill and a decode instance) serving its model:
    a bus with two models and decode for one only cannot answer the other's requests. A process that names
    no model (a scheduler started without one) serves every model, as its registry takes any; with no model
    named at all the stack is checked as one, under ``""``."""
    missing: dict[str, list[str]] = {}
    for model in sorted({hb.model for hb in members if hb.model}) or [""]:
        of_model = [hb for hb in members if hb.model in (model, "")]
        serving = {hb.role for hb in of_model if takes_new_work(hb)}
        roles = [_why_missing(role, [hb for hb in of_model if hb.role == role]) for role in ROLES if role not in serving]
        if roles:
            missing[model] = roles
    return missing


def _why_missing(role: str, heard: list[Heartbeat]) -> str:
    """``role`` as the warning names it, with what was heard of it that takes no work."""
    if not heard:
        return role
    if all(hb.draining for hb in heard):
        return f"{role} (only draining ones)"
    return f"{role} (no rank 0, the leader, taking work)"


def missing_lines(members: list[Heartbeat], url: str, wait_s: float) -> list[str]:
    """The warnings of `missing_roles`, one per model that lacks a role; the model is named only when the
    bus serves more than one."""
    several = len({hb.model for hb in members if hb.model}) > 1
    return [f"moebus status: no serving {', '.join(roles)}{f' of model {model}' if several else ''} heard on {url} within {wait_s}s: "
            f"the stack cannot answer requests{f' for {model}' if several else ''}" for model, roles in missing_roles(members).items()]


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="moebus status", description="show what a running moebus stack reports in its heartbeats")
    ap.add_argument("--url", default=nats_url_from_env(), help="NATS URL (printed by `moebus up`; default: $MOEBUS_NATS_URL, else nats://127.0.0.1:4222)")
    ap.add_argument("--wait", type=float, default=1.5, help="seconds to listen (at least two heartbeat intervals)")
    ap.add_argument("--json", action="store_true", help="print each process's latest heartbeat as a JSON line")
    a = ap.parse_args(argv)
    if not 0 < a.wait < math.inf:  # nan too: it listened for nothing and then said no process serves
        ap.error(f"--wait must be a positive number of seconds, got {a.wait}")
    return a


def main(argv: list[str]) -> int:
    a = _parse(argv)
    configure_tool_logging("moebus-status")
    try:
        members = asyncio.run(collect(a.url, a.wait))
    except Unreachable as e:
        print(f"moebus status: {e}", file=sys.stderr)
        return 1
    if not members:
        print(f"moebus status: no heartbeat on {a.url} within {a.wait}s: no moebus process serves there", file=sys.stderr)
        return 1
    if a.json:
        for hb in members:
            print(msgspec.json.encode(hb).decode())
    else:
        now = time.time()
        for hb in members:
            print(member_line(hb, now))
        for line in summary_lines(members):
            print(line)
    warnings = missing_lines(members, a.url, a.wait)
    if warnings:
        sys.stdout.flush()  # the listing first, then the warnings below it, on a terminal showing both
        print("\n".join(warnings), file=sys.stderr)
        return 1
    return 0
