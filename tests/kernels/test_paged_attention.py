"""Paged decode attention (kernels/paged_attention.py), without a GPU.

The fp32 reference equals the model's own paged attention (`shared.model.layers.paged_attention`)
on decode batches: GQA group sizes 1-16, page sizes 4/16/32, uneven lengths (1, page
multiples and not), non-contiguous page ids, padded tables, int32 and int64 indices; a
sequence of length 0 gives zeros; bad arguments are refused naming the tensor. The split
rule fills the GPU from static shapes. The CuTeDSL kernels compile for sm_90a: tensor-core
MMAs (Q @ K^T and P @ V per 16-token tile), 16-byte read-only K/V loads, nothing in local
memory, no NVLink multicast. The model's routing switch is read from the environment.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest
import torch
from cubin_info import kernel_attributes

from kernels import paged_attention as pa
from shared.kvcache import KVLayout, PagedKVCache
from shared.model import layers
from shared.model.model import ForwardBatch, SequenceChunk


def _decode_case(gen: torch.Generator, hq: int, hkv: int, d: int, page: int, lens: list[int], num_pages: int = 64):
    """A one-layer cache with random K/V (fp32), each sequence's pages drawn at random from the pool,
    the decode batch's metadata built the way the model builds it, and random queries."""
    cache = PagedKVCache(KVLayout(1, num_pages, hkv, page, d, torch.float32))
    cache.pools[0].copy_(torch.randn(cache.pools[0].shape, generator=gen))
    order = torch.randperm(num_pages, generator=gen).tolist()
    chunks = []
    for n in lens:
        need = -(-n // page)
        table, order = order[:need], order[need:]
        chunks.append(SequenceChunk([1], n - 1, table))
    meta = ForwardBatch.build(chunks, page, torch.device("cpu")).attn
    q = torch.randn(len(lens), hq, d, generator=gen)
    return cache, meta, q


@pytest.mark.parametrize("hq,hkv,d,page,lens", [
    (8, 2, 64, 4, [1, 5, 16, 33, 2]),
    (32, 4, 128, 16, [1, 17, 64, 100]),
    (16, 1, 64, 32, [31, 32, 95]),
    (4, 4, 64, 16, [7, 48]),
])
def test_reference_equals_the_models_paged_attention(hq, hkv, d, page, lens):
    cache, meta, q = _decode_case(torch.Generator().manual_seed(hq + page), hq, hkv, d, page, lens)
    assert meta.max_q == 1
    expect = layers.paged_attention(q, cache, 0, meta, d**-0.5)
    got = pa.paged_decode_attention_reference(q, cache.pools[0], meta.page_tables, meta.context_lens, d**-0.5)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)
    # int32 indices read the same keys; the public function on CPU is the reference.
    got32 = pa.paged_decode_attention(q, cache.pools[0], meta.page_tables.int(), meta.context_lens.int(), d**-0.5)
    torch.testing.assert_close(got32, expect, rtol=1e-5, atol=1e-5)


def test_reference_is_a_softmax_over_each_sequences_own_tokens():
    """Against PagedKVCache.read per sequence: only tokens 0..len-1 of the sequence's own pages count."""
    gen = torch.Generator().manual_seed(1)
    cache, meta, q = _decode_case(gen, 6, 3, 64, 4, [3, 9, 1])
    got = pa.paged_decode_attention_reference(q, cache.pools[0], meta.page_tables, meta.context_lens, 0.2)
    for b, n in enumerate(meta.context_lens.tolist()):
        k, v = cache.read(0, meta.page_tables[b], n)  # [Hkv, n, D]
        k, v = k.repeat_interleave(2, dim=0), v.repeat_interleave(2, dim=0)
        probs = torch.softmax(torch.einsum("hd,hld->hl", q[b], k) * 0.2, dim=-1)
        torch.testing.assert_close(got[b], torch.einsum("hl,hld->hd", probs, v), rtol=1e-5, atol=1e-5)


