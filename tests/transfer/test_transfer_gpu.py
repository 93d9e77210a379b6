"""The same-host CUDA IPC path between two processes on two GPUs (UCX for control).

The decode process sees GPU1 first, the prefill processes GPU0 first (both see both),
as on one host of a deployment. KV written directly into the decode pages must equal
an unsharded prefill bit for bit (equal and unequal page sizes, shuffled page ids on
both sides, TP=1 and 2 ranks, all layers at once and layer groups formed while layers
trickle in), with ``path == "cuda_ipc"`` on both sides; a cancelled or expired
reservation keeps its pages out of the pool while a direct writer may still write them
(until it landed everything, or the lease + grace when the writer was killed); a sender
killed after announcing writes that never ran does not complete the request; writes
enqueued in time that reach the GPU only after the lease deadline + guard write nothing
(the kernel's own check) and the sender fails with ``TransferTimeout``; a decode
killed during direct writes fails the sender with a typed error within its deadline,
and the prefill process stays usable.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import torch

from schemas.transfer import KVTransferDescriptor
from shared.transfer.cuda_ipc import WRITE_GUARD_AFTER_LEASE_S

from transfer_peers import Peer, reference_kv, spawn_context

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

LAYERS, HEADS, HEAD_DIM, DECODE_PAGE, PAGES = 6, 4, 64, 16, 128
CACHES = {"h4": {"num_layers": LAYERS, "num_pages": PAGES, "kv_heads": HEADS, "page_size": DECODE_PAGE, "head_dim": HEAD_DIM}}
GRACE_S = 2.0  # receiver.DIRECT_WRITE_GRACE_S


def layer_bytes(heads: int, tokens: int) -> int:
    return 2 * heads * tokens * HEAD_DIM * 2


@pytest.fixture(scope="module")
def peers():
    ctx = spawn_context()
    decode = Peer(ctx, "decode", device="cuda", visible="1,0", caches=CACHES, staging_slot_bytes=8 << 20)
    prefill = [Peer(ctx, "prefill", device="cuda", visible="0,1", head_dim=HEAD_DIM) for _ in range(2)]
    yield decode, prefill
    for peer in (decode, *prefill):
        peer.stop()


def _send(decode, prefill, request_id, tokens, tp, page_size, seed, lease_s=30.0, **send_kwargs):
    """Reserve on the decode side and start the ``tp`` prefill ranks' sends (chunk: two layers)."""
    desc = decode.call("reserve", cache="h4", request_id=request_id, num_tokens=tokens, lease_s=lease_s)
    jobs = [
        (prefill[r], prefill[r].submit("send", descriptor=desc, tp_rank=r, tp_size=tp, page_size=page_size, seed=seed, chunk_bytes=2 * layer_bytes(HEADS // tp, tokens), timeout_s=20.0, **send_kwargs))
        for r in range(tp)
    ]
    return jobs


@pytest.mark.parametrize(
    "tp,tokens,prefill_page,pace_s",
    [
        (1, 200, 16, 0.0),
        (2, 333, 16, 0.0),
        (1, 200, 32, 0.0),
        (2, 77, 8, 0.0),
        (2, 333, 64, 0.0),
        (1, 1, 16, 0.0),
        (2, 333, 16, 0.02),  # layer groups formed while the layers come in
    ],
)
def test_direct_writes_land_bit_identical(peers, tp, tokens, prefill_page, pace_s):
    decode, prefill = peers
    assert decode.call("status", cache="h4")["cuda_ipc"]
    seed = tokens * 7 + tp + prefill_page
    rid = f"ipc-{tp}-{tokens}-{prefill_page}-{pace_s}"
    decode_free = decode.call("status", cache="h4")["free_pages"]
    jobs = _send(decode, prefill, rid, tokens, tp, prefill_page, seed, pace_s=pace_s)
    results = [peer.wait(job) for peer, job in jobs]
    assert all(r["ok"] and r["path"] == "cuda_ipc" and r["held_buffers"] == 0 for r in results), results
    if pace_s:
        assert all(r["groups"] > 1 for r in results), results
    got = decode.call("wait", cache="h4", request_id=rid, timeout=20.0)
    assert got["ok"], got
    ref = reference_kv(seed, LAYERS, HEADS, tokens, HEAD_DIM)
    assert torch.equal(got["kv"].view(torch.int16), ref.view(torch.int16)), "decode pages differ from the unsharded reference"
    status = decode.call("status", cache="h4")
    assert status["metrics"]["last"]["path"] == "cuda_ipc" and status["metrics"]["last"]["nbytes"] == LAYERS * layer_bytes(HEADS, tokens)
    decode.call("free", cache="h4", pages=got["pages"])
    assert decode.call("status", cache="h4")["free_pages"] == decode_free


def test_cancel_keeps_pages_until_the_direct_writer_is_done(peers):
    decode, prefill = peers
    lease_s = 20.0
    jobs = _send(decode, prefill, "cancel", 160, 1, 32, 5, lease_s=lease_s, pace_s=0.3, progress_after_layer=1)
    peer, job = jobs[0]
    peer.wait(job, "progress")
    cancelled_at = time.monotonic()
    assert decode.call("cancel", cache="h4", request_id="cancel")
    status = decode.call("status", cache="h4")
    assert status["free_pages"] < PAGES and status["quarantined_pages"] > 0, status  # the writer is still at it
    result = peer.wait(job)
    assert result["ok"] and result["path"] == "cuda_ipc", result  # the sender does not learn of the cancel
    deadline = time.monotonic() + 10
    while decode.call("status", cache="h4")["free_pages"] != PAGES and time.monotonic() < deadline:
        time.sleep(0.05)
    status = decode.call("status", cache="h4")
    assert status["free_pages"] == PAGES and status["quarantined_pages"] == 0, status
    assert time.monotonic() - cancelled_at < lease_s  # freed once every head landed, not at the lease end


def test_killed_direct_writer_pages_return_only_after_lease_plus_grace(peers):
    """A prefill killed mid-transfer sends no "stopped": its pages wait for the lease + grace."""
    decode, _ = peers
    victim = Peer(spawn_context(), "prefill", device="cuda", visible="0,1", head_dim=HEAD_DIM)
    try:
        assert victim.call("ping")  # started (CUDA, UCX) before the lease clock runs
        lease_s = 4.0
        reserved = time.monotonic()
        ((_, job),) = _send(decode, [victim], "killed", 160, 1, 32, 6, lease_s=lease_s, pace_s=0.3, progress_after_layer=1)
        victim.wait(job, "progress")
        victim.kill()
        assert time.monotonic() - reserved < lease_s, "the victim was not killed mid-transfer"
        got = decode.call("wait", cache="h4", request_id="killed", timeout=20.0)
        assert not got["ok"] and got["error"] == "LeaseExpired", got
        status = decode.call("status", cache="h4")
        assert status["free_pages"] < PAGES and status["quarantined_pages"] > 0, status
        while decode.call("status", cache="h4")["free_pages"] != PAGES:
            assert time.monotonic() - reserved < lease_s + GRACE_S + 10, "quarantined pages never freed"
            time.sleep(0.05)
        assert time.monotonic() - reserved >= lease_s + GRACE_S - 0.1
    finally:
        victim.stop()


def test_sender_killed_before_its_announced_writes_ran_never_completes_the_request(peers):
    """"landed" headers go out as the writes are issued, with an event recorded after them:
    a sender killed while its writes still wait (behind a GPU sleep) must not complete the
    request; the pages come back after the lease + grace."""
    decode, _ = peers
    victim = Peer(spawn_context(), "prefill", device="cuda", visible="0,1", head_dim=HEAD_DIM)
    try:
        assert victim.call("ping")
        lease_s = 5.0
        reserved = time.monotonic()
        ((_, job),) = _send(decode, [victim], "stalled", 160, 1, 16, 8, lease_s=lease_s, stall_writes_s=60.0, progress_after_layer=LAYERS - 1)
        victim.wait(job, "progress")
        time.sleep(0.5)  # the "landed" headers are out: sent as the writes were issued
        victim.kill()
        got = decode.call("wait", cache="h4", request_id="stalled", timeout=20.0)
        assert not got["ok"] and got["error"] in ("LeaseExpired", "PeerFailed"), got
        while decode.call("status", cache="h4")["free_pages"] != PAGES:
            assert time.monotonic() - reserved < lease_s + GRACE_S + 10, "quarantined pages never freed"
            time.sleep(0.05)
    finally:
        victim.stop()


def test_writes_reaching_the_gpu_after_the_lease_write_nothing(peers):
    """Writes enqueued before the deadline but held on their stream (a GPU sleep) until past
    the lease deadline + guard: the kernel skips them, the decode pages keep what they held,
    the sender fails with TransferTimeout and the receiver never completes the request."""
    decode, _ = peers
    sender = Peer(spawn_context(), "prefill", device="cuda", visible="0,1", head_dim=HEAD_DIM)
    try:
        assert sender.call("ping")
        lease_s, tokens = 1.5, 160
        stall_s = lease_s + WRITE_GUARD_AFTER_LEASE_S + 1.5
        desc = decode.call("reserve", cache="h4", request_id="late", num_tokens=tokens, lease_s=lease_s)
        pages = msgspec.msgpack.decode(desc, type=KVTransferDescriptor).page_ids
        decode.call("fill", cache="h4", pages=pages, value=7.0)
        job = sender.submit("send", descriptor=desc, tp_rank=0, tp_size=1, page_size=16, seed=11, chunk_bytes=2 * layer_bytes(HEADS, tokens), timeout_s=20.0, stall_writes_s=stall_s)
        got = decode.call("wait", cache="h4", request_id="late", timeout=20.0)
        result = sender.wait(job, reply_timeout=stall_s + 20)
        assert not got["ok"] and got["error"] == "LeaseExpired", got
        assert not result["ok"] and result["error"] == "TransferTimeout" and result["path"] == "cuda_ipc", result
        assert result["elapsed_s"] >= stall_s - 0.5, result  # it waited for its held writes before reporting
        kv = decode.call("read", cache="h4", pages=pages, num_tokens=tokens)
        assert bool((kv == 7.0).all()), "writes that reached the GPU past the deadline wrote into the decode pages"
        deadline = time.monotonic() + GRACE_S + 10
        while decode.call("status", cache="h4")["free_pages"] != PAGES:
            assert time.monotonic() < deadline, "the pages never came back"
            time.sleep(0.05)
    finally:
        sender.stop()


def test_decode_killed_during_direct_writes_fails_the_sender_in_time():
    """The decode process dies while a prefill writes into its pages: the sender ends with a
    typed error within its deadline, holds nothing, and its process keeps working."""
    ctx = spawn_context()
    victim = Peer(ctx, "decode", device="cuda", visible="1,0", caches=CACHES, staging_slot_bytes=8 << 20)
    sender = Peer(ctx, "prefill", device="cuda", visible="0,1", head_dim=HEAD_DIM)
    try:
        assert sender.call("ping")
        timeout_s = 8.0
        desc = victim.call("reserve", cache="h4", request_id="victim", num_tokens=160, lease_s=30.0)
        job = sender.submit("send", descriptor=desc, tp_rank=0, tp_size=1, page_size=16, seed=9, chunk_bytes=2 * layer_bytes(HEADS, 160), timeout_s=timeout_s, pace_s=0.3, progress_after_layer=1)
        sender.wait(job, "progress")
        started = time.monotonic()
        victim.kill()
        result = sender.wait(job, reply_timeout=timeout_s + 10)
        assert not result["ok"] and result["error"] in ("PeerFailed", "TransferTimeout") and result["path"] == "cuda_ipc", result
        assert time.monotonic() - started < timeout_s + 2, result
        assert result["held_buffers"] == 0 and sender.call("status")["pool_buffers"] == 0, result
        assert sender.call("ping")  # the CUDA context survived writes into a dead process's memory
    finally:
        victim.stop()
        sender.stop()
