"""Compile-once cache and launch of the Hopper grouped GEMM (CUDA tensors only).

Kernels are keyed by :class:`GroupedGemmConfig` (experts, N, K, layout,
dtype, tile shape, epilogue, SM count): the token count stays a run-time
argument, so one compiled kernel serves every batch of a weight shape and
"shape bucket" here means the tile bucket chosen from tokens per expert.
Launches take raw device pointers and the current torch stream of the
tensors' device (through `kernels._cute_runtime.launcher`: from any thread), so
they are CUDA-graph capturable and never synchronise with the host.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import TYPE_CHECKING

import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import make_fake_stream, make_ptr

from kernels._cute_runtime import launcher, sm_count
from kernels.act_quant import scale_row_stride
from kernels.grouped_gemm import (MID_TILE_MAX_TOKENS_PER_EXPERT, MID_TILE_MAX_WEIGHT_ELEMENTS,
                                  SMALL_TILE_MAX_TOKENS_PER_EXPERT, SWAPPED_TOKEN_TILES)
from kernels.grouped_gemm_mxfp8 import kernel_scale_layout
from kernels.grouped_gemm_sm90 import GroupedGemmConfig, GroupedGemmSm90, scale_vector

if TYPE_CHECKING:
    from cutlass.base_dsl.jit_executor import JitCompiledFunction

_CACHE: dict[GroupedGemmConfig, object] = {}
_LOCK = threading.Lock()
_GMEM = cute.AddressSpace.gmem


@functools.lru_cache(maxsize=4096)  # a launch's arguments repeat from layer to layer; building the config took ~6 us
def choose_config(*, num_experts: int, n: int, k: int, masked: bool, fp8: bool, swiglu: bool,
                  row_weights: bool, tokens_per_expert: float, num_sms: int, mxfp8: bool = False,
                  tile_m: int | None = None, tile_n: int | None = None,
                  swap_ab: bool | None = None) -> GroupedGemmConfig:
    """Tile bucket by tokens per expert (the bounds are ``kernels.grouped_gemm.TILE_BUCKET_BOUNDS``).

    * up to SMALL_TILE_MAX_TOKENS_PER_EXPERT (64, decode-sized groups): 64x128 tiles;
    * above: 128-row tiles as wide as the registers allow, FP8 128x192 (96 accumulator
      + 96 partial-product registers), bf16 128x256 (two consumer warpgroups, 128
      accumulator registers each) -- but bf16 128x192 for the contiguous (prefill)
      layout of small experts (N * K <= MID_TILE_MAX_WEIGHT_ELEMENTS, 4 Mi) up to
      MID_TILE_MAX_TOKENS_PER_EXPERT (512).  Measured on H200 (both GPUs of one call, see
      the measured section of ``kernels.grouped_gemm_sm90``): at 375 tokens per expert the
      Qwen3-30B shapes ran 3-4% faster with 128x192, the Qwen3-235B shapes (6-12 Mi
      weights) up to 5% slower under sustained load; from 768 tokens on 128x192 was
      mostly level or slower.  The masked (decode) layout keeps 128x256.
    * MXFP8 weights and the SwiGLU interleave fix N at 128; MXFP8 prefill (contiguous, no SwiGLU)
      above MID_TILE_MAX_TOKENS_PER_EXPERT takes 192-row tiles, whose third consumer warpgroup
      adds WGMMA work to each stage's conversion (see ``_mainloop_mx``): +8..+17% on the four
      Qwen3 shapes at 375 and 2048 tokens per expert on one H200.  Not below that bound,
      where an expert's last tile can be mostly padding (129-192 tokens: 192 rows for 129).

    bf16 128x192 and 128x256 tiles of the contiguous layout up to MID_TILE_MAX_TOKENS_PER_EXPERT hand
    their output to the store warps in two halves (``split_output``), which gives 128x192
    tiles a fifth pipeline stage and 128x256 a fourth.  On one H200 at 375 tokens per expert
    (f712969d93c0+h52-split against f712969d93c0, same call, burst / sustained): Qwen3-30B
    down +2.5 / +2.1%, 30B gate_up +3.3 / +6.8%, 235B down +6.4 / +6.8%, 235B gate_up
    +4.7 / +2.1% (another machine, 2x H200, 12b7528a9f5c against that base: 30B down +1.0 /
    +0.5%, 235B down +3.5% burst); split at 2048 tokens too (128x256, the call before) it ran -2.6..+0.5%,
    so larger groups keep the whole-tile buffer.  The masked (decode) layout was not
    measured and keeps it.  Details: bench/grouped_gemm_findings.md.

    * MXFP8 weights up to SMALL_TILE_MAX_TOKENS_PER_EXPERT (decode) swap the operands
      (``swap_ab``, see ``kernels.grouped_gemm_sm90_swapped``): 256 weight rows per tile
      (128 for SwiGLU when 2I is not a multiple of 256, and with FP8 activations for 64
      tokens), converted in registers by four consumer warpgroups (FP8 activations: read
      from shared memory), and the fewest tokens of SWAPPED_TOKEN_TILES (8 to 64) that
      hold the expected group.  FP8 activations with MXFP8 weights run only these tiles.  One H200, burst, same call: 256 rows took 0.77-0.93 of
      128 rows' time on the four Qwen3 shapes at 1-64 tokens per expert (235B gate_up at
      1 token 461 against 595 us).

    ``tile_m`` / ``tile_n`` / ``swap_ab`` override the choice (benchmarks compare buckets).
    """
    if swap_ab is None:
        swap_ab = mxfp8 and tokens_per_expert <= SMALL_TILE_MAX_TOKENS_PER_EXPERT
    if swap_ab:
        tile_m = tile_m or next((t for t in SWAPPED_TOKEN_TILES if t >= tokens_per_expert), SWAPPED_TOKEN_TILES[-1])
        # FP8 activations keep two partials beside the accumulator: 64 tokens of them need more registers than
        # four warpgroups have (ptxas spilled 240 bytes a thread), so those take 128 weight rows
        wide = (not swiglu or n % 256 == 0) and not (fp8 and tile_m > 32)
        tile_n = tile_n or (256 if wide else 128)
    if not tile_m:
        tile_m = 64 if tokens_per_expert <= SMALL_TILE_MAX_TOKENS_PER_EXPERT else 128
        if mxfp8 and not masked and not swiglu and tokens_per_expert > MID_TILE_MAX_TOKENS_PER_EXPERT:
            tile_m = 192
    if not tile_n:
        if tile_m == 64 or mxfp8 or swiglu:
            tile_n = 128
        elif fp8:
            tile_n = 192
        else:
            small_experts = n * k <= MID_TILE_MAX_WEIGHT_ELEMENTS
            mid = not masked and small_experts and tokens_per_expert <= MID_TILE_MAX_TOKENS_PER_EXPERT
            tile_n = 192 if mid else 256
    # FP8 prefill (128-row tiles): every tile whose rows all belong to its expert goes out by TMA stores, and an
    # expert's last row tile is moved back to end at its last row (``GroupedGemmSm90._locate``), so only experts
    # of fewer than 128 rows keep the store warps' stores.  One H200, each arm from its own tree, base new new
    # base, burst (25188a70bf50+s41-tmaall against 25188a70bf50): Qwen3-30B down at 256 / 375 / 512 tokens per
    # expert 946 / 990 / 1038 -> 977-979 / 1029-1030 / 1079-1081 TFLOP/s (+3.4 / +4.0 / +4.0%), 235B down +1.5..
    # +3.8%, the gate_up shapes +0.6..+2.9%; at 128 (one tile an expert, nothing moved) -0.8..+1.3%; at 2048
    # (TMA stores before too) within 0.6%.  Before the move, TMA stores at 375 ran -0.6%: the same 44 CTAs got
    # every partial tile and their store warps set the pace; bench/grouped_gemm_findings.md.
    tma_store = fp8 and not mxfp8 and not masked and not swiglu and tile_m == 128 and n % 8 == 0
    # Only the measured tiles: 128-wide ones (SwiGLU, overrides) gain a stage only beside ~1600 experts' schedule.
    split_output = (tile_m == 128 and tile_n in (192, 256) and not fp8 and not mxfp8 and not masked
                    and tokens_per_expert <= MID_TILE_MAX_TOKENS_PER_EXPERT)
    # Decode-sized groups launch with programmatic dependent launch: a launch's set-up runs under the previous
    # kernel's last CTAs.  One H200, burst, each arm from its own tree (e2ed9e3+s32-pdl against +s32-base, B P P B):
    # bf16 decode at 64 tokens per expert -1.1..-1.4% time (Qwen3-30B down 110.5 -> 109.0 us), at 1 token -0.5%,
    # FP8 -0.3..-1.5%; but prefill +1.2..+2.5% (30B down FP8 at 375 tokens 155.2 -> 158.5 us), so not there.
    pdl = tokens_per_expert <= SMALL_TILE_MAX_TOKENS_PER_EXPERT
    return GroupedGemmConfig(num_experts=num_experts, n=n, k=k, masked=masked, fp8=fp8, tile_m=tile_m,
                             tile_n=tile_n, swiglu=swiglu, row_weights=row_weights, mxfp8=mxfp8,
                             split_output=split_output, tma_store=tma_store, swap_ab=swap_ab, pdl=pdl,
                             num_sms=num_sms)


# Byte alignment promised for each pointer argument (TMA operands need 16).
_ALIGN_AB, _ALIGN_WORD = 16, 4


def _out_align(cfg: GroupedGemmConfig) -> int:
    """The epilogue's vector store width in bytes: 16 when output rows are 16-byte multiples."""
    return 2 * math.gcd(8, cfg.out_n)


