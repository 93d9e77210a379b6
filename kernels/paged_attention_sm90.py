"""CuTeDSL kernels of :func:`kernels.paged_attention.paged_decode_attention` (CUDA tensors only).

Decode attention straight from the paged pool: one query per sequence, the ``g`` query
heads of a KV head as the 16 rows of ``mma.sync.m16n8k16`` (bf16 in, fp32 out; rows past
``g`` are zeros), so every K/V element loaded feeds all ``g`` heads at once.

Work split (flash-decoding). CTA ``(split, kv head, sequence)`` takes an equal share of the
sequence's 16-token tiles (``ceil(tiles / splits)``, from the length read on the GPU); its
4 warps take every 4th tile of the share. A warp loads each tile's K and V straight from the
tile's page (16-byte loads, every 32-byte sector used whole) one tile ahead, into registers,
while it computes the tile before (and the page id one more tile ahead); per tile it computes the 16 x 16 scores
with 16 MMAs, runs the online softmax in fp32 (exp2, scale folded in), and adds P @ V with
``head_dim / 8`` MMAs into its fp32 accumulator. The 4 warps' (max, sum, output) meet in
shared memory; with one split the CTA writes the bf16 output, otherwise fp32 partials that
``_combine_kernel`` merges (one CTA per (sequence, query head)).

Several queries a CTA (``queries`` > 1, `kernels.paged_attention.paged_multi_query_attention`): the
rows of KV head ``h`` hold ``queries`` queries of one sequence, ``group // queries`` heads each, and
``lens`` holds a length per query (nondecreasing). Rows ``grp`` and ``grp + 8`` of a thread are masked
at their own query's length; the tiles run to the last query's. With one query the kernel is the
decode kernel above (its PTX is unchanged by this option).

Fragment layouts (PTX ISA, ``mma.m16n8k16``; lane = 4 * grp + t): A holds rows ``grp`` and
``grp + 8`` at k ``2t, 2t+1`` and ``2t+8, 2t+9``; B holds k ``2t, 2t+1`` and ``2t+8, 2t+9`` at
column ``grp``; C holds rows ``grp``, ``grp + 8`` at columns ``2t, 2t+1``. Contracted
dimensions may be permuted freely as long as both operands agree, which is how the loads
stay 16 bytes wide without shared memory:

* Q @ K^T contracts head dims: in k-step ``2j + hh`` the logical k ``2t + e`` is dim
  ``32j + 8t + 4hh + e`` and ``2t + 8 + e`` is ``32j + 8t + 4hh + 2 + e``, so thread t's
  16-byte load of dims ``32j + 8t .. + 8`` (of a K row, and of its Q rows) feeds two k-steps.
* P @ V contracts tokens, in their natural order (P's A fragment is the scores' C fragment
  converted to bf16 in place). V's B fragment wants two tokens of one dim per register, so
  thread (grp, t) loads dims ``64hh + 8grp .. + 8`` of tokens ``2t, 2t+1, 2t+8, 2t+9`` and
  pairs them with ``prmt``; output column n of n-tile ``8hh + e`` is dim ``64hh + 8n + e``.

Launch shapes come from static tensor shapes and the split count the host picks, lengths
and page ids are read on the GPU: the launches are CUDA-graph capturable.

Measured (2x H200, fec297f6042a, bench/results/paged_attention.jsonl; one layer call under
a CUDA graph, K/V not in L2): 3.0-3.9x faster than gather + SDPA in all 18 cases (30B and
235B heads, batch 32/64/128, context 512/4k/16k), e.g. 30B heads at batch 64: 33.5 us vs
102.7 at 512 tokens, 568 us vs 1893 at 16k; 2.9-3.9 TB/s of K/V at 4k+ tokens, 1.8-2.5
TB/s at 512 (18-60 us: launch and split-combine overheads show). ptxas: 158 registers at
8 query heads per KV head, 210 at 16, no spills. With page ids loaded a tile ahead
(ebaad7df4cf1, another 2x H200 machine, so a cross-run comparison): 30B heads at batch 64 /
128 and 512 tokens 26.8 / 49.9 us (was 33.5 / 53.0), at 4k 148 / 280 (156 / 315); 235B heads
level at 512 (32.0 / 60.0 vs 31.9 / 59.7) and 3-4% slower at 4k (162 / 305 vs 157 / 293).
K/V loaded a tile ahead (one H200, each arm from its own tree, B N N B, [8c2adcbb8b38+s37-kvahead] against
[8c2adcbb8b38]), batch 16 / 64 / 128: 30B heads at 4k 41.9 / 145 / 288 -> 39.6 / 135 / 271 us (-5..-7%), at 512
10.9 / 22.4 / 42.3 -> 11.4 / 21.3 / 40.8 (+4% at 16, -3.5..-5% beyond); 235B heads at 4k 45.5 / 155 / 302 ->
40.4 / 134 / 261 (-11..-14%), at 512 12.5 / 24.5 / 47.3 -> 12.5 / 22.3 / 42.8 (level at 16, -9% beyond); means
of two runs. ptxas (CUDA 12.9): 255 registers and a 24-byte spill at 8 query heads per KV head, 245 and none at 16
(before: 202 and 210). In a whole decode step at 4k context (bench.decode_step, 64 sequences, 16 layers of 30B
shapes, another call) no change was measured (5.70-5.75 ms both): not explained; the step's interleaved page tables
are one difference from this bench.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import cuda.bindings.driver as cuda_driver
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from kernels._cute_comm import load_f32, load_i32, load_i64, store_f32, wait_for_previous_kernel
from kernels._cute_runtime import dummy_stream, launcher
from kernels.paged_attention import TILE

if TYPE_CHECKING:
    from cutlass.base_dsl.jit_executor import JitCompiledFunction

THREADS = 128
WARPS = THREADS // 32
ROWS = 16  # query rows of an MMA tile: the most query heads per KV head the kernel takes
MASKED = -1.0e30  # score of a masked key and the running max of a warp with no tile (finite: no inf - inf)
LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------- PTX pieces


@dsl_user_op
def _load_v4(addr: Int64, *, loc=None, ip=None) -> tuple[Int32, Int32, Int32, Int32]:
    """16 read-only bytes at ``addr`` as 4 words (``ld.global.nc``: K/V, Q and tables do not change during the launch)."""
    res = llvm.inline_asm(
        ir.Type.parse("!llvm.struct<(i32,i32,i32,i32)>"),
        [Int64(addr).ir_value(loc=loc, ip=ip)],
        "ld.global.nc.L1::no_allocate.v4.b32 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,l",
        asm_dialect=0,
        loc=loc,
        ip=ip,
    )
    return tuple(Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def _mma(a: tuple, b0: Int32, b1: Int32, c: tuple, *, loc=None, ip=None) -> tuple[Float32, Float32, Float32, Float32]:
    """``mma.sync.m16n8k16`` bf16 x bf16 + fp32: A in 4 words, B in 2, C/D in 4 floats."""
    ins = [Int32(x).ir_value(loc=loc, ip=ip) for x in (*a, b0, b1)] + [Float32(x).ir_value(loc=loc, ip=ip) for x in c]
    res = llvm.inline_asm(
        ir.Type.parse("!llvm.struct<(f32,f32,f32,f32)>"),
        ins,
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
        asm_dialect=0,
        loc=loc,
        ip=ip,
    )
    return tuple(Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def _exp2(x: Float32, *, loc=None, ip=None) -> Float32:
    """2^x (``ex2.approx``: 2 ulp; 2^-1e30 is 0)."""
    return Float32(llvm.inline_asm(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], "ex2.approx.ftz.f32 $0, $1;", "=f,f",
                                   asm_dialect=0, loc=loc, ip=ip))


@dsl_user_op
def _prmt(a: Int32, b: Int32, selector: int, *, loc=None, ip=None) -> Int32:
    """Byte permute of ``{b, a}``: 0x5410 pairs the low bf16 halves, 0x7632 the high ones (a's in the low half)."""
    return Int32(llvm.inline_asm(T.i32(), [Int32(a).ir_value(loc=loc, ip=ip), Int32(b).ir_value(loc=loc, ip=ip)],
                                 f"prmt.b32 $0, $1, $2, {selector:#x};", "=r,r,r", asm_dialect=0, loc=loc, ip=ip))


@dsl_user_op
def _pack_bf16(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Int32:
    """Two floats rounded to bf16 in one word, ``lo`` in the low half (the lower k index of a fragment pair)."""
    return Int32(llvm.inline_asm(T.i32(), [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
                                 "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", asm_dialect=0, loc=loc, ip=ip))


@cute.jit
def _load_index(addr: Int64, index_bytes: cutlass.Constexpr) -> Int64:
    """One int32 or int64 entry of a page table or length vector."""
    value = Int64(0)
    if cutlass.const_expr(index_bytes == 8):
        value = load_i64(addr)
    else:
        value = Int64(load_i32(addr))
    return value


@dsl_user_op
def _store_bf16(addr: Int64, value: Float32, *, loc=None, ip=None) -> None:
    """``value`` rounded to bf16, stored at ``addr``."""
    llvm.inline_asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), Float32(value).ir_value(loc=loc, ip=ip)],
                    "{\n\t.reg .b16 h;\n\tcvt.rn.bf16.f32 h, $1;\n\tst.global.b16 [$0], h;\n\t}", "l,f,~{memory}",
                    has_side_effects=True, asm_dialect=0, loc=loc, ip=ip)


