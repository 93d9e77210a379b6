"""CPU checks of the fused norm/RoPE ops: the kernels compile for sm_90a, the references are
transformers' Qwen3 ops, bad shapes are refused. The kernels against the references on a GPU:
tests/gpu/test_norm_rope_cuda.py."""

from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm, apply_rotary_pos_emb

from kernels.norm_rope import add_rms_norm, qk_norm_rope
from kernels.norm_rope_sm90 import compiled_add_rms_norm, compiled_qk_norm_rope


@pytest.mark.parametrize("hidden, residual", [(2048, True), (4096, False), (136, True)])
def test_add_rms_norm_compiles_for_sm90a(hidden, residual):
    assert compiled_add_rms_norm(hidden, residual) is not None


@pytest.mark.parametrize("head_dim", [64, 128])
def test_qk_norm_rope_compiles_for_sm90a(head_dim):
    assert compiled_qk_norm_rope(head_dim) is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_references_match_transformers(dtype):
    gen = torch.Generator().manual_seed(0)
    t, heads, d, hidden, eps = 5, 3, 64, 96, 1e-6
    h, delta = (torch.randn(t, hidden, generator=gen).to(dtype) for _ in range(2))
    norm = Qwen3MoeRMSNorm(hidden, eps).to(dtype)
    norm.weight.data = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    s, x = add_rms_norm(h, delta, norm.weight.data, eps)
    assert torch.equal(s, h + delta)
    assert torch.equal(x, norm(h + delta))
    assert torch.equal(add_rms_norm(h, None, norm.weight.data, eps)[1], norm(h))

    q = torch.randn(t, heads, d, generator=gen).to(dtype)
    head_norm = Qwen3MoeRMSNorm(d, eps).to(dtype)
    head_norm.weight.data = (1 + 0.1 * torch.randn(d, generator=gen)).to(dtype)
    angles = torch.randn(t, d // 2, generator=gen)
    cos, sin = torch.cat((angles, angles), -1).cos().to(dtype), torch.cat((angles, angles), -1).sin().to(dtype)
    # transformers rotates [B, heads, T, D] with cos/sin [B, T, D]
    expect, _ = apply_rotary_pos_emb(head_norm(q).transpose(0, 1)[None], head_norm(q).transpose(0, 1)[None], cos[None], sin[None])
    got = qk_norm_rope(q, head_norm.weight.data, cos, sin, eps)
    assert torch.equal(got, expect[0].transpose(0, 1))


def test_shapes_are_checked():
    h = torch.zeros(4, 64)
    with pytest.raises(ValueError, match="delta"):
        add_rms_norm(h, torch.zeros(4, 32), torch.ones(64), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(h, None, torch.ones(32), 1e-6)
    with pytest.raises(ValueError, match="cos/sin"):
        qk_norm_rope(torch.zeros(4, 2, 64), torch.ones(64), torch.zeros(3, 64), torch.zeros(3, 64), 1e-6)
