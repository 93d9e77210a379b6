"""Transfer pieces that need no second process: shard mapping, pack/scatter, wire structs,
staging budget, and the receiver/sender checks that fire before any byte moves (a real
UCX worker in this process, sending to itself over the self/tcp transports)."""

from __future__ import annotations

import asyncio
import os
import random
import time

import msgspec
import pytest
import torch

from schemas.transfer import KVTransferDescriptor, KVTransferLayout, ShardHeader
from shared.kvcache import KVLayout, OutOfPages, PagedKVCache
from shared.transfer import KVHeadShard, KVReceiver, KVSender, LayoutMismatch, ProtocolError, StagingPool, TransferError, TransferRecord, TransferTimeout, UnknownTransfer, kv_head_shard
from shared.transfer.shard import chunk_nbytes, chunk_view, pack_layers, scatter_layers
from shared.transfer.worker import data_tag, decode_header, encode_header, header_tag

from local_worker import local_worker

if not torch.cuda.is_available():  # with a GPU, UCX keeps its default transports (cuda_ipc, cuda_copy)
    os.environ.setdefault("UCX_TLS", "tcp,self")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


def test_head_shards_cover_every_head_once():
    for heads, tp in [(4, 1), (4, 2), (4, 4), (4, 8), (2, 4), (1, 4), (8, 2)]:
        shards = [kv_head_shard(r, tp, heads) for r in range(tp)]
        sent = [h for s in shards if s.sends for h in range(s.start, s.end)]
        assert sorted(sent) == list(range(heads)), (heads, tp, shards)
        held = [h for s in shards for h in range(s.start, s.end)]
        assert sorted(set(held)) == list(range(heads)) and len(held) == max(tp, heads)
    assert kv_head_shard(3, 8, 4) == KVHeadShard(1, 2, False)  # rank 3 is the 2nd replica of head 1
    with pytest.raises(ValueError):
        kv_head_shard(0, 3, 4)
    with pytest.raises(ValueError):
        kv_head_shard(4, 4, 4)


_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", _CUDA])
@pytest.mark.parametrize("src_page,dst_page,tokens", [(8, 16, 37), (16, 16, 64), (32, 8, 5), (4, 32, 100)])
def test_pack_then_scatter_is_exact_across_page_sizes(src_page, dst_page, tokens, device):
    layers, heads, dim = 3, 4, 8
    ref = torch.randn(layers, 2, heads, tokens, dim, device=device).to(torch.bfloat16)
    rng = random.Random(tokens)
    h0, h1 = 1, 3
    src = PagedKVCache(KVLayout(layers, 40, h1 - h0, src_page, dim, torch.bfloat16), device)
    src_table = torch.tensor(rng.sample(range(40), src.layout.pages_for(tokens)), device=device)
    pages, offsets = src.slots(src_table, torch.arange(tokens, device=device))
    for layer in range(layers):
        src.write(layer, pages, offsets, ref[layer, 0, h0:h1].transpose(0, 1), ref[layer, 1, h0:h1].transpose(0, 1))
    buf = torch.empty(chunk_nbytes(layers, h1 - h0, tokens, dim, torch.bfloat16), dtype=torch.uint8, device=device)
    chunk = chunk_view(buf, layers, h1 - h0, tokens, dim, torch.bfloat16)
    pack_layers(src, range(layers), src_table, tokens, chunk)
    assert torch.equal(chunk, ref[:, :, h0:h1])

    dst = PagedKVCache(KVLayout(layers, 40, heads, dst_page, dim, torch.bfloat16), device)
    for pool in dst.pools:
        pool.fill_(3.0)
    dst_table = torch.tensor(rng.sample(range(40), dst.layout.pages_for(tokens)), device=device)
    scatter_layers(dst, range(layers), range(h0, h1), dst_table, tokens, chunk)
    for layer in range(layers):
        k, v = dst.read(layer, dst_table, tokens)
        assert torch.equal(k[h0:h1], ref[layer, 0, h0:h1]) and torch.equal(v[h0:h1], ref[layer, 1, h0:h1])
        assert bool((k[:h0] == 3.0).all() and (k[h1:] == 3.0).all())  # other heads untouched


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pack_and_scatter_launch_two_kernels_per_layer_group_on_cuda():
    """However many layers and pages a group holds: one kernel for its full pages, one for
    the partial last page, each way (no per-page or per-layer loop)."""

    def kernels(fn) -> int:
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)

    counts = set()
    for layers, tokens in [(1, 40), (12, 300)]:
        heads, dim, ps = 4, 128, 16
        src = PagedKVCache(KVLayout(layers, 64, heads, ps, dim, torch.bfloat16), "cuda")
        src.storage.normal_()
        table = torch.randperm(64, device="cuda")[: src.layout.pages_for(tokens)]
        buf = torch.empty(chunk_nbytes(layers, heads, tokens, dim, torch.bfloat16), dtype=torch.uint8, device="cuda")
        chunk = chunk_view(buf, layers, heads, tokens, dim, torch.bfloat16)
        dst = PagedKVCache(KVLayout(layers, 64, heads, ps, dim, torch.bfloat16), "cuda")
        counts.add((kernels(lambda: pack_layers(src, range(layers), table, tokens, chunk)), kernels(lambda: scatter_layers(dst, range(layers), range(heads), table, tokens, chunk))))
        assert all(torch.equal(torch.stack(dst.read(layer, table, tokens)), torch.stack(src.read(layer, table, tokens))) for layer in range(layers))
    assert counts == {(2, 2)}, counts


