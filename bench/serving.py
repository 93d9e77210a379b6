"""Serving benchmark: latency and throughput of a moebus stack under a stream of requests.

What a user compares engines by (vLLM's ``bench serve``, SGLang's ``bench_serving``):
``--requests`` requests of random token ids (``--input-len`` each, spread by
``--range-ratio``, after a ``--prefix-len`` prefix all requests share, as vLLM's random
dataset's ``--random-prefix-len``: a system prompt the prefill's prefix cache serves, whose
hits the stack reports as ``cached_share`` of the prompt tokens) asking for ``--output-len`` tokens (``ignore_eos``, so every request
generates its full length), arriving as a Poisson process at ``--rate`` per second
(``inf``: all at once), at most ``--max-concurrency`` in flight. Each is streamed and timed: TTFT (send -> first token), TPOT ((end - first token) /
(tokens - 1)), ITL (the gaps between chunks), E2E; and the run's request and token
throughput.

The peer, in the same run on the same device: the same requests through one ModelRunner
in this process with the decode rank's settings (device, dtype, page size, CUDA graphs,
warm-up), batched continuously in one loop (admit what has arrived, prefill it in batches
of the prefill instance's ``max_batch_tokens``, one decode step for everything running),
with no services, bus or KV transfer: the throughput the
model runtime alone gives, and what the disaggregated stack keeps of it
(``throughput_ratio``). With ``--up`` the peer runs before the stack starts, so the two
never share the device; against a running server after the measurement, while it idles.

With ``--up`` and the prefill service logging at info (``MOEBUS_PREFILL_LOG_LEVEL=info``; the
stack's services log warnings only otherwise), the run also reports its prefill batches from
the leader's ``prefill_batch`` events: how many, their mean requests and computed tokens, and
the mean milliseconds per batch of each phase (``services.prefill.batch.BatchTimes``: plan,
pages, senders, forward, transfer, settle, report), as ``prefill_*`` metrics.

The client is the native one (``llm.generate`` on NATS) or, with ``--api openai`` or
``--openai-url``, streamed ``/v1/completions`` over HTTP (token counts from the usage
chunk): the same client then measures ``moebus openai`` and any other OpenAI-compatible
server (vLLM, SGLang) with the same workload, e.g. another engine on the same GPU.

    python -m bench.serving --up [--api openai] [--stack compose/single-node.yml] [--model DIR]
    python -m bench.serving --url nats://127.0.0.1:4222 [--model DIR]
    python -m bench.serving --openai-url http://127.0.0.1:8000/v1 [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import http.client
import json
import math
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.openai_client import OpenAIConnection, OpenAIError
from bench.results import print_table, record
from schemas.api import GenerateRequest
from services.client import Client, GenerateError
from services.compose import DEFAULT_STACK, EPHEMERAL_FRONTENDS, load_compose
from services.decode.__main__ import use_cuda_graphs
from services.launch import LocalStack, default_cache_dir, ensure_tiny_model
from services.model_rank import resolve_device, resolve_dtype
from services.warmup import warm_up_decode
from shared.bus import connect
from shared.model.config import ModelConfig
from shared.model.runner import ModelRunner, SequenceState, StepOutput
from shared.model.sampling_params import SamplingParams
from shared.settings import DecodeSettings, PrefillSettings, S, load_settings

LATENCIES = ("ttft", "tpot", "itl", "e2e")


@dataclass(frozen=True)
class Workload:
    """The requests of one run: prompts, output lengths and arrival offsets (seconds)."""

    prompts: list[list[int]]
    output_lens: list[int]
    arrivals: list[float]

    @classmethod
    def random(cls, n: int, input_len: int, output_len: int, range_ratio: float, rate: float, vocab: int, seed: int, prefix_len: int = 0) -> Workload:
        rng = random.Random(seed)

        def length(mean: int) -> int:
            return max(1, rng.randint(math.floor(mean * (1 - range_ratio)), math.ceil(mean * (1 + range_ratio))))

        # Ordinary tokens: past the first ids (bytes) and below the special ones at the top.
        low, high = (1000, min(vocab, 100_000)) if vocab > 2000 else (0, vocab)
        prefix = [rng.randrange(low, high) for _ in range(prefix_len)]
        prompts = [prefix + [rng.randrange(low, high) for _ in range(length(input_len))] for _ in range(n)]
        output_lens = [length(output_len) for _ in range(n)]
        arrivals, t = [], 0.0
        for _ in range(n):
            arrivals.append(t)
            t += 0.0 if math.isinf(rate) else rng.expovariate(rate)
        return cls(prompts, output_lens, arrivals)


@dataclass
class Timeline:
    """One request as the client saw it (seconds): sent, first and last chunk with tokens, the
    gaps between chunks, how many tokens came."""

    sent: float
    first: float = 0.0  # meaningful once tokens > 0
    last: float = 0.0
    tokens: int = 0
    chunk_gaps: list[float] = field(default_factory=list)
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens the server's prefix cache served (its usage)

    def add(self, now: float, tokens: int) -> None:
        """A chunk of `tokens` tokens arrived at `now`."""
        if tokens <= 0:
            return
        if self.tokens:
            self.chunk_gaps.append(now - self.last)
        else:
            self.first = now
        self.last = now
        self.tokens += tokens


def summarize(timelines: list[Timeline], input_tokens: int, elapsed_s: float) -> dict[str, float]:
    """Throughput and latency percentiles (ms) of the completed requests; failures counted."""
    done = [t for t in timelines if t.error is None and t.tokens]
    samples: dict[str, list[float]] = {
        "ttft": [t.first - t.sent for t in done],
        "tpot": [(t.last - t.first) / (t.tokens - 1) for t in done if t.tokens > 1],
        "itl": [g for t in done for g in t.chunk_gaps],
        "e2e": [t.last - t.sent for t in done],
    }
    output_tokens = sum(t.tokens for t in done)
    metrics = {"completed": len(done), "failed": len(timelines) - len(done), "output_tokens": output_tokens, "elapsed_s": elapsed_s,
               "cached_share": sum(t.cached_tokens for t in done) / input_tokens if input_tokens else 0.0,
               "requests_per_s": len(done) / elapsed_s, "output_tokens_per_s": output_tokens / elapsed_s,
               "total_tokens_per_s": (output_tokens + input_tokens) / elapsed_s}
    for name in LATENCIES:
        values = sorted(samples[name])
        for q in (50, 90, 99):
            metrics[f"{name}_p{q}_ms"] = 1000 * values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))] if values else float("nan")
        metrics[f"{name}_mean_ms"] = 1000 * statistics.fmean(values) if values else float("nan")
    return {k: v for k, v in metrics.items() if not math.isnan(v)}  # no samples: no figure


def prefill_batches(log_paths: list[Path], since_unix: float) -> dict[str, float]:
    """The ``prefill_batch`` events the prefill leaders logged (JSON lines) at or after
    ``since_unix`` (the measured run's start: the client's first-use request comes before),
    summarized (module doc); empty when there are none."""
    events = []
    for path in log_paths:
        for line in path.read_text(errors="replace").splitlines():
            if not line.startswith("{") or '"prefill_batch"' not in line:
                continue
            event = json.loads(line)
            if event.get("event") == "prefill_batch" and datetime.datetime.fromisoformat(event["timestamp"]).timestamp() >= since_unix:
                events.append(event)
    if not events:
        return {}
    summary = {"prefill_batches": len(events)}
    for name in ("requests", "computed_tokens", "cached_tokens"):
        summary[f"prefill_batch_{name}_mean"] = statistics.fmean(e[name] for e in events)
    for name in sorted({k for e in events for k in e if k.endswith("_ms")}):
        summary[f"prefill_{name}_mean"] = statistics.fmean(e.get(name, 0.0) for e in events)
    return summary


# ---------------------------------------------------------------- the clients


Send = Callable[[int, Timeline], Awaitable[None]]  # send request i of the workload, timing it into the timeline


async def drive(work: Workload, max_concurrency: int, send: Send) -> tuple[list[Timeline], float]:
    """Every request of `work` at its arrival time, at most `max_concurrency` in flight, each
    timed from when it is sent; (timelines, elapsed seconds)."""
    slots = asyncio.Semaphore(max_concurrency)
    start = time.perf_counter()

    async def one(i: int) -> Timeline:
        await asyncio.sleep(max(0.0, start + work.arrivals[i] - time.perf_counter()))
        async with slots:
            timeline = Timeline(time.perf_counter())
            await send(i, timeline)
            return timeline

    timelines = await asyncio.gather(*(one(i) for i in range(len(work.prompts))))
    return list(timelines), time.perf_counter() - start


async def run_native(url: str, work: Workload, max_concurrency: int, timeout_s: float) -> tuple[list[Timeline], float]:
    """The workload through a moebus stack's native API (`llm.generate` on NATS at `url`)."""
    async with connect(url, "bench-serving") as bus:
        client = Client(bus, timeout=timeout_s)
        await client.generate(GenerateRequest(input_ids=work.prompts[0][:8], max_tokens=2, temperature=0))  # first-use costs out

        async def send(i: int, timeline: Timeline) -> None:
            req = GenerateRequest(input_ids=work.prompts[i], max_tokens=work.output_lens[i], temperature=0, ignore_eos=True,
                                  stream=True, timeout_ms=round(timeout_s * 1000))
            try:
                async for chunk in client.stream(req):
                    timeline.add(time.perf_counter(), len(chunk.token_ids))
                    if chunk.usage is not None:
                        timeline.cached_tokens = chunk.usage.cached_tokens
            except GenerateError as e:
                timeline.error = e.code

        return await drive(work, max_concurrency, send)


