"""Hopper (sm_90a) MoE grouped GEMM in CuTeDSL: ``out[e] = x_e @ W[e]^T``.

One persistent, warp-specialised kernel serves every variant:

* operand types: bf16 x bf16, or FP8 E4M3 x E4M3 with DeepSeek-style block
  scales (1x128 per token for the activations, 128x128 for the weights; the
  partial product of every 128-wide K block is scaled in registers and added
  to an fp32 accumulator, "scale promotion", scheduled behind WGMMAs: 128-wide
  tiles alternate two partials per warpgroup, 192-wide tiles keep one and
  the two consumer warpgroups take turns to issue, reading the scales that
  warp 1 staged in shared memory; what the promotion and its scales still
  cost is in bench/grouped_gemm_findings.md); or bf16
  activations x MXFP8 weights (E4M3 + E8M0 per 32 along K) dequantized to
  bf16 inside the kernel, the scale bytes brought by TMA with each weight
  stage: in shared memory for prefill, in registers for decode, whose tiles
  swap the operands (the weights as the MMA's M side, its A operand from
  registers; ``grouped_gemm_sm90_swapped``);
* token layouts: *contiguous* (rows of all experts back to back, ``offsets``
  [E+1] int32 on the GPU) or *masked* (``[E, max_tokens, K]`` with ``counts``
  [E] int32 on the GPU).  Nothing is read back to the host.
* epilogue: plain bf16 store, or SwiGLU (``silu(gate) * up``) when the weight
  rows are interleaved in blocks of ``tile_n // 2`` (see
  ``grouped_gemm.interleave_gate_up``): each output tile then holds the gate
  and the up half of the same channels, so the activation is thread-local.
  An optional per-row weight (the router probability) multiplies the result.

Work decomposition.  Every CTA first builds, in shared memory, the prefix sum
of output tiles per expert (one warp, shuffle scan over the GPU-resident
counts).  Tiles are numbered expert by expert, N-tile-major and M-tile-minor
inside an expert so that CTAs working at the same time share a weight tile in
L2; CTA ``c`` of ``G`` takes tiles ``c, c+G, ...``.  Warp 0 issues TMA loads
for A (the tokens) and B (the weights; MXFP8: and a box of their E8M0 scales)
into a multi-stage mbarrier pipeline; with FP8 192-wide tiles warp 1 copies each tile's block scales into shared
memory through a second, two-stage pipeline (``ScaleStaging``); one or two
consumer warpgroups run WGMMA and hand each finished tile to two store warps
through shared memory, so its global stores drain while the consumers run the
next tile's mainloop (bf16 prefill tiles of up to 512 tokens per expert in two
halves through a half-size buffer, which frees shared memory for one more
pipeline stage; FP8 prefill tiles whose rows all belong to their expert by
TMA stores, an expert's last row tile ending at its last row so that it does;
see ``grouped_gemm_sm90_epilogue``).

Decode-sized launches (``pdl``) use programmatic dependent launch: a launch's CTAs start while the
previous kernel in the stream finishes and wait for it (``griddepcontrol.wait``) before any global
memory access, which hides about 1.5 us of launch per decode GEMM.

Code: this module holds the configuration, the host side, the schedule, the
TMA producer and the bf16 mainloop; ``grouped_gemm_sm90_scaled`` the FP8
block-scaled and MXFP8 mainloops; ``grouped_gemm_sm90_swapped`` the consumers of
the swapped MXFP8 decode tiles (mainloop and epilogue); ``grouped_gemm_sm90_epilogue`` the epilogue
(registers -> shared memory -> 16-byte stores predicated on each row, so rows
of a tile past its expert are never written; TMA zero-fills K and N beyond the
tensor bounds, so N and token counts need not be multiples of the tile).

Why it is built this way, and every variant measured against it (with the
figures, the calls and what was tried and dropped): ``bench/grouped_gemm_findings.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.tensor_utils import LayoutEnum

from kernels.act_quant import scale_row_stride
from kernels.grouped_gemm import SWAPPED_TOKEN_TILES, SWIGLU_BLOCK
from kernels.grouped_gemm_sm90_epilogue import EPI_N, STORE_WARPS, Epilogue
from kernels.grouped_gemm_mxfp8 import MX_BLOCK, scale_row_bytes
from kernels.grouped_gemm_sm90_scaled import MX_B_BUFFERS, MX_SCALE_BOX, SCALE_BLOCK, ScaledMainloops
from kernels.grouped_gemm_sm90_swapped import SWAPPED_X_PAD, SwappedMxMainloop, swapped_out_floats

SMEM_CAPACITY = 232448  # bytes of shared memory per CTA on sm_90 (227 KiB)
SCALE_WARP = 1  # the producer warpgroup's warp that stages FP8 scales (0 issues TMA, STORE_WARPS store)


@dataclass(frozen=True)
class GroupedGemmConfig:
    """Everything that selects one compiled kernel (the cache key)."""

    num_experts: int
    n: int  # output columns (weight rows); for SwiGLU the gate+up width 2I
    k: int
    masked: bool  # masked [E, max_tokens, K] layout, else contiguous
    fp8: bool  # E4M3 activations with 1x128 fp32 scales; weights E4M3 with 128x128 fp32 scales, or MXFP8 (mxfp8)
    tile_m: int  # 64 (one consumer warpgroup), 128 (two) or, bf16 x MXFP8 without SwiGLU, 192 (three)
    tile_n: int  # 64 / 128 / 192 / 256 (bf16), 128 / 192 (FP8), 128 (MXFP8, SwiGLU)
    swiglu: bool = False  # epilogue silu(gate) * up over interleaved weight rows
    row_weights: bool = False  # multiply output row r by weights[r]
    # MXFP8 weights (E4M3 + E8M0 per 32 along K): bf16 activations and bf16 math, or with fp8 (swap_ab only) FP8
    # activations and FP8 math, each 32-wide K block promoted with its scales
    mxfp8: bool = False
    # bf16: hand each output tile to the store warps in two halves where that frees a pipeline stage (see Epilogue)
    split_output: bool = False
    # Output tiles whose rows all belong to their expert go out by TMA stores (see Epilogue); contiguous layout
    tma_store: bool = False
    # MXFP8 decode: the weights as the MMA's M side (bf16 math: converted in registers, the register A operand;
    # FP8 math: read from their stage), the tokens (tile_m of SWAPPED_TOKEN_TILES) as its N side; see
    # grouped_gemm_sm90_swapped
    swap_ab: bool = False
    # Programmatic dependent launch: the CTAs may start while the previous kernel in the stream finishes and wait
    # for its results in the kernel (decode-sized tiles; see grouped_gemm_launch.choose_config)
    pdl: bool = False
    num_sms: int = 132  # persistent CTAs launched

    def validate(self) -> None:
        elem_bytes = 1 if self.fp8 else 2
        if self.swap_ab:
            if not self.mxfp8 or self.tile_n not in (128, 256) or self.tile_m not in SWAPPED_TOKEN_TILES:
                raise ValueError(f"swap_ab is for MXFP8 weights with tile_n 128 or 256 and tile_m in "
                                 f"{SWAPPED_TOKEN_TILES}, got mxfp8={self.mxfp8} {self.tile_m}x{self.tile_n}")
        elif self.tile_m not in (64, 128, 192) or (self.tile_m == 192 and not (self.mxfp8 and not self.swiglu)):
            raise ValueError(f"tile_m must be 64 or 128 (192 only for bf16 x MXFP8 without SwiGLU), got {self.tile_m}")
        if (self.tile_n not in (64, 128, 192, 256) or (self.fp8 and not self.mxfp8 and self.tile_n not in (128, 192))
                or (self.mxfp8 and self.tile_n != 128 and not self.swap_ab)):
            raise ValueError(f"tile_n {self.tile_n} unsupported (fp8 128/192, mxfp8 128; bf16 64/128/192/256)")
        if self.fp8 and self.mxfp8 and not self.swap_ab:
            raise ValueError("FP8 activations x MXFP8 weights (fp8 and mxfp8) run only the swapped decode tiles (swap_ab)")
        if self.split_output and (self.fp8 or self.mxfp8):
            raise ValueError("split_output is for bf16 x bf16 tiles (only their mainloop writes the held half)")
        if self.tma_store and (self.masked or self.out_n % 8):
            raise ValueError(f"tma_store needs the contiguous layout and output rows of 16-byte multiples (N={self.out_n})")
        if (self.k * elem_bytes) % 16 or (self.mxfp8 and self.k % 16):
            raise ValueError(f"K={self.k}: rows must be 16-byte aligned for TMA ({16 // elem_bytes} elements; "
                             "16 for MXFP8 weights)")
        swiglu_tile_n = (2 * SWIGLU_BLOCK, 4 * SWIGLU_BLOCK) if self.swap_ab else (2 * SWIGLU_BLOCK,)
        if self.swiglu and (self.tile_n not in swiglu_tile_n or self.n % self.tile_n):
            raise ValueError(
                f"SwiGLU needs tile_n in {swiglu_tile_n} and N={self.n} a multiple of it (gate/up interleaved in "
                f"{SWIGLU_BLOCK}-row blocks)"
            )
        if self.num_experts < 1:
            raise ValueError("num_experts must be >= 1")

    @property
    def out_n(self) -> int:
        return self.n // 2 if self.swiglu else self.n


def scale_vector(cfg: GroupedGemmConfig) -> int:
    """How many consecutive K blocks of a weight-scale row one staging copy moves (FP8 192-wide tiles).

    A weight-scale row holds its K blocks contiguously, so 4 of them are one
    16-byte copy when the number of K blocks is a multiple of 4: the weight-scale
    pointer is then promised that alignment.  Otherwise one block a copy.  (The
    activation-scale rows are padded to 16 bytes, ``kernels.act_quant``, and always
    move 4 blocks a copy.)
    """
    if not cfg.fp8 or cfg.tile_n != 192:
        return 1
    return 4 if math.ceil(cfg.k / SCALE_BLOCK) % 4 == 0 else 1


def tma_tile(op: cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp | cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp,
             tensor: cute.Tensor, smem_layout: cute.Layout | cute.ComposedLayout,
             tile: tuple[int, int]) -> cute.nvgpu.cpasync.TmaInfo:
    """The TMA atom and TMA tensor (a pair) that move ``tile`` of ``tensor`` by ``op`` to or from one
    stage of ``smem_layout``, whose last mode counts the stages (or output buffers)."""
    return cute.nvgpu.cpasync.make_tiled_tma_atom(op, tensor, cute.slice_(smem_layout, (None, None, 0)), tile)


@dataclass(frozen=True)
class ScaleStaging:
    """Shared-memory staging of an FP8 192-wide tile's scales (``_stage_scales``, ``_fp8_one_partial``).

    Each stage holds ``chunk`` consecutive K blocks' scales of one output tile:
    ``[tile_m rows][row_stride]`` activation scales (row-major like the
    tensor, a row padded to an odd number of 16-byte groups so that the rows one
    warp reads at once fall in distinct banks) and ``[quarters][chunk]`` weight
    scales (one row per 64-column quarter of the tile).  ``chunk`` is a multiple
    of ``A_COPY`` (4) dividing the activation-scale row as ``kernels.act_quant``
    pads it (at most ``MAX_CHUNK``); when the K blocks are not a multiple of 4 the
    tile's last chunk ends in padding, never read: the consumers read ``vec``
    blocks of a row at a time (4, else 2, else 1: the most that divides the K
    blocks) and stop at the last block.
    """

    blocks: int  # K blocks (ceil(K / 128))
    chunk: int  # K blocks per stage
    vec: int  # K blocks per shared-memory read of a scale row
    b_copy: int  # K blocks per weight-scale copy (scale_vector)
    row_stride: int  # floats between activation-scale rows of a stage
    rows: int  # tile_m
    quarters: int  # tile_n // 64

    STAGES = 2
    MAX_CHUNK = 12
    A_COPY = 4  # K blocks per activation-scale copy (16 bytes of a padded row)

    @staticmethod
    def of(cfg: GroupedGemmConfig) -> ScaleStaging | None:
        """The staging of ``cfg``'s kernel, or None where the consumers load their scales from global memory."""
        if not cfg.fp8 or cfg.tile_n != 192:
            return None
        blocks = math.ceil(cfg.k / SCALE_BLOCK)
        padded = scale_row_stride(blocks)
        chunk = max(c for c in range(4, ScaleStaging.MAX_CHUNK + 1, 4) if padded % c == 0)
        vec = next(v for v in (4, 2, 1) if blocks % v == 0)
        # A warp reads 8 rows (vec 1), 4 rows per half (vec 2) or 2 per quarter (vec 4) at once: rows an odd
        # number of 16-byte groups apart never share a bank in any of these.
        row_stride = chunk + (4 if (chunk // 4) % 2 == 0 else 0)
        return ScaleStaging(blocks=blocks, chunk=chunk, vec=vec, b_copy=scale_vector(cfg), row_stride=row_stride,
                            rows=cfg.tile_m, quarters=cfg.tile_n // 64)

    @property
    def chunks(self) -> int:
        """Stages per tile."""
        return scale_row_stride(self.blocks) // self.chunk

    @property
    def groups(self) -> int:
        """Reads (of ``vec`` blocks) per chunk but the tile's last."""
        return self.chunk // self.vec

    @property
    def last_groups(self) -> int:
        """Reads in the tile's last chunk (fewer when it ends in padding)."""
        return (self.blocks - (self.chunks - 1) * self.chunk) // self.vec

    @property
    def a_floats(self) -> int:
        return self.STAGES * self.rows * self.row_stride

    @property
    def b_floats(self) -> int:
        return self.STAGES * self.quarters * self.chunk

    @property
    def smem_bytes(self) -> int:
        """Both buffers, each 16-byte aligned."""
        return 4 * (self.a_floats + self.b_floats) + 32


class GroupedGemmSm90(ScaledMainloops, SwappedMxMainloop, Epilogue):
    """CuTeDSL kernel object for one :class:`GroupedGemmConfig`.

    Call (through ``cute.compile``) with raw device pointers:
    ``(a, b, c, groups, sfa, sfb, row_w, rows, stream)`` where ``rows`` is the
    number of token rows of ``a`` (contiguous) or ``max_tokens`` (masked).
    Pointers that a configuration does not use (scales without FP8, row
    weights without ``row_weights``) are never dereferenced.
    """

    def __init__(self, cfg: GroupedGemmConfig):
        cfg.validate()
        self.cfg = cfg
        # ab_dtype: the MMA operand type (A's type); MXFP8 weights arrive as E4M3 and are
        # dequantized to bf16 in shared memory before the MMA reads them.
        self.ab_dtype = cutlass.Float8E4M3FN if cfg.fp8 else cutlass.BFloat16
        self.b_load_dtype = cutlass.Float8E4M3FN if (cfg.fp8 or cfg.mxfp8) else cutlass.BFloat16
        self.c_dtype = cutlass.BFloat16
        self.acc_dtype = cutlass.Float32
        # One consumer warpgroup per 64 rows of the MMA's M side: tokens, or with swap_ab weight rows.
        self.num_consumer_wg = (cfg.tile_n if cfg.swap_ab else cfg.tile_m) // 64
        self.threads = 128 * (1 + self.num_consumer_wg)
        # K per pipeline stage: 64 bf16 (128 B rows, SW128) or 128 fp8 (one scale block).
        self.tile_k = SCALE_BLOCK if cfg.fp8 else 64
        self.k_tiles = math.ceil(cfg.k / self.tile_k)
        self.n_tiles = math.ceil(cfg.n / cfg.tile_n)
        self.scale_k_blocks = math.ceil(cfg.k / SCALE_BLOCK)
        # Weight-scale rows: 128-row blocks of N, or with SwiGLU (interleaved 64-row
        # gate/up halves) one per half tile; see interleave_gate_up.
        self.scale_n_blocks = 2 * self.n_tiles if cfg.swiglu else math.ceil(cfg.n / SCALE_BLOCK)
        # MXFP8: each stage also brings a [tile_n x MX_SCALE_BOX] byte box of the E8M0 scales (see _mainloop_mx)
        self.mx_scale_box_bytes = cfg.tile_n * MX_SCALE_BOX if cfg.mxfp8 else 0
        stage_bytes = ((cfg.tile_m * self.ab_dtype.width + cfg.tile_n * self.b_load_dtype.width) * self.tile_k // 8
                       + self.mx_scale_box_bytes)
        # FP8 192-wide tiles: the scales come through shared memory (see ScaleStaging)
        self.staging = ScaleStaging.of(cfg)
        scale_bytes = self.staging.smem_bytes if self.staging else 0
        # mbarriers (at most 8 stages + the scale stages) + schedule, padded to the 1024-byte alignment of the tiles
        reserved = -(-(16 * (8 + ScaleStaging.STAGES) + 12 * (cfg.num_experts + 1)) // 1024) * 1024
        self.out_cols = cfg.tile_n // 2 if cfg.swiglu else cfg.tile_n  # output columns per tile
        self.out_chunks = self.out_cols // EPI_N
        mx_bytes = MX_B_BUFFERS * cfg.tile_n * self.tile_k * 2 if cfg.mxfp8 and not cfg.swap_ab else 0
        # swap_ab: the fp32 output tile the consumers share (see grouped_gemm_sm90_swapped)
        self.x_floats = swapped_out_floats(cfg.tile_m, cfg.tile_n) if cfg.swap_ab else 0

        def stages_beside(out_buffer_bytes: int) -> int:
            return min(8, (SMEM_CAPACITY - reserved - out_buffer_bytes - mx_bytes - scale_bytes) // stage_bytes)

        # The output buffer the store warps drain holds one bf16 output tile, or with split_output
        # half of one where that frees the shared memory of one more pipeline stage (bf16 128x192:
        # 5 stages instead of 4, 128x256: 4 instead of 3, with up to ~240 experts, whose tile schedule
        # shares the reserved bytes; 128x128 only beside ~240-1600 experts).  The tile then goes over in two column
        # halves, the second from registers in the middle of the next tile's mainloop (see Epilogue).
        out_tile_bytes = cfg.tile_m * self.out_cols * 2
        self.out_halves = cfg.split_output and stages_beside(out_tile_bytes // 2) > stages_beside(out_tile_bytes)
        self.buffer_chunks = self.out_chunks // 2 if self.out_halves else self.out_chunks
        self.stages = stages_beside(self.buffer_chunks * cfg.tile_m * EPI_N * 2 + 4 * self.x_floats)
        # Output elements per 16-byte global store in the epilogue (fewer when rows are not 16-byte aligned).
        self.store_vec = math.gcd(8, cfg.out_n)
        # FP8 192-wide tiles: one partial, the two consumer warpgroups take turns (see _fp8_one_partial).
        self.fp8_turns = cfg.fp8 and cfg.tile_n != 128 and self.num_consumer_wg == 2
        # bf16 with two consumer warpgroups: they take turns to issue each stage (see _mainloop).
        self.bf16_turns = not cfg.fp8 and not cfg.mxfp8 and self.num_consumer_wg == 2
        self.turns = self.fp8_turns or self.bf16_turns
        self.tma_store = cfg.tma_store
        self.producer_regs = 40
        # setmaxnreg budgets of 65536 registers: three consumer warpgroups (MXFP8 192-row tiles) get 152 each
        # setmaxnreg budgets: the CTA holds what ptxas gave each of its threads (at most 65536 / threads, in
        # multiples of 8: 96 for 640), the producer warpgroup gives back down to 40, the consumers share the rest;
        # asking for more than that waits forever (four consumer warpgroups at 112 did)
        self.consumer_regs = {1: 240, 2: 232, 3: 152, 4: 104}[self.num_consumer_wg]

    def _make_tiled_mma(self) -> cute.TiledMma:
        """WGMMA tiling: one 64 x tile_n atom per consumer warpgroup, both operands K-major in smem; with
        ``swap_ab`` 64 weight rows x tile_m tokens per warpgroup, the weights' A operand from registers (bf16
        math) or from shared memory (FP8 activations)."""
        swapped = self.cfg.swap_ab
        source = cute.nvgpu.warpgroup.OperandSource
        # bf16 math converts the weights into registers; FP8 math reads them from their TMA stage
        weights_in_registers = swapped and not self.cfg.fp8
        return sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype,
            self.ab_dtype,
            LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(),
            LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(),
            self.acc_dtype,
            (self.num_consumer_wg, 1, 1),
            tiler_mn=(64, self.cfg.tile_m if swapped else self.cfg.tile_n),
            a_source=source.RMEM if weights_in_registers else source.SMEM,
        )

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        a_ptr: cute.Pointer,
        b_ptr: cute.Pointer,
        c_ptr: cute.Pointer,
        groups_ptr: cute.Pointer,
        sfa_ptr: cute.Pointer,
        sfb_ptr: cute.Pointer,
        row_w_ptr: cute.Pointer,
        rows: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        E, N, K = cfg.num_experts, cfg.n, cfg.k
        batches = E if cutlass.const_expr(cfg.masked) else 1
        rows64 = cutlass.Int64(rows)
        # A: (rows, K, batch) K-major; masked layout batches over experts.
        mA = cute.make_tensor(a_ptr, cute.make_layout((rows, K, batches), stride=(K, 1, rows64 * K)))
        mB = cute.make_tensor(b_ptr, cute.make_layout((N, K, E), stride=(K, 1, N * K)))
        out_n = cfg.out_n
        mC = cute.make_tensor(c_ptr, cute.make_layout((rows, out_n, batches), stride=(out_n, 1, rows64 * out_n)))
        n_groups = E + 1 if cutlass.const_expr(not cfg.masked) else E
        mGroups = cute.make_tensor(groups_ptr, cute.make_layout(n_groups))
        # Activation scales (rows, K/128 padded to a multiple of 4, batch): rows of 16-byte multiples
        # (kernels.act_quant), the padding read only by the 4-block staging copies and never used;
        # weight scales (N/128, K/128, E).
        skb = self.scale_k_blocks
        sfa_row = scale_row_stride(skb)
        sfa_batch_stride = cute.assume(rows64 * sfa_row, divby=sfa_row)
        mSFA = cute.make_tensor(sfa_ptr, cute.make_layout((rows, sfa_row, batches), stride=(sfa_row, 1, sfa_batch_stride)))
        if cutlass.const_expr(cfg.mxfp8):
            # E8M0 weight scales (N, K/32, E), one byte each, rows scale_row_bytes apart (16-byte multiples for TMA).
            mxk = math.ceil(K / MX_BLOCK)
            sf_row = scale_row_bytes(mxk)
            mSFB = cute.make_tensor(sfb_ptr, cute.make_layout((N, mxk, E), stride=(sf_row, 1, N * sf_row)))
        else:
            snb = self.scale_n_blocks
            mSFB = cute.make_tensor(sfb_ptr, cute.make_layout((snb, skb, E), stride=(skb, 1, snb * skb)))
        mRowW = cute.make_tensor(row_w_ptr, cute.make_layout((rows, batches), stride=(1, rows64)))

        self.tiled_mma = self._make_tiled_mma()
        staging = self.staging
        tile_mnk = (cfg.tile_m, cfg.tile_n, self.tile_k)
        self.a_smem_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile_mnk, self.ab_dtype, self.stages)
        self.b_smem_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, tile_mnk, self.b_load_dtype, self.stages
        )
        # MXFP8: the MMA reads B from these bf16 buffers (otherwise straight from the TMA stages).
        self.b_mma_smem_layout = (
            sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile_mnk, self.ab_dtype, MX_B_BUFFERS)
            if cfg.mxfp8 and not cfg.swap_ab else self.b_smem_layout
        )
        self.epi_smem_layout = sm90_utils.make_smem_layout_epi(
            self.c_dtype, LayoutEnum.ROW_MAJOR, (cfg.tile_m, EPI_N), self.buffer_chunks
        )
        load = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_a, tma_a = tma_tile(load, mA, self.a_smem_layout, (cfg.tile_m, self.tile_k))
        tma_atom_b, tma_b = tma_tile(load, mB, self.b_smem_layout, (cfg.tile_n, self.tile_k))
        # MXFP8: per stage a (tile_n, MX_SCALE_BOX) byte box of the scales, row-major and unswizzled
        # (otherwise B's atom and tensor stand in, never used).
        self.sf_smem_layout = cute.make_layout((cfg.tile_n, MX_SCALE_BOX, self.stages),
                                               stride=(MX_SCALE_BOX, 1, cfg.tile_n * MX_SCALE_BOX))
        tma_atom_c, tma_c = tma_atom_b, tma_b  # stand-ins where the output is not stored by TMA
        if cutlass.const_expr(self.tma_store):
            tma_atom_c, tma_c = tma_tile(cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), mC, self.epi_smem_layout,
                                         (cfg.tile_m, EPI_N))
        tma_atom_sf, tma_sf = tma_atom_b, tma_b
        if cutlass.const_expr(cfg.mxfp8):
            tma_atom_sf, tma_sf = tma_tile(load, mSFB, self.sf_smem_layout, (cfg.tile_n, MX_SCALE_BOX))

        @cute.struct
        class SharedStorage:
            pipeline_mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            # tile_begin[e] = first output tile of expert e; tile_begin[E] = total
            tile_begin: cute.struct.MemRange[cutlass.Int32, E + 1]
            row_start: cute.struct.MemRange[cutlass.Int32, E]
            row_count: cute.struct.MemRange[cutlass.Int32, E]
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.a_smem_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.b_load_dtype, cute.cosize(self.b_smem_layout)], 1024]
            sEpi: cute.struct.Align[cute.struct.MemRange[self.c_dtype, cute.cosize(self.epi_smem_layout)], 1024]
            # MXFP8: the dequantized bf16 weight tiles (otherwise one unaligned byte, outside the stage budget)
            sBmx: (
                cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.b_mma_smem_layout)], 1024]
                if cfg.mxfp8 and not cfg.swap_ab else cute.struct.MemRange[self.ab_dtype, 1]
            )
            # swap_ab: the fp32 output tile (see grouped_gemm_sm90_swapped; otherwise one float)
            sX: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, self.x_floats or 1], 16]
            # MXFP8: each stage's scale box (see _mainloop_mx; otherwise one byte)
            sSF: cute.struct.Align[
                cute.struct.MemRange[cutlass.Uint8, cute.cosize(self.sf_smem_layout) if cfg.mxfp8 else 1], 128]
            # FP8 192-wide tiles: the staged scales (see ScaleStaging; otherwise one float each)
            scale_mbar: cute.struct.MemRange[cutlass.Int64, ScaleStaging.STAGES * 2]
            sSA: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, staging.a_floats if staging else 1], 16]
            sSB: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, staging.b_floats if staging else 1], 16]

        # stages_beside sized the stages with a reserve for what precedes the 1024-byte aligned tiles: check it held.
        if cutlass.const_expr(SharedStorage.size_in_bytes() > SMEM_CAPACITY):
            raise ValueError(f"{cfg}: {SharedStorage.size_in_bytes()} bytes of shared memory, over {SMEM_CAPACITY}")
        self.shared_storage = SharedStorage
        self.kernel(
            tma_atom_a, tma_a, tma_atom_b, tma_b, tma_atom_sf, tma_sf, mC, tma_atom_c, tma_c, mGroups, mSFA, mSFB,
            mRowW, rows,
            self.tiled_mma, self.a_smem_layout, self.b_smem_layout, self.b_mma_smem_layout, self.epi_smem_layout,
            self.sf_smem_layout,
        ).launch(
            grid=[cfg.num_sms, 1, 1],
            block=[self.threads, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
            use_pdl=cfg.pdl,
        )

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(
        self,
        tma_atom_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_atom_sf: cute.CopyAtom,
        mSF: cute.Tensor,
        mC: cute.Tensor,
        tma_atom_c: cute.CopyAtom,
        mCt: cute.Tensor,
        mGroups: cute.Tensor,
        mSFA: cute.Tensor,
        mSFB: cute.Tensor,
        mRowW: cute.Tensor,
        rows: cutlass.Int32,
        tiled_mma: cute.TiledMma,
        a_smem_layout: cute.ComposedLayout,
        b_smem_layout: cute.ComposedLayout,
        b_mma_smem_layout: cute.ComposedLayout,
        epi_smem_layout: cute.ComposedLayout,
        sf_smem_layout: cute.Layout,
    ):
        cfg = self.cfg
        E = cfg.num_experts
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bidx, _, _ = cute.arch.block_idx()
        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_b)
            if cutlass.const_expr(cfg.mxfp8):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_sf)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        s_tile_begin = storage.tile_begin.get_tensor(cute.make_layout(E + 1))
        s_row_start = storage.row_start.get_tensor(cute.make_layout(E))
        s_row_count = storage.row_count.get_tensor(cute.make_layout(E))
        if cutlass.const_expr(cfg.pdl):
            # Launched with programmatic dependent launch: the set-up above may run while the previous kernel in
            # the stream finishes; every thread waits here for that kernel's completion and memory before any
            # global read (the counts just below, the operands) or write.  Then the next kernel may launch: its
            # CTAs take the SMs ours leave.
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        if warp_idx == 0:
            self._build_schedule(mGroups, rows, s_tile_begin, s_row_start, s_row_count)

        tma_bytes = cute.size_in_bytes(self.ab_dtype, cute.slice_(a_smem_layout, (None, None, 0))) + cute.size_in_bytes(
            self.b_load_dtype, cute.slice_(b_smem_layout, (None, None, 0))
        ) + self.mx_scale_box_bytes
        # A stage is free once every consumer warp has released it (one arrive per warp).
        mainloop = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.pipeline_mbar.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * self.num_consumer_wg),
            tx_count=tma_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )
        sA = storage.sA.get_tensor(a_smem_layout.outer, swizzle=a_smem_layout.inner)
        sB = storage.sB.get_tensor(b_smem_layout.outer, swizzle=b_smem_layout.inner)
        sEpi = storage.sEpi.get_tensor(epi_smem_layout.outer, swizzle=epi_smem_layout.inner)
        sBmma, sSF, sX = sB, None, None
        if cutlass.const_expr(cfg.mxfp8):
            if cutlass.const_expr(not cfg.swap_ab):
                sBmma = storage.sBmx.get_tensor(b_mma_smem_layout.outer, swizzle=b_mma_smem_layout.inner)
            sSF = storage.sSF.get_tensor(sf_smem_layout)
        if cutlass.const_expr(cfg.swap_ab):
            sX = storage.sX.get_tensor(cute.make_layout((cfg.tile_m, cfg.tile_n), stride=(cfg.tile_n + SWAPPED_X_PAD, 1)))
        # FP8 192-wide tiles: warp 1 stages each tile's scales in shared memory, a chunk of K blocks per stage.
        scales, sSA, sSB = None, None, None
        st = self.staging
        if cutlass.const_expr(st is not None):
            scales = pipeline.PipelineCpAsync.create(
                barrier_storage=storage.scale_mbar.data_ptr(),
                num_stages=st.STAGES,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),  # every lane's copies
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * self.num_consumer_wg),  # a lane per warp
                defer_sync=True,
            )
            sSA = storage.sSA.get_tensor(cute.make_layout((st.rows, st.row_stride, st.STAGES),
                                                          stride=(st.row_stride, 1, st.rows * st.row_stride)))
            sSB = storage.sSB.get_tensor(cute.make_layout((st.quarters, st.chunk, st.STAGES),
                                                          stride=(st.chunk, 1, st.quarters * st.chunk)))
        # CTA barrier with release/acquire: publishes the mbarrier inits and the
        # schedule written above to every thread.
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=False)
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))
        total_tiles = s_tile_begin[E]
        warp_group = cute.arch.make_warp_uniform(tidx // 128)

        if warp_group == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self._produce(
                    tma_atom_a, mA, tma_atom_b, mB, tma_atom_sf, mSF, sA, sB, sSF, mainloop, bidx, total_tiles,
                    s_tile_begin, s_row_start, s_row_count,
                )
            elif warp_idx == SCALE_WARP:
                if cutlass.const_expr(st is not None):
                    self._stage_scales(mSFA, mSFB, sSA, sSB, scales, rows, bidx, total_tiles, s_tile_begin,
                                       s_row_start, s_row_count)
            elif warp_idx >= STORE_WARPS[0]:
                if cutlass.const_expr(not cfg.swap_ab):  # swapped tiles are stored by their consumers
                    self._store_tiles(sEpi, mC, (tma_atom_c, mCt), rows, tidx - 32 * STORE_WARPS[0], bidx,
                                      total_tiles, s_tile_begin, s_row_start, s_row_count)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            if cutlass.const_expr(cfg.swap_ab):
                self._consume_swapped(tiled_mma, sA, sB, b_smem_layout, sSF, sX, mSFA, mC, mRowW, rows, mainloop, tidx - 128,
                                      bidx, total_tiles, s_tile_begin, s_row_start, s_row_count)
            else:
                self._consume(
                    tiled_mma, sA, sB, sBmma, sEpi, mSFA, mSFB, sSA, sSB, sSF, scales, mRowW, rows, mainloop,
                    tidx - 128, bidx, total_tiles, s_tile_begin, s_row_start, s_row_count,
                )

    @cute.jit
    def _build_schedule(self, mGroups, rows, s_tile_begin, s_row_start, s_row_count):
        """Warp 0: per-expert rows and the prefix sum of output tiles, into smem."""
        cfg = self.cfg
        lane = cute.arch.lane_idx()
        carry = cutlass.Int32(0)
        if lane == 0:
            s_tile_begin[0] = cutlass.Int32(0)
        for chunk in cutlass.range_constexpr((cfg.num_experts + 31) // 32):
            e = chunk * 32 + lane
            start = cutlass.Int32(0)
            count = cutlass.Int32(0)
            if e < cfg.num_experts:
                if cutlass.const_expr(cfg.masked):
                    count = mGroups[e]
                    if count > rows:
                        count = rows
                else:
                    start = mGroups[e]
                    count = mGroups[e + 1] - start
                if count < 0:
                    count = cutlass.Int32(0)
            tiles = (count + cfg.tile_m - 1) // cfg.tile_m * self.n_tiles
            # inclusive warp scan of the tile counts
            for step in cutlass.range_constexpr(5):
                other = cute.arch.shuffle_sync_up(tiles, 1 << step)
                if lane >= (1 << step):
                    tiles = tiles + other
            if e < cfg.num_experts:
                s_tile_begin[e + 1] = carry + tiles
                s_row_start[e] = start
                s_row_count[e] = count
            carry = carry + cute.arch.shuffle_sync(tiles, 31)

    @cute.jit
    def _locate(self, tile, expert, s_tile_begin, s_row_start, s_row_count):
        """Where output ``tile`` is: ``(expert, n_tile, batch, row0, rows_left)``.

        ``expert`` advances from the caller's previous value (a CTA's tiles come
        in order).  Tiles run N-major, M-minor inside an expert, so the CTAs
        working at the same time share weight tiles in L2.  ``row0`` is the
        tile's first row in its batch (masked layout: batch = expert), and
        ``rows_left`` how many rows from there belong to the expert.

        With ``tma_store`` the last row tile of an expert of at least ``tile_m``
        rows ends at the expert's last row instead of running past it: it
        overlaps the tile before by a few rows, which both compute and write
        alike, and every tile of such an expert is full, so it goes out by TMA.
        (With tiles from the expert's first row on, a group of 375 rows leaves a
        partial third tile, and since 132 CTAs take 4 experts of 33 such tiles a
        round, the same 44 CTAs get every partial tile: their store warps set
        the pace however fast the others store.)
        """
        cfg = self.cfg
        while tile >= s_tile_begin[expert + 1]:
            expert = expert + 1
        local = tile - s_tile_begin[expert]
        m_tiles = (s_row_count[expert] + cfg.tile_m - 1) // cfg.tile_m
        n_tile = local // m_tiles
        m_row = (local - n_tile * m_tiles) * cfg.tile_m
        if cutlass.const_expr(self.tma_store):
            m_row = cutlass.min(m_row, cutlass.max(s_row_count[expert] - cfg.tile_m, 0))
        batch = expert if cutlass.const_expr(cfg.masked) else 0
        return expert, n_tile, batch, s_row_start[expert] + m_row, s_row_count[expert] - m_row

    @cute.jit
    def _produce(self, tma_atom_a, mA, tma_atom_b, mB, tma_atom_sf, mSF, sA, sB, sSF, mainloop, first_tile,
                 total_tiles, s_tile_begin, s_row_start, s_row_count):
        """Warp 0: every tile's K stages by TMA, A and B (MXFP8: and the stage's scale box) on one mbarrier."""
        cfg = self.cfg
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        gB = cute.local_tile(mB, (cfg.tile_n, self.tile_k), (None, None, None))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_atom_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
        )
        tSsS, tSgS = None, None
        if cutlass.const_expr(cfg.mxfp8):
            gSF = cute.local_tile(mSF, (cfg.tile_n, MX_SCALE_BOX), (None, None, None))
            tSsS, tSgS = cute.nvgpu.cpasync.tma_partition(
                tma_atom_sf, 0, cute.make_layout(1), cute.group_modes(sSF, 0, 2), cute.group_modes(gSF, 0, 2)
            )
        stages_per_box = MX_SCALE_BOX * MX_BLOCK // self.tile_k  # consecutive stages whose scales one box holds
        tile = first_tile
        expert = cutlass.Int32(0)
        while tile < total_tiles:
            expert, n_tile, batch, row0, _ = self._locate(tile, expert, s_tile_begin, s_row_start, s_row_count)
            # The expert's rows start at an arbitrary row (contiguous layout): offset
            # the TMA coordinate space to the tile's first row, then tile.
            gA = cute.local_tile(cute.domain_offset((row0, 0, 0), mA), (cfg.tile_m, self.tile_k), (None, None, None))
            tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                tma_atom_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
            )
            tAgA_t = tAgA[(None, 0, None, batch)]
            tBgB_t = tBgB[(None, n_tile, None, expert)]
            for k_tile in cutlass.range(self.k_tiles, unroll=1):
                mainloop.producer_acquire(state)
                barrier = mainloop.producer_get_barrier(state)
                cute.copy(tma_atom_a, tAgA_t[(None, k_tile)], tAsA[(None, state.index)], tma_bar_ptr=barrier)
                cute.copy(tma_atom_b, tBgB_t[(None, k_tile)], tBsB[(None, state.index)], tma_bar_ptr=barrier)
                if cutlass.const_expr(cfg.mxfp8):
                    # The box of the 16-byte window holding this stage's scale bytes (L2 serves the repeats).
                    cute.copy(tma_atom_sf, tSgS[(None, n_tile, k_tile // stages_per_box, expert)],
                              tSsS[(None, state.index)], tma_bar_ptr=barrier)
                mainloop.producer_commit(state)
                state.advance()
            tile = tile + cfg.num_sms
        mainloop.producer_tail(state)

    @cute.jit
    def _store_tiles(self, sEpi, mC, tma_c, rows, store_tidx, first_tile, total_tiles, s_tile_begin, s_row_start,
                     s_row_count):
        """Store warps: every output tile of this CTA, in the consumers' order, from shared to global memory."""
        cfg = self.cfg
        store = self._store_setup(sEpi, store_tidx)
        tile = first_tile
        expert = cutlass.Int32(0)
        while tile < total_tiles:
            expert, n_tile, batch, row0, rows_left = self._locate(tile, expert, s_tile_begin, s_row_start,
                                                                  s_row_count)
            self._store_tile(store, mC, tma_c, sEpi, rows, row0, rows_left, n_tile, batch, store_tidx)
            tile = tile + cfg.num_sms
        if cutlass.const_expr(self.tma_store):
            if store_tidx == 0:
                cute.arch.cp_async_bulk_wait_group(0)  # the last tile's TMA stores complete before the CTA exits

    @cute.jit
    def _consume(self, tiled_mma, sA, sB, sBmma, sEpi, mSFA, mSFB, sSA, sSB, sSF, scales, mRowW, rows, mainloop,
                 mma_tidx, first_tile, total_tiles, s_tile_begin, s_row_start, s_row_count):
        cfg = self.cfg
        thr_mma = tiled_mma.get_slice(mma_tidx)
        wg = cute.arch.make_warp_uniform(mma_tidx // 128)  # consumer warpgroup index
        tCsA = thr_mma.partition_A(sA)
        tCsB = thr_mma.partition_B(sBmma)
        tCrA = tiled_mma.make_fragment_A(tCsA)
        tCrB = tiled_mma.make_fragment_B(tCsB)
        num_k_blocks = cute.size(tCrA, mode=[2])

        # Coordinates of this thread's accumulator elements inside a tile.
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.tile_n)))
        acc = cute.make_rmem_tensor(tCcC.shape, self.acc_dtype)
        # FP8: K blocks' products before scaling (128-wide tiles use both, 192-wide one)
        part0 = cute.make_rmem_tensor(tCcC.shape, self.acc_dtype)
        part1 = cute.make_rmem_tensor(tCcC.shape, self.acc_dtype)
        epi = self._epilogue_setup(tiled_mma, sEpi, acc, mma_tidx)
        held = self._held_half(epi) if cutlass.const_expr(self.out_halves) else None
        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        scale_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, ScaleStaging.STAGES)

        if cutlass.const_expr(self.turns):
            if wg == 1:
                self._pass_turn(wg)  # warpgroup 0 issues first
        tile = first_tile
        expert = cutlass.Int32(0)
        while tile < total_tiles:
            expert, n_tile, batch, row0, _ = self._locate(tile, expert, s_tile_begin, s_row_start, s_row_count)
            # The pipeline states are assigned here, not only mutated in the callee,
            # so that the DSL carries them across iterations of this tile loop.
            if cutlass.const_expr(cfg.fp8):
                read_state, release_state, scale_state = self._mainloop_block_scaled(
                    tiled_mma, tCrA, tCrB, num_k_blocks, acc, part0, part1, tCcC, mSFA, mSFB, sSA, sSB, rows, row0,
                    batch, expert, n_tile, wg, mainloop, read_state, release_state, scales, scale_state,
                )
            elif cutlass.const_expr(cfg.mxfp8):
                read_state, release_state = self._mainloop_mx(
                    tiled_mma, tCrA, tCrB, num_k_blocks, acc, sB, sBmma, sSF, mma_tidx,
                    mainloop, read_state, release_state,
                )
            else:
                read_state, release_state = self._mainloop(
                    tiled_mma, tCrA, tCrB, num_k_blocks, acc, wg, mainloop, read_state, release_state,
                    epi, held, tile > first_tile,
                )
            self._epilogue(acc, tCcC, epi, held, mRowW, rows, row0, batch, wg)
            tile = tile + cfg.num_sms
        if cutlass.const_expr(self.out_halves):
            if first_tile < total_tiles:
                self._write_held_half(epi, held, wg)  # the last tile's second half
        if cutlass.const_expr(self.turns):
            if wg == 0:
                self._take_turn(wg)  # the turn warpgroup 1 passed after its last block: both barriers end balanced

    @cute.jit
    def _mma_stage(self, tiled_mma, acc, tCrA, tCrB, num_k_blocks, a_stage, b_stage,
                   fresh: cutlass.Constexpr = False):
        """Issue one K stage's WGMMAs (A from smem stage ``a_stage``, B from ``b_stage``) as one batch, not waited for.

        ``fresh``: the first WGMMA overwrites ``acc`` instead of adding to it.
        """
        cute.nvgpu.warpgroup.fence()
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, not fresh)
        for kb in cutlass.range_constexpr(num_k_blocks):
            cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, a_stage)], tCrB[(None, None, kb, b_stage)], acc)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        cute.nvgpu.warpgroup.commit_group()

    @cute.jit
    def _mainloop(self, tiled_mma, tCrA, tCrB, num_k_blocks, acc, wg, mainloop, read_state, release_state,
                  epi, held, held_pending):
        """bf16: accumulate the whole K range in one fp32 accumulator, one WGMMA batch in flight.

        With two consumer warpgroups they take turns to issue each stage's WGMMAs
        (``_take_turn`` / ``_pass_turn``, as the FP8 192-wide tiles do), so that
        warpgroup 0's last batch of a tile finishes half a stage before warpgroup
        1's and its epilogue runs under those WGMMAs, and warpgroup 1's under
        warpgroup 0's first batch of the next tile; issued together, both batches
        finished together and both epilogues left the tensor cores idle.  On an
        H200 (a371ffeef6e4, same GPU, same call, A/B by a temporary switch)
        bf16 prefill moved -0.7..+2.5% sustained, 0..+2% in bursts, by shape.

        With ``out_halves`` (``held_pending``: the previous tile's second output
        half waits in ``held``) that half is written to the output buffer after
        the middle stage's batch is issued, under its WGMMAs: the store warps
        have had half a tile to drain the first half, and get half a tile for
        this one before the epilogue needs the buffer again.
        """
        acc.fill(0.0)
        for k_tile in cutlass.range(self.k_tiles, unroll=1):
            mainloop.consumer_wait(read_state)
            if cutlass.const_expr(self.bf16_turns):
                self._take_turn(wg)
            self._mma_stage(tiled_mma, acc, tCrA, tCrB, num_k_blocks, read_state.index, read_state.index)
            if cutlass.const_expr(self.bf16_turns):
                self._pass_turn(wg)
            if cutlass.const_expr(self.out_halves):
                if held_pending:
                    if k_tile == self.k_tiles // 2:
                        self._write_held_half(epi, held, wg)
            # Keep this batch in flight; the previous one is done, free its stage.
            cute.nvgpu.warpgroup.wait_group(1)
            if k_tile > 0:
                mainloop.consumer_release(release_state)
                release_state.advance()
            read_state.advance()
        cute.nvgpu.warpgroup.wait_group(0)
        mainloop.consumer_release(release_state)
        release_state.advance()
        return read_state, release_state
