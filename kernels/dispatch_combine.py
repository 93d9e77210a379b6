"""Decode DP-EP dispatch/combine: a sparse all-to-all over NVLink peer memory.

Every rank owns up to ``max_tokens`` tokens and ``E_local = E / world`` experts
(expert e lives on rank ``e // E_local``). One MoE layer is four phases, each a
separate launch so other work can overlap between them:

1. `dispatch_send`: each token is sent once per top-k slot straight into the
   receive buffer of the rank owning that expert. The slot inside the expert's
   receive area comes from a remote atomic on the owner's per-expert counter, so
   receivers get a packed ``[E_local, capacity, H]`` layout with no local
   repacking (capacity = world * max_tokens: every token of every rank could pick
   the same expert). Payload: bf16, or FP8 E4M3 quantized on the fly with one fp32
   scale per token per 128 channels (``scale = max(amax, 1e-12) * (1/448)``). With each
   row goes its origin ``(src rank << 24) | (token * topk + slot)``. The last CTA to
   finish raises this round's flag on every peer.
2. `dispatch_recv`: wait for every peer's flag, publish ``expert_counts`` (rows of
   each local expert, the masked grouped GEMM's per-group M) and reset the counters.
3. `combine_send`: each expert output row goes back to its origin, into
   ``comb[token, slot, H]`` on the token's rank; the last CTA raises the flag.
4. `combine_recv`: wait for every peer, then ``out[t] = sum_j w[t, j] * comb[t, j]``
   in fp32 in slot order, written as bf16 in the original token order (rows past
   ``num_tokens`` are zeroed).

No host synchronisation anywhere: ``num_tokens`` and the routing live on the GPU,
buffers and grids depend only on ``max_tokens``, and the round number ("epoch")
that flags carry is advanced by `combine_recv` in device memory, so the four
launches can be captured in a CUDA graph and replayed.

Protocol invariant: the four phases run in this order every round on every rank
(an idle rank joins with ``num_tokens = 0``). That ordering is what makes single
buffers safe: a rank starts round r+1's dispatch only after its round-r combine
has received from every peer, which each peer sends only after it has consumed
its round-r receive buffers and reset its counters.

Row order inside an expert's receive area depends on atomics; the combine result
does not (it is summed per token in slot order).
"""

from __future__ import annotations

import functools

import cuda.bindings.driver as cuda_driver
import cutlass
import cutlass.cute as cute
import torch
import torch.distributed as dist
from cutlass import BFloat16, Float32, Int32, Int64

from kernels._cute_comm import (
    MAX_PEERS,
    finish_launch,
    gptr,
    last_block_of_launch,
    load_i32,
    load_vec_f32,
    peer_base,
    read_epoch,
    signal,
    store_i32,
    store_vec_f32,
    wait_at_least,
)
from kernels.act_quant import AMAX_FLOOR, FP8_MAX, INV_FP8_MAX, QUANT_BLOCK, quantize_act_reference

# The FP8 payload is the activation format of kernels.act_quant (one scale per token
# per 128 channels, amax * fl(1/448)); its reference is that module's.
FP8_GROUP = QUANT_BLOCK
E4M3_MAX = FP8_MAX
INV_E4M3_MAX = INV_FP8_MAX
quantize_per_token_group = quantize_act_reference
SRC_RANK_SHIFT = 24
THREADS = 256
VEC = 8  # bf16 elements per thread access (16 bytes)
COMBINE_SEND_SPLIT = 8  # CTAs per local expert in combine_send
CTRL_DISPATCH_DONE = 2  # control words 0 and 1 are the epoch and finish_launch's counter
CTRL_COMBINE_DONE = 3
PAYLOADS = ("bf16", "fp8")


class DispatchCombineError(ValueError):
    """Bad configuration or tensors for dispatch/combine."""


# --------------------------------------------------------------------------- references


