"""Device-side building blocks shared by the CuTeDSL communication kernels.

Everything here is a ``@cute.jit`` helper that inlines into a kernel. Addresses are
plain ``Int64`` values (raw device pointers, ours or a peer's mapping of peer memory),
which keeps kernel signatures independent of the world size and lets a kernel pick
a peer at run time (the dispatch kernel routes by expert id).

Memory ordering follows the PTX memory model: data is written with ordinary stores,
then one thread per destination issues ``fence.acq_rel.sys`` and a
``st.release.sys`` flag store after a CTA barrier; the receiver polls with
``ld.acquire.sys`` and releases its CTA with a barrier. Flag values are monotone
per call ("epochs"), compared with wrap-around arithmetic, so no flag is ever reset
and nothing depends on the host: a CUDA graph replays the same kernels and the
epoch, kept in device memory, moves on by itself.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# Peer tables and flag rows are sized for the largest group any kernel supports.
MAX_PEERS = 16
# Upper bound of CTAs in one comm kernel launch; each CTA owns one flag row.
MAX_BLOCKS = 264
# Bytes of one vector access (ld/st .v4.b32).
VEC_BYTES = 16
# Control words in the rank-local (not peer-visible) control tensor.
CTRL_EPOCH = 0  # calls completed on this rank (all ranks count the same calls)
CTRL_DONE = 1  # CTAs of the running launch that have finished (last one bumps the epoch)
CTRL_WORDS = 8
# A flag wait that lasts longer than this means a peer is gone: trap instead of hanging.
WAIT_TIMEOUT_NS = 20_000_000_000


@cute.jit
def gptr(dtype: cutlass.Constexpr, addr: Int64, align: cutlass.Constexpr = 16):
    """A global-memory pointer to ``dtype`` at byte address ``addr``."""
    return cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align)


@cute.jit
def load_i64(addr: Int64) -> Int64:
    return cute.arch.load(gptr(Int64, addr, 8), Int64)


@cute.jit
def load_i32(addr: Int64) -> Int32:
    return cute.arch.load(gptr(Int32, addr, 4), Int32)


@cute.jit
def store_i32(addr: Int64, value: Int32):
    cute.arch.store(gptr(Int32, addr, 4), value)


@cute.jit
def load_f32(addr: Int64) -> Float32:
    return cute.arch.load(gptr(Float32, addr, 4), Float32)


@cute.jit
def store_f32(addr: Int64, value: Float32):
    cute.arch.store(gptr(Float32, addr, 4), value)


@cute.jit
def peer_base(table: Int64, q) -> Int64:
    """Base address of rank ``q``'s peer buffer, read from the device pointer table."""
    return load_i64(table + Int64(q) * 8)


@cute.jit
def signal(flag_addr: Int64, value: Int32):
    """Publish every write this CTA made before its last barrier, then set a flag."""
    cute.arch.fence_acq_rel_sys()
    cute.arch.store(gptr(Int32, flag_addr, 4), value, sem="release", scope="sys")


@cute.jit
def wait_at_least(flag_addr: Int64, target: Int32):
    """Spin until the flag has reached ``target`` (wrap-around safe comparison).

    A peer that never arrives (crashed, or issuing a different sequence of calls)
    would otherwise hang the GPU forever; after `WAIT_TIMEOUT_NS` the kernel traps,
    which surfaces as a CUDA error on the host.
    """
    ptr = gptr(Int32, flag_addr, 4)
    start = cute.arch.globaltimer()
    v = cute.arch.load(ptr, Int32, sem="acquire", scope="sys")
    while (v - target) < 0:
        v = cute.arch.load(ptr, Int32, sem="acquire", scope="sys")
        if cute.arch.globaltimer() - start > WAIT_TIMEOUT_NS:
            llvm.intr_trap()


@cute.jit
def cta_barrier(table: Int64, flags_off: Int64, rank: cutlass.Constexpr, world: cutlass.Constexpr, value: Int32):
    """Barrier between CTA ``blockIdx.x`` of every rank.

    Flag row of CTA b on rank r: ``flags[b][src]`` (int32, ``MAX_PEERS`` per row) in
    r's peer buffer. Thread q < world tells rank q "rank `rank` reached `value`" and
    then waits for rank q's word in its own row.
    """
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    cute.arch.sync_threads()
    if tid < world:
        row = flags_off + Int64(bid * MAX_PEERS) * 4
        signal(peer_base(table, tid) + row + Int64(rank) * 4, value)
        wait_at_least(peer_base(table, rank) + row + Int64(tid) * 4, value)
    cute.arch.sync_threads()


@cute.jit
def read_epoch(ctrl: Int64) -> Int32:
    return load_i32(ctrl + CTRL_EPOCH * 4)


