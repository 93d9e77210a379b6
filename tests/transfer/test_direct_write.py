"""The direct-write plan (same-host CUDA IPC path): segments that move a shard of a
request's KV from prefill pages into decode pages, checked against an independently
built reference KV read back through the decode cache; on a GPU, both executors
(copy engines, copy kernel) against the plan's torch reference."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from shared.kvcache import KVLayout, PagedKVCache
from shared.transfer.direct_write import DirectWriter, choose_method, plan_segments, reference_write
from shared.transfer.shard import kv_head_shard

LAYERS, HEADS, DIM = 3, 4, 8
SRC_PAGES, DST_PAGES = 90, 60


def _setup(src_page: int, dst_page: int, tp: int, rank: int, tokens: int, contiguous: bool, device: str = "cpu"):
    """A prefill shard cache holding the reference KV, an empty decode cache, and both tables."""
    shard = kv_head_shard(rank, tp, HEADS)
    src = PagedKVCache(KVLayout(LAYERS, SRC_PAGES, shard.num_heads, src_page, DIM, torch.bfloat16), device)
    dst = PagedKVCache(KVLayout(LAYERS, DST_PAGES, HEADS, dst_page, DIM, torch.bfloat16), device)
    ref = torch.randn(LAYERS, 2, HEADS, tokens, DIM, generator=torch.Generator().manual_seed(tokens)).to(torch.bfloat16).to(device)
    rng = random.Random(tokens * 10 + rank)
    n_src, n_dst = src.layout.pages_for(tokens), dst.layout.pages_for(tokens)
    src_table = list(range(5, 5 + n_src)) if contiguous else rng.sample(range(SRC_PAGES), n_src)
    dst_table = list(range(2, 2 + n_dst)) if contiguous else rng.sample(range(DST_PAGES), n_dst)
    pages, offsets = src.slots(torch.tensor(src_table, device=device), torch.arange(tokens, device=device))
    for layer in range(LAYERS):
        src.write(layer, pages, offsets, ref[layer, 0, shard.start : shard.end].transpose(0, 1), ref[layer, 1, shard.start : shard.end].transpose(0, 1))
    plan = plan_segments(
        num_tokens=tokens, head_dim=DIM, itemsize=2, src_page_size=src_page, src_heads=shard.num_heads, src_num_pages=SRC_PAGES,
        src_table=np.array(src_table), dst_page_size=dst_page, dst_heads=HEADS, dst_num_pages=DST_PAGES, dst_table=np.array(dst_table), head_start=shard.start,
    )
    return shard, src, dst, ref, dst_table, plan


def _landed_exactly(dst: PagedKVCache, dst_table: list[int], ref: torch.Tensor, heads: range, tokens: int) -> bool:
    table = torch.tensor(dst_table, device=dst.device)
    return all(torch.equal(torch.stack(dst.read(layer, table, tokens))[:, heads.start : heads.stop], ref[layer, :, heads.start : heads.stop]) for layer in range(LAYERS))


@pytest.mark.parametrize(
    "src_page,dst_page,tp,tokens,contiguous",
    [(16, 16, 1, 100, False), (16, 16, 1, 100, True), (16, 16, 2, 77, False), (32, 16, 1, 200, False), (8, 16, 2, 333, False), (64, 16, 4, 50, True), (24, 16, 1, 99, False)],
)
def test_plan_moves_every_token_of_every_shard_head(src_page, dst_page, tp, tokens, contiguous):
    for rank in range(tp):
        shard, src, dst, ref, dst_table, plan = _setup(src_page, dst_page, tp, rank, tokens, contiguous)
        dst.storage.fill_(float("nan"))  # what the plan does not write stays NaN
        reference_write(plan, range(LAYERS), src.storage, dst.storage)
        assert _landed_exactly(dst, dst_table, ref, range(shard.start, shard.end), tokens)
        others = [h for h in range(HEADS) if not shard.start <= h < shard.end]
        table = torch.tensor(dst_table)
        assert all(torch.stack(dst.read(layer, table, tokens))[:, others].isnan().all() for layer in range(LAYERS))  # other ranks' heads untouched


def test_segments_merge_where_both_sides_are_contiguous():
    page_bytes = 2 * HEADS * 16 * DIM * 2
    _, _, _, _, _, whole = _setup(16, 16, 1, 0, 160, contiguous=True)
    assert whole.num_segments == 1 and whole.bytes_per_layer == 10 * page_bytes  # ten consecutive pages, all heads
    _, _, _, _, _, shard = _setup(16, 16, 2, 0, 160, contiguous=True)
    assert shard.num_segments == 2 * 10 and shard.bytes_per_layer == 10 * page_bytes // 2  # K and V of each page apart
    _, _, _, _, _, mismatch = _setup(32, 16, 1, 0, 160, contiguous=False)
    assert mismatch.num_segments == 10 * 2 * HEADS  # a row per decode page, K/V and head


def test_pieces_cover_the_segments_exactly():
    _, _, _, _, _, plan = _setup(16, 16, 1, 0, 160, contiguous=True)
    pieces = plan.pieces(1000)
    assert pieces[:, 2].max() <= 1000 and pieces[:, 2].sum() == plan.bytes_per_layer
    covered = np.concatenate([np.arange(s, s + n) for s, _, n in pieces])
    expected = np.concatenate([np.arange(s, s + n) for s, n in zip(plan.src_offsets, plan.lengths)])
    assert np.array_equal(covered, expected) and np.array_equal(pieces[:, 1] - pieces[:, 0], np.repeat(plan.dst_offsets - plan.src_offsets, -(-plan.lengths // 1000)))


def test_bad_page_tables_are_refused_before_any_write():
    common = dict(num_tokens=40, head_dim=DIM, itemsize=2, src_page_size=16, src_heads=HEADS, src_num_pages=10, dst_page_size=16, dst_heads=HEADS, dst_num_pages=10, head_start=0)
    with pytest.raises(ValueError, match="decode page table has 2 pages"):
        plan_segments(src_table=np.arange(3), dst_table=np.arange(2), **common)
    with pytest.raises(ValueError, match="source page table names pages outside 0..9"):
        plan_segments(src_table=np.array([0, 1, 10]), dst_table=np.arange(3), **common)
    with pytest.raises(ValueError, match="heads"):
        plan_segments(src_table=np.arange(3), dst_table=np.arange(3), **common | {"head_start": 1})


def test_auto_takes_copy_engines_for_wide_segments_over_many_layers_only():
    _, _, _, _, _, wide = _setup(16, 16, 1, 0, 160, contiguous=False)  # whole pages (2 KiB here)
    big = max(wide.src_layer_bytes, wide.dst_layer_bytes)
    assert choose_method("auto", wide, LAYERS, big) == "kernel"  # 2 KiB rows: below CE_MIN_SEGMENT_BYTES
    _, _, _, _, _, merged = _setup(16, 16, 1, 0, 16 * 50, contiguous=True)  # one 100 KiB segment per layer
    assert choose_method("auto", merged, 94, big * 100) == "copy_engine"
    assert choose_method("auto", merged, 1, big * 100) == "kernel"  # one layer: 100 KiB per call
    assert choose_method("copy_engine", merged, 94, big - 1) == "kernel"  # layer stride above the max pitch
    assert choose_method("kernel", merged, 94, big * 100) == "kernel"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["copy_engine", "kernel"])
@pytest.mark.parametrize("src_page,tp,contiguous", [(16, 1, False), (16, 1, True), (16, 2, False), (32, 1, False), (8, 4, False)])
def test_executors_write_what_the_reference_writes(method, src_page, tp, contiguous):
    for rank in range(tp):
        shard, src, dst, ref, dst_table, plan = _setup(src_page, 16, tp, rank, 301, contiguous, device="cuda")
        dst.storage.fill_(float("nan"))
        writer = DirectWriter(plan, src.storage, dst.storage, method)
        stream = torch.cuda.Stream()
        assert writer.write(range(1, LAYERS), stream) == method  # layers 1.. in one group, then layer 0
        assert writer.write(range(0, 1), stream) == method
        stream.synchronize()
        expected = torch.full_like(dst.storage, float("nan"))
        reference_write(plan, range(LAYERS), src.storage, expected)
        assert torch.equal(dst.storage.view(torch.int16), expected.view(torch.int16))
        assert _landed_exactly(dst, dst_table, ref, range(shard.start, shard.end), 301)
