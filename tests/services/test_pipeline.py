"""End to end on one real stack (compose/single-node.yml, decode scaled to two instances):
correctness against transformers, streaming, concurrency, seeds, bad input, overload,
cancellation; then failures and scaling (destructive tests last, in file order)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from datetime import datetime

import msgspec
import pytest

from schemas.api import ChatMessage, ErrorReply, GenerateRequest, GenerateResponse, ModelList
from schemas import subjects
from schemas.internal import Heartbeat, StageError
from services.client import Client, GenerateError
from services.common import decode_stage
from shared.bus import CONTENT_TYPE, KEEPALIVE_HEADER, MSGPACK, pack
from shared.settings import NatsServerSettings

from services_helpers import Series, all_kv_free, histogram_buckets, log_events, parse_metrics, run, session, stack_fixture, stream_all, until

pytestmark = pytest.mark.slow

stack = stack_fixture(
    "single-node.yml",
    scale={"decode": 2},
    env={"MOEBUS_SCHEDULER_QUEUE_WAIT_MS": "1000", "MOEBUS_DECODE_MAX_BATCH": "40"},
    nats=NatsServerSettings(max_payload=1 << 20),  # nats-server's own default, so that a reply of ~2 MB exceeds it
)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Mixture-of-experts models route each token to a few experts, which",
    "1, 2, 3, 4,",
    "Once upon a time in a land far away there lived a dragon who loved to read books about",
    "hi",
]


def test_models_lists_the_served_model(stack, tiny_model):
    async def go():
        async with session(stack.url) as (client, _):
            return await client.models()

    models = run(go())
    assert isinstance(models, ModelList)
    assert [m.id for m in models.models] == [tiny_model.name]
    assert models.models[0].max_context == 4096


def test_model_ranks_warm_up_before_their_first_heartbeat(stack):
    async def go():
        async with session(stack.url) as (_, watch):
            await watch.wait_for(lambda w: len(w.live("prefill")) == 1 and len(w.live("decode")) == 2, 10, "every model rank")
            return watch.live("prefill") + watch.live("decode")

    warmed = {e["replica"]: e for e in log_events(stack, "warmup.done")}
    for hb in run(go()):
        done = warmed[hb.instance]
        # A rank's heartbeats carry the time its heartbeater was made: after its warm-up.
        assert datetime.fromisoformat(done["timestamp"]).timestamp() <= hb.started_at
        assert done["duration_s"] > 0 and done["steps"]


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_unary_and_stream_match_transformers_greedy(stack, tokenizer, hf_greedy, prompt):
    ids = tokenizer.encode(prompt)
    expected = hf_greedy(tuple(ids), 24)

    async def go():
        async with session(stack.url) as (client, _):
            unary = await client.generate(GenerateRequest(prompt=prompt, max_tokens=24, temperature=0))
            chunks = await stream_all(client, GenerateRequest(prompt=prompt, max_tokens=24, temperature=0))
            return unary, chunks

    unary, chunks = run(go())
    assert unary.token_ids == expected
    assert unary.text == tokenizer.decode(expected, skip_special_tokens=True)
    assert unary.finish_reason == "length"
    assert unary.usage.prompt_tokens == len(ids) and unary.usage.completion_tokens == 24
    assert 0 < unary.timing.ttft_ms <= unary.timing.total_ms
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert [t for c in chunks for t in c.token_ids] == expected
    assert "".join(c.text for c in chunks) == unary.text
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage == unary.usage
    assert all(c.finish_reason is None for c in chunks[:-1])


def test_chat_messages_use_the_chat_template(stack, tokenizer, hf_greedy):
    messages = [{"role": "user", "content": "What is an expert?"}]
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)

    async def go():
        async with session(stack.url) as (client, _):
            return await client.generate(GenerateRequest(messages=[ChatMessage(**m) for m in messages], max_tokens=8, temperature=0))

    resp = run(go())
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.token_ids == hf_greedy(tuple(ids), 8)


def test_plain_json_and_msgpack_on_the_wire(stack, tokenizer, hf_greedy):
    """What `nats req llm.generate '{"prompt":"hi"}'` sends, and the msgpack variant."""
    expected = hf_greedy(tuple(tokenizer.encode("hi")), 64)

    async def go():
        async with session(stack.url) as (client, _):
            as_json = await client.bus.nc.request("llm.generate", b'{"prompt":"hi","temperature":0}', timeout=30)
            payload = msgspec.msgpack.encode({"prompt": "hi", "temperature": 0.0, "max_tokens": 5})
            as_msgpack = await client.bus.nc.request("llm.generate", payload, timeout=30, headers={CONTENT_TYPE: MSGPACK})
            return as_json.data, as_msgpack.data

    json_reply, msgpack_reply = run(go())
    body = json.loads(json_reply)
    assert body["type"] == "response" and body["token_ids"] == expected  # default max_tokens: 64
    resp = msgspec.msgpack.decode(msgpack_reply, type=GenerateResponse)
    assert resp.token_ids == expected[:5]


def test_stop_strings_end_the_text_before_the_stop(stack, tokenizer, hf_greedy):
    prompt = PROMPTS[1]
    full = tokenizer.decode(hf_greedy(tuple(tokenizer.encode(prompt)), 24), skip_special_tokens=True)
    stop = full[5:8]  # a piece of what the model will say
    assert stop and full.find(stop) >= 0

    async def go():
        async with session(stack.url) as (client, watch):
            resp = await client.generate(GenerateRequest(prompt=prompt, max_tokens=24, temperature=0, stop=[stop]))
            chunks = await stream_all(client, GenerateRequest(prompt=prompt, max_tokens=24, temperature=0, stop=[stop]))
            await watch.wait_for(all_kv_free, 5, "decode KV freed after the stop string")
            return resp, chunks

    resp, chunks = run(go())
    assert resp.finish_reason == "stop"
    assert resp.text == full[: full.find(stop)]
    assert "".join(c.text for c in chunks) == resp.text and chunks[-1].finish_reason == "stop"


def test_seeded_sampling_reproduces(stack):
    req = GenerateRequest(prompt=PROMPTS[2], max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234, logprobs=True)

    async def go():
        async with session(stack.url) as (client, _):
            a = await client.generate(req)
            b = await client.generate(req)
            c = await client.generate(msgspec.structs.replace(req, seed=4321))
            return a, b, c

    a, b, c = run(go())
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert len(a.logprobs) == 16 and all(lp <= 0 for lp in a.logprobs)
    assert c.token_ids != a.token_ids


def test_64_concurrent_mixed_requests(stack, tokenizer, hf_greedy):
    """Greedy (unary and streamed) and seeded requests of mixed prompt and output lengths at once."""
    rng = random.Random(0)
    cases = []
    for i in range(64):
        prompt = PROMPTS[i % len(PROMPTS)] * (1 + i % 2) + " " * (i % 3)
        cases.append((prompt, rng.randint(1, 24), ("greedy", "seeded", "stream")[i % 3], 1000 + i))

    def request(prompt, max_tokens, kind, seed):
        if kind == "seeded":
            return GenerateRequest(prompt=prompt, max_tokens=max_tokens, temperature=0.8, top_k=40, seed=seed)
        return GenerateRequest(prompt=prompt, max_tokens=max_tokens, temperature=0)

    async def one(client, case):
        req = request(*case)
        if case[2] == "stream":
            chunks = await stream_all(client, req)
            return [t for c in chunks for t in c.token_ids]
        return (await client.generate(req)).token_ids

    async def go():
        async with session(stack.url) as (client, watch):
            # Every model rank heard from (a fresh watch may have seen only some yet), all idle.
            await watch.wait_for(lambda w: len(w.live("decode")) == 2 and len(w.live("prefill")) == 1 and len(w.live("gateway")) == 1
                                 and all_kv_free(w), 10, "idle model ranks and the gateway")
            before = _counters(watch)
            together = await asyncio.gather(*(one(client, c) for c in cases))
            # Some seeded ones again, alone: sharing a batch with 63 others must not change them.
            alone = {i: (await client.generate(request(*cases[i]))).token_ids for i in (1, 4, 31, 61)}
            await watch.wait_for(all_kv_free, 5, "all KV free after the burst")
            sent = len(cases) + len(alone)
            # The heartbeats count every KV handoff on both sides (the prefill is TP=1: its leader sends all heads).
            await watch.wait_for(lambda w: _counters(w)["decode_completed"] >= before["decode_completed"] + sent
                                 and _counters(w)["prefill_completed"] >= before["prefill_completed"] + sent
                                 and _counters(w)["finished"] >= before["finished"] + sent, 5, "transfer and request counters",
                                 show=lambda w: {"sent": sent, "before": before, "now": _counters(w)})
            return together, alone, before, _counters(watch), sent

    together, alone, before, after, sent = run(go())
    # The gateway counted every reply once, as finished, with the tokens the clients got.
    assert after["finished"] - before["finished"] == sent and after["failed"] == before["failed"], (before, after)
    tokens_out = sum(len(t) for t in together) + sum(len(t) for t in alone.values())
    assert after["completion_tokens"] - before["completion_tokens"] == tokens_out
    assert after["ttft_count"] >= min(sent, 1024)
    assert after["decode_completed"] - before["decode_completed"] == sent
    assert after["prefill_completed"] - before["prefill_completed"] == sent
    assert after["decode_bytes"] > before["decode_bytes"] and after["prefill_bytes"] > before["prefill_bytes"]
    assert after["failures"] == before["failures"], (before, after)
    assert after["eager_steps"] > before["eager_steps"] and after["graph_steps"] == 0, (before, after)  # CPU: no CUDA graphs
    for i, tokens in alone.items():
        assert together[i] == tokens, f"request {i}"
    for i, (prompt, max_tokens, kind, _) in enumerate(cases):
        if kind != "seeded":
            # greedy output for n tokens is the first n of the output for 24 (or all of it up to EOS)
            assert together[i] == hf_greedy(tuple(tokenizer.encode(prompt)), 24)[:max_tokens], f"request {i}"
        else:
            assert 1 <= len(together[i]) <= max_tokens


def _answered(watch) -> int:
    gateways = watch.live("gateway")
    return sum(gateways[0].requests.outcomes.values()) if len(gateways) == 1 and gateways[0].requests else 0


def _serve_a_few(stack, count: int = 4) -> int:
    """Send ``count`` short requests and wait for the gateway's heartbeat to count them; returns
    its total of answered requests then. So a test of the totals does not rely on the tests
    before it (run alone, it still sees traffic)."""
    async def go():
        async with session(stack.url) as (client, watch):
            await watch.wait_for(lambda w: len(w.live("gateway")) == 1, 5, "the gateway")
            before = _answered(watch)
            await asyncio.gather(*(client.generate(GenerateRequest(prompt=PROMPTS[i % len(PROMPTS)], max_tokens=2)) for i in range(count)))
            await watch.wait_for(lambda w: _answered(w) >= before + count, 10, f"the gateway's heartbeat counting {count} more answers")
            return _answered(watch)

    return run(go())


def test_moebus_status_lists_every_process_and_the_request_totals(stack):
    def status(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "services.cli", "status", "--url", stack.url, *flags], capture_output=True, text=True, timeout=60)

    answered = _serve_a_few(stack)
    as_json, as_text = status("--json"), status()
    assert as_json.returncode == 0 and as_text.returncode == 0, as_json.stderr + as_text.stderr
    members = [msgspec.json.decode(line, type=Heartbeat) for line in as_json.stdout.splitlines()]
    assert Counter(hb.role for hb in members) == {"gateway": 1, "scheduler": 1, "prefill": 1, "decode": 2}
    lines = as_text.stdout.splitlines()
    for hb in members:
        assert any(line.split()[:4] == [hb.role, hb.instance, str(hb.rank), hb.model] for line in lines), (hb, lines)
    requests = next(hb.requests for hb in members if hb.role == "gateway")
    assert requests is not None and sum(requests.outcomes.values()) >= answered and requests.outcomes.get("length", 0) + requests.outcomes.get("stop", 0) >= 4
    assert f"requests: {sum(requests.outcomes.values())} answered" in as_text.stdout
    decode_pages = sum(hb.kv_total_pages for hb in members if hb.role == "decode")
    assert f"kv pages 0/{decode_pages} in use" in as_text.stdout  # idle between tests


@contextlib.contextmanager
def _metrics_exporter(stack):
    """A `moebus metrics` process on a free port, yielding its /metrics URL; stopped by SIGINT, which it exits 0 on."""
    exporter = subprocess.Popen([sys.executable, "-m", "services.cli", "metrics", "--url", stack.url, "--port", "0"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield re.search(r"(http://\S+/metrics)", exporter.stdout.readline()).group(1)
    finally:
        exporter.send_signal(signal.SIGINT)
        rc = exporter.wait(30)
    assert rc == 0


def test_moebus_metrics_serves_every_process_to_a_prometheus_scrape(stack):
    answered = _serve_a_few(stack)
    with _metrics_exporter(stack) as url:
        deadline = time.monotonic() + 10
        while True:  # until every process has beaten once since the exporter started
            page = urllib.request.urlopen(url, timeout=5).read().decode()
            up = re.findall(r'^moebus_up\{role="(\w+)"', page, re.M)
            if sorted(up) == ["decode", "decode", "gateway", "prefill", "scheduler"] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(url.replace("/metrics", "/nope"), timeout=5)

        async def gateway_requests():
            async with session(stack.url) as (_, watch):
                await watch.wait_for(lambda w: len(w.live("gateway")) == 1, 5, "the gateway")
                return watch.live("gateway")[0].requests

        requests = run(gateway_requests())
    assert sorted(up) == ["decode", "decode", "gateway", "prefill", "scheduler"], page
    assert missing.value.code == 404
    scraped = {m[0]: int(m[1]) for m in re.findall(r'^moebus_gateway_requests_total\{.*outcome="(\w+)"\} (\d+)$', page, re.M)}
    assert scraped == requests.outcomes and sum(scraped.values()) >= answered  # no traffic between the scrape and the heartbeat
    assert re.search(r'^moebus_decode_steps_total\{.*path="eager"\} \d+$', page, re.M)


def test_time_to_first_token_is_counted_when_the_first_token_comes(stack):
    """As vLLM counts it: a stream's time to first token is in the gateway's heartbeat while the
    stream still runs, and stays counted once when the request is then cancelled (it was counted
    at the final reply of completed requests only: a dashboard saw long generations' TTFT at their
    end and never that of requests abandoned after their first token)."""

    def gateway(watch) -> Heartbeat | None:  # type: ignore[no-untyped-def]
        live = watch.live("gateway")
        return live[0] if len(live) == 1 and live[0].requests is not None else None

    def ttft_count(watch) -> int:  # type: ignore[no-untyped-def]
        hb = gateway(watch)
        return hb.requests.ttft_seconds.count if hb and hb.requests.ttft_seconds else 0

    async def scenario() -> None:
        async with session(stack.url) as (client, watch):
            await watch.wait_for(lambda w: gateway(w) is not None and gateway(w).in_flight == 0, 30, "an idle gateway")
            before, cancelled = ttft_count(watch), gateway(watch).requests.outcomes.get("cancelled", 0)
            stream = client.stream(GenerateRequest(prompt=PROMPTS[0], max_tokens=4000, ignore_eos=True, request_id="ttft-live"))
            first = await anext(stream)
            assert first.token_ids and first.finish_reason is None
            await watch.wait_for(lambda w: ttft_count(w) == before + 1, 10, "the running stream's TTFT in the heartbeat")
            hb = gateway(watch)
            assert hb.in_flight == 1 and hb.requests.outcomes.get("cancelled", 0) == cancelled  # still streaming
            await client.cancel("ttft-live")
            with pytest.raises(GenerateError) as ended:
                async for _ in stream:
                    pass
            assert ended.value.code == "cancelled"
            await watch.wait_for(lambda w: gateway(w).requests.outcomes.get("cancelled", 0) == cancelled + 1, 10, "the cancel counted")
            assert ttft_count(watch) == before + 1

    run(scenario())


# The gateway histograms whose every value follows from a reply's `timing` and `usage`.
GATEWAY_HISTOGRAMS = ("time_to_first_token_seconds", "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
                      "request_queue_time_seconds", "request_prefill_time_seconds", "request_prompt_tokens", "request_generation_tokens")


def test_moebus_metrics_histograms_count_the_finished_requests_by_their_own_timings(stack, tiny_model):
    """Scraped over HTTP before and after requests of known timings: every gateway histogram parses
    as Prometheus text, grows by exactly those requests, each in the buckets its reply's `timing`
    and `usage` put it in, and its sum by their values (the time per output token, measured from the
    first token's arrival, within the bounds the replies and the decode time give); the inter-token latency grows by one gap
    per token after the first, adding up to the decode time, which grows by one per request, each
    within its reply's time after its first token; the prefill instance's queue time histogram
    grows by one wait per request, each shorter than that request's time to first token."""

    def scrape_idle(url: str, finished: float = 0, prefilled: float = 0) -> tuple[Series, frozenset, frozenset]:
        """A page whose gateway has nothing in flight (so it counted every reply sent) and has
        counted at least `finished` requests, and whose prefill instance has taken `prefilled` tasks."""
        deadline = time.monotonic() + 10
        while True:
            series = parse_metrics(urllib.request.urlopen(url, timeout=5).read().decode())
            gateway = [labels for name, labels in series if name == "moebus_gateway_in_flight"]
            prefill = [labels for name, labels in series if name == "moebus_prefill_queue_time_seconds_count"]
            if len(gateway) == 1 and len(prefill) == 1 and series[("moebus_gateway_in_flight", gateway[0])] == 0:
                if (series[("moebus_gateway_time_to_first_token_seconds_count", gateway[0])] >= finished
                        and series[("moebus_prefill_queue_time_seconds_count", prefill[0])] >= prefilled):
                    return series, gateway[0], prefill[0]
            assert time.monotonic() < deadline, f"no idle gateway with {finished} finished requests and prefill with {prefilled} tasks"
            time.sleep(0.2)

    async def serve() -> list:
        async with session(stack.url) as (client, _):
            unary = await asyncio.gather(*(client.generate(GenerateRequest(prompt=PROMPTS[i], max_tokens=n, ignore_eos=True))
                                           for i, n in enumerate((1, 2, 5, 9))))
            streamed = await stream_all(client, GenerateRequest(prompt=PROMPTS[4], max_tokens=3, ignore_eos=True))
            return [(r.timing, r.usage) for r in unary] + [(streamed[-1].timing, streamed[-1].usage)]

    def counts(series: Series, gw: frozenset, pf: frozenset) -> tuple[float, float]:
        return series[("moebus_gateway_time_to_first_token_seconds_count", gw)], series[("moebus_prefill_queue_time_seconds_count", pf)]

    with _metrics_exporter(stack) as url:
        before, gw, pf = scrape_idle(url)
        for _ in range(10):  # a page after the last heartbeats that may still count the tests before this one
            time.sleep(1.0)
            again, gw, pf = scrape_idle(url)
            if counts(again, gw, pf) == counts(before, gw, pf):
                break
            before = again
        else:
            raise AssertionError("the gateway's and prefill instance's counts kept changing with no traffic")
        replies = run(serve())
        after, gw_after, pf_after = scrape_idle(url, before[("moebus_gateway_time_to_first_token_seconds_count", gw)] + len(replies),
                                                before[("moebus_prefill_queue_time_seconds_count", pf)] + len(replies))
    assert (gw_after, pf_after) == (gw, pf)
    assert set(dict(gw)) == {"role", "instance", "rank", "model_name"} and dict(gw)["role"] == "gateway"
    assert dict(gw)["model_name"] == dict(pf)["model_name"] == tiny_model.name  # the served model, as vLLM labels its series
    observed = {  # what each histogram should have gained, from the replies themselves
        "time_to_first_token_seconds": [t.ttft_ms / 1000 for t, _ in replies],
        "e2e_request_latency_seconds": [t.total_ms / 1000 for t, _ in replies],
        "request_queue_time_seconds": [t.queue_ms / 1000 for t, _ in replies],
        "request_prefill_time_seconds": [(t.ttft_ms - t.queue_ms) / 1000 for t, _ in replies],
        "request_prompt_tokens": [u.prompt_tokens for _, u in replies],
        "request_generation_tokens": [u.completion_tokens for _, u in replies],
    }
    assert [u.completion_tokens for _, u in replies] == [1, 2, 5, 9, 3]
    for short in GATEWAY_HISTOGRAMS:
        if short == "request_time_per_output_token_seconds":
            continue  # its values are not in the replies (below)
        family = f"moebus_gateway_{short}"
        values = observed[short]
        assert after[(f"{family}_count", gw)] - before[(f"{family}_count", gw)] == len(values), family
        assert after[(f"{family}_sum", gw)] - before[(f"{family}_sum", gw)] == pytest.approx(sum(values), rel=1e-9, abs=1e-9), family
        gained = [(le, n - m) for (le, n), (_, m) in zip(histogram_buckets(after, family)[gw], histogram_buckets(before, family)[gw], strict=True)]
        assert gained == [(le, sum(v <= le for v in values)) for le, _ in gained], family
    def gained(short: str) -> tuple[float, float]:
        family = f"moebus_gateway_{short}"
        return after[(f"{family}_count", gw)] - before[(f"{family}_count", gw)], after[(f"{family}_sum", gw)] - before[(f"{family}_sum", gw)]

    (gaps, gaps_s), (decoded, decode_s) = gained("inter_token_latency_seconds"), gained("request_decode_time_seconds")
    # Token 0 reaches the gateway before the decode rank is even told to start, and the rank sends
    # each later token as its step ends, in order on one connection: every token after the first is
    # an arrival of its own.
    assert gaps == sum(u.completion_tokens - 1 for _, u in replies)
    assert decoded == len(replies) and gaps_s == pytest.approx(decode_s, rel=1e-6)  # a request's gaps add up to its decode time
    assert 0 < decode_s <= sum(t.total_ms - t.ttft_ms for t, _ in replies) / 1000 + 1e-9
    # A request's time per output token is its first token to its last over the tokens after the first (vLLM's
    # rule): at most its reply's time after the first token over them, and all of them together between the
    # decode time over the most tokens after a first (8) and the decode time itself.
    family = "moebus_gateway_request_time_per_output_token_seconds"
    bounds = [(t.total_ms - t.ttft_ms) / (u.completion_tokens - 1) / 1000 for t, u in replies if u.completion_tokens > 1]
    tpots, tpot_s = gained("request_time_per_output_token_seconds")
    assert tpots == len(bounds) == 4
    assert decode_s / 8 - 1e-9 <= tpot_s <= min(decode_s, sum(bounds)) + 1e-9
    gained_buckets = [(le, n - m) for (le, n), (_, m) in zip(histogram_buckets(after, family)[gw], histogram_buckets(before, family)[gw], strict=True)]
    assert all(n >= sum(b <= le for b in bounds) for le, n in gained_buckets), (gained_buckets, bounds)
    family = "moebus_prefill_queue_time_seconds"
    assert after[(f"{family}_count", pf)] - before[(f"{family}_count", pf)] == len(replies)
    waited = after[(f"{family}_sum", pf)] - before[(f"{family}_sum", pf)]
    assert 0 <= waited <= sum(observed["time_to_first_token_seconds"])
    # the counters on the same page agree with the histograms
    finished = sum(v for (name, labels), v in after.items() if name == "moebus_gateway_requests_total" and dict(labels)["outcome"] in ("stop", "length"))
    assert after[("moebus_gateway_e2e_request_latency_seconds_count", gw)] == finished
    assert after[("moebus_gateway_request_prompt_tokens_sum", gw)] == after[("moebus_gateway_prompt_tokens_total", gw)]
    assert after[("moebus_gateway_request_generation_tokens_sum", gw)] == after[("moebus_gateway_completion_tokens_total", gw)]


def test_the_gateway_logs_one_completed_line_per_request_with_its_reply_figures(stack):
    """An operator greps one line per request: `completed`, with its request id, its prompt and
    completion tokens and its time to first token and end to end as its reply gave them."""
    tag = f"{time.time_ns():x}"

    async def serve() -> list:
        async with session(stack.url) as (client, _):
            unary = await client.generate(GenerateRequest(prompt=PROMPTS[1], max_tokens=3, ignore_eos=True, request_id=f"log-unary-{tag}"))
            streamed = await stream_all(client, GenerateRequest(prompt=PROMPTS[4], max_tokens=4, ignore_eos=True, request_id=f"log-stream-{tag}"))

            def logged() -> bool:
                return {e.get("request_id") for e in log_events(stack, "completed")} >= {f"log-unary-{tag}", f"log-stream-{tag}"}

            await until(logged, "the gateway logged both requests")  # it logs once the final reply is out
            return [(unary.request_id, unary.usage, unary.timing), (streamed[-1].request_id, streamed[-1].usage, streamed[-1].timing)]

    for request_id, usage, timing in run(serve()):
        lines = [e for e in log_events(stack, "completed") if e.get("request_id") == request_id]
        assert len(lines) == 1, lines
        figures = {k: lines[0][k] for k in ("finish_reason", "prompt_tokens", "tokens", "ttft_ms", "e2e_ms")}
        assert figures == {"finish_reason": "length", "prompt_tokens": usage.prompt_tokens, "tokens": usage.completion_tokens,
                           "ttft_ms": round(timing.ttft_ms, 3), "e2e_ms": round(timing.total_ms, 3)}, request_id
        assert 0 < figures["ttft_ms"] <= figures["e2e_ms"]


def _counters(watch) -> dict:
    """Totals over the live heartbeats: KV transfers (both sides), decode steps by path, the gateways' replies."""
    decode, prefill = watch.live("decode"), watch.live("prefill")
    stats = [(role, hb.transfer) for role, hbs in (("decode", decode), ("prefill", prefill)) for hb in hbs if hb.transfer is not None]
    steps = [hb.decode_steps for hb in decode]
    requests = [hb.requests for hb in watch.live("gateway") if hb.requests is not None]
    outcomes = [(name, n) for r in requests for name, n in r.outcomes.items()]
    return {
        "finished": sum(n for name, n in outcomes if name in ("stop", "length")),
        "failed": {name: n for name, n in outcomes if name not in ("stop", "length")},
        "completion_tokens": sum(r.completion_tokens for r in requests),
        "ttft_count": sum(r.ttft.count for r in requests if r.ttft),
        "decode_completed": sum(t.completed for role, t in stats if role == "decode"),
        "prefill_completed": sum(t.completed for role, t in stats if role == "prefill"),
        "decode_bytes": sum(t.bytes_total for role, t in stats if role == "decode"),
        "prefill_bytes": sum(t.bytes_total for role, t in stats if role == "prefill"),
        "failures": {f"{role}:{cause}": n for role, t in stats for cause, n in t.failures.items()},
        "eager_steps": sum(s.get("eager", 0) for s in steps),
        "graph_steps": sum(n for s in steps for path, n in s.items() if path != "eager"),
    }


BAD_INPUTS = [
    (b'{"prompt": "hi"', "malformed"),
    (b'{"prompt": "hi", "bogus": 1}', "unknown field"),
    (b'{"prompt": 42}', "$.prompt"),
    (b'{"prompt": "hi", "max_tokens": "ten"}', "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": 0}', "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": -3}', "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": 100000}', "max_tokens"),
    (b'{"prompt": ""}', "empty"),
    (b'{}', "exactly one of"),
    (b'{"prompt": "hi", "input_ids": [1]}', "exactly one of"),
    (b'{"input_ids": [999999999]}', "vocabulary"),
    (b'{"prompt": "hi", "temperature": -1}', "temperature"),
    (b'{"prompt": "hi", "top_p": 0}', "top_p"),
    (json.dumps({"prompt": "hi", "stop": [f"s{i}" for i in range(301)]}).encode(), "stop: at most 300 strings, got 301"),
    # Free-form values nested deeper than msgspec (or the chat template) can follow: msgspec's
    # RecursionError left the first without an answer (the client waited out its timeout), the
    # template's the second with `internal`.
    (b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": ' + b"[" * 100000 + b"]" * 100000 + b"}}",
     "malformed json: nested too deeply"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": ' + b"[" * 900 + b"]" * 900 + b"}}",
     "x: nested deeper than 64 levels"),
]


