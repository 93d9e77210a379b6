"""Decode DP-EP dispatch/combine: a sparse all-to-all over NVLink peer memory.

Every rank owns up to ``max_tokens`` tokens and ``E_local = E / world`` experts
(expert e lives on rank ``e // E_local``). One MoE layer is four phases, each a
separate launch so other work can overlap between them:

1. `dispatch_send`: each token travels **once per destination rank** (not once
   per top-k slot) into that rank's staging area ``disp_x[src][token]``, with its
   routing row (top-k ids and weights; these go to every rank, 32 bytes a token
   at top-8, so a receiver never reads a stale row). Payload: bf16, or FP8 E4M3
   quantized on the fly with one fp32 scale per token per 128 channels
   (``scale = max(amax, 1e-12) * (1/448)``).
2. `dispatch_recv`: per sender, wait for its flag, then scatter each received
   token into the rows of the local experts it picked: a packed
   ``[E_local, capacity, H]`` layout that the masked grouped GEMM reads directly,
   ``expert_counts`` being its per-group M (capacity = world * max_tokens: every
   token of every rank could pick the same expert). Slots come from local atomics.
3. `combine_send`: per (source rank, token), the weighted sum of the token's
   expert rows on this rank (fp32, in top-k slot order, rounded once to bf16) goes
   back as **one** row into ``comb[this rank][token]`` on the token's rank.
4. `combine_recv`: wait for every peer, then ``out[t]`` = the fp32 sum, in rank
   order, of the partial rows from the ranks holding t's experts, as bf16 in the
   original token order (rows past ``num_tokens`` are zeroed).

Sending per destination rank and reducing on the expert side cut the NVLink bytes
of a round by ``topk / (distinct ranks per token)`` in each direction (4x at EP=2,
top-8), at the price of one local copy in `dispatch_recv`.

Signalling: every CTA of a sending phase handles the tokens of one destination
rank and, after a barrier, adds 1 to that rank's flag with one ``red.release.sys``
(`signal_add`); the receiver waits until the flag has reached ``(round + 1) *
ctas_per_peer``. Counts only grow, so no flag is ever reset, and no CTA waits to
learn that it finished last. The round number ("epoch") is advanced in device
memory by `combine_recv`, so the four launches can be captured in a CUDA graph
and replayed; nothing synchronises with the host (``num_tokens`` and the routing
live on the GPU, buffers and grids depend only on ``max_tokens``).

Protocol invariant: the four phases run in this order every round on every rank
(an idle rank joins with ``num_tokens = 0``), on one stream. That ordering is what
makes single buffers safe: a rank starts round r+1's dispatch only after its
round-r combine has received from every peer, which each peer sends only after it
has read this rank's round-r staging rows and routing.

Row order inside an expert's receive area depends on atomics; the combine result
does not. A token naming one expert twice in its top-k (invalid routing) sends it
one row, weighted by the first of those slots.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import cuda.bindings.driver as cuda_driver
import cutlass
import cutlass.cute as cute
import torch
import torch.distributed as dist
from cutlass import BFloat16, Float32, Int32, Int64

from kernels._cute_comm import (
    MAX_PEERS,
    VEC_BYTES,
    finish_launch,
    gptr,
    load_f32,
    load_i32,
    load_vec_f32,
    peer_base,
    read_epoch,
    store_f32,
    store_i32,
    store_vec_f32,
    wait_at_least,
)
from kernels.act_quant import QUANT_BLOCK, quantize_act_reference
from kernels.act_quant_sm90 import quantize_group

if TYPE_CHECKING:
    from cutlass.base_dsl.jit_executor import JitCompiledFunction

# The FP8 payload is the activation format of kernels.act_quant (one scale per token
# per 128 channels, amax * fl(1/448)); its reference is that module's.
FP8_GROUP = QUANT_BLOCK
quantize_per_token_group = quantize_act_reference
SRC_RANK_SHIFT = 24
THREADS = 256
VEC = 8  # bf16 elements per thread access (16 bytes)
# CTAs of one phase, spread over the peers. A CTA walks its tokens one after another
# (barrier, atomics, dependent loads per token), so few tokens per CTA pay: at EP=2,
# 256 tokens per rank, a round took 38.6 / 36.8-40.7 / 43.2-46.2 / 70.3 us with 1 / 2 /
# 4 / 8 tokens per CTA (bench/results/dispatch_combine.jsonl, two runs). No phase needs
# its CTAs co-resident: only the receiving phases wait, and only for other GPUs.
CTA_BUDGET = 512
FLAG_DISPATCH, FLAG_COMBINE = 0, 1  # rows of the flag region: [2][MAX_PEERS] int32
PAYLOADS = ("bf16", "fp8")


class DispatchCombineError(ValueError):
    """Bad configuration or tensors for dispatch/combine."""


def ctas_per_peer(max_tokens: int, world: int) -> int:
    """CTAs of a sending phase per destination rank (each flag counts this many per round)."""
    return max(1, min(max_tokens, CTA_BUDGET // world))


# --------------------------------------------------------------------------- references


class DispatchCombineReference:
    """The same exchange with torch ops and ``all_to_all_single`` (any backend).

    Received rows are ordered by (source rank, token, slot). Host synchronisation
    (split sizes) is allowed here: this is the definition and the CPU path.
    `combine` uses the routing weights and receive order of the last `dispatch`.
    """

    def __init__(self, group: dist.ProcessGroup, num_experts: int, max_tokens: int, hidden: int, topk: int, payload: str = "bf16") -> None:
        _check_config(dist.get_world_size(group), num_experts, max_tokens, hidden, topk, payload)
        self.group, self.world, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.num_experts, self.max_tokens, self.hidden, self.topk, self.payload = num_experts, max_tokens, hidden, topk, payload
        self.num_local = num_experts // self.world
        self.capacity = self.world * max_tokens
        self._recv_weights: torch.Tensor | None = None  # [E_local, capacity] routing weight of each received row

    def _a2a(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
        dist.all_to_all_single(recv, send.contiguous(), recv_counts, send_counts, group=self.group)
        return recv

    def _exchange_counts(self, send_counts: torch.Tensor) -> list[int]:
        recv = torch.empty_like(send_counts)
        dist.all_to_all_single(recv, send_counts, group=self.group)
        return recv.tolist()

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_tokens: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """Returns ``(recv_x, recv_scales | None, expert_counts, recv_src)``."""
        n, k, dev = int(num_tokens.reshape(-1)[0]), self.topk, x.device
        ids = topk_ids[:n].long()
        # A token naming one expert twice keeps only its first slot (as the kernels do).
        first = torch.ones_like(ids, dtype=torch.bool)
        for j in range(1, k):
            first[:, j] = (ids[:, :j] != ids[:, j : j + 1]).all(dim=1)
        entry = torch.arange(n * k, device=dev).view(n, k)[first]
        ids = ids[first]
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
        recv_w = self._a2a(topk_weights[:n].float().reshape(-1)[entry[order]], send_counts, recv_counts)
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
        self._recv_weights = torch.zeros(self.num_local, self.capacity, dtype=torch.float32, device=dev)
        self._recv_weights[local_e[by_expert], pos] = recv_w[by_expert]
        recv_scales = None
        if scales is not None:
            recv_scales = torch.zeros(self.num_local, self.capacity, self.hidden // FP8_GROUP, dtype=torch.float32, device=dev)
            recv_scales[local_e[by_expert], pos] = scales[by_expert]
            recv_x = recv_x.view(torch.float8_e4m3fn)
        return recv_x, recv_scales, counts.int(), recv_src.int()

    def combine(self, y: torch.Tensor, expert_counts: torch.Tensor, recv_src: torch.Tensor, topk_ids: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
        """``out[t]`` ``[max_tokens, H]`` bf16: per rank q holding t's experts, ``p_q = bf16(sum_j w[t, j] *
        y_row(t, j))`` (fp32, slot order); then ``out[t] = bf16(sum_q p_q)`` (fp32, rank order)."""
        if self._recv_weights is None:
            raise DispatchCombineError("combine before dispatch")
        n, k, m, dev = int(num_tokens.reshape(-1)[0]), self.topk, self.max_tokens, y.device
        valid = torch.arange(self.capacity, device=dev)[None, :] < expert_counts[:, None].long()
        src = recv_src[valid].long()
        rows = y[valid].float() * self._recv_weights[valid][:, None]
        src_rank, entry = src >> SRC_RANK_SHIFT, src & ((1 << SRC_RANK_SHIFT) - 1)
        token, slot = src_rank * m + entry // k, entry % k
        partial = torch.zeros(self.world * m, self.hidden, dtype=torch.float32, device=dev)
        for j in range(k):  # slot order; a (rank, token) has at most one row per slot
            partial[token[slot == j]] += rows[slot == j]
        back = torch.empty_like(partial, dtype=torch.bfloat16)
        dist.all_to_all_single(back, partial.bfloat16(), group=self.group)  # [world, max_tokens, H]: q's partials of our tokens
        back = back.view(self.world, m, self.hidden).float()
        owners = topk_ids[:n].long() // self.num_local
        acc = torch.zeros(m, self.hidden, dtype=torch.float32, device=dev)
        for q in range(self.world):
            used = torch.zeros(m, dtype=torch.bool, device=dev)
            used[:n] = (owners == q).any(dim=1)
            acc = acc + torch.where(used[:, None], back[q], 0.0)
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
    if not 1 <= topk <= min(num_experts, THREADS) or max_tokens < 1 or max_tokens * topk >= 1 << SRC_RANK_SHIFT:
        raise DispatchCombineError(f"bad topk={topk} / max_tokens={max_tokens}")


# --------------------------------------------------------------------------- kernels
# Peer-buffer regions arrive as Int64 byte offsets (`peer_base(table, q)` + offset is
# rank q's copy); rank-local tensors as plain addresses. A sending or receiving CTA
# ``b`` serves peer ``b % world`` and that peer's tokens ``b // world, + cpp, ...``
# (cpp = ctas_per_peer), so consecutive CTAs talk to different peers.


@cute.jit
def signal_add(flag_addr: Int64, value: Int32):
    """Publish every write this CTA made before its last barrier, then add ``value`` to a flag.

    One ``red.release.sys``: the release orders the CTA's earlier writes (made visible to
    this thread by the barrier) before the addition, with no separate fence. Several
    CTAs add to one flag, and the receiver waits for their total (`wait_at_least`), so
    no CTA has to find out that it finished last before signalling.
    """
    cute.arch.red(gptr(Int32, flag_addr, 4), value, op="add", dtype=Int32, sem="release", scope="sys")


@cute.jit
def load_16b(addr: Int64):
    """One 16-byte vector load (four 32-bit words, any payload type) into a register fragment.

    A fragment rather than the loaded value, so it can be stored from inside later branches.
    """
    frag = cute.make_rmem_tensor((4,), Int32)
    frag.store(cute.make_tensor(gptr(Int32, addr), cute.make_layout(4)).load())
    return frag


@cute.jit
def store_16b(addr: Int64, frag):
    """Store a fragment from `load_16b` as one 16-byte vector."""
    cute.make_tensor(gptr(Int32, addr), cute.make_layout(4)).store(frag.load())


@cute.jit
def _in_range(e: Int32, first: Int32, count: cutlass.Constexpr) -> Int32:
    """1 when expert ``e`` is one of ``[first, first + count)`` (out-of-range ids match nothing)."""
    hit = Int32(0)
    if e >= first:
        if e < first + count:
            hit = Int32(1)
    return hit


@cute.jit
def _token_uses_rank(topk_ids: Int64, t: Int32, n: Int32, first: Int32, count: cutlass.Constexpr, topk: cutlass.Constexpr) -> Int32:
    """1 when token ``t`` (of ``n``) picked an expert in ``[first, first + count)``."""
    hit = Int32(0)
    if t < n:
        for j in cutlass.range_constexpr(topk):
            hit = hit | _in_range(load_i32(topk_ids + (Int64(t) * topk + j) * 4), first, count)
    return hit


@cute.kernel
def _dispatch_send_kernel(
    x: Int64, topk_ids: Int64, topk_weights: Int64, num_tokens: Int64, expert_counts: Int64, table: Int64,
    flags_off: Int64, ntok_off: Int64, disp_x_off: Int64, disp_scales_off: Int64, disp_ids_off: Int64, disp_w_off: Int64,
    max_tokens: Int32, cpp: Int32, world: cutlass.Constexpr, rank: cutlass.Constexpr,
    num_local: cutlass.Constexpr, hidden: cutlass.Constexpr, topk: cutlass.Constexpr, fp8: cutlass.Constexpr,
):
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    q = bid % world
    n = load_i32(num_tokens)
    if bid == 0:
        # This round's dispatch_recv counts into expert_counts with atomics; it runs after
        # this launch on the stream, and last round's counts have been consumed by now.
        for le in cutlass.range(tid, num_local, THREADS):
            store_i32(expert_counts + Int64(le) * 4, Int32(0))
    psz = 1 if cutlass.const_expr(fp8) else 2
    groups = hidden // FP8_GROUP
    peer = peer_base(table, q)
    for t in cutlass.range(bid // world, n, cpp):
        token_row = Int64(rank) * max_tokens + t  # this token's row in the peer's staging area
        hit = _token_uses_rank(topk_ids, t, n, q * num_local, num_local, topk)
        if tid < topk:
            entry = Int64(t) * topk + tid
            store_i32(peer + disp_ids_off + (token_row * topk + tid) * 4, load_i32(topk_ids + entry * 4))
            store_f32(peer + disp_w_off + (token_row * topk + tid) * 4, load_f32(topk_weights + entry * 4))
        if hit != 0:
            dst_x = peer + disp_x_off + token_row * (hidden * psz)
            dst_scales = peer + disp_scales_off + token_row * (groups * 4)
            for h in cutlass.range_constexpr(0, hidden, THREADS * VEC):
                # Whole 16-lane groups (128 channels) fall past `hidden` together, and every
                # lane takes part in the shuffles; only the stores are guarded.
                c = h + tid * VEC
                v = load_vec_f32(x + (Int64(t) * hidden + c) * 2, BFloat16, VEC, hidden - c)
                if cutlass.const_expr(fp8):
                    qv, scale = quantize_group(v)  # the activation quantizer's step, 16 lanes a group
                    if c < hidden:
                        store_vec_f32(dst_x + c, qv, cutlass.Float8E4M3FN, VEC, VEC, align=8)
                        if tid % 16 == 0:
                            store_f32(dst_scales + Int64(c // FP8_GROUP) * 4, scale)
                elif c < hidden:
                    store_vec_f32(dst_x + c * 2, v, BFloat16, VEC, VEC)
    cute.arch.sync_threads()
    if tid == 0:
        if bid < world:
            store_i32(peer + ntok_off + rank * 4, n)
        signal_add(peer + flags_off + Int64(FLAG_DISPATCH * MAX_PEERS + rank) * 4, Int32(1))


@cute.kernel
def _dispatch_recv_kernel(
    table: Int64, flags_off: Int64, ntok_off: Int64, disp_x_off: Int64, disp_scales_off: Int64, disp_ids_off: Int64,
    recv_x: Int64, recv_scales: Int64, recv_src: Int64, row_of: Int64, expert_counts: Int64, ctrl: Int64,
    max_tokens: Int32, cpp: Int32, world: cutlass.Constexpr, rank: cutlass.Constexpr, num_local: cutlass.Constexpr,
    hidden: cutlass.Constexpr, topk: cutlass.Constexpr, fp8: cutlass.Constexpr,
):
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    src = bid % world
    capacity = Int32(world) * max_tokens  # rows per local expert (row indices fit 32 bits)
    epoch = read_epoch(ctrl)
    mine = peer_base(table, rank)
    if tid == 0:
        wait_at_least(mine + flags_off + Int64(FLAG_DISPATCH * MAX_PEERS + src) * 4, (epoch + 1) * cpp)
    cute.arch.sync_threads()
    n = load_i32(mine + ntok_off + src * 4)
    row_bytes = hidden * (1 if cutlass.const_expr(fp8) else 2)
    groups = hidden // FP8_GROUP
    for t in cutlass.range(bid // world, n, cpp):
        token_row = Int64(src) * max_tokens + t
        ids_at = mine + disp_ids_off + token_row * (topk * 4)
        # Thread j places slot j: a row in its local expert (or -1), kept in row_of for the
        # combine and read back by the whole CTA after the barrier.
        if tid < topk:
            e = load_i32(ids_at + tid * 4)
            place = _in_range(e, Int32(rank * num_local), num_local)
            for i in cutlass.range(0, tid, 1):
                if load_i32(ids_at + i * 4) == e:
                    place = Int32(0)
            row = Int32(-1)
            if place != 0:
                le = e - rank * num_local
                slot = cute.arch.atomic_add(gptr(Int32, expert_counts + Int64(le) * 4, 4), Int32(1), sem="relaxed", scope="gpu")
                row = le * capacity + slot
                store_i32(recv_src + Int64(row) * 4, src * (1 << SRC_RANK_SHIFT) + t * topk + tid)
            store_i32(row_of + (token_row * topk + tid) * 4, row)
        cute.arch.sync_threads()
        rows = [Int64(load_i32(row_of + (token_row * topk + j) * 4)) for j in range(topk)]
        staged = mine + disp_x_off + token_row * row_bytes
        for off in cutlass.range_constexpr(0, row_bytes, THREADS * VEC_BYTES):
            b = off + tid * VEC_BYTES
            if b < row_bytes:
                words = load_16b(staged + b)
                for j in cutlass.range_constexpr(topk):
                    if rows[j] >= 0:
                        store_16b(recv_x + rows[j] * row_bytes + b, words)
        if cutlass.const_expr(fp8):
            for g in cutlass.range(tid, groups, THREADS):
                s = load_f32(mine + disp_scales_off + (token_row * groups + g) * 4)
                for j in cutlass.range_constexpr(topk):
                    if rows[j] >= 0:
                        store_f32(recv_scales + (rows[j] * groups + g) * 4, s)
        cute.arch.sync_threads()  # row_of of this token is rewritten only by the next round


@cute.kernel
def _combine_send_kernel(
    y: Int64, row_of: Int64, table: Int64, flags_off: Int64, ntok_off: Int64, disp_w_off: Int64, comb_off: Int64,
    max_tokens: Int32, cpp: Int32, world: cutlass.Constexpr, rank: cutlass.Constexpr,
    hidden: cutlass.Constexpr, topk: cutlass.Constexpr,
):
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    src = bid % world
    mine = peer_base(table, rank)
    peer = peer_base(table, src)
    n = load_i32(mine + ntok_off + src * 4)
    for t in cutlass.range(bid // world, n, cpp):
        token_row = Int64(src) * max_tokens + t
        rows = [Int64(load_i32(row_of + (token_row * topk + j) * 4)) for j in range(topk)]
        ws = [load_f32(mine + disp_w_off + (token_row * topk + j) * 4) for j in range(topk)]
        used = Int32(0)
        for j in cutlass.range_constexpr(topk):
            if rows[j] >= 0:
                used = Int32(1)
        if used != 0:
            dst = peer + comb_off + (Int64(rank) * max_tokens + t) * (hidden * 2)
            for h in cutlass.range_constexpr(0, hidden, THREADS * VEC):
                c = h + tid * VEC
                if c < hidden:
                    acc = cute.make_rmem_tensor((VEC,), Float32)
                    acc.fill(0.0)
                    for j in cutlass.range_constexpr(topk):
                        if rows[j] >= 0:
                            v = load_vec_f32(y + (rows[j] * hidden + c) * 2, BFloat16, VEC, VEC)
                            acc.store(acc.load() + v.load() * ws[j])
                    store_vec_f32(dst + c * 2, acc, BFloat16, VEC, VEC)
    cute.arch.sync_threads()
    if tid == 0:
        signal_add(peer + flags_off + Int64(FLAG_COMBINE * MAX_PEERS + rank) * 4, Int32(1))


@cute.kernel
def _combine_recv_kernel(
    topk_ids: Int64, num_tokens: Int64, out: Int64, table: Int64, flags_off: Int64, comb_off: Int64, ctrl: Int64,
    max_tokens: Int32, cpp: Int32, world: cutlass.Constexpr, rank: cutlass.Constexpr, num_local: cutlass.Constexpr,
    hidden: cutlass.Constexpr, topk: cutlass.Constexpr,
):
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    nblocks, _, _ = cute.arch.grid_dim()
    epoch = read_epoch(ctrl)
    mine = peer_base(table, rank)
    if tid < world:
        wait_at_least(mine + flags_off + Int64(FLAG_COMBINE * MAX_PEERS + tid) * 4, (epoch + 1) * cpp)
    cute.arch.sync_threads()
    n = load_i32(num_tokens)
    for t in cutlass.range(bid, max_tokens, nblocks):
        used = [_token_uses_rank(topk_ids, t, n, Int32(q * num_local), num_local, topk) for q in range(world)]
        for h in cutlass.range_constexpr(0, hidden, THREADS * VEC):
            c = h + tid * VEC
            if c < hidden:
                acc = cute.make_rmem_tensor((VEC,), Float32)
                acc.fill(0.0)
                for q in cutlass.range_constexpr(world):
                    if used[q] != 0:
                        v = load_vec_f32(mine + comb_off + ((Int64(q) * max_tokens + t) * hidden + c) * 2, BFloat16, VEC, VEC)
                        acc.store(acc.load() + v.load())
                store_vec_f32(out + (Int64(t) * hidden + c) * 2, acc, BFloat16, VEC, VEC)
    finish_launch(ctrl)


@cute.jit
def _launch_dispatch_send(
    x: Int64, topk_ids: Int64, topk_weights: Int64, num_tokens: Int64, expert_counts: Int64, table: Int64,
    flags_off: Int64, ntok_off: Int64, disp_x_off: Int64, disp_scales_off: Int64, disp_ids_off: Int64, disp_w_off: Int64,
    max_tokens: Int32, cpp: Int32, stream: cuda_driver.CUstream, world: cutlass.Constexpr,
    rank: cutlass.Constexpr, num_local: cutlass.Constexpr, hidden: cutlass.Constexpr, topk: cutlass.Constexpr,
    fp8: cutlass.Constexpr,
):
    _dispatch_send_kernel(
        x, topk_ids, topk_weights, num_tokens, expert_counts, table, flags_off, ntok_off, disp_x_off, disp_scales_off,
        disp_ids_off, disp_w_off, max_tokens, cpp, world, rank, num_local, hidden, topk, fp8,
    ).launch(grid=[cpp * world, 1, 1], block=[THREADS, 1, 1], stream=stream)


@cute.jit
def _launch_dispatch_recv(
    table: Int64, flags_off: Int64, ntok_off: Int64, disp_x_off: Int64, disp_scales_off: Int64, disp_ids_off: Int64,
    recv_x: Int64, recv_scales: Int64, recv_src: Int64, row_of: Int64, expert_counts: Int64, ctrl: Int64,
    max_tokens: Int32, cpp: Int32, stream: cuda_driver.CUstream, world: cutlass.Constexpr, rank: cutlass.Constexpr,
    num_local: cutlass.Constexpr, hidden: cutlass.Constexpr, topk: cutlass.Constexpr, fp8: cutlass.Constexpr,
):
    _dispatch_recv_kernel(
        table, flags_off, ntok_off, disp_x_off, disp_scales_off, disp_ids_off, recv_x, recv_scales, recv_src, row_of,
        expert_counts, ctrl, max_tokens, cpp, world, rank, num_local, hidden, topk, fp8,
    ).launch(grid=[cpp * world, 1, 1], block=[THREADS, 1, 1], stream=stream)


@cute.jit
def _launch_combine_send(
    y: Int64, row_of: Int64, table: Int64, flags_off: Int64, ntok_off: Int64, disp_w_off: Int64, comb_off: Int64,
    max_tokens: Int32, cpp: Int32, stream: cuda_driver.CUstream, world: cutlass.Constexpr,
    rank: cutlass.Constexpr, hidden: cutlass.Constexpr, topk: cutlass.Constexpr,
):
    _combine_send_kernel(
        y, row_of, table, flags_off, ntok_off, disp_w_off, comb_off, max_tokens, cpp, world, rank, hidden, topk,
    ).launch(grid=[cpp * world, 1, 1], block=[THREADS, 1, 1], stream=stream)


@cute.jit
def _launch_combine_recv(
    topk_ids: Int64, num_tokens: Int64, out: Int64, table: Int64, flags_off: Int64, comb_off: Int64, ctrl: Int64,
    max_tokens: Int32, cpp: Int32, stream: cuda_driver.CUstream, world: cutlass.Constexpr, rank: cutlass.Constexpr,
    num_local: cutlass.Constexpr, hidden: cutlass.Constexpr, topk: cutlass.Constexpr,
):
    _combine_recv_kernel(
        topk_ids, num_tokens, out, table, flags_off, comb_off, ctrl, max_tokens, cpp, world, rank, num_local, hidden, topk,
    ).launch(grid=[cpp * world, 1, 1], block=[THREADS, 1, 1], stream=stream)


@functools.cache
def compile_kernels(world: int, rank: int, num_experts: int, hidden: int, topk: int, payload: str) -> tuple[JitCompiledFunction, ...]:
    """The four compiled launches for one configuration (cached per process; token
    counts and grid sizes are run-time arguments, so one compilation serves them all)."""
    from kernels._cute_runtime import dummy_stream

    z, i, s = Int64(0), Int32(1), dummy_stream()
    num_local = num_experts // world
    fp8 = payload == "fp8"
    return (
        cute.compile(_launch_dispatch_send, *[z] * 12, i, i, s, world, rank, num_local, hidden, topk, fp8),
        cute.compile(_launch_dispatch_recv, *[z] * 12, i, i, s, world, rank, num_local, hidden, topk, fp8),
        cute.compile(_launch_combine_send, *[z] * 7, i, i, s, world, rank, hidden, topk),
        cute.compile(_launch_combine_recv, *[z] * 7, i, i, s, world, rank, num_local, hidden, topk),
    )


# --------------------------------------------------------------------------- host side


class DispatchCombine:
    """Peer-memory dispatch/combine for one EP group (construction is collective).

    Inputs are tensors on this rank's GPU that may change between calls (CUDA
    graphs replay the same addresses): ``x`` ``[T, H]`` bf16, ``topk_ids`` int32
    ``[T, topk]``, ``topk_weights`` fp32 ``[T, topk]`` with ``T <= max_tokens``,
    and ``num_tokens`` int32 ``[1]`` holding the number of valid rows (``<= T``; it
    is read on the GPU only). Outputs, rank-local and rewritten every round:
    ``recv_x`` ``[E_local, capacity, H]`` (bf16 or E4M3), ``recv_scales``
    ``[E_local, capacity, H/128]`` fp32 (FP8 only), ``expert_counts`` int32
    ``[E_local]``, ``recv_src`` int32 ``[E_local, capacity]`` (each row's origin,
    ``(src rank << 24) | (token * topk + slot)``).

    ``max_tokens`` (and ``cpp``, CTAs per peer, which benchmarks vary; default
    `ctas_per_peer(max_tokens, world)`) must be the same on every rank: they fix
    the staging layout and how many CTAs each flag counts.
    """

    def __init__(self, group: dist.ProcessGroup, num_experts: int, max_tokens: int, hidden: int, topk: int, payload: str = "bf16", cpp: int | None = None) -> None:
        from kernels.peer_memory import PeerMemory, RegionLayout

        world = dist.get_world_size(group)
        _check_config(world, num_experts, max_tokens, hidden, topk, payload)
        self.world, self.num_experts, self.max_tokens, self.hidden, self.topk, self.payload = world, num_experts, max_tokens, hidden, topk, payload
        self.num_local = num_experts // world
        self.capacity = world * max_tokens
        self.ctas_per_peer = cpp or ctas_per_peer(max_tokens, world)
        if not 1 <= self.ctas_per_peer <= max_tokens:
            raise DispatchCombineError(f"ctas_per_peer must be 1..max_tokens={max_tokens}, got {self.ctas_per_peer}")
        fp8 = payload == "fp8"
        staged_rows = world * max_tokens  # one staging row per (source rank, token)
        layout = RegionLayout()
        layout.add("flags", 2 * MAX_PEERS * 4)
        layout.add("ntok", MAX_PEERS * 4)
        layout.add("disp_x", staged_rows * hidden * (1 if fp8 else 2))
        layout.add("disp_scales", staged_rows * (hidden // FP8_GROUP) * 4 if fp8 else 0)
        layout.add("disp_ids", staged_rows * topk * 4)
        layout.add("disp_w", staged_rows * topk * 4)
        layout.add("comb", staged_rows * hidden * 2)
        self.mem = PeerMemory(group, layout)
        self.rank = self.mem.rank
        dev = self.mem.device
        self.recv_x = torch.empty(self.num_local, self.capacity, hidden, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, device=dev)
        self.recv_scales = torch.empty(self.num_local, self.capacity, hidden // FP8_GROUP, dtype=torch.float32, device=dev) if fp8 else None
        self.recv_src = torch.empty(self.num_local, self.capacity, dtype=torch.int32, device=dev)
        self.expert_counts = torch.zeros(self.num_local, dtype=torch.int32, device=dev)
        self._row_of = torch.empty(staged_rows * topk, dtype=torch.int32, device=dev)
        self._ctrl = self.mem.control
        from kernels._cute_runtime import launcher

        self._launchers = [launcher(fn, dev) for fn in compile_kernels(world, self.rank, num_experts, hidden, topk, payload)]

    def _check(self, name: str, t: torch.Tensor, cols: int | None, dtype: torch.dtype) -> None:
        rows_ok = t.shape == (1,) if cols is None else (t.dim() == 2 and t.shape[0] <= self.max_tokens and t.shape[1] == cols)
        if not rows_ok or t.dtype != dtype or not t.is_contiguous() or t.device != self.mem.device:
            want = "[1]" if cols is None else f"[<= {self.max_tokens}, {cols}]"
            raise DispatchCombineError(f"{name} must be a contiguous {dtype} {want} tensor on {self.mem.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")

    def dispatch_send(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_tokens: torch.Tensor) -> None:
        """Send each of the first ``num_tokens`` rows of ``x`` to the ranks owning its experts."""
        self._check("x", x, self.hidden, torch.bfloat16)
        self._check("topk_ids", topk_ids, self.topk, torch.int32)
        self._check("topk_weights", topk_weights, self.topk, torch.float32)
        self._check("num_tokens", num_tokens, None, torch.int32)
        if not x.shape[0] == topk_ids.shape[0] == topk_weights.shape[0]:
            raise DispatchCombineError(f"x, topk_ids and topk_weights disagree on rows: {x.shape[0]}, {topk_ids.shape[0]}, {topk_weights.shape[0]}")
        m, lay = self.mem, self.mem.layout
        self._launchers[0](
            x.data_ptr(), topk_ids.data_ptr(), topk_weights.data_ptr(), num_tokens.data_ptr(), self.expert_counts.data_ptr(),
            m.peer_table.data_ptr(), lay["flags"], lay["ntok"], lay["disp_x"], lay["disp_scales"], lay["disp_ids"], lay["disp_w"],
            self.max_tokens, self.ctas_per_peer,
        )

    def dispatch_recv(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """Wait for every peer and fill the per-expert layout; returns ``(recv_x, recv_scales, expert_counts, recv_src)``."""
        m, lay = self.mem, self.mem.layout
        scales = self.recv_scales.data_ptr() if self.recv_scales is not None else 0
        self._launchers[1](
            m.peer_table.data_ptr(), lay["flags"], lay["ntok"], lay["disp_x"], lay["disp_scales"], lay["disp_ids"],
            self.recv_x.data_ptr(), scales, self.recv_src.data_ptr(), self._row_of.data_ptr(), self.expert_counts.data_ptr(),
            self._ctrl.data_ptr(), self.max_tokens, self.ctas_per_peer,
        )
        return self.recv_x, self.recv_scales, self.expert_counts, self.recv_src

    def combine_send(self, y: torch.Tensor) -> None:
        """Send expert outputs ``y`` ``[E_local, capacity, H]`` bf16, weighted and summed per token, back to the tokens' ranks."""
        if tuple(y.shape) != (self.num_local, self.capacity, self.hidden) or y.dtype != torch.bfloat16 or not y.is_contiguous():
            raise DispatchCombineError(f"y must be contiguous bf16 {(self.num_local, self.capacity, self.hidden)}, got {y.dtype} {tuple(y.shape)}")
        m, lay = self.mem, self.mem.layout
        self._launchers[2](
            y.data_ptr(), self._row_of.data_ptr(), m.peer_table.data_ptr(), lay["flags"], lay["ntok"], lay["disp_w"], lay["comb"],
            self.max_tokens, self.ctas_per_peer,
        )

    def combine_recv(self, topk_ids: torch.Tensor, num_tokens: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Wait for every peer and write ``out`` ``[max_tokens, H]`` bf16 (the sum per token).

        ``topk_ids`` and ``num_tokens`` are the ones this round's `dispatch_send` took.
        """
        self._check("topk_ids", topk_ids, self.topk, torch.int32)
        self._check("num_tokens", num_tokens, None, torch.int32)
        if tuple(out.shape) != (self.max_tokens, self.hidden) or out.dtype != torch.bfloat16 or not out.is_contiguous():
            raise DispatchCombineError(f"out must be contiguous bf16 {(self.max_tokens, self.hidden)}, got {out.dtype} {tuple(out.shape)}")
        m, lay = self.mem, self.mem.layout
        self._launchers[3](
            topk_ids.data_ptr(), num_tokens.data_ptr(), out.data_ptr(), m.peer_table.data_ptr(), lay["flags"], lay["comb"],
            self._ctrl.data_ptr(), self.max_tokens, self.ctas_per_peer,
        )
        return out


def make_dispatch_combine(group: dist.ProcessGroup, num_experts: int, max_tokens: int, hidden: int, topk: int, payload: str = "bf16", device: torch.device | None = None
                          ) -> DispatchCombine | DispatchCombineReference:
    """The peer-memory implementation on CUDA devices, the torch reference elsewhere."""
    device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    if device.type == "cuda":
        return DispatchCombine(group, num_experts, max_tokens, hidden, topk, payload)
    return DispatchCombineReference(group, num_experts, max_tokens, hidden, topk, payload)
