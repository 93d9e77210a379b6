"""Mainloops of the Hopper grouped GEMM for scaled operands (a mixin of ``GroupedGemmSm90``).

* FP8 E4M3 x E4M3 with 1x128 activation / 128x128 weight block scales:
  per-K-block partial products promoted into an fp32 accumulator by CUDA
  cores, hidden behind the tensor cores' work (two partials per warpgroup
  with 128-wide tiles, one with 192-wide tiles and the warpgroups in turn);
* bf16 activations x MXFP8 weights (E4M3 + one E8M0 scale per 32 along K):
  the consumer threads dequantize each weight tile to bf16 in shared memory
  (the E8M0 bytes come by TMA with the stage), then bf16 WGMMA (prefill; decode
  tiles convert in registers, ``grouped_gemm_sm90_swapped``).

The methods use the kernel object's attributes (``cfg``, ``tile_k``,
``k_tiles``, ``num_consumer_wg``, ``ab_dtype``, ``b_load_dtype``,
``scale_n_blocks``, ``_mma_stage``); see ``kernels.grouped_gemm_sm90``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from kernels.act_quant import QUANT_BLOCK
from kernels.grouped_gemm_mxfp8 import MX_BLOCK

# FP8 block-scale granularity along K (the activations' quantization blocks) and N (the weights' 128x128 blocks).
SCALE_BLOCK = QUANT_BLOCK
MX_B_BUFFERS = 3  # MXFP8: dequantized bf16 weight tiles (see _mainloop_mx for why three)
MX_SCALE_BOX = 16  # MXFP8: bytes of each scale row per TMA box (TMA's smallest inner box), 8 stages' worth
_BAR_WG_TURN = (5, 6)  # named barrier of each consumer warpgroup's WGMMA issue turn (FP8, 192-wide tiles)


class ScaledMainloops:
    """FP8 block-scaled and MXFP8 K loops of one output tile."""

    # ------------------------------------------------------ MXFP8 weights, bf16 MMA
    @cute.jit
    def _mainloop_mx(self, tiled_mma, tCrA, tCrB, num_k_blocks, acc, sBq, sBmma, sSF, mma_tidx, mainloop, read_state,
                     release_state):
        """bf16 x MXFP8: per K stage, the consumer threads dequantize the E4M3 weight tile to bf16.

        Every consumer thread converts one segment of one weight row (half a
        row with two warpgroups: exactly one 32-value scale block) from the
        TMA stage into a bf16 buffer, ``q * 2^(e - 127)`` (exact in bf16),
        then a barrier over the consumer threads, then the WGMMAs of that stage.
        192-row tiles (prefill above MID_TILE_MAX_TOKENS_PER_EXPERT) have a third
        consumer warpgroup that converts nothing: a stage's conversion, the same
        as a 128-row tile's, then feeds 1.5 times the WGMMA work.  One H200, burst,
        against 128-row tiles in the same call (18d998c990c2+wg3mx, forced tiles): all
        four Qwen3 prefill shapes +8..+17% at 375 and 2048 tokens per expert
        (235B gate_up at 2048: 409-414 -> 478-479 TFLOP/s), with three pipeline
        stages instead of five.
        The conversion of stage k overlaps stage k-1's WGMMAs, which stay in
        flight (``wait_group(1)``).  Three bf16 buffers: buffer k % 3 was last
        read by stage k-3's WGMMAs, which every warpgroup retired (its
        ``wait_group(1)`` in stage k-2) before the barrier of stage k-1 that
        this thread has passed (k counts the CTA's stages over all its tiles, the
        pipeline state's count: with the tile's own K index the ring restarted at
        buffer 0 each tile, so a tile of 3j + 1 stages, as Qwen3-235B gate_up's 64,
        ended on buffer 0 and the next tile's first conversion could overwrite it
        under the other warpgroup's last WGMMAs, whose epilogue does not wait for
        this one's); two buffers would race with the other
        warpgroup's WGMMAs of stage k-2.

        The E8M0 bytes come with the stage: the producer's TMA brings, on the
        stage's mbarrier, the ``[tile_n rows x MX_SCALE_BOX bytes]`` box of the
        scale rows (laid out ``scale_row_bytes`` apart by the launcher,
        ``kernels.grouped_gemm_mxfp8.kernel_scale_layout``) whose 16-byte window
        holds the stage's 2 bytes a row, so 8 consecutive stages load the same
        window (L2 serves the repeats); each thread reads its 1-2 bytes from
        shared memory after the stage's wait (one 16-bit load; rows 16 bytes
        apart put 4 of a warp's rows on one bank, 4 wavefronts a stage).  Rows
        past N and K past the row's blocks are zero-filled: the values they
        scale are zero-filled too.  The box costs 2 KB of shared memory a stage:
        decode keeps 8 stages, 128-row prefill tiles go from 6 to 5.  Before,
        every thread loaded its bytes from global memory, a byte a load one
        stage ahead: 97% of the kernel's global sectors excess (ncu), 8-15% of
        decode time against constant scales.  On one H200 (eaf1ac783ee9+h61
        against +base, base new new base, burst): decode 235B gate_up
        809-819 -> 716-722 us (-11..-12%), 235B down -3.4..-4.8%, 30B down
        -8..-9.6% (2.02-2.33 TB/s of MXFP8 bytes); prefill at 375 tokens 235B
        gate_up 440 -> 444 TFLOP/s (+0.9%), 30B down 378 -> 408 (+8%);
        loading 4/8/16-byte windows per thread had cost more than it saved
        (bench/grouped_gemm_findings.md).

        Measured before the scale boxes (grouped_gemm.jsonl at 5e6727614d60):
        decode took bf16's time (1.9-2.2 TB/s of MXFP8 bytes, half of what bf16
        and FP8 stream) and prefill reached 389-429 TFLOP/s (bf16 600-650).  Every
        stage runs wait -> convert -> fence -> barrier -> WGMMA issue in the
        consumer threads, so only one stage's WGMMAs overlap the conversion.
        Converting ahead in a warpgroup of its own, through a ring of bf16
        buffers, was measured slower all the same (c72085a514df+h58-conv,
        +h58-conv128b: decode -0.4..-13%, gate_up prefill -3..-13%, down prefill
        +2..+6%), with 64- and with 128-byte E4M3 rows per stage: four
        converting warps are latency-bound (0.62 us per 8192 values), so
        conversion throughput bounds this path.  Decode groups (up to 64 tokens
        per expert) convert in registers instead, for WGMMA's register A operand
        with the weights as the M side (``grouped_gemm_sm90_swapped``): 0.62-0.87
        of bf16's time; see bench/grouped_gemm_findings.md.
        """
        cfg = self.cfg
        threads = 128 * self.num_consumer_wg
        # 192-row tiles: the first two warpgroups convert (a row's two 32-value segments), the third waits at the barrier
        converters = min(threads, 256)
        converting = mma_tidx < converters if cutlass.const_expr(converters < threads) else True
        segs_per_row = converters // cfg.tile_n
        seg = self.tile_k // segs_per_row  # 32 or 64 values
        row = mma_tidx // segs_per_row
        seg_idx = mma_tidx - row * segs_per_row
        blocks_per_seg = seg // MX_BLOCK
        stages_per_box = MX_SCALE_BOX * MX_BLOCK // self.tile_k
        # A stage's two scale bytes of a row are one aligned 16-bit word of the box.
        sSF16 = cute.recast_tensor(sSF, cutlass.Uint16)
        barrier = pipeline.NamedBarrier(barrier_id=2, num_threads=threads)
        acc.fill(0.0)
        for k_tile in cutlass.range(self.k_tiles, unroll=1):
            buf = read_state.count % MX_B_BUFFERS  # the CTA's stage count, not the tile's: see the docstring
            mainloop.consumer_wait(read_state)
            if converting:
                e_lo, e_hi = self._mx_scales(sSF16[(row, k_tile % stages_per_box, read_state.index)], seg_idx,
                                             blocks_per_seg)
                src = cute.local_tile(sBq[(row, None, read_state.index)], (seg,), (seg_idx,))
                dst = cute.local_tile(sBmma[(row, None, buf)], (seg,), (seg_idx,))
                self._dequant_segment(src, dst, e_lo, e_hi, seg)
            # Generic-proxy smem writes that the tensor cores (async proxy) read next.
            cute.arch.fence_proxy("async.shared", space="cta")
            barrier.arrive_and_wait()
            self._mma_stage(tiled_mma, acc, tCrA, tCrB, num_k_blocks, read_state.index, buf)
            cute.nvgpu.warpgroup.wait_group(1)
            if k_tile > 0:
                mainloop.consumer_release(release_state)
                release_state.advance()
            read_state.advance()
        cute.nvgpu.warpgroup.wait_group(0)
        mainloop.consumer_release(release_state)
        release_state.advance()
        return read_state, release_state

    @cute.jit
    def _mx_scales(self, pair, seg_idx, blocks_per_seg: cutlass.Constexpr):
        """The E8M0 bytes of this thread's segment (its first and last 32 values) from the stage's 16-bit ``pair``.

        Byte 0 scales the stage's first 32 values of the row, byte 1 the next 32.
        """
        word = cutlass.Int32(pair) & 0xFFFF
        if cutlass.const_expr(blocks_per_seg == 2):
            return word & 0xFF, word >> 8
        e = (word >> (8 * seg_idx)) & 0xFF
        return e, e

    @cute.jit
    def _dequant_segment(self, src, dst, e_lo, e_hi, seg):
        """``dst (bf16) = src (E4M3) * 2^(e - 127)``: the first 32 values use byte ``e_lo``, the rest ``e_hi``.

        Integer work and bf16x2 multiplies, no conversion instructions (which
        run at a fraction of the ALU rate): see :func:`_e4m3x2_to_bf16x2`.
        Replacing the e4m3 -> f16 -> f32 -> bf16 conversions with this moved the
        measured times by under 5%, so conversion throughput is not what
        bounds this path (see _mainloop_mx).  The power of two is applied as two exact
        bf16 multiplies, ``2^(min(e, 134) - 7)`` then ``2^(max(e - 134, 0))``,
        since the bit trick leaves a factor 2^-120 and bf16 tops out at 2^127.
        """
        q = cute.make_rmem_tensor((seg,), self.b_load_dtype)
        cute.autovec_copy(src, q)
        words = cute.recast_tensor(q, cutlass.Int32)  # 4 E4M3 values per word
        out = cute.make_rmem_tensor((seg // 2,), cutlass.Int32)  # 2 bf16 per word
        lo = _bf16x2_scale_pair(e_lo)
        hi = _bf16x2_scale_pair(e_hi)
        for i in cutlass.range_constexpr(seg // 4):
            s1, s2 = lo if i * 4 < MX_BLOCK else hi
            out[2 * i] = _e4m3x2_to_bf16x2(words[i], 0x1404, s1, s2)
            out[2 * i + 1] = _e4m3x2_to_bf16x2(words[i], 0x3424, s1, s2)
        cute.autovec_copy(cute.recast_tensor(out, self.ab_dtype), dst)

    # ------------------------------------------------- FP8 block-scaled mainloops
    @cute.jit
    def _mainloop_block_scaled(self, tiled_mma, tCrA, tCrB, num_k_blocks, acc, part0, part1, tCcC, mSFA, mSFB,
                               sSA, sSB, rows, row0, batch, expert, n_tile, wg, mainloop, read_state, release_state,
                               scales, scale_state):
        """FP8: per 128-wide K block, WGMMA into a fresh partial, then ``acc += part * sa[row] * sb[column block]``.

        The promotion must not leave the tensor cores idle.  128-wide tiles have
        the registers for two partials per thread (3 x 64), so each warpgroup
        hides its own promotions, loading its scales from global memory;
        192-wide tiles (96 + 96) have one, and the two warpgroups take turns
        instead, reading the scales that warp 1 staged in shared memory (see
        the two loops).
        """
        acc.fill(0.0)
        if cutlass.const_expr(self.cfg.tile_n == 128):
            r_lo = row0 + tCcC[0][0]
            r_hi = row0 + tCcC[2][0]
            r_lo = r_lo if r_lo < rows else rows - 1  # rows past the tensor hold no scale
            r_hi = r_hi if r_hi < rows else rows - 1
            where = (mSFA, mSFB, r_lo, r_hi, self._weight_scale_rows(n_tile), batch, expert)
            read_state, release_state = self._fp8_two_partials(
                tiled_mma, tCrA, tCrB, num_k_blocks, acc, part0, part1, where, mainloop, read_state, release_state)
        else:
            # This thread's rows inside the tile: the staged scales are the tile's own.
            staged = (sSA, sSB, tCcC[0][0], tCcC[2][0])
            read_state, release_state, scale_state = self._fp8_one_partial(
                tiled_mma, tCrA, tCrB, num_k_blocks, acc, part0, staged, wg, mainloop, read_state, release_state,
                scales, scale_state)
        return read_state, release_state, scale_state

    @cute.jit
    def _weight_scale_rows(self, n_tile):
        """The weight-scale row (128-row block of N) of each 64-column quarter of output tile ``n_tile``.

        A 192-wide tile straddles two 128-row blocks, split after its first 64
        or 128 columns by the tile's parity; with SwiGLU (128-wide tiles of an
        interleaved gate/up matrix) each half has its own row (see interleave_gate_up).
        """
        cfg = self.cfg
        if cutlass.const_expr(cfg.swiglu):
            return [n_tile * 2 + q for q in range(2)]
        c0 = n_tile * cfg.tile_n
        last = self.scale_n_blocks - 1  # columns past N (zero-filled by TMA) take any scale
        return [cutlass.min((c0 + 64 * q) // SCALE_BLOCK, last) for q in range(cfg.tile_n // 64)]

    @cute.jit
    def _load_scales(self, where, k_tile):
        """This thread's scales of K block ``k_tile``: ``[sa[r], sa[r + 8], sb[quarter 0], sb[quarter 1], ...]``.

        Loaded before the block's WGMMAs are issued and multiplied in
        ``_promote``, so the load latency hides behind the WGMMAs.
        """
        mSFA, mSFB, r_lo, r_hi, sb_rows, batch, expert = where
        return [mSFA[(r_lo, k_tile, batch)], mSFA[(r_hi, k_tile, batch)]] + [
            mSFB[(r, k_tile, expert)] for r in sb_rows]

    @cute.jit
    def _promote(self, acc, part, scales, mainloop, release_state):
        """Free a finished K block's stage, then ``acc += part * sa[row] * sb[quarter]``."""
        mainloop.consumer_release(release_state)
        release_state.advance()
        scale = [(scales[0] * sb, scales[1] * sb) for sb in scales[2:]]  # [quarter][row half]
        for i in cutlass.range_constexpr(cute.size(acc)):
            # element order: (column pair, row half, 8-column block); 8 blocks per 64-column quarter
            acc[i] = acc[i] + part[i] * scale[i // 32][(i // 2) % 2]
        return release_state

    @cute.jit
    def _issue_block(self, tiled_mma, tCrA, tCrB, num_k_blocks, part, mainloop, read_state):
        """Wait for the next stage and issue its WGMMAs into a fresh ``part`` (not waited for)."""
        mainloop.consumer_wait(read_state)
        self._mma_stage(tiled_mma, part, tCrA, tCrB, num_k_blocks, read_state.index, read_state.index, fresh=True)
        read_state.advance()
        return read_state

    @cute.jit
    def _fp8_two_partials(self, tiled_mma, tCrA, tCrB, num_k_blocks, acc, part0, part1, where, mainloop,
                          read_state, release_state):
        """Two partials alternate: block k+1's WGMMAs are issued before block k is promoted.

        One batch stays in flight (``wait_group(1)``), so the tensor cores never
        wait for this warpgroup's promotion.  K blocks go in pairs (part0,
        part1); the static tail finishes an odd or even count.  The K loop is
        unrolled: in a run-time loop ptxas cannot tell that ``wait_group(1)``
        retired the partial being promoted and serializes every WGMMA (C7514).
        """
        a = self._load_scales(where, 0)
        read_state = self._issue_block(tiled_mma, tCrA, tCrB, num_k_blocks, part0, mainloop, read_state)
        for pair in cutlass.range_constexpr((self.k_tiles - 1) // 2):
            b = self._load_scales(where, 2 * pair + 1)
            read_state = self._issue_block(tiled_mma, tCrA, tCrB, num_k_blocks, part1, mainloop, read_state)
            cute.nvgpu.warpgroup.wait_group(1)
            release_state = self._promote(acc, part0, a, mainloop, release_state)
            a = self._load_scales(where, 2 * pair + 2)
            read_state = self._issue_block(tiled_mma, tCrA, tCrB, num_k_blocks, part0, mainloop, read_state)
            cute.nvgpu.warpgroup.wait_group(1)
            release_state = self._promote(acc, part1, b, mainloop, release_state)
        # part0 holds the last block issued above: k_tiles - 1 (odd count) or k_tiles - 2 (even count).
        if cutlass.const_expr(self.k_tiles % 2 == 0):
            t = self._load_scales(where, self.k_tiles - 1)
            read_state = self._issue_block(tiled_mma, tCrA, tCrB, num_k_blocks, part1, mainloop, read_state)
            cute.nvgpu.warpgroup.wait_group(1)
            release_state = self._promote(acc, part0, a, mainloop, release_state)
            cute.nvgpu.warpgroup.wait_group(0)
            release_state = self._promote(acc, part1, t, mainloop, release_state)
        else:
            cute.nvgpu.warpgroup.wait_group(0)
            release_state = self._promote(acc, part0, a, mainloop, release_state)
        return read_state, release_state

    @cute.jit
    def _fp8_one_partial(self, tiled_mma, tCrA, tCrB, num_k_blocks, acc, part, staged, wg, mainloop, read_state,
                         release_state, scales, scale_state):
        """One partial, waited for (``wait_group(0)``) and promoted at once; the two warpgroups take turns.

        While one warpgroup promotes, the other's WGMMAs must be running.  Both
        wait for the same stage, and WGMMAs issued by both at once share the
        tensor cores and finish together, leaving both promotions exposed (on an
        H200 this ran 6-17% below the two-partial 128-wide tiles, d2c25f900d65).
        So the warpgroups take turns to issue a block (``_take_turn`` /
        ``_pass_turn``): warpgroup 0's WGMMAs finish first and its promotion
        runs under warpgroup 1's, and so on.  The turns run on across tiles
        (see ``_consume``).  With one consumer warpgroup (64-row tiles) there is
        nothing to overlap.  The K loop stays a run-time loop: nothing is in
        flight when the partial is read.

        The scales come from shared memory, a stage of ``ScaleStaging.chunk`` K
        blocks at a time (``_stage_scales``, warp 1); each group of ``vec`` (4 when
        the K blocks allow) blocks' scales is one read per scale row.  Loading them
        from global memory in every consumer thread (5 loads per block, 2 of them
        8 rows per warp) cost 7-11% against constant scales, and 16-byte loads of
        4 blocks recovered about half (see the measured section of
        ``kernels.grouped_gemm_sm90``).  The tile's last chunk has fewer groups
        when it ends in padding.
        """
        st = self.staging
        sSA, sSB, r_lo, r_hi = staged
        lane = cute.arch.lane_idx()
        for chunk in cutlass.range(st.chunks, unroll=1):
            scales.consumer_wait(scale_state)
            groups = st.groups if cutlass.const_expr(st.chunks > 1) else st.last_groups
            if cutlass.const_expr(st.chunks > 1 and st.last_groups != st.groups):
                groups = cutlass.Int32(st.groups) if chunk < st.chunks - 1 else cutlass.Int32(st.last_groups)
            for group in cutlass.range(groups, unroll=1):
                vectors = self._read_scale_group(sSA, sSB, r_lo, r_hi, scale_state.index, group)
                for j in cutlass.range_constexpr(st.vec):
                    mainloop.consumer_wait(read_state)
                    if cutlass.const_expr(self.fp8_turns):
                        self._take_turn(wg)
                    self._mma_stage(tiled_mma, part, tCrA, tCrB, num_k_blocks, read_state.index, read_state.index,
                                    fresh=True)
                    if cutlass.const_expr(self.fp8_turns):
                        self._pass_turn(wg)
                    read_state.advance()
                    cute.nvgpu.warpgroup.wait_group(0)
                    release_state = self._promote(acc, part, [v[j] for v in vectors], mainloop, release_state)
            # The chunk's scales are in registers (used by the promotions above): free the stage, one lane per warp.
            if lane == 0:
                scales.consumer_release(scale_state)
            scale_state.advance()
        return read_state, release_state, scale_state

    @cute.jit
    def _read_scale_group(self, sSA, sSB, r_lo, r_hi, stage, group):
        """Staged scales of K blocks ``group * vec ..`` of the stage's chunk, one shared-memory read per row.

        Returns ``[sa[r_lo], sa[r_hi], sb[quarter 0], ...]`` as ``vec``-element register tensors.
        """
        st = self.staging
        rows = [sSA[(r_lo, None, stage)], sSA[(r_hi, None, stage)]] + [
            sSB[(q, None, stage)] for q in range(st.quarters)]
        out = []
        for row in rows:
            dst = cute.make_rmem_tensor((st.vec,), cutlass.Float32)
            cute.autovec_copy(cute.local_tile(row, (st.vec,), (group,)), dst)
            out.append(dst)
        return out

    @cute.jit
    def _stage_scales(self, mSFA, mSFB, sSA, sSB, scales, rows, first_tile, total_tiles, s_tile_begin, s_row_start,
                      s_row_count):
        """Warp 1 (FP8 192-wide tiles): every tile's scales into shared memory, ``ScaleStaging.chunk`` K blocks a stage.

        A stage gets the tile's ``tile_m`` activation-scale rows (rows past
        the tensor are left alone: their outputs are never stored) and its
        weight-scale row of each 64-column quarter, by ``cp.async`` copies:
        16 bytes (``A_COPY`` blocks of a row padded by ``kernels.act_quant``)
        for the activation scales, ``b_copy`` blocks for the weight scales; each
        lane's ``cp.async.mbarrier.arrive`` completes the stage once its copies
        have landed.  The tiles come in the consumers' order; two stages let the
        next chunk arrive while one is read.

        Each lane keeps one (row, piece) slot and the passes over the rows are
        unrolled, so a copy costs ~8 instructions: a run-time loop over
        (row, piece) items took ~24 and ran 2.0 / 2.5% slower on Qwen3-30B down
        (warp 1 shares its scheduler with one warp of each consumer warpgroup).
        """
        cfg, st = self.cfg, self.staging
        lane = cute.arch.lane_idx()
        copy = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), cutlass.Float32, num_bits_per_copy=32 * st.A_COPY)
        copy_b = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), cutlass.Float32, num_bits_per_copy=32 * st.b_copy)
        per_row = st.chunk // st.A_COPY  # copies per activation-scale row and chunk
        per_row_b = st.chunk // st.b_copy  # copies per weight-scale row and chunk (<= 12)
        # Lanes past the last whole row of a pass (per_row not a power of two) repeat copies of the
        # next pass: the same bytes to the same place.
        rows_per_pass = 32 // per_row
        lane_row = lane // per_row
        piece = lane - lane_row * per_row
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, st.STAGES)
        tile = first_tile
        expert = cutlass.Int32(0)
        while tile < total_tiles:
            expert, n_tile, batch, row0, _ = self._locate(tile, expert, s_tile_begin, s_row_start, s_row_count)
            sb_rows = self._weight_scale_rows(n_tile)
            limit = cutlass.min(rows - row0, st.rows)  # the tile's rows that the tensor holds
            for chunk in cutlass.range(st.chunks, unroll=1):
                scales.producer_acquire(state)
                first = chunk * per_row
                for p in cutlass.range_constexpr(-(-st.rows // rows_per_pass)):
                    r = p * rows_per_pass + lane_row
                    if r < limit:
                        cute.copy(copy, cute.local_tile(mSFA[(row0 + r, None, batch)], (st.A_COPY,), (first + piece,)),
                                  cute.local_tile(sSA[(r, None, state.index)], (st.A_COPY,), (piece,)))
                # Weight-scale rows are not padded: copy only the chunk's blocks below K/128.
                first_b = chunk * per_row_b
                copies_b = per_row_b
                if cutlass.const_expr(st.chunks * st.chunk != st.blocks):
                    copies_b = cutlass.min(per_row_b, st.blocks - first_b * st.b_copy)
                if lane < copies_b:
                    for q in cutlass.range_constexpr(st.quarters):
                        cute.copy(copy_b,
                                  cute.local_tile(mSFB[(sb_rows[q], None, expert)], (st.b_copy,), (first_b + lane,)),
                                  cute.local_tile(sSB[(q, None, state.index)], (st.b_copy,), (lane,)))
                scales.producer_commit(state)
                state.advance()
            tile = tile + cfg.num_sms
        scales.producer_tail(state)

    def _turn(self, wg_id):
        """The named barrier on which consumer warpgroup ``wg_id`` waits for its turn to issue WGMMAs."""
        return pipeline.NamedBarrier(barrier_id=_BAR_WG_TURN[0] + wg_id, num_threads=128 * self.num_consumer_wg)

    @cute.jit
    def _take_turn(self, wg):
        """Wait until the other warpgroup has issued its block (``wg`` a warp-uniform Int32)."""
        self._turn(wg).arrive_and_wait()

    @cute.jit
    def _pass_turn(self, wg):
        """Let the other warpgroup issue its block."""
        self._turn(1 - wg).arrive()


# ----------------------------------------------------------- MXFP8 helpers
def _bf16x2_scale_pair(e):
    """Two packed bf16x2 factors whose product with the 2^-120 of the bit trick is 2^(e - 127).

    bf16 2^p has exponent field p + 127: 2^(min(e, 134) - 7) is field
    min(e, 134) + 120 (at most 254), 2^max(e - 134, 0) is field max(e, 134) - 7.
    """
    f1 = (cutlass.min(e, 134) + 120) << 7
    f2 = (cutlass.max(e, 134) - 7) << 7
    return f1 | (f1 << 16), f2 | (f2 << 16)


@dsl_user_op
def _e4m3x2_to_bf16x2(word, selector: int, s1, s2, *, loc=None, ip=None) -> cutlass.Int32:
    """Two E4M3 bytes of ``word`` (``selector`` 0x1404: bytes 0-1, 0x3424: bytes 2-3) as bf16x2 times s1 * s2.

    ``prmt`` puts each byte in the high byte of a 16-bit half; sign stays at
    bit 15 and exponent+mantissa shift right by 4 into bf16's fields.  That
    bf16 equals the E4M3 value times 2^-120, subnormals included (both
    formats put the implicit-zero values at exponent field 0).  The two
    ``mul.rn.bf16x2`` by powers of two are exact.
    """
    out = llvm.inline_asm(
        cutlass.Int32.mlir_type,
        [cutlass.Int32(word).ir_value(loc=loc, ip=ip), cutlass.Int32(s1).ir_value(loc=loc, ip=ip),
         cutlass.Int32(s2).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .b32 t, m;\n\t"
        f"prmt.b32 t, $1, 0, {selector:#x};\n\t"
        "shr.b32 m, t, 4;\n\t"
        "and.b32 m, m, 0x07F007F0;\n\t"
        "and.b32 t, t, 0x80008000;\n\t"
        "or.b32 t, t, m;\n\t"
        "mul.rn.bf16x2 t, t, $2;\n\t"
        "mul.rn.bf16x2 $0, t, $3;\n\t"
        "}",
        "=r,r,r,r",
        loc=loc,
        ip=ip,
    )
    return cutlass.Int32(out)