def test_bad_input_gets_a_typed_error_fast_and_others_are_unaffected(stack, tokenizer, hf_greedy):
    long_prompt = "word " * 5000  # > 4096 tokens of context
    prompt = PROMPTS[0]

    logged_before = len(log_events(stack, "rejected"))

    async def go():
        async with session(stack.url) as (client, watch):
            await watch.wait_for(lambda w: len(w.live("gateway")) == 1, 5, "the gateway's heartbeat")
            before = _counters(watch)["failed"]
            good = asyncio.ensure_future(client.generate(GenerateRequest(prompt=prompt, max_tokens=20, temperature=0)))
            replies = []
            for payload, _ in BAD_INPUTS + [(json.dumps({"prompt": long_prompt}).encode(), "context"), (b'{"prompt": "hi", "model": "nope"}', "nope")]:
                started = time.monotonic()
                replies.append((await client.send_raw(payload), time.monotonic() - started))
            good = await good
            bad_header = await client.send_raw(b'{"prompt": "hi"}', headers={KEEPALIVE_HEADER: "5"})
            replies.append((bad_header, 0.0))
            rejected = {"invalid_request": before.get("invalid_request", 0) + len(BAD_INPUTS) + 2, "unknown_model": before.get("unknown_model", 0) + 1}
            await watch.wait_for(lambda w: all(_counters(w)["failed"].get(code, 0) >= n for code, n in rejected.items()), 5, "rejections counted")
            return replies, good, rejected, _counters(watch)["failed"]

    replies, good, rejected, failed = run(go())
    assert {code: failed[code] for code in rejected} == rejected  # every rejection counted once, under its code
    expectations = [e for _, e in BAD_INPUTS] + ["context", "nope", "Moebus-Keepalive-Ms must be an integer number of milliseconds in [100, 60000], got '5'"]
    for (reply, elapsed), expected in zip(replies, expectations, strict=True):
        assert isinstance(reply, ErrorReply), reply
        assert reply.error.code == ("unknown_model" if expected == "nope" else "invalid_request")
        assert expected in reply.error.message, reply.error.message
        assert elapsed < 1.0
    assert good.token_ids == hf_greedy(tuple(tokenizer.encode(prompt)), 20)
    # Each refusal is in the gateway's log too, with its code and reason (the counters alone said how many, not which).
    logged = log_events(stack, "rejected")[logged_before:]
    assert [(e["replica"], e["code"], e["reason"]) for e in logged] == [("gateway-0", r.error.code, r.error.message) for r, _ in replies]