def test_wire_structs_round_trip_and_reject_unknown_fields():
    desc = KVTransferDescriptor(b"\x00addr", "req-1", 7, [5, 2, 9], 40, KVTransferLayout(94, 16, 4, 128, "bfloat16"), 1e9, 1 << 20)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(desc), type=KVTransferDescriptor) == desc
    raw = msgspec.msgpack.encode(msgspec.structs.asdict(desc) | {"extra": 1})
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(raw, type=KVTransferDescriptor)
    header = ShardHeader("req-1", 7, 0, 2, 4, 8, 40, 123, "bfloat16")
    assert decode_header(encode_header(header)) == header
    with pytest.raises(ValueError, match="frame"):
        encode_header(ShardHeader("x" * 600, 7, 0, 2, 4, 8, 40, 123, "bfloat16"))


def test_staging_pool_waits_for_a_slot_and_counts():
    async def main():
        pool = StagingPool(64, 2)
        a = await pool.acquire(60)
        b = await pool.acquire(10)
        assert a.data_ptr() != b.data_ptr() and pool.in_use_bytes == 70 and pool.in_use_buffers == 2
        waiter = asyncio.ensure_future(pool.acquire(64))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        pool.release(a)
        c = await asyncio.wait_for(waiter, 1)
        assert c.data_ptr() == a.data_ptr() and pool.in_use_bytes == 74  # the freed slot, reused
        pool.release(b)
        pool.release(c)
        assert pool.in_use_bytes == 0 and pool.in_use_buffers == 0
        with pytest.raises(ValueError, match="slots"):
            await pool.acquire(65)
        with pytest.raises(ValueError, match="not in use"):
            pool.release(c)

    asyncio.run(main())


def _cache(heads: int = 4, pages: int = 8, page_size: int = 16) -> PagedKVCache:
    return PagedKVCache(KVLayout(2, pages, heads, page_size, 8, torch.bfloat16))


def test_receiver_rejects_bad_reservations_and_expires_leases():
    async def main():
        async with local_worker() as worker:
            cache = _cache()
            rx = KVReceiver(worker, cache, staging=StagingPool(32768, 2))
            with pytest.raises(OutOfPages):
                rx.reserve("too-big", 9 * 16, 5.0)
            with pytest.raises(ValueError, match="staging slot"):
                rx.reserve("too-big-for-staging", 300, 5.0)  # one layer = 2*4*300*8*2 bytes > 32768
            assert rx.num_free_pages == 8
            rx.reserve("r", 20, 0.2)
            with pytest.raises(ValueError, match="already"):
                rx.reserve("r", 20, 0.2)
            assert rx.num_free_pages == 6
            with pytest.raises(TransferTimeout):
                await rx.wait_complete("r", 0.01)  # reservation survives a waiter's timeout
            with pytest.raises(Exception) as e:
                await rx.wait_complete("r", 5.0)
            assert type(e.value).__name__ == "LeaseExpired" and rx.num_free_pages == 8
            with pytest.raises(type(e.value)):
                await rx.wait_complete("r", 1.0)  # a late waiter learns why
            with pytest.raises(UnknownTransfer):
                await rx.wait_complete("never", 1.0)
            assert rx.metrics.snapshot()["failures"] == {"lease_expired": 1}

    asyncio.run(main())