def test_length_zero_gives_zeros_and_bf16_keeps_its_dtype():
    cache, meta, q = _decode_case(torch.Generator().manual_seed(2), 4, 2, 64, 16, [5, 20])
    lens = meta.context_lens.clone()
    lens[0] = 0
    got = pa.paged_decode_attention(q.bfloat16(), cache.pools[0].bfloat16(), meta.page_tables, lens, 0.1)
    assert got.dtype == torch.bfloat16 and torch.equal(got[0], torch.zeros_like(got[0])) and got[1].abs().sum() > 0


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(q=a["q"][0]), "q must be"),
    (lambda a: a.update(pool=a["pool"][:, :1]), "pool must be"),
    (lambda a: a.update(q=a["q"][:, :, :32]), "head_dim"),
    (lambda a: a.update(q=a["q"][:, :3]), "multiple of the pool's kv_heads"),
    (lambda a: a.update(q=a["q"].double()), "dtype"),
    (lambda a: a.update(page_tables=a["page_tables"][:1]), "page_tables must be"),
    (lambda a: a.update(page_tables=a["page_tables"].float()), "page_tables must be int32 or int64"),
    (lambda a: a.update(context_lens=a["context_lens"][:, None]), "context_lens must be"),
    (lambda a: a.update(context_lens=a["context_lens"].to(torch.int16)), "context_lens must be int32 or int64"),
])
def test_bad_arguments_are_refused_by_name(change, match):
    cache, meta, q = _decode_case(torch.Generator().manual_seed(3), 4, 2, 64, 16, [5, 20])
    args = dict(q=q, pool=cache.pools[0], page_tables=meta.page_tables, context_lens=meta.context_lens)
    change(args)
    with pytest.raises(pa.PagedAttentionError, match=match):
        pa.paged_decode_attention(args["q"], args["pool"], args["page_tables"], args["context_lens"], 0.1)


def test_kernel_supports_says_why_not():
    assert pa.kernel_supports(32, 4, 128, 16, torch.bfloat16) is None
    assert pa.kernel_supports(64, 4, 128, 16, torch.bfloat16) is None
    assert pa.kernel_supports(4, 2, 64, 4, torch.bfloat16) is None
    assert "bfloat16" in pa.kernel_supports(32, 4, 128, 16, torch.float32)
    assert "per KV head" in pa.kernel_supports(64, 2, 128, 16, torch.bfloat16)
    assert "head_dim" in pa.kernel_supports(32, 4, 96, 16, torch.bfloat16)
    assert "page_size" in pa.kernel_supports(32, 4, 128, 24, torch.bfloat16)


@pytest.mark.parametrize("batch,kv_heads,tiles", [(1, 4, 512), (16, 4, 32), (32, 4, 256), (64, 4, 32), (128, 4, 32),
                                                   (128, 4, 1024), (4, 4, 1)])
def test_splits_fill_the_gpu_without_short_splits(batch, kv_heads, tiles):
    sms = 132
    pairs = batch * kv_heads
    splits = pa.choose_splits(batch, kv_heads, tiles, sms)
    assert splits >= 1
    if splits > 1:
        assert tiles // splits >= pa.MIN_TILES_PER_SPLIT  # no split shorter than the minimum
        assert pairs * splits <= pa.CTAS_PER_SM_TARGET * sms  # never more CTAs than the target
    # one more split would pass the target or be too short
    assert pairs * (splits + 1) > pa.CTAS_PER_SM_TARGET * sms or tiles // (splits + 1) < pa.MIN_TILES_PER_SPLIT
    if (batch, kv_heads) == (16, 4) or batch >= 64:  # the measured optima (see the rule's comment)
        assert splits == (4 if batch == 16 else 1)