@cute.jit
def finish_launch(ctrl: Int64):
    """The last CTA of the launch to get here advances the epoch.

    No CTA reads the epoch after it has counted itself done, so every CTA of a launch
    sees the same epoch; the next launch on the stream sees the incremented one.
    """
    tid, _, _ = cute.arch.thread_idx()
    nblocks, _, _ = cute.arch.grid_dim()
    cute.arch.sync_threads()
    if tid == 0:
        done_ptr = gptr(Int32, ctrl + CTRL_DONE * 4, 4)
        old = cute.arch.atomic_add(done_ptr, Int32(1), sem="acq_rel", scope="gpu")
        if old == Int32(nblocks) - 1:
            cute.arch.store(done_ptr, Int32(0))
            store_i32(ctrl + CTRL_EPOCH * 4, read_epoch(ctrl) + 1)


# Rows per CTA of the warp-per-row kernels (norms, RoPE, router): one warp each.
ROW_WARPS = 4


@cute.jit
def grid_stride() -> tuple[Int32, Int32]:
    """(this thread's first index, the grid's thread count): a grid-stride loop's start and step."""
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    nthr, _, _ = cute.arch.block_dim()
    nblk, _, _ = cute.arch.grid_dim()
    return bid * nthr + tid, nblk * nthr


@cute.jit
def warp_row() -> tuple[Int32, Int32]:
    """(row, lane) of the calling thread in a warp-per-row kernel launched with
    ``row_launch(rows)``: CTAs of ``32 * ROW_WARPS`` threads."""
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    return bid * ROW_WARPS + tid // 32, cute.arch.lane_idx()