def test_landed_kv_let_go_unclaimed_is_not_a_transfer_failure():
    """All KV landed, then the decode side drops the reservation (the request finished at its
    first token): pages back, the waiter learns it was cancelled, and the metrics count one
    completed transfer and no failure. A cancel while KV is still arriving is a failure."""

    async def main():
        async with local_worker() as worker:
            rx = KVReceiver(worker, _cache(), staging=StagingPool(1 << 20, 2))
            desc = rx.reserve("landed", 20, 5.0)
            sender = KVSender(worker, _cache(heads=4), desc, [0, 1], KVHeadShard(0, 4, True), timeout_s=5.0)
            sender.mark_all_layers_done()
            await sender.finish()
            for _ in range(250):
                if rx.metrics.completed == 1:
                    break
                await asyncio.sleep(0.02)
            assert rx.metrics.completed == 1 and rx.num_free_pages == 6
            assert rx.cancel("landed") and rx.num_free_pages == 8
            with pytest.raises(TransferError, match="cancelled"):
                await rx.wait_complete("landed", 1.0)
            rx.reserve("arriving", 20, 5.0)
            assert rx.cancel("arriving") and rx.num_free_pages == 8
            stats = rx.metrics.stats()
            assert (stats.completed, stats.failures) == (1, {"cancelled": 1}), stats
            assert stats.bytes_total == chunk_nbytes(2, 4, 20, 8, torch.bfloat16)

    asyncio.run(main())


def test_a_cancel_once_landed_lets_the_kv_already_sent_arrive_as_a_completed_transfer():
    """A prefill releases the reservation of a request that ended at its first token after all of
    its KV went out; the release can reach the decode rank before the last chunks do (a send
    completes before the receiver has seen it). Here it comes before any chunk: the KV still
    lands, counted as one completed transfer and no failure, then the pages are freed. KV that
    never lands is still failed by the lease."""

    async def free_pages_back(rx: KVReceiver) -> None:
        for _ in range(250):
            if rx.num_free_pages == 8:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"pages not freed: {rx.num_free_pages} of 8 free")

    async def main():
        async with local_worker() as worker:
            rx = KVReceiver(worker, _cache(), staging=StagingPool(1 << 20, 2))
            desc = rx.reserve("first-token", 20, 5.0)
            assert rx.cancel("first-token", once_landed=True) and rx.num_free_pages == 6  # held until the KV landed
            sender = KVSender(worker, _cache(heads=4), desc, [0, 1], KVHeadShard(0, 4, True), timeout_s=5.0)
            sender.mark_all_layers_done()
            await sender.finish()
            await free_pages_back(rx)
            stats = rx.metrics.stats()
            assert (stats.completed, stats.failures) == (1, {}), stats
            assert stats.bytes_total == chunk_nbytes(2, 4, 20, 8, torch.bfloat16)
            with pytest.raises(TransferError, match="cancelled"):
                await rx.wait_complete("first-token", 1.0)
            rx.reserve("never-sent", 20, 0.2)
            assert rx.cancel("never-sent", once_landed=True)
            await free_pages_back(rx)
            assert rx.metrics.stats().failures == {"lease_expired": 1}

    asyncio.run(main())


def test_sender_rejects_layouts_that_cannot_map():
    async def main():
        async with local_worker() as worker:
            rx = KVReceiver(worker, _cache(), staging=StagingPool(1 << 20, 2))
            desc = rx.reserve("r", 20, 5.0)
            shard = kv_head_shard(0, 2, 4)
            with pytest.raises(LayoutMismatch, match="holds 4 KV heads"):
                KVSender(worker, _cache(heads=4), desc, [0, 1], shard, timeout_s=1.0)
            with pytest.raises(LayoutMismatch, match="replica"):
                KVSender(worker, _cache(heads=1), desc, [0, 1], kv_head_shard(1, 8, 4), timeout_s=1.0)
            with pytest.raises(LayoutMismatch, match="page table"):
                KVSender(worker, _cache(heads=2, page_size=4), desc, [0, 1], shard, timeout_s=1.0)
            with pytest.raises(LayoutMismatch, match="dtype"):
                KVSender(worker, PagedKVCache(KVLayout(2, 8, 2, 16, 8, torch.float16)), desc, [0, 1], shard, timeout_s=1.0)
            rx.cancel("r")

    asyncio.run(main())


