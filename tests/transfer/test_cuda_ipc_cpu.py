"""The same-host CUDA IPC path's pieces that need no GPU: the descriptor's export field,
the choice of the UCX fallback, and the receiver's page quarantine for reservations a
direct writer may still write (real receiver, real UCX worker sending headers to itself)."""

from __future__ import annotations

import asyncio
import os
import time

import msgspec
import pytest
import structlog
import torch

from schemas.transfer import CudaIpcExport, KVTransferDescriptor, KVTransferLayout, ShardHeader
from shared.kvcache import KVLayout, PagedKVCache
from shared.transfer import KVReceiver, KVSender, LayoutMismatch, PeerFailed, StagingPool, TransferWorker, kv_head_shard
from shared.transfer import cuda_ipc
from shared.transfer.receiver import DIRECT_WRITE_GRACE_S
from shared.transfer.worker import encode_header, header_tag

from local_worker import local_worker

if not torch.cuda.is_available():
    os.environ.setdefault("UCX_TLS", "tcp,self")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

LAYERS, HEADS, PAGE, DIM = 2, 4, 16, 8


def _export(host_id: str, num_pages: int = 8) -> CudaIpcExport:
    """A well-formed export as another decode rank would send it (its handle opens nowhere here)."""
    nbytes = LAYERS * num_pages * 2 * HEADS * PAGE * DIM * 2
    return CudaIpcExport(host_id, 4242, "GPU-00000000-0000-0000-0000-000000000000", num_pages, bytes(64), nbytes, 0, 0, b"/torch_0_0", 0, bytes(64), True)


def _cache(heads: int = HEADS, pages: int = 8) -> PagedKVCache:
    return PagedKVCache(KVLayout(LAYERS, pages, heads, PAGE, DIM, torch.bfloat16))


def test_descriptor_round_trips_with_and_without_export():
    layout = KVTransferLayout(94, 16, 4, 128, "bfloat16")
    plain = KVTransferDescriptor(b"addr", "r", 3, [4, 1], 20, layout, 1e9, 1 << 20)
    assert plain.cuda_ipc is None
    with_export = msgspec.structs.replace(plain, cuda_ipc=_export("boot/host"))
    for desc in (plain, with_export):
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(desc), type=KVTransferDescriptor) == desc
    bad = msgspec.msgpack.encode(msgspec.structs.asdict(with_export) | {"cuda_ipc": msgspec.structs.asdict(with_export.cuda_ipc) | {"extra": 1}})
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(bad, type=KVTransferDescriptor)
    landed = ShardHeader("r", 3, 0, 2, 0, 94, 20, 0, "bfloat16", kind="landed")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(landed), type=ShardHeader) == landed
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(msgspec.structs.asdict(landed) | {"kind": "teleported"}), type=ShardHeader)


def test_switch_and_host_identity(monkeypatch):
    monkeypatch.setenv(cuda_ipc.ENV_SWITCH, "0")
    assert not cuda_ipc.enabled_by_env()
    monkeypatch.setenv(cuda_ipc.ENV_SWITCH, "1")
    assert cuda_ipc.enabled_by_env()
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert cuda_ipc.host_identity().startswith(f.read().strip() + "/")


def test_cpu_receiver_offers_no_export_and_senders_take_ucx():
    """On CPU there is nothing to export; a descriptor from another host or a CPU sender
    falls back to UCX (logged with the reason) and the KV still lands."""

    async def main():
        async with local_worker() as worker:
            rx = KVReceiver(worker, _cache(), staging=StagingPool(1 << 20, 2), cuda_ipc=True)
            assert rx.cuda_ipc_export is None and rx.reserve("plain", 20, 5.0).cuda_ipc is None
            rx.cancel("plain")
            for host in ("another-boot-id/another-host", cuda_ipc.host_identity()):
                rid = f"from-{host[:7]}"
                desc = msgspec.structs.replace(rx.reserve(rid, 20, 5.0), cuda_ipc=_export(host))
                src = _cache()
                src.storage.copy_(torch.randn(src.storage.shape).to(torch.bfloat16))
                with structlog.testing.capture_logs() as logs:
                    sender = KVSender(worker, src, desc, [3, 5], kv_head_shard(0, 1, HEADS), timeout_s=5.0)
                assert sender.path == "ucx"
                reasons = [e["reason"] for e in logs if e["event"] == "kv.cuda_ipc_unavailable"]
                assert len(reasons) == 1 and ("host" in reasons[0] if host.startswith("another") else "cpu" in reasons[0]), reasons
                record = await sender.send_all()
                pages = await rx.wait_complete(rid, 5.0)
                assert record.path == "ucx" and rx.metrics.recent[-1].path == "ucx"
                table = torch.tensor(pages)
                for layer in range(LAYERS):
                    assert torch.equal(torch.stack(rx._cache.read(layer, table, 20)), torch.stack(src.read(layer, torch.tensor([3, 5]), 20)))
                rx._cache.allocator.free(pages)
            desc = msgspec.structs.replace(rx.reserve("bad-pages", 20, 5.0), cuda_ipc=_export(cuda_ipc.host_identity(), num_pages=1))
            with pytest.raises(LayoutMismatch, match="page ids"):
                KVSender(worker, _cache(), desc, [3, 5], kv_head_shard(0, 1, HEADS), timeout_s=5.0)
            rx.cancel("bad-pages")
            assert rx.num_free_pages == 8

    asyncio.run(main())


