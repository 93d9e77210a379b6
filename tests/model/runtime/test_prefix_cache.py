"""Prefix caching: the cache's bookkeeping (shared.prefix_cache) and a runner reusing cached pages."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest
import torch
from runtime_helpers import GPU, random_prompts

from shared.kvcache import InvalidPages, OutOfPages, PageAllocator
from shared.model.runner import ModelRunner, StepOutput
from shared.model.sampling_params import SamplingParams
from shared.prefix_cache import PrefixCache
from shared.prefix_keys import page_keys

PS = 4  # page size of these tests


def cache_of(num_pages: int, enabled: bool = True) -> PrefixCache:
    return PrefixCache(PageAllocator(num_pages), PS, enabled)


def hold(cache: PrefixCache, prompt: list[int]) -> tuple[list[int], int]:
    """Pages for a new request, as the prefill group takes them: its page table and how many
    of its pages came from the cache."""
    hits = cache.match(prompt)
    cache.acquire(hits, len(prompt))
    return hits + cache.alloc(-(-len(prompt) // PS) - len(hits)), len(hits)


def run_request(cache: PrefixCache, prompt: list[int], computed: bool = True) -> list[int]:
    """One request's whole life on the cache: its page table."""
    table, hits = hold(cache, prompt)
    cache.release(prompt, table, hits, computed)
    return table


def test_page_keys_chain_the_whole_prefix():
    a, b, x = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]
    ax, bx = page_keys(a + x, PS), page_keys(b + x, PS)
    assert len(ax) == 2 and ax[1] != bx[1]  # same page tokens after another prefix: another key
    assert page_keys(a + x + [1, 2], PS) == ax  # the partial tail page has no key
    assert page_keys(a + x, PS) == ax and page_keys(a, PS) == ax[:1]
    assert page_keys([1, 2, 3], PS) == []
    # The format every process (TP peers, scheduler replicas) must agree on: blake2b-128 over the
    # parent key and the page's token ids as little-endian int64.
    first = hashlib.blake2b(struct.pack("<4q", *a), digest_size=16).digest()
    assert ax == [first, hashlib.blake2b(first + struct.pack("<4q", *x), digest_size=16).digest()]


def test_a_cache_salt_starts_the_key_chain_so_only_prompts_of_the_same_salt_share_pages():
    """vLLM's cache_salt: the same tokens under another salt (or none) have none of the same keys,
    not even the first page's; the same salt gives the same keys. Cached under one salt, a prompt
    matches nothing under another."""
    prompt = [1, 2, 3, 4, 9, 9, 9, 9, 5]
    plain, a, b = page_keys(prompt, PS), page_keys(prompt, PS, "tenant-a"), page_keys(prompt, PS, "tenant-b")
    assert len(plain) == len(a) == len(b) == 2
    assert not {*plain} & {*a} and not {*a} & {*b} and not {*plain} & {*b}
    assert page_keys(prompt, PS, "tenant-a") == a and page_keys(prompt, PS, None) == plain
    assert page_keys(prompt, PS, "tenant-a")[:1] == page_keys(prompt[:PS], PS, "tenant-a")  # still a chain: a prefix's keys are the prompt's first ones
    cache = cache_of(16)
    hits = cache.match(prompt, a)
    cache.acquire(hits, len(prompt))
    cache.release(prompt, hits + cache.alloc(3), 0, True, a)  # cached under tenant-a
    assert cache.match(prompt, a) != [] and len(cache.match(prompt, a)) == 2
    assert cache.match(prompt, b) == [] and cache.match(prompt, plain) == [] and cache.match(prompt) == []


