"""CPU checks of the fused router top-k: the kernel compiles for sm_90a, the reference is
transformers' Qwen3-MoE router, bad arguments are refused. The kernel against the reference
on a GPU: tests/gpu/test_router_cuda.py."""

from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from kernels.router import route_topk
from kernels.router_sm90 import compiled_route


@pytest.mark.parametrize("experts, top_k, renormalize", [(128, 8, True), (64, 4, False), (256, 8, True)])
def test_router_kernel_compiles_for_sm90a(experts, top_k, renormalize):
    assert compiled_route(experts, top_k, renormalize) is not None


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_transformers_router(norm_topk_prob, dtype):
    config = Qwen3MoeConfig(hidden_size=64, num_experts=32, num_experts_per_tok=4, norm_topk_prob=norm_topk_prob)
    router = Qwen3MoeTopKRouter(config).to(dtype)
    router.weight.data = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    logits, expect_w, expect_ids = router(x)
    weights, ids = route_topk(logits, 4, norm_topk_prob)
    assert torch.equal(ids, expect_ids) and ids.dtype == torch.int64
    assert torch.equal(weights, expect_w) and weights.dtype == dtype


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="top_k"):
        route_topk(torch.zeros(3, 8), 9, True)
    with pytest.raises(ValueError, match=r"\[T, E\]"):
        route_topk(torch.zeros(8), 2, True)