def _scale_align(cfg: GroupedGemmConfig) -> int:
    """Byte alignment promised for the FP8 weight-scale pointer (the width of the kernel's staging copies)."""
    return _ALIGN_WORD * scale_vector(cfg)


def _scale_rows_padded(x_scale: torch.Tensor) -> torch.Tensor:
    """``x_scale`` in the layout the FP8 kernels read: rows ``scale_row_stride`` floats apart, 16-byte aligned.

    ``kernels.act_quant.quantize_act`` makes that layout on CUDA (when K/128 is a multiple
    of 4 it is the contiguous one); scales from elsewhere (the torch reference, a
    contiguous copy) are copied into it here, a small extra kernel per call.
    """
    kb = x_scale.shape[-1]
    row = scale_row_stride(kb)
    strides = [1, row] + ([x_scale.shape[-2] * row] if x_scale.dim() == 3 else [])
    if list(x_scale.stride())[::-1] == strides and x_scale.data_ptr() % _ALIGN_AB == 0:
        return x_scale
    padded = torch.empty(*x_scale.shape[:-1], row, dtype=x_scale.dtype, device=x_scale.device)[..., :kb]
    return padded.copy_(x_scale)




def _operand_types(cfg: GroupedGemmConfig) -> tuple:
    """(A, B, weight-scale) element types of ``cfg``'s kernel arguments."""
    a = cutlass.Float8E4M3FN if cfg.fp8 else cutlass.BFloat16
    b = cutlass.Float8E4M3FN if (cfg.fp8 or cfg.mxfp8) else cutlass.BFloat16
    return a, b, (cutlass.Uint8 if cfg.mxfp8 else cutlass.Float32)


