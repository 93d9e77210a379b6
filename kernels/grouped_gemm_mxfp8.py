"""MXFP8 expert weights (OCP MX: E4M3 values, one E8M0 power-of-two scale per 32 along K).

MXFP8 is Blackwell's native block-scaled format; on Hopper it is a storage
format.  This module holds the format (quantize / dequantize, fp32 torch
reference) and the grouped GEMM entry point :func:`grouped_gemm_mxfp8` with the
same layouts as :func:`kernels.grouped_gemm.grouped_gemm`.

On CUDA the Hopper grouped GEMM dequantizes inside the kernel: TMA brings the
E4M3 weight tile into shared memory, with it a 16-byte-wide box of the tile's
E8M0 scale rows, the consumer threads multiply each value by its
``2^(e - 127)`` (exact in bf16: an E4M3 value times a power of two fits bf16's
8-bit exponent and 7-bit mantissa) into a bf16 tile there, and bf16 WGMMAs read
it (``GroupedGemmSm90._mainloop_mx``, prefill); decode tiles convert into
registers that the WGMMAs take as their A operand
(``kernels.grouped_gemm_sm90_swapped``).  The weights cross HBM as one byte per
value plus one byte per 32 values.  TMA needs the scale rows 16-byte multiples
apart: :func:`kernel_scale_layout` gives that layout (a copy where ``ceil(K/32)``
is not a multiple of 16, e.g. K = 768), which the launcher applies per call and
``shared.model.weights.prepare_for_kernels`` once at load.  On CPU the same
function runs the fp32 reference on the dequantized weights.
"""

from __future__ import annotations

import math

import torch

from kernels import grouped_gemm as gg
from kernels.act_quant import FP8_MAX, QUANT_BLOCK

MX_BLOCK = 32
SCALE_ROW_ALIGN = 16  # bytes: TMA needs a row pitch and a start address that are multiples of 16
E4M3_EMAX = 8  # exponent of E4M3's largest normal: 448 = 1.75 * 2^8 (OCP MX "emax_elem")
E8M0_BIAS = 127


