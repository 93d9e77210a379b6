"""Epilogue of the Hopper grouped GEMM (a mixin of ``GroupedGemmSm90``).

SwiGLU and row weights in registers, then the tile goes registers -> shared
memory (``stmatrix``, chunks of ``EPI_N`` columns, two buffers) -> global
memory in 16-byte vector stores by all consumer threads, each predicated on
its row and column: a tile's rows may run past its expert (contiguous layout:
the next expert's rows; masked: past the count), and those are never written.
A TMA store could not respect expert boundaries inside a tile without a tensor
map per expert.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.tensor_utils import LayoutEnum

EPI_N = 32  # output columns per epilogue chunk (staged through shared memory)
EPI_BUFFERS = 2  # chunks in flight: chunk i+1 is written while chunk i is stored


class Epilogue:
    """Per-tile output of the grouped GEMM (uses ``cfg``, ``c_dtype``, ``acc_dtype``, ``num_consumer_wg``, ``store_vec``)."""

    # --------------------------------------------------------------- epilogue
    @cute.jit
    def _epilogue_setup(self, tiled_mma, sEpi, acc, mma_tidx):
        """Copy partitions of the epilogue, made once per CTA.

        Registers -> shared memory with ``stmatrix`` in chunks of ``EPI_N``
        columns; shared -> global with 16-byte vector stores by all consumer
        threads, each predicated on its row (the tile's rows may run past the
        expert) and column.
        """
        cfg = self.cfg
        r2s_atom = sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.c_dtype, self.acc_dtype)
        stmatrix = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.c_dtype)
        r2s = cute.make_tiled_copy_S(r2s_atom, cute.make_tiled_copy_C_atom(stmatrix, tiled_mma))
        thr_r2s = r2s.get_slice(mma_tidx)
        tRS_sD = thr_r2s.partition_D(sEpi)
        tRS_rAcc = r2s.retile(acc)
        rD_shape = cute.shape(thr_r2s.partition_S(sEpi))[:3]
        vec = self.store_vec
        vecs_per_row = EPI_N // vec
        threads = 128 * self.num_consumer_wg
        s2g_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.c_dtype, num_bits_per_copy=16 * vec)
        s2g = cute.make_tiled_copy_tv(
            s2g_atom,
            cute.make_layout((threads // vecs_per_row, vecs_per_row), stride=(vecs_per_row, 1)),
            cute.make_layout((1, vec)),
        )
        thr_s2g = s2g.get_slice(mma_tidx)
        tSG_sD = thr_s2g.partition_S(sEpi)
        tSG_cD = thr_s2g.partition_S(cute.make_identity_tensor((cfg.tile_m, EPI_N)))
        return r2s, tRS_sD, tRS_rAcc, rD_shape, thr_s2g, s2g_atom, tSG_sD, tSG_cD

    @cute.jit
    def _epilogue(self, acc, tCcC, epi, sEpi, mC, mRowW, rows, row0, rows_left, n_tile, batch):
        """Activation / row weights in registers, then the tile through shared memory to global."""
        cfg = self.cfg
        r2s, tRS_sD, tRS_rAcc, rD_shape, thr_s2g, s2g_atom, tSG_sD, tSG_cD = epi
        size = cute.size(acc)
        out_cols = cfg.tile_n // 2 if cutlass.const_expr(cfg.swiglu) else cfg.tile_n
        if cutlass.const_expr(cfg.swiglu):
            # Element i (gate, column c) pairs with element i + size/2 (up, column
            # c + half): the accumulator's last mode walks 8-column blocks.  The
            # result replaces the gate half, which is the output tile.
            for i in cutlass.range_constexpr(size // 2):
                g = acc[i]
                acc[i] = g / (1.0 + cute.math.exp(-g, fastmath=True)) * acc[i + size // 2]
        if cutlass.const_expr(cfg.row_weights):
            r_lo = row0 + tCcC[0][0]
            r_hi = row0 + tCcC[2][0]
            w_lo = mRowW[(r_lo if r_lo < rows else rows - 1, batch)]
            w_hi = mRowW[(r_hi if r_hi < rows else rows - 1, batch)]
            for i in cutlass.range_constexpr(size // 2 if cutlass.const_expr(cfg.swiglu) else size):
                acc[i] = acc[i] * (w_hi if (i // 2) % 2 else w_lo)
        col0 = n_tile * out_cols
        # Element offset of this expert's output rows (masked layout: [E, rows, out_n]).
        batch_first = cutlass.Int64(batch) * rows * cfg.out_n
        rD = cute.make_rmem_tensor(rD_shape, self.acc_dtype)
        rD_out = cute.make_rmem_tensor(rD_shape, self.c_dtype)
        n_rd = cute.size(rD)
        barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=128 * self.num_consumer_wg)
        for chunk in cutlass.range_constexpr(out_cols // EPI_N):
            buf = chunk % EPI_BUFFERS
            for v in cutlass.range_constexpr(n_rd):
                rD[v] = tRS_rAcc[chunk * n_rd + v]
            rD_out.store(rD.load().to(self.c_dtype))
            cute.copy(r2s, rD_out, tRS_sD[(None, None, None, buf)])
            # Every consumer thread wrote its part of the chunk; with two buffers the
            # next chunk's writes go to the other one, so one barrier per chunk suffices.
            barrier.arrive_and_wait()
            cols_left = cfg.out_n - (col0 + chunk * EPI_N)
            # Rows are out_n elements apart and chunks start at multiples of EPI_N, so the
            # chunk's first element is store_vec-aligned: say so, or the stores get split.
            first = cute.assume(batch_first + row0 * cfg.out_n + col0 + chunk * EPI_N, divby=self.store_vec)
            gD = cute.make_tensor(mC.iterator + first, cute.make_layout((cfg.tile_m, EPI_N), stride=(cfg.out_n, 1)))
            tSG_gD = thr_s2g.partition_D(gD)
            for m in cutlass.range_constexpr(cute.size(tSG_sD, mode=[1])):
                coord = tSG_cD[(0, m, 0)]
                if coord[0] < rows_left and coord[1] < cols_left:
                    cute.copy(s2g_atom, tSG_sD[(None, m, 0, buf)], tSG_gD[(None, m, 0)])