def test_a_message_over_the_bus_payload_limit_is_a_typed_error_and_the_request_is_let_go(stack):
    """An answer larger than the NATS server's max_payload (1 MiB here: 900 prompt tokens with 20
    alternatives each is ~2 MB) cannot be sent: the client gets `invalid_request` naming the
    limit the server was started with and how to raise it (not `internal`), streamed or not,
    nothing stays in flight, and the next request runs. A request that large never leaves the client."""
    prompt = list(range(10, 910))

    async def go():
        async with session(stack.url) as (client, watch):
            errors = []
            for stream in (False, True):
                req = GenerateRequest(input_ids=prompt, max_tokens=2, temperature=0, prompt_logprobs=20)
                with pytest.raises(GenerateError) as e:
                    await (stream_all(client, req) if stream else client.generate(req))
                errors.append(e.value)
            with pytest.raises(GenerateError) as too_big:
                await client.generate(GenerateRequest(prompt="x" * (2 << 20), max_tokens=1))
            after = await client.generate(GenerateRequest(input_ids=prompt[:8], max_tokens=2, temperature=0))
            await watch.wait_for(all_kv_free, 10, "every KV page free")
            return errors, too_big.value, after

    errors, too_big, after = run(go())
    for e in errors:
        assert e.code == "invalid_request" and "too large for the bus" in e.message, e.message
        assert f"exceeds the NATS server's max_payload of {1 << 20} bytes" in e.message and "MOEBUS_NATS_MAX_PAYLOAD" in e.message
    assert too_big.code == "invalid_request" and f"exceeds the NATS server's max_payload of {1 << 20} bytes" in too_big.message
    assert len(after.token_ids) == 2


