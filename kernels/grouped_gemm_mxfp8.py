"""MXFP8 expert weights (OCP MX: E4M3 values, one E8M0 power-of-two scale per 32 along K).

MXFP8 is Blackwell's native block-scaled format; on Hopper it is a storage
format.  This module holds the format (quantize / dequantize, fp32 torch
reference) and the grouped GEMM entry point :func:`grouped_gemm_mxfp8` with the
same layouts as :func:`kernels.grouped_gemm.grouped_gemm`.

Status of the CUDA path: the weights are dequantized to bf16 by a torch pass
(exact: an E4M3 value times a power of two fits bf16's 8-bit exponent and
7-bit mantissa) and multiplied by the bf16 Hopper kernel (on CPU, by the fp32
reference).  That costs a
bf16 copy of the weights per call; dequantizing inside the kernel (the
intended Hopper path) is not built yet, so use this for correctness, not speed.
"""

from __future__ import annotations

import math

import torch

from kernels import grouped_gemm as gg

MX_BLOCK = 32
E4M3_EMAX = 8  # exponent of E4M3's largest normal: 448 = 1.75 * 2^8 (OCP MX "emax_elem")
E8M0_BIAS = 127
FP8_MAX = 448.0


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


def grouped_gemm_mxfp8(x: torch.Tensor, w: torch.Tensor, w_scale_e8m0: torch.Tensor, groups: torch.Tensor, *,
                       masked: bool = False, row_weights: torch.Tensor | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[rows of e] = x[rows of e] @ dequant(w[e])^T`` for bf16 ``x`` and MXFP8 ``w[E, N, K]``.

    Layouts and ``groups`` as in :func:`kernels.grouped_gemm.grouped_gemm`;
    ``w_scale_e8m0`` is uint8 ``[E, N, ceil(K/32)]``.  See the module note on
    the CUDA path.
    """
    if w.dtype != torch.float8_e4m3fn:
        raise gg.GroupedGemmError(f"MXFP8 weights must be float8_e4m3fn, got {w.dtype}")
    if x.dtype != torch.bfloat16:
        raise gg.GroupedGemmError(f"MXFP8 grouped GEMM takes bfloat16 activations, got {x.dtype}")
    # bf16 holds every E4M3 value times 2^(e - 127) exactly down to scales of 2^-124,
    # so both devices share one path: the CPU reference sees the same bf16 weights.
    w_deq = dequantize_mxfp8(w, w_scale_e8m0, dtype=torch.bfloat16)
    return gg.grouped_gemm(x, w_deq, groups, masked=masked, row_weights=row_weights, out=out)
