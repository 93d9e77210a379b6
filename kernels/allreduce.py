"""All-reduce (sum) over NVLink peer memory: one-shot and two-shot CuTeDSL kernels.

All kernels *push*: a rank writes its data into slots in its peers' buffers with
plain stores (fire-and-forget over NVLink, so the link stays busy without many
loads in flight) and reduces from its own HBM. Each CTA only ever synchronises
with the CTA of the same index on the other ranks, because all ranks split the
message the same way; no grid-wide barrier is needed.

* lamport (small messages, ``CudaAllReduce.lamport_max_bytes``): the one-shot with
  the data as its own flag. Slots start filled with all-ones bytes (a NaN pattern in
  bf16, fp16 and fp32). Each thread pushes its vectors to every peer's slot
  ``[parity][my rank]``, then spins (``ld.volatile``) on the peers' vectors in its own
  buffer until no element is all-ones, sums in rank order and writes all-ones back.
  No fence, no flag round trip, no CTA pairing: a thread waits only for the bytes it
  sums. Payload elements that are all-ones are sent as another NaN (sign bit
  cleared); every rank sums the sent values, and any sum with a NaN term is the
  canonical NaN, so the bits equal the reference's. Re-arming happens in the launch
  that read the slot: a peer writes that parity again two launches later, which it
  can only reach after this rank's next launch has pushed, i.e. after this launch
  ended.
* lamport_two_shot (from ``lamport_max_bytes`` to ``lamport_two_shot_max_bytes``, 16 MiB at
  2 ranks; not a default at more ranks, where it has not run yet):
  the two-shot with the data as its own flag, in one launch and without a barrier. The
  message is cut into ``world`` slices; thread t of every rank handles vector v of every
  slice, for the same v on every rank:
    1. push vector v of slice p of my input into rank p's scatter slot ``[parity][me]``;
    2. spin on vector v of the world-1 scatter slots of my slice, re-arm them, sum in
       rank order in fp32 (my own input in my place), write the result to my output and
       push it into every peer's gather slot ``[parity][me]``;
    3. spin on vector v of the world-1 gather slots, re-arm them, copy to my output.
  Each slice is reduced once, by its owner, and copied: bits identical on every rank
  and equal to the reference. Payload elements that are all-ones go out as another NaN
  in both pushes, like the one-shot's (a reduced value never is all-ones: the fp32 -> dtype
  conversion gives the canonical NaN; it is sent and kept with the same bits anyway).
  Traffic per rank: 2 (world-1)/world x message, against (world-1) x for the one-shots,
  for one more NVLink hop of latency. A thread waits only for the threads of its own index
  on the other ranks (step 3 needs the owners' step 2, which needs every rank's step 1),
  so there is no CTA pairing or grid barrier, and no fence: nothing is published but the
  data itself.
  Re-arming in the launch that read the slot is safe with two parities. Slots of parity
  P on rank r are written by peers only in launches e = P mod 2, and in launch e rank r
  reads and re-arms every position a peer wrote (the writer and the reader test the same
  ``element < n`` condition). A peer q writes parity P again at the earliest in launch
  e+2, which it can only start after finishing e+1; q finishes e+1 only after it has the
  reduced first vector of slice 0 (which every launch has: reduced by q in step 2 or
  received in step 3), that reduction waited for rank r's step 1 of e+1, so r had started
  e+1, so r's launch e (stream order, no programmatic dependent launch) had ended, re-arm
  stores included. The same holds whatever kernels launch e+1 runs: every kernel here
  waits, directly or through a slice owner, for every rank in every launch, and all of
  them advance the same launch epoch.
* one-shot (the default nowhere since the data-as-flag kernels cover its range; selectable):
  push the whole input to every peer's slot ``[parity][my rank]``, one barrier,
  then every rank sums all ``world`` slots. Traffic per rank: (world-1) x message;
  latency: one barrier (a system-scope fence, which waits for every pushed store to
  be acknowledged, and a flag round trip).
* two-shot (large messages): reduce-scatter then all-gather, both pushed, in one
  launch that walks the message in pipeline steps ("chunks") of
  ``world x slice`` elements. Per chunk k:
    A_k  slice p of my input -> rank p's slot ``[parity][me]``  (NVLink stores),
         overlapped with C_{k-1}: the slices my peers pushed into my gather area
         in step k-1 -> my output (local copy);
    ---  barrier with the same CTA of every peer
    B_k  sum my slice (my input + the world-1 slots, rank order), write it to my
         output and push it into every peer's gather area ``[me]``;
    ---  barrier
  and after the last chunk the remaining gather -> output copy. Traffic per rank:
  2 (world-1)/world x message, all of it stores; the local copies hide under the
  NVLink-bound pushes, and the input is read straight from the caller's tensor
  and the result written straight to the caller's output (no staging copy).

Measured on 2xH200, CUDA-graph timed (bench/results/allreduce.jsonl at commit
45764b2ea806): the Lamport kernel took 3.2-3.9 us from 8 to 128 KiB, 4.3 / 5.1 /
6.5 / 9.9 / 15.8-17.1 us at 256 KiB / 512 KiB / 1 / 2 / 4 MiB, 0.28-0.32x NCCL up to
2 MiB and 0.45x at 4 MiB; the barrier one-shot took 5.1-5.6 us up to 64 KiB and
8.1 / 10.0 / 15.6 / 22.2 us at 512 KiB / 1 / 2 / 4 MiB in the same run. Launch
shapes for the Lamport kernel (128 / 256 / 1024 threads per CTA, CTA caps 132 / 66)
were within 0.3 us of 512 threads x 264 CTAs up to 512 KiB and up to 7% slower
from 1 MiB. The Lamport two-shot (commit 94006a5c01db, same machine): 4.0-4.8 us from 8
to 256 KiB, 5.3 / 7.2 / 10.4 / 15.9 / 28.1 / 56.2 us at 512 KiB / 1 / 2 / 4 / 8 / 16 MiB,
against the Lamport one-shot's 3.3-4.2 / 5.0 / 6.5 / 9.8 / 15.8 us up to 4 MiB and, at 8
and 16 MiB, the barrier kernels' 35.0 and 62.4 us (NCCL 49.1 / 77.5 us). No launch shape
(128 / 512 / 1024 threads per CTA, CTA caps 132 / 66) beat 256 threads x 264 CTAs by more
than 0.2 us at any size; 1024 threads were up to 1.3 us slower below 256 KiB and 66 CTAs
3.9 us slower at 4 MiB.

A streamed one-shot (per-CTA steps with a flag per step, pushing step s while
reducing s-1) was tried and measured slower at every size on 2xH200 (commit
b730c5da9ea3 in bench/results/allreduce.jsonl): the per-step system-scope fences
cost more than the overlap gains. The earlier two-shot (one launch per 64 MiB,
gather pulled over NVLink after a separate local reduce pass) reached 0.93x NCCL
bus bandwidth at 256 MiB; this one 1.15-1.18x from 64 to 256 MiB with 32 MiB steps
(311-342 GB/s, commit 4549f685d928, same file).

Identical bits on every rank: sums run in fp32 in rank order 0..world-1 (one-shot:
each rank does the same arithmetic; two-shot: each slice is summed once and copied).

Buffer reuse without a trailing barrier:
* slots are double-buffered by launch parity. Before a rank writes slots of parity
  P in launch e+1 it has passed launch e's barriers with the peer, so the peer's
  launch e-1 (the last reader of parity P) has completed. Inside one two-shot
  launch a CTA rewrites a slot position in A_{k+1} only after the barrier the
  peer's same CTA (the only reader of that position) signals after B_k.
* the gather area is written in B_k only after the first barrier of step k: the
  peer's same CTA has then finished C_{k-1} (it signals after A_k + C_{k-1}), and
  at k = 0 the peer's previous launch (whose final copy read it) has completed.
Flag values are ``epoch * FLAG_STEPS + step``, monotone over launches of both
kernels (they share the flag rows).

This module holds the reference, the choice of algorithm and ``CudaAllReduce`` (peer memory,
launch parameters); the CuTeDSL kernels and their launchers are in ``kernels.allreduce_sm90``.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.distributed as dist

from kernels._cute_comm import MAX_BLOCKS, MAX_PEERS, VEC_BYTES
from kernels.allreduce_sm90 import (
    CUTE_DTYPES,
    FLAG_STEPS,
    THREADS,
    compile_lamport,
    compile_one_shot,
    compile_two_shot,
    slice_elems,
)

Algorithm = Literal["lamport", "lamport_two_shot", "one_shot", "two_shot"]
ALGORITHMS = ("lamport", "lamport_two_shot", "one_shot", "two_shot")
# Threads per CTA of the data-as-flag two-shot (`CudaAllReduce.lamport_two_shot_threads`;
# 2 ranks: no other shape measured more than 0.2 us faster, see above).
LAMPORT_TWO_SHOT_THREADS = 256
# Two barriers per two-shot chunk, so a launch walks at most this many chunks.
MAX_CHUNKS = (FLAG_STEPS - 1) // 2
SUPPORTED_DTYPES = tuple(CUTE_DTYPES)


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


def summation_order_bound(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """fp32, per element: how far two sums of ``x`` over ``group`` in ``x``'s dtype may differ
    when they add in different orders and round differently, e.g. NCCL (its ring rounds to
    ``x.dtype`` after each of its ``world - 1`` steps) against `all_reduce_reference` (one
    rounding). Each rounding errs by at most half an ulp of a partial sum, whose magnitude is at
    most ``S = sum_r |x_r|``; with at most ``world`` roundings on either side the two differ by
    at most ``world * eps * S`` (``eps``: the dtype's ulp at 1, two units of roundoff), plus the
    dtype's smallest normal for sums that round in the subnormal range."""
    magnitude = x.float().abs()
    dist.all_reduce(magnitude, group=group)
    info = torch.finfo(x.dtype)
    return dist.get_world_size(group) * info.eps * magnitude + info.tiny


# --------------------------------------------------------------------------- host side


def default_one_shot_max_bytes(world: int) -> int:
    """Largest message sent one-shot (the Lamport one-shot's limit; the barrier one-shot,
    whose range the data-as-flag kernels now cover, is only run when asked for).

    2 ranks (measured, bench/results/allreduce.jsonl at commit 4549f685d928, 2xH200,
    CUDA-graph timed): one-shot is faster up to 8 MiB (1 MiB 9.95 vs 12.64 us,
    8 MiB 34.9 vs 37.2 us) and two-shot from 16 MiB (67.0 vs 62.2 us, 32 MiB 131.3
    vs 115.7 us). Both move the same NVLink bytes at 2 ranks; the two-shot's extra
    barrier and copy cost it ~2.5 us, which it wins back once the one-shot's
    serial push -> reduce passes grow long.

    More ranks (the rule below is reasoned; 4 ranks ran once, b055d136ff6e on 4xH200: the
    Lamport one-shot to 512 KiB 4.6-9.8 us, 0.28-0.44x NCCL, the two-shot at 1 MiB 15.9 us,
    0.63x; the one-shot above 512 KiB was not timed there): the one-shot sends (world-1) x the message per rank, the two-shot 2 (world-1)/world
    x, so the one-shot moves (world-1)(world-2)/world x the message more. The
    switch is where that excess takes as long as the two-shot's fixed extra cost at
    2 ranks (~2.5 us at ~300 GB/s, i.e. ~750 kB of excess), rounded to a power of
    two: 1 MiB at 3 ranks, 512 KiB at 4, 256 KiB at 5-6, 128 KiB at 7-8.
    """
    if world == 2:
        return 8 << 20
    excess_bytes = 750_000
    crossover = excess_bytes * world / ((world - 1) * (world - 2))
    return 1 << round(math.log2(crossover))


def default_lamport_slot_bytes(world: int) -> int:
    """Bytes of one data-as-flag slot: 4 MiB, or the one-shot limit when that is smaller (the
    Lamport region, 2 x world slots, is 16 MiB at 2 ranks and 2 MiB at 8).

    The Lamport kernel is the default up to this size (``lamport_max_bytes``). At 2
    ranks it beat the barrier one-shot and the two-shot at every size measured, 8 KiB to
    4 MiB (commit 45764b2ea806: 4 MiB 15.8-17.1 vs 22.2 vs 25.6 us); above 4 MiB it
    was not measured, so the barrier one-shot keeps 4-8 MiB. At 3-8 ranks it moves
    the same bytes as the barrier one-shot without the barrier, so it takes the whole
    one-shot range (reasoned, not measured).
    """
    return min(4 << 20, default_one_shot_max_bytes(world))


def default_lamport_two_shot_slot_bytes(world: int) -> int:
    """Bytes of one slice slot of the data-as-flag two-shot: 8 MiB / world, so one launch
    reduces up to 8 MiB and its region (2 parities x scatter and gather x world slots) is
    32 MiB at any world size; longer messages take several launches."""
    return (8 << 20) // world // 256 * 256


def default_lamport_two_shot_max_bytes(world: int) -> int:
    """Largest message the data-as-flag two-shot takes by default: 16 MiB at 2 ranks, where it
    has run; 0 (never by default) at 3..8 ranks, where it has not. It starts where the
    Lamport one-shot stops (``lamport_max_bytes``).

    2 ranks (measured, bench/results/allreduce.jsonl at commit 94006a5c01db, 2xH200,
    CUDA-graph timed): the Lamport one-shot is as fast or faster up to 4 MiB (1 MiB 6.5
    vs 7.2 us, 4 MiB 15.8 vs 15.9); above, the two-shot wins: 8 MiB 28.1 us against 35.0
    (barrier one-shot) and 37.4 (barrier two-shot), 16 MiB (two launches) 56.2 against
    62.4 (two-shot). 32 MiB was not measured; 4 launches of 8 MiB would take about the
    two-shot's 113 us there, so the barrier two-shot keeps it.

    3..8 ranks: its GPU tests and timings exist at 2 ranks only, where each rank has one
    peer, so its slice and peer indexing beyond that has never run (no machine with more
    than 2 GPUs was lent since it was written, and 2 GPUs cannot stand in: torch symmetric
    memory refuses ranks that share a device). The barrier two-shot, tested and timed at 4
    ranks (b055d136ff6e: 1 MiB 15.9 us, 0.63x NCCL), keeps the range until then. It moves
    2 (world-1)/world x the message against the one-shots' (world-1) x and has no barrier,
    so it is expected to win from the Lamport one-shot's limit to 16 MiB there too: set
    ``CudaAllReduce.lamport_two_shot_max_bytes`` to 16 MiB to use it, and run
    ``tests/gpu/test_comm_allreduce.py`` and ``bench.allreduce --world W`` first.
    """
    return 16 << 20 if world == 2 else 0


def default_slot_bytes(world: int) -> int:
    """Bytes of one peer slot: 64 MiB / world, so the peer buffer (3 x world slots) stays 192 MiB at any world size."""
    return (64 << 20) // world // 256 * 256


# Message bytes (all ranks' slices together) per two-shot pipeline step. Measured at 2
# ranks (commit 4549f685d928): steps of 8 / 16 / 32 / 64 MiB took 960 / 834 / 786 / 781 us
# at 256 MiB and 262 / 220 / 216 / 219 us at 64 MiB (each step costs ~8 us of barriers
# and pipeline fill); 32 MiB is within 1.2% of the best step at every size from 16 to 256 MiB.
DEFAULT_TWO_SHOT_CHUNK_BYTES = 32 << 20


class CudaAllReduce:
    """All-reduce over a process group with the CuTeDSL kernels (one instance per group).

    Construction is collective (it maps peer memory on every rank). Calls are
    stream-ordered, host-sync free and can be captured in CUDA graphs; every rank
    must issue the same sequence of calls with the same sizes.

    Four kernels, chosen by message size (`choose`): ``lamport`` (the one-shot with the
    data as its own flag) up to ``lamport_max_bytes``, ``lamport_two_shot`` (the two-shot
    with the data as its own flag) up to ``lamport_two_shot_max_bytes``,
    ``one_shot`` (barrier one-shot) up to ``one_shot_max_bytes``, ``two_shot`` above.

    Tunables (plain attributes, the same on every rank): ``lamport_max_bytes``,
    ``lamport_two_shot_max_bytes`` and ``one_shot_max_bytes`` (the algorithm switches),
    ``one_shot_threads`` (threads per CTA of both one-shot kernels),
    ``lamport_two_shot_threads`` (threads per CTA of the data-as-flag two-shot),
    ``two_shot_chunk_bytes`` (pipeline step of the two-shot kernel, capped at
    ``world x slot_bytes``) and ``max_blocks`` (CTAs per launch, at most `MAX_BLOCKS`; at
    2 ranks 264 measured best from 64 MiB: 132 CTAs took 229 / 441 / 852 us at 64 / 128 /
    256 MiB against 220 / 421 / 834, 66 CTAs 253 / 478 / 929, commit 4549f685d928).
    """

    def __init__(
        self, group: dist.ProcessGroup, slot_bytes: int | None = None, one_shot_max_bytes: int | None = None,
        two_shot_chunk_bytes: int = DEFAULT_TWO_SHOT_CHUNK_BYTES, lamport_slot_bytes: int | None = None,
        lamport_two_shot_slot_bytes: int | None = None,
    ) -> None:
        from kernels.peer_memory import PeerMemory, RegionLayout

        world = dist.get_world_size(group)
        if not 2 <= world <= 8:
            raise AllReduceError(f"all-reduce supports 2..8 ranks, group has {world}")
        self.world = world
        self.slot_bytes = _slot_size("slot_bytes", default_slot_bytes(world) if slot_bytes is None else slot_bytes)
        self.lamport_slot_bytes = _slot_size(
            "lamport_slot_bytes", default_lamport_slot_bytes(world) if lamport_slot_bytes is None else lamport_slot_bytes)
        self.lamport_two_shot_slot_bytes = _slot_size(
            "lamport_two_shot_slot_bytes",
            default_lamport_two_shot_slot_bytes(world) if lamport_two_shot_slot_bytes is None else lamport_two_shot_slot_bytes)
        layout = RegionLayout()
        layout.add("flags", MAX_BLOCKS * MAX_PEERS * 4)
        layout.add("slots", 2 * world * self.slot_bytes)  # [parity][source rank]
        layout.add("gather", world * self.slot_bytes)  # [source rank]: reduced slices pushed by peers
        # Data-as-flag regions, all-ones when empty: the one-shot's [parity][source rank] and the
        # two-shot's [parity][scatter, gather][source rank].
        layout.add("lamport", 2 * world * self.lamport_slot_bytes)
        layout.add("lamport_two_shot", 4 * world * self.lamport_two_shot_slot_bytes)
        self.mem = PeerMemory(group, layout)
        self.rank = self.mem.rank
        # Arm every Lamport slot before any peer can write one (the kernels re-arm what they read).
        for region, nbytes in (("lamport", 2 * world * self.lamport_slot_bytes),
                               ("lamport_two_shot", 4 * world * self.lamport_two_shot_slot_bytes)):
            self.mem.local[layout[region] : layout[region] + nbytes].fill_(0xFF)
        torch.cuda.synchronize(self.mem.device)
        dist.barrier(group=group)
        self.one_shot_max_bytes = default_one_shot_max_bytes(world) if one_shot_max_bytes is None else one_shot_max_bytes
        self.lamport_max_bytes = min(self.lamport_slot_bytes, self.one_shot_max_bytes)
        self.lamport_two_shot_max_bytes = default_lamport_two_shot_max_bytes(world)
        self.two_shot_chunk_bytes = two_shot_chunk_bytes
        self.one_shot_threads = THREADS
        self.lamport_two_shot_threads = LAMPORT_TWO_SHOT_THREADS
        self.max_blocks = MAX_BLOCKS

    def warmup(self, dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)) -> None:
        """Compile, load and run every kernel once (collective; do it before CUDA-graph capture,
        where loading a module is not allowed)."""
        for dt in dtypes:
            x = torch.ones(4 * self.world * VEC_BYTES, dtype=dt, device=self.mem.device)
            for algo in ALGORITHMS:
                self(x, algorithm=algo)
        torch.cuda.synchronize(self.mem.device)

    def choose(self, nbytes: int) -> Algorithm:
        if nbytes <= self.lamport_max_bytes:
            return "lamport"
        if nbytes <= self.lamport_two_shot_max_bytes:
            return "lamport_two_shot"
        return "one_shot" if nbytes <= self.one_shot_max_bytes else "two_shot"

    def two_shot_chunk_elems(self, esz: int) -> int:
        """Elements per two-shot pipeline step: a multiple of world x vector, at most world x slot."""
        unit = self.world * (VEC_BYTES // esz)
        cap = self.world * (self.slot_bytes // esz)
        return max(unit, min(self.two_shot_chunk_bytes // esz, cap) // unit * unit)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None, algorithm: Algorithm | None = None) -> torch.Tensor:
        """Sum ``x`` over the group into ``out`` (new tensor if None; ``out=x`` is in place)."""
        from kernels._cute_runtime import launcher

        _check_input(x, self.mem.device)
        if out is None:
            out = torch.empty_like(x)
        elif out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous() or out.device != x.device:
            raise AllReduceError(f"out must be a contiguous {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}")
        elif out.data_ptr() % VEC_BYTES:
            raise AllReduceError(f"out must be {VEC_BYTES}-byte aligned (got address {out.data_ptr():#x})")
        n = x.numel()
        if n == 0:
            return out
        algo = algorithm or self.choose(n * x.element_size())
        if algo not in ALGORITHMS:
            raise AllReduceError(f"unknown all-reduce algorithm {algo!r}")
        esz = x.element_size()
        vec = VEC_BYTES // esz
        blocks = max(1, min(self.max_blocks, MAX_BLOCKS))
        mem = self.mem
        table, flags, slots, ctrl = mem.peer_table.data_ptr(), mem.layout["flags"], mem.layout["slots"], mem.control.data_ptr()
        if algo == "two_shot":
            chunk = self.two_shot_chunk_elems(esz)
            if n + chunk >= 2**31:  # the kernel indexes up to one chunk past the end in int32
                raise AllReduceError(f"tensor of {n} elements is too large for two-shot steps of {chunk} (limit 2**31 - 1 - step)")
            if -(-n // chunk) > MAX_CHUNKS:
                raise AllReduceError(f"{n} elements need more than {MAX_CHUNKS} two-shot steps of {chunk}; raise two_shot_chunk_bytes")
            grid = min(-(-slice_elems(min(n, chunk), self.world, vec) // (vec * THREADS)), blocks)
            launcher(compile_two_shot(x.dtype, self.world, self.rank), mem.device)(
                x.data_ptr(), out.data_ptr(), n, chunk, table, flags, slots, self.slot_bytes, mem.layout["gather"], ctrl, grid)
            return out
        # The other kernels reduce at most one slot's worth per launch: longer messages run as
        # several launches. `walked(m)`: the elements one launch of m elements spreads over its threads.
        if algo == "lamport_two_shot":
            kernel, threads_attr = compile_lamport(x.dtype, self.world, self.rank, two_shot=True), "lamport_two_shot_threads"
            per_launch = self.world * (self.lamport_two_shot_slot_bytes // esz)
            region = (mem.layout["lamport_two_shot"], self.lamport_two_shot_slot_bytes, ctrl)
            walked = lambda m: slice_elems(m, self.world, vec)  # noqa: E731
        elif algo == "lamport":
            kernel, threads_attr = compile_lamport(x.dtype, self.world, self.rank, two_shot=False), "one_shot_threads"
            per_launch = self.lamport_slot_bytes // esz
            region = (mem.layout["lamport"], self.lamport_slot_bytes, ctrl)
            walked = lambda m: m  # noqa: E731
        else:
            kernel, threads_attr = compile_one_shot(x.dtype, self.world, self.rank), "one_shot_threads"
            per_launch = self.slot_bytes // esz
            region = (flags, slots, self.slot_bytes, ctrl)
            walked = lambda m: m  # noqa: E731
        threads = getattr(self, threads_attr)
        if threads % 32 or not 32 <= threads <= 1024:
            raise AllReduceError(f"{threads_attr} must be a multiple of 32 in 32..1024, got {threads}")
        launch = launcher(kernel, mem.device)
        for start in range(0, n, per_launch):
            m = min(per_launch, n - start)
            grid = min(-(-walked(m) // (vec * threads)), blocks)
            launch(x.data_ptr() + start * esz, out.data_ptr() + start * esz, m, table, *region, grid, threads)
        return out


def _slot_size(name: str, nbytes: int) -> int:
    """A slot size rounded up to the 256-byte region alignment; at least one vector."""
    if nbytes < VEC_BYTES:
        raise AllReduceError(f"{name} must be at least {VEC_BYTES}, got {nbytes}")
    return -(-nbytes // 256) * 256


def _check_input(x: torch.Tensor, device: torch.device) -> None:
    if x.dtype not in CUTE_DTYPES:
        raise AllReduceError(f"all-reduce supports {list(CUTE_DTYPES)}, got {x.dtype}")
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