async def run_openai(base_url: str, work: Workload, max_concurrency: int, timeout_s: float) -> tuple[list[Timeline], float]:
    """The workload as streamed ``/v1/completions`` requests to an OpenAI-compatible server at
    `base_url` (``moebus openai``, or another engine's, e.g. vLLM's or SGLang's: the same
    client measures both), the model named as its ``/v1/models`` lists first. Each of the
    ``max_concurrency`` sending threads keeps its connection (`bench.openai_client`): a pool of
    at most that many, as a pooling client (the openai SDK, aiohttp's connector) holds."""
    loop = asyncio.get_running_loop()
    local = threading.local()
    opened: list[OpenAIConnection] = []

    def connection() -> OpenAIConnection:
        if not hasattr(local, "conn"):
            local.conn = OpenAIConnection(base_url, timeout_s)
            opened.append(local.conn)
        return local.conn

    with ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="bench-http") as pool:
        try:
            model = (await loop.run_in_executor(pool, lambda: connection().models()))[0]["id"]
            await loop.run_in_executor(pool, openai_stream, connection, model, work.prompts[0][:8], 2, Timeline(0.0))

            async def send(i: int, timeline: Timeline) -> None:
                await loop.run_in_executor(pool, openai_stream, connection, model, work.prompts[i], work.output_lens[i], timeline)

            return await drive(work, max_concurrency, send)
        finally:
            for conn in opened:
                conn.close()