def test_the_openai_frontend_refuses_a_body_over_the_bus_payload_limit_with_413(stack):
    """A body the bus cannot carry (its request would exceed the NATS server's max_payload, 1 MiB
    here) is refused as too large (413, naming that limit), as one over the frontend's own limit is."""
    url = stack.frontend_urls()["openai-0"] + "/completions"
    body = json.dumps({"prompt": "x" * (2 << 20), "max_tokens": 1}).encode()
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(urllib.request.Request(url, body, {"Content-Type": "application/json"}), timeout=30)
    assert refused.value.code == 413
    assert json.loads(refused.value.read())["error"]["message"] == (
        f"request body of {len(body)} bytes exceeds the NATS server's max_payload of {1 << 20} bytes (1 MiB)")


def test_a_first_token_batch_over_the_bus_payload_limit_fails_only_its_request(stack):
    """The prefill's own message can be over max_payload too: the first token's batch carries the
    prompt logprobs, 20 alternatives for each of 4000 prompt tokens here (~1.1 MB of msgpack).
    That request gets `invalid_request` naming the limit; the prefill instance serves on (the
    error escaped its batch loop and the instance exited) and the reservation is freed."""
    prompt = [10 + (i * 7919) % 150_000 for i in range(4000)]
    prefill = next(r for r in stack.replicas if r.role == "prefill" and r.proc.poll() is None)

    async def go():
        async with session(stack.url) as (client, watch):
            with pytest.raises(GenerateError) as too_large:
                await client.generate(GenerateRequest(input_ids=prompt, max_tokens=2, temperature=0, prompt_logprobs=20, timeout_ms=30_000))
            after = await client.generate(GenerateRequest(input_ids=prompt[:8], max_tokens=2, temperature=0, timeout_ms=30_000))
            await watch.wait_for(all_kv_free, 10, "every KV page free")
            return too_large.value, after

    error, after = run(go())
    assert error.code == "invalid_request" and "too large for the bus" in error.message and "max_payload" in error.message, error.message
    assert error.message.startswith(f"prefill:{prefill.instance}"), error.message
    assert len(after.token_ids) == 2 and prefill.proc.poll() is None


