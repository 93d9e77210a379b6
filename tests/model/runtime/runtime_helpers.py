"""Helpers shared by the model runtime tests (fixtures live in conftest.py)."""

from __future__ import annotations

import pytest
import torch

VOCAB = 512  # parity tests feed random ids; the tokenizer is exercised in test_tiny_offline


GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
# fp32 tests run on the CPU always and on CUDA where a GPU exists (TF32 is off by default).
DEVICES = ["cpu", pytest.param("cuda", marks=GPU)]


def hf_model(path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())