async def _header(worker: TransferWorker, desc: KVTransferDescriptor, heads: tuple[int, int], kind: str, layers: tuple[int, int] = (0, LAYERS)) -> None:
    nbytes = 0 if kind == "stopped" else (layers[1] - layers[0]) * 2 * (heads[1] - heads[0]) * desc.num_tokens * DIM * 2
    header = ShardHeader(desc.request_id, desc.transfer_id, heads[0], heads[1], layers[0], layers[1], desc.num_tokens, nbytes, "bfloat16", kind=kind)
    await worker.send(worker.address, header_tag(desc.transfer_id), encode_header(header))


async def _until(predicate, timeout: float) -> float:
    """Seconds until ``predicate()`` held (polling), or raise after ``timeout``."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(0.02)
    return time.monotonic() - started


def test_landed_headers_complete_a_direct_request():
    async def main():
        async with local_worker() as worker:
            rx = KVReceiver(worker, _cache(), staging=StagingPool(1 << 20, 2))
            rx.cuda_ipc_export = _export("elsewhere")  # as a GPU receiver's: reservations may have direct writers
            desc = rx.reserve("d", 20, 5.0)
            assert desc.cuda_ipc == rx.cuda_ipc_export
            await _header(worker, desc, (0, 2), "landed")
            await _header(worker, desc, (2, 4), "landed", (0, 1))
            await _header(worker, desc, (2, 4), "landed", (1, 2))
            pages = await rx.wait_complete("d", 5.0)
            record = rx.metrics.recent[-1]
            assert record.path == "cuda_ipc" and record.chunks == 3 and record.nbytes == LAYERS * 2 * HEADS * 20 * DIM * 2
            rx._cache.allocator.free(pages)
            plain = KVReceiver(worker, _cache(), staging=StagingPool(1 << 20, 2), cuda_ipc=False)
            desc = plain.reserve("no-export", 20, 5.0)
            await _header(worker, desc, (0, 4), "landed")
            with pytest.raises(Exception, match="no CUDA IPC export"):
                await plain.wait_complete("no-export", 5.0)
            assert plain.num_free_pages == 8

    asyncio.run(main())


def test_cancelled_direct_reservation_quarantines_pages_until_every_head_is_quiet():
    async def main():
        async with local_worker() as worker:
            rx = KVReceiver(worker, _cache(), staging=StagingPool(1 << 20, 2))
            rx.cuda_ipc_export = _export("elsewhere")
            desc = rx.reserve("c", 20, 30.0)
            await _header(worker, desc, (0, 2), "landed")
            await _until(lambda: rx._reservations["c"].landed[:, :2].all(), 5.0)
            with structlog.testing.capture_logs() as logs:
                assert rx.cancel("c")
            # A cancel is its owner's decision (a client that hung up), logged as such, not warned of as a failure.
            assert [(e["event"], e["log_level"]) for e in logs if e["event"].startswith("kv.receive")] == [("kv.receive_cancelled", "info")]
            assert rx.num_free_pages == 6 and rx.num_quarantined_pages == 2  # heads 2..3 may still be written
            await asyncio.sleep(0.2)
            assert rx.num_free_pages == 6
            await _header(worker, desc, (2, 4), "stopped")  # their sender gave up: no more writes
            await _until(lambda: rx.num_free_pages == 8, 5.0)
            assert rx.num_quarantined_pages == 0
            # Cancelled after everything landed: nothing can write any more, freed at once.
            desc = rx.reserve("all-landed", 20, 30.0)
            await _header(worker, desc, (0, 4), "landed")
            await _until(lambda: rx._reservations["all-landed"].landed.all(), 5.0)
            assert rx.cancel("all-landed") and rx.num_free_pages == 8
            # A sender that fell back to UCX (its chunk header came) never writes directly either.
            desc = rx.reserve("ucx-sender", 20, 30.0)
            await _header(worker, desc, (0, 4), "chunk", (0, 1))
            await _until(lambda: rx._reservations["ucx-sender"].announced[0].all(), 5.0)
            assert rx.cancel("ucx-sender") and rx.num_free_pages == 8 and rx.num_quarantined_pages == 0

    asyncio.run(main())


def test_expired_or_failed_direct_reservations_free_pages_only_after_lease_plus_grace():
    async def main():
        async with local_worker() as worker:
            rx = KVReceiver(worker, _cache(), staging=StagingPool(1 << 20, 2))
            rx.cuda_ipc_export = _export("elsewhere")
            lease = 0.3
            rx.reserve("e", 20, lease)
            reserved = time.monotonic()
            with pytest.raises(Exception) as e:
                await rx.wait_complete("e", 5.0)
            assert type(e.value).__name__ == "LeaseExpired"
            assert rx.num_free_pages == 6 and rx.num_quarantined_pages == 2  # a writer may still be at it
            await _until(lambda: rx.num_free_pages == 8, lease + DIRECT_WRITE_GRACE_S + 5.0)
            assert time.monotonic() - reserved >= lease + DIRECT_WRITE_GRACE_S - 0.05
            # One TP rank stops: the request fails at once, its pages wait for the other rank.
            desc = rx.reserve("s", 20, 30.0)
            await _header(worker, desc, (0, 2), "stopped")
            with pytest.raises(PeerFailed, match="stopped"):
                await rx.wait_complete("s", 5.0)
            assert rx.num_free_pages == 6
            await _header(worker, desc, (2, 4), "landed")
            await _until(lambda: rx.num_free_pages == 8, 5.0)
            assert rx.metrics.snapshot()["failures"] == {"lease_expired": 1, "peer_failed": 1}
            # close() frees whatever is still quarantined (no writer outlives the decode rank's cache).
            rx.reserve("closing", 20, 30.0)
            rx.cancel("closing")
            assert rx.num_quarantined_pages == 2
            await rx.close()
            assert rx.num_free_pages == 8 and rx.num_quarantined_pages == 0

    asyncio.run(main())