def test_a_stage_error_from_a_stage_not_serving_the_request_is_ignored(stack, tokenizer, hf_greedy):
    """A decode rank that answered its reservation too late (the scheduler placed the request on
    another rank) reports the end of that ghost reservation's lease on the request's token
    subject: the gateway must not fail the request running elsewhere for it. One from the decode
    rank that serves the request still fails it."""
    prompt = PROMPTS[0]

    async def go():
        async with session(stack.url) as (client, watch):
            await watch.wait_for(lambda w: len(w.live("gateway")) == 1, 5, "the gateway's heartbeat")
            gateway = watch.live("gateway")[0].instance
            ghost = StageError(request_id="ghosted", code="unavailable", message="KV reservation lease ended before prefill delivered",
                               stage="decode:no-such-instance/0")
            chunks = []
            async for chunk in client.stream(GenerateRequest(prompt=prompt, max_tokens=24, temperature=0, request_id="ghosted")):
                if not chunks:
                    await client.bus.publish(subjects.tokens(gateway, "ghosted"), pack(ghost))
                chunks.append(chunk)
            with pytest.raises(GenerateError) as served:  # the same error from every decode rank: one of them serves it
                async for _ in client.stream(GenerateRequest(prompt=prompt, max_tokens=200, temperature=0, request_id="served")):
                    for hb in watch.live("decode"):
                        error = msgspec.structs.replace(ghost, request_id="served", stage=decode_stage(hb.instance, hb.rank))
                        await client.bus.publish(subjects.tokens(gateway, "served"), pack(error))
            return chunks, served.value

    chunks, served = run(go())
    assert chunks[-1].finish_reason == "length"
    assert [t for c in chunks for t in c.token_ids] == hf_greedy(tuple(tokenizer.encode(prompt)), 24)
    assert served.code == "unavailable" and "lease ended" in served.message