def test_layout_verdicts_are_kept_per_objects_and_the_page_table_checked_every_time():
    """A sender's layout verdict is kept per (local layout, shard, decode layout), the first two by
    identity: checking the same objects again is served by the kept verdict (no new entry) and
    still refuses a page table too short for its request; a shard of equal value but another
    object is checked afresh; a shard that does not fit is refused and never kept."""
    from shared.transfer import sender

    cache = _cache(heads=2)
    desc = KVTransferDescriptor(b"addr", "r", 1, [0, 1], 20, KVTransferLayout(2, 16, 4, 8, "bfloat16"), time.time() + 5, 1 << 20)
    shard = kv_head_shard(0, 2, 4)
    sender._layouts_fit.clear()
    sender._check_layouts(cache, desc, shard, 2)
    assert list(sender._layouts_fit.values()) == [(cache.layout, shard)]
    (key, kept), = sender._layouts_fit.items()
    sender._check_layouts(cache, desc, shard, 2)
    assert len(sender._layouts_fit) == 1 and sender._layouts_fit[key] is kept  # a check afresh would store a new verdict
    with pytest.raises(LayoutMismatch, match="page table of 1 pages cannot hold 20 tokens"):
        sender._check_layouts(cache, desc, shard, 1)
    sender._check_layouts(cache, desc, KVHeadShard(shard.start, shard.end, shard.sends), 2)
    assert len(sender._layouts_fit) == 2
    with pytest.raises(LayoutMismatch, match="replica"):
        sender._check_layouts(cache, desc, KVHeadShard(shard.start, shard.end, False), 2)
    assert len(sender._layouts_fit) == 2


def test_overlapping_shards_fail_the_request_with_protocol_error():
    """Two senders claiming the same heads: the receiver fails the request and frees its pages."""

    async def main():
        async with local_worker() as worker:
            rx = KVReceiver(worker, _cache(), staging=StagingPool(1 << 20, 2))
            desc = rx.reserve("dup", 20, 5.0)
            shard = KVHeadShard(0, 2, True)
            senders = [KVSender(worker, _cache(heads=2), desc, [0, 1], shard, timeout_s=1.0) for _ in range(2)]
            for sender in senders:
                sender.mark_all_layers_done()
            with pytest.raises(ProtocolError, match="overlap"):
                await rx.wait_complete("dup", 5.0)
            assert rx.num_free_pages == 8
            outcomes = await asyncio.gather(*(s.finish() for s in senders), return_exceptions=True)
            assert all(s.staging.in_use_bytes == 0 for s in senders)
            # Chunks this small go eagerly (UCX buffers them), so senders may finish; either way typed.
            assert all(isinstance(o, (TransferRecord, TransferError)) for o in outcomes), outcomes

    asyncio.run(main())


def test_late_chunk_after_lease_end_lands_in_quarantined_staging_not_pages():
    """A chunk announced before the lease ended but sent after it: its staging slot stays
    out of the pool until UCX is done with it, and the freed pages are never written."""

    async def main():
        async with local_worker() as worker:
            cache = _cache(heads=4)
            rx = KVReceiver(worker, cache, staging=StagingPool(1 << 20, 2))
            desc = rx.reserve("late", 20, 0.3)
            nbytes = chunk_nbytes(2, 4, 20, 8, torch.bfloat16)
            header = ShardHeader("late", desc.transfer_id, 0, 4, 0, 2, 20, nbytes, "bfloat16")
            await worker.send(worker.address, header_tag(desc.transfer_id), encode_header(header))
            with pytest.raises(Exception) as e:
                await rx.wait_complete("late", 5.0)
            assert type(e.value).__name__ == "LeaseExpired" and rx.num_free_pages == 8
            assert rx.staging.in_use_buffers == 1  # the abandoned receive still owns its slot
            for pool in cache.pools:
                pool.fill_(5.0)
            await worker.send(worker.address, data_tag(desc.transfer_id, 0, 0), torch.ones(nbytes, dtype=torch.uint8).numpy())
            for _ in range(100):
                if rx.staging.in_use_buffers == 0:
                    break
                await asyncio.sleep(0.02)
            assert rx.staging.in_use_buffers == 0  # freed by the late receive, well before the 2 s margin
            assert all(bool((pool == 5.0).all()) for pool in cache.pools)

    asyncio.run(main())


