"""GPU: the paged decode attention kernel (kernels/paged_attention_sm90.py) against the fp32 reference.

Fresh random inputs per case: 4/8/16 query heads per KV head (and 2 with head_dim 64 and
pages of 4, the tiny test model's shape), uneven lengths including 1 and lengths that are
no multiple of the page size, page ids drawn at random over the pool, batch 1 and 128,
contexts past 8k, int32 and int64 indices, one split and several. The output is poisoned
(NaN) before each launch so that every element must be written; slots past each
sequence's length hold large finite values, which must not leak into the result. A CUDA
graph captured once reads lengths and page ids on the GPU: replayed after they changed in
place, it matches the reference of the new ones. The model's routing: `paged_attention_sdpa`
on a decode batch runs the kernel and agrees with its gather + SDPA path.
"""

from __future__ import annotations

import pytest
import torch

from kernels import paged_attention as pa

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REL_TOL = 1e-2  # bf16 inputs and output, probabilities rounded to bf16 before P @ V (as flash kernels do)


def _case(gen: torch.Generator, batch: int, hq: int, hkv: int, d: int, page: int, lens: list[int], index=torch.int64, spare: int = 3):
    """A bf16 pool on the GPU with every sequence's pages at random ids, tails past each length poisoned
    with large finite values, tables padded with valid ids, random queries."""
    pages = [-(-n // page) for n in lens]
    width = max(pages) + spare
    num_pages = sum(pages) + 8
    pool = torch.randn((num_pages, 2, hkv, page, d), generator=gen).to(torch.bfloat16)
    order = torch.randperm(num_pages, generator=gen)
    tables = torch.randint(0, num_pages, (batch, width), generator=gen)  # padding: any valid id
    at = 0
    for b, (n, p) in enumerate(zip(lens, pages)):
        tables[b, :p] = order[at:at + p]
        at += p
        tail = n % page
        if tail:
            pool[tables[b, p - 1], :, :, tail:] = 3.0e4  # past the length: must get weight 0
    q = torch.randn((batch, hq, d), generator=gen).to(torch.bfloat16)
    dev = torch.device("cuda")
    return q.to(dev), pool.to(dev), tables.to(dev, index), torch.tensor(lens, dtype=index, device=dev)


def _check(q, pool, tables, lens, scale):
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=q.device)
    pa.paged_decode_attention(q, pool, tables, lens, scale, out=out)
    ref = pa.paged_decode_attention_reference(q, pool, tables, lens, scale)
    torch.cuda.synchronize()
    assert not out.isnan().any(), "elements left unwritten (NaN poison) or NaN results"
    err = (out.float() - ref).norm() / ref.norm()
    max_abs = (out.float() - ref).abs().max().item()
    print(f"  B={q.shape[0]} Hq={q.shape[1]} Hkv={pool.shape[2]} D={q.shape[2]} page={pool.shape[3]} "
          f"max_len={int(lens.max())} rel_err={err.item():.2e} max_abs={max_abs:.2e}")
    assert err < REL_TOL and max_abs < 0.05 * ref.abs().max().item()
    return out


def _splits(q, pool, tables) -> int:
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    return pa.choose_splits(q.shape[0], pool.shape[2], tables.shape[1] * pool.shape[3] // pa.TILE, sms)


@pytest.mark.parametrize("hq,hkv,d,page", [(16, 4, 128, 16), (32, 4, 128, 16), (64, 4, 128, 16), (4, 2, 64, 4), (32, 4, 128, 32)])
def test_kernel_matches_reference_on_uneven_batches(hq, hkv, d, page):
    gen = torch.Generator().manual_seed(hq * 7 + page)
    lens = [1, page - 1, page, page + 1, 2 * page + 5, 100, 333, 1000] * 2
    q, pool, tables, lens_t = _case(gen, len(lens), hq, hkv, d, page, lens)
    _check(q, pool, tables, lens_t, d**-0.5)


@pytest.mark.parametrize("index", [torch.int32, torch.int64])
def test_batch_128_one_split_and_batch_1_many(index):
    gen = torch.Generator().manual_seed(11)
    lens = torch.randint(1, 480, (128,), generator=gen).tolist()
    q, pool, tables, lens_t = _case(gen, 128, 32, 4, 128, 16, lens, index, spare=0)
    assert _splits(q, pool, tables) == 1
    _check(q, pool, tables, lens_t, 0.088)
    q, pool, tables, lens_t = _case(gen, 1, 64, 4, 128, 16, [9000], index)
    assert _splits(q, pool, tables) > 8
    _check(q, pool, tables, lens_t, 0.088)


def test_long_contexts_split_and_combine():
    gen = torch.Generator().manual_seed(12)
    lens = [8192, 8193, 12000, 17, 16384, 1, 9999, 4096]
    q, pool, tables, lens_t = _case(gen, len(lens), 32, 4, 128, 16, lens)
    assert _splits(q, pool, tables) > 1
    _check(q, pool, tables, lens_t, 128**-0.5)


def test_graph_replay_reads_lengths_and_pages_on_the_gpu():
    gen = torch.Generator().manual_seed(13)
    lens = [40, 700, 3, 2000]
    q, pool, tables, lens_t = _case(gen, 4, 32, 4, 128, 16, lens)
    out = torch.empty_like(q)
    pa.paged_decode_attention(q, pool, tables, lens_t, 0.1, out=out)  # compile and load outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        pa.paged_decode_attention(q, pool, tables, lens_t, 0.1, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    for step in range(3):
        lens_t.add_(1 + 37 * step)
        tables.copy_(tables[torch.randperm(4, generator=gen)].roll(1, dims=1))  # new page order per sequence
        q.copy_(torch.randn(q.shape, generator=gen))
        pool.copy_(torch.randn(pool.shape, generator=gen))  # no poisoned tails: tables moved between sequences
        out.fill_(float("nan"))
        graph.replay()
        ref = pa.paged_decode_attention_reference(q, pool, tables, lens_t, 0.1)
        torch.cuda.synchronize()
        assert not out.isnan().any()
        assert (out.float() - ref).norm() / ref.norm() < REL_TOL


def test_model_routes_decode_batches_through_the_kernel(monkeypatch):
    from shared.kvcache import KVLayout, PagedKVCache
    from shared.model import layers
    from shared.model.model import ForwardBatch, SequenceChunk

    gen = torch.Generator().manual_seed(14)
    dev = torch.device("cuda")
    cache = PagedKVCache(KVLayout(2, 96, 4, 16, 128, torch.bfloat16), dev)
    cache.storage.copy_(torch.randn(cache.storage.shape, generator=gen).to(torch.bfloat16))
    ids = torch.randperm(96, generator=gen).tolist()
    chunks = [SequenceChunk([1], 40, ids[:3]), SequenceChunk([2], 700, ids[3:48]), SequenceChunk([3], 0, ids[48:49])]
    meta = ForwardBatch.build(chunks, 16, dev).attn
    q = torch.randn((3, 32, 128), generator=gen).to(dev, torch.bfloat16)
    calls = []
    monkeypatch.setattr(layers, "paged_decode_attention", lambda *a, **k: calls.append(1) or pa.paged_decode_attention(*a, **k))
    monkeypatch.delenv(layers.DECODE_ATTENTION_ENV, raising=False)
    got = layers.paged_attention_sdpa(q, cache, 1, meta, 128**-0.5)
    monkeypatch.setenv(layers.DECODE_ATTENTION_ENV, "sdpa")
    sdpa = layers.paged_attention_sdpa(q, cache, 1, meta, 128**-0.5)
    assert calls == [1]
    torch.testing.assert_close(got.float(), sdpa.float(), rtol=2.0**-6, atol=2.0**-6)


def test_prefill_attention_after_a_cached_prefix_matches_the_reference_and_needs_no_mask_memory():
    """`paged_attention_sdpa` on prefill chunks (one after 600 cached tokens, one fresh prompt, one
    decode row in the same batch) at Qwen3-235B's per-KV-head grouping (8 query heads per KV head
    here, 16 in the model), against the fp32 reference; then a 16k-token prompt whose attention
    takes a few copies of its queries and its K/V gather, not a [g * n, L] mask (2 GiB as bools)."""
    from shared.kvcache import KVLayout, PagedKVCache
    from shared.model import layers
    from shared.model.model import ForwardBatch, SequenceChunk

    gen = torch.Generator().manual_seed(15)
    dev = torch.device("cuda")
    page, hq, hkv, d = 16, 32, 4, 128
    cache = PagedKVCache(KVLayout(1, 200, hkv, page, d, torch.bfloat16), dev)
    cache.storage.copy_(torch.randn(cache.storage.shape, generator=gen).to(torch.bfloat16))
    ids = torch.randperm(200, generator=gen).tolist()
    chunks = [SequenceChunk([1] * 900, 600, ids[:94]), SequenceChunk([2] * 700, 0, ids[94:138]), SequenceChunk([3], 50, ids[138:142])]
    meta = ForwardBatch.build(chunks, page, dev).attn
    q = torch.randn((1601, hq, d), generator=gen).to(dev, torch.bfloat16)
    got = layers.paged_attention_sdpa(q, cache, 0, meta, d**-0.5).float()
    want = layers.paged_attention(q, cache, 0, meta, d**-0.5).float()
    torch.testing.assert_close(got, want, rtol=2.0**-6, atol=2.0**-6)

    n = 16384
    big = PagedKVCache(KVLayout(1, n // page, hkv, page, d, torch.bfloat16), dev)
    meta = ForwardBatch.build([SequenceChunk([0] * n, 0, list(range(n // page)))], page, dev).attn
    q = torch.randn((n, hq, d), device=dev, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = layers.paged_attention_sdpa(q, big, 0, meta, d**-0.5)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    kv_gather = 2 * hkv * n * d * 2
    assert torch.isfinite(out.float()).all()
    assert extra < 4 * out.numel() * 2 + 4 * kv_gather, f"prefill attention took {extra / 2**20:.0f} MiB beyond its inputs"


def test_prefill_attention_of_many_short_prompts_after_a_shared_cached_prefix():
    """The batch a prefix-cache hit makes: 24 prompts of 1 to 40 new tokens after the same 96
    cached tokens (their 6 pages shared by all), next to a fresh 50-token prompt, at Qwen3-30B's
    per-rank heads: one variable-length call against the fp32 reference of every sequence; then
    a fresh prompt alone (the per-sequence route: FlashAttention-2's batched kernel)."""
    from shared.kvcache import KVLayout, PagedKVCache
    from shared.model import layers
    from shared.model.model import ForwardBatch, SequenceChunk

    gen = torch.Generator().manual_seed(16)
    dev = torch.device("cuda")
    page, hq, hkv, d, cached = 16, 32, 4, 128, 96
    cache = PagedKVCache(KVLayout(1, 120, hkv, page, d, torch.bfloat16), dev)
    cache.storage.copy_(torch.randn(cache.storage.shape, generator=gen).to(torch.bfloat16))
    ids = torch.randperm(120, generator=gen).tolist()
    prefix, free = ids[: cached // page], ids[cached // page :]
    chunks = []
    for n in [1 + (7 * i) % 40 for i in range(24)]:
        own = -(-(cached + n) // page) - len(prefix)
        chunks.append(SequenceChunk([1] * n, cached, prefix + free[:own]))
        free = free[own:]
    chunks.append(SequenceChunk([2] * 50, 0, free[:4]))
    meta = ForwardBatch.build(chunks, page, dev).attn
    q = torch.randn((sum(len(c.token_ids) for c in chunks), hq, d), generator=gen).to(dev, torch.bfloat16)
    got = layers.paged_attention_sdpa(q, cache, 0, meta, d**-0.5).float()
    want = layers.paged_attention(q, cache, 0, meta, d**-0.5).float()
    torch.testing.assert_close(got, want, rtol=2.0**-6, atol=2.0**-6)

    assert meta.prefill_route == "varlen"
    # One fresh prompt alone: the per-sequence route instead of the varlen call, the same attention.
    meta = ForwardBatch.build([SequenceChunk([3] * 300, 0, free[4:23])], page, dev).attn
    q = torch.randn((300, hq, d), generator=gen).to(dev, torch.bfloat16)
    got = layers.paged_attention_sdpa(q, cache, 0, meta, d**-0.5).float()
    assert meta.prefill_route == "per_sequence"
    want = layers.paged_attention(q, cache, 0, meta, d**-0.5).float()
    torch.testing.assert_close(got, want, rtol=2.0**-6, atol=2.0**-6)


@pytest.mark.parametrize("hq", [32, 64])
def test_one_sequence_after_a_long_context_runs_a_flash_call(hq):
    """One sequence past the decode route's cap for it, after a long cached context (Qwen3-30B's / 235B's
    heads per rank): 200 new tokens after 4000 cached, 40 after 3000, 24 fresh; the route runs a flash call per
    sequence, against the fp32 reference and the varlen call. Two sequences (70 after 3000, 49 fresh)
    and four take the varlen call, whose result the per-sequence call must match there too."""
    from shared.kvcache import KVLayout, PagedKVCache
    from shared.model import layers
    from shared.model.model import ForwardBatch, SequenceChunk

    gen = torch.Generator().manual_seed(23 + hq)
    dev = torch.device("cuda")
    page, hkv, d = 16, 4, 128
    cache = PagedKVCache(KVLayout(1, 800, hkv, page, d, torch.bfloat16), dev)
    cache.storage.copy_(torch.randn(cache.storage.shape, generator=gen).to(torch.bfloat16))
    for lens, route in (([(200, 4000)], "per_sequence"), ([(40, 3000)], "per_sequence"), ([(24, 0)], "per_sequence"), ([(70, 3000), (49, 0)], "varlen"),
                        ([(70, 3000), (49, 0), (60, 1000), (50, 800)], "varlen")):
        free = torch.randperm(800, generator=gen).tolist()
        chunks = []
        for n, cached in lens:
            own = -(-(cached + n) // page)
            chunks.append(SequenceChunk([1] * n, cached, free[:own]))
            free = free[own:]
        meta = ForwardBatch.build(chunks, page, dev).attn
        q = torch.randn((meta.token_seq.shape[0], hq, d), generator=gen).to(dev, torch.bfloat16)
        got = layers.paged_attention_sdpa(q, cache, 0, meta, d**-0.5).float()
        assert meta.prefill_route == route, (lens, meta.prefill_route)
        per_sequence = layers.per_sequence_prefill_attention(q, cache, 0, meta, d**-0.5).float()
        want = layers.paged_attention(q, cache, 0, meta, d**-0.5).float()
        torch.testing.assert_close(per_sequence, want, rtol=2.0**-6, atol=2.0**-6)
        torch.testing.assert_close(got, want, rtol=2.0**-6, atol=2.0**-6)
        varlen = layers.varlen_prefill_attention(q, cache, 0, meta, d**-0.5).float()
        torch.testing.assert_close(per_sequence, varlen, rtol=2.0**-6, atol=2.0**-6)


@pytest.mark.parametrize("hq", [32, 64])
def test_prefill_of_short_suffixes_runs_as_decode_queries(hq):
    """A prefix-cache hit's batch, every sequence at most `AS_DECODE_MAX_QUERIES` new tokens (after
    a shared 1000-token prefix, after private prefixes, and fresh), at Qwen3-30B's / 235B's heads
    per rank: `paged_attention_sdpa` takes the decode kernel (each query its own decode row), and
    agrees with the fp32 reference and with the varlen flash call it replaces."""
    from shared.kvcache import KVLayout, PagedKVCache
    from shared.model import layers
    from shared.model.model import ForwardBatch, SequenceChunk

    gen = torch.Generator().manual_seed(17 + hq)
    dev = torch.device("cuda")
    page, hkv, d, shared_len = 16, 4, 128, 1000
    cache = PagedKVCache(KVLayout(1, 300, hkv, page, d, torch.bfloat16), dev)
    cache.storage.copy_(torch.randn(cache.storage.shape, generator=gen).to(torch.bfloat16))
    ids = torch.randperm(300, generator=gen).tolist()
    prefix, free = ids[: shared_len // page], ids[shared_len // page :]  # 62 whole pages, then a partly shared one per sequence
    chunks = []
    cap = layers.AS_DECODE_MAX_QUERIES
    for i, (n, cached) in enumerate([(cap, shared_len), (2, shared_len), (7, shared_len), (cap, 37), (3, 0), (cap, 0), (5, 250)]):
        own = -(-(cached + n) // page) - (len(prefix) if cached == shared_len else 0)
        table = (prefix if cached == shared_len else []) + free[:own]
        free = free[own:]
        chunks.append(SequenceChunk([i] * n, cached, table))
    meta = ForwardBatch.build(chunks, page, dev).attn
    q = torch.randn((sum(len(c.token_ids) for c in chunks), hq, d), generator=gen).to(dev, torch.bfloat16)
    assert layers.prefill_attention_route(meta, hq, cache.pools[0].shape, q.dtype, dev) == "as_decode"
    got = layers.paged_attention_sdpa(q, cache, 0, meta, d**-0.5).float()
    assert meta.as_decode is not None and meta.prefill_keys is None  # the decode route ran, not the varlen call
    assert meta.as_decode.rows.shape[1] == (2 if hq == 32 else 1)  # 113 queries fill the GPU: 30B's pairs share CTAs
    want = layers.paged_attention(q, cache, 0, meta, d**-0.5).float()
    torch.testing.assert_close(got, want, rtol=2.0**-6, atol=2.0**-6)
    varlen = layers.varlen_prefill_attention(q, cache, 0, meta, d**-0.5).float()
    torch.testing.assert_close(got, varlen, rtol=2.0**-6, atol=2.0**-6)


@pytest.mark.parametrize("hq,hkv,d,page", [(32, 4, 128, 16), (16, 4, 128, 16), (64, 4, 128, 16), (8, 4, 64, 4)])
@pytest.mark.parametrize("batch", [3, 96])
def test_ctas_of_several_queries_match_the_reference(hq, hkv, d, page, batch):
    """`paged_multi_query_attention`: each sequence's `queries_per_cta` queries (2 / 4 / 1 / 8 here) in one
    CTA, query j seeing one key more than query j - 1 (a prefill suffix), lengths uneven and past 8k at
    batch 3 (split contexts and their combine) and short at 96 (one split), against the fp32 reference of
    each query alone; the poisoned slots past each sequence's longest context must not leak in."""
    gen = torch.Generator().manual_seed(hq * batch + page)
    n = pa.queries_per_cta(hq, hkv)
    longest = [9000, 1, 37][:batch] if batch == 3 else [1 + (53 * i) % 700 for i in range(batch)]
    q1, pool, tables, lens = _case(gen, batch, hq, hkv, d, page, longest)
    q = torch.randn((batch, n, hq, d), generator=gen).to(q1.device, torch.bfloat16)
    contexts = torch.clamp(lens[:, None] - (n - 1) + torch.arange(n, device=lens.device), min=1)  # nondecreasing, each >= 1
    contexts = torch.minimum(contexts, lens[:, None])
    out = pa.paged_multi_query_attention(q, pool, tables, contexts, d**-0.5)
    ref = pa.paged_decode_attention_reference(q.reshape(batch * n, hq, d), pool, tables.repeat_interleave(n, dim=0),
                                              contexts.reshape(-1), d**-0.5).view(batch, n, hq, d)
    torch.cuda.synchronize()
    err = (out.float() - ref).norm() / ref.norm()
    print(f"  B={batch} n={n} Hq={hq} D={d} page={page} rel_err={err.item():.2e}")
    assert out.shape == (batch, n, hq, d) and torch.isfinite(out.float()).all()
    assert err < REL_TOL and (out.float() - ref).abs().max().item() < 0.05 * ref.abs().max().item()
