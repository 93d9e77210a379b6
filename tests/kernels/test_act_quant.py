"""Activation quantizer without a GPU: the masked variant compiles for sm_90a, bad inputs raise typed errors."""

from __future__ import annotations

import os

import pytest
import torch

from kernels.act_quant import ActQuantError, quantize_act


def test_quantizer_variants_compile_for_sm90(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", os.environ.get("CUTE_DSL_ARCH", "sm_90a"))
    from kernels.act_quant_sm90 import BLOCKS_PER_WARP, compiled_quantizer

    masked = compiled_quantizer(768, masked=True)
    plain = [compiled_quantizer(768, blocks_per_warp=b) for b in BLOCKS_PER_WARP]
    assert len({id(k) for k in (masked, *plain)}) == 1 + len(BLOCKS_PER_WARP)


def test_warps_take_more_blocks_only_where_the_grid_stays_wide():
    from kernels.act_quant_sm90 import BLOCKS_PER_WARP, MIN_CTAS_PER_SM, WARPS_PER_CTA, warp_blocks_for

    few, most = BLOCKS_PER_WARP[0], BLOCKS_PER_WARP[-1]
    wide = 132 * MIN_CTAS_PER_SM * WARPS_PER_CTA * most  # blocks that give 132 SMs their CTAs at `most` a warp
    assert warp_blocks_for(64 * 16, 132) == few         # a decode step's tokens, K = 2048
    assert warp_blocks_for(wide - 1, 132) == few
    assert warp_blocks_for(wide, 132) == most
    assert warp_blocks_for(48000 * 32, 132) == most     # prefill-sized
    assert warp_blocks_for(wide, 264) == few            # twice the SMs want twice the blocks


def test_a_blocks_per_warp_without_a_kernel_is_refused():
    from kernels.act_quant_sm90 import quantize_cuda

    with pytest.raises(ActQuantError, match="blocks_per_warp"):
        quantize_cuda(torch.zeros(4, 256, dtype=torch.bfloat16), blocks_per_warp=3)


@pytest.mark.parametrize("counts, match", [
    (torch.tensor([1, 2], dtype=torch.int32), r"counts \[E\]"),       # one count per group: 3 needed
    (torch.tensor([1, 2, 3]), "int64"),                                  # not int32
])
def test_masked_quantization_rejects_mismatched_counts(counts, match):
    x = torch.zeros(3, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(ActQuantError, match=match):
        quantize_act(x, counts)


def test_masked_quantization_needs_grouped_rows():
    with pytest.raises(ActQuantError, match=r"x \[E, capacity, K\]"):
        quantize_act(torch.zeros(24, 128, dtype=torch.bfloat16), torch.tensor([1, 2, 3], dtype=torch.int32))


def test_masked_reference_quantizes_every_row():
    """On CPU (the torch reference) the counts change nothing: the filled rows are what a GEMM reads."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 256, generator=gen).bfloat16()
    q, s = quantize_act(x, torch.tensor([0, 5, 2], dtype=torch.int32))
    q_all, s_all = quantize_act(x)
    assert torch.equal(q.view(torch.uint8), q_all.view(torch.uint8)) and torch.equal(s, s_all)