def _fill_kv(client, n: int):
    """n requests that each take ~half a decode rank's KV (512 pages x 16 tokens) and run for long."""
    reqs = [GenerateRequest(prompt="fill", max_tokens=4000, temperature=0, request_id=f"filler-{i}", timeout_ms=120_000) for i in range(n)]
    return reqs, [asyncio.ensure_future(client.generate(r)) for r in reqs]


def test_overload_is_an_explicit_error_after_the_bounded_wait_and_cancel_frees_kv(stack):
    async def go():
        async with session(stack.url) as (client, watch):
            reqs, fillers = _fill_kv(client, 4)  # 2 decode instances x 2 requests: KV exhausted
            await watch.wait_for(lambda w: sum(hb.batch_size for hb in w.live("decode")) == 4, 20, "fillers placed")
            started = time.monotonic()
            with pytest.raises(GenerateError) as overloaded:
                await client.generate(GenerateRequest(prompt="one more", max_tokens=200, temperature=0))
            waited = time.monotonic() - started
            # A request waiting for capacity can be cancelled too, without waiting out the queue.
            waiter = asyncio.ensure_future(client.generate(GenerateRequest(prompt="waiter", max_tokens=200, temperature=0, request_id="waiter")))
            await asyncio.sleep(0.2)
            cancel_sent = time.monotonic()
            await client.cancel("waiter")
            with pytest.raises(GenerateError) as cancelled:
                await waiter
            cancel_latency = time.monotonic() - cancel_sent
            for r in reqs:
                await client.cancel(r.request_id)
            results = await asyncio.gather(*fillers, return_exceptions=True)
            await watch.wait_for(all_kv_free, 5, "KV pages back after llm.cancel")
            return overloaded.value, waited, cancelled.value, cancel_latency, results

    err, waited, cancelled, cancel_latency, results = run(go())
    assert err.code == "overloaded"
    assert 0.9 <= waited < 5.0  # MOEBUS_SCHEDULER_QUEUE_WAIT_MS=1000, then a prompt answer
    # "cancelled", not "overloaded", proves the cancel ended the wait before the queue's 1 s bound;
    # the reply itself must follow promptly (a loose bound: 0.5 s once failed on a loaded 2-core box).
    assert cancelled.code == "cancelled" and cancel_latency < 1.0
    assert all(isinstance(r, GenerateError) and r.code == "cancelled" for r in results), results