@cute.jit
def _quad_max(x: Float32) -> Float32:
    """Max over the 4 lanes holding one row of a C fragment."""
    x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1))
    return cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=2))


@cute.jit
def _quad_sum(x: Float32) -> Float32:
    x = x + cute.arch.shuffle_sync_bfly(x, offset=1)
    return x + cute.arch.shuffle_sync_bfly(x, offset=2)


# --------------------------------------------------------------------------- the split kernel


@cute.jit
def _row_address(pool: Int64, table_row: Int64, token: Int32, kv: cutlass.Constexpr, head: Int32, kv_heads: Int32,
                 max_pages: Int32, page: Int64, head_dim: cutlass.Constexpr, page_size: cutlass.Constexpr,
                 table_bytes: cutlass.Constexpr) -> Int64:
    """Byte address of ``token``'s K (kv 0) or V (kv 1) row of KV head ``head``. ``page``: the tile's
    page id when a tile lies in one page (page_size a multiple of 16); smaller pages are looked
    up per token (clamped to the table: the rows past a sequence's end are masked)."""
    page_id = page
    if cutlass.const_expr(page_size < TILE):
        page_id = _load_index(table_row + Int64(cutlass.min(token // page_size, max_pages - 1)) * table_bytes, table_bytes)
    block = (page_id * 2 + kv) * Int64(kv_heads) + Int64(head)  # [page, K/V, head] block of page_size x head_dim
    return pool + (block * page_size + Int64(token % page_size)) * (head_dim * 2)


@cute.jit
def _load_kv_tile(dst, pool: Int64, table_row: Int64, tok0: Int32, head: Int32, kv_heads: Int32, max_pages: Int32,
                  page: Int64, t: Int32, grp: Int32, k_chunks: cutlass.Constexpr, v_chunks: cutlass.Constexpr,
                  head_dim: cutlass.Constexpr, page_size: cutlass.Constexpr, table_bytes: cutlass.Constexpr):
    """This thread's words of the 16-token tile at ``tok0`` into ``dst``: K first (rows ``8nt + grp``, dims
    ``32j + 8t .. + 8``), then V (tokens ``2t, 2t + 1, 2t + 8, 2t + 9``, dims ``64hh + 8grp .. + 8``); see the
    module doc for why these."""
    for nt in cutlass.range_constexpr(2):
        row = _row_address(pool, table_row, tok0 + nt * 8 + grp, 0, head, kv_heads, max_pages, page, head_dim,
                           page_size, table_bytes)
        for j in cutlass.range_constexpr(k_chunks):
            w = _load_v4(row + (j * 32 + t * 8) * 2)
            for e in cutlass.range_constexpr(4):
                dst[(nt * k_chunks + j) * 4 + e] = w[e]
    for i in cutlass.range_constexpr(4):
        row = _row_address(pool, table_row, tok0 + 2 * t + (0, 1, 8, 9)[i], 1, head, kv_heads, max_pages, page, head_dim,
                           page_size, table_bytes)
        for hh in cutlass.range_constexpr(v_chunks):
            w = _load_v4(row + (hh * 64 + grp * 8) * 2)
            for e in cutlass.range_constexpr(4):
                dst[2 * k_chunks * 4 + (i * v_chunks + hh) * 4 + e] = w[e]


@cute.jit
def _context_length(lens: Int64, entry: Int64, max_pages: Int32, page_size: cutlass.Constexpr, len_bytes: cutlass.Constexpr) -> Int32:
    """Entry ``entry`` of the length vector, clamped to ``0 .. max_pages * page_size``."""
    return Int32(cutlass.min(cutlass.max(_load_index(lens + entry * len_bytes, len_bytes), Int64(0)), Int64(max_pages) * page_size))


@cute.kernel
def _split_kernel(q: Int64, pool: Int64, tables: Int64, lens: Int64, out: Int64, part_o: Int64, part_ml: Int64,
                  kv_heads: Int32, max_pages: Int32, splits: Int32, scale_log2: Float32, group: cutlass.Constexpr,
                  head_dim: cutlass.Constexpr, page_size: cutlass.Constexpr, table_bytes: cutlass.Constexpr,
                  len_bytes: cutlass.Constexpr, queries: cutlass.Constexpr):
    wait_for_previous_kernel()
    split, head, seq = cute.arch.block_idx()
    tid, _, _ = cute.arch.thread_idx()
    warp, lane = tid // 32, tid % 32
    grp, t = lane // 4, lane % 4
    q_heads = kv_heads * group
    n_tiles_d = head_dim // 8  # n-tiles of P @ V
    k_chunks = head_dim // 32  # 16-byte loads per K row and thread (two k-steps each)
    v_chunks = head_dim // 64  # 16-byte loads per V row and thread

    # ``queries`` queries of one sequence share the CTA's rows, ``group // queries`` each (module doc): rows
    # grp and grp + 8 see their own query's length, the tiles run to the last (longest) query's.
    length = _context_length(lens, Int64(seq) * queries + queries - 1, max_pages, page_size, len_bytes)
    row_lengths = (length, length)
    if cutlass.const_expr(queries > 1):
        heads = group // queries
        row_lengths = (_context_length(lens, Int64(seq) * queries + Int64(cutlass.min(grp // heads, queries - 1)), max_pages, page_size, len_bytes),
                       _context_length(lens, Int64(seq) * queries + Int64(cutlass.min((grp + 8) // heads, queries - 1)), max_pages, page_size,
                                       len_bytes))
    n_tiles = (length + TILE - 1) // TILE
    share = (n_tiles + splits - 1) // splits
    first = split * share
    last = cutlass.min(n_tiles, first + share)
    table_row = tables + Int64(seq) * Int64(max_pages) * table_bytes

    # Q as A fragments, one per k-step: rows grp and grp + 8 (zeros past the group).
    qf = cute.make_rmem_tensor((head_dim // 16 * 4,), Int32)
    qf.fill(0)
    for half in cutlass.range_constexpr(2):
        row = grp + 8 * half
        if row < group:
            q_row = q + (Int64(seq) * q_heads + Int64(head * group + row)) * (head_dim * 2)
            for j in cutlass.range_constexpr(k_chunks):
                w = _load_v4(q_row + (j * 32 + t * 8) * 2)
                for hh in cutlass.range_constexpr(2):
                    qf[(2 * j + hh) * 4 + half] = w[2 * hh]
                    qf[(2 * j + hh) * 4 + 2 + half] = w[2 * hh + 1]

    acc = cute.make_rmem_tensor((n_tiles_d * 4,), Float32)  # C fragments of P @ V: [n-tile][c0..c3]
    acc.fill(0.0)
    stats = cute.make_rmem_tensor((4,), Float32)  # running max of rows grp, grp+8 (log2 units); this thread's sums
    stats[0] = MASKED
    stats[1] = MASKED
    stats[2] = 0.0
    stats[3] = 0.0
    # Software pipeline over a warp's tiles: a tile's K and V are loaded one tile ahead, into registers,
    # while the tile before is computed, and (when a tile lies in one page) its page id one more tile
    # ahead, so a tile's compute waits for no memory latency but the first's. Loaded in the loop they
    # would leave each warp with one tile in flight, a latency per tile: 22.5 us for 64 sequences of
    # 512 tokens (30B heads), ~1.3 TB/s of K/V.
    k_words = 2 * k_chunks * 4
    kv_next = cute.make_rmem_tensor((k_words + 4 * v_chunks * 4,), Int32)  # the next tile's K words, then V words
    next_page = Int64(0)
    if first + warp < last:
        page = Int64(0)
        if cutlass.const_expr(page_size >= TILE):
            page = _load_index(table_row + Int64((first + warp) * TILE // page_size) * table_bytes, table_bytes)
        _load_kv_tile(kv_next, pool, table_row, (first + warp) * TILE, head, kv_heads, max_pages, page, t, grp,
                      k_chunks, v_chunks, head_dim, page_size, table_bytes)
        if cutlass.const_expr(page_size >= TILE):
            if first + warp + WARPS < last:
                next_page = _load_index(table_row + Int64((first + warp + WARPS) * TILE // page_size) * table_bytes,
                                        table_bytes)
    for tile in cutlass.range(first + warp, last, WARPS):
        tok0 = tile * TILE
        kw = [[[kv_next[(nt * k_chunks + j) * 4 + w] for w in range(4)] for j in range(k_chunks)] for nt in range(2)]
        vw = [[[kv_next[k_words + (i * v_chunks + hh) * 4 + w] for w in range(4)] for hh in range(v_chunks)]
              for i in range(4)]
        if tile + WARPS < last:
            _load_kv_tile(kv_next, pool, table_row, (tile + WARPS) * TILE, head, kv_heads, max_pages, next_page, t, grp,
                          k_chunks, v_chunks, head_dim, page_size, table_bytes)
            if cutlass.const_expr(page_size >= TILE):
                if tile + 2 * WARPS < last:
                    next_page = _load_index(table_row + Int64((tile + 2 * WARPS) * TILE // page_size) * table_bytes,
                                            table_bytes)

        # Scores of tokens tok0 + 8nt + 2t + (c & 1), rows grp (c < 2) and grp + 8, in log2 units.
        x = []
        for nt in cutlass.range_constexpr(2):
            s = (Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0))
            for j in cutlass.range_constexpr(k_chunks):
                for hh in cutlass.range_constexpr(2):
                    ks = 2 * j + hh
                    s = _mma((qf[ks * 4], qf[ks * 4 + 1], qf[ks * 4 + 2], qf[ks * 4 + 3]), kw[nt][j][2 * hh], kw[nt][j][2 * hh + 1], s)
            for c in cutlass.range_constexpr(4):
                token = tok0 + nt * 8 + 2 * t + c % 2
                x.append(cutlass.select_(token < row_lengths[c // 2], s[c] * scale_log2, Float32(MASKED)))
        # x[4 * nt + c]; row grp: c in (0, 1), row grp + 8: c in (2, 3).
        p = [Float32(0.0)] * 8
        for half in cutlass.range_constexpr(2):
            cols = [4 * nt + 2 * half + e for nt in range(2) for e in range(2)]
            tile_max = _quad_max(cute.arch.fmax(cute.arch.fmax(x[cols[0]], x[cols[1]]), cute.arch.fmax(x[cols[2]], x[cols[3]])))
            m_old = stats[half]
            m_new = cute.arch.fmax(m_old, tile_max)
            alpha = _exp2(m_old - m_new)
            stats[half] = m_new
            row_sum = Float32(0.0)
            for col in cols:
                p[col] = _exp2(x[col] - m_new)
                row_sum = row_sum + p[col]
            stats[2 + half] = stats[2 + half] * alpha + row_sum
            for i in cutlass.range_constexpr(n_tiles_d):
                acc[i * 4 + 2 * half] = acc[i * 4 + 2 * half] * alpha
                acc[i * 4 + 2 * half + 1] = acc[i * 4 + 2 * half + 1] * alpha
        pa = (_pack_bf16(p[0], p[1]), _pack_bf16(p[2], p[3]), _pack_bf16(p[4], p[5]), _pack_bf16(p[6], p[7]))
        for hh in cutlass.range_constexpr(v_chunks):
            for e in cutlass.range_constexpr(8):
                sel = 0x5410 if e % 2 == 0 else 0x7632
                b0 = _prmt(vw[0][hh][e // 2], vw[1][hh][e // 2], sel)  # tokens 2t, 2t + 1 of dim 64hh + 8grp + e
                b1 = _prmt(vw[2][hh][e // 2], vw[3][hh][e // 2], sel)  # tokens 2t + 8, 2t + 9
                i = hh * 8 + e
                o = _mma(pa, b0, b1, (acc[i * 4], acc[i * 4 + 1], acc[i * 4 + 2], acc[i * 4 + 3]))
                for c in cutlass.range_constexpr(4):
                    acc[i * 4 + c] = o[c]

    # The 4 warps' partial results meet in shared memory: output rows [warp][row][dim], (max, sum) [warp][row].
    smem = cutlass.memory.SmemAllocator()
    s_out = smem.allocate_tensor(Float32, cute.make_layout(WARPS * group * head_dim), 16)
    s_stats = smem.allocate_tensor(Float32, cute.make_layout(WARPS * ROWS * 2), 16)
    for half in cutlass.range_constexpr(2):
        row = grp + 8 * half
        row_sum = _quad_sum(stats[2 + half])
        if row < group:
            for i in cutlass.range_constexpr(n_tiles_d):
                for e in cutlass.range_constexpr(2):
                    dim = (i // 8) * 64 + (2 * t + e) * 8 + i % 8
                    s_out[(warp * group + row) * head_dim + dim] = acc[i * 4 + 2 * half + e]
        if t == 0:
            s_stats[(warp * ROWS + row) * 2] = stats[half]
            s_stats[(warp * ROWS + row) * 2 + 1] = row_sum
    cute.arch.sync_threads()
    for item in cutlass.range(tid, group * head_dim, THREADS):
        row, dim = item // head_dim, item % head_dim
        m_all = Float32(MASKED)
        for w in cutlass.range_constexpr(WARPS):
            m_all = cute.arch.fmax(m_all, s_stats[(w * ROWS + row) * 2])
        total, value = Float32(0.0), Float32(0.0)
        for w in cutlass.range_constexpr(WARPS):
            f = _exp2(s_stats[(w * ROWS + row) * 2] - m_all)
            total = total + f * s_stats[(w * ROWS + row) * 2 + 1]
            value = value + f * s_out[(w * group + row) * head_dim + dim]
        if splits == 1:
            inv = Float32(0.0)
            if total > 0.0:
                inv = 1.0 / total
            _store_bf16(out + ((Int64(seq) * q_heads + Int64(head * group + row)) * head_dim + dim) * 2, value * inv)
        else:
            part = ((Int64(seq) * kv_heads + Int64(head)) * splits + Int64(split)) * group + Int64(row)
            store_f32(part_o + (part * head_dim + dim) * 4, value)
            if dim == 0:
                store_f32(part_ml + part * 8, m_all)
                store_f32(part_ml + part * 8 + 4, total)


@cute.kernel
def _combine_kernel(part_o: Int64, part_ml: Int64, out: Int64, kv_heads: Int32, splits: Int32, group: cutlass.Constexpr,
                    head_dim: cutlass.Constexpr):
    """out[seq, q head] from the splits' partials: CTA (q head, seq), thread = dim."""
    wait_for_previous_kernel()
    q_head, seq, _ = cute.arch.block_idx()
    dim, _, _ = cute.arch.thread_idx()
    head, row = q_head // group, q_head % group
    base = (Int64(seq) * kv_heads + Int64(head)) * splits * group + Int64(row)  # partial of split s: base + s * group
    m_all = Float32(MASKED)
    for s in cutlass.range(splits):
        m_all = cute.arch.fmax(m_all, load_f32(part_ml + (base + Int64(s) * group) * 8))
    total, value = Float32(0.0), Float32(0.0)
    for s in cutlass.range(splits):
        part = base + Int64(s) * group
        f = _exp2(load_f32(part_ml + part * 8) - m_all)
        total = total + f * load_f32(part_ml + part * 8 + 4)
        value = value + f * load_f32(part_o + (part * head_dim + dim) * 4)
    inv = Float32(0.0)
    if total > 0.0:
        inv = 1.0 / total
    _store_bf16(out + ((Int64(seq) * kv_heads * group + Int64(q_head)) * head_dim + dim) * 2, value * inv)


# --------------------------------------------------------------------------- host side


@cute.jit
def _launch_split(q: Int64, pool: Int64, tables: Int64, lens: Int64, out: Int64, part_o: Int64, part_ml: Int64,
                  batch: Int32, kv_heads: Int32, max_pages: Int32, splits: Int32, scale_log2: Float32,
                  stream: cuda_driver.CUstream, group: cutlass.Constexpr, head_dim: cutlass.Constexpr,
                  page_size: cutlass.Constexpr, table_bytes: cutlass.Constexpr, len_bytes: cutlass.Constexpr,
                  queries: cutlass.Constexpr):
    smem_bytes = (WARPS * group * head_dim + WARPS * ROWS * 2) * 4 + 64
    _split_kernel(q, pool, tables, lens, out, part_o, part_ml, kv_heads, max_pages, splits, scale_log2, group, head_dim,
                  page_size, table_bytes, len_bytes, queries).launch(grid=[splits, kv_heads, batch], block=[THREADS, 1, 1], smem=smem_bytes,
                                                 stream=stream, use_pdl=True)


@cute.jit
def _launch_combine(part_o: Int64, part_ml: Int64, out: Int64, batch: Int32, kv_heads: Int32, splits: Int32,
                    stream: cuda_driver.CUstream, group: cutlass.Constexpr, head_dim: cutlass.Constexpr):
    _combine_kernel(part_o, part_ml, out, kv_heads, splits, group, head_dim).launch(
        grid=[kv_heads * group, batch, 1], block=[head_dim, 1, 1], stream=stream, use_pdl=True)


_CACHE: dict[tuple, object] = {}
_LOCK = threading.Lock()


def _compiled(key: tuple, build):
    with _LOCK:
        if key not in _CACHE:
            _CACHE[key] = build()
        return _CACHE[key]


def compiled_split(group: int, head_dim: int, page_size: int, table_bytes: int, len_bytes: int, queries: int = 1,
                   options: str = "") -> JitCompiledFunction:
    """The split kernel of one row count per KV head (``group``: query heads per KV head times ``queries``,
    the queries of a sequence sharing a CTA), head dim, page size and index widths, compiled once per
    process (no GPU needed); ``options`` go to ``cute.compile`` (and bypass the cache)."""
    def compile_split() -> JitCompiledFunction:
        z64, z32 = Int64(0), Int32(1)
        return cute.compile(_launch_split, z64, z64, z64, z64, z64, z64, z64, z32, z32, z32, z32, Float32(1.0), dummy_stream(), group,
                            head_dim, page_size, table_bytes, len_bytes, queries, options=options)

    # Looked up on every launch: the compile arguments are built only on a miss (they took ~8 us of host time).
    key = ("split", group, head_dim, page_size, table_bytes, len_bytes, queries)
    return compile_split() if options else _compiled(key, compile_split)


def compiled_combine(group: int, head_dim: int, options: str = "") -> JitCompiledFunction:
    """The combine kernel of one head shape, compiled once per process."""
    def compile_combine() -> JitCompiledFunction:
        z64, z32 = Int64(0), Int32(1)
        return cute.compile(_launch_combine, z64, z64, z64, z32, z32, z32, dummy_stream(), group, head_dim, options=options)

    return compile_combine() if options else _compiled(("combine", group, head_dim), compile_combine)


def launch(q: torch.Tensor, pool: torch.Tensor, page_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
           splits: int, out: torch.Tensor) -> None:
    """Enqueue the attention on ``q``'s device's current stream (``kernels.paged_attention`` checked the
    arguments: contiguous, aligned, supported shape). ``q`` ``[B, kv_heads * group, D]`` holds a CTA's rows:
    with ``context_lens`` ``[B, n]``, KV head ``h``'s rows are n queries' heads of ``h`` in turn (the
    caller's packing). ``splits > 1`` adds the partials' combine."""
    batch, q_heads, head_dim = q.shape
    _, _, kv_heads, page_size, _ = pool.shape
    group, max_pages = q_heads // kv_heads, page_tables.shape[1]
    table_bytes, len_bytes = page_tables.element_size(), context_lens.element_size()
    queries = context_lens.shape[1] if context_lens.dim() == 2 else 1
    split_fn = launcher(compiled_split(group, head_dim, page_size, table_bytes, len_bytes, queries), q.device)
    if splits == 1:
        part_o = part_ml = out  # never touched with one split
    else:
        part_o = torch.empty(batch * kv_heads * splits * group * head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(batch * kv_heads * splits * group * 2, dtype=torch.float32, device=q.device)
    split_fn(q.data_ptr(), pool.data_ptr(), page_tables.data_ptr(), context_lens.data_ptr(), out.data_ptr(), part_o.data_ptr(),
             part_ml.data_ptr(), batch, kv_heads, max_pages, splits, scale * LOG2E)
    if splits > 1:
        launcher(compiled_combine(group, head_dim), q.device)(part_o.data_ptr(), part_ml.data_ptr(), out.data_ptr(), batch,
                                                              kv_heads, splits)
