"""Helpers shared by the model runtime tests (fixtures live in conftest.py)."""

from __future__ import annotations

import pytest
import torch

VOCAB = 512  # parity tests feed random ids; the tokenizer is exercised in test_tiny_offline


# name -> make_tiny options. Together: GQA ratios 1/2/4/8, top-k 1/2/8, norm_topk_prob
# on/off, tied/untied, sharded files, a dense layer inside a MoE model, a dense model.
CONFIGS: dict[str, dict] = {
    "gqa1_top1_norm_tied": dict(heads=4, kv_heads=4, experts=4, top_k=1, norm_topk_prob=True, tie=True),
    "gqa2_top2_nonorm_sharded": dict(heads=4, kv_heads=2, experts=8, top_k=2, norm_topk_prob=False, max_shard_size="150KB"),
    "gqa4_top8_norm": dict(heads=8, kv_heads=2, experts=8, top_k=8, norm_topk_prob=True),
    "gqa8_top2_mlp_only_tied": dict(layers=3, heads=8, kv_heads=1, experts=8, top_k=2, norm_topk_prob=False, tie=True, mlp_only_layers=[1]),
    "dense": dict(dense=True, heads=4, kv_heads=2),
}

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


def median_token_rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Median over tokens of ``||a - ref|| / ||ref||`` along the vocabulary (robust to router near-tie flips)."""
    return float(((a.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)).median())


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of tokens whose argmax agrees."""
    return float((a.argmax(-1) == b.argmax(-1)).float().mean())