def test_deadline_cancels_and_frees_kv(stack):
    async def go():
        async with session(stack.url) as (client, watch):
            started = time.monotonic()
            with pytest.raises(GenerateError) as timeout:
                await client.generate(GenerateRequest(prompt="slow", max_tokens=4000, temperature=0, timeout_ms=1500))
            elapsed = time.monotonic() - started
            await watch.wait_for(all_kv_free, 5, "KV pages back after the deadline")
            return timeout.value, elapsed

    err, elapsed = run(go())
    assert err.code == "timeout"
    assert 1.4 < elapsed < 3.0


def test_a_client_that_went_away_has_its_request_cancelled_and_kv_freed(stack):
    """Clients that asked for keepalives and then vanished: one process killed mid-stream (the
    CLI, keepalives every 2 s by default), one that closed its stream after the first chunk
    (which unsubscribes its inbox). The gateway's next keepalive probe finds nobody listening
    and cancels each request, long before its 4000 tokens or its 60 s deadline."""
    cli = subprocess.Popen([sys.executable, "-m", "services.cli", "request", "--url", stack.url, "--prompt", "killed client",
                            "--max-tokens", "4000", "--temperature", "0", "--timeout-ms", "60000", "--stream"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def go():
        async with session(stack.url) as (plain, watch):
            try:
                await watch.wait_for(lambda w: sum(hb.batch_size for hb in w.live("decode")) == 1, 30, "the CLI's request decoding")
                client = Client(plain.bus, keepalive_s=0.3)
                req = GenerateRequest(prompt="abandoned stream", max_tokens=4000, temperature=0, timeout_ms=60_000, request_id="abandoned-client")
                async with contextlib.aclosing(client.stream(req)) as chunks:
                    await chunks.__anext__()
                    await watch.wait_for(lambda w: sum(hb.batch_size for hb in w.live("decode")) == 2, 10, "both decoding")
            finally:
                cli.kill()
                cli.wait()
            left_at = time.monotonic()
            await watch.wait_for(all_kv_free, 10, "KV freed after the clients left")
            return time.monotonic() - left_at

    freed_after = run(go())
    assert freed_after < 6.0  # one 2 s keepalive interval plus a loaded box's slack; 4000 tokens take far longer
    gone = {e["request_id"] for e in log_events(stack, "client_gone")}
    assert "abandoned-client" in gone and len(gone) == 2, gone
    failed = {e["request_id"]: e["code"] for e in log_events(stack, "request_failed")}
    completed = {e["request_id"] for e in log_events(stack, "completed")}
    assert all(failed.get(rid) == "cancelled" for rid in gone) and not gone & completed


def test_scheduler_restart_resumes_placement_within_2s(stack):
    old = next(r for r in stack.replicas if r.role == "scheduler" and r.proc.poll() is None)
    stack.stop_replica(old, signal.SIGKILL)

    async def go():
        async with session(stack.url) as (client, watch):
            with pytest.raises(GenerateError) as no_scheduler:
                await client.generate(GenerateRequest(prompt="hi", max_tokens=2, temperature=0))
            new = stack.start_replica("scheduler")
            await watch.wait_for(lambda w: any(hb.instance == new.instance for hb in w.live("scheduler")), 60, "the new scheduler")
            started = time.monotonic()
            resp = await client.generate(GenerateRequest(prompt="hi", max_tokens=2, temperature=0))
            return no_scheduler.value, resp, time.monotonic() - started

    err, resp, elapsed = run(go())
    assert err.code == "unavailable"
    assert resp.usage.completion_tokens == 2
    assert resp.timing.queue_ms < 2000 and elapsed < 2.5


def test_prefill_killed_and_restarted(stack, tokenizer, hf_greedy):
    old = next(r for r in stack.replicas if r.role == "prefill" and r.proc.poll() is None)
    stack.stop_replica(old, signal.SIGKILL)

    async def go():
        async with session(stack.url) as (client, watch):
            await watch.wait_for(lambda w: not w.live("prefill", within_s=1.0), 5, "the prefill heartbeat to stop")
            with pytest.raises(GenerateError) as down:
                await client.generate(GenerateRequest(prompt="hi", max_tokens=2, temperature=0, timeout_ms=10_000))
            new = stack.start_replica("prefill")
            await watch.wait_for(lambda w: any(hb.instance == new.instance for hb in w.live("prefill")), 90, "the new prefill instance")
            return down.value, await client.generate(GenerateRequest(prompt=PROMPTS[0], max_tokens=10, temperature=0))

    err, resp = run(go())
    assert err.code in ("unavailable", "overloaded")
    assert resp.token_ids == hf_greedy(tuple(tokenizer.encode(PROMPTS[0])), 10)


def test_decode_killed_mid_stream_fails_fast_and_survivors_serve(stack, tokenizer, hf_greedy):
    async def go():
        async with session(stack.url) as (client, watch):
            req = GenerateRequest(prompt="victim", max_tokens=4000, temperature=0, timeout_ms=60_000)
            chunks = client.stream(req)
            first = await chunks.__anext__()
            await watch.wait_for(lambda w: any(hb.batch_size > 0 for hb in w.live("decode")), 5, "the victim's heartbeat")
            busy = [hb for hb in watch.live("decode") if hb.batch_size > 0]
            assert len(busy) == 1, busy
            victim = next(r for r in stack.replicas if r.instance == busy[0].instance)
            killed_at = time.monotonic()
            stack.stop_replica(victim, signal.SIGKILL)
            with pytest.raises(GenerateError) as lost:
                async for _ in chunks:
                    pass
            detected = time.monotonic() - killed_at
            after = await client.generate(GenerateRequest(prompt=PROMPTS[3], max_tokens=12, temperature=0))
            return first, lost.value, detected, after

    first, err, detected, after = run(go())
    assert first.token_ids
    assert err.code == "unavailable"
    assert detected < 5.0  # stage_expiry_s=2 + the 0.25 s watch tick, far before the 60 s deadline
    assert after.token_ids == hf_greedy(tuple(tokenizer.encode(PROMPTS[3])), 12)


def test_a_gateway_killed_mid_request_fails_its_clients_within_three_keepalives(stack, tokenizer, hf_greedy):
    """Clients that ask for keepalives (every 0.5 s here) learn within 3 intervals that the
    gateway which accepted their requests died, instead of at their 60 s deadline; a new
    gateway then serves."""
    old = next(r for r in stack.replicas if r.role == "gateway" and r.proc.poll() is None)

    async def go():
        async with session(stack.url) as (plain, watch):
            client = Client(plain.bus, keepalive_s=0.5)
            # A unary request quiet for long stretches (only keepalives), and a streamed one.
            unary = asyncio.ensure_future(client.generate(GenerateRequest(prompt="unary victim", max_tokens=4000, temperature=0, timeout_ms=60_000, request_id="unary-victim")))
            chunks = client.stream(GenerateRequest(prompt="stream victim", max_tokens=4000, temperature=0, timeout_ms=60_000, request_id="stream-victim"))
            await chunks.__anext__()
            await watch.wait_for(lambda w: sum(hb.batch_size for hb in w.live("decode")) == 2, 10, "both victims decoding")
            await asyncio.sleep(1.5)  # the unary one has lived on keepalives alone for a while
            assert not unary.done()
            killed_at = time.monotonic()
            stack.stop_replica(old, signal.SIGKILL)
            with pytest.raises(GenerateError) as stream_lost:
                async for _ in chunks:
                    pass
            with pytest.raises(GenerateError) as unary_lost:
                await unary
            detected = time.monotonic() - killed_at
            new = stack.start_replica("gateway")
            await watch.wait_for(lambda w: any(hb.instance == new.instance for hb in w.live("gateway")), 60, "the new gateway")
            after = await client.generate(GenerateRequest(prompt=PROMPTS[3], max_tokens=6, temperature=0))
            await watch.wait_for(all_kv_free, 15, "the victims' KV freed by the decode ranks (gateway_expiry_s=5)")
            return stream_lost.value, unary_lost.value, detected, after

    stream_lost, unary_lost, detected, after = run(go())
    assert stream_lost.code == unary_lost.code == "unavailable"
    assert "stopped answering" in stream_lost.message and "stopped answering" in unary_lost.message
    assert detected < 4.0  # 3 x 0.5 s of silence, plus a loaded box's slack; the deadline was 60 s
    assert after.token_ids == hf_greedy(tuple(tokenizer.encode(PROMPTS[3])), 6)
    orphaned = {e["request_id"] for e in log_events(stack, "decode_orphaned")}
    assert {"unary-victim", "stream-victim"} <= orphaned  # dropped for the dead gateway, not at the deadline


def test_new_decode_instance_gets_placements_without_restarts(stack):
    new = stack.start_replica("decode")

    async def go():
        async with session(stack.url) as (client, watch):
            await watch.wait_for(lambda w: any(hb.instance == new.instance for hb in w.live("decode")), 90, "the new decode instance")
            reqs, fillers = _fill_kv(client, 3)
            await watch.wait_for(lambda w: any(hb.instance == new.instance and hb.batch_size > 0 for hb in w.live("decode")), 20, "a request on the new instance")
            for r in reqs:
                await client.cancel(r.request_id)
            await asyncio.gather(*fillers, return_exceptions=True)
            await watch.wait_for(all_kv_free, 5, "KV free")

    run(go())


def test_a_decode_rank_whose_warm_up_fails_exits_without_reporting_ready(stack):
    async def go():
        async with session(stack.url) as (_, watch):
            # One page of one token: not even a 1-token prompt and its first generated token fit.
            bad = stack.start_replica("decode", env={"MOEBUS_DECODE_KV_PAGES": "1", "MOEBUS_DECODE_PAGE_SIZE": "1"})
            exit_code = await asyncio.to_thread(bad.proc.wait, 120)
            await asyncio.sleep(0.5)  # a heartbeat published just before exiting would have arrived
            return bad, exit_code, [key for key in watch.latest if key[1] == bad.instance]

    bad, exit_code, heartbeats = run(go())
    assert exit_code != 0
    assert heartbeats == []
    failed = [e for e in log_events(stack, "warmup.failed") if e["replica"] == bad.instance]
    assert len(failed) == 1 and "kv_pages=1 of page_size=1 cannot hold one sequence" in failed[0]["error"]
    assert "services.warmup.WarmupFailed" in bad.log_path.read_text()