def quantize_mxfp8(w: torch.Tensor, block_size: int = MX_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``w[..., K]`` -> (E4M3 ``[..., K]``, E8M0 scales uint8 ``[..., ceil(K/block_size)]``).

    Per block: ``scale = 2^(floor(log2(amax)) - 8)`` (OCP MX rule for E4M3),
    values ``clamp(w / scale, ±448)`` rounded to E4M3 (scaled values up to 512
    saturate, as the spec prescribes).  floor(log2(amax)) is read exactly from
    the float's exponent (frexp), so no device's log2 rounding can move a block
    to the next scale.  All-zero blocks get the smallest scale.  This is the one
    definition of the format (``shared.model.quant_formats`` wraps it).
    """
    K = w.shape[-1]
    kb = math.ceil(K / block_size)
    wp = torch.nn.functional.pad(w.float(), (0, kb * block_size - K)).view(*w.shape[:-1], kb, block_size)
    amax = wp.abs().amax(dim=-1, keepdim=True)
    _, exponent = torch.frexp(amax)  # amax = m * 2^e with 0.5 <= m < 1
    floor_log2 = torch.where(amax > 0, exponent - 1, -E8M0_BIAS - E4M3_EMAX)
    shared_exp = (floor_log2 - E4M3_EMAX).clamp(-E8M0_BIAS, E8M0_BIAS).float()
    q = (wp / torch.exp2(shared_exp)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    scale = (shared_exp + E8M0_BIAS).squeeze(-1).to(torch.uint8)
    return q.view(*w.shape[:-1], kb * block_size)[..., :K].contiguous(), scale.contiguous()


def dequantize_mxfp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                     block_size: int = MX_BLOCK) -> torch.Tensor:
    """E4M3 ``[..., K]`` times ``2^(scale - 127)`` per ``block_size`` along K, as ``dtype``."""
    K = q.shape[-1]
    expected = (*q.shape[:-1], math.ceil(K / block_size))
    if scale.dtype != torch.uint8 or tuple(scale.shape) != expected:
        raise gg.GroupedGemmError(f"MXFP8 scales must be uint8 {expected}, got {scale.dtype} {tuple(scale.shape)}")
    factor = torch.exp2(scale.float() - E8M0_BIAS).repeat_interleave(block_size, dim=-1)[..., :K]
    return (q.float() * factor).to(dtype)


def scale_row_bytes(blocks: int) -> int:
    """Bytes between consecutive weight rows' scales in the kernel's layout: ``blocks`` (``ceil(K/32)``) rounded up to 16."""
    return -(-blocks // SCALE_ROW_ALIGN) * SCALE_ROW_ALIGN


def kernel_scale_layout(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 scales ``[E, N, kb]`` in the layout the Hopper kernel reads: rows ``scale_row_bytes`` apart, 16-byte aligned.

    Returned as is when already so (always when ``kb`` is a multiple of 16, e.g. K = 2048, 4096 or
    1536, contiguous from a 16-byte aligned address); otherwise copied into a ``[E, N, 16 * ceil(kb/16)]``
    buffer and returned as the ``[..., :kb]`` view of it (K = 768: 24-byte rows), a small extra kernel
    per call.  Weights held in this layout (call it once at load) pay that copy never.
    """
    E, N, kb = scale.shape
    row = scale_row_bytes(kb)
    if tuple(scale.stride()) == (N * row, row, 1) and scale.data_ptr() % SCALE_ROW_ALIGN == 0:
        return scale
    return torch.empty(E, N, row, dtype=scale.dtype, device=scale.device)[..., :kb].copy_(scale)


def fp8_math_pays(masked: bool, tokens_per_expert: float) -> bool:
    """Whether MXFP8 experts should take E4M3 activations (``kernels.act_quant.quantize_act``) for this group size.

    Decode groups (masked layout, at most ``SMALL_TILE_MAX_TOKENS_PER_EXPERT`` tokens per
    expert: the swapped tiles) run FP8 math: no weight conversion, so on one H200 the
    Qwen3 expert GEMMs take 0.53-0.58 of bf16 weights' time at 1-32 tokens per expert,
    where bf16 math takes 0.61-0.75 of it (at 64: 0.73-0.83 against 0.76-0.86;
    grouped_gemm.jsonl [279004028288]).  Larger groups, and prefill's contiguous layout, keep
    bf16 activations (the FP8 tiles are decode's only).  The activations are then rounded
    to E4M3 with one fp32 scale per 128 channels, as FP8 block-scaled models' are (and as
    MXFP8 on Blackwell quantizes both operands).
    """
    return masked and tokens_per_expert <= gg.SMALL_TILE_MAX_TOKENS_PER_EXPERT


def _check_mx(x: torch.Tensor, w: torch.Tensor, w_scale_e8m0: torch.Tensor, x_scale: torch.Tensor | None) -> None:
    if w.dtype != torch.float8_e4m3fn:
        raise gg.GroupedGemmError(f"MXFP8 weights must be float8_e4m3fn, got {w.dtype}")
    if x.dtype == gg.FP8_DTYPE:
        blocks = (*x.shape[:-1], math.ceil(x.shape[-1] / QUANT_BLOCK))
        if x_scale is None or x_scale.dtype != torch.float32 or tuple(x_scale.shape) != blocks:
            got = "none" if x_scale is None else f"{x_scale.dtype} {tuple(x_scale.shape)}"
            raise gg.GroupedGemmError(f"FP8 activations need x_scale float32 {blocks} (kernels.act_quant.quantize_act), "
                                      f"got {got}")
    elif x.dtype != torch.bfloat16 or x_scale is not None:
        raise gg.GroupedGemmError(f"MXFP8 grouped GEMM takes bfloat16 activations, or float8_e4m3fn ones with x_scale; "
                                  f"got {x.dtype}{' with x_scale' if x_scale is not None else ''}")
    if w.dim() != 3:
        raise gg.GroupedGemmError(f"MXFP8 weights must be [E, N, K], got shape {tuple(w.shape)}")
    expected = (*w.shape[:-1], math.ceil(w.shape[-1] / MX_BLOCK))
    if w_scale_e8m0.dtype != torch.uint8 or tuple(w_scale_e8m0.shape) != expected:
        raise gg.GroupedGemmError(
            f"MXFP8 scales must be uint8 {expected}, got {w_scale_e8m0.dtype} {tuple(w_scale_e8m0.shape)}")
    if w.shape[-1] % 16:
        raise gg.GroupedGemmError(f"MXFP8 weights need K % 16 == 0 (16-byte rows for TMA), got K={w.shape[-1]}")


def _launch(x, x_scale, w, w_scale_e8m0, groups, masked, row_weights, swiglu, out, expected_rows_per_expert):
    from kernels import grouped_gemm_launch  # CuTeDSL is imported only on the GPU path

    return grouped_gemm_launch.launch(x, w, groups, masked=masked, x_scale=x_scale, w_scale=None,
                                      row_weights=row_weights, swiglu=swiglu, out=out, w_scale_e8m0=w_scale_e8m0,
                                      expected_rows_per_expert=expected_rows_per_expert)


def grouped_gemm_mxfp8(x: torch.Tensor, w: torch.Tensor, w_scale_e8m0: torch.Tensor, groups: torch.Tensor, *,
                       masked: bool = False, x_scale: torch.Tensor | None = None,
                       row_weights: torch.Tensor | None = None, out: torch.Tensor | None = None,
                       expected_rows_per_expert: float | None = None) -> torch.Tensor:
    """``out[rows of e] = x[rows of e] @ dequant(w[e])^T`` for MXFP8 ``w[E, N, K]``.

    ``x`` is bf16 (bf16 math), or E4M3 with ``x_scale`` from :func:`kernels.act_quant.quantize_act`
    (FP8 math; on CUDA decode-sized groups only, at most 64 tokens per expert).
    Layouts, ``groups``, ``row_weights``, ``out`` and ``expected_rows_per_expert`` as in
    :func:`kernels.grouped_gemm.grouped_gemm`; ``w_scale_e8m0`` is uint8
    ``[E, N, ceil(K/32)]``; K must be a multiple of 16.
    """
    _check_mx(x, w, w_scale_e8m0, x_scale)
    gg.check_layout(x, w, groups, masked, row_weights, w_scale_e8m0, x_scale)
    if x.is_cuda:
        return _launch(x, x_scale, w, w_scale_e8m0, groups, masked, row_weights, False, out, expected_rows_per_expert)
    return gg.into(out, gg.grouped_gemm_reference(x, dequantize_mxfp8(w, w_scale_e8m0), groups, masked=masked,
                                                  x_scale=x_scale, row_weights=row_weights))


def grouped_gemm_mxfp8_swiglu(x: torch.Tensor, w13_interleaved: torch.Tensor, w13_scale_interleaved: torch.Tensor,
                              groups: torch.Tensor, *, masked: bool = False, x_scale: torch.Tensor | None = None,
                              row_weights: torch.Tensor | None = None, out: torch.Tensor | None = None,
                              expected_rows_per_expert: float | None = None) -> torch.Tensor:
    """Fused gate_up GEMM + SwiGLU (as :func:`kernels.grouped_gemm.grouped_gemm_swiglu`) for MXFP8 weights.

    Prepare both tensors once with :func:`interleave_gate_up_mxfp8`; ``x`` / ``x_scale`` as in
    :func:`grouped_gemm_mxfp8`.
    """
    _check_mx(x, w13_interleaved, w13_scale_interleaved, x_scale)
    if w13_interleaved.shape[1] % (2 * gg.SWIGLU_BLOCK):
        raise gg.GroupedGemmError(f"w13 must be [E, 2I, K] with 2I a multiple of {2 * gg.SWIGLU_BLOCK}, "
                                  f"got {tuple(w13_interleaved.shape)}")
    gg.check_layout(x, w13_interleaved, groups, masked, row_weights, w13_scale_interleaved, x_scale)
    if x.is_cuda:
        return _launch(x, x_scale, w13_interleaved, w13_scale_interleaved, groups, masked, row_weights, True, out,
                       expected_rows_per_expert)
    w13, _ = gg.deinterleave_gate_up(dequantize_mxfp8(w13_interleaved, w13_scale_interleaved))
    y = gg.swiglu_reference(gg.grouped_gemm_reference(x, w13, groups, masked=masked, x_scale=x_scale))
    if row_weights is not None:
        y = y * row_weights[..., None]
    return gg.into(out, y)


def interleave_gate_up_mxfp8(w13: torch.Tensor, w13_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kernels.grouped_gemm.interleave_gate_up` for MXFP8: the per-row scales move with their rows."""
    return gg.interleave_gate_up(w13)[0], gg.interleave_gate_up(w13_scale)[0]