def test_keys_hashed_once_by_the_caller_match_and_release_as_the_token_ids_do():
    a, x = [1, 2, 3, 4], [9, 9, 9, 9]
    by_ids, by_keys = cache_of(16), cache_of(16)
    for prompt in (a + x + [3], a + x + [5, 6, 7, 8, 1], a + [2]):
        keys = page_keys(prompt, PS)
        hits = by_keys.match(prompt, keys)
        assert hits == by_ids.match(prompt)
        by_keys.acquire(hits, len(prompt))
        table = hits + by_keys.alloc(-(-len(prompt) // PS) - len(hits))
        by_keys.release(prompt, table, len(hits), True, keys)
        run_request(by_ids, prompt)
    assert by_keys.stats() == by_ids.stats() and by_keys.stats().cached_pages == 3
    with pytest.raises(InvalidPages, match="1 page keys for a prompt of 2 full pages"):
        by_keys.match(a + x + [3], page_keys(a, PS))
    table, hits = hold(by_keys, a + x + [3])
    with pytest.raises(InvalidPages, match="1 page keys for a prompt of 2 full pages"):
        by_keys.release(a + x + [3], table, hits, True, page_keys(a, PS))


def test_match_finds_only_the_cached_prefix_and_leaves_a_token_to_run():
    cache = cache_of(16)
    a, b, x, y = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9], [7, 7, 7, 7]
    first = run_request(cache, a + x + [3])  # pages a, x cached; the partial page freed
    assert cache.cached_pages == 2 and cache.allocator.num_free == 14
    assert cache.match(b + x + [3]) == []  # x after b is not x after a
    assert cache.match(a + y + [3]) == first[:1]
    assert cache.match(a + x + [1, 2]) == first[:2]
    assert cache.match(a + x) == first[:1]  # both pages cached, but the last token must run
    assert cache.match(a) == [] and cache.match([1]) == []


def test_refs_keep_shared_pages_out_of_eviction_until_the_last_holder_releases():
    cache = cache_of(6)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    run_request(cache, prompt)  # 2 cached pages
    (t1, h1), (t2, h2) = hold(cache, prompt), hold(cache, prompt)
    assert (h1, h2) == (2, 2) and t1[:2] == t2[:2] and cache.evictable_pages == 0
    assert cache.available() == 6 - 4  # 2 shared cached pages + one tail page each
    with pytest.raises(OutOfPages):
        cache.alloc(3)
    cache.release(prompt, t1, h1, True)
    assert cache.evictable_pages == 0  # t2 still holds both
    cache.release(prompt, t2, h2, True)
    assert cache.evictable_pages == 2 and cache.available() == 6
    assert cache.stats().hits == 2 and cache.stats().hit_tokens == 16 and cache.stats().lookups == 3


def test_eviction_is_lru_of_unheld_pages_deepest_first_and_all_or_nothing():
    cache = cache_of(8)
    old, new = [1] * 8 + [0], [2] * 8 + [0]
    old_table = run_request(cache, old)
    new_table = run_request(cache, new)
    hold(cache, new)  # holds new's two cached pages
    assert cache.available() == 8 - 2 - 1
    with pytest.raises(OutOfPages) as info:
        cache.alloc(6)
    assert info.value.requested == 6 and cache.cached_pages == 4 and cache.stats().evictions == 0  # nothing evicted
    free_before = cache.allocator.num_free  # 8 - 4 cached - 1 tail of `held`
    got = cache.alloc(free_before + 1)  # one eviction: old's deepest page
    assert old_table[1] in got and cache.match(old) == old_table[:1] and cache.stats().evictions == 1
    got += cache.alloc(1)  # then old's first page; new's held pages stay
    assert old_table[0] in got and cache.match(old) == [] and cache.match(new) == new_table[:2]
    assert cache.available() == 0
    with pytest.raises(OutOfPages):
        cache.alloc(1)


def test_the_cache_never_fails_an_allocation_and_the_pool_returns_to_full():
    """Random requests (shared system prompts, some failing): whatever is cached, an allocation
    gets every page no running request holds; once all are done and everything is evicted, the
    allocator has every page free again."""
    rng = random.Random(7)
    num_pages = 24
    cache = cache_of(num_pages)
    systems = [[rng.randrange(50) for _ in range(rng.randrange(1, 12))] for _ in range(4)]
    running: list[tuple[list[int], list[int], int]] = []
    for step in range(400):
        if running and (rng.random() < 0.5 or step % 37 == 0):
            prompt, table, hits = running.pop(rng.randrange(len(running)))
            cache.release(prompt, table, hits, computed=rng.random() < 0.9)
        else:
            prompt = rng.choice(systems) + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
            hits = cache.match(prompt)
            held = {p for _, t, _ in running for p in t}
            need = -(-len(prompt) // PS) - len(hits)
            assert cache.available(hits) == num_pages - len(held | set(hits))  # nothing but running requests' pages is withheld
            if need > cache.available(hits):
                continue
            cache.acquire(hits, len(prompt))
            table = hits + cache.alloc(need)
            assert not set(table[len(hits):]) & (held | set(hits))
            running.append((prompt, table, len(hits)))
    assert cache.stats().hits > 0 and cache.stats().evictions > 0
    for prompt, table, hits in running:
        cache.release(prompt, table, hits, computed=True)
    assert cache.available() == num_pages
    everything = cache.alloc(num_pages)
    assert cache.cached_pages == 0 and cache.allocator.num_free == 0
    cache.allocator.free(everything)
    assert cache.allocator.num_free == num_pages


def test_duplicates_failed_forwards_and_a_disabled_cache_cache_nothing_extra():
    cache = cache_of(8)
    prompt = [3] * 9
    (t1, h1), (t2, h2) = hold(cache, prompt), hold(cache, prompt)  # the same prefix computed twice in one batch
    assert (h1, h2) == (0, 0)
    cache.release(prompt, t1, h1, True)
    cache.release(prompt, t2, h2, True)
    assert cache.cached_pages == 2 and cache.allocator.num_free == 6  # the second copy was freed
    failed = [4] * 9
    run_request(cache, failed, computed=False)
    assert cache.match(failed) == [] and cache.allocator.num_free == 6

    off = cache_of(8, enabled=False)
    run_request(off, prompt)
    assert off.match(prompt) == [] and off.allocator.num_free == 8 and off.stats().cached_pages == 0
    with pytest.raises(InvalidPages):
        off.release(prompt, [0], 0, True)  # a table that does not cover the prompt


# ------------------------------------------------------------ the runner on cached pages

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, logprobs=True, top_logprobs=5)
# CPU: fp32 reference ops, pages of 4. CUDA: bf16 on the kernel path (the shapes the kernels take:
# head_dim 64, pages of 16, as in test_kernel_path), where rounding differs between the runs.
CASES = [
    pytest.param("cpu", torch.float32, "gqa2_top2_nonorm_sharded", {}, 4, id="cpu-fp32"),
    pytest.param("cuda", torch.bfloat16, "kernel_shapes", dict(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=64, experts=8, top_k=2,
                                                              moe_intermediate=128), 16, id="cuda-bf16-kernels", marks=GPU),
]


def generate(runner: ModelRunner, cache: PrefixCache | None, seq_id: str, prompt: list[int]) -> tuple[list[StepOutput], int]:
    """Prefill (reusing cached pages when ``cache`` is given), then greedy decode to the end.
    Returns every step's output and how many prompt tokens came from the cache."""
    ps = runner.cache.layout.page_size
    hits = cache.match(prompt) if cache is not None else []
    if cache is not None:
        cache.acquire(hits, len(prompt))
    new = (cache.alloc if cache is not None else runner.cache.allocator.alloc)(-(-len(prompt) // ps) - len(hits))
    seq = runner.add(seq_id, prompt, PARAMS, page_table=hits + new, num_cached=len(hits) * ps)
    outputs = runner.prefill([seq])
    if cache is not None:  # as the prefill rank: the prompt's pages go back to the cache, the decode goes on in copies
        table = list(seq.page_table)
        decode_pages = runner.cache.allocator.alloc(len(table))
        for pool in runner.cache.pools:
            pool[decode_pages] = pool[table]
        cache.release(prompt, table, len(hits), computed=True)
        seq.page_table = decode_pages
    while not seq.finished:
        outputs += runner.decode([seq])
    runner.release(seq)
    return outputs, len(hits) * ps


@pytest.mark.parametrize(("device", "dtype", "name", "shape", "page"), CASES)
def test_a_prompt_reusing_another_prompts_pages_matches_its_cold_prefill(tiny_checkpoint, device, dtype, name, shape, page):
    path = tiny_checkpoint(name, **shape)
    a_prompt, b_tail = random_prompts([3 * page + 2, 2 * page - 1], seed=11)
    b_prompt = a_prompt[: 2 * page] + b_tail  # shares 2 full pages with a
    warm = ModelRunner.from_dir(path, num_pages=32, page_size=page, dtype=dtype, device=device, release_finished=False)
    cache = PrefixCache(warm.cache.allocator, page)
    _, cached_a = generate(warm, cache, "a", a_prompt)
    steps, cached_b = generate(warm, cache, "b", b_prompt)
    assert (cached_a, cached_b) == (0, 2 * page)

    cold = ModelRunner.from_dir(path, num_pages=32, page_size=page, dtype=dtype, device=device, release_finished=False)
    cold_steps, _ = generate(cold, None, "b", b_prompt)
    tol = 1e-4 if dtype == torch.float32 else 5e-2  # bf16: the runs round differently (other batch shapes)
    # The first token's top 5 and their logprobs (bf16: a near tie may swap one in or out).
    mine, theirs = (dict(zip(s.top_logprobs.token_ids, s.top_logprobs.logprobs)) for s in (steps[0], cold_steps[0]))
    both = sorted(set(mine) & set(theirs))
    assert len(both) >= (5 if dtype == torch.float32 else 4)
    torch.testing.assert_close(torch.tensor([mine[t] for t in both]), torch.tensor([theirs[t] for t in both]), rtol=tol, atol=tol)
    for i, (mine, theirs) in enumerate(zip(steps, cold_steps, strict=True)):
        if mine.token_id != theirs.token_id:  # greedy may part only where the cold run's top two are a near tie
            margin = theirs.top_logprobs.logprobs[0] - theirs.top_logprobs.logprobs[1]
            assert dtype != torch.float32 and margin <= 2 * tol, f"greedy parts at step {i} with a margin of {margin:.3g}"
            break

    # The cache is what made the difference: a prompt sharing no page gets nothing.
    _, cached_c = generate(warm, cache, "c", random_prompts([10], seed=12)[0])
    assert cached_c == 0