def _compile_args(cfg: GroupedGemmConfig) -> list:
    a, b, sb = _operand_types(cfg)
    return [
        make_ptr(a, 0, _GMEM, assumed_align=_ALIGN_AB),
        make_ptr(b, 0, _GMEM, assumed_align=_ALIGN_AB),
        make_ptr(cutlass.BFloat16, 0, _GMEM, assumed_align=_out_align(cfg)),
        make_ptr(cutlass.Int32, 0, _GMEM, assumed_align=_ALIGN_WORD),
        make_ptr(cutlass.Float32, 0, _GMEM, assumed_align=_ALIGN_AB if cfg.fp8 else _ALIGN_WORD),
        make_ptr(sb, 0, _GMEM, assumed_align=_ALIGN_AB if cfg.mxfp8 else _scale_align(cfg)),
        make_ptr(cutlass.Float32, 0, _GMEM, assumed_align=_ALIGN_WORD),
        cutlass.Int32(0),
        make_fake_stream(),
    ]


def compile_kernel(cfg: GroupedGemmConfig, options: str = "") -> JitCompiledFunction:
    """Compile ``cfg`` now (no GPU needed under CUTE_DSL_ARCH=sm_90a); ``options`` go to ``cute.compile``."""
    return cute.compile(GroupedGemmSm90(cfg), *_compile_args(cfg), options=options)


def compiled_kernel(cfg: GroupedGemmConfig) -> JitCompiledFunction:
    """The cached compiled kernel for ``cfg`` (compiled on first use, once whatever the threads)."""
    fn = _CACHE.get(cfg)
    if fn is not None:
        return fn
    with _LOCK:
        fn = _CACHE.get(cfg)
        if fn is None:
            fn = _CACHE[cfg] = compile_kernel(cfg)
        return fn


