"""MXFP8 weight format (E4M3 + E8M0 per 32 along K) and its grouped GEMM reference path, on CPU."""

from __future__ import annotations

import pytest
import torch

from kernels import grouped_gemm as gg
from kernels import grouped_gemm_mxfp8 as mx
from kernels.act_quant import quantize_act
from kernels.grouped_gemm_mxfp8 import MX_BLOCK, dequantize_mxfp8, grouped_gemm_mxfp8, quantize_mxfp8

FP8 = torch.float8_e4m3fn


def test_representable_weights_round_trip_exactly():
    gen = torch.Generator().manual_seed(1)
    E, N, K = 2, 6, 80  # K not a multiple of 32: the last block has 16 values
    q = (torch.rand(E, N, K, generator=gen) * 200 - 100).to(FP8)
    q[..., ::MX_BLOCK] = 320.0  # block max 320 = 1.25 * 2^8 fixes the exponent rule's answer
    exps = torch.randint(-20, 20, (E, N, 3), generator=gen)
    w = dequantize_mxfp8(q, (exps + 127).to(torch.uint8))
    q2, s2 = quantize_mxfp8(w)
    assert torch.equal(s2.long() - 127, exps)
    assert torch.equal(q2.float(), q.float())


def test_quantization_error_bounds_and_zero_blocks():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(5, 7, 96, generator=gen) * torch.logspace(-4, 4, 7)[None, :, None]
    w[0, 0, :32] = 0
    q, s = quantize_mxfp8(w)
    assert q.dtype == FP8 and s.dtype == torch.uint8 and s.shape == (5, 7, 3)
    deq = dequantize_mxfp8(q, s)
    amax = w.view(5, 7, 3, 32).abs().amax(-1).repeat_interleave(32, -1)
    err = (deq - w).abs()
    # E4M3 rounding is within 2^-4 relative; values above 448 * scale saturate (OCP rule), at most 1/8 of the block max.
    assert torch.all(err <= torch.maximum(w.abs() * 2.0**-4, amax * 0.125) + 1e-30)
    assert (err <= w.abs() * 2.0**-4 + 1e-30).float().mean() > 0.95
    assert torch.all(deq[0, 0, :32] == 0)


def test_grouped_gemm_mxfp8_reference_matches_dequantized_weights():
    gen = torch.Generator().manual_seed(3)
    E, N, K = 3, 40, 96
    offsets = torch.tensor([0, 7, 7, 20], dtype=torch.int32)
    x = torch.randn(20, K, generator=gen).bfloat16()
    q, s = quantize_mxfp8(torch.randn(E, N, K, generator=gen))
    out = grouped_gemm_mxfp8(x, q, s, offsets)
    expect = gg.grouped_gemm_reference(x, dequantize_mxfp8(q, s), offsets, masked=False)
    torch.testing.assert_close(out, expect, rtol=1e-6, atol=1e-6)


def test_mxfp8_swiglu_reference_on_interleaved_weights_and_scales():
    """Interleaving moves each row's scales with the row: the fused reference equals plain GEMM + SwiGLU."""
    gen = torch.Generator().manual_seed(4)
    E, I, K = 2, 128, 96
    counts = torch.tensor([5, 0], dtype=torch.int32)
    x = torch.randn(E, 6, K, generator=gen).bfloat16()
    q, s = quantize_mxfp8(torch.randn(E, 2 * I, K, generator=gen) * torch.logspace(-3, 3, 2 * I)[None, :, None])
    qi, si = mx.interleave_gate_up_mxfp8(q, s)
    rw = torch.rand(E, 6, generator=gen)
    fused = mx.grouped_gemm_mxfp8_swiglu(x, qi, si, counts, masked=True, row_weights=rw)
    h = gg.grouped_gemm_reference(x, dequantize_mxfp8(q, s), counts, masked=True)
    torch.testing.assert_close(fused, gg.swiglu_reference(h) * rw[..., None], rtol=1e-6, atol=1e-6)


