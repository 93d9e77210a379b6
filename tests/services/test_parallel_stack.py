"""End to end with prefill TP=2 and decode DP=2 x EP=2 (compose/split-nodes.yml run locally:
two gateways, two schedulers, one prefill instance of 2 ranks, one decode instance of 2 ranks)."""

from __future__ import annotations

import asyncio
import signal

import pytest

from schemas.api import GenerateRequest

from services_helpers import log_events, run, session, stack_fixture, stream_all

pytestmark = pytest.mark.slow

stack = stack_fixture("split-nodes.yml")

PROMPTS = ["The capital of France is", "Mixture-of-experts models route each token to a few experts, which", "1, 2, 3, 4,", "hi"]


def test_unary_and_stream_match_transformers_greedy(stack, tokenizer, hf_greedy):
    async def go():
        async with session(stack.url) as (client, _):
            unary = [await client.generate(GenerateRequest(prompt=p, max_tokens=20, temperature=0)) for p in PROMPTS[:2]]
            streamed = [await stream_all(client, GenerateRequest(prompt=p, max_tokens=20, temperature=0)) for p in PROMPTS[:2]]
            return unary, streamed

    unary, streamed = run(go())
    for prompt, resp, chunks in zip(PROMPTS, unary, streamed):
        expected = hf_greedy(tuple(tokenizer.encode(prompt)), 20)
        assert resp.token_ids == expected
        assert [t for c in chunks for t in c.token_ids] == expected
        assert "".join(c.text for c in chunks) == resp.text


def test_both_dp_ranks_serve_concurrent_requests(stack, tokenizer, hf_greedy):
    cases = [(PROMPTS[i % len(PROMPTS)], 8 + 4 * i) for i in range(12)]

    async def go():
        async with session(stack.url) as (client, watch):
            busy_ranks: set[int] = set()

            async def sample_heartbeats() -> None:
                while True:
                    busy_ranks.update(hb.rank for hb in watch.live("decode") if hb.batch_size > 0)
                    await asyncio.sleep(0.02)

            sampler = asyncio.ensure_future(sample_heartbeats())
            results = await asyncio.gather(*(client.generate(GenerateRequest(prompt=p, max_tokens=n, temperature=0)) for p, n in cases))
            sampler.cancel()
            return results, busy_ranks

    results, busy_ranks = run(go())
    assert busy_ranks == {0, 1}
    for (prompt, n), resp in zip(cases, results):
        assert resp.token_ids == hf_greedy(tuple(tokenizer.encode(prompt)), n)


def test_the_prefill_leader_reports_both_tp_ranks_kv_sends(stack):
    """Each TP rank sends its own KV head; the leader's heartbeat sums both ranks' shards,
    so its totals match what the decode ranks received (every request's whole KV)."""

    def totals(watch):
        sent = [hb.transfer for hb in watch.live("prefill") if hb.transfer is not None]
        received = [hb.transfer for hb in watch.live("decode") if hb.transfer is not None]
        return (sum(t.completed for t in sent), sum(t.bytes_total for t in sent), sum(t.completed for t in received),
                sum(t.bytes_total for t in received), [t.failures for t in sent + received if t.failures])

    async def go():
        async with session(stack.url) as (client, watch):
            await watch.wait_for(lambda w: len(w.live("prefill")) == 1 and len(w.live("decode")) == 2, 10, "prefill leader and decode ranks")
            before = totals(watch)
            for prompt in PROMPTS:
                await client.generate(GenerateRequest(prompt=prompt, max_tokens=2, temperature=0))
            await watch.wait_for(lambda w: totals(w)[2] >= before[2] + len(PROMPTS) and totals(w)[0] >= before[0] + 2 * len(PROMPTS), 5, "transfer totals")
            return before, totals(watch)

    before, after = run(go())
    sent, sent_bytes, received, received_bytes, failures = (a - b if isinstance(a, int) else a for a, b in zip(after, before))
    assert received == len(PROMPTS) and sent == 2 * len(PROMPTS)  # one shard per TP rank per request
    assert sent_bytes == received_bytes > 0
    assert failures == []


def test_every_rank_of_the_tp_and_dp_groups_warmed_up(stack):
    ranks = {(e["service"], e["replica"], e["rank"]) for e in log_events(stack, "warmup.done")}
    prefill = next(r.instance for r in stack.replicas if r.role == "prefill")
    decode = next(r.instance for r in stack.replicas if r.role == "decode")
    assert {("prefill", prefill, 0), ("prefill", prefill, 1), ("decode", decode, 0), ("decode", decode, 1)} <= ranks


def test_sigterm_drains_decode_in_flight_requests_finish(stack, tokenizer, hf_greedy):
    decode = next(r for r in stack.replicas if r.role == "decode")

    async def go():
        async with session(stack.url) as (client, watch):
            running = asyncio.ensure_future(client.generate(GenerateRequest(prompt=PROMPTS[1], max_tokens=60, temperature=0)))
            await watch.wait_for(lambda w: any(hb.batch_size > 0 for hb in w.live("decode")), 10, "the request on a decode rank")
            decode.proc.send_signal(signal.SIGTERM)
            resp = await running
            exit_code = await asyncio.to_thread(decode.proc.wait, 30)
            return resp, exit_code

    resp, exit_code = run(go())
    assert resp.finish_reason == "length"
    assert resp.token_ids == hf_greedy(tuple(tokenizer.encode(PROMPTS[1])), 60)
    assert exit_code == 0
