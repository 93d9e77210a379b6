"""FP8 storage formats as data and math (no I/O): block-scaled FP8, MXFP8, and
per-token-group activation quantization.

All three store values as E4M3 (``torch.float8_e4m3fn``, largest finite 448) next
to one scale per block of values; they differ in the block shape and the scale type:

* **Block FP8** (Qwen / DeepSeek checkpoints): one fp32 ``scale_inv`` per 128x128
  block of a weight ``[N, K]``. ``scale_inv = amax(block) * fl(1/448)`` and the real
  weight is ``w_fp8 * scale_inv`` (the name says it is the inverse of the factor
  that was multiplied in at quantization time).
* **MXFP8** (OCP Microscaling spec v1.0): one E8M0 scale (a bare power of two,
  stored as its biased exponent in a uint8, bias 127) per 32 consecutive values
  along K. The shared exponent is ``floor(log2(amax)) - 8``, 8 being the exponent
  of E4M3's largest normal (448 = 1.75 * 2^8); scaled values up to 512 can then
  exceed 448 and are saturated to it, as the spec prescribes.
* **Activations**: one fp32 scale per token per 128 channels, ``amax * fl(1/448)``,
  the layout the FP8 GEMMs of DeepSeek-V3 / DeepGEMM consume next to block weights.

Shapes that are not multiples of the block are handled by treating the missing
part of the last block as zeros (the scale covers only the values that exist).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels import grouped_gemm_mxfp8 as _mx
from kernels.act_quant import AMAX_FLOOR, FP8_MAX, INV_FP8_MAX, QUANT_BLOCK, quantize_act_reference
from kernels.grouped_gemm_mxfp8 import MX_BLOCK

FP8_DTYPE = torch.float8_e4m3fn
WEIGHT_BLOCK = (128, 128)
ACT_GROUP = QUANT_BLOCK
# The arithmetic of MXFP8 and of the activation format is defined once, in kernels/
# (kernels.grouped_gemm_mxfp8, kernels.act_quant); this module adds the typed
# containers and checks. Block-FP8 weight scales follow the same rule as activation
# scales: max(amax, AMAX_FLOOR) * fl(1/448), identical bits on every device.

# Activations per token per 128 channels: the kernels' reference, under its historical name here.
quantize_act_per_token_group = quantize_act_reference


class QuantFormatError(ValueError):
    """A quantized tensor whose dtype, shape or scale layout is inconsistent."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _pad_to_multiple(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    size = x.shape[dim]
    missing = _ceil_div(size, multiple) * multiple - size
    if missing == 0:
        return x
    pad_shape = list(x.shape)
    pad_shape[dim] = missing
    return torch.cat([x, x.new_zeros(pad_shape)], dim=dim)


def _to_e4m3(x: torch.Tensor) -> torch.Tensor:
    # torch's float->float8_e4m3fn cast does not saturate (out of range becomes
    # NaN), so clamp first; the scales keep values in range up to rounding anyway.
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


# --------------------------------------------------------------------------- block FP8


@dataclass(frozen=True)
class BlockFp8Weight:
    """A weight ``[..., N, K]`` in E4M3 with one fp32 scale per ``block`` tile.

    ``scale_inv`` has shape ``[..., ceil(N/block[0]), ceil(K/block[1])]``; leading
    dimensions (e.g. experts stacked as ``[E, N, K]``) are carried through.
    """

    weight: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int] = WEIGHT_BLOCK

    def __post_init__(self) -> None:
        check_block_fp8(self.weight, self.scale_inv, self.block)

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_block_fp8(self.weight, self.scale_inv, self.block).to(dtype)


def check_block_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = WEIGHT_BLOCK
) -> None:
    """Raise QuantFormatError unless ``weight``/``scale_inv`` form a valid block-FP8 pair."""
    if weight.dtype != FP8_DTYPE:
        raise QuantFormatError(f"block FP8 weight must be float8_e4m3fn, got {weight.dtype}")
    if not scale_inv.is_floating_point() or scale_inv.element_size() < 2:
        raise QuantFormatError(f"block FP8 scale_inv must be a float tensor, got {scale_inv.dtype}")
    if len(block) != 2 or min(block) <= 0:
        raise QuantFormatError(f"block must be two positive sizes, got {block}")
    if weight.dim() < 2:
        raise QuantFormatError(f"block FP8 weight must be at least 2-D, got shape {tuple(weight.shape)}")
    *lead, n, k = weight.shape
    expected = (*lead, _ceil_div(n, block[0]), _ceil_div(k, block[1]))
    if tuple(scale_inv.shape) != expected:
        raise QuantFormatError(
            f"block FP8 scale_inv shape {tuple(scale_inv.shape)} does not match weight "
            f"{tuple(weight.shape)} with block {tuple(block)}: expected {expected}"
        )


def quantize_block_fp8(w: torch.Tensor, block: tuple[int, int] = WEIGHT_BLOCK) -> BlockFp8Weight:
    """Quantize a weight ``[..., N, K]`` to E4M3 with one ``amax/448`` scale per block."""
    if w.dim() < 2:
        raise QuantFormatError(f"block FP8 quantization needs a >= 2-D tensor, got {tuple(w.shape)}")
    bn, bk = block
    *lead, n, k = w.shape
    padded = _pad_to_multiple(_pad_to_multiple(w.float(), -2, bn), -1, bk)
    nb, kb = padded.shape[-2] // bn, padded.shape[-1] // bk
    tiles = padded.reshape(*lead, nb, bn, kb, bk)
    amax = tiles.abs().amax(dim=(-3, -1), keepdim=True).clamp(min=AMAX_FLOOR)
    scale_inv = amax * INV_FP8_MAX
    q = _to_e4m3(tiles / scale_inv).reshape(padded.shape)[..., :n, :k]
    return BlockFp8Weight(
        weight=q.contiguous(),
        scale_inv=scale_inv.reshape(*lead, nb, kb).contiguous(),
        block=(bn, bk),
    )


