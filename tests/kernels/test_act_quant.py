"""Activation quantizer without a GPU: the masked variant compiles for sm_90a, bad inputs raise typed errors."""

from __future__ import annotations

import os

import pytest
import torch

from kernels.act_quant import ActQuantError, quantize_act


def test_masked_quantizer_compiles_for_sm90(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", os.environ.get("CUTE_DSL_ARCH", "sm_90a"))
    from kernels.act_quant_sm90 import compiled_quantizer

    masked, plain = compiled_quantizer(768, masked=True), compiled_quantizer(768)
    assert masked is not None and plain is not None and masked is not plain


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
