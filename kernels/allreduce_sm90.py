"""The CuTeDSL kernels of the NVLink all-reduce (sm_90a): the Lamport (data-as-flag) one-shot and
two-shot, the barrier one-shot and the pipelined barrier two-shot, their launchers and their
compiled-kernel caches (one per dtype, world size and rank).

What each algorithm does, why re-arming and the barriers are safe, and what was measured is in
the docstring of ``kernels.allreduce``, whose ``CudaAllReduce`` maps the peer memory, chooses an
algorithm and launches these."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import cuda.bindings.driver as cuda_driver
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64

from kernels._cute_comm import (
    VEC_BYTES,
    cta_barrier,
    finish_launch,
    grid_stride,
    load_vec,
    load_vec_f32,
    load_volatile_v4,
    peer_base,
    read_epoch,
    sentinel_count,
    sentinel_free,
    store_v4,
    store_vec,
    wait_written_v4,
)

if TYPE_CHECKING:
    from cutlass.base_dsl.jit_executor import JitCompiledFunction

THREADS = 512  # threads per CTA of the one-shot kernels and the two-shot
# Barrier steps one launch may use: flag value = epoch * FLAG_STEPS + step, step >= 1.
FLAG_STEPS = 1 << 12
CUTE_DTYPES = {torch.bfloat16: cutlass.BFloat16, torch.float32: cutlass.Float32, torch.float16: cutlass.Float16}


def _vec(dtype) -> int:
    return VEC_BYTES * 8 // dtype.width


def slice_elems(count: int, world: int, vec: int) -> int:
    """Elements of one rank's slice of a ``count``-element chunk: ceil(count / world) rounded up to ``vec``."""
    return -(-(-(-count // world)) // vec) * vec


@cute.jit
def _slice_elems(count: Int32, world: cutlass.Constexpr, vec: cutlass.Constexpr) -> Int32:
    return ((count + world - 1) // world + vec - 1) // vec * vec


@cute.jit
def _add(acc, x):
    """``acc + x`` (fp32 fragments) into a fresh fragment."""
    res = cute.make_rmem_tensor((cute.size(x.shape),), cutlass.Float32)
    res.store(acc.load() + x.load())
    return res


@cute.jit
def _rank_ordered_sum(own_addr: Int64, own_valid: Int32, slot_row: Int64, slot_bytes: Int64, off: Int64,
                      dtype: cutlass.Constexpr, world: cutlass.Constexpr, rank: cutlass.Constexpr):
    """fp32 sum, in rank order, of my ``own_valid`` elements at ``own_addr`` and the peers'
    vectors at ``slot_row + slot_bytes * q + off`` (all loads issued before the first add),
    rounded to ``dtype``. The sum starts at rank 0's value, not at 0, which keeps -0.0
    like the reference."""
    vec = _vec(dtype)
    own = load_vec_f32(own_addr, dtype, vec, own_valid)
    parts = [own if q == rank else load_vec_f32(slot_row + slot_bytes * q + off, dtype, vec, vec) for q in range(world)]
    acc = parts[0]
    for q in cutlass.range_constexpr(1, world):
        acc = _add(acc, parts[q])
    red = cute.make_rmem_tensor((vec,), dtype)
    red.store(acc.load().to(dtype))
    return red


@cute.kernel
def _one_shot_kernel(
    inp: Int64, out: Int64, n: Int32, table: Int64, flags_off: Int64, slots_off: Int64, slot_bytes: Int64, ctrl: Int64,
    dtype: cutlass.Constexpr, world: cutlass.Constexpr, rank: cutlass.Constexpr,
):
    vec = _vec(dtype)
    esz = dtype.width // 8
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    nthr, _, _ = cute.arch.block_dim()
    nblk, _, _ = cute.arch.grid_dim()
    epoch = read_epoch(ctrl)
    slot_row = slots_off + Int64(epoch & 1) * world * slot_bytes
    bases = [peer_base(table, q) for q in range(world)]
    nvec = (n + vec - 1) // vec
    first = bid * nthr + tid
    stride = nblk * nthr

    for v in cutlass.range(first, nvec, stride):
        e0 = v * vec
        x = load_vec(inp + Int64(e0) * esz, dtype, vec, n - e0)
        for q in cutlass.range_constexpr(world):
            if cutlass.const_expr(q != rank):
                store_vec(bases[q] + slot_row + slot_bytes * rank + Int64(e0) * esz, x, dtype, vec, vec)

    cta_barrier(table, flags_off, rank, world, epoch * FLAG_STEPS + 1)

    mine = bases[rank] + slot_row
    for v in cutlass.range(first, nvec, stride):
        e0 = v * vec
        red = _rank_ordered_sum(inp + Int64(e0) * esz, n - e0, mine, slot_bytes, Int64(e0) * esz, dtype, world, rank)
        store_vec(out + Int64(e0) * esz, red, dtype, vec, n - e0)

    finish_launch(ctrl)


@cute.jit
def _words_of(frag):
    """A 16-byte register fragment as a fresh 4-word fragment with the sentinel pattern removed."""
    raw = cute.recast_tensor(frag, Int32)
    words = cute.make_rmem_tensor((4,), Int32)
    for i in cutlass.range_constexpr(4):
        words[i] = sentinel_free(raw[i], frag.element_type.width)
    return words


@cute.jit
def _payload_words(addr: Int64, valid: Int32, dtype: cutlass.Constexpr):
    """My vector at ``addr`` (elements past ``valid`` as 0) as 4 words with the sentinel pattern removed."""
    return _words_of(load_vec(addr, dtype, _vec(dtype), valid))


@cute.jit
def _words_f32(words, dtype: cutlass.Constexpr):
    """4 words holding one vector of ``dtype`` as an fp32 fragment."""
    res = cute.make_rmem_tensor((_vec(dtype),), Float32)
    res.store(cute.recast_tensor(words, dtype).load().to(Float32))
    return res


@cute.kernel
def _lamport_kernel(
    inp: Int64, out: Int64, n: Int32, table: Int64, lam_off: Int64, slot_bytes: Int64, ctrl: Int64,
    dtype: cutlass.Constexpr, world: cutlass.Constexpr, rank: cutlass.Constexpr,
):
    vec = _vec(dtype)
    esz = dtype.width // 8
    first, stride = grid_stride()
    row = lam_off + Int64(read_epoch(ctrl) & 1) * world * slot_bytes  # slot [parity][0]
    bases = [peer_base(table, q) for q in range(world)]
    nvec = (n + vec - 1) // vec

    # Push: my vectors into slot [parity][rank] of every peer. The data is the flag.
    for v in cutlass.range(first, nvec, stride):
        e0 = v * vec
        w = _payload_words(inp + Int64(e0) * esz, n - e0, dtype)
        for q in cutlass.range_constexpr(world):
            if cutlass.const_expr(q != rank):
                store_v4(bases[q] + row + slot_bytes * rank + Int64(e0) * esz, w[0], w[1], w[2], w[3])

    # Reduce: wait for each peer's vector in my buffer, sum in rank order, re-arm the slot.
    mine = bases[rank] + row
    for v in cutlass.range(first, nvec, stride):
        e0 = v * vec
        off = Int64(e0) * esz
        own = _payload_words(inp + off, n - e0, dtype)
        parts = []
        for q in cutlass.range_constexpr(world):
            if cutlass.const_expr(q == rank):
                parts.append(_words_f32(own, dtype))
            else:
                w0, w1, w2, w3 = wait_written_v4(mine + slot_bytes * q + off, dtype.width)
                got = cute.make_rmem_tensor((4,), Int32)
                got[0], got[1], got[2], got[3] = w0, w1, w2, w3
                parts.append(_words_f32(got, dtype))
        for q in cutlass.range_constexpr(world):
            if cutlass.const_expr(q != rank):
                store_v4(mine + slot_bytes * q + off, Int32(-1), Int32(-1), Int32(-1), Int32(-1))
        acc = parts[0]
        for q in cutlass.range_constexpr(1, world):
            acc = _add(acc, parts[q])
        red = cute.make_rmem_tensor((vec,), dtype)
        red.store(acc.load().to(dtype))
        store_vec(out + off, red, dtype, vec, n - e0)

    finish_launch(ctrl)


@cute.jit
def _store_words(addr: Int64, words, dtype: cutlass.Constexpr, valid: Int32):
    """Store a vector held as 4 words; only its first ``valid`` elements (a tensor's tail) are written."""
    if valid >= _vec(dtype):
        store_v4(addr, words[0], words[1], words[2], words[3])
    else:
        store_vec(addr, cute.recast_tensor(words, dtype), dtype, _vec(dtype), valid)


@cute.jit
def _wait_all_written(addrs, bits: cutlass.Constexpr, valid=None):
    """`wait_written_v4` on several vectors, with their first reads all in flight at once (one
    L2 round trip instead of one per vector when the data is already there); a vector still
    unwritten then spins on its own. ``valid`` (optional, per address): elements of the vector
    inside the tensor; one with none is never written, so it is not waited for. Returns one
    4-word fragment per address."""
    first = [load_volatile_v4(a) for a in addrs]
    res = []
    for i in cutlass.range_constexpr(len(addrs)):
        w0, w1, w2, w3 = first[i]
        pending = sentinel_count(w0, bits) + sentinel_count(w1, bits) + sentinel_count(w2, bits) + sentinel_count(w3, bits)
        if cutlass.const_expr(valid is not None):
            if valid[i] <= 0:
                pending = Int32(0)
        if pending > 0:
            w0, w1, w2, w3 = wait_written_v4(addrs[i], bits)
        got = cute.make_rmem_tensor((4,), Int32)
        got[0], got[1], got[2], got[3] = w0, w1, w2, w3
        res.append(got)
    return res


@cute.jit
def _rearm(addr: Int64):
    store_v4(addr, Int32(-1), Int32(-1), Int32(-1), Int32(-1))


@cute.kernel
def _lamport_two_shot_kernel(
    inp: Int64, out: Int64, n: Int32, table: Int64, lam_off: Int64, slot_bytes: Int64, ctrl: Int64,
    dtype: cutlass.Constexpr, world: cutlass.Constexpr, rank: cutlass.Constexpr,
):
    vec = _vec(dtype)
    esz = dtype.width // 8
    first, stride = grid_stride()
    scatter = lam_off + Int64(read_epoch(ctrl) & 1) * 2 * world * slot_bytes  # slot [parity][scatter][0]
    gather = scatter + world * slot_bytes  # slot [parity][gather][0]
    bases = [peer_base(table, q) for q in range(world)]
    peers = [q for q in range(world) if q != rank]
    mine = bases[rank]
    sl = _slice_elems(n, world, vec)
    # Every phase walks vector v of every slice with the same thread on every rank, so a
    # thread only ever waits for the threads of its own index on the other ranks.

    # Reduce-scatter: vector v of slice p -> rank p's scatter slot [rank]. The data is the flag.
    for v in cutlass.range(first, sl // vec, stride):
        off = Int64(v * vec) * esz
        ws = [_payload_words(inp + Int64(p * sl + v * vec) * esz, n - (p * sl + v * vec), dtype) for p in peers]
        for i in cutlass.range_constexpr(world - 1):
            if peers[i] * sl + v * vec < n:
                store_v4(bases[peers[i]] + scatter + slot_bytes * rank + off, ws[i][0], ws[i][1], ws[i][2], ws[i][3])

    # Reduce my slice: wait for the world - 1 pushed vectors, re-arm their slots, sum in rank
    # order, keep the result and push it to every peer's gather slot [rank].
    for v in cutlass.range(first, sl // vec, stride):
        e0 = rank * sl + v * vec
        if e0 < n:
            off = Int64(v * vec) * esz
            own = _payload_words(inp + Int64(e0) * esz, n - e0, dtype)
            slots = [mine + scatter + slot_bytes * q + off for q in peers]
            got = _wait_all_written(slots, dtype.width)
            for i in cutlass.range_constexpr(world - 1):
                _rearm(slots[i])
            parts = [_words_f32(w, dtype) for w in got[:rank] + [own] + got[rank:]]  # rank order
            acc = parts[0]
            for q in cutlass.range_constexpr(1, world):
                acc = _add(acc, parts[q])
            red = cute.make_rmem_tensor((vec,), dtype)
            red.store(acc.load().to(dtype))
            words = _words_of(red)
            for p in peers:
                store_v4(bases[p] + gather + slot_bytes * rank + off, words[0], words[1], words[2], words[3])
            _store_words(out + Int64(e0) * esz, words, dtype, n - e0)

    # All-gather: wait for the peers' reduced vectors, re-arm, copy them to my output.
    for v in cutlass.range(first, sl // vec, stride):
        off = Int64(v * vec) * esz
        slots = [mine + gather + slot_bytes * p + off for p in peers]
        valid = [n - (p * sl + v * vec) for p in peers]
        got = _wait_all_written(slots, dtype.width, valid)
        for i in cutlass.range_constexpr(world - 1):
            if valid[i] > 0:
                _rearm(slots[i])
                _store_words(out + Int64(peers[i] * sl + v * vec) * esz, got[i], dtype, valid[i])

    finish_launch(ctrl)


@cute.kernel
def _two_shot_kernel(
    inp: Int64, out: Int64, n: Int32, chunk_elems: Int32, table: Int64, flags_off: Int64, slots_off: Int64,
    slot_bytes: Int64, gather_off: Int64, ctrl: Int64,
    dtype: cutlass.Constexpr, world: cutlass.Constexpr, rank: cutlass.Constexpr,
):
    vec = _vec(dtype)
    esz = dtype.width // 8
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    nthr, _, _ = cute.arch.block_dim()
    nblk, _, _ = cute.arch.grid_dim()
    epoch = read_epoch(ctrl)
    flag0 = epoch * FLAG_STEPS
    slot_row = slots_off + Int64(epoch & 1) * world * slot_bytes  # offset of slot [parity][0] in any peer buffer
    bases = [peer_base(table, q) for q in range(world)]
    peers = [q for q in range(world) if q != rank]
    first = bid * nthr + tid
    stride = nblk * nthr
    full_slice = chunk_elems // world  # every chunk but the last is full
    num_chunks = (n + chunk_elems - 1) // chunk_elems

    for k in cutlass.range(0, num_chunks, 1):
        base = k * chunk_elems
        sl = _slice_elems(cutlass.min(chunk_elems, n - base), world, vec)
        svec = sl // vec
        prev = base - chunk_elems  # chunk k-1, full, when k > 0
        # A_k (+ C_{k-1}): from step 1 on, every thread also copies its part of the
        # previous chunk's gathered slices, so loop over the full slice length.
        hi = svec + cutlass.min(k, 1) * (full_slice // vec - svec)
        for v in cutlass.range(first, hi, stride):
            off = Int64(v * vec) * esz
            if v < svec:
                xs = [load_vec(inp + Int64(base + p * sl + v * vec) * esz, dtype, vec, n - (base + p * sl + v * vec))
                      for p in peers]
                for i in cutlass.range_constexpr(world - 1):
                    store_vec(bases[peers[i]] + slot_row + slot_bytes * rank + off, xs[i], dtype, vec, vec)
            if k > 0:
                ys = [load_vec(bases[rank] + gather_off + slot_bytes * p + off, dtype, vec, vec) for p in peers]
                for i in cutlass.range_constexpr(world - 1):
                    store_vec(out + Int64(prev + peers[i] * full_slice + v * vec) * esz, ys[i], dtype, vec, vec)

        cta_barrier(table, flags_off, rank, world, flag0 + 2 * k + 1)

        # B_k: reduce my slice, keep it, push it to every peer's gather row [rank].
        for v in cutlass.range(first, svec, stride):
            e0 = base + rank * sl + v * vec
            if e0 < n:
                off = Int64(v * vec) * esz
                red = _rank_ordered_sum(inp + Int64(e0) * esz, n - e0, bases[rank] + slot_row, slot_bytes, off, dtype, world, rank)
                store_vec(out + Int64(e0) * esz, red, dtype, vec, n - e0)
                for i in cutlass.range_constexpr(world - 1):
                    store_vec(bases[peers[i]] + gather_off + slot_bytes * rank + off, red, dtype, vec, vec)

        cta_barrier(table, flags_off, rank, world, flag0 + 2 * k + 2)

    # C of the last chunk.
    last = (num_chunks - 1) * chunk_elems
    sl = _slice_elems(n - last, world, vec)
    for v in cutlass.range(first, sl // vec, stride):
        off = Int64(v * vec) * esz
        for p in peers:
            e0 = last + p * sl + v * vec
            if e0 < n:
                y = load_vec(bases[rank] + gather_off + slot_bytes * p + off, dtype, vec, vec)
                store_vec(out + Int64(e0) * esz, y, dtype, vec, n - e0)

    finish_launch(ctrl)


@cute.jit
def _launch_one_shot(
    inp: Int64, out: Int64, n: Int32, table: Int64, flags_off: Int64, slots_off: Int64, slot_bytes: Int64, ctrl: Int64,
    grid: Int32, block: Int32, stream: cuda_driver.CUstream,
    dtype: cutlass.Constexpr, world: cutlass.Constexpr, rank: cutlass.Constexpr,
):
    _one_shot_kernel(inp, out, n, table, flags_off, slots_off, slot_bytes, ctrl, dtype, world, rank).launch(
        grid=[grid, 1, 1], block=[block, 1, 1], stream=stream
    )


@cute.jit
def _launch_lamport(
    inp: Int64, out: Int64, n: Int32, table: Int64, lam_off: Int64, slot_bytes: Int64, ctrl: Int64,
    grid: Int32, block: Int32, stream: cuda_driver.CUstream,
    dtype: cutlass.Constexpr, world: cutlass.Constexpr, rank: cutlass.Constexpr, two_shot: cutlass.Constexpr,
):
    # The two data-as-flag kernels take the same arguments; ``two_shot`` picks one at compile time.
    if cutlass.const_expr(two_shot):
        kernel = _lamport_two_shot_kernel(inp, out, n, table, lam_off, slot_bytes, ctrl, dtype, world, rank)
    else:
        kernel = _lamport_kernel(inp, out, n, table, lam_off, slot_bytes, ctrl, dtype, world, rank)
    kernel.launch(grid=[grid, 1, 1], block=[block, 1, 1], stream=stream)


@cute.jit
def _launch_two_shot(
    inp: Int64, out: Int64, n: Int32, chunk_elems: Int32, table: Int64, flags_off: Int64, slots_off: Int64,
    slot_bytes: Int64, gather_off: Int64, ctrl: Int64, grid: Int32, stream: cuda_driver.CUstream,
    dtype: cutlass.Constexpr, world: cutlass.Constexpr, rank: cutlass.Constexpr,
):
    _two_shot_kernel(
        inp, out, n, chunk_elems, table, flags_off, slots_off, slot_bytes, gather_off, ctrl, dtype, world, rank
    ).launch(grid=[grid, 1, 1], block=[THREADS, 1, 1], stream=stream)


@functools.cache
def compile_one_shot(dtype: torch.dtype, world: int, rank: int) -> JitCompiledFunction:
    """Compile (once per process) the one-shot kernel for a dtype, world size and rank."""
    from kernels._cute_runtime import dummy_stream

    z = Int64(0)
    return cute.compile(
        _launch_one_shot, z, z, Int32(0), z, z, z, z, z, Int32(1), Int32(1), dummy_stream(), CUTE_DTYPES[dtype], world, rank
    )


@functools.cache
def compile_lamport(dtype: torch.dtype, world: int, rank: int, two_shot: bool) -> JitCompiledFunction:
    """Compile (once per process) a data-as-flag kernel, one-shot or two-shot, for a dtype, world size and rank."""
    from kernels._cute_runtime import dummy_stream

    z = Int64(0)
    return cute.compile(
        _launch_lamport, z, z, Int32(0), z, z, z, z, Int32(1), Int32(1), dummy_stream(),
        CUTE_DTYPES[dtype], world, rank, two_shot,
    )


@functools.cache
def compile_two_shot(dtype: torch.dtype, world: int, rank: int) -> JitCompiledFunction:
    """Compile (once per process) the two-shot kernel for a dtype, world size and rank."""
    from kernels._cute_runtime import dummy_stream

    z = Int64(0)
    return cute.compile(
        _launch_two_shot, z, z, Int32(0), Int32(1), z, z, z, z, z, z, Int32(1), dummy_stream(),
        CUTE_DTYPES[dtype], world, rank,
    )
