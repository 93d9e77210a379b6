"""Activation quantization to FP8 E4M3 with one fp32 scale per token per 128 channels.

``quantize_act(x)`` returns ``(q, scale)`` with ``q * scale ~= x``: for each row
and each 128-channel block, ``scale = max(amax, 1e-12) * fl(1/448)`` and
``q = clamp(x / scale, ±448)`` rounded to E4M3.  This is the activation side of
DeepSeek/Qwen-style block-scaled FP8 GEMMs (weights carry 128x128 blocks).

Layout of ``scale`` on CUDA: a ``[..., ceil(K/128)]`` view of rows padded to a
multiple of ``SCALE_ROW_ALIGN`` (4) K blocks, i.e. 16 bytes (row stride
:func:`scale_row_stride`; the padding is never written).  The FP8 grouped GEMM's
192-wide tiles copy a tile's scales into shared memory 4 K blocks (16 bytes) per
``cp.async``, which needs 16-byte aligned rows (the copies read the padding and
never use it); when K/128 is a multiple of 4 the view is simply contiguous.
Values are those of the reference in any layout.

This module is the one definition of that format in the project
(``shared.model.quant_formats`` and ``kernels.dispatch_combine`` re-export
:func:`quantize_act_reference`).  It imports only torch: the CuTeDSL kernel
lives in :mod:`kernels.act_quant_sm90` and is imported on the CUDA path only.
"""

from __future__ import annotations

import math

import torch

QUANT_BLOCK = 128
FP8_MAX = 448.0
# Scales are amax times the fp32 reciprocal of 448, not amax / 448: torch on CUDA
# divides by a Python scalar that way, so the multiplication gives the same bits on
# the CPU, with torch on CUDA and in the kernels.
INV_FP8_MAX = 1.0 / FP8_MAX
# An all-zero block would give scale 0 and 0/0; flooring amax keeps the scale
# positive and still maps such a block to exact zeros.
AMAX_FLOOR = 1e-12


SCALE_ROW_ALIGN = 4  # K blocks: rows of CUDA activation scales are padded to 16 bytes


def scale_row_stride(k_blocks: int) -> int:
    """Floats between consecutive rows of CUDA activation scales of ``k_blocks`` K blocks (see module doc)."""
    return -(-k_blocks // SCALE_ROW_ALIGN) * SCALE_ROW_ALIGN


class ActQuantError(ValueError):
    """Activations the quantizer cannot take (dtype, shape, group size)."""


def quantize_act_reference(x: torch.Tensor, group: int = QUANT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference, any float dtype and device: ``x[..., K]`` -> (``q`` E4M3 ``[..., K]``,
    ``scale`` fp32 ``[..., ceil(K/group)]``); a partial last group is padded with zeros."""
    if x.dim() < 1 or group <= 0:
        raise ActQuantError(f"activation quantization needs a >= 1-D tensor and group > 0, got {tuple(x.shape)}, group {group}")
    K = x.shape[-1]
    kb = math.ceil(K / group)
    xf = torch.nn.functional.pad(x.float(), (0, kb * group - K)).view(*x.shape[:-1], kb, group)
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=AMAX_FLOOR) * INV_FP8_MAX
    # torch's cast to E4M3 does not saturate (out of range becomes NaN): clamp first.
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(*x.shape[:-1], kb * group)[..., :K].contiguous(), scale.squeeze(-1).contiguous()


def quantize_act(x: torch.Tensor, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize bf16 activations ``[..., K]`` per token per 128 channels (see module doc).

    ``counts``: the masked grouped-GEMM layout, ``x`` ``[E, capacity, K]`` of which group ``e``
    holds ``counts[e]`` rows (int32 ``[E]``, on x's device): on CUDA only those rows are
    quantized, the rest of ``q`` and ``scale`` is left unwritten (the masked GEMMs never
    store a result from such rows); the torch reference quantizes every row.
    CUDA tensors run the CuTeDSL kernel, others the torch reference; on CUDA ``scale`` is a
    view of rows padded to :func:`scale_row_stride` floats (see module doc).
    """
    if x.dtype != torch.bfloat16:
        raise TypeError(f"quantize_act expects bfloat16 activations, got {x.dtype}")
    if x.shape[-1] % 16:
        raise ValueError(f"quantize_act needs K % 16 == 0 (FP8 TMA rows), got K={x.shape[-1]}")
    if counts is not None and (x.dim() != 3 or tuple(counts.shape) != (x.shape[0],) or counts.dtype != torch.int32 or counts.device != x.device):
        raise ActQuantError(f"masked quantization takes x [E, capacity, K] and int32 counts [E] on its device, got x {tuple(x.shape)} "
                            f"and counts {tuple(counts.shape)} {counts.dtype} on {counts.device}")
    if not x.is_cuda:
        return quantize_act_reference(x)
    from kernels import act_quant_sm90  # CuTeDSL is imported only on the GPU path

    return act_quant_sm90.quantize_cuda(x.contiguous(), counts)
