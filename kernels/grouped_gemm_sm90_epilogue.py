"""Epilogue of the Hopper grouped GEMM (a mixin of ``GroupedGemmSm90``), split over two roles.

* The consumer warpgroups apply SwiGLU and row weights in registers, convert
  to bf16 and write the whole output tile to shared memory (``stmatrix``, in
  chunks of ``EPI_N`` columns), then go straight on to the next tile's
  mainloop.
* Two store warps of the producer warpgroup (``STORE_WARPS``; warp 0 issues
  the TMA loads) copy that tile to global memory in 16-byte vector stores,
  each predicated on its row and column: a tile's rows may run past its
  expert (contiguous layout: the next expert's rows; masked: past the count),
  and those are never written.  FP8 prefill (``tma_store``): a tile whose
  rows all belong to its expert goes out by TMA stores instead, issued by one
  store thread (TMA clips the columns past N; it could not stop at an expert's
  last row inside a tile without a tensor map per expert, so an expert's last
  row tile ends at its last row, see ``_locate``, and only experts of fewer
  rows than a tile keep the store warps' stores).  Qwen3-30B down, one H200:
  at 2048 tokens per expert 1123-1124 TFLOP/s against 1066-1069 with the store
  warps' stores, same call; at 375, with the last row tiles moved, 1029-1030
  against 990 (bench/grouped_gemm_findings.md).

So the global stores of tile t drain while the tensor cores run tile t+1.
Each consumer warpgroup hands its 64 rows of the one output buffer back and
forth with the store warps through its own pair of named barriers: ``FULL``
(the warpgroup arrives once its rows are in shared memory; the store warps
wait for every warpgroup's) and ``EMPTY`` (the store warps arrive once they
have read the tile, the warpgroup waits before writing the next one), one
phase of each per tile.
Per-warpgroup pairs let a warpgroup start the next tile without waiting for
the other one to finish this tile: with FP8 192-wide tiles the warpgroups
run half a K block apart (see ``_fp8_one_partial``), and a shared barrier
idled the tensor cores at every tile boundary.

Where the configuration asks for it (``split_output``) and a half-size
buffer frees shared memory for one more pipeline stage (``out_halves``: bf16
128x192 and 128x256 tiles beside up to ~240 experts; ``choose_config`` asks
for it there only) a tile goes over in two
fills of that buffer, its column halves: the first at the end of the tile,
the second, kept in bf16 registers (``held``), in the middle of the next
tile's mainloop (``_write_held_half``).  The store warps drain the fills in
that order, one phase of each barrier per fill.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.tensor_utils import LayoutEnum

EPI_N = 32  # output columns per stmatrix / store chunk
STORE_WARPS = (2, 3)  # warps of the producer warpgroup that store output tiles
STORE_THREADS = 32 * len(STORE_WARPS)
# Named barrier ids of consumer warpgroup w: FULL 3 + 4w, EMPTY 4 + 4w (2: MXFP8 dequant, 5/6: FP8 issue turns).
_BAR_OUT_FULL, _BAR_OUT_EMPTY, _BAR_OUT_STRIDE = 3, 4, 4


class Epilogue:
    """Per-tile output of the grouped GEMM (uses ``cfg``, ``c_dtype``, ``acc_dtype``, ``num_consumer_wg``, ``store_vec``,
    ``out_chunks``, ``buffer_chunks``, ``out_halves``, ``tma_store``)."""

    def _out_barriers(self, wg):
        """(full, empty) named barriers between consumer warpgroup ``wg`` (an int or a warp-uniform Int32) and the store warps."""
        threads = 128 + STORE_THREADS
        return (pipeline.NamedBarrier(barrier_id=_BAR_OUT_FULL + _BAR_OUT_STRIDE * wg, num_threads=threads),
                pipeline.NamedBarrier(barrier_id=_BAR_OUT_EMPTY + _BAR_OUT_STRIDE * wg, num_threads=threads))

    @cute.jit
    def _epilogue_setup(self, tiled_mma, sOut, acc, mma_tidx):
        """Consumer side, made once per CTA: registers -> shared memory with ``stmatrix`` per chunk."""
        r2s_atom = sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.c_dtype, self.acc_dtype)
        stmatrix = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.c_dtype)
        r2s = cute.make_tiled_copy_S(r2s_atom, cute.make_tiled_copy_C_atom(stmatrix, tiled_mma))
        thr_r2s = r2s.get_slice(mma_tidx)
        tRS_sD = thr_r2s.partition_D(sOut)
        tRS_rAcc = r2s.retile(acc)
        rD_shape = cute.shape(thr_r2s.partition_S(sOut))[:3]
        return r2s, tRS_sD, tRS_rAcc, rD_shape

    @cute.jit
    def _held_half(self, epi):
        """bf16 registers for a tile's second output half (``out_halves``), one tensor per ``EPI_N``-column chunk."""
        return [cute.make_rmem_tensor(epi[3], self.c_dtype) for _ in range(self.buffer_chunks)]

    @cute.jit
    def _epilogue(self, acc, tCcC, epi, held, mRowW, rows, row0, batch, wg):
        """Consumer warpgroup ``wg``: activation / row weights in registers, then its rows into the shared output buffer.

        With ``out_halves`` the buffer takes the first column half; the second is
        converted into ``held`` and written by ``_write_held_half`` later.
        """
        cfg = self.cfg
        r2s, tRS_sD, tRS_rAcc, rD_shape = epi
        size = cute.size(acc)
        if cutlass.const_expr(cfg.swiglu):
            # Element i (gate, column c) pairs with element i + size/2 (up, column
            # c + half): the accumulator's last mode walks 8-column blocks.  The
            # result replaces the gate half, which is the output tile.
            # silu(g) = g * rcp(1 + exp(-g)) with the approximate reciprocal (the
            # denominator is >= 1, inf for g << 0, where both give -0): an IEEE
            # division (div.rn.f32) here made the fused decode kernel slower than the
            # plain GEMM, Qwen3-30B gate_up FP8 at 16 tokens/expert 133.6 us against
            # 99.8 with rcp.approx and 103.5 for the GEMM alone (one H200, same call;
            # bench/grouped_gemm_findings.md, "The fused SwiGLU's division").
            for i in cutlass.range_constexpr(size // 2):
                g = acc[i]
                acc[i] = g * cute.arch.rcp_approx(1.0 + cute.math.exp(-g, fastmath=True)) * acc[i + size // 2]
        if cutlass.const_expr(cfg.row_weights):
            r_lo = row0 + tCcC[0][0]
            r_hi = row0 + tCcC[2][0]
            w_lo = mRowW[(r_lo if r_lo < rows else rows - 1, batch)]
            w_hi = mRowW[(r_hi if r_hi < rows else rows - 1, batch)]
            for i in cutlass.range_constexpr(size // 2 if cutlass.const_expr(cfg.swiglu) else size):
                acc[i] = acc[i] * (w_hi if (i // 2) % 2 else w_lo)
        rD = cute.make_rmem_tensor(rD_shape, self.acc_dtype)
        rD_out = cute.make_rmem_tensor(rD_shape, self.c_dtype)
        out_full, out_empty = self._out_barriers(wg)
        out_empty.arrive_and_wait()  # the store warps have read these rows of the previous fill
        for chunk in cutlass.range_constexpr(self.buffer_chunks):
            self._chunk_to_bf16(tRS_rAcc, chunk, rD, rD_out)
            cute.copy(r2s, rD_out, tRS_sD[(None, None, None, chunk)])
        self._fence_for_tma_store()
        out_full.arrive()
        if cutlass.const_expr(self.out_halves):
            for c in cutlass.range_constexpr(self.buffer_chunks):
                self._chunk_to_bf16(tRS_rAcc, self.buffer_chunks + c, rD, held[c])

    @cute.jit
    def _chunk_to_bf16(self, tRS_rAcc, chunk, rD, dst):
        """This thread's elements of accumulator chunk ``chunk`` (``EPI_N`` columns), converted into ``dst``."""
        n_rd = cute.size(rD)
        for v in cutlass.range_constexpr(n_rd):
            rD[v] = tRS_rAcc[chunk * n_rd + v]
        dst.store(rD.load().to(self.c_dtype))

    @cute.jit
    def _write_held_half(self, epi, held, wg):
        """Consumer warpgroup ``wg``: the previous tile's second output half, from ``held`` into the output buffer."""
        r2s, tRS_sD, _, _ = epi
        out_full, out_empty = self._out_barriers(wg)
        out_empty.arrive_and_wait()  # the store warps have read these rows of the first half
        for c in cutlass.range_constexpr(self.buffer_chunks):
            cute.copy(r2s, held[c], tRS_sD[(None, None, None, c)])
        self._fence_for_tma_store()
        out_full.arrive()

    def _fence_for_tma_store(self):
        """The consumers' shared-memory writes (generic proxy) made visible to the TMA stores (async proxy)."""
        if cutlass.const_expr(self.tma_store):
            cute.arch.fence_proxy("async.shared", space="cta")

    @cute.jit
    def _store_setup(self, sOut, store_tidx):
        """Store-warp side, made once per CTA: shared -> global 16-byte vectors, chunk by chunk."""
        cfg = self.cfg
        vec = self.store_vec
        vecs_per_row = EPI_N // vec
        s2g_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.c_dtype, num_bits_per_copy=16 * vec)
        s2g = cute.make_tiled_copy_tv(
            s2g_atom,
            cute.make_layout((STORE_THREADS // vecs_per_row, vecs_per_row), stride=(vecs_per_row, 1)),
            cute.make_layout((1, vec)),
        )
        thr_s2g = s2g.get_slice(store_tidx)
        tSG_sD = thr_s2g.partition_S(sOut)
        tSG_cD = thr_s2g.partition_S(cute.make_identity_tensor((cfg.tile_m, EPI_N)))
        return thr_s2g, s2g_atom, tSG_sD, tSG_cD

    @cute.jit
    def _store_tile(self, store, mC, tma_c, sEpi, rows, row0, rows_left, n_tile, batch, store_tidx):
        """Store warps: per fill of the output buffer (the tile, or its two halves), wait for it, write its valid
        rows and columns, free the buffer.

        With ``tma_store`` a tile whose rows all belong to its expert goes out
        by TMA (``_tma_store_fill``), the others by ``_store_fill``; the buffer
        is freed for the next fill once the TMA stores have read it.
        """
        cfg = self.cfg
        for fill in cutlass.range_constexpr(self.out_chunks // self.buffer_chunks):
            if cutlass.const_expr(self.tma_store):
                if store_tidx == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)  # the previous fill's TMA stores have read it
            for wg in cutlass.range_constexpr(self.num_consumer_wg):
                self._out_barriers(wg)[1].arrive()  # done with the previous fill: the warpgroup may overwrite its rows
            for wg in cutlass.range_constexpr(self.num_consumer_wg):
                self._out_barriers(wg)[0].arrive_and_wait()
            if cutlass.const_expr(self.tma_store):
                if rows_left >= cfg.tile_m:
                    if store_tidx == 0:
                        self._tma_store_fill(tma_c, sEpi, row0, n_tile, batch, fill)
                else:
                    self._store_fill(store, mC, rows, row0, rows_left, n_tile, batch, fill)
            else:
                self._store_fill(store, mC, rows, row0, rows_left, n_tile, batch, fill)

    @cute.jit
    def _tma_store_fill(self, tma_c, sEpi, row0, n_tile, batch, fill: cutlass.Constexpr):
        """One store thread: the fill's column chunks by TMA stores, one bulk group (TMA clips the columns past N)."""
        cfg = self.cfg
        tma_atom_c, mCt = tma_c
        gC = cute.local_tile(cute.domain_offset((row0, 0, 0), mCt), (cfg.tile_m, EPI_N), (None, None, None))
        tCsC, tCgC = cute.nvgpu.cpasync.tma_partition(
            tma_atom_c, 0, cute.make_layout(1), cute.group_modes(sEpi, 0, 2), cute.group_modes(gC, 0, 2))
        for c in cutlass.range_constexpr(self.buffer_chunks):
            chunk = n_tile * self.out_chunks + fill * self.buffer_chunks + c  # the output's EPI_N-column chunk
            cute.copy(tma_atom_c, tCsC[(None, c)], tCgC[(None, 0, chunk, batch)])
        cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def _store_fill(self, store, mC, rows, row0, rows_left, n_tile, batch, fill: cutlass.Constexpr):
        """Store warps: the fill's rows that belong to the expert and columns below N, in 16-byte vector stores."""
        cfg = self.cfg
        thr_s2g, s2g_atom, tSG_sD, tSG_cD = store
        col0 = n_tile * self.out_cols
        # Element offset of the tile's first element (masked layout: [E, rows, out_n]).
        tile_first = cutlass.Int64(batch) * rows * cfg.out_n + row0 * cfg.out_n + col0
        for c in cutlass.range_constexpr(self.buffer_chunks):
            chunk = fill * self.buffer_chunks + c  # the tile's column chunk in buffer chunk c
            cols_left = cfg.out_n - (col0 + chunk * EPI_N)
            # Rows are out_n elements apart and chunks start at multiples of EPI_N, so the
            # chunk's first element is store_vec-aligned: say so, or the stores get split.
            first = cute.assume(tile_first + chunk * EPI_N, divby=self.store_vec)
            gD = cute.make_tensor(mC.iterator + first,
                                  cute.make_layout((cfg.tile_m, EPI_N), stride=(cfg.out_n, 1)))
            tSG_gD = thr_s2g.partition_D(gD)
            for m in cutlass.range_constexpr(cute.size(tSG_sD, mode=[1])):
                coord = tSG_cD[(0, m, 0)]
                if coord[0] < rows_left and coord[1] < cols_left:
                    cute.copy(s2g_atom, tSG_sD[(None, m, 0, c)], tSG_gD[(None, m, 0)])