def openai_stream(connection: Callable[[], OpenAIConnection], model: str, prompt: list[int], max_tokens: int, timeline: Timeline) -> None:
    """One streamed completion on this thread's connection (blocking: run in a thread), its
    chunks timed into `timeline`; the token count is the usage chunk's (a chunk's text may hold
    several tokens)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    usage = None

    def on_event(event: dict) -> None:
        nonlocal usage
        if any(choice.get("text") for choice in event.get("choices", [])):
            timeline.add(time.perf_counter(), 1)
        usage = (event.get("usage") or {}).get("completion_tokens", usage)
        timeline.cached_tokens = ((event.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens", timeline.cached_tokens)

    try:
        connection().stream(body, on_event)
    except OpenAIError as e:
        timeline.error = e.code
        return
    except (OSError, http.client.HTTPException, ValueError) as e:
        timeline.error = type(e).__name__
        return
    if usage is not None and timeline.tokens:
        timeline.tokens = usage


# ---------------------------------------------------------------- the peer: one runner, this process


def build_runner(model: Path, settings: DecodeSettings, work: Workload, max_concurrency: int) -> ModelRunner:
    """A ModelRunner as a decode rank builds it (device, dtype, graphs, warm-up), with KV for
    `max_concurrency` of the longest requests of `work`."""
    device = resolve_device(settings.device, 0, settings.gpus)
    longest = max(len(p) + n for p, n in zip(work.prompts, work.output_lens, strict=True))
    pages = max(settings.kv_pages, max_concurrency * -(-longest // settings.page_size) + 2)
    runner = ModelRunner.from_dir(model, num_pages=pages, page_size=settings.page_size, dtype=resolve_dtype(settings.dtype, device), device=device)
    use_cuda_graphs(runner, settings)
    if settings.warmup:
        warm_up_decode(runner, settings, 1)
    return runner


def run_in_process(runner: ModelRunner, work: Workload, max_concurrency: int, prefill_tokens: int) -> tuple[list[Timeline], float]:
    """Continuous batching in one loop: the arrived requests are sent (timed from then on, as
    the stack's client times them) while fewer than `max_concurrency` are in flight; each
    iteration prefills the sent ones together, prompts of at most `prefill_tokens` (as a
    prefill instance batches them), then runs one decode step for every running sequence."""
    sync: Callable[[], None] = torch.cuda.synchronize if runner.cache.device.type == "cuda" else (lambda: None)
    waiting = list(range(len(work.prompts)))
    sent: list[int] = []  # in flight, not yet prefilled
    live: list[SequenceState] = []
    timelines: dict[str, Timeline] = {}
    start = time.perf_counter()

    def note(outputs: list[StepOutput]) -> None:
        sync()  # the tokens exist once the step's work has finished
        now = time.perf_counter()
        for out in outputs:
            timelines[out.seq_id].add(now, 1)

    while waiting or sent or live:
        while waiting and work.arrivals[waiting[0]] <= time.perf_counter() - start and len(live) + len(sent) < max_concurrency:
            i = waiting.pop(0)
            sent.append(i)
            timelines[f"r{i}"] = Timeline(time.perf_counter())
        admitted, tokens = [], 0
        while sent and (not admitted or tokens + len(work.prompts[sent[0]]) <= prefill_tokens):
            i = sent.pop(0)
            tokens += len(work.prompts[i])
            admitted.append(runner.add(f"r{i}", work.prompts[i], SamplingParams(temperature=0.0, max_tokens=work.output_lens[i], ignore_eos=True)))
        if admitted:
            note(runner.prefill(admitted))
            live += [s for s in admitted if not s.finished]
        if live:
            note(runner.decode(live))
            live = [s for s in live if not s.finished]
        elif waiting and not sent:
            time.sleep(max(0.0, start + work.arrivals[waiting[0]] - time.perf_counter()))
    return [timelines[f"r{i}"] for i in range(len(work.prompts))], time.perf_counter() - start


# ---------------------------------------------------------------- command line


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--up", action="store_true", help="start a local stack for the run (moebus up's code path)")
    where.add_argument("--url", help="the NATS URL of a running moebus stack (native API)")
    where.add_argument("--openai-url", help="the base URL (.../v1) of any OpenAI-compatible server")
    ap.add_argument("--api", choices=("native", "openai"), default="native", help="with --up: the stack's native API or its `openai` frontend")
    ap.add_argument("--stack", default=str(DEFAULT_STACK), help="compose file of the stack --up starts")
    ap.add_argument("--model", help="checkpoint directory: the model --up serves (default: the embedded tiny one), and the peer's "
                                     "(without it, --url and --openai-url runs have no peer and draw token ids below 32000)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (mean), after the shared prefix")
    ap.add_argument("--prefix-len", type=int, default=0, help="tokens of a prefix every prompt starts with (a shared system prompt)")
    ap.add_argument("--output-len", type=int, default=64, help="generated tokens per request (mean)")
    ap.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [len*(1-r), len*(1+r)]")
    ap.add_argument("--rate", type=float, default=math.inf, help="requests per second (Poisson arrivals); inf: all at once")
    ap.add_argument("--max-concurrency", type=int, default=16, help="requests in flight at most")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=600.0, help="deadline of each request")
    ap.add_argument("--no-peer", action="store_true", help="skip the in-process runner")
    a = ap.parse_args(argv)
    for name in ("requests", "input_len", "output_len", "max_concurrency"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.prefix_len < 0:
        ap.error("--prefix-len must be >= 0")
    if not 0 <= a.range_ratio < 1:
        ap.error("--range-ratio must be in [0, 1)")
    if not a.rate > 0 or not a.timeout_s > 0:
        ap.error("--rate and --timeout-s must be > 0")
    if a.api == "openai" and not a.up:
        ap.error("--api openai goes with --up (for a running server give --openai-url)")
    return a


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    model = Path(a.model) if a.model else (ensure_tiny_model(default_cache_dir()) if a.up else None)
    vocab = ModelConfig.from_dir(model).vocab_size if model else 32_000
    work = Workload.random(a.requests, a.input_len, a.output_len, a.range_ratio, a.rate, vocab, a.seed, a.prefix_len)
    input_tokens = sum(len(p) for p in work.prompts)
    # The stack --up starts: interpolated like `moebus up` does (e.g. DECODE_MAX_BATCH=64 in the environment).
    specs = load_compose(Path(a.stack), {**os.environ, "MOEBUS_MODEL": str(model), **EPHEMERAL_FRONTENDS}) if a.up else []

    def service_settings(cls: type[S], role: str) -> S:  # what that service of the stack runs with
        env = dict(os.environ) | next((s.env for s in specs if s.role == role), {})
        return load_settings(cls, role, overrides={"model": str(model)}, env=env)

    settings = service_settings(DecodeSettings, "decode")
    with_peer = model is not None and not a.no_peer

    def peer() -> dict[str, float]:
        assert model is not None
        runner = build_runner(model, settings, work, a.max_concurrency)
        timelines, elapsed = run_in_process(runner, work, a.max_concurrency, service_settings(PrefillSettings, "prefill").max_batch_tokens)
        del runner
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the stack's ranks get the device's memory back
        return summarize(timelines, input_tokens, elapsed)

    peer_metrics = peer() if with_peer and a.up else None  # --up: before the stack exists
    stack = None
    if a.up:
        stack = LocalStack(specs, model, Path(tempfile.mkdtemp(prefix="bench-serving-")), extra_env={"MOEBUS_LOG_LEVEL": "warning"})
        stack.start()
    api = "openai" if a.openai_url or a.api == "openai" else "native"
    try:
        if stack is not None:
            server = stack.frontend_urls()["openai-0"] if api == "openai" else stack.url
        else:
            server = a.openai_url or a.url
        run = run_openai if api == "openai" else run_native
        timelines, elapsed = asyncio.run(run(server, work, a.max_concurrency, a.timeout_s))
        # The first request's send on the wall clock (not now - elapsed: closing the client after the run takes a while too).
        measured_since = min(t.sent for t in timelines) + time.time() - time.perf_counter()
    finally:
        if stack is not None:
            stack.stop()
    metrics = summarize(timelines, input_tokens, elapsed)
    batches = prefill_batches([r.log_path for r in stack.replicas if r.role == "prefill"], measured_since) if stack is not None else {}
    metrics.update(batches)
    if with_peer and peer_metrics is None:
        peer_metrics = peer()  # a running server: after the measurement, while it idles
    if peer_metrics:
        metrics["throughput_ratio"] = metrics["output_tokens_per_s"] / peer_metrics["output_tokens_per_s"]

    errors = sorted({t.error for t in timelines if t.error})
    case = {"server": Path(a.stack).name if a.up else server, "api": api, "model": model.name if model else None, "requests": a.requests,
            "input_len": a.input_len, "prefix_len": a.prefix_len, "output_len": a.output_len, "range_ratio": a.range_ratio,
            "rate": "inf" if math.isinf(a.rate) else a.rate, "max_concurrency": a.max_concurrency, "seed": a.seed, "errors": errors}
    if a.up or with_peer:  # what the stack's decode (or the peer's runner) ran with
        dtype = resolve_dtype(settings.dtype, resolve_device(settings.device, 0, settings.gpus))  # "auto" as a rank here resolves it
        case["decode"] = {"device": settings.device, "dtype": str(dtype).removeprefix("torch."), "dp": settings.dp, "max_batch": settings.max_batch,
                          "page_size": settings.page_size, "kv_pages": settings.kv_pages, "cuda_graphs": settings.cuda_graphs}
    record("serving", case, metrics, {"in_process_runner": peer_metrics} if peer_metrics else None)
    rows = [{"system": f"server ({api} API)", **metrics}] + ([{"system": "in-process runner", **peer_metrics}] if peer_metrics else [])
    print_table(rows, ["system", "completed", "failed", "requests_per_s", "output_tokens_per_s", "cached_share", "ttft_p50_ms", "ttft_p99_ms",
                       "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms", "e2e_p50_ms", "e2e_p99_ms"])
    if batches:
        print_table([{k.removeprefix("prefill_"): v for k, v in batches.items()}], [k.removeprefix("prefill_") for k in batches])
    if peer_metrics:
        print(f"throughput ratio (server / in-process runner): {metrics['throughput_ratio']:.2f}")
    if errors:
        print(f"failed requests: {metrics['failed']} ({', '.join(errors)})")
    return 1 if metrics["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