def test_model_switch_reads_the_environment(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv(layers.DECODE_ATTENTION_ENV, raising=False)
    assert layers.decode_attention_kernel(32, 4, 128, 16, torch.bfloat16, cuda)
    assert not layers.decode_attention_kernel(32, 4, 128, 16, torch.bfloat16, cpu)
    assert not layers.decode_attention_kernel(32, 4, 96, 16, torch.bfloat16, cuda)
    monkeypatch.setenv(layers.DECODE_ATTENTION_ENV, "sdpa")
    assert not layers.decode_attention_kernel(32, 4, 128, 16, torch.bfloat16, cuda)
    monkeypatch.setenv(layers.DECODE_ATTENTION_ENV, "fast")
    with pytest.raises(ValueError, match="MOEBUS_DECODE_ATTENTION"):
        layers.decode_attention_kernel(32, 4, 128, 16, torch.bfloat16, cuda)


def test_prefill_batch_as_decode_queries_equals_the_models_attention():
    """`layers.queries_as_decode_attention` (on CPU: the kernel's fp32 reference) on a batch a
    prefix-cache hit makes: suffixes of 1-6 queries after cached prefixes (page-aligned and not),
    a fresh 5-token prompt and a decode row, against the model's own causal attention."""
    gen = torch.Generator().manual_seed(21)
    hq, hkv, d, page = 8, 2, 64, 4
    cache = PagedKVCache(KVLayout(1, 40, hkv, page, d, torch.float32))
    cache.pools[0].copy_(torch.randn(cache.pools[0].shape, generator=gen))
    order = torch.randperm(40, generator=gen).tolist()
    chunks = []
    for n, cached in ((3, 8), (6, 13), (1, 20), (5, 0), (2, 1)):
        need = -(-(cached + n) // page)
        chunks.append(SequenceChunk([1] * n, cached, order[:need]))
        order = order[need:]
    meta = ForwardBatch.build(chunks, page, torch.device("cpu")).attn
    q = torch.randn(17, hq, d, generator=gen)
    expect = layers.paged_attention(q, cache, 0, meta, d**-0.5)
    got = layers.queries_as_decode_attention(q, cache, 0, meta, d**-0.5)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)
    # 2 KV heads of 4 query heads: 4 queries of a sequence share a CTA, its last CTA's spare places
    # repeating its last query; query i reads exactly its causal prefix, L - n + i + 1 keys of its own pages.
    assert meta.as_decode is not None and meta.as_decode.rows.shape[1] == 1  # on CPU one query a place
    view = layers.QueriesAsDecode.build(meta, 4)
    assert view.context_lens.tolist() == [[9, 10, 11, 11], [14, 15, 16, 17], [18, 19, 19, 19], [21, 21, 21, 21], [1, 2, 3, 4],
                                          [5, 5, 5, 5], [2, 3, 3, 3]]
    assert view.rows.view(-1)[view.slots].tolist() == list(range(17))
    assert view.context_lens.view(-1)[view.slots].tolist() == [9, 10, 11, 14, 15, 16, 17, 18, 19, 21, 1, 2, 3, 4, 5, 2, 3]
    assert torch.equal(view.page_tables[view.slots // 4], meta.page_tables[meta.token_seq])
    # the packed places through the multi-query attention (on CPU each place alone), results put back by slot
    packed = pa.paged_multi_query_attention(q[view.rows], cache.pools[0], view.page_tables, view.context_lens, d**-0.5)
    torch.testing.assert_close(packed.view(-1, hq, d)[view.slots], expect, rtol=1e-5, atol=1e-5)
    # one query a CTA (16 query heads per KV head): the same contexts, one place each
    single = layers.QueriesAsDecode.build(meta, 1)
    assert single.context_lens.view(-1).tolist() == view.context_lens.view(-1)[view.slots].tolist()
    assert single.slots.tolist() == list(range(17)) and torch.equal(single.page_tables, meta.page_tables[meta.token_seq])


def test_prefill_route_takes_the_decode_kernel_only_for_few_queries_per_sequence(monkeypatch):
    monkeypatch.delenv(layers.DECODE_ATTENTION_ENV, raising=False)
    cuda = torch.device("cuda")
    pool_shape = torch.Size((64, 2, 4, 16, 128))
    cap = layers.AS_DECODE_MAX_QUERIES

    def route(queries_per_seq: int, seqs: int, device: torch.device = cuda, dtype: torch.dtype = torch.bfloat16, cached: int = 64) -> str:
        chunks = [SequenceChunk([1] * queries_per_seq, cached, list(range(8))) for _ in range(seqs)]
        meta = ForwardBatch.build(chunks, 16, torch.device("cpu")).attn
        return layers.prefill_attention_route(meta, 32, pool_shape, dtype, device)

    # 8 sequences: past the decode route one varlen call
    assert route(cap, seqs=8) == "as_decode" and route(2, seqs=8) == "as_decode"
    assert route(cap + 1, seqs=8) == "varlen"
    # fresh prompts (or less cached than new) only up to the smaller cap
    fresh_cap = layers.AS_DECODE_FRESH_MAX_QUERIES
    assert route(fresh_cap, seqs=8, cached=0) == "as_decode" and route(fresh_cap + 1, seqs=8, cached=0) == "varlen"
    assert route(fresh_cap + 1, seqs=8, cached=fresh_cap) == "varlen" and route(fresh_cap + 1, seqs=8, cached=fresh_cap + 1) == "as_decode"
    assert route(cap, seqs=8, dtype=torch.float16) == "varlen"
    # one sequence alone: a flash call past its own cap after a cached context, past the fresh cap without one
    one_cap = layers.AS_DECODE_ONE_SEQUENCE_MAX_QUERIES
    assert route(one_cap, seqs=1) == "as_decode" and route(one_cap + 1, seqs=1) == "per_sequence"
    assert route(fresh_cap, seqs=1, cached=0) == "as_decode" and route(fresh_cap + 1, seqs=1, cached=0) == "per_sequence"
    assert route(100, seqs=1, cached=0) == "per_sequence"
    assert route(fresh_cap + 1, seqs=2) == "as_decode" and route(cap + 1, seqs=2) == "varlen"
    # off CUDA every batch past the decode route runs a sequence at a time
    assert route(2, seqs=8, device=torch.device("cpu")) == "per_sequence"
    monkeypatch.setenv(layers.DECODE_ATTENTION_ENV, "sdpa")
    assert route(2, seqs=8) == "varlen" and route(2, seqs=1) == "per_sequence"


def test_prefill_routes_refuse_what_they_cannot_run_by_name():
    """The varlen flash call runs on CUDA only (off CUDA the route sends every batch a sequence at a time),
    and the per-sequence route needs the batch's host-side lengths."""
    cache, meta, q = _decode_case(torch.Generator().manual_seed(3), 8, 2, 64, 4, [5, 20])
    with pytest.raises(ValueError, match="runs on CUDA"):
        layers.varlen_prefill_attention(q, cache, 0, meta, 0.1)
    meta.host_lens = None
    with pytest.raises(ValueError, match="host_lens"):
        layers.per_sequence_prefill_attention(q, cache, 0, meta, 0.1)


def test_queries_share_a_cta_only_once_one_query_a_cta_fills_the_gpu(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(layers, "sm_count", lambda device: 132)
    target = pa.CTAS_PER_SM_TARGET * 132 // 4  # queries whose CTAs (4 KV heads) reach the target alone
    assert layers.as_decode_queries_per_cta(target, 32, 4, cuda) == 2  # 8 heads a KV head: two queries fill 16 rows
    assert layers.as_decode_queries_per_cta(target - 1, 32, 4, cuda) == 1
    assert layers.as_decode_queries_per_cta(10 * target, 64, 4, cuda) == 1  # 16 heads fill the rows alone
    assert layers.as_decode_queries_per_cta(10 * target, 8, 4, cuda) == 8
    assert layers.as_decode_queries_per_cta(10 * target, 32, 4, torch.device("cpu")) == 1


def test_multi_query_attention_refuses_bad_shapes_by_name():
    cache, meta, q = _decode_case(torch.Generator().manual_seed(5), 4, 2, 64, 16, [5, 20])
    pool, tables = cache.pools[0], meta.page_tables
    with pytest.raises(pa.PagedAttentionError, match="context_lens"):
        pa.paged_multi_query_attention(q[:, None], pool, tables, meta.context_lens, 0.1)  # lens not [batch, n]
    with pytest.raises(pa.PagedAttentionError, match="n >= 1"):
        pa.paged_multi_query_attention(q[:, None][:, :0], pool, tables, meta.context_lens[:, None][:, :0], 0.1)


# --------------------------------------------------------------------------- compilation (sm_90a, no GPU)


# (rows per KV head, queries per CTA): one query of 8 / 16 / 2 heads per KV head, and the packed CTAs of
# paged_multi_query_attention (2 queries of 8 heads, Qwen3-30B's rank; 8 queries of 2 heads, the tiny model's)
@pytest.mark.parametrize("group,queries,head_dim,page,table_bytes", [(8, 1, 128, 16, 8), (16, 1, 128, 16, 4), (2, 1, 64, 4, 8),
                                                                     (16, 2, 128, 16, 8), (16, 8, 64, 4, 8)])
def test_kernels_compile_for_sm90a_with_tensor_core_tiles(group, queries, head_dim, page, table_bytes, tmp_path, monkeypatch):
    from kernels import paged_attention_sm90 as sm90

    monkeypatch.chdir(tmp_path)  # --keep-ptx writes its file into the working directory
    ptx = sm90.compiled_split(group, head_dim, page, table_bytes, 8, queries, options=f"--keep-ptx --keep-cubin --dump-dir={tmp_path}").__ptx__
    assert ".target sm_90a" in ptx and "multimem" not in ptx and ".local" not in ptx
    # One tile: Q @ K^T in 2 n-tiles x head_dim / 16 k-steps, P @ V in head_dim / 8 n-tiles.
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 2 * head_dim // 16 + head_dim // 8
    kv_loads = ptx.count("ld.global.nc.L1::no_allocate.v4.b32")
    q_rows = 2 if group > 8 else 1  # rows grp + 8 hold queries only past 8 heads per KV head
    tile_loads = 2 * head_dim // 32 + 4 * head_dim // 64
    # a warp's first tile before its loop, each next one a tile ahead inside it (the software pipeline)
    assert kv_loads == 2 * tile_loads + q_rows * head_dim // 32
    # Two tiles' K/V words held at once: ptxas (CUDA 12.9 here) spills 24 bytes a thread at 8 query heads per KV head
    # (255 registers), none at 16 (245), as measured faster on an H200 (the module doc); a larger frame is a regression
    (cubin,) = tmp_path.glob("*split*.cubin")
    assert kernel_attributes(cubin)["frame_size"] <= (32 if group == 8 else 0)
    combine = sm90.compiled_combine(group, head_dim, options="--keep-ptx").__ptx__
    assert ".target sm_90a" in combine and "st.global.b16" in combine


def test_prepare_compiles_both_kernels_or_declines():
    from kernels import paged_attention_sm90 as sm90

    assert not pa.prepare_paged_decode_attention(32, 4, 96, 16)
    assert pa.prepare_paged_decode_attention(8, 4, 64, 8)
    assert ("split", 2, 64, 8, 8, 8, 1) in sm90._CACHE and ("combine", 2, 64) in sm90._CACHE
    # and the CTAs of 8 queries (2 query heads per KV head) that paged_multi_query_attention packs
    assert pa.queries_per_cta(8, 4) == 8
    assert ("split", 16, 64, 8, 8, 8, 8) in sm90._CACHE and ("combine", 16, 64) in sm90._CACHE
