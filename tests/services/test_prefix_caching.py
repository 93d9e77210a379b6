"""Prefix caching through real stacks (compose/single-node.yml, tiny model, real nats-server and
processes): a prefill instance of TP=2 ranks (gloo) with the cache on, and one with it off.

Expected cached tokens follow the rule, not the code: the shared leading *full* pages (16
tokens each, the stack's page size), leaving at least one prompt token to compute."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from nats.aio.msg import Msg

from schemas.api import ChatMessage, GenerateRequest, Usage
from schemas.internal import Heartbeat, Job, Placement, PrefillTask, PrefixCacheStats, SamplingSpec
from schemas.transfer import KVTransferDescriptor, KVTransferLayout
from services.metrics import render
from services.openai.protocol import merged_usage
from services.prefill.batch import Outcome, Planned
from services.prefill.group import PrefillGroup
from services.scheduler.registry import Registry, affinity_score
from shared.bus import pack, unpack
from shared.kvcache import KVLayout, PagedKVCache
from shared.model.model import Qwen3Model
from shared.model.runner import ModelRunner
from shared.prefix_keys import page_keys
from shared.settings import PrefillSettings
from prefill_workers import run_tp_pair, tp_short_rank
from services_helpers import log_events, run, session, start_stack, stack_fixture, stream_all

pytestmark = pytest.mark.slow

PAGE = 16  # PrefillSettings.page_size's default, which the stacks keep
SYSTEM = ("You are a careful assistant for a mixture-of-experts inference engine. Answer in one short sentence, "
          "name the component you mean, and never invent configuration keys that do not exist in the documentation.")

stack = stack_fixture("single-node.yml", env={"MOEBUS_PREFILL_TP": "2", "MOEBUS_PREFILL_PREFIX_CACHING": "true"})


def chat(question: str) -> list[ChatMessage]:
    return [ChatMessage("system", SYSTEM), ChatMessage("user", question)]


def chat_ids(tokenizer, messages: list[ChatMessage]) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in messages]), add_special_tokens=False)


def reusable(cached_ids: list[int], ids: list[int]) -> int:
    """Tokens a prompt ``ids`` can take from the cached pages of ``cached_ids`` (module doc)."""
    common = next((i for i, (a, b) in enumerate(zip(cached_ids, ids)) if a != b), min(len(cached_ids), len(ids)))
    return min(common // PAGE, (len(ids) - 1) // PAGE) * PAGE


def prefill_stats(watch) -> PrefixCacheStats:
    (hb,) = watch.live("prefill")
    assert hb.prefix_cache is not None
    return hb.prefix_cache


def test_a_repeated_prompt_reuses_its_prefix_and_answers_the_same(stack, tokenizer, hf_greedy):
    """The same chat twice, then a follow-up question under the same system prompt: the
    repeats report the cached tokens, and every answer is transformers' greedy one (the decode
    rank got both TP ranks' KV heads of every page, cached ones included)."""
    first_q, other_q = chat("What does the prefill service do?"), chat("Which service samples the first token?")
    ids, other_ids = chat_ids(tokenizer, first_q), chat_ids(tokenizer, other_q)
    assert reusable(ids, ids) >= 2 * PAGE and reusable(ids, other_ids) >= PAGE

    async def go():
        async with session(stack.url) as (client, watch):
            await watch.wait_for(lambda w: len(w.live("prefill")) == 1, 10, "the prefill leader's heartbeat")
            before = prefill_stats(watch)
            cold = await client.generate(GenerateRequest(messages=first_q, max_tokens=12, temperature=0))
            warm = await client.generate(GenerateRequest(messages=first_q, max_tokens=12, temperature=0))
            streamed = await stream_all(client, GenerateRequest(messages=first_q, max_tokens=12, temperature=0, stream=True))
            other = await client.generate(GenerateRequest(messages=other_q, max_tokens=12, temperature=0))
            await watch.wait_for(lambda w: len(w.live("prefill")) == 1 and prefill_stats(w).hits >= before.hits + 3, 10, "prefix cache hits")
            return cold, warm, streamed, other, before, prefill_stats(watch)

    cold, warm, streamed, other, before, after = run(go())
    expected = hf_greedy(tuple(ids), 12)
    assert cold.usage.cached_tokens == 0 and cold.token_ids == expected
    assert warm.usage == Usage(len(ids), 12, reusable(ids, ids)) and warm.token_ids == expected and warm.text == cold.text
    assert streamed[-1].usage == warm.usage and [t for c in streamed for t in c.token_ids] == expected
    assert other.usage.cached_tokens == reusable(ids, other_ids) and other.token_ids == hf_greedy(tuple(other_ids), 12)
    assert after.hit_tokens - before.hit_tokens == 2 * reusable(ids, ids) + reusable(ids, other_ids)
    assert after.lookups - before.lookups == 4 and after.cached_pages > 0
    logged = {e["request_id"]: e["cached_tokens"] for e in log_events(stack, "prefilled")}
    assert logged[cold.request_id] == 0 and logged[warm.request_id] == reusable(ids, ids)


