"""MXFP8 decode tiles of the Hopper grouped GEMM with the operands swapped, for bf16 or FP8 activations
(a mixin of ``GroupedGemmSm90``).

Decode groups are a few tokens per expert, so the weights are almost all the
bytes.  The other MXFP8 tiles (``ScaledMainloops._mainloop_mx``) convert each
weight stage into a bf16 tile in shared memory, then a barrier over the
consumer threads, then WGMMAs with the tokens as the M side: a chain per stage
that kept decode at bf16's time for half the bytes.  Here the weights are the
M side instead: WGMMA takes its A operand from registers, so each thread loads
the E4M3 values of its own A fragment from the TMA stage, multiplies them by
their ``2^(e - 127)`` into bf16 registers (exact, see ``_e4m3x2_to_bf16x2``)
and issues; no shared-memory tile, no proxy fence, no barrier, and the tokens
(``tile_m`` of them, one of ``kernels.grouped_gemm.SWAPPED_TOKEN_TILES``) are the MMA's N side, so padding a decode group
to a tile costs little.

Each consumer warpgroup owns 64 of the tile's weight rows: 128 (two
warpgroups) or 256 (four; the default where N allows).  Two register fragments
alternate: stage k converts into one while stage k-1's WGMMAs read the other
(``wait_group(1)`` retires stage k-2's, the last reader of the one being
written).  The conversion's instructions are what bounds these tiles (the
loads are not): with four warpgroups an SM sub-partition has four consumer
warps to hide each one's conversion chain behind, and on one H200 Qwen3-235B
gate_up at 1 token per expert took 461 us against 595 with two (bf16: 728 us);
bench/grouped_gemm_findings.md has every step.

With FP8 activations (``cfg.fp8``: E4M3 with 1x128 fp32 scales from
``kernels.act_quant``) the weights need no conversion: both operands stay in
the TMA stages (128 K a stage) and FP8 WGMMAs read them there, one 32-wide K
block at a time into a fresh partial (``_swapped_fp8_k_loop``): the E8M0
scales change every 32 K along a weight row, so each K block is scaled on its
own.  The consumer adds each retired block's partial times its weight row's
``2^(e - 127)`` into a stage accumulator (a multiply-add per value), and at
the stage's end adds that times each token's activation scale (one per 128 K,
loaded at the stage's start, so its latency hides behind the stage's WGMMAs)
into the tile's accumulator.  Two or three partials are in flight, so the next
blocks' WGMMAs run while one is scaled.  Decode groups are a few tokens, so the
partials are small (8 to 64 tokens: 4 to 32 registers a thread).  On one H200
(burst) these tiles take 0.53-0.58 of bf16 weights' time at 1-32 tokens per
expert on the Qwen3 shapes, and 0.72-0.83 at 64.

The accumulator holds the output tile transposed (weight rows x tokens).  The
epilogue writes it to shared memory as fp32 ``[token][weight row]``, and the
consumer threads then apply SwiGLU (each interleaved block's gate rows belong
to one warpgroup, its up rows to the next: the pairs meet only there) and the
row weights, and store each token row's valid columns in 16-byte vectors.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from kernels.grouped_gemm import SWIGLU_BLOCK
from kernels.grouped_gemm_mxfp8 import MX_BLOCK
from kernels.grouped_gemm_sm90_scaled import MX_SCALE_BOX, _bf16x2_scale_pair, _e4m3x2_to_bf16x2

SWAPPED_X_PAD = 4  # floats after each token row of the fp32 output tile: a warp's writes fall in distinct banks
_BAR_SWAPPED = 2  # named barrier over the consumer threads around the output tile (the other MXFP8 tiles' id)


def swapped_out_floats(tile_m: int, tile_n: int) -> int:
    """Floats of the shared fp32 output tile of a swapped kernel: ``tile_m`` token rows, padded."""
    return tile_m * (tile_n + SWAPPED_X_PAD)


class SwappedMxMainloop:
    """Consumer side of the swapped MXFP8 tiles (uses ``cfg``, ``tile_k``, ``k_tiles``, ``ab_dtype``,
    ``b_load_dtype``, ``acc_dtype``, ``c_dtype``, ``num_consumer_wg``, ``out_cols``, ``store_vec``, ``_locate``)."""

    @cute.jit
    def _consume_swapped(self, tiled_mma, sA, sB, b_smem_layout, sSF, sX, mSFA, mC, mRowW, rows, mainloop, mma_tidx,
                         first_tile, total_tiles, s_tile_begin, s_row_start, s_row_count):
        """Consumer warpgroups: every tile of this CTA, its K loop (bf16 or FP8 math), then its output."""
        cfg = self.cfg
        thr_mma = tiled_mma.get_slice(mma_tidx)
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sA))  # the tokens' stages: the MMA's B
        # (weight row, token) of every value of this thread's accumulator
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((cfg.tile_n, cfg.tile_m)))
        acc = cute.make_rmem_tensor(tCcC.shape, self.acc_dtype)
        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        barrier = pipeline.NamedBarrier(barrier_id=_BAR_SWAPPED, num_threads=128 * self.num_consumer_wg)
        if cutlass.const_expr(cfg.fp8):
            operands = (tCcC, thr_mma, sB, sSF, mSFA)
        else:
            operands = self._swapped_bf16_operands(tiled_mma, thr_mma, sB, b_smem_layout, sSF)
        tile = first_tile
        expert = cutlass.Int32(0)
        while tile < total_tiles:
            expert, n_tile, batch, row0, rows_left = self._locate(tile, expert, s_tile_begin, s_row_start,
                                                                  s_row_count)
            acc.fill(0.0)
            if cutlass.const_expr(cfg.fp8):
                read_state = self._swapped_fp8_k_loop(tiled_mma, acc, tCrB, operands, rows, row0, batch, mainloop,
                                                      read_state)
            else:
                read_state, release_state = self._swapped_bf16_k_loop(tiled_mma, acc, tCrB, operands, mainloop,
                                                                      read_state, release_state)
            self._swapped_epilogue(acc, tCcC, sX, mC, mRowW, rows, row0, rows_left, n_tile, batch, mma_tidx, barrier)
            tile = tile + cfg.num_sms

    # ------------------------------------------------------- bf16 math: weights converted in registers
    @cute.jit
    def _swapped_bf16_operands(self, tiled_mma, thr_mma, sB, b_smem_layout, sSF):
        """What the bf16 K loop needs: two A fragments, this thread's A coordinates, the weight stages and scales."""
        cfg = self.cfg
        a_shape = thr_mma.partition_shape_A((cfg.tile_n, self.tile_k))
        frags = [thr_mma.make_fragment_A(a_shape), thr_mma.make_fragment_A(a_shape)]
        # (weight row, K) of every value of this thread's A fragment
        tCcA = thr_mma.partition_A(cute.make_identity_tensor((cfg.tile_n, self.tile_k)))
        sSF16 = cute.recast_tensor(sSF, cutlass.Uint16)  # a stage's two scale bytes of a row: one 16-bit word
        # The weight stages as 16-bit words, unswizzled: _convert_fragment computes the swizzled addresses of this
        # thread's values once, here, instead of per load.
        stage_words = cfg.tile_n * self.tile_k * self.b_load_dtype.width // 16
        sB16 = cute.make_tensor(cute.recast_ptr(sB.iterator, dtype=cutlass.Uint16),
                                cute.make_layout(self.stages * stage_words))
        firsts = [cute.crd2idx((tCcA[(0, 0, kb)][0], tCcA[(0, 0, kb)][1], 0), b_smem_layout) // 2
                  for kb in range(cute.size(tCcA, mode=[2]))]
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)  # every WGMMA adds: acc is zeroed per tile
        return frags, tCcA, (sB16, stage_words, firsts), sSF16

    @cute.jit
    def _swapped_bf16_k_loop(self, tiled_mma, acc, tCrB, operands, mainloop, read_state, release_state):
        """One tile's K stages, two at a time (one per fragment); all retired and released on return."""
        frags, tCcA, weights, sSF16 = operands
        for pair in cutlass.range(self.k_tiles // 2, unroll=1):
            read_state, release_state = self._swapped_stage(
                tiled_mma, acc, frags[0], tCrB, tCcA, weights, sSF16, 2 * pair, mainloop, read_state,
                release_state)
            read_state, release_state = self._swapped_stage(
                tiled_mma, acc, frags[1], tCrB, tCcA, weights, sSF16, 2 * pair + 1, mainloop, read_state,
                release_state)
        if cutlass.const_expr(self.k_tiles % 2):
            read_state, release_state = self._swapped_stage(
                tiled_mma, acc, frags[0], tCrB, tCcA, weights, sSF16, self.k_tiles - 1, mainloop, read_state,
                release_state)
        cute.nvgpu.warpgroup.wait_group(0)
        mainloop.consumer_release(release_state)
        release_state.advance()
        return read_state, release_state

    @cute.jit
    def _swapped_stage(self, tiled_mma, acc, frag, tCrB, tCcA, weights, sSF16, k_tile, mainloop, read_state,
                       release_state):
        """One K stage: wait for it, convert this thread's weight values into ``frag``, issue its WGMMAs.

        ``k_tile`` is the stage's K index in the tile; stage 0 releases nothing
        (the previous tile freed its last stage after its ``wait_group(0)``).
        """
        mainloop.consumer_wait(read_state)
        self._convert_fragment(frag, tCcA, weights, sSF16, k_tile, read_state.index)
        cute.nvgpu.warpgroup.fence()  # the fragment's registers are written before the WGMMAs read them
        for kb in cutlass.range_constexpr(cute.size(frag, mode=[2])):
            cute.gemm(tiled_mma, acc, frag[(None, None, kb)], tCrB[(None, None, kb, read_state.index)], acc)
        cute.nvgpu.warpgroup.commit_group()
        # Keep this stage's batch in flight; the previous one is done (its stage free, its fragment rewritable).
        cute.nvgpu.warpgroup.wait_group(1)
        if k_tile > 0:
            mainloop.consumer_release(release_state)
            release_state.advance()
        read_state.advance()
        return read_state, release_state

    @cute.jit
    def _convert_fragment(self, frag, tCcA, weights, sSF16, k_tile, stage):
        """``frag`` (bf16) = this thread's E4M3 weight values of stage ``stage`` times their ``2^(e - 127)``.

        The fragment's 32-bit words each hold two values adjacent along K of one
        row (a 16-bit load from the stage); per 16-wide K block a thread has
        rows r and r + 8, K offsets 0 and 8 of its pair: words (r, 0), (r + 8, 0),
        (r, 8), (r + 8, 8).  The block's first word is at ``firsts[kb]`` (16-bit
        words into stage 0, swizzle applied); the other three are 8 rows and 8
        values on, which the swizzle leaves alone (it permutes 16-byte chunks
        by the row's bits above the eighth), so they are fixed word offsets.
        A stage's 64 values of a row span two scale blocks, whose bytes are one
        16-bit word of the stage's scale box.
        """
        sB16, stage_words, firsts = weights
        words = cute.recast_tensor(frag, cutlass.Int32)
        stages_per_box = MX_SCALE_BOX * MX_BLOCK // self.tile_k
        row_lo = tCcA[0][0]
        row_hi = tCcA[2][0]
        box = k_tile % stages_per_box
        e_lo = cutlass.Int32(sSF16[(row_lo, box, stage)])
        e_hi = cutlass.Int32(sSF16[(row_hi, box, stage)])
        # factors[row half][scale block of the stage]
        factors = [[_bf16x2_scale_pair(e_lo & 0xFF), _bf16x2_scale_pair(e_lo >> 8)],
                   [_bf16x2_scale_pair(e_hi & 0xFF), _bf16x2_scale_pair(e_hi >> 8)]]
        row8 = 8 * self.tile_k // 2  # 16-bit words of 8 rows of E4M3 values
        k8 = 8 // 2
        for kb in cutlass.range_constexpr(len(firsts)):
            first = stage * stage_words + firsts[kb]
            for q in cutlass.range_constexpr(4):
                s1, s2 = factors[q % 2][(kb * 16) // MX_BLOCK]
                words[q + 4 * kb] = _e4m3x2_to_bf16x2(
                    cutlass.Int32(sB16[first + (q % 2) * row8 + (q // 2) * k8]), 0x1404, s1, s2)

    # ------------------------------------------------------- FP8 math: E4M3 x E4M3, promoted per 32 K
    @cute.jit
    def _swapped_fp8_k_loop(self, tiled_mma, acc, tCrB, operands, rows, row0, batch, mainloop, read_state):
        """One tile's K stages with FP8 activations; every stage is released after its last WGMMA retired."""
        tCcC, thr_mma, sB, sSF, mSFA = operands
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sB))  # the weights' stages: the MMA's A
        # Partials in flight: a third where registers allow (two warpgroups: 64 tokens, or SwiGLU's 128-row
        # tiles) took 0.96-0.98 of two's time at 64 tokens per expert (one H200, burst, grouped_gemm.jsonl
        # [24e70ef0e5e7+s31-stageacc-d3] against [...-d2]);
        # four warpgroups have 104 registers a thread
        depth = 3 if self.num_consumer_wg == 2 else 2
        parts = [cute.make_rmem_tensor(tCcC.shape, self.acc_dtype) for _ in range(depth)]
        sSF32 = cute.recast_tensor(sSF, cutlass.Uint32)  # a stage's four scale bytes of a row: one 32-bit word
        # This thread's tokens (accumulator columns) as activation-scale rows; rows past the tensor read its
        # last row (their outputs are never stored).  Element i's token is column (i % 2) + 2 * (i // 4) of these.
        columns = cute.size(tCcC) // 2
        token_rows = []
        for j in cutlass.range_constexpr(columns):
            r = row0 + tCcC[(j % 2) + 4 * (j // 2)][1]
            token_rows.append(r if r < rows else rows - 1)
        stages_per_box = MX_SCALE_BOX * MX_BLOCK // self.tile_k
        stage_acc = cute.make_rmem_tensor(tCcC.shape, self.acc_dtype)
        for k_tile in cutlass.range(self.k_tiles, unroll=1):
            mainloop.consumer_wait(read_state)
            stage = read_state.index
            box = k_tile % stages_per_box
            words = (cutlass.Int32(sSF32[(tCcC[0][0], box, stage)]), cutlass.Int32(sSF32[(tCcC[2][0], box, stage)]))
            sa = [mSFA[(t, k_tile, batch)] for t in token_rows]
            blocks = cute.size(tCrA, mode=[2])  # 32-wide K blocks of the stage
            for kb in cutlass.range_constexpr(blocks):
                cute.nvgpu.warpgroup.fence()
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
                cute.gemm(tiled_mma, parts[kb % depth], tCrA[(None, None, kb, stage)], tCrB[(None, None, kb, stage)],
                          parts[kb % depth])
                cute.nvgpu.warpgroup.commit_group()
                if kb >= depth - 1:
                    cute.nvgpu.warpgroup.wait_group(depth - 1)  # block kb - depth + 1 is done, the later ones run
                    self._scale_block(stage_acc, parts[(kb - depth + 1) % depth], words, kb - depth + 1)
            cute.nvgpu.warpgroup.wait_group(0)
            mainloop.consumer_release(read_state)
            for kb in cutlass.range_constexpr(blocks - depth + 1, blocks):
                self._scale_block(stage_acc, parts[kb % depth], words, kb)
            for i in cutlass.range_constexpr(cute.size(acc)):
                acc[i] = acc[i] + stage_acc[i] * sa[(i % 2) + 2 * (i // 4)]
            read_state.advance()
        return read_state

    @cute.jit
    def _scale_block(self, stage_acc, part, words, kb: cutlass.Constexpr):
        """``stage_acc (+)= part * 2^(e - 127)``: ``e`` the E8M0 byte ``kb`` of each row half's scale word."""
        w = [_e8m0_to_f32((words[h] >> (8 * kb)) & 0xFF) for h in range(2)]
        for i in cutlass.range_constexpr(cute.size(stage_acc)):
            if cutlass.const_expr(kb == 0):
                stage_acc[i] = part[i] * w[(i // 2) % 2]
            else:
                stage_acc[i] = stage_acc[i] + part[i] * w[(i // 2) % 2]

    @cute.jit
    def _swapped_epilogue(self, acc, tCcC, sX, mC, mRowW, rows, row0, rows_left, n_tile, batch, mma_tidx, barrier):
        """The transposed accumulator through shared memory into ``out[token rows, tile columns]``.

        Every consumer thread writes its values as ``sX[token][weight row]``
        (fp32), then they share the tile's ``tile_m x out_cols`` outputs in
        ``store_vec``-wide items: SwiGLU (column c's gate row c, up row c + 64),
        row weight, bf16, one vector store for each item whose token belongs
        to the expert.  The first barrier keeps this tile's writes off the
        previous tile's values still being read.
        """
        cfg = self.cfg
        vec = self.store_vec
        threads = 128 * self.num_consumer_wg
        barrier.arrive_and_wait()
        for i in cutlass.range_constexpr(cute.size(acc)):
            r, t = tCcC[i]
            sX[(t, r)] = acc[i]
        barrier.arrive_and_wait()
        col0 = n_tile * self.out_cols
        vecs_per_row = self.out_cols // vec
        items = cfg.tile_m * vecs_per_row
        for it in cutlass.range_constexpr(-(-items // threads)):
            item = it * threads + mma_tidx
            t = item // vecs_per_row
            c = (item - t * vecs_per_row) * vec
            if item < items and t < rows_left and col0 + c < cfg.out_n:
                out = cute.make_rmem_tensor((vec,), self.acc_dtype)
                # The weight row of output column c: with SwiGLU the gate rows of each interleaved block pair
                # (SWIGLU_BLOCK gate rows, then as many up rows), else c itself.
                gate = (c // SWIGLU_BLOCK) * 2 * SWIGLU_BLOCK + c % SWIGLU_BLOCK if cutlass.const_expr(cfg.swiglu) else c
                for v in cutlass.range_constexpr(vec):
                    x = sX[(t, gate + v)]
                    if cutlass.const_expr(cfg.swiglu):
                        x = x * cute.arch.rcp_approx(1.0 + cute.math.exp(-x, fastmath=True)) * sX[(t, gate + v + SWIGLU_BLOCK)]
                    out[v] = x
                if cutlass.const_expr(cfg.row_weights):
                    w = mRowW[(row0 + t, batch)]
                    for v in cutlass.range_constexpr(vec):
                        out[v] = out[v] * w
                first = cute.assume(
                    cutlass.Int64(batch) * rows * cfg.out_n + (row0 + t) * cfg.out_n + col0 + c, divby=vec)
                dst = cute.make_tensor(mC.iterator + first, cute.make_layout((vec,)))
                res = cute.make_rmem_tensor((vec,), self.c_dtype)
                res.store(out.load().to(self.c_dtype))
                cute.autovec_copy(res, dst)


@dsl_user_op
def _e8m0_to_f32(e, *, loc=None, ip=None) -> cutlass.Float32:
    """The fp32 ``2^(e - 127)`` of an E8M0 byte ``e`` (0..254): its bits are ``e << 23``, but e = 0 (2^-127) is
    fp32's subnormal 0x00400000."""
    out = llvm.inline_asm(
        cutlass.Float32.mlir_type,
        [cutlass.Int32(e).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .b32 t;\n\t.reg .pred p;\n\t"
        "shl.b32 t, $1, 23;\n\t"
        "setp.eq.u32 p, $1, 0;\n\t"
        "selp.b32 t, 0x00400000, t, p;\n\t"
        "mov.b32 $0, t;\n\t"
        "}",
        "=f,r",
        loc=loc,
        ip=ip,
    )
    return cutlass.Float32(out)
