"""Helpers the services tests share: real stacks, a client session, a heartbeat watch."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import math
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from schemas import subjects
from schemas.api import GenerateChunk, GenerateRequest, GenerateResponse
from schemas.internal import Heartbeat
from services.client import Client, GenerateError
from services.compose import EPHEMERAL_FRONTENDS, REPO_ROOT, ServiceSpec, load_compose
from services.launch import LocalStack
from shared.bus import Bus, connect, unpack
from shared.settings import NatsServerSettings

T = TypeVar("T")

# The OpenAI frontend's fields taken only at their no-op values (`protocol`'s NO_OPS): vLLM's extensions
# both endpoints take, and OpenAI's chat fields, at the values that ask for nothing moebus does not do;
# then one value of each that asks for something.
NO_OP_FIELDS: dict[str, Any] = {"use_beam_search": False,
                "length_penalty": 1.0, "prompt_logprobs": None,
                "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None, "structured_outputs": None}
CHAT_NO_OP_FIELDS: dict[str, Any] = NO_OP_FIELDS | {"store": False, "metadata": {"user": "u1", "app": "trial"}, "service_tier": "auto",
                                    "modalities": ["text"], "reasoning_effort": None, "prediction": None}
USED_FIELDS: dict[str, Any] = {"use_beam_search": True,
               "length_penalty": 0.5, "prompt_logprobs": 1,
               "guided_json": {"type": "object"}, "guided_regex": "a+", "guided_choice": ["yes", "no"], "guided_grammar": 'root ::= "a"',
               "structured_outputs": {"choice": ["yes", "no"]}}
CHAT_USED_FIELDS: dict[str, Any] = USED_FIELDS | {"store": True, "service_tier": "flex", "modalities": ["text", "audio"], "reasoning_effort": "low",
                                  "prediction": {"type": "content", "content": "def f(): pass"}}



def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def until_listened(bus: Bus, subject: str, timeout: float = 10.0) -> None:
    """Until the server routes `subject` to a subscriber, as seen from `bus`'s connection: a
    flush on the subscriber's side does not suffice (a request right after it met "no
    responders" about one run in four here)."""
    deadline = time.monotonic() + timeout
    while not await bus.has_listener(subject, b"", wait_s=0.2):
        assert time.monotonic() < deadline, f"nothing subscribes to {subject}"
        await asyncio.sleep(0.01)


def compose_specs(compose: str, model: Path, scale: dict[str, int] | None = None) -> list[ServiceSpec]:
    """The services of one of the repository's compose files; HTTP frontends on free local ports."""
    return load_compose(REPO_ROOT / "compose" / compose, {"MOEBUS_MODEL": str(model), **EPHEMERAL_FRONTENDS}, scale)


def start_specs(specs: list[ServiceSpec], model: Path, log_dir: Path, env: dict[str, str] | None = None,
                nats: NatsServerSettings | None = None) -> LocalStack:
    """Start a stack (JSON logs; its nats-server configured by ``nats``, else the defaults) and wait
    until it is ready; stopped again if it never gets there."""
    stack = LocalStack(specs, model, log_dir, extra_env={"MOEBUS_LOG_JSON": "true", **(env or {})}, nats_settings=nats or NatsServerSettings())
    try:
        stack.start(ready_timeout=240)
    except BaseException:
        stack.stop()
        raise
    return stack


def start_stack(tiny_model: Path, log_dir: Path, compose: str, scale: dict[str, int] | None = None, env: dict[str, str] | None = None,
                nats: NatsServerSettings | None = None) -> LocalStack:
    return start_specs(compose_specs(compose, tiny_model, scale), tiny_model, log_dir, env, nats)


def frontend_address(stack: LocalStack, replica: str = "openai-0") -> tuple[str, int]:
    """(host, port) of one of the stack's HTTP frontends (`moebus openai`, `moebus metrics`), from the address it printed."""
    urls = stack.frontend_urls()
    match = re.search(r"http://([\d.]+):(\d+)/", urls.get(replica, ""))
    assert match, f"{replica} printed no address: {urls}"
    return match.group(1), int(match.group(2))