def test_prompt_logprobs_are_right_when_the_prefix_is_cached(stack, tokenizer, tiny_model):
    """A prompt whose pages are cached, asked again with prompt_logprobs: it reuses nothing (every
    prompt row's logits are needed), and its logprobs are transformers' teacher-forced ones."""
    messages = chat("List the services of the stack.")
    ids = chat_ids(tokenizer, messages)

    async def go():
        async with session(stack.url) as (client, _):
            await client.generate(GenerateRequest(messages=messages, max_tokens=1, temperature=0))  # caches its pages
            asked = await client.generate(GenerateRequest(input_ids=ids, max_tokens=1, temperature=0, prompt_logprobs=0))
            again = await client.generate(GenerateRequest(input_ids=ids, max_tokens=1, temperature=0))
            return asked, again

    asked, again = run(go())
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        teacher = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1], dim=-1)
    expected = teacher[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert asked.usage.cached_tokens == 0 and again.usage.cached_tokens == reusable(ids, ids) > 0
    assert [e.token_id for e in asked.prompt_logprobs] == ids and asked.prompt_logprobs[0].logprob is None
    torch.testing.assert_close(torch.tensor([e.logprob for e in asked.prompt_logprobs[1:]]), expected, rtol=0, atol=1e-4)
    assert asked.token_ids == again.token_ids


def openai_completion(stack, body: dict) -> dict:
    """The answer of the stack's OpenAI frontend to a /v1/completions ``body``."""
    openai = re.search(r"(http://[\d.]+:\d+/v1)", stack.frontend_urls().get("openai-0", "")).group(1)
    request = urllib.request.Request(f"{openai}/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=60).read())


def test_openai_usage_and_metrics_report_cached_tokens(stack):
    """``usage.prompt_tokens_details.cached_tokens`` on /v1/completions, and the prefill leader's
    counters on `moebus metrics` (the stack's own exporter)."""
    metrics = re.search(r"(http://\S+/metrics)", stack.frontend_urls().get("metrics-0", "")).group(1)
    prompt = " ".join(["the experts of every layer route tokens to the gate"] * 4)

    def complete() -> dict:
        return openai_completion(stack, {"prompt": prompt, "max_tokens": 4, "temperature": 0})

    first, second = complete(), complete()
    n = first["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": (n - 1) // PAGE * PAGE} and (n - 1) // PAGE > 0
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    deadline = time.monotonic() + 10  # the counters travel in the prefill leader's next heartbeat
    while True:
        page = urllib.request.urlopen(metrics, timeout=10).read().decode()
        hits = re.search(r'^moebus_prefill_prefix_cache_hits_total\{[^}]*role="prefill"[^}]*\} (\S+)$', page, re.M)
        if (hits and float(hits.group(1)) >= 1) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert hits and float(hits.group(1)) >= 1, page


def test_a_cache_salt_shares_cached_pages_only_with_requests_of_the_same_salt(stack, tokenizer):
    """vLLM's cache_salt (native API and OpenAI frontend): the same long prompt under two salts and
    none is computed whole three times (no hit, the heartbeat's hit counter unmoved), then each again
    reuses its own pages; the OpenAI frontend's salt reaches the same cache."""
    prompt = " ".join(["salted tenants never read each other's cached pages of the shared system prompt"] * 5)
    reuse = reusable(tokenizer.encode(prompt), tokenizer.encode(prompt))
    assert reuse >= 3 * PAGE

    async def go():
        async with session(stack.url) as (client, watch):
            await watch.wait_for(lambda w: len(w.live("prefill")) == 1, 10, "the prefill leader's heartbeat")
            before = prefill_stats(watch)
            cold = [await client.generate(GenerateRequest(prompt=prompt, max_tokens=2, temperature=0, cache_salt=salt))
                    for salt in ("tenant-a", "tenant-b", None)]
            await watch.wait_for(lambda w: len(w.live("prefill")) == 1 and prefill_stats(w).lookups >= before.lookups + 3, 10, "3 lookups")
            middle = prefill_stats(watch)
            warm = [await client.generate(GenerateRequest(prompt=prompt, max_tokens=2, temperature=0, cache_salt=salt))
                    for salt in ("tenant-a", "tenant-b", None)]
            await watch.wait_for(lambda w: len(w.live("prefill")) == 1 and prefill_stats(w).lookups >= before.lookups + 6, 10, "6 lookups")
            return cold, warm, before, middle, prefill_stats(watch)

    cold, warm, before, middle, after = run(go())
    assert [r.usage.cached_tokens for r in cold] == [0, 0, 0]
    assert (middle.lookups - before.lookups, middle.hits - before.hits, middle.hit_tokens - before.hit_tokens) == (3, 0, 0)
    assert [r.usage.cached_tokens for r in warm] == [reuse] * 3
    assert (after.lookups - middle.lookups, after.hits - middle.hits, after.hit_tokens - middle.hit_tokens) == (3, 3, 3 * reuse)
    assert [r.token_ids for r in warm] == [r.token_ids for r in cold]
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    assert openai_completion(stack, body | {"cache_salt": "tenant-a"})["usage"]["prompt_tokens_details"] == {"cached_tokens": reuse}
    assert openai_completion(stack, body | {"cache_salt": "tenant-c"})["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_with_prefix_caching_off_nothing_is_reused(tiny_model, tokenizer, hf_greedy, tmp_path: Path):
    off = start_stack(tiny_model, tmp_path, "single-node.yml", scale={"openai": 0, "metrics": 0}, env={"MOEBUS_PREFILL_PREFIX_CACHING": "false"})
    messages = chat("What does the prefill service do?")
    try:
        async def go():
            async with session(off.url) as (client, watch):
                answers = [await client.generate(GenerateRequest(messages=messages, max_tokens=8, temperature=0)) for _ in range(2)]
                await watch.wait_for(lambda w: len(w.live("prefill")) == 1, 10, "the prefill heartbeat")
                return answers, watch.live("prefill")[0].prefix_cache

        (cold, again), stats = run(go())
    finally:
        off.stop()
    ids = chat_ids(tokenizer, messages)
    assert cold.usage.cached_tokens == again.usage.cached_tokens == 0
    assert cold.token_ids == again.token_ids == hf_greedy(tuple(ids), 8)
    assert stats is None  # no cache to report (and none for the scheduler's affinity to aim at)


# ------------------------------------------------------------ the leader's plan (a real PrefillGroup, no bus)

def group_on(tiny_model: Path, num_pages: int, **settings) -> PrefillGroup:
    model = Qwen3Model.load(tiny_model)
    c = model.config
    runner = ModelRunner(model, PagedKVCache(KVLayout(c.num_layers, num_pages, model.local_kv_heads, PAGE, c.head_dim, torch.float32)),
                         release_finished=False)
    return PrefillGroup(PrefillSettings(instance="p", **({"prefix_caching": True} | settings)), runner, None, 0, 1, None)  # type: ignore[arg-type]  # planning needs no transfer worker


def task(request_id: str, ids: list[int], prompt_logprobs: int = -1, kv_dtype: str = "float32") -> Msg:
    job = Job(request_id=request_id, gateway="g", input_ids=ids, max_tokens=4, sampling=SamplingSpec(0.0, 1.0, 0, None), stop_token_ids=[],
              logprobs=False, deadline=time.time() + 60, prompt_logprobs=prompt_logprobs)
    layout = KVTransferLayout(num_layers=2, page_size=PAGE, kv_heads=2, head_dim=32, dtype=kv_dtype)
    descriptor = KVTransferDescriptor(worker_address=b"", request_id=request_id, transfer_id=1, page_ids=[0], num_tokens=len(ids), layout=layout,
                                      lease_deadline_unix=time.time() + 60, max_chunk_bytes=1 << 20)
    msg = PrefillTask(job=job, placement=Placement(decode_instance="d", decode_rank=0, prefill_instance="p"), descriptor=descriptor)
    return Msg(_client=None, subject="test", data=pack(msg))  # type: ignore[arg-type]


def cache_prompt(group: PrefillGroup, ids: list[int]) -> None:
    """As if a request had run ``ids``: its full pages cached, nobody holding them."""
    table = group.prefix.alloc(-(-len(ids) // PAGE))
    group.prefix.release(ids, table, 0, computed=True)


def plan(group: PrefillGroup, tasks: list[Msg]) -> list[tuple[str, int]]:
    async def go():
        for t in tasks:
            await group._on_task(t)
        return await group._take_batch(None)

    return [(p.task.job.request_id, p.cached_pages) for p in asyncio.run(go())]


def test_the_leader_counts_cached_pages_as_allocated_and_evictable_ones_as_free(tiny_model):
    """8 pages of 16 tokens, 3 of them a cached prefix nobody holds (5 free)."""
    shared = list(range(100, 148))  # 3 full pages
    group = group_on(tiny_model, 8)
    cache_prompt(group, shared + [1])
    follow_up, fresh = shared + list(range(200, 240)), list(range(300, 364))  # 6 pages (3 cached), 4 pages
    # 3 new pages for the follow-up fit the 5 free; the fresh prompt's 4 more do not (the cached 3 are in use by then): it waits.
    assert plan(group, [task("b", follow_up), task("c", fresh)]) == [("b", 3)]
    assert plan(group, []) == [("c", 0)]
    # A task's own cached pages are not evictable for it: 2 fresh pages, then 4 new ones behind
    # the 3 cached would need 6 of the 5 free pages (8 counting the cached ones): it waits.
    group = group_on(tiny_model, 8)
    cache_prompt(group, shared + [1])
    assert plan(group, [task("f", list(range(600, 632))), task("g", shared + list(range(700, 764)))]) == [("f", 0)]
    # A prompt of 7 pages, sharing nothing: the 3 evictable pages count as available.
    group = group_on(tiny_model, 8)
    cache_prompt(group, shared + [1])
    assert plan(group, [task("d", list(range(400, 512)))]) == [("d", 0)]
    # The batch's token budget counts computed tokens: the follow-up computes 40 of its 88.
    group = group_on(tiny_model, 16, max_batch_tokens=60)
    cache_prompt(group, shared + [1])
    assert plan(group, [task("b", follow_up), task("e", list(range(500, 520)))]) == [("b", 3), ("e", 0)]
    # Its context budget counts every prompt token, reused ones included (prefill attention gathers
    # them all): two follow-ups of 88 tokens computing 40 each fit 100 computed tokens, not 150 context ones;
    # a prompt over the context budget alone still runs, alone.
    group = group_on(tiny_model, 32, max_batch_tokens=100, max_batch_context_tokens=150)
    cache_prompt(group, shared + [1])
    assert plan(group, [task("b", follow_up), task("h", shared + list(range(800, 840)))]) == [("b", 3)]
    assert plan(group, []) == [("h", 3)]
    group = group_on(tiny_model, 32, max_batch_tokens=100, max_batch_context_tokens=100)
    cache_prompt(group, shared + [1])
    assert plan(group, [task("l", shared + list(range(900, 990))), task("m", list(range(1000, 1010)))]) == [("l", 3)]


def test_prompt_logprob_tasks_reuse_nothing_and_a_rank_reuses_no_more_than_the_plan(tiny_model):
    shared = list(range(100, 148))
    group = group_on(tiny_model, 16)
    cache_prompt(group, shared + [1])
    assert plan(group, [task("lp", shared + [2], prompt_logprobs=0), task("plain", shared + [2])]) == [("lp", 0), ("plain", 3)]
    # A rank whose index finds more than the leader planned (its peers may lack the rest) reuses
    # the planned 2 pages and computes the third, whose copy it frees: the cached one stays.
    group = group_on(tiny_model, 16)
    cache_prompt(group, shared + [1])
    planned = [Planned(unpack(task("x", shared + [2], kv_dtype="bfloat16").data, PrefillTask), 2)]
    ((outcome,), _) = asyncio.run(group.batch_runner.prefill(planned))
    assert outcome.output is not None and outcome.cached_tokens == 2 * PAGE
    assert group.prefix.cached_pages == group.prefix.evictable_pages == 3 and group.prefix.allocator.num_free == 13


def test_a_failed_forward_caches_nothing_and_a_computed_batch_caches_its_full_pages(tiny_model):
    """The group's batch path (`BatchRunner.prefill`, one rank): whether a batch's pages enter the cache
    follows its forward alone. The decode layout here is refused (another dtype: LayoutMismatch),
    so no KV leaves either batch."""
    group = group_on(tiny_model, 16)
    prompt = list(range(100, 148)) + [1, 2]  # 3 full pages and 2 tokens

    def prefill(request_id: str) -> Outcome:
        planned = [Planned(unpack(task(request_id, prompt, kv_dtype="bfloat16").data, PrefillTask), 0)]
        ((outcome,), _) = asyncio.run(group.batch_runner.prefill(planned))
        return outcome

    attn = group.runner.model.weights.layers[1].attn
    o_proj = attn.o_proj
    attn.o_proj = o_proj[:, :-1]  # layer 1's output projection one input column short: the forward raises
    failed = prefill("bad")
    assert failed.output is None and failed.error is not None and failed.error.startswith("prefill forward failed: RuntimeError")
    assert failed.code == "internal"  # a bug, not a stage gone (it was `unavailable`)
    assert group.prefix.cached_pages == 0 and group.prefix.allocator.num_free == 16 and group.prefix.match(prompt) == []
    attn.o_proj = o_proj
    computed = prefill("good")
    assert computed.output is not None and computed.error is not None and "dtype" in computed.error  # computed, not sent
    assert computed.code == "internal"  # prefill's and decode's layouts differ: no stage is gone (it was `unavailable`)
    assert group.prefix.cached_pages == group.prefix.evictable_pages == 3 and group.prefix.allocator.num_free == 13
    assert len(group.prefix.match(prompt)) == 3


def test_a_tp_rank_short_of_pages_leaves_the_ranks_caches_apart_and_the_next_batch_reuses_what_every_rank_has(tiny_model, tmp_path):
    """A TP group of 2 (gloo, spawned processes, `prefill_workers.tp_short_rank`): rank 1 alone is
    short of pages for a task of 31 pages. The leader takes them, evicting one cached page of a
    prompt that rank 1 keeps; the task fails on both ranks (rank 1 could not prepare it), and their
    indexes now differ: the leader finds 1 page of the prompt, rank 1 finds 2. The same prompt
    again, planned by the leader (1 page) and broadcast: before this change rank 1's index
    disagreed with the plan, both ranks raised `PrefixCacheMismatch` and `PrefillGroup.run`
    stopped the instance (the request failed with `internal`, later ones found no prefill). Now
    every rank reuses what every rank finds (1 page), the batch runs, and the caches are alike again."""
    leader, peer = run_tp_pair(tp_short_rank, tiny_model, tmp_path)
    assert leader["warm"] == peer["warm"] == [2, 30, 2]
    elsewhere = "prefill could not prepare the request: on another rank of the TP group (its log names the error)"
    short = "prefill could not prepare the request: its KV pages are short on this rank (its log says how short)"
    assert leader["big"] == [False, "internal", elsewhere, 1, 31, 1]  # the leader evicted a page of the prompt for the task
    assert peer["big"] == [False, "internal", short, 2, 30, 2]  # rank 1 took no page for it: it keeps both
    assert leader["plan"] == peer["plan"] == [1]
    assert "raised" not in leader and "raised" not in peer, (leader, peer)
    for again in (leader["again"], peer["again"]):
        ran, code, error, cached_tokens, *after = again
        assert ran and code == "internal" and "dtype" in error, again  # it ran (its KV is refused: another dtype)
        assert cached_tokens == PAGE and after == [2, 30, 2]  # one page reused on every rank; both full pages cached on both again


# ------------------------------------------------------------ the scheduler's prefix affinity

def prefill_registry(queued: dict[str, int], page_size: int = PAGE, caching: bool = True) -> Registry:
    reg = Registry(expiry_s=10)
    for name, tokens in queued.items():
        reg.update(Heartbeat(role="prefill", instance=name, rank=0, model="m", version="v", started_at=1.0, queued_tokens=tokens, page_size=page_size,
                             prefix_cache=PrefixCacheStats() if caching else None))
    return reg


def test_prompts_with_the_same_first_page_go_to_the_same_prefill_instance_while_the_load_allows():
    reg = prefill_registry({"p0": 0, "p1": 0, "p2": 0})
    rng = random.Random(3)
    prompts = [[rng.randrange(1000) for _ in range(40)] for _ in range(60)]
    chosen = [reg.prefill_for(p, 4096).hb.instance for p in prompts]
    assert set(chosen) == {"p0", "p1", "p2"}  # different first pages spread over the instances
    for p, instance in zip(prompts, chosen):  # a follow-up (same first page, any tail) goes where its start went
        assert reg.prefill_for(p[:PAGE] + [7] * 30, 4096).hb.instance == instance
    # Another scheduler replica (its own registry) picks the same instances.
    assert [prefill_registry({"p2": 0, "p0": 0, "p1": 0}).prefill_for(p, 4096).hb.instance for p in prompts] == chosen

    preferred = chosen[0]
    busy = prefill_registry({name: (5000 if name == preferred else 1000) for name in ("p0", "p1", "p2")})
    assert busy.prefill_for(prompts[0], 4096).hb.instance == preferred  # 4000 more queued: within the slack
    assert busy.prefill_for(prompts[0], 3999).hb.instance != preferred  # beyond it: the least loaded
    assert busy.prefill_for(prompts[0], 0).hb.instance != preferred  # affinity off
    assert busy.prefill_for(prompts[0][: PAGE], 4096).hb.instance != preferred  # no page to reuse: the least loaded
    assert prefill_registry({"p0": 0, "p1": 9}, page_size=0).prefill_for(prompts[0], 4096).hb.instance == "p0"  # no page size reported
    uncached = prefill_registry({name: (1 if name == preferred else 0) for name in ("p0", "p1", "p2")}, caching=False)
    assert uncached.prefill_for(prompts[0], 4096).hb.instance != preferred  # caching off: the least loaded


# ------------------------------------------------------------ units: the figures' shapes

def test_the_affinity_hashes_the_first_page_salted_as_prefill_keys_it():
    """A request's cache_salt salts the scheduler's first-page key as prefill salts its pages' keys
    (`shared.prefix_keys.page_keys`): the instance picked is the one whose rendezvous score of the
    salted key is highest, so a salt's prompts go where that salt's pages are; other salts spread."""
    reg = prefill_registry({"p0": 0, "p1": 0, "p2": 0})
    prompt = list(range(40))
    for salt in (None, *(f"tenant-{i}" for i in range(30))):
        (key,) = page_keys(prompt[:PAGE], PAGE, salt)
        expected = max(("p0", "p1", "p2"), key=lambda name: affinity_score(name, key))
        assert reg.prefill_for(prompt, 4096, salt).hb.instance == expected, salt  # type: ignore[union-attr]
    assert {reg.prefill_for(prompt, 4096, f"tenant-{i}").hb.instance for i in range(30)} == {"p0", "p1", "p2"}  # type: ignore[union-attr]


def test_merged_openai_usage_counts_each_prompts_cached_tokens_once():
    usages = [Usage(40, 3, 32), Usage(40, 5, 32), Usage(20, 2, 0), Usage(20, 4, 16)]  # 2 prompts x n=2
    assert merged_usage(usages, 2) == Usage(60, 14, 32)


def test_metrics_render_the_prefix_cache_counters():
    stats = PrefixCacheStats(lookups=9, hits=4, lookup_tokens=900, hit_tokens=320, evictions=2, cached_pages=30, evictable_pages=25)
    hb = Heartbeat(role="prefill", instance="p0", rank=0, model="tiny", version="0.1", started_at=0.0, prefix_cache=stats)
    page = render([hb], now=1.0)
    for name, value in [("lookups_total", 9), ("hits_total", 4), ("lookup_tokens_total", 900), ("hit_tokens_total", 320),
                        ("evictions_total", 2), ("pages", 30), ("evictable_pages", 25)]:
        assert f'moebus_prefill_prefix_cache_{name}{{role="prefill",instance="p0",rank="0",model_name="tiny"}} {value}\n' in page
