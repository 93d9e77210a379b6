"""All-reduce (sum) over NVLink peer memory: one-shot and two-shot CuTeDSL kernels.

Both kernels *push*: a rank writes its data into slots in its peers' buffers (a
remote store costs the same as a remote load over NVLink, and pushing lets the
receiver reduce from its own HBM). Each CTA only ever synchronises with the CTA of
the same index on the other ranks, because all ranks split the message the same
way; no grid-wide barrier is needed.

* one-shot (small messages; up to 16 MiB for two ranks): push the whole input to
  every peer's slot ``[parity][my rank]``, one barrier, then every rank sums all
  ``world`` slots. Traffic per rank: (world-1) x message, latency: one barrier.
* two-shot (large messages): reduce-scatter then all-gather. Slice p of the input
  goes to rank p's slot; rank p sums its slice, keeps it in its result area and
  writes its own output; after a second barrier every rank pulls the other
  slices. Traffic per rank: 2 (world-1)/world x message.

A streamed one-shot (per-CTA steps with a flag per step, pushing step s while
reducing s-1) was tried and measured slower at every size on 2xH200 (commit
b730c5da9ea3 in bench/results/allreduce.jsonl): the per-step system-scope fences
cost more than the overlap gains.

Identical bits on every rank: sums run in fp32 in rank order 0..world-1 (one-shot:
each rank does the same arithmetic; two-shot: each slice is summed once and copied).

Buffer reuse without a trailing barrier: the slot area is double-buffered by epoch
parity. Before a rank writes slots of parity P in call k+1 it has passed call k's
barrier with the peer, so the peer's kernel of call k-1 (the last reader of parity
P) has completed. The two-shot result area is rewritten only after call k+1's first
barrier, by when every peer has finished call k.

Messages larger than the buffer run as several launches (chunks).
"""

from __future__ import annotations

import functools
from typing import Literal

import cuda.bindings.driver as cuda_driver
import cutlass
import cutlass.cute as cute
import torch
import torch.distributed as dist
from cutlass import Int32, Int64

from kernels._cute_comm import (
    MAX_BLOCKS,
    MAX_PEERS,
    VEC_BYTES,
    cta_barrier,
    finish_launch,
    load_vec_f32,
    peer_base,
    read_epoch,
    store_vec_f32,
)

Algorithm = Literal["one_shot", "two_shot"]
THREADS = 512
_CUTE_DTYPES = {torch.bfloat16: cutlass.BFloat16, torch.float32: cutlass.Float32, torch.float16: cutlass.Float16}
SUPPORTED_DTYPES = tuple(_CUTE_DTYPES)


class AllReduceError(ValueError):
    """An all-reduce was asked for something it cannot do (dtype, device, size, group)."""


# --------------------------------------------------------------------------- reference


