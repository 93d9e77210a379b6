"""The KV page-to-page copy (kernels/kv_copy.py).

CPU (CI): the kernel compiles for sm_90a at every access width, moving each vector with
one load and one store of that width, loads ahead of stores, and no NVLink multicast
instruction, behind a ``%globaltimer`` deadline check; the torch reference (and ``KVCopy``
on CPU tensors) equals a token-by-token loop; a copy past its deadline writes nothing and
says so; bad calls are refused with ``KVCopyError``.
GPU: the kernel writes what the reference writes (every dtype and access width) and
nothing else, through its own launcher; past its deadline it writes nothing, reports the
GPU clock it saw, and the host-to-GPU clock relation holds to well under a millisecond.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import numpy as np
import pytest
import torch

import cutlass.cute as cute
from kernels import kv_copy as kc
from kernels import kv_copy_sm90 as sm90
from kernels._cute_runtime import dummy_stream
from shared.transfer.direct_write import plan_rows

FP8 = torch.float8_e4m3fn


# --------------------------------------------------------------------------- compilation


@pytest.mark.parametrize("vector_bytes,access", [(16, "v4.b32"), (8, "v2.b32"), (4, "b32"), (2, "b16")])
def test_kernel_compiles_for_sm90a_with_one_access_per_vector(vector_bytes, access, tmp_path, monkeypatch):
    assert sm90.compile_kv_copy(vector_bytes) is not None
    monkeypatch.chdir(tmp_path)  # --keep-ptx writes its file into the working directory
    ptx = cute.compile(sm90._launch_kv_copy, *sm90.compile_args(dummy_stream()), vector_bytes, options="--keep-ptx").__ptx__
    assert ".target sm_90a" in ptx and "multimem" not in ptx
    body = [line.split()[0] for line in ptx.splitlines() if line.strip().startswith(("ld.global", "st.global"))]
    guard, *stores = [op for op in body if op.startswith("st.")]
    assert "%globaltimer" in ptx and guard == "st.global.b64"  # the deadline guard's skip word comes first
    assert len(stores) >= sm90.UNROLL + 1 and set(stores) == {f"st.global.{access}"}  # the unrolled loop and the tail
    assert body.count(f"ld.global.{access}") >= len(stores)
    first_store = body.index(f"st.global.{access}")
    assert body[first_store - sm90.UNROLL : first_store] == [f"ld.global.{access}"] * sm90.UNROLL  # UNROLL loads in flight


def test_unknown_width_is_refused():
    with pytest.raises(kc.KVCopyError, match="12-byte"):
        sm90.compile_kv_copy(12)


# --------------------------------------------------------------------------- reference


def _loop_copy(src, src_table, dst, dst_table, layers, head_start, num_tokens):
    """Token by token, the definition in words: token t of every source head lands in the
    destination heads from ``head_start``, each side at its own page and slot."""
    heads = src.shape[3]
    for layer in layers:
        for t in range(num_tokens):
            s_page, s_slot = divmod(t, src.shape[4])
            d_page, d_slot = divmod(t, dst.shape[4])
            dst[layer, int(dst_table[d_page]), :, head_start : head_start + heads, d_slot] = src[layer, int(src_table[s_page]), :, :, s_slot]


def _pools(dtype, layers, src_pages, dst_pages, src_heads, dst_heads, src_ps, dst_ps, dim, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(layers, src_pages, 2, src_heads, src_ps, dim, generator=g).to(dtype).to(device)
    dst = torch.randn(layers, dst_pages, 2, dst_heads, dst_ps, dim, generator=g).to(dtype).to(device)
    return src, dst


def _tables(src_pages, dst_pages, src_ps, dst_ps, tokens, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(src_pages, generator=g)[: -(-tokens // src_ps)], torch.randperm(dst_pages, generator=g)[: -(-tokens // dst_ps)]


CASES = [  # dtype, src page, dst page, src heads, dst heads, head start, head_dim, tokens, layers copied
    (torch.bfloat16, 16, 16, 4, 4, 0, 8, 37, range(3)),
    (torch.float16, 16, 16, 2, 4, 2, 8, 33, range(1, 3)),
    (torch.float32, 32, 16, 1, 4, 1, 4, 50, range(2, 3)),
    (FP8, 8, 16, 2, 4, 0, 16, 17, range(3)),
    (torch.bfloat16, 24, 16, 4, 8, 4, 8, 1, range(3)),
]


@pytest.mark.parametrize("dtype,src_ps,dst_ps,src_heads,dst_heads,head_start,dim,tokens,layers", CASES)
def test_reference_and_cpu_kv_copy_equal_a_token_loop(dtype, src_ps, dst_ps, src_heads, dst_heads, head_start, dim, tokens, layers):
    src, dst = _pools(dtype, 3, 9, 10, src_heads, dst_heads, src_ps, dst_ps, dim, seed=tokens)
    src_table, dst_table = _tables(9, 10, src_ps, dst_ps, tokens, seed=tokens + 1)
    expected = dst.clone()
    _loop_copy(src, src_table, expected, dst_table, layers, head_start, tokens)
    got = dst.clone()
    kc.kv_copy_reference(src, src_table, got, dst_table, layers, head_start, tokens)
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    assert not torch.equal(got.view(torch.uint8), dst.view(torch.uint8))  # the copy wrote something
    routed = dst.clone()
    kc.KVCopy(kc.CopyRoute(src, routed, plan_rows(src, dst, head_start)), src_table.numpy(), dst_table.tolist(), tokens).copy(layers)
    assert torch.equal(routed.view(torch.uint8), expected.view(torch.uint8))


def test_copy_past_its_deadline_writes_nothing_and_says_so():
    src, dst = _pools(torch.bfloat16, 2, 4, 4, 2, 4, 16, 16, 8)
    table = torch.arange(2)
    rows = plan_rows(src, dst, 2)
    now_ns = kc.device_time_ns(src.device, time.time())
    assert abs(now_ns - time.time_ns()) < 10**8  # the CPU's "device" clock is the host's
    late = dst.clone()
    copy = kc.KVCopy(kc.CopyRoute(src, late, rows), table, table, 20, deadline_ns=now_ns - 1)
    copy.copy(range(2))
    assert torch.equal(late.view(torch.uint8), dst.view(torch.uint8)) and copy.skipped_at_ns >= now_ns
    in_time = dst.clone()
    copy = kc.KVCopy(kc.CopyRoute(src, in_time, rows), table, table, 20, deadline_ns=now_ns + 60 * 10**9)
    copy.copy(range(2))
    assert not torch.equal(in_time.view(torch.uint8), dst.view(torch.uint8)) and copy.skipped_at_ns is None


def test_bad_calls_are_refused():
    src, dst = _pools(torch.bfloat16, 2, 4, 4, 2, 4, 16, 16, 8)
    rows = plan_rows(src, dst, 0)
    route = kc.CopyRoute(src, dst, rows)
    table = torch.arange(2)
    with pytest.raises(kc.KVCopyError, match="one dtype"):
        kc.CopyRoute(src, dst.float(), rows)
    with pytest.raises(kc.KVCopyError, match="destination page table must list at least 2 integer page ids"):
        kc.KVCopy(route, table, table[:1], 20)
    with pytest.raises(kc.KVCopyError, match="source page table must list at least 2 integer page ids"):
        kc.KVCopy(route, table.float(), table, 20)
    with pytest.raises(kc.KVCopyError, match="the pools hold layers 0..1"):
        kc.KVCopy(route, table, table, 20).copy(range(1, 3))
    # Ids outside a pool, negative ones and int64 ids that would wrap into range as int32 included:
    # refused before anything is copied (on CUDA the slot they were packed into goes back unused).
    for bad in (torch.tensor([0, 4]), np.array([-1, 0], dtype=np.int32), np.array([0, 2**32 + 1], dtype=np.int64), [3, -2]):
        with pytest.raises(kc.KVCopyError, match="destination page table names pages outside 0..3"):
            kc.KVCopy(route, table, bad, 20)
        with pytest.raises(kc.KVCopyError, match="source page table names pages outside 0..3"):
            kc.KVCopy(route, bad, table, 20)
    kc.KVCopy(route, np.array([3, 0, -7]), table, 20)  # past the pages the tokens need: not read
    del src, dst
    with pytest.raises(kc.KVCopyError, match="pools were freed"):  # a route refers to its pools weakly
        kc.KVCopy(route, table, table, 20)


def test_page_ids_are_checked_at_both_ends_whatever_their_form():
    """Page ids from lists (descriptors, allocators: packed straight into a slot's words), arrays
    or tensors: the side is named, a short table, a non-integer, a negative id, an id past the
    pool or one past int32 is refused, and ids past the ones the tokens need are not read."""
    out = np.full(8, -1, dtype=np.int32)
    kc._fill_page_ids("destination", [4, 0, 7, 99], 3, 10, out)
    assert out[:4].tolist() == [4, 0, 7, -1]
    kc._fill_page_ids("destination", [9, 1, 2], 3, 10, out)  # a list of exactly the ids needed
    assert out[:4].tolist() == [9, 1, 2, -1]
    for table in ([1, 2], np.array([1, 2]), torch.tensor([1, 2])):
        with pytest.raises(kc.KVCopyError, match="source page table must list at least 3 integer page ids"):
            kc._fill_page_ids("source", table, 3, 10, out)
    for bad in ([1, 10, 3], [1, -1, 3], [1, 2, 2**31], [2**32 - 1, 0, 0], [0, 2**40, 1], [0, np.int64(-3), 1], np.array([1, 2, 10], dtype=np.int64),
                np.array([1, -2, 3], dtype=np.int32), torch.tensor([10, 0, 0])):
        with pytest.raises(kc.KVCopyError, match="source page table names pages outside 0..9"):
            kc._fill_page_ids("source", bad, 3, 10, out)
    with pytest.raises(kc.KVCopyError, match="decode page table must hold integer page ids"):
        kc._fill_page_ids("decode", [0, 1.5, 1], 3, 10, out)
    for bad in (np.array([1.0, 2.0, 3.0]), [0.5], [2**64]):
        with pytest.raises(kc.KVCopyError, match="integer page ids"):
            kc.page_ids("decode", bad, 1, 10)
    assert kc.page_ids("decode", np.array([1, 2, 9, -5], dtype=np.int16), 3, 10).tolist() == [1, 2, 9]


# --------------------------------------------------------------------------- GPU


def test_fixed_launch_parameters_follow_the_pools():
    """The launch parameters a pool pair fixes (kept with its ``CopyRoute``): another destination
    pool (a decode rank's new export) gets its own address, a pool of another shape at the same
    address its own strides."""
    src = torch.zeros(2, 5, 2, 2, 16, 8, dtype=torch.bfloat16)
    dst_a, dst_b = torch.zeros(2, 6, 2, 4, 16, 8, dtype=torch.bfloat16), torch.zeros(2, 6, 2, 4, 16, 8, dtype=torch.bfloat16)
    rows = plan_rows(src, dst_a, 2)
    names = kc.LAUNCH_PARAMS
    a, b = kc._fixed_launch_params(src, dst_a, rows), kc._fixed_launch_params(src, dst_b, rows)
    head_bytes = 16 * 8 * 2  # one head of one K/V half of a page: page_size x head_dim bf16
    assert a[names.index("dst")] == dst_a.data_ptr() + 2 * head_bytes and b[names.index("dst")] == dst_b.data_ptr() + 2 * head_bytes
    wide = dst_a.view(2, 3, 2, 8, 16, 8)  # same address, pages of 8 heads
    page = kc._fixed_launch_params(src, wide, plan_rows(src, wide, 2))[names.index("dst_page")]
    assert page * rows.vector_bytes == 2 * 8 * head_bytes != a[names.index("dst_page")] * rows.vector_bytes


GPU_CASES = [  # dtype, head_dim -> access width of plan_rows
    (torch.bfloat16, 64, 16),
    (torch.bfloat16, 80, 16),  # TP=1 rows of 1280 vectors: the unrolled loop and the tail in one row
    (FP8, 64, 16),
    (torch.float32, 2, 8),
    (torch.bfloat16, 2, 4),
    (FP8, 2, 2),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,dim,width", GPU_CASES)
@pytest.mark.parametrize("src_ps,dst_ps,src_heads", [(16, 16, 4), (16, 16, 2), (32, 16, 1)])
def test_kernel_writes_what_the_reference_writes(dtype, dim, width, src_ps, dst_ps, src_heads):
    dst_heads, head_start, tokens = 4, 4 - src_heads, 301
    src, dst = _pools(dtype, 3, 40, 30, src_heads, dst_heads, src_ps, dst_ps, dim, device="cuda", seed=dim)
    src_table, dst_table = _tables(40, 30, src_ps, dst_ps, tokens, seed=src_ps)
    rows = plan_rows(src, dst, head_start)
    assert rows.vector_bytes == width
    expected = dst.clone()
    kc.kv_copy_reference(src, src_table.cuda(), expected, dst_table.cuda(), range(1, 3), head_start, tokens)
    got = dst.clone()
    copy = kc.KVCopy(kc.CopyRoute(src, got, rows), src_table, dst_table.numpy(), tokens)
    copy.copy(range(2, 3))  # two launches of one set-up, the later layer first
    copy.copy(range(1, 2))
    torch.cuda.synchronize()
    # Equal except the last block's slots past `tokens` (copied whole by the kernel, inside the sequence's last pages).
    last = dst_table[-1].item()
    keep = torch.ones(30, dtype=torch.bool)
    keep[last] = False
    assert torch.equal(got[:, keep].view(torch.uint8), expected[:, keep].view(torch.uint8))
    slot = tokens % dst_ps
    assert torch.equal(got[:, last, :, :, :slot].view(torch.uint8), expected[:, last, :, :, :slot].view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_past_its_deadline_writes_nothing_and_the_clocks_agree():
    src, dst = _pools(torch.bfloat16, 3, 40, 30, 2, 4, 16, 16, 64, device="cuda", seed=3)
    src_table, dst_table = _tables(40, 30, 16, 16, 301, seed=4)
    rows = plan_rows(src, dst, 2)
    kc.prepare_kv_copy(src.device, rows.vector_bytes)  # relates the GPU clock to the host's
    before = time.time()
    now_ns = kc.device_time_ns(src.device, before)
    late = dst.clone()
    copy = kc.KVCopy(kc.CopyRoute(src, late, rows), src_table, dst_table, 301, deadline_ns=now_ns)
    copy.copy(range(3))
    torch.cuda.synchronize()
    after_ns = kc.device_time_ns(src.device, time.time())
    assert torch.equal(late.view(torch.uint8), dst.view(torch.uint8)), "a copy past its deadline wrote"
    assert copy.skipped_at_ns is not None and now_ns - 10**6 < copy.skipped_at_ns < after_ns + 10**6, (now_ns, copy.skipped_at_ns, after_ns)
    in_time = dst.clone()
    copy = kc.KVCopy(kc.CopyRoute(src, in_time, rows), src_table, dst_table, 301, deadline_ns=kc.device_time_ns(src.device, time.time() + 60))
    copy.copy(range(3))
    torch.cuda.synchronize()
    assert copy.skipped_at_ns is None and not torch.equal(in_time.view(torch.uint8), dst.view(torch.uint8))
    assert torch.equal(in_time[:, :, :, :2].view(torch.uint8), dst[:, :, :, :2].view(torch.uint8))  # only heads [2, 4) written


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_parameter_slots_are_reused_only_once_their_copy_ran():
    """Copies of one route take parameter slots in turn: a slot released while its copy still
    waits on the GPU (behind a sleep) is not handed to the next copy, whose tables would
    otherwise overwrite the waiting copy's before its upload ran; once the work ran the slot
    comes back, and at once when released as having run. Every copy lands its own pages, and
    a released copy cannot launch again."""
    src, dst = _pools(torch.bfloat16, 3, 40, 30, 4, 4, 16, 16, 64, device="cuda", seed=5)
    stream = torch.cuda.Stream()
    tables = [_tables(40, 30, 16, 16, 304, seed=s) for s in (6, 7, 8)]
    expected = dst.clone()
    for src_table, dst_table in tables[:2]:
        kc.kv_copy_reference(src, src_table.cuda(), expected, dst_table.cuda(), range(3), 0, 304)
    got = dst.clone()
    route = kc.CopyRoute(src, got, plan_rows(src, dst, 0), stream)  # whole pages: the kernel and the reference write the same bytes
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(0.3 * 2e9))  # ~0.3 s: the first copy's upload and launch wait behind it
    first = kc.KVCopy(route, tables[0][0], tables[0][1], 304)
    first.copy(range(3))
    first.release()
    with pytest.raises(kc.KVCopyError, match="released"):
        first.copy(range(3))
    second = kc.KVCopy(route, tables[1][0], tables[1][1], 304)
    assert second._launcher is not first._launcher, "a slot whose copy had not run was taken again"
    second.copy(range(3))
    second.release()
    stream.synchronize()
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    third = kc.KVCopy(route, tables[2][0], tables[2][1], 304)
    assert third._launcher in (first._launcher, second._launcher), "a slot whose copy ran was not reused"
    third.copy(range(3))
    fourth = kc.KVCopy(route, tables[0][0], tables[0][1], 304)  # the other idle slot: none left free
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(0.3 * 2e9))
    fourth.release()  # its slot waits behind the sleep
    third.release(ran=True)  # the caller saw its work complete: free at once, no event asked
    fifth = kc.KVCopy(route, tables[1][0], tables[1][1], 304)
    assert fifth._launcher is third._launcher and fifth._launcher is not fourth._launcher
    stream.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_collected_routes_pending_slots_live_until_their_work_ran():
    """A route dropped while a released copy's upload still waits on its stream (behind a sleep)
    keeps that slot alive (its pinned words must not go back to the host allocator before the
    upload read them) until the work ran; then the next retirement lets it go."""
    import gc

    src, dst = _pools(torch.bfloat16, 2, 8, 8, 4, 4, 16, 16, 64, device="cuda", seed=9)
    stream = torch.cuda.Stream()
    route = kc.CopyRoute(src, dst, plan_rows(src, dst, 0), stream)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(0.3 * 2e9))
    copy = kc.KVCopy(route, [0, 1], [2, 3], 20)
    copy.copy(range(2))
    copy.release()
    (slot,) = (s for slots in route._free.values() for s in slots)
    assert slot.pending
    del copy, route
    gc.collect()
    assert slot in kc._retiring, "a pending slot of a collected route was dropped"
    stream.synchronize()
    kc._retire({})
    assert slot not in kc._retiring