class DispatchCombineReference:
    """The same four phases with torch ops and ``all_to_all_single`` (any backend).

    Received rows are ordered by (source rank, token, slot). Host synchronisation
    (split sizes) is allowed here: this is the definition and the CPU path.
    """

    def __init__(self, group: dist.ProcessGroup, num_experts: int, max_tokens: int, hidden: int, topk: int, payload: str = "bf16") -> None:
        _check_config(dist.get_world_size(group), num_experts, max_tokens, hidden, topk, payload)
        self.group, self.world, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.num_experts, self.max_tokens, self.hidden, self.topk, self.payload = num_experts, max_tokens, hidden, topk, payload
        self.num_local = num_experts // self.world
        self.capacity = self.world * max_tokens

    def _a2a(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
        dist.all_to_all_single(recv, send.contiguous(), recv_counts, send_counts, group=self.group)
        return recv

    def _exchange_counts(self, send_counts: torch.Tensor) -> list[int]:
        recv = torch.empty_like(send_counts)
        dist.all_to_all_single(recv, send_counts, group=self.group)
        return recv.tolist()

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, num_tokens: torch.Tensor):
        """Returns ``(recv_x, recv_scales | None, expert_counts, recv_src)``."""
        n, k, dev = int(num_tokens.reshape(-1)[0]), self.topk, x.device
        ids = topk_ids[:n].long().reshape(-1)
        entry = torch.arange(n * k, device=dev)
        dst = ids // self.num_local
        order = torch.argsort(dst, stable=True)
        send_counts_t = torch.bincount(dst, minlength=self.world)
        send_counts = send_counts_t.tolist()
        recv_counts = self._exchange_counts(send_counts_t)
        if self.payload == "fp8":
            q, s = quantize_per_token_group(x[:n])
            rows = q.view(torch.uint8)[entry[order] // k]
            scales = self._a2a(s[entry[order] // k], send_counts, recv_counts)
        else:
            rows = x[:n][entry[order] // k]
            scales = None
        meta = torch.stack([ids[order] % self.num_local, (self.rank << SRC_RANK_SHIFT) | entry[order]], dim=1)
        recv_rows = self._a2a(rows, send_counts, recv_counts)
        recv_meta = self._a2a(meta, send_counts, recv_counts)
        local_e = recv_meta[:, 0]
        by_expert = torch.argsort(local_e, stable=True)
        counts = torch.bincount(local_e, minlength=self.num_local)
        starts = torch.cumsum(counts, 0) - counts
        pos = torch.arange(len(by_expert), device=dev) - starts[local_e[by_expert]]
        row_dtype = torch.uint8 if self.payload == "fp8" else x.dtype
        recv_x = torch.zeros(self.num_local, self.capacity, self.hidden, dtype=row_dtype, device=dev)
        recv_x[local_e[by_expert], pos] = recv_rows[by_expert]
        recv_src = torch.full((self.num_local, self.capacity), -1, dtype=torch.int64, device=dev)
        recv_src[local_e[by_expert], pos] = recv_meta[by_expert, 1]
        recv_scales = None
        if scales is not None:
            recv_scales = torch.zeros(self.num_local, self.capacity, self.hidden // FP8_GROUP, dtype=torch.float32, device=dev)
            recv_scales[local_e[by_expert], pos] = scales[by_expert]
            recv_x = recv_x.view(torch.float8_e4m3fn)
        return recv_x, recv_scales, counts.int(), recv_src.int()

    def combine(self, y: torch.Tensor, expert_counts: torch.Tensor, recv_src: torch.Tensor, topk_weights: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
        """``out[t] = sum_j w[t, j] * y_row(t, j)`` (fp32, slot order) as ``[max_tokens, H]`` bf16."""
        n, k, dev = int(num_tokens.reshape(-1)[0]), self.topk, y.device
        valid = torch.arange(self.capacity, device=dev)[None, :] < expert_counts[:, None].long()
        rows = y[valid]
        src = recv_src[valid].long()
        src_rank = src >> SRC_RANK_SHIFT
        order = torch.argsort(src_rank, stable=True)
        send_counts_t = torch.bincount(src_rank, minlength=self.world)
        recv_counts = self._exchange_counts(send_counts_t)
        back_rows = self._a2a(rows[order], send_counts_t.tolist(), recv_counts)
        back_entry = self._a2a(src[order] & ((1 << SRC_RANK_SHIFT) - 1), send_counts_t.tolist(), recv_counts)
        comb = torch.zeros(self.max_tokens * k, self.hidden, dtype=y.dtype, device=dev)
        comb[back_entry] = back_rows
        comb = comb.view(self.max_tokens, k, self.hidden)
        acc = torch.zeros(self.max_tokens, self.hidden, dtype=torch.float32, device=dev)
        for j in range(k):
            acc = acc + topk_weights[:, j : j + 1].float() * comb[:, j].float()
        acc[n:] = 0
        return acc.to(torch.bfloat16)


def _check_config(world: int, num_experts: int, max_tokens: int, hidden: int, topk: int, payload: str) -> None:
    if not 2 <= world <= MAX_PEERS:
        raise DispatchCombineError(f"EP size must be 2..{MAX_PEERS}, got {world}")
    if num_experts % world or num_experts < world:
        raise DispatchCombineError(f"{num_experts} experts cannot be split evenly over {world} ranks")
    if payload not in PAYLOADS:
        raise DispatchCombineError(f"payload must be one of {PAYLOADS}, got {payload!r}")
    if hidden % FP8_GROUP:
        raise DispatchCombineError(f"hidden size {hidden} must be a multiple of {FP8_GROUP}")
    if not 1 <= topk <= num_experts or max_tokens < 1 or max_tokens * topk >= 1 << SRC_RANK_SHIFT:
        raise DispatchCombineError(f"bad topk={topk} / max_tokens={max_tokens}")


# --------------------------------------------------------------------------- kernels
# Peer-buffer region offsets arrive as Int64 byte offsets; `peer_base(table, q)` + offset
# is rank q's copy of a region.


@cute.jit
def _amax_16_lanes(v: Float32) -> Float32:
    """Max over the 16 lanes that share one 128-channel group (xor shuffles stay inside it)."""
    for off in cutlass.range_constexpr(4):
        v = cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=8 >> off))
    return v


@cute.kernel
def _dispatch_send_kernel(
    x: Int64, topk_ids: Int64, num_tokens: Int64, slot_of: Int64, table: Int64,
    flags_off: Int64, counters_off: Int64, recv_x_off: Int64, recv_scales_off: Int64, recv_src_off: Int64, ctrl: Int64,
    capacity: Int32, world: cutlass.Constexpr, rank: cutlass.Constexpr, num_local: cutlass.Constexpr,
    hidden: cutlass.Constexpr, topk: cutlass.Constexpr, fp8: cutlass.Constexpr,
):
    # One CTA per (token, top-k slot): at decode batch sizes a CTA per token leaves
    # too few stores in flight to fill NVLink.
    tid, _, _ = cute.arch.thread_idx()
    entry, _, _ = cute.arch.block_idx()
    t = entry // topk
    epoch = read_epoch(ctrl)
    n = load_i32(num_tokens)
    psz = 1 if cutlass.const_expr(fp8) else 2
    groups = hidden // FP8_GROUP
    if t < n:
        e = load_i32(topk_ids + Int64(entry) * 4)
        dst = e // num_local
        le = e - dst * num_local
        owner = peer_base(table, dst)
        if tid == 0:
            slot = cute.arch.atomic_add(
                gptr(Int32, owner + counters_off + Int64(le) * 4, 4), Int32(1), sem="relaxed", scope="sys"
            )
            store_i32(slot_of + Int64(entry) * 4, slot)
            # A slot past the capacity only happens with repeated experts in one token's
            # top-k (invalid routing); the row is dropped rather than written out of bounds.
            if slot < capacity:
                store_i32(owner + recv_src_off + (Int64(le) * capacity + slot) * 4, Int32(rank << SRC_RANK_SHIFT) + entry)
        cute.arch.sync_threads()
        slot = load_i32(slot_of + Int64(entry) * 4)
        if slot < capacity:
            row = Int64(le) * capacity + slot
            dst_x = owner + recv_x_off + row * (hidden * psz)
            dst_scales = owner + recv_scales_off + row * (groups * 4)
            for h in cutlass.range_constexpr(0, hidden, THREADS * VEC):
                # Whole 16-lane groups (128 channels) fall past `hidden` together, and every
                # lane takes part in the shuffles; only the stores are guarded.
                c = h + tid * VEC
                v = load_vec_f32(x + (Int64(t) * hidden + c) * 2, BFloat16, VEC, hidden - c)
                if cutlass.const_expr(fp8):
                    amax = Float32(0.0)
                    for i in cutlass.range_constexpr(VEC):
                        amax = cute.arch.fmax(amax, cute.arch.fmax(v[i], -v[i]))
                    scale = cute.arch.fmax(_amax_16_lanes(amax), Float32(AMAX_FLOOR)) * Float32(INV_E4M3_MAX)
                    q = cute.make_rmem_tensor((VEC,), Float32)
                    for i in cutlass.range_constexpr(VEC):
                        q[i] = cute.arch.fmin(cute.arch.fmax(v[i] / scale, Float32(-E4M3_MAX)), Float32(E4M3_MAX))
                    if c < hidden:
                        store_vec_f32(dst_x + c, q, cutlass.Float8E4M3FN, VEC, VEC, align=8)
                        if tid % 16 == 0:
                            cute.arch.store(gptr(Float32, dst_scales + Int64(c // FP8_GROUP) * 4, 4), scale)
                elif c < hidden:
                    store_vec_f32(dst_x + c * 2, v, BFloat16, VEC, VEC)
    cute.arch.sync_threads()
    if tid == 0:
        if last_block_of_launch(ctrl, CTRL_DISPATCH_DONE) == 1:
            for q in cutlass.range_constexpr(world):
                signal(peer_base(table, q) + flags_off + rank * 4, epoch + 1)


@cute.kernel
def _dispatch_recv_kernel(
    table: Int64, flags_off: Int64, counters_off: Int64, expert_counts: Int64, ctrl: Int64, capacity: Int32,
    world: cutlass.Constexpr, rank: cutlass.Constexpr, num_local: cutlass.Constexpr,
):
    tid, _, _ = cute.arch.thread_idx()
    epoch = read_epoch(ctrl)
    mine = peer_base(table, rank)
    if tid < world:
        wait_at_least(mine + flags_off + Int64(tid) * 4, epoch + 1)
    cute.arch.sync_threads()
    for le in cutlass.range(tid, num_local, THREADS):
        counter = gptr(Int32, mine + counters_off + Int64(le) * 4, 4)
        count = cute.arch.load(counter, Int32, sem="relaxed", scope="sys")
        if count > capacity:  # rows past the capacity were dropped by the senders
            count = capacity
        store_i32(expert_counts + Int64(le) * 4, count)
        cute.arch.store(counter, Int32(0))


@cute.kernel
def _combine_send_kernel(
    y: Int64, expert_counts: Int64, table: Int64, flags_off: Int64, recv_src_off: Int64, comb_off: Int64, ctrl: Int64,
    capacity: Int32, world: cutlass.Constexpr, rank: cutlass.Constexpr, hidden: cutlass.Constexpr,
):
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    epoch = read_epoch(ctrl)
    le = bid // COMBINE_SEND_SPLIT
    count = load_i32(expert_counts + Int64(le) * 4)
    mine = peer_base(table, rank)
    for i in cutlass.range(bid % COMBINE_SEND_SPLIT, count, COMBINE_SEND_SPLIT):
        row = Int64(le) * capacity + i
        src = load_i32(mine + recv_src_off + row * 4)
        dst = peer_base(table, src >> SRC_RANK_SHIFT) + comb_off + Int64(src & ((1 << SRC_RANK_SHIFT) - 1)) * (hidden * 2)
        for h in cutlass.range_constexpr(0, hidden, THREADS * VEC):
            c = h + tid * VEC
            if c < hidden:
                v = load_vec_f32(y + (row * hidden + c) * 2, BFloat16, VEC, VEC)
                store_vec_f32(dst + c * 2, v, BFloat16, VEC, VEC)
    cute.arch.sync_threads()
    if tid == 0:
        if last_block_of_launch(ctrl, CTRL_COMBINE_DONE) == 1:
            for q in cutlass.range_constexpr(world):
                signal(peer_base(table, q) + flags_off + (MAX_PEERS + rank) * 4, epoch + 1)


@cute.kernel
def _combine_recv_kernel(
    weights: Int64, num_tokens: Int64, out: Int64, table: Int64, flags_off: Int64, comb_off: Int64, ctrl: Int64,
    world: cutlass.Constexpr, rank: cutlass.Constexpr, hidden: cutlass.Constexpr, topk: cutlass.Constexpr,
):
    tid, _, _ = cute.arch.thread_idx()
    t, _, _ = cute.arch.block_idx()
    epoch = read_epoch(ctrl)
    mine = peer_base(table, rank)
    if tid < world:
        wait_at_least(mine + flags_off + Int64(MAX_PEERS + tid) * 4, epoch + 1)
    cute.arch.sync_threads()
    n = load_i32(num_tokens)
    ws = [cute.arch.load(gptr(Float32, weights + (Int64(t) * topk + j) * 4, 4), Float32) for j in range(topk)]
    for h in cutlass.range_constexpr(0, hidden, THREADS * VEC):
        c = h + tid * VEC
        acc = cute.make_rmem_tensor((VEC,), Float32)
        acc.fill(0.0)
        if c < hidden:
            if t < n:
                for j in cutlass.range_constexpr(topk):
                    v = load_vec_f32(mine + comb_off + ((Int64(t) * topk + j) * hidden + c) * 2, BFloat16, VEC, VEC)
                    acc.store(acc.load() + v.load() * ws[j])
            store_vec_f32(out + (Int64(t) * hidden + c) * 2, acc, BFloat16, VEC, VEC)
    finish_launch(ctrl)


@cute.jit
def _launch_dispatch_send(
    x: Int64, topk_ids: Int64, num_tokens: Int64, slot_of: Int64, table: Int64, flags_off: Int64, counters_off: Int64,
    recv_x_off: Int64, recv_scales_off: Int64, recv_src_off: Int64, ctrl: Int64, capacity: Int32, max_tokens: Int32,
    stream: cuda_driver.CUstream, world: cutlass.Constexpr, rank: cutlass.Constexpr, num_local: cutlass.Constexpr,
    hidden: cutlass.Constexpr, topk: cutlass.Constexpr, fp8: cutlass.Constexpr,
):
    _dispatch_send_kernel(
        x, topk_ids, num_tokens, slot_of, table, flags_off, counters_off, recv_x_off, recv_scales_off, recv_src_off,
        ctrl, capacity, world, rank, num_local, hidden, topk, fp8,
    ).launch(grid=[max_tokens * topk, 1, 1], block=[THREADS, 1, 1], stream=stream)


@cute.jit
def _launch_dispatch_recv(
    table: Int64, flags_off: Int64, counters_off: Int64, expert_counts: Int64, ctrl: Int64, capacity: Int32,
    stream: cuda_driver.CUstream, world: cutlass.Constexpr, rank: cutlass.Constexpr, num_local: cutlass.Constexpr,
):
    _dispatch_recv_kernel(table, flags_off, counters_off, expert_counts, ctrl, capacity, world, rank, num_local).launch(
        grid=[1, 1, 1], block=[THREADS, 1, 1], stream=stream
    )


@cute.jit
def _launch_combine_send(
    y: Int64, expert_counts: Int64, table: Int64, flags_off: Int64, recv_src_off: Int64, comb_off: Int64, ctrl: Int64,
    capacity: Int32, stream: cuda_driver.CUstream, world: cutlass.Constexpr, rank: cutlass.Constexpr,
    num_local: cutlass.Constexpr, hidden: cutlass.Constexpr,
):
    _combine_send_kernel(y, expert_counts, table, flags_off, recv_src_off, comb_off, ctrl, capacity, world, rank, hidden).launch(
        grid=[num_local * COMBINE_SEND_SPLIT, 1, 1], block=[THREADS, 1, 1], stream=stream
    )


@cute.jit
def _launch_combine_recv(
    weights: Int64, num_tokens: Int64, out: Int64, table: Int64, flags_off: Int64, comb_off: Int64, ctrl: Int64,
    max_tokens: Int32, stream: cuda_driver.CUstream, world: cutlass.Constexpr, rank: cutlass.Constexpr,
    hidden: cutlass.Constexpr, topk: cutlass.Constexpr,
):
    _combine_recv_kernel(weights, num_tokens, out, table, flags_off, comb_off, ctrl, world, rank, hidden, topk).launch(
        grid=[max_tokens, 1, 1], block=[THREADS, 1, 1], stream=stream
    )


@functools.cache
def compile_kernels(world: int, rank: int, num_experts: int, hidden: int, topk: int, payload: str):
    """The four compiled launches for one configuration (cached per process; token
    counts and capacities are run-time arguments, so one compilation serves them all)."""
    from kernels._cute_runtime import dummy_stream

    z, i, s = Int64(0), Int32(1), dummy_stream()
    num_local = num_experts // world
    fp8 = payload == "fp8"
    return (
        cute.compile(_launch_dispatch_send, *[z] * 11, i, i, s, world, rank, num_local, hidden, topk, fp8),
        cute.compile(_launch_dispatch_recv, *[z] * 5, i, s, world, rank, num_local),
        cute.compile(_launch_combine_send, *[z] * 7, i, s, world, rank, num_local, hidden),
        cute.compile(_launch_combine_recv, *[z] * 7, i, s, world, rank, hidden, topk),
    )


# --------------------------------------------------------------------------- host side


class DispatchCombine:
    """Peer-memory dispatch/combine for one EP group (construction is collective).

    Inputs live in tensors the caller fills in place (for CUDA graphs): ``x``
    ``[max_tokens, H]`` bf16, ``topk_ids`` int32 ``[max_tokens, topk]``,
    ``topk_weights`` fp32 ``[max_tokens, topk]``, ``num_tokens`` int32 ``[1]``.
    Outputs: ``recv_x`` ``[E_local, capacity, H]`` (bf16 or E4M3), ``recv_scales``
    ``[E_local, capacity, H/128]`` fp32 (FP8 only), ``expert_counts`` int32
    ``[E_local]``, ``recv_src`` int32 ``[E_local, capacity]``.
    """

    def __init__(self, group: dist.ProcessGroup, num_experts: int, max_tokens: int, hidden: int, topk: int, payload: str = "bf16") -> None:
        from kernels.peer_memory import PeerMemory, RegionLayout

        world = dist.get_world_size(group)
        _check_config(world, num_experts, max_tokens, hidden, topk, payload)
        self.world, self.num_experts, self.max_tokens, self.hidden, self.topk, self.payload = world, num_experts, max_tokens, hidden, topk, payload
        self.num_local = num_experts // world
        self.capacity = world * max_tokens
        psz = 1 if payload == "fp8" else 2
        layout = RegionLayout()
        layout.add("flags", 2 * MAX_PEERS * 4)
        layout.add("counters", self.num_local * 4)
        layout.add("recv_x", self.num_local * self.capacity * hidden * psz)
        layout.add("recv_scales", self.num_local * self.capacity * (hidden // FP8_GROUP) * 4 if payload == "fp8" else 0)
        layout.add("recv_src", self.num_local * self.capacity * 4)
        layout.add("comb", max_tokens * topk * hidden * 2)
        self.mem = PeerMemory(group, layout)
        self.rank = self.mem.rank
        dev = self.mem.device
        self.recv_x = self.mem.view("recv_x", (self.num_local, self.capacity, hidden), torch.float8_e4m3fn if payload == "fp8" else torch.bfloat16)
        self.recv_scales = self.mem.view("recv_scales", (self.num_local, self.capacity, hidden // FP8_GROUP), torch.float32) if payload == "fp8" else None
        self.recv_src = self.mem.view("recv_src", (self.num_local, self.capacity), torch.int32)
        self.expert_counts = torch.zeros(self.num_local, dtype=torch.int32, device=dev)
        self._slot_of = torch.empty(max_tokens * topk, dtype=torch.int32, device=dev)
        self._ctrl = self.mem.control
        self._kernels = compile_kernels(world, self.rank, num_experts, hidden, topk, payload)

    def _check_inputs(self, x: torch.Tensor, topk_ids: torch.Tensor, num_tokens: torch.Tensor) -> None:
        want = {"x": ((self.max_tokens, self.hidden), torch.bfloat16), "topk_ids": ((self.max_tokens, self.topk), torch.int32), "num_tokens": ((1,), torch.int32)}
        for name, t in (("x", x), ("topk_ids", topk_ids), ("num_tokens", num_tokens)):
            shape, dtype = want[name]
            if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device != self.mem.device:
                raise DispatchCombineError(f"{name} must be a contiguous {dtype} {shape} tensor on {self.mem.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")

    def dispatch_send(self, x: torch.Tensor, topk_ids: torch.Tensor, num_tokens: torch.Tensor) -> None:
        from kernels._cute_runtime import current_stream

        self._check_inputs(x, topk_ids, num_tokens)
        m, lay = self.mem, self.mem.layout
        self._kernels[0](
            x.data_ptr(), topk_ids.data_ptr(), num_tokens.data_ptr(), self._slot_of.data_ptr(), m.peer_table.data_ptr(),
            lay["flags"], lay["counters"], lay["recv_x"], lay["recv_scales"], lay["recv_src"], self._ctrl.data_ptr(),
            self.capacity, self.max_tokens, current_stream(),
        )

    def dispatch_recv(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """Wait for all peers; returns ``(recv_x, recv_scales, expert_counts, recv_src)``."""
        from kernels._cute_runtime import current_stream

        m, lay = self.mem, self.mem.layout
        self._kernels[1](
            m.peer_table.data_ptr(), lay["flags"], lay["counters"], self.expert_counts.data_ptr(), self._ctrl.data_ptr(),
            self.capacity, current_stream(),
        )
        return self.recv_x, self.recv_scales, self.expert_counts, self.recv_src

    def combine_send(self, y: torch.Tensor) -> None:
        """Send expert outputs ``y`` ``[E_local, capacity, H]`` bf16 back to the tokens' ranks."""
        from kernels._cute_runtime import current_stream

        if tuple(y.shape) != (self.num_local, self.capacity, self.hidden) or y.dtype != torch.bfloat16 or not y.is_contiguous():
            raise DispatchCombineError(f"y must be contiguous bf16 {(self.num_local, self.capacity, self.hidden)}, got {y.dtype} {tuple(y.shape)}")
        m, lay = self.mem, self.mem.layout
        self._kernels[2](
            y.data_ptr(), self.expert_counts.data_ptr(), m.peer_table.data_ptr(), lay["flags"], lay["recv_src"], lay["comb"],
            self._ctrl.data_ptr(), self.capacity, current_stream(),
        )

    def combine_recv(self, topk_weights: torch.Tensor, num_tokens: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Wait for all peers and write ``out`` ``[max_tokens, H]`` bf16 (weighted sum per token)."""
        from kernels._cute_runtime import current_stream

        if tuple(topk_weights.shape) != (self.max_tokens, self.topk) or topk_weights.dtype != torch.float32 or not topk_weights.is_contiguous():
            raise DispatchCombineError(f"topk_weights must be contiguous fp32 {(self.max_tokens, self.topk)}")
        if tuple(out.shape) != (self.max_tokens, self.hidden) or out.dtype != torch.bfloat16 or not out.is_contiguous():
            raise DispatchCombineError(f"out must be contiguous bf16 {(self.max_tokens, self.hidden)}")
        m, lay = self.mem, self.mem.layout
        self._kernels[3](
            topk_weights.data_ptr(), num_tokens.data_ptr(), out.data_ptr(), m.peer_table.data_ptr(), lay["flags"], lay["comb"],
            self._ctrl.data_ptr(), self.max_tokens, current_stream(),
        )
        return out


def make_dispatch_combine(group: dist.ProcessGroup, num_experts: int, max_tokens: int, hidden: int, topk: int, payload: str = "bf16", device: torch.device | None = None):
    """The peer-memory implementation on CUDA devices, the torch reference elsewhere."""
    device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    if device.type == "cuda":
        return DispatchCombine(group, num_experts, max_tokens, hidden, topk, payload)
    return DispatchCombineReference(group, num_experts, max_tokens, hidden, topk, payload)