def test_kernel_scale_layout_pads_rows_to_16_bytes_only_where_needed():
    """The Hopper kernel's TMA reads scale rows 16-byte multiples apart from a 16-byte aligned start."""
    _, s48 = quantize_mxfp8(torch.randn(2, 8, 1520))  # 48 scales a row: already the layout
    assert mx.scale_row_bytes(48) == 48 and mx.kernel_scale_layout(s48) is s48
    _, s24 = quantize_mxfp8(torch.randn(2, 8, 752))  # 24 a row: copied into 32-byte rows
    padded = mx.kernel_scale_layout(s24)
    assert padded.stride() == (8 * 32, 32, 1) and padded.data_ptr() % 16 == 0 and torch.equal(padded, s24)
    assert mx.kernel_scale_layout(padded) is padded  # held in the layout: no copy per call
    shifted = torch.empty(s48.numel() + 1, dtype=torch.uint8)[1:].view(s48.shape).copy_(s48)  # misaligned start
    moved = mx.kernel_scale_layout(shifted)
    assert moved.data_ptr() % 16 == 0 and torch.equal(moved, s48)


def test_mxfp8_reference_with_fp8_activations_uses_their_scales():
    """FP8 activations (E4M3 and their 1x128 scales) against MXFP8 weights: the reference is the fp32 GEMM of both
    dequantized, for the plain and the fused SwiGLU op."""
    gen = torch.Generator().manual_seed(5)
    E, I, K = 2, 128, 256
    counts = torch.tensor([5, 1], dtype=torch.int32)
    xq, xs = quantize_act(torch.randn(E, 6, K, generator=gen).bfloat16())
    xs = xs * torch.logspace(-4, 4, E * 6 * 2).view(E, 6, 2)  # scales far from 1: a missed factor shows
    q, s = quantize_mxfp8(torch.randn(E, 2 * I, K, generator=gen))
    x_deq = xq.float() * xs.repeat_interleave(128, -1)
    h = gg.grouped_gemm_reference(x_deq, dequantize_mxfp8(q, s), counts, masked=True)
    torch.testing.assert_close(grouped_gemm_mxfp8(xq, q, s, counts, masked=True, x_scale=xs), h, rtol=1e-6, atol=1e-6)
    qi, si = mx.interleave_gate_up_mxfp8(q, s)
    fused = mx.grouped_gemm_mxfp8_swiglu(xq, qi, si, counts, masked=True, x_scale=xs)
    torch.testing.assert_close(fused, gg.swiglu_reference(h), rtol=1e-6, atol=1e-6)


def test_bad_mxfp8_inputs_raise():
    q, s = quantize_mxfp8(torch.randn(2, 8, 64))
    x = torch.randn(4, 64).bfloat16()
    offsets = torch.tensor([0, 2, 4], dtype=torch.int32)
    with pytest.raises(gg.GroupedGemmError, match="uint8"):
        grouped_gemm_mxfp8(x, q, s.float(), offsets)
    with pytest.raises(gg.GroupedGemmError, match="bfloat16 activations"):
        grouped_gemm_mxfp8(x.float(), q, s, offsets)
    xq, xs = quantize_act(x)
    with pytest.raises(gg.GroupedGemmError, match="bfloat16 activations.*with x_scale"):
        grouped_gemm_mxfp8(x, q, s, offsets, x_scale=xs)
    with pytest.raises(gg.GroupedGemmError, match=r"FP8 activations need x_scale float32 \(4, 1\).*got none"):
        grouped_gemm_mxfp8(xq, q, s, offsets)
    with pytest.raises(gg.GroupedGemmError, match=r"got torch.float32 \(4, 2\)"):
        grouped_gemm_mxfp8(xq, q, s, offsets, x_scale=xs.repeat(1, 2))
    q24, s24 = quantize_mxfp8(torch.randn(2, 8, 24))
    with pytest.raises(gg.GroupedGemmError, match="K % 16"):
        grouped_gemm_mxfp8(torch.randn(4, 24).bfloat16(), q24, s24, offsets)
    with pytest.raises(gg.GroupedGemmError, match="offsets must be"):
        grouped_gemm_mxfp8(x, q, s, offsets[:2])
