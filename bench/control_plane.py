"""Control-plane overhead of the moebus services, on CPU with the tiny model.

Three measurements:

1. **Time outside model compute** per request, through a real local stack
   (`compose/single-node.yml`: nats-server, gateway, scheduler, prefill, decode as
   processes): `total_ms - compute_ms` of each reply, where `compute_ms` is the model
   time the prefill pass and the decode steps of that request took. What remains is
   tokenization, admission, NATS hops, placement, KV transfer, detokenization and
   relaying. Reported as p50/p99 at concurrency 1 and 16.
2. **Placements per second of one scheduler**: a real scheduler process against
   stand-in decode ranks and prefill instances living in this process (they heartbeat
   with ample capacity, grant every reservation at once and drop the prefill tasks),
   so the number is the scheduler's own rate: decode choice, the reservation round
   trip, the prefill task, the ack.
3. **What the OpenAI-compatible frontend adds** (`moebus openai`, the stack's `openai`
   service): the same unary completions, one at a time, sent in turn through the native
   client on NATS, as ``POST /v1/completions`` on one kept HTTP connection (``http_kept_*``:
   a pooling client, the openai SDK) and on a new connection each (``http_*``: curl, a client
   without a pool), each timed by its client from send to answer (`bench.openai_client`); the
   peer is the native path in the same run. Then its own HTTP cost per request, which the
   completions' run-to-run spread hides: ``GET /version`` (answered without the stack) on
   one kept connection and on a new connection each, alternating.

    python -m bench.control_plane [--requests 64] [--placements 2000] [--parts overhead frontend scheduler]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from bench.openai_client import OpenAIConnection
from bench.results import print_table, record
from schemas import subjects
from schemas.api import GenerateRequest
from schemas.internal import Heartbeat, Job, KVReservation, ReserveKV, SamplingSpec, SubmitJob
from schemas.transfer import KVTransferDescriptor, KVTransferLayout
from services.client import Client
from services.compose import DEFAULT_STACK, EPHEMERAL_FRONTENDS, load_compose
from services.launch import LocalStack, default_cache_dir, ensure_tiny_model, start_nats_server
from services.ranks import free_port
from services.submit import final_ack
from shared.bus import Bus, Deadline, connect, pack, unpack
from shared.settings import NatsServerSettings, OpenAISettings

PROMPT = "Mixture-of-experts models route each token to a few experts, which"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def overhead(url: str, requests: int, concurrency: int, max_tokens: int) -> dict[str, float]:
    async with connect(url, "bench") as bus:
        client = Client(bus)
        await client.generate(GenerateRequest(prompt=PROMPT, max_tokens=2, temperature=0))  # warm up
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int):
            async with sem:
                return await client.generate(GenerateRequest(prompt=f"{i} {PROMPT}", max_tokens=max_tokens, temperature=0))

        replies = await asyncio.gather(*(one(i) for i in range(requests)))
    outside = [r.timing.total_ms - r.timing.compute_ms for r in replies]
    per_token = [(r.timing.total_ms - r.timing.compute_ms) / r.usage.completion_tokens for r in replies]
    return {
        "outside_compute_p50_ms": statistics.median(outside),
        "outside_compute_p99_ms": percentile(outside, 99),
        "outside_compute_per_token_p50_ms": statistics.median(per_token),
        "total_p50_ms": statistics.median(r.timing.total_ms for r in replies),
        "ttft_p50_ms": statistics.median(r.timing.ttft_ms for r in replies),
        "queue_p50_ms": statistics.median(r.timing.queue_ms for r in replies),
    }


async def frontend_overhead(url: str, frontend: str, requests: int, max_tokens: int) -> dict[str, float]:
    """Client-side latency of the same completions via NATS, via the HTTP frontend on one kept
    connection, and via the HTTP frontend on a new connection each, interleaved request by request.
    The HTTP requests are blocking calls on this event loop's thread (no thread hop in their time):
    nothing else runs meanwhile, the native client is idle between its requests."""
    native_ms, kept_ms, new_ms = [], [], []
    kept, new = OpenAIConnection(frontend, 60.0), OpenAIConnection(frontend, 60.0, keep_alive=False)
    async with connect(url, "bench") as bus:
        client = Client(bus)
        for i in range(requests + 1):  # the first round warms every path up (and opens the kept connection)
            prompt = f"{i} {PROMPT}"
            started = time.perf_counter()
            native = await client.generate(GenerateRequest(prompt=prompt, max_tokens=max_tokens, temperature=0))
            native_s = time.perf_counter() - started
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            times = {}
            for conn in (kept, new) if i % 2 else (new, kept):  # neither HTTP arm always follows the native request
                started = time.perf_counter()
                text = conn.complete(body)["choices"][0]["text"]
                times[conn] = time.perf_counter() - started
                if text != native.text:
                    raise RuntimeError(f"request {i}: the frontend answered {text!r}, the native API {native.text!r}")
            if i:
                native_ms.append(native_s * 1e3)
                kept_ms.append(times[kept] * 1e3)
                new_ms.append(times[new] * 1e3)
    kept.close()
    check_connections(kept.connections, new.connections, requests + 1)
    return {"native_p50_ms": statistics.median(native_ms), "native_p99_ms": percentile(native_ms, 99),
            "http_p50_ms": statistics.median(new_ms), "http_p99_ms": percentile(new_ms, 99),
            "added_p50_ms": statistics.median(h - n for h, n in zip(new_ms, native_ms)),
            "http_kept_p50_ms": statistics.median(kept_ms), "http_kept_p99_ms": percentile(kept_ms, 99),
            "added_kept_p50_ms": statistics.median(h - n for h, n in zip(kept_ms, native_ms)),
            "kept_saves_p50_ms": statistics.median(n - k for n, k in zip(new_ms, kept_ms))}


def check_connections(kept: int, new: int, requests: int) -> None:
    """The kept arm reused its connection (up to the frontend's default request limit per
    connection, after which it is closed and reopened) and the other did not."""
    expected = -(-requests // OpenAISettings().keep_alive_requests)
    if kept != expected or new != requests:
        raise RuntimeError(f"{requests} requests per arm: {kept} connection(s) for the kept arm (expected {expected}), "
                           f"{new} for the new-connection arm")


def frontend_http_cost(frontend: str, requests: int) -> dict[str, float]:
    """Client-side latency of ``GET /version`` (the frontend answers it without the stack) on one
    kept connection and on a new connection each, alternating request by request: the frontend's
    own per-request HTTP cost (read, answer, and for a new connection its accept and close, with
    the client's connect) with and without connection reuse."""
    kept, new = OpenAIConnection(frontend, 60.0), OpenAIConnection(frontend, 60.0, keep_alive=False)
    timed: dict[OpenAIConnection, list[float]] = {kept: [], new: []}
    for i in range(requests + 10):  # the first 10 of each warm up
        for conn in (kept, new) if i % 2 else (new, kept):
            started = time.perf_counter()
            conn.version()
            if i >= 10:
                timed[conn].append((time.perf_counter() - started) * 1e6)
    kept.close()
    check_connections(kept.connections, new.connections, requests + 10)
    return {"version_kept_p50_us": statistics.median(timed[kept]), "version_kept_p99_us": percentile(timed[kept], 99),
            "version_new_p50_us": statistics.median(timed[new]), "version_new_p99_us": percentile(timed[new], 99),
            "kept_saves_p50_us": statistics.median(n - k for n, k in zip(timed[new], timed[kept]))}


async def stand_in_members(bus: Bus, decode_ranks: int, model: str) -> None:
    """Decode ranks and a prefill instance that only do their control-plane part."""
    layout = KVTransferLayout(num_layers=2, page_size=16, kv_heads=2, head_dim=16, dtype="float32")

    async def reserve(msg) -> None:  # type: ignore[no-untyped-def]
        req = unpack(msg.data, ReserveKV)
        desc = KVTransferDescriptor(b"", req.request_id, 1, [0], req.prompt_tokens, layout, req.lease_until, 1 << 20)
        await msg.respond(pack(KVReservation(request_id=req.request_id, ok=True, descriptor=desc)))

    async def drop(msg) -> None:  # type: ignore[no-untyped-def]
        pass

    for rank in range(decode_ranks):
        await bus.subscribe(subjects.decode_reserve("bench", rank), reserve, concurrent=False)
    await bus.subscribe(subjects.prefill_task("bench"), drop, concurrent=False)

    async def beat() -> None:
        while True:
            for rank in range(decode_ranks):
                hb = Heartbeat(role="decode", instance="bench", rank=rank, model=model, version="bench", started_at=0.0, kv_total_pages=1 << 30, kv_free_pages=1 << 30, page_size=16, batch_size=0, max_batch=1 << 30)
                await bus.publish(subjects.heartbeat("decode", "bench", rank), pack(hb))
            await bus.publish(subjects.heartbeat("prefill", "bench", 0), pack(Heartbeat(role="prefill", instance="bench", rank=0, model=model, version="bench", started_at=0.0)))
            await asyncio.sleep(0.5)

    asyncio.get_running_loop().create_task(beat())


async def closed_loop(ids: range, concurrency: int, send: Callable[[int], Awaitable[bool]]) -> list[bool]:
    """``send(i)`` for every i of ``ids`` by ``concurrency`` clients, each sending its next once its last
    was answered; the results in ``ids``' order. Not one task per send waiting on a semaphore: those
    ran their first steps (each building its job) in the loop ahead of the first answers, and the
    first ``concurrency`` submissions' latencies counted them: 30-45 ms of a 2000-submission run's
    p99 at concurrency 64 on the 2-core CPU host (the slowest 3% were the first 64, every run)."""
    results: dict[int, bool] = {}
    pending = iter(ids)

    async def client() -> None:
        for i in pending:  # shared: each client takes the next id
            results[i] = await send(i)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return [results[i] for i in ids]


async def placements(url: str, total: int, concurrency: int, decode_ranks: int) -> dict[str, float]:
    async with connect(url, "bench-members") as members, connect(url, "bench-submit") as bus:
        await stand_in_members(members, decode_ranks, model="bench")
        sampling = SamplingSpec(temperature=0.0, top_p=1.0, top_k=0, seed=None)
        latencies: list[float] = []

        async def submit(i: int) -> bool:
            job = Job(request_id=f"b{i}", gateway="bench", input_ids=list(range(32)), max_tokens=16, sampling=sampling, stop_token_ids=[], logprobs=False, deadline=time.time() + 60)
            started = time.perf_counter()
            ack = await final_ack(bus, SubmitJob(job=job), Deadline.after(30))
            latencies.append((time.perf_counter() - started) * 1000)
            return ack.placement is not None

        while not await bus.has_listener(subjects.SUBMIT, b"", wait_s=1.0):  # the scheduler's start varies with the box's load
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # the scheduler has seen the stand-ins' heartbeats
        await closed_loop(range(-100, 0), concurrency, submit)  # warm up
        latencies.clear()
        started = time.perf_counter()
        placed = await closed_loop(range(total), concurrency, submit)
        elapsed = time.perf_counter() - started
    if not all(placed):
        raise RuntimeError(f"{placed.count(False)} of {total} submissions were refused")
    return {"placements_per_s": total / elapsed, "submit_p50_ms": statistics.median(latencies), "submit_p99_ms": percentile(latencies, 99)}


def run_scheduler_bench(total: int, concurrency: int, decode_ranks: int) -> dict[str, float]:
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    nats = start_nats_server(port, NatsServerSettings(), Path(tempfile.mkdtemp(prefix="bench-cp-nats-")))
    command = [sys.executable, "-m", "services.cli", "scheduler", "--nats-url", url, "--set", "model_name=bench", "--set", "log_level=warning", "--set", "max_queued=100000"]
    scheduler = subprocess.Popen(command)
    try:
        return asyncio.run(placements(url, total, concurrency, decode_ranks))
    finally:
        scheduler.terminate()
        scheduler.wait(10)
        nats.terminate()
        nats.wait(10)


PARTS = ("overhead", "frontend", "scheduler")  # measurements 1, 3 and 2 of the docstring


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--placements", type=int, default=2000)
    ap.add_argument("--http-requests", type=int, default=1000, help="GET /version requests per arm (frontend part)")
    ap.add_argument("--model", help="checkpoint (default: the embedded tiny model)")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="which measurements to run (default: all)")
    a = ap.parse_args(argv)

    if "overhead" in a.parts or "frontend" in a.parts:
        rows = []
        model = Path(a.model) if a.model else ensure_tiny_model(default_cache_dir())
        specs = load_compose(DEFAULT_STACK, {"MOEBUS_MODEL": str(model), **EPHEMERAL_FRONTENDS})
        stack = LocalStack(specs, model, Path(tempfile.mkdtemp(prefix="bench-cp-")), extra_env={"MOEBUS_LOG_LEVEL": "warning"})
        stack.start()
        try:
            for concurrency in (1, 16) if "overhead" in a.parts else ():
                case = {"what": "request_overhead", "stack": "single-node", "model": model.name, "concurrency": concurrency, "requests": a.requests,
                        "max_tokens": a.max_tokens}
                metrics = asyncio.run(overhead(stack.url, a.requests, concurrency, a.max_tokens))
                record("control_plane", case, metrics)
                rows.append({**case, **metrics})
            if "frontend" in a.parts:
                case = {"what": "openai_frontend", "stack": "single-node", "model": model.name, "concurrency": 1, "requests": a.requests,
                        "max_tokens": a.max_tokens, "client": "bench.openai_client"}
                frontend = asyncio.run(frontend_overhead(stack.url, stack.frontend_urls()["openai-0"], a.requests, a.max_tokens))
                record("control_plane", case, frontend, {"native_nats_client": {"latency_p50_ms": frontend["native_p50_ms"]}})
                case = {"what": "openai_frontend_http", "stack": "single-node", "path": "/version", "requests": a.http_requests, "client": "bench.openai_client"}
                http_cost = frontend_http_cost(stack.frontend_urls()["openai-0"], a.http_requests)
                record("control_plane", case, http_cost)
        finally:
            stack.stop()
        if rows:
            print_table(rows, ["concurrency", "outside_compute_p50_ms", "outside_compute_p99_ms", "outside_compute_per_token_p50_ms", "ttft_p50_ms",
                               "total_p50_ms"])
            print()
        if "frontend" in a.parts:
            print_table([frontend], ["native_p50_ms", "native_p99_ms", "http_p50_ms", "http_p99_ms", "added_p50_ms", "http_kept_p50_ms",
                                     "http_kept_p99_ms", "added_kept_p50_ms", "kept_saves_p50_ms"])
            print()
            print_table([http_cost], list(http_cost))
            print()

    if "scheduler" in a.parts:
        sched_rows = []
        for concurrency in (1, 64):
            case = {"what": "scheduler_placements", "schedulers": 1, "decode_ranks": 8, "concurrency": concurrency, "submissions": a.placements}
            metrics = run_scheduler_bench(a.placements, concurrency, decode_ranks=8)
            record("control_plane", case, metrics)
            sched_rows.append({**case, **metrics})
        print_table(sched_rows, ["concurrency", "placements_per_s", "submit_p50_ms", "submit_p99_ms"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
