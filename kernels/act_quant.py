"""Activation quantization to FP8 E4M3 with one fp32 scale per token per 128 channels.

``quantize_act(x)`` returns ``(q, scale)`` with ``q * scale ~= x``: for each
row and each 128-channel block, ``scale = max(|x|, eps) / 448`` and
``q = clamp(x / scale, ±448)`` rounded to E4M3.  This is the activation side
of DeepSeek/Qwen-style block-scaled FP8 GEMMs (weights carry 128x128 blocks).
On CUDA a CuTeDSL kernel does it in one pass (one warp per row block, four
channels per lane, a shuffle max-reduction); on CPU the torch reference runs.
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import make_fake_stream, make_ptr

QUANT_BLOCK = 128
FP8_MAX = 448.0
AMAX_EPS = 1e-10
WARPS_PER_CTA = 8


def quantize_act_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: ``x[..., K]`` -> (``q`` E4M3 ``[..., K]``, ``scale`` fp32 ``[..., ceil(K/128)]``)."""
    K = x.shape[-1]
    kb = math.ceil(K / QUANT_BLOCK)
    xf = torch.nn.functional.pad(x.float(), (0, kb * QUANT_BLOCK - K)).view(*x.shape[:-1], kb, QUANT_BLOCK)
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=AMAX_EPS)
    scale = amax / FP8_MAX
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(*x.shape[:-1], kb * QUANT_BLOCK)[..., :K].contiguous(), scale.squeeze(-1)


def quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize bf16 activations ``[..., K]`` per token per 128 channels (see module doc)."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"quantize_act expects bfloat16 activations, got {x.dtype}")
    if x.shape[-1] % 16:
        raise ValueError(f"quantize_act needs K % 16 == 0 (FP8 TMA rows), got K={x.shape[-1]}")
    if not x.is_cuda:
        return quantize_act_reference(x)
    return _quantize_cuda(x.contiguous())


# ----------------------------------------------------------------- CuTeDSL
class ActQuantKernel:
    """One warp per (row, 128-channel block); each lane owns four channels."""

    def __init__(self, k: int):
        self.k = k
        self.k_blocks = math.ceil(k / QUANT_BLOCK)

    @cute.jit
    def __call__(self, x_ptr: cute.Pointer, q_ptr: cute.Pointer, s_ptr: cute.Pointer, rows: cutlass.Int32,
                 stream: cuda.CUstream):
        K, kb = self.k, self.k_blocks
        mX = cute.make_tensor(x_ptr, cute.make_layout((rows, K), stride=(K, 1)))
        mQ = cute.make_tensor(q_ptr, cute.make_layout((rows, K), stride=(K, 1)))
        mS = cute.make_tensor(s_ptr, cute.make_layout((rows, kb), stride=(kb, 1)))
        blocks = (rows * kb + WARPS_PER_CTA - 1) // WARPS_PER_CTA
        self.kernel(mX, mQ, mS, rows).launch(grid=[blocks, 1, 1], block=[32 * WARPS_PER_CTA, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, rows: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        pair = bidx * WARPS_PER_CTA + tidx // 32
        if pair < rows * self.k_blocks:
            row = pair // self.k_blocks
            block = pair - row * self.k_blocks
            col0 = block * QUANT_BLOCK + lane * 4
            vals = cute.make_rmem_tensor((4,), cutlass.Float32)
            amax = cutlass.Float32(0.0)
            for j in cutlass.range_constexpr(4):
                v = cutlass.Float32(0.0)
                if col0 + j < self.k:
                    v = mX[(row, col0 + j)].to(cutlass.Float32)
                vals[j] = v
                amax = cute.arch.fmax(amax, cute.math.absf(v))
            amax = cute.arch.warp_reduction_max(amax)
            scale = cute.arch.fmax(amax, cutlass.Float32(AMAX_EPS)) / FP8_MAX
            for j in cutlass.range_constexpr(4):
                if col0 + j < self.k:
                    y = vals[j] / scale
                    y = cute.arch.fmin(cute.arch.fmax(y, cutlass.Float32(-FP8_MAX)), cutlass.Float32(FP8_MAX))
                    mQ[(row, col0 + j)] = y.to(cutlass.Float8E4M3FN)
            if lane == 0:
                mS[(row, block)] = scale


_GMEM = cute.AddressSpace.gmem
_COMPILED: dict[int, object] = {}


def compiled_quantizer(k: int):
    """Compiled quantizer for rows of ``k`` channels (cached; compiles without a GPU under CUTE_DSL_ARCH)."""
    if k not in _COMPILED:
        _COMPILED[k] = cute.compile(
            ActQuantKernel(k),
            make_ptr(cutlass.BFloat16, 0, _GMEM, assumed_align=2),
            make_ptr(cutlass.Float8E4M3FN, 0, _GMEM, assumed_align=1),
            make_ptr(cutlass.Float32, 0, _GMEM, assumed_align=4),
            cutlass.Int32(0),
            make_fake_stream(),
        )
    return _COMPILED[k]


def _quantize_cuda(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    K = x.shape[-1]
    kb = math.ceil(K / QUANT_BLOCK)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(*x.shape[:-1], kb, dtype=torch.float32, device=x.device)
    rows = x.numel() // K
    if rows == 0:
        return q, scale
    compiled_quantizer(K)(
        make_ptr(cutlass.BFloat16, x.data_ptr(), _GMEM, assumed_align=2),
        make_ptr(cutlass.Float8E4M3FN, q.data_ptr(), _GMEM, assumed_align=1),
        make_ptr(cutlass.Float32, scale.data_ptr(), _GMEM, assumed_align=4),
        cutlass.Int32(rows),
        cuda.CUstream(torch.cuda.current_stream(x.device).cuda_stream),
    )
    return q, scale