@pytest.mark.parametrize("device", ["cpu", _CUDA])
def test_layers_reported_out_of_order_from_another_thread_still_complete_exactly(device):
    """on_layer_done from a worker thread (as a forward in asyncio.to_thread) in reverse order;
    on CUDA this runs the pack stream / group events / scatter stream paths end to end."""

    async def main():
        async with local_worker() as worker:
            layers, heads, tokens, dim = 6, 2, 21, 8
            ref = torch.randn(layers, 2, heads, tokens, dim, device=device).to(torch.bfloat16)
            decode = PagedKVCache(KVLayout(layers, 8, heads, 4, dim, torch.bfloat16), device)
            rx = KVReceiver(worker, decode, staging=StagingPool(1 << 20, 2, device), cuda_ipc=False)  # the UCX path's stages
            desc = rx.reserve("ooo", tokens, 5.0)
            local = PagedKVCache(KVLayout(layers, 8, heads, 8, dim, torch.bfloat16), device)
            table = [5, 0, 3]
            pages, offsets = local.slots(torch.tensor(table, device=device), torch.arange(tokens, device=device))
            for layer in range(layers):
                local.write(layer, pages, offsets, ref[layer, 0].transpose(0, 1), ref[layer, 1].transpose(0, 1))
            started = time.perf_counter()
            sender = KVSender(worker, local, desc, table, kv_head_shard(0, 1, heads), timeout_s=5.0, chunk_bytes=2 * chunk_nbytes(1, heads, tokens, dim, torch.bfloat16))

            def forward() -> None:
                for layer in reversed(range(layers)):
                    sender.on_layer_done(layer)

            await asyncio.to_thread(forward)
            record = await sender.finish()
            assert sender.layer_groups == [range(0, 2), range(2, 4), range(4, 6)]  # layer 0 came last: all ready at once
            assert record.chunks == 3 and record.nbytes == chunk_nbytes(layers, heads, tokens, dim, torch.bfloat16)
            assert set(record.phases_s) == {"setup", "first_ready", "start", "staging_wait", "pack", "endpoint", "wire", "tail"}
            phases = record.phases_s
            assert phases["setup"] + phases["first_ready"] + phases["start"] <= time.perf_counter() - started and phases["wire"] > 0
            got = torch.tensor(await rx.wait_complete("ooo", 5.0), device=device)
            received = rx.metrics.recent[-1]
            assert set(received.phases_s) == {"first_header", "post", "wire", "scatter", "tail"} and received.chunks == 3
            assert received.started_unix <= received.started_unix + received.phases_s["first_header"] <= time.time()
            for layer in range(layers):
                k, v = decode.read(layer, got, tokens)
                assert torch.equal(k, ref[layer, 0]) and torch.equal(v, ref[layer, 1])

    asyncio.run(main())


def test_announced_chunk_that_never_comes_frees_its_staging_after_the_lease_margin():
    async def main():
        async with local_worker() as worker:
            rx = KVReceiver(worker, _cache(heads=4), staging=StagingPool(1 << 20, 2))
            desc = rx.reserve("ghost", 20, 0.2)
            nbytes = chunk_nbytes(2, 4, 20, 8, torch.bfloat16)
            header = ShardHeader("ghost", desc.transfer_id, 0, 4, 0, 2, 20, nbytes, "bfloat16")
            await worker.send(worker.address, header_tag(desc.transfer_id), encode_header(header))
            with pytest.raises(Exception, match="lease ended"):
                await rx.wait_complete("ghost", 5.0)
            assert rx.staging.in_use_buffers == 1 and rx.num_free_pages == 8
            await asyncio.sleep(2.5)  # the lease ended ~0 s ago; the margin is 2 s
            assert rx.staging.in_use_buffers == 0

    asyncio.run(main())