def all_reduce_reference(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum of ``x`` over ``group``: fp32 accumulation in rank order, cast back to ``x.dtype``.

    The definition the kernels must match bit for bit. Works with any backend
    (gloo on CPU, NCCL on GPU); returns a new tensor.
    """
    world = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    return acc.to(x.dtype)


# --------------------------------------------------------------------------- kernels


def _vec(dtype) -> int:
    return VEC_BYTES * 8 // dtype.width


@cute.jit
def _accumulate(acc, x, first: cutlass.Constexpr):
    """``acc + x`` into a fresh fragment; ``first`` starts the sum at ``x`` (keeps -0.0 like the reference)."""
    res = cute.make_rmem_tensor((cute.size(x.shape),), cutlass.Float32)
    if cutlass.const_expr(first):
        res.store(x.load())
    else:
        res.store(acc.load() + x.load())
    return res


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
    parity_off = slots_off + Int64(epoch & 1) * world * slot_bytes
    bases = [peer_base(table, q) for q in range(world)]
    nvec = (n + vec - 1) // vec
    first = bid * nthr + tid
    stride = nblk * nthr

    for v in cutlass.range(first, nvec, stride):
        e0 = v * vec
        x = load_vec_f32(inp + Int64(e0) * esz, dtype, vec, n - e0)
        for q in cutlass.range_constexpr(world):
            if cutlass.const_expr(q != rank):
                dst = bases[q] + parity_off + slot_bytes * rank + Int64(e0) * esz
                store_vec_f32(dst, x, dtype, vec, vec)

    cta_barrier(table, flags_off, rank, world, epoch * 2 + 1)

    for v in cutlass.range(first, nvec, stride):
        e0 = v * vec
        acc = load_vec_f32(inp + Int64(e0) * esz, dtype, vec, n - e0)  # my part, used at q == rank
        mine = acc
        for q in cutlass.range_constexpr(world):
            if cutlass.const_expr(q != rank):
                x = load_vec_f32(bases[rank] + parity_off + slot_bytes * q + Int64(e0) * esz, dtype, vec, vec)
                acc = _accumulate(acc, x, q == 0)
            elif cutlass.const_expr(q != 0):
                acc = _accumulate(acc, mine, False)
        store_vec_f32(out + Int64(e0) * esz, acc, dtype, vec, n - e0)

    finish_launch(ctrl)


@cute.kernel
def _two_shot_kernel(
    inp: Int64, out: Int64, n: Int32, slice_elems: Int32, table: Int64, flags_off: Int64, slots_off: Int64,
    slot_bytes: Int64, results_off: Int64, ctrl: Int64,
    dtype: cutlass.Constexpr, world: cutlass.Constexpr, rank: cutlass.Constexpr,
):
    vec = _vec(dtype)
    esz = dtype.width // 8
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    nthr, _, _ = cute.arch.block_dim()
    nblk, _, _ = cute.arch.grid_dim()
    epoch = read_epoch(ctrl)
    parity_off = slots_off + Int64(epoch & 1) * world * slot_bytes
    bases = [peer_base(table, q) for q in range(world)]
    svec = slice_elems // vec
    first = bid * nthr + tid
    stride = nblk * nthr

    # Phase A (scatter): slice p of my input goes to rank p's slot [parity][rank].
    for v in cutlass.range(first, svec, stride):
        for p in cutlass.range_constexpr(world):
            if cutlass.const_expr(p != rank):
                e0 = p * slice_elems + v * vec
                x = load_vec_f32(inp + Int64(e0) * esz, dtype, vec, n - e0)
                dst = bases[p] + parity_off + slot_bytes * rank + Int64(v * vec) * esz
                store_vec_f32(dst, x, dtype, vec, vec)

    cta_barrier(table, flags_off, rank, world, epoch * 2 + 1)

    # Phase B (reduce my slice): rank order 0..world-1, my own part straight from the input.
    mine = rank * slice_elems
    for v in cutlass.range(first, svec, stride):
        e0 = mine + v * vec
        if e0 < n:
            acc = load_vec_f32(inp + Int64(e0) * esz, dtype, vec, n - e0)  # my part, used at q == rank
            own = acc
            for q in cutlass.range_constexpr(world):
                if cutlass.const_expr(q != rank):
                    x = load_vec_f32(bases[rank] + parity_off + slot_bytes * q + Int64(v * vec) * esz, dtype, vec, vec)
                    acc = _accumulate(acc, x, q == 0)
                elif cutlass.const_expr(q != 0):
                    acc = _accumulate(acc, own, False)
            store_vec_f32(out + Int64(e0) * esz, acc, dtype, vec, n - e0)
            store_vec_f32(bases[rank] + results_off + Int64(v * vec) * esz, acc, dtype, vec, vec)

    cta_barrier(table, flags_off, rank, world, epoch * 2 + 2)

    # Phase C (gather): pull every other rank's reduced slice.
    for v in cutlass.range(first, svec, stride):
        for p in cutlass.range_constexpr(world):
            if cutlass.const_expr(p != rank):
                e0 = p * slice_elems + v * vec
                if e0 < n:
                    x = load_vec_f32(bases[p] + results_off + Int64(v * vec) * esz, dtype, vec, vec)
                    store_vec_f32(out + Int64(e0) * esz, x, dtype, vec, n - e0)

    finish_launch(ctrl)


@cute.jit
def _launch_one_shot(
    inp: Int64, out: Int64, n: Int32, table: Int64, flags_off: Int64, slots_off: Int64, slot_bytes: Int64, ctrl: Int64,
    grid: Int32, stream: cuda_driver.CUstream, dtype: cutlass.Constexpr, world: cutlass.Constexpr, rank: cutlass.Constexpr,
):
    _one_shot_kernel(inp, out, n, table, flags_off, slots_off, slot_bytes, ctrl, dtype, world, rank).launch(
        grid=[grid, 1, 1], block=[THREADS, 1, 1], stream=stream
    )


@cute.jit
def _launch_two_shot(
    inp: Int64, out: Int64, n: Int32, slice_elems: Int32, table: Int64, flags_off: Int64, slots_off: Int64,
    slot_bytes: Int64, results_off: Int64, ctrl: Int64, grid: Int32, stream: cuda_driver.CUstream,
    dtype: cutlass.Constexpr, world: cutlass.Constexpr, rank: cutlass.Constexpr,
):
    _two_shot_kernel(
        inp, out, n, slice_elems, table, flags_off, slots_off, slot_bytes, results_off, ctrl, dtype, world, rank
    ).launch(grid=[grid, 1, 1], block=[THREADS, 1, 1], stream=stream)


@functools.cache
def compile_one_shot(dtype: torch.dtype, world: int, rank: int):
    """Compile (once per process) the one-shot kernel for a dtype, world size and rank."""
    from kernels._cute_runtime import dummy_stream

    z = Int64(0)
    return cute.compile(
        _launch_one_shot, z, z, Int32(0), z, z, z, z, z, Int32(1), dummy_stream(), _CUTE_DTYPES[dtype], world, rank
    )


@functools.cache
def compile_two_shot(dtype: torch.dtype, world: int, rank: int):
    """Compile (once per process) the two-shot kernel for a dtype, world size and rank."""
    from kernels._cute_runtime import dummy_stream

    z = Int64(0)
    return cute.compile(
        _launch_two_shot, z, z, Int32(0), Int32(0), z, z, z, z, z, z, Int32(1), dummy_stream(),
        _CUTE_DTYPES[dtype], world, rank,
    )


# --------------------------------------------------------------------------- host side


def default_one_shot_max_bytes(world: int) -> int:
    """Largest message sent one-shot.

    Per rank, one-shot moves (world-1) x the message over NVLink and two-shot
    2 (world-1)/world x: the same for two ranks, where one-shot (one barrier, no
    gather phase) measured faster up to 16 MiB on 2xH200 (bench/results/allreduce.jsonl,
    commit 3ccfd220dd44: 16 MiB 63.0 us vs 69.5 us) and two-shot faster above.
    """
    return 16 << 20 if world == 2 else 256 << 10


class CudaAllReduce:
    """All-reduce over a process group with the CuTeDSL kernels (one instance per group).

    Construction is collective (it maps peer memory on every rank). Calls are
    stream-ordered, host-sync free and can be captured in CUDA graphs; every rank
    must issue the same sequence of calls with the same sizes.
    """

    def __init__(self, group: dist.ProcessGroup, slot_bytes: int = 32 << 20, one_shot_max_bytes: int | None = None) -> None:
        from kernels.peer_memory import PeerMemory, RegionLayout

        world = dist.get_world_size(group)
        if not 2 <= world <= 8:
            raise AllReduceError(f"all-reduce supports 2..8 ranks, group has {world}")
        self.world = world
        self.slot_bytes = -(-slot_bytes // 256) * 256
        layout = RegionLayout()
        layout.add("flags", MAX_BLOCKS * MAX_PEERS * 4)
        layout.add("slots", 2 * world * self.slot_bytes)
        layout.add("results", self.slot_bytes)
        self.mem = PeerMemory(group, layout)
        self.rank = self.mem.rank
        self.one_shot_max_bytes = default_one_shot_max_bytes(world) if one_shot_max_bytes is None else one_shot_max_bytes

    def warmup(self, dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)) -> None:
        """Compile, load and run every kernel once (collective; do it before CUDA-graph capture,
        where loading a module is not allowed)."""
        for dt in dtypes:
            x = torch.ones(4 * self.world * VEC_BYTES, dtype=dt, device=self.mem.device)
            self(x, algorithm="one_shot")
            self(x, algorithm="two_shot")
        torch.cuda.synchronize(self.mem.device)

    def choose(self, nbytes: int) -> Algorithm:
        return "one_shot" if nbytes <= self.one_shot_max_bytes else "two_shot"

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None, algorithm: Algorithm | None = None) -> torch.Tensor:
        """Sum ``x`` over the group into ``out`` (new tensor if None; ``out=x`` is in place)."""
        from kernels._cute_runtime import current_stream

        _check_input(x, self.mem.device)
        if out is None:
            out = torch.empty_like(x)
        elif out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous() or out.device != x.device:
            raise AllReduceError(f"out must be a contiguous {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}")
        if x.numel() == 0:
            return out
        algo = algorithm or self.choose(x.numel() * x.element_size())
        esz = x.element_size()
        vec = VEC_BYTES // esz
        slot_elems = self.slot_bytes // esz
        chunk = slot_elems if algo == "one_shot" else slot_elems * self.world
        stream = current_stream()
        mem = self.mem
        flat_in, flat_out = x.view(-1), out.view(-1)
        for start in range(0, x.numel(), chunk):
            n = min(chunk, x.numel() - start)
            src, dst = flat_in[start].data_ptr(), flat_out[start].data_ptr()
            if algo == "one_shot":
                grid = min(-(-n // (vec * THREADS)), MAX_BLOCKS)
                compile_one_shot(x.dtype, self.world, self.rank)(
                    src, dst, n, mem.peer_table.data_ptr(), mem.layout["flags"], mem.layout["slots"], self.slot_bytes,
                    mem.control.data_ptr(), grid, stream,
                )
            else:
                slice_elems = -(-(-(-n // self.world)) // vec) * vec
                grid = min(-(-slice_elems // (vec * THREADS)), MAX_BLOCKS)
                compile_two_shot(x.dtype, self.world, self.rank)(
                    src, dst, n, slice_elems, mem.peer_table.data_ptr(), mem.layout["flags"], mem.layout["slots"],
                    self.slot_bytes, mem.layout["results"], mem.control.data_ptr(), grid, stream,
                )
        return out


def _check_input(x: torch.Tensor, device: torch.device) -> None:
    if x.dtype not in _CUTE_DTYPES:
        raise AllReduceError(f"all-reduce supports {list(_CUTE_DTYPES)}, got {x.dtype}")
    if x.device != device:
        raise AllReduceError(f"tensor is on {x.device}, the communicator on {device}")
    if not x.is_contiguous():
        raise AllReduceError("all-reduce needs a contiguous tensor")
    if x.data_ptr() % VEC_BYTES:
        raise AllReduceError(f"all-reduce needs a {VEC_BYTES}-byte aligned tensor (got address {x.data_ptr():#x})")
    if x.numel() >= 2**31:
        raise AllReduceError(f"tensor of {x.numel()} elements is too large (limit 2**31 - 1)")


_COMMUNICATORS: dict[str, CudaAllReduce] = {}


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Sum ``x`` over ``group``: the CuTeDSL kernels on CUDA, the torch reference elsewhere.

    ``out=None`` returns a new tensor, ``out=x`` reduces in place. The first CUDA call
    for a group is collective (maps peer memory) and must not happen during graph
    capture.
    """
    group = group or dist.group.WORLD
    if not x.is_cuda:
        result = all_reduce_reference(x, group)
        if out is None:
            return result
        out.copy_(result)
        return out
    comm = _COMMUNICATORS.get(group.group_name)
    if comm is None:
        comm = _COMMUNICATORS[group.group_name] = CudaAllReduce(group)
    return comm(x, out)