def dequantize_block_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = WEIGHT_BLOCK
) -> torch.Tensor:
    """``weight * scale_inv`` broadcast over each block, as fp32 ``[..., N, K]``."""
    check_block_fp8(weight, scale_inv, block)
    n, k = weight.shape[-2:]
    scales = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :n, :]
    scales = scales.repeat_interleave(block[1], dim=-1)[..., :k]
    return weight.float() * scales


# --------------------------------------------------------------------------- MXFP8


@dataclass(frozen=True)
class Mxfp8Weight:
    """A tensor ``[..., K]`` in E4M3 with one E8M0 scale per ``block_size`` values of K.

    ``scale_e8m0`` is uint8 ``[..., ceil(K/block_size)]`` holding biased exponents:
    the scale of a block is ``2 ** (scale_e8m0 - 127)`` (255, the spec's NaN, is
    never produced).
    """

    weight: torch.Tensor
    scale_e8m0: torch.Tensor
    block_size: int = MX_BLOCK

    def __post_init__(self) -> None:
        check_mxfp8(self.weight, self.scale_e8m0, self.block_size)

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_mxfp8(self.weight, self.scale_e8m0, self.block_size).to(dtype)


def check_mxfp8(weight: torch.Tensor, scale_e8m0: torch.Tensor, block_size: int = MX_BLOCK) -> None:
    """Raise QuantFormatError unless ``weight``/``scale_e8m0`` form a valid MXFP8 pair."""
    if weight.dtype != FP8_DTYPE:
        raise QuantFormatError(f"MXFP8 weight must be float8_e4m3fn, got {weight.dtype}")
    if scale_e8m0.dtype != torch.uint8:
        raise QuantFormatError(f"MXFP8 scale must be uint8 (biased E8M0 exponents), got {scale_e8m0.dtype}")
    if block_size <= 0 or weight.dim() < 1:
        raise QuantFormatError(f"invalid MXFP8 block size {block_size} or 0-D weight")
    expected = (*weight.shape[:-1], _ceil_div(weight.shape[-1], block_size))
    if tuple(scale_e8m0.shape) != expected:
        raise QuantFormatError(
            f"MXFP8 scale shape {tuple(scale_e8m0.shape)} does not match weight "
            f"{tuple(weight.shape)} with block size {block_size}: expected {expected}"
        )


def quantize_mxfp8(w: torch.Tensor, block_size: int = MX_BLOCK) -> Mxfp8Weight:
    """Quantize ``[..., K]`` to E4M3 with a power-of-two scale per ``block_size`` values
    (the rule of `kernels.grouped_gemm_mxfp8.quantize_mxfp8`)."""
    if w.dim() < 1 or block_size <= 0:
        raise QuantFormatError(f"MXFP8 quantization needs at least a 1-D tensor and block_size > 0, got {block_size}")
    weight, scale = _mx.quantize_mxfp8(w, block_size)
    return Mxfp8Weight(weight=weight, scale_e8m0=scale, block_size=block_size)


def dequantize_mxfp8(
    weight: torch.Tensor, scale_e8m0: torch.Tensor, block_size: int = MX_BLOCK
) -> torch.Tensor:
    """``weight * 2**(e - 127)`` per block of ``block_size`` values, as fp32."""
    check_mxfp8(weight, scale_e8m0, block_size)
    return _mx.dequantize_mxfp8(weight, scale_e8m0, torch.float32, block_size)


# --------------------------------------------------------------------------- activations


def dequantize_act_per_token_group(
    x_fp8: torch.Tensor, scales: torch.Tensor, group: int = ACT_GROUP
) -> torch.Tensor:
    """Inverse of `quantize_act_per_token_group`, as fp32 ``[..., K]``."""
    if x_fp8.dtype != FP8_DTYPE:
        raise QuantFormatError(f"quantized activations must be float8_e4m3fn, got {x_fp8.dtype}")
    expected = (*x_fp8.shape[:-1], _ceil_div(x_fp8.shape[-1], group))
    if tuple(scales.shape) != expected:
        raise QuantFormatError(
            f"activation scales shape {tuple(scales.shape)} does not match "
            f"{tuple(x_fp8.shape)} with group {group}: expected {expected}"
        )
    k = x_fp8.shape[-1]
    return x_fp8.float() * scales.float().repeat_interleave(group, dim=-1)[..., :k]


# --------------------------------------------------------------------------- error statistics


@dataclass(frozen=True)
class QuantError:
    """How far an approximation is from its reference."""

    rel_fro: float  # ||approx - ref||_F / ||ref||_F
    max_abs: float  # max |approx - ref|
    snr_db: float  # 10 log10(||ref||^2 / ||approx - ref||^2); inf when exact

    def as_dict(self) -> dict[str, float]:
        return {"rel_fro": self.rel_fro, "max_abs": self.max_abs, "snr_db": self.snr_db}


def quant_error(ref: torch.Tensor, approx: torch.Tensor) -> QuantError:
    ref64, diff = ref.double(), approx.double() - ref.double()
    signal, noise = float(ref64.square().sum()), float(diff.square().sum())
    return QuantError(
        rel_fro=math.sqrt(noise / signal) if signal > 0 else (0.0 if noise == 0 else math.inf),
        max_abs=float(diff.abs().max()) if diff.numel() else 0.0,
        snr_db=10 * math.log10(signal / noise) if noise > 0 else math.inf,
    )