def row_launch(rows: Int32) -> dict:
    """``launch()`` keywords (less the stream) of a warp-per-row kernel over ``rows`` rows (launched with PDL:
    the kernel must start with `wait_for_previous_kernel`)."""
    return {"grid": [(rows + ROW_WARPS - 1) // ROW_WARPS, 1, 1], "block": [32 * ROW_WARPS, 1, 1], "use_pdl": True}


# Programmatic dependent launch (PDL) for the short kernels of a model step (norms and RoPE, routing, token
# selection and combine, activation quantization, decode attention): launched with ``use_pdl=True``, a kernel's
# CTAs are scheduled while the kernel before it in the stream is still finishing instead of after it, and wait in
# `wait_for_previous_kernel` -- the first statement of every such kernel, before any global memory access --
# until that kernel has finished and its writes are visible.  In a decode step these kernels run 1-4 us each,
# about what a launch after a finished kernel costs.  (The decode-sized grouped GEMMs do the same, see
# `kernels.grouped_gemm_sm90`.)  Without the launch attribute the wait returns at once.  One H200, decode step of
# 16 layers of Qwen3-30B shapes, FP8 experts, CUDA graph, B N N B (99c4a8de7b5c+s44-pdl against 99c4a8de7b5c):
# -1.7% at 64 sequences (3.873 / 3.859 -> 3.810 / 3.788 ms), -1.8% at 128, level at 16.  In a profile such a
# kernel's time includes its wait for the kernel before it.
@cute.jit
def wait_for_previous_kernel():
    """PDL prologue: wait for the previous kernel in the stream and its memory, then let the next one launch."""
    cute.arch.griddepcontrol_wait()
    cute.arch.griddepcontrol_launch_dependents()


@cute.jit
def load_vec_f32(addr: Int64, dtype: cutlass.Constexpr, vec: cutlass.Constexpr, valid: Int32, align: cutlass.Constexpr = 16):
    """Load ``vec`` elements at ``addr`` as fp32; elements at index >= ``valid`` read as 0.

    Full vectors take one vector load (``align`` bytes must hold for ``addr``); only
    a tensor's tail takes scalar loads.
    """
    frag = cute.make_rmem_tensor((vec,), Float32)
    g = cute.make_tensor(gptr(dtype, addr, align), cute.make_layout(vec))
    if valid >= vec:
        frag.store(g.load().to(Float32))
    else:
        frag.fill(0.0)
        for e in cutlass.range_constexpr(vec):
            if e < valid:
                frag[e] = g[e].to(Float32)
    return frag


@cute.jit
def store_vec_f32(addr: Int64, frag, dtype: cutlass.Constexpr, vec: cutlass.Constexpr, valid: Int32, align: cutlass.Constexpr = 16):
    """Store fp32 ``frag`` converted to ``dtype``; only the first ``valid`` elements are written."""
    g = cute.make_tensor(gptr(dtype, addr, align), cute.make_layout(vec))
    if valid >= vec:
        g.store(frag.load().to(dtype))
    else:
        for e in cutlass.range_constexpr(vec):
            if e < valid:
                g[e] = frag[e].to(dtype)


@cute.jit
def load_vec(addr: Int64, dtype: cutlass.Constexpr, vec: cutlass.Constexpr, valid: Int32, align: cutlass.Constexpr = 16):
    """Load ``vec`` elements at ``addr`` unconverted (for copies); elements at index >= ``valid`` read as 0."""
    frag = cute.make_rmem_tensor((vec,), dtype)
    g = cute.make_tensor(gptr(dtype, addr, align), cute.make_layout(vec))
    if valid >= vec:
        frag.store(g.load())
    else:
        frag.fill(0.0)
        for e in cutlass.range_constexpr(vec):
            if e < valid:
                frag[e] = g[e]
    return frag


@cute.jit
def store_vec(addr: Int64, frag, dtype: cutlass.Constexpr, vec: cutlass.Constexpr, valid: Int32, align: cutlass.Constexpr = 16):
    """Store ``frag`` (already ``dtype``); only the first ``valid`` elements are written."""
    g = cute.make_tensor(gptr(dtype, addr, align), cute.make_layout(vec))
    if valid >= vec:
        g.store(frag.load())
    else:
        for e in cutlass.range_constexpr(vec):
            if e < valid:
                g[e] = frag[e]



# --------------------------------------------------------------------------- data-as-flag (Lamport) pieces
#
# A receive buffer pre-filled with all-ones bytes needs no flag: the reader polls
# the data itself until no element holds the all-ones pattern (a NaN in bf16, fp16
# and fp32), then writes the pattern back for the call after next. A sender turns
# every all-ones element of its payload into another NaN first (`sentinel_free`),
# so real data can never look unwritten.


@dsl_user_op
def load_volatile_v4(addr: Int64, *, loc=None, ip=None) -> tuple[Int32, Int32, Int32, Int32]:
    """16 bytes at ``addr`` as 4 words, read from L2 on every call (``ld.volatile``: never an L1 hit, so a
    spin loop sees a peer's NVLink stores)."""
    res = llvm.inline_asm(
        ir.Type.parse("!llvm.struct<(i32,i32,i32,i32)>"),
        [Int64(addr).ir_value(loc=loc, ip=ip)],
        "ld.volatile.global.v4.b32 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,l,~{memory}",
        has_side_effects=True,
        asm_dialect=0,
        loc=loc,
        ip=ip,
    )
    return tuple(Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def store_v4(addr: Int64, w0: Int32, w1: Int32, w2: Int32, w3: Int32, *, loc=None, ip=None) -> None:
    """Store 4 words (16 bytes) at ``addr``."""
    llvm.inline_asm(
        None,
        [Int64(addr).ir_value(loc=loc, ip=ip)] + [Int32(w).ir_value(loc=loc, ip=ip) for w in (w0, w1, w2, w3)],
        "st.global.v4.b32 [$0], {$1, $2, $3, $4};",
        "l,r,r,r,r,~{memory}",
        has_side_effects=True,
        asm_dialect=0,
        loc=loc,
        ip=ip,
    )


@cute.jit
def sentinel_free(w: Int32, bits: cutlass.Constexpr) -> Int32:
    """``w`` (one word of ``bits``-wide elements) with every all-ones element made a positive NaN
    (sign bit cleared). Only NaNs change, and a sum with a NaN term is the canonical NaN
    whatever the payload, so results keep their bits."""
    res = w
    if cutlass.const_expr(bits == 32):
        if w == Int32(-1):
            res = Int32(0x7FFFFFFF)
    else:
        if (w | Int32(-65536)) == Int32(-1):  # low half all ones
            res = res ^ Int32(0x8000)
        if (w | Int32(0xFFFF)) == Int32(-1):  # high half all ones
            res = res ^ Int32(-(1 << 31))
    return res


@cute.jit
def sentinel_count(w: Int32, bits: cutlass.Constexpr) -> Int32:
    """How many ``bits``-wide elements of word ``w`` still hold the all-ones pattern."""
    cnt = Int32(0)
    if cutlass.const_expr(bits == 32):
        if w == Int32(-1):
            cnt = Int32(1)
    else:
        if (w | Int32(-65536)) == Int32(-1):
            cnt = cnt + 1
        if (w | Int32(0xFFFF)) == Int32(-1):
            cnt = cnt + 1
    return cnt


@cute.jit
def wait_written_v4(addr: Int64, bits: cutlass.Constexpr):
    """Spin on the 16 bytes at ``addr`` (in this rank's memory) until a peer has written every
    element; returns the 4 words. Traps after `WAIT_TIMEOUT_NS` like `wait_at_least`."""
    w0, w1, w2, w3 = load_volatile_v4(addr)
    pending = sentinel_count(w0, bits) + sentinel_count(w1, bits) + sentinel_count(w2, bits) + sentinel_count(w3, bits)
    if pending > 0:
        start = cute.arch.globaltimer()
        while pending > 0:
            w0, w1, w2, w3 = load_volatile_v4(addr)
            pending = sentinel_count(w0, bits) + sentinel_count(w1, bits) + sentinel_count(w2, bits) + sentinel_count(w3, bits)
            if cute.arch.globaltimer() - start > WAIT_TIMEOUT_NS:
                llvm.intr_trap()
    return w0, w1, w2, w3