@contextlib.contextmanager
def openai_frontend(url: str, flags: list[str], env: dict[str, str] | None = None) -> Iterator[tuple[str, int]]:
    """(host, port) of a `moebus openai` of its own on the stack at ``url``, started with ``flags`` (and
    ``env``, else this process's environment) on a port the OS picks; stopped at the end."""
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "openai", "--url", url, "--port", "0", *flags], stdout=subprocess.PIPE, text=True,
                            env=env)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        match = re.search(r"http://([\d.]+):(\d+)/v1", line)
        assert match, f"the frontend printed no address: {line!r} (exit {proc.poll()})"
        yield match.group(1), int(match.group(2))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def post_json(addr: tuple[str, int], path: str, body: object) -> tuple[int, dict]:
    """(status, decoded JSON answer) of one POST of ``body`` (JSON-encoded unless it is bytes) to a frontend."""
    conn = http.client.HTTPConnection(*addr, timeout=60)
    try:
        conn.request("POST", path, body=body if isinstance(body, bytes) else json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def health(addr: tuple[str, int]) -> tuple[int, str]:
    """(status, body) of the frontend's GET /health."""
    conn = http.client.HTTPConnection(*addr, timeout=30)
    try:
        conn.request("GET", "/health")
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def written_lines(log: Path) -> list[str]:
    """The lines of a log a live process is writing, less a last line it has not finished yet
    (reading between two writes of one event would otherwise see half a JSON object)."""
    return log.read_text(errors="replace").split("\n")[:-1]


def log_records(stack: LocalStack, needle: str) -> Iterator[dict[str, Any]]:
    """The JSON events of the replicas' logs on lines containing `needle` (other lines, e.g.
    tracebacks, are skipped), each with the replica's instance added."""
    for replica in stack.replicas:
        for n, line in enumerate(written_lines(replica.log_path), 1):
            if line.startswith("{") and needle in line:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise AssertionError(f"{replica.log_path}:{n} is not one JSON event: {e}: {line[:300]}") from e
                yield record | {"replica": replica.instance}


def log_events(stack: LocalStack, event: str) -> list[dict[str, Any]]:
    """Every `event` in the replicas' logs."""
    return [r for r in log_records(stack, f'"{event}"') if r.get("event") == event]


def log_events_of(stack: LocalStack, request_id: str) -> list[dict[str, Any]]:
    """Every event the replicas logged for one request."""
    return [r for r in log_records(stack, request_id) if r.get("request_id") == request_id]


def stack_fixture(compose: str, scale: dict[str, int] | None = None, env: dict[str, str] | None = None,
                  nats: NatsServerSettings | None = None) -> Callable[..., Iterator[LocalStack]]:
    @pytest.fixture(scope="module")
    def fixture(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
        stack = start_stack(tiny_model, tmp_path_factory.mktemp("stack-logs"), compose, scale, env, nats)
        try:
            yield stack
        finally:
            stack.stop()

    return fixture


async def until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Poll `condition` every 10 ms until it holds; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:g}s waiting until {what}"
        await asyncio.sleep(0.01)


class HeartbeatWatch:
    """The latest heartbeat of every (role, instance, rank), and a way to wait for a condition."""

    def __init__(self) -> None:
        self.latest: dict[tuple[str, str, int], Heartbeat] = {}
        self.seen_at: dict[tuple[str, str, int], float] = {}

    async def attach(self, bus: Bus) -> None:
        async def on_hb(msg) -> None:  # type: ignore[no-untyped-def]
            hb = unpack(msg.data, Heartbeat)
            key = (hb.role, hb.instance, hb.rank)
            self.latest[key] = hb
            self.seen_at[key] = time.monotonic()

        await bus.subscribe(subjects.HEARTBEAT_ALL, on_hb, concurrent=False)

    def live(self, role: str, within_s: float = 1.5) -> list[Heartbeat]:
        now = time.monotonic()
        return [hb for key, hb in self.latest.items() if key[0] == role and now - self.seen_at[key] < within_s]

    async def wait_for(self, condition: Callable[[HeartbeatWatch], bool], timeout: float, what: str,
                       show: Callable[[HeartbeatWatch], object] | None = None) -> None:
        """Poll ``condition``; on timeout fail with ``show(self)`` (default: every latest heartbeat,
        which CI's log may cut off: pass what the condition reads)."""
        deadline = time.monotonic() + timeout
        while not condition(self):
            if time.monotonic() > deadline:
                shown = self.latest if show is None else show(self)
                raise AssertionError(f"timed out after {timeout}s waiting for {what}; {'heartbeats' if show is None else 'seen'}: {shown}")
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def session(url: str) -> AsyncIterator[tuple[Client, HeartbeatWatch]]:
    async with connect(url, "tests") as bus:
        watch = HeartbeatWatch()
        await watch.attach(bus)
        yield Client(bus, timeout=60.0), watch


async def stream_all(client: Client, req: GenerateRequest) -> list[GenerateChunk]:
    return [chunk async for chunk in client.stream(req)]


def all_kv_free(watch: HeartbeatWatch) -> bool:
    decode = watch.live("decode")
    return bool(decode) and all(hb.kv_free_pages == hb.kv_total_pages and hb.batch_size == 0 for hb in decode)



async def cancelled_requests(url: str) -> int:
    """The requests the stack's one gateway has counted as cancelled so far (from its heartbeat)."""
    async with session(url) as (_, watch):
        await watch.wait_for(lambda w: len(w.live("gateway")) == 1, 10, "the gateway")
        return watch.live("gateway")[0].requests.outcomes.get("cancelled", 0)


def rank1_pid(stack: LocalStack, role: str) -> int:
    """Rank 1 of the first `role` instance of a two-rank group: its supervisor starts rank 0 first (services/ranks.py)."""
    supervisor = next(r for r in stack.replicas if r.role == role).proc.pid
    out = subprocess.run(["pgrep", "-P", str(supervisor), "-f", "spawn_main"], capture_output=True, text=True, check=True).stdout
    return max(int(pid) for pid in out.split())


async def served_again(client: Client, within_s: float) -> GenerateResponse:
    """A small request answered once the stack serves again (after a stall): `unavailable` until then, within `within_s`."""
    until = time.monotonic() + within_s
    while True:
        try:
            return await client.generate(GenerateRequest(prompt="after", max_tokens=4, temperature=0, timeout_ms=10_000))
        except GenerateError as e:
            assert e.code == "unavailable" and time.monotonic() < until, e
            await asyncio.sleep(0.5)

METRIC_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)\{((?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*)\} (\S+)$')
METRIC_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_metrics(page: str) -> Series:
    """The series of a Prometheus text-format page (version 0.0.4), checked as a scraper reads it:
    every family announced (HELP, TYPE) before its lines, and its lines together; a histogram's
    lines are `<family>_bucket{le}`, `_sum` and `_count`, and `check_histograms` holds for them."""
    kinds: dict[str, str] = {}
    announced: dict[str, list[str]] = {}
    finished_families: set[str] = set()
    current = None
    series: Series = {}
    for line in page.splitlines():
        if not line:
            continue  # blank lines are allowed (an empty page is one)
        if line.startswith("# "):
            _, what, name, rest = line.split(" ", 3)
            announced.setdefault(name, []).append(what)
            if what == "TYPE":
                kinds[name] = rest
            continue
        m = METRIC_LINE.match(line)
        assert m, f"not a series line: {line!r}"
        name, labels, value = m.groups()
        family = name if name in kinds else re.sub(r"_(bucket|sum|count)$", "", name)
        assert family == name or kinds.get(family) == "histogram", f"{name} belongs to no announced family"
        assert announced.get(family) == ["HELP", "TYPE"], f"{family} is not announced before its series"
        if family != current:
            assert family not in finished_families, f"the lines of {family} are not together"
            if current is not None:
                finished_families.add(current)
            current = family
        series[(name, frozenset(METRIC_LABEL.findall(labels)))] = float(value)
    check_histograms(series, [name for name, kind in kinds.items() if kind == "histogram"])
    return series


def histogram_buckets(series: Series, family: str) -> dict[frozenset[tuple[str, str]], list[tuple[float, float]]]:
    """Each label set's (le, cumulative count) of a histogram family, in page order."""
    out: dict[frozenset[tuple[str, str]], list[tuple[float, float]]] = {}
    for (name, labels), value in series.items():
        if name == f"{family}_bucket":
            le = dict(labels)["le"]
            out.setdefault(labels - {("le", le)}, []).append((float(le), value))
    return out


def check_histograms(series: Series, families: list[str]) -> None:
    """Prometheus' histogram rules: bounds ascending and ending with +Inf, counts cumulative
    (non-decreasing), +Inf equal to `_count`, a `_sum` beside it."""
    for family in families:
        for labels, buckets in histogram_buckets(series, family).items():
            bounds, counts = [b for b, _ in buckets], [c for _, c in buckets]
            assert bounds == sorted(set(bounds)) and bounds[-1] == math.inf, (family, labels, bounds)
            assert counts == sorted(counts), (family, labels, counts)
            assert series[(f"{family}_count", labels)] == counts[-1], (family, labels)
            assert (f"{family}_sum", labels) in series, (family, labels)