def test_senders_share_the_workers_send_pool_and_return_it_after_failures():
    """Senders without their own staging pack into the worker's long-lived pool (one arena,
    registered once); every outcome - success, cancel, deadline - gives its slots back."""

    async def main():
        async with local_worker(send_slot_bytes=4096, send_slots=2) as worker:
            layers, heads, tokens, dim = 2, 4, 20, 8
            rx = KVReceiver(worker, _cache(heads=heads, pages=24), staging=StagingPool(1 << 20, 2))
            local = _cache(heads=heads)
            arenas = set()
            for i in range(2):
                sender = KVSender(worker, local, rx.reserve(f"ok-{i}", tokens, 5.0), [0, 1], kv_head_shard(0, 1, heads), timeout_s=5.0)
                await sender.send_all()
                await rx.wait_complete(f"ok-{i}", 5.0)
                assert sender.held_buffers == 0 and sender.staging is worker.staging_pools[0]
                arenas.add(sender.staging.arena.data_ptr())
            assert len(arenas) == 1 and len(worker.staging_pools) == 1
            pool = worker.staging_pools[0]
            assert pool.slot_bytes == 4096 and pool.in_use_buffers == 0

            cancelled = KVSender(worker, local, rx.reserve("cancel", tokens, 5.0), [0, 1], kv_head_shard(0, 1, heads), timeout_s=5.0, chunk_bytes=chunk_nbytes(1, heads, tokens, dim, torch.bfloat16))
            cancelled.on_layer_done(0)
            await asyncio.sleep(0)  # the first chunk takes its slot
            cancelled.cancel()
            with pytest.raises(TransferError) as e:
                await cancelled.finish()
            assert e.value.cause == "cancelled" and cancelled.held_buffers == 0 and pool.in_use_buffers == 0

            stalled = KVSender(worker, local, rx.reserve("stall", tokens, 5.0), [0, 1], kv_head_shard(0, 1, heads), timeout_s=0.2)
            with pytest.raises(TransferTimeout):
                await stalled.finish()  # no layer ever reported
            assert stalled.held_buffers == 0 and pool.in_use_buffers == 0
            assert {"cancelled": 1, "timeout": 1} == dict(cancelled.metrics.failures + stalled.metrics.failures)
            rx.cancel("cancel")
            rx.cancel("stall")

            big = chunk_nbytes(1, heads, 200, dim, torch.bfloat16)  # one layer > the 4096-byte slots
            grown = KVSender(worker, PagedKVCache(KVLayout(layers, 16, heads, 16, dim, torch.bfloat16)), rx.reserve("big", 200, 5.0), list(range(13)), kv_head_shard(0, 1, heads), timeout_s=5.0)
            assert grown.staging.slot_bytes >= big and worker.staging_pools == [grown.staging]
            await grown.send_all()
            await rx.wait_complete("big", 5.0)
            assert grown.staging.in_use_buffers == 0

    asyncio.run(main())


def test_chunks_take_the_layers_ready_when_a_slot_is_free():
    """KV that is all there goes in full chunks; KV reported layer by layer with the wire
    idle in between goes one layer per chunk (nothing waits for a chunk to fill up)."""

    async def main():
        async with local_worker() as worker:
            layers, heads, tokens, dim = 6, 2, 24, 8
            ref = torch.randn(layers, 2, heads, tokens, dim).to(torch.bfloat16)
            decode = PagedKVCache(KVLayout(layers, 16, heads, 8, dim, torch.bfloat16))
            rx = KVReceiver(worker, decode, staging=StagingPool(1 << 20, 2))
            local = PagedKVCache(KVLayout(layers, 4, heads, 8, dim, torch.bfloat16))
            table = [2, 0, 3]
            pages, offsets = local.slots(torch.tensor(table), torch.arange(tokens))
            for layer in range(layers):
                local.write(layer, pages, offsets, ref[layer, 0].transpose(0, 1), ref[layer, 1].transpose(0, 1))
            three_layers = 3 * chunk_nbytes(1, heads, tokens, dim, torch.bfloat16)
            for rid, trickle in [("all-there", False), ("trickle", True)]:
                sender = KVSender(worker, local, rx.reserve(rid, tokens, 5.0), table, kv_head_shard(0, 1, heads), timeout_s=5.0, chunk_bytes=three_layers)
                if trickle:
                    for layer in range(layers):
                        sender.on_layer_done(layer)
                        await asyncio.sleep(0.05)
                else:
                    sender.mark_all_layers_done()
                await sender.finish()
                expected = [range(i, i + 1) for i in range(layers)] if trickle else [range(0, 3), range(3, 6)]
                assert sender.layer_groups == expected, (rid, sender.layer_groups)
                got = torch.tensor(await rx.wait_complete(rid, 5.0))
                assert all(torch.equal(torch.stack(decode.read(layer, got, tokens)), ref[layer]) for layer in range(layers))
                decode.allocator.free(got.tolist())

    asyncio.run(main())
