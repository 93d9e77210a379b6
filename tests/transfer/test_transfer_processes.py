"""KV transfer between real processes over real UCX endpoints (TCP loopback).

One decode rank and four prefill ranks are spawned once for the module; failure
tests that kill a process spawn their own victim. KV arrives bit-identical to the
unsharded reference (random bf16 from a fixed seed), and every failure ends in a
typed error with pages and staging accounted for.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import torch

from schemas.transfer import KVTransferDescriptor
from transfer_peers import Peer, reference_kv, spawn_context

pytestmark = pytest.mark.slow

LAYERS, HEAD_DIM, DECODE_PAGE = 6, 16, 16
CACHES = {
    "h4": {"num_layers": LAYERS, "num_pages": 96, "kv_heads": 4, "page_size": DECODE_PAGE, "head_dim": HEAD_DIM},
    "h2": {"num_layers": LAYERS, "num_pages": 64, "kv_heads": 2, "page_size": DECODE_PAGE, "head_dim": HEAD_DIM},
}
STAGING = 1 << 20


def layer_bytes(heads: int, tokens: int) -> int:
    return 2 * heads * tokens * HEAD_DIM * 2


@pytest.fixture(scope="module")
def ctx():
    return spawn_context()


@pytest.fixture(scope="module")
def decode(ctx):
    peer = Peer(ctx, "decode", caches=CACHES, staging_slot_bytes=STAGING)
    yield peer
    peer.stop()


@pytest.fixture(scope="module")
def prefill(ctx):
    peers = [Peer(ctx, "prefill") for _ in range(4)]
    yield peers
    for peer in peers:
        peer.stop()


def transfer(decode, prefill, cache, request_id, tokens, tp, page_size, seed, chunk_layers=2, lease_s=30.0):
    """Reserve on the decode rank and start every TP rank's send; return (send jobs, descriptor)."""
    desc = decode.call("reserve", cache=cache, request_id=request_id, num_tokens=tokens, lease_s=lease_s)
    heads = CACHES[cache]["kv_heads"]
    jobs = [
        (prefill[r], prefill[r].submit("send", descriptor=desc, tp_rank=r, tp_size=tp, page_size=page_size, seed=seed, chunk_bytes=chunk_layers * layer_bytes(max(1, heads // tp), tokens), timeout_s=20.0))
        for r in range(tp)
    ]
    return jobs, desc


def check_landed(decode, cache, request_id, tokens, seed, sends):
    results = [peer.wait(job) for peer, job in sends]
    assert all(r["ok"] for r in results), results
    assert all(r.get("held_buffers", 0) == 0 for r in results)
    got = decode.call("wait", cache=cache, request_id=request_id, timeout=20.0)
    assert got["ok"], got
    ref = reference_kv(seed, LAYERS, CACHES[cache]["kv_heads"], tokens, HEAD_DIM)
    assert got["kv"].shape == ref.shape
    assert torch.equal(got["kv"].view(torch.int16), ref.view(torch.int16)), "decode pages differ from the unsharded reference"
    decode.call("free", cache=cache, pages=got["pages"])
    return results, got


@pytest.mark.parametrize(
    "cache,tp,tokens,prefill_page",
    [
        ("h4", 1, 100, 16),  # same page size
        ("h4", 2, 37, 8),  # smaller prefill pages, partial last page
        ("h4", 4, 130, 32),  # larger prefill pages
        ("h2", 4, 65, 8),  # TP > KV heads: heads replicated, one replica sends
        ("h2", 2, 16, 16),  # exactly one page
    ],
)
def test_sharded_prefill_lands_bit_identical(decode, prefill, cache, tp, tokens, prefill_page):
    before = decode.call("status", cache=cache)
    rid = f"{cache}-tp{tp}-{tokens}"
    sends, _ = transfer(decode, prefill, cache, rid, tokens, tp, prefill_page, seed=tp * 1000 + tokens)
    results, got = check_landed(decode, cache, rid, tokens, tp * 1000 + tokens, sends)
    senders = [r for r in results if not r.get("skipped")]
    heads = CACHES[cache]["kv_heads"]
    assert len(senders) == min(tp, heads)  # replicas stay silent
    assert sum(r["bytes"] for r in senders) == LAYERS * layer_bytes(heads, tokens)
    if len(got["pages"]) > 1:  # the decode free list is shuffled: pages are scattered
        assert got["pages"] != list(range(got["pages"][0], got["pages"][0] + len(got["pages"])))
    after = decode.call("status", cache=cache)
    assert after["free_pages"] == before["free_pages"] and after["reservations"] == 0 and after["staging_in_use"] == 0
    assert after["metrics"]["completed"] == before["metrics"]["completed"] + 1


def test_several_requests_in_flight(decode, prefill):
    before = decode.call("status", cache="h4")
    requests = [("multi-a", 90, 11), ("multi-b", 47, 12), ("multi-c", 128, 13), ("multi-d", 5, 14)]
    in_flight = [(rid, tokens, seed, transfer(decode, prefill, "h4", rid, tokens, 2, 8, seed, chunk_layers=1)[0]) for rid, tokens, seed in requests]
    for rid, tokens, seed, sends in in_flight:
        check_landed(decode, "h4", rid, tokens, seed, sends)
    after = decode.call("status", cache="h4")
    assert after["free_pages"] == before["free_pages"] and after["staging_in_use"] == 0
    # The prefill ranks' shared send pools are all back once every send finished.
    assert all(peer.call("status") == {"pool_buffers": 0, "pool_bytes": 0} for peer in prefill[:2])


def test_cancelled_request_is_dropped_and_frees_pages(decode, prefill):
    before = decode.call("status", cache="h4")
    tokens = 64
    desc = decode.call("reserve", cache="h4", request_id="cancel-me", num_tokens=tokens, lease_s=20.0)
    reserved = decode.call("status", cache="h4")
    assert reserved["free_pages"] == before["free_pages"] - tokens // DECODE_PAGE
    send = prefill[0].submit("send", descriptor=desc, tp_rank=0, tp_size=1, page_size=16, seed=5, chunk_bytes=layer_bytes(4, tokens), timeout_s=15.0, pace_s=0.3, progress_after_layer=1)
    prefill[0].wait(send, kind="progress")
    assert decode.call("cancel", cache="h4", request_id="cancel-me")
    assert decode.call("status", cache="h4")["free_pages"] == before["free_pages"]  # freed at once
    outcome = decode.call("wait", cache="h4", request_id="cancel-me", timeout=5.0)
    assert not outcome["ok"] and outcome["error"] == "Cancelled"
    # The sender is drained, not left hanging until its deadline, and frees its staging.
    sent = prefill[0].wait(send)
    assert sent["ok"] and sent["elapsed_s"] < 10.0 and sent["held_buffers"] == 0 and sent["pool_buffers"] == 0
    after = decode.call("status", cache="h4")
    assert after["free_pages"] == before["free_pages"] and after["staging_in_use"] == 0
    assert after["metrics"]["failures"].get("cancelled", 0) == before["metrics"]["failures"].get("cancelled", 0) + 1


def test_cancelled_transfer_never_writes_freed_pages(decode, prefill):
    """Chunks that arrive after cancel() are discarded: the pages (poisoned beforehand) stay untouched."""
    tokens = 48
    desc = decode.call("reserve", cache="h2", request_id="poison", num_tokens=tokens, lease_s=20.0)
    pages = msgspec.msgpack.decode(desc, type=KVTransferDescriptor).page_ids
    decode.call("fill", cache="h2", pages=pages, value=7.0)
    send = prefill[1].submit("send", descriptor=desc, tp_rank=0, tp_size=1, page_size=8, seed=6, chunk_bytes=layer_bytes(2, tokens), timeout_s=15.0, pace_s=0.3, progress_after_layer=0)
    prefill[1].wait(send, kind="progress")
    time.sleep(0.1)
    assert decode.call("cancel", cache="h2", request_id="poison")
    assert prefill[1].wait(send)["ok"]
    kv = decode.call("read", cache="h2", pages=pages, num_tokens=tokens)
    untouched = [layer for layer in range(LAYERS) if bool((kv[layer].float() == 7.0).all())]
    assert untouched and untouched == list(range(untouched[0], LAYERS)), f"layers after the cancel point were written: untouched={untouched}"


def test_decode_killed_mid_transfer_fails_sender_within_deadline(ctx, prefill):
    victim = Peer(ctx, "decode", caches=CACHES, staging_slot_bytes=STAGING)
    try:
        tokens, timeout_s = 64, 6.0
        desc = victim.call("reserve", cache="h4", request_id="dead-decode", num_tokens=tokens, lease_s=30.0)
        send = prefill[2].submit("send", descriptor=desc, tp_rank=0, tp_size=1, page_size=16, seed=8, chunk_bytes=layer_bytes(4, tokens), timeout_s=timeout_s, pace_s=0.3, progress_after_layer=1)
        prefill[2].wait(send, kind="progress")
        victim.kill()
        result = prefill[2].wait(send, reply_timeout=timeout_s + 10)
    finally:
        victim.stop()
    assert not result["ok"] and result["error"] in ("PeerFailed", "TransferTimeout"), result
    assert result["elapsed_s"] <= timeout_s + 1.0
    assert result["held_buffers"] == 0 and result["pool_buffers"] == 0


def test_prefill_killed_reservation_expires_and_pages_return(ctx, decode):
    before = decode.call("status", cache="h4")
    victim = Peer(ctx, "prefill")
    try:
        assert victim.call("ping", reply_timeout=90)  # started: the lease below runs against a live sender
        tokens = 80
        desc = decode.call("reserve", cache="h4", request_id="dead-prefill", num_tokens=tokens, lease_s=3.0)
        assert decode.call("status", cache="h4")["free_pages"] == before["free_pages"] - 5
        send = victim.submit("send", descriptor=desc, tp_rank=0, tp_size=1, page_size=16, seed=9, chunk_bytes=layer_bytes(4, tokens), timeout_s=20.0, pace_s=0.3, progress_after_layer=1)
        victim.wait(send, kind="progress")
        victim.kill()
    finally:
        victim.stop()
    outcome = decode.call("wait", cache="h4", request_id="dead-prefill", timeout=10.0)
    assert outcome["elapsed_s"] < 6.0, outcome  # ended by the 3 s lease (or sooner), not by the 10 s wait
    # Killed between chunks, only the lease can tell; killed with a chunk on the wire, UCX
    # reports the reset connection first. Either way the request fails and its pages return.
    assert not outcome["ok"] and outcome["error"] in ("LeaseExpired", "PeerFailed"), outcome
    after = decode.call("status", cache="h4")
    assert after["free_pages"] == before["free_pages"] and after["reservations"] == 0
    # A chunk announced just before the kill keeps its staging slot until its receive can no
    # longer be matched (lease end + a 2 s margin); then the staging is all back.
    deadline = time.monotonic() + 10.0
    while after["staging_in_use"] and time.monotonic() < deadline:
        time.sleep(0.2)
        after = decode.call("status", cache="h4")
    assert after["staging_in_use"] == 0
    cause = {"LeaseExpired": "lease_expired", "PeerFailed": "peer_failed"}[outcome["error"]]
    assert after["metrics"]["failures"].get(cause, 0) == before["metrics"]["failures"].get(cause, 0) + 1