def _address(t: torch.Tensor, align: int) -> int:
    """``t``'s device address, which the kernel was compiled to assume ``align``-byte aligned."""
    address = t.data_ptr()
    if address % align:
        raise ValueError(f"tensor {tuple(t.shape)} {t.dtype} must be {align}-byte aligned (got address {address:#x})")
    if not t.is_contiguous():
        raise ValueError(f"tensor {tuple(t.shape)} {t.dtype} must be contiguous")
    return address


def launch(x: torch.Tensor, w: torch.Tensor, groups: torch.Tensor, *, masked: bool,
           x_scale: torch.Tensor | None, w_scale: torch.Tensor | None, row_weights: torch.Tensor | None,
           swiglu: bool, out: torch.Tensor | None, tile_m: int | None = None,
           tile_n: int | None = None, w_scale_e8m0: torch.Tensor | None = None,
           expected_rows_per_expert: float | None = None, swap_ab: bool | None = None) -> torch.Tensor:
    """Run the kernel on ``x``'s device's current stream; arguments were validated by ``kernels.grouped_gemm``
    (or ``kernels.grouped_gemm_mxfp8`` for ``w_scale_e8m0``: bf16 ``x`` times MXFP8 ``w``).

    ``tile_m`` / ``tile_n`` / ``swap_ab`` override the tile bucket (benchmarks compare buckets with them;
    see :func:`choose_config`).
    """
    E, N, K = w.shape
    fp8 = x_scale is not None
    mxfp8 = w_scale_e8m0 is not None
    rows = x.shape[-2]
    # The tile bucket's token count. A masked layout's host-side shape is its capacity, far
    # above what a decode step fills: its caller passes the expected rows per expert.
    tokens_per_expert = expected_rows_per_expert if expected_rows_per_expert is not None else (rows if masked else rows / E)
    cfg = choose_config(num_experts=E, n=N, k=K, masked=masked, fp8=fp8, swiglu=swiglu,
                        row_weights=row_weights is not None, tokens_per_expert=tokens_per_expert,
                        num_sms=sm_count(x.device),
                        mxfp8=mxfp8, tile_m=tile_m, tile_n=tile_n, swap_ab=swap_ab)
    if fp8 and mxfp8 and not cfg.swap_ab:
        raise ValueError(f"FP8 activations with MXFP8 weights run only the decode tiles (at most "
                         f"{SMALL_TILE_MAX_TOKENS_PER_EXPERT} tokens per expert), got {tokens_per_expert:g} tokens per "
                         "expert; pass bf16 activations")
    if rows * cfg.out_n >= 2**31:  # the epilogue addresses output elements with 32-bit offsets
        raise ValueError(f"output of {rows} rows x {cfg.out_n} columns exceeds 2^31 elements per batch; split the call")
    out_shape = (*x.shape[:-1], cfg.out_n)
    if out is None:
        out = torch.empty(out_shape, dtype=torch.bfloat16, device=x.device)
    elif tuple(out.shape) != out_shape or out.dtype != torch.bfloat16:
        raise ValueError(f"out must be bfloat16 {out_shape}, got {out.dtype} {tuple(out.shape)}")
    if rows == 0:
        return out
    if fp8:
        x_scale = _scale_rows_padded(x_scale)
    if mxfp8:
        w_scale_e8m0 = kernel_scale_layout(w_scale_e8m0)  # the TMA box rows: 16-byte pitch and alignment
    groups_address = _address(groups, _ALIGN_WORD)
    unused = groups_address  # for pointers this configuration never reads (any word-aligned address)
    launcher(compiled_kernel(cfg), x.device)(  # any calling thread: x's GPU, its current stream
        _address(x, _ALIGN_AB),
        _address(w, _ALIGN_AB),
        _address(out, _out_align(cfg)),
        groups_address,
        x_scale.data_ptr() if fp8 else unused,  # 16-byte aligned padded rows (not contiguous when padded)
        w_scale_e8m0.data_ptr() if mxfp8 else (_address(w_scale, _scale_align(cfg)) if fp8 else unused),
        _address(row_weights, _ALIGN_WORD) if row_weights is not None else unused,
        rows,
    )
    return out

