"""Direct writes (same-host CUDA IPC path). On CPU: the row shapes the kernel copies are
contiguous on both sides and cover every K/V head once, bad page tables are refused
before any write, and the writer (through ``kernels.kv_copy``'s torch reference) writes
what the UCX path's pack + scatter writes. On a GPU: the CuTeDSL kernel writes exactly
what pack + scatter writes, for every page-size / shard combination, and nothing else; the
write issuer enqueues writes behind unfinished compute without the host waiting for it,
and they land once that compute is done."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import torch

from shared.kvcache import KVLayout, PagedKVCache
from shared.transfer import direct_write
from shared.transfer.direct_write import DirectWriter, WriteIssuer, row_shape
from shared.transfer.shard import chunk_view, kv_head_shard, pack_layers, scatter_layers

LAYERS, HEADS, DIM = 3, 4, 8
SHAPES = [(16, 16, 4), (16, 16, 2), (16, 16, 1), (32, 16, 4), (8, 16, 2), (24, 16, 4), (64, 16, 1)]  # src page, dst page, shard heads


@pytest.mark.parametrize("src_page,dst_page,heads", SHAPES)
def test_rows_are_contiguous_on_both_sides_and_cover_every_head_once(src_page, dst_page, heads):
    block, rows, heads_per_row = row_shape(src_page, dst_page, heads, HEADS)
    assert src_page % block == 0 and dst_page % block == 0 and rows * heads_per_row == 2 * heads
    src = torch.empty(2, 5, 2, heads, src_page, DIM)  # [layers, pages, K/V, heads, page, dim]
    dst = torch.empty(2, 5, 2, HEADS, dst_page, DIM)
    for r in range(rows):
        first = r * heads_per_row  # K/V-major (kv, head) index of the row's first head
        kv, h = divmod(first, heads)
        span = range(first, first + heads_per_row)
        assert all(divmod(x, heads)[0] == kv for x in span) or heads_per_row == 2 * heads
        for side, t, page in (("src", src, src_page), ("dst", dst, dst_page)):
            offset = page - block  # the last block of a page
            if heads_per_row == 2 * heads:
                view = t[1, 3, :, :heads, offset : offset + block]
            else:
                view = t[1, 3, kv, h : h + heads_per_row, offset : offset + block]
            assert view.is_contiguous(), (side, r)


def test_bad_page_tables_are_refused_before_any_write():
    src = torch.zeros(LAYERS, 10, 2, 2, 16, DIM, dtype=torch.bfloat16)
    dst = torch.zeros(LAYERS, 10, 2, HEADS, 16, DIM, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="destination page table must list at least 3 integer page ids"):
        DirectWriter(src, np.arange(3), dst, np.arange(2), head_start=0, num_tokens=40)
    with pytest.raises(ValueError, match="source page table names pages outside 0..9"):
        DirectWriter(src, np.array([0, 1, 10]), dst, np.arange(3), head_start=0, num_tokens=40)
    with pytest.raises(ValueError, match="heads"):
        DirectWriter(src, np.arange(3), dst, np.arange(3), head_start=3, num_tokens=40)
    with pytest.raises(ValueError, match="float32"):
        DirectWriter(src, np.arange(3), dst.float(), np.arange(3), head_start=0, num_tokens=40)
    assert DirectWriter(src, np.arange(3), dst, np.array([9, 0, 4]), head_start=2, num_tokens=40).bytes_per_layer == 2 * 2 * 48 * DIM * 2


def test_storage_checks_are_kept_per_storage_pair():
    """A writer's storage checks and row shape are kept per (local storage, decode storage, head
    start) tensors; another decode storage (a decode rank's new export) gets its own, from its
    own shape, and a storage that died is never matched by the one that took its id."""
    src = torch.zeros(LAYERS, 10, 2, 2, 16, DIM, dtype=torch.bfloat16)
    dst = torch.zeros(LAYERS, 10, 2, HEADS, 16, DIM, dtype=torch.bfloat16)
    route = direct_write._route(src, dst, 2, None)
    assert direct_write._route(src, dst, 2, None) is route and direct_write._route(src, dst, 0, None) is not route
    assert route.rows.block == 16 and route.src() is src and route.dst() is dst
    other = torch.zeros(LAYERS, 7, 2, HEADS, 32, DIM, dtype=torch.bfloat16)
    assert direct_write._route(src, other, 2, None).rows.block == 16 and direct_write._route(src, other, 2, None).rows.rows == 2 * 2  # one head per row
    del dst
    for _ in range(20):  # new tensors, some of which may take the dead one's id
        dst = torch.zeros(LAYERS, 5, 2, HEADS, 8, DIM, dtype=torch.bfloat16)
        assert direct_write._route(src, dst, 2, None).rows.block == 8
    with pytest.raises(ValueError, match="direct write of 0 tokens"):
        DirectWriter(src, np.arange(3), dst, np.arange(3), head_start=0, num_tokens=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_routes_are_kept_per_write_stream():
    """A route's parameter slots are reused in its stream's order: writes on another stream get
    their own route, the same stream (the current one when none is given) the kept one."""
    src = torch.zeros(LAYERS, 10, 2, 2, 16, DIM, dtype=torch.bfloat16, device="cuda")
    dst = torch.zeros(LAYERS, 10, 2, HEADS, 16, DIM, dtype=torch.bfloat16, device="cuda")
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    route = direct_write._route(src, dst, 2, first)
    assert route.stream is first and direct_write._route(src, dst, 2, first) is route
    assert direct_write._route(src, dst, 2, second) is not route and direct_write._route(src, dst, 2, second).stream is second
    with torch.cuda.stream(first):
        assert direct_write._route(src, dst, 2, None) is route


def test_issuer_enqueues_a_report_of_every_layer_in_one_write_and_nothing_twice():
    """``mark_all_layers_done``'s report (every layer, none enqueued before) is one write of all
    layers; later reports of any layer enqueue nothing. Reports that split the layers write each
    layer once, in runs of consecutive layers, and complete the transfer only with the last
    missing layer. On CPU the writer's reference copies at once: the data is there on return."""
    layers, tokens = 5, 40
    src = PagedKVCache(KVLayout(layers, 8, HEADS, 16, DIM, torch.bfloat16), "cpu")
    src.storage.copy_(torch.randn(src.storage.shape))
    src_table, dst_table = [5, 1, 3], [2, 6, 0]

    def issuer_into(dst: PagedKVCache) -> WriteIssuer:
        dst.storage.fill_(float("nan"))
        writer = DirectWriter(src.storage, src_table, dst.storage, dst_table, head_start=0, num_tokens=tokens)
        return WriteIssuer(writer, None, time.monotonic() + 60)

    def landed(dst: PagedKVCache, layer: int) -> bool:
        return torch.equal(torch.stack(dst.read(layer, torch.tensor(dst_table), tokens)), torch.stack(src.read(layer, torch.tensor(src_table), tokens)))

    dst = PagedKVCache(KVLayout(layers, 8, HEADS, 16, DIM, torch.bfloat16), "cpu")
    issuer = issuer_into(dst)
    issuer.issue(range(layers), None)
    assert issuer.error is None and issuer.complete and issuer.groups == [range(layers)]
    assert all(landed(dst, layer) for layer in range(layers))
    dst.storage.fill_(float("nan"))
    issuer.issue((2,), None)
    issuer.issue(range(layers), None)
    assert issuer.groups == [range(layers)] and dst.storage.isnan().all(), "a layer was written twice"

    split = issuer_into(dst)
    split.issue((1,), None)
    split.issue([4, 3, 1], None)
    assert not split.complete and split.groups == [range(1, 2), range(3, 5)]
    assert landed(dst, 3) and not landed(dst, 0) and not landed(dst, 2)
    split.issue(range(layers), None)  # every layer reported: only the missing ones are written
    assert split.complete and split.groups == [range(1, 2), range(3, 5), range(0, 1), range(2, 3)]
    assert all(landed(dst, layer) for layer in range(layers))
    split.close()
    split.issue(range(layers), None)
    assert len(split.groups) == 4


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src_page,dst_page,heads", SHAPES)
@pytest.mark.parametrize("tokens", [1, 301])
def test_writer_writes_what_pack_and_scatter_write(device, src_page, dst_page, heads, tokens):
    tp = HEADS // heads
    for rank in range(tp):
        shard = kv_head_shard(rank, tp, HEADS)
        src = PagedKVCache(KVLayout(LAYERS, 90, heads, src_page, DIM, torch.bfloat16), device)
        dst = PagedKVCache(KVLayout(LAYERS, 60, HEADS, dst_page, DIM, torch.bfloat16), device)
        expected = PagedKVCache(dst.layout, device)
        src.storage.copy_(torch.randn(src.storage.shape, device=device))
        rng = random.Random(tokens + rank)
        src_table = rng.sample(range(90), src.layout.pages_for(tokens))
        dst_table = rng.sample(range(60), dst.layout.pages_for(tokens))
        chunk = chunk_view(torch.empty(LAYERS * 2 * heads * tokens * DIM * 2, dtype=torch.uint8, device=device), LAYERS, heads, tokens, DIM, torch.bfloat16)
        pack_layers(src, range(LAYERS), torch.tensor(src_table, device=device), tokens, chunk)
        dst.storage.fill_(float("nan"))
        expected.storage.fill_(float("nan"))
        scatter_layers(expected, range(LAYERS), range(shard.start, shard.end), torch.tensor(dst_table, device=device), tokens, chunk)
        stream = torch.cuda.Stream() if device == "cuda" else None
        writer = DirectWriter(src.storage, np.array(src_table), dst.storage, np.array(dst_table), head_start=shard.start, num_tokens=tokens, stream=stream)
        if stream is not None:
            assert writer.rows.vector_bytes == 16  # DIM 8 bf16: one 16-byte vector per token of a head
        writer.write(range(1, LAYERS))  # two groups, the later layers first
        writer.write(range(0, 1))
        if stream is not None:
            stream.synchronize()
        table = torch.tensor(dst_table, device=device)
        for layer in range(LAYERS):
            got, want = torch.stack(dst.read(layer, table, tokens)), torch.stack(expected.read(layer, table, tokens))
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (rank, layer)
        others = torch.ones(HEADS, dtype=torch.bool)
        others[shard.start : shard.end] = False
        assert dst.storage[:, :, :, others].isnan().all()  # other ranks' heads untouched
        unused = torch.ones(60, dtype=torch.bool)
        unused[table] = False
        assert dst.storage[:, unused].isnan().all()  # other requests' pages untouched


@pytest.mark.parametrize("device", DEVICES)
def test_writers_follow_the_decode_storage_they_are_given(device):
    """A sender process writes into one decode storage after another (a decode rank restarted
    and exported new storage; the kernel's fixed launch parameters are kept per pool pair):
    each writer lands in its own storage only, also in one allocated where a freed one was."""
    tokens = 40
    src = PagedKVCache(KVLayout(LAYERS, 8, HEADS, 16, DIM, torch.bfloat16), device)
    src.storage.copy_(torch.randn(src.storage.shape, device=device))
    src_table, dst_table = [5, 1, 3], [2, 6, 0]

    def write_into(dst: PagedKVCache) -> None:
        dst.storage.fill_(float("nan"))
        stream = torch.cuda.Stream() if device == "cuda" else None
        DirectWriter(src.storage, np.array(src_table), dst.storage, np.array(dst_table), head_start=0, num_tokens=tokens, stream=stream).write(range(LAYERS))
        if stream is not None:
            stream.synchronize()

    def holds_src(dst: PagedKVCache) -> bool:
        return all(torch.equal(torch.stack(dst.read(layer, torch.tensor(dst_table, device=device), tokens)),
                               torch.stack(src.read(layer, torch.tensor(src_table, device=device), tokens))) for layer in range(LAYERS))

    first, second = (PagedKVCache(KVLayout(LAYERS, 8, HEADS, 16, DIM, torch.bfloat16), device) for _ in range(2))
    write_into(first)
    write_into(second)
    assert holds_src(first) and holds_src(second)
    second.storage.fill_(0.0)
    write_into(first)
    assert holds_src(first) and not second.storage.any(), "a write meant for the first storage reached the second"
    del first
    third = PagedKVCache(KVLayout(LAYERS, 8, HEADS, 16, DIM, torch.bfloat16), device)  # on CUDA: likely where the first was
    second.storage.fill_(0.0)
    write_into(third)
    assert holds_src(third) and not second.storage.any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_issuer_enqueues_writes_behind_compute_without_waiting_for_it():
    tokens, layers = 301, 6
    src = PagedKVCache(KVLayout(layers, 30, HEADS, 16, DIM, torch.bfloat16), "cuda")
    dst = PagedKVCache(KVLayout(layers, 30, HEADS, 16, DIM, torch.bfloat16), "cuda")
    src.storage.copy_(torch.randn(src.storage.shape, device="cuda"))
    dst.storage.fill_(float("nan"))
    src_table, dst_table = random.Random(3).sample(range(30), 19), random.Random(4).sample(range(30), 19)
    stream = torch.cuda.Stream()
    writer = DirectWriter(src.storage, np.array(src_table), dst.storage, np.array(dst_table), head_start=0, num_tokens=tokens, stream=stream,
                          deadline_unix=time.time() + 60)
    issuer = WriteIssuer(writer, stream, time.monotonic() + 60)
    torch.cuda._sleep(int(0.5 * 2e9))  # the "compute" of the layers (~0.5 s) on the current stream
    computed = torch.cuda.Event()
    computed.record()
    started = time.perf_counter()
    issuer.issue(range(2), computed)
    issuer.issue([5, 2, 3, 4], computed)
    issuer.issue(range(layers), computed)  # every layer enqueued already: nothing more
    assert time.perf_counter() - started < 0.2, "the issuer waited for the compute"
    assert issuer.error is None and issuer.complete and issuer.groups == [range(0, 2), range(2, 6)]
    assert not issuer.writes_done.query(), "a write ran before its compute"
    issuer.landing[0].synchronize()
    assert issuer.writes_done.query() and not writer.skipped
    table = torch.tensor(src_table, device="cuda"), torch.tensor(dst_table, device="cuda")
    for layer in range(layers):
        assert torch.equal(torch.stack(dst.read(layer, table[1], tokens)), torch.stack(src.read(layer, table[0], tokens))), layer
    done = issuer.writes_done
    assert issuer.close(ran=True) is None and issuer.close() is None  # seen complete: the event went back, never handed out again
    from shared.transfer import streams
    assert streams._spare_events[writer.device][-1] is done


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("reporting_stream", ["default", "another"])
def test_reports_without_an_event_wait_for_the_reporting_stream(reporting_stream):
    """A report without a CUDA event marks the reporting thread's current stream (the default
    one, or another entered with ``torch.cuda.stream``: ``streams.current_stream`` keeps one
    object per stream handle) with the issuer's own event: the writes wait for the KV enqueued
    there before the report (here behind ~0.3 s of GPU sleep) and copy it, not what the pages
    held before; closing the issuer gives its event back for the next transfer."""
    from shared.transfer import streams

    tokens, layers = 304, 4
    src = PagedKVCache(KVLayout(layers, 30, HEADS, 16, DIM, torch.bfloat16), "cuda")
    dst = PagedKVCache(KVLayout(layers, 30, HEADS, 16, DIM, torch.bfloat16), "cuda")
    dst.storage.fill_(float("nan"))
    src_table, dst_table = random.Random(5).sample(range(30), 19), random.Random(6).sample(range(30), 19)
    stream = torch.cuda.Stream()
    writer = DirectWriter(src.storage, np.array(src_table), dst.storage, np.array(dst_table), head_start=0, num_tokens=tokens, stream=stream)
    issuer = WriteIssuer(writer, stream, time.monotonic() + 60)
    kv = torch.randn(src.storage.shape, device="cuda").to(torch.bfloat16)
    reporting = torch.cuda.current_stream() if reporting_stream == "default" else torch.cuda.Stream()
    reporting.wait_stream(torch.cuda.current_stream())  # kv is made
    with torch.cuda.stream(reporting):
        assert streams.current_stream(0).cuda_stream == reporting.cuda_stream
        torch.cuda._sleep(int(0.3 * 2e9))  # the forward, then its KV, on the current stream
        src.storage.copy_(kv)
        started = time.perf_counter()
        issuer.issue(range(layers), None)
        assert time.perf_counter() - started < 0.2, "the issuer waited for the compute"
    assert streams.current_stream(0).cuda_stream == torch.cuda.current_stream(0).cuda_stream
    assert issuer.error is None and issuer.complete and not issuer.writes_done.query()
    issuer.landing[0].synchronize()
    table = torch.tensor(src_table, device="cuda"), torch.tensor(dst_table, device="cuda")
    for layer in range(layers):
        assert torch.equal(torch.stack(dst.read(layer, table[1], tokens)), torch.stack(src.read(layer, table[0], tokens))), layer
    mark = issuer._mark
    issuer.close()
    assert streams._spare_events[writer.device][-1] is mark
    assert streams.take_event(writer.device) is mark
