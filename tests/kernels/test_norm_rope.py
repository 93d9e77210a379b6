"""CPU checks of the fused norm/RoPE ops: the kernels compile for sm_90a, the references are
transformers' Qwen3 ops, bad shapes are refused. The kernels against the references on a GPU:
tests/gpu/test_norm_rope_cuda.py."""

from __future__ import annotations

import os
import re

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm, apply_rotary_pos_emb

from kernels.norm_rope import add_rms_norm, qk_norm_rope, qkv_norm_rope_store
from kernels.norm_rope_sm90 import compile_add_rms_norm, compiled_add_rms_norm, compiled_qk_norm_rope, compiled_qkv_norm_rope_store


@pytest.mark.parametrize("hidden, residual", [(2048, True), (4096, False), (136, True)])
def test_add_rms_norm_compiles_for_sm90a(hidden, residual):
    assert compiled_add_rms_norm(hidden, residual) is not None


@pytest.mark.parametrize("hidden, residual", [(2048, True), (4096, True), (4096, False), (136, True)])
def test_add_rms_norm_loads_the_whole_row_before_its_first_store(hidden, residual, tmp_path):
    # Loads after a store through these raw pointers wait for the loads before it (the compiler must assume they
    # alias): interleaved per vector they cost a memory latency each (6.5 us for 64 rows of 2048 on an H200).
    ptx = compile_add_rms_norm(hidden, residual, options=f"--keep-ptx --dump-dir={tmp_path}").artifacts.PTX
    loads = [m.start() for m in re.finditer(r"\bld\.global", ptx)]
    stores = [m.start() for m in re.finditer(r"\bst\.global", ptx)]
    vectors_per_lane = -(-hidden // 256)
    assert len(loads) >= (3 if residual else 2) * vectors_per_lane and stores
    assert max(loads) < min(stores)
    assert ".local" not in ptx  # the row stays in registers


@pytest.mark.parametrize("head_dim", [64, 128])
def test_qk_norm_rope_compiles_for_sm90a(head_dim):
    assert compiled_qk_norm_rope(head_dim) is not None


@pytest.mark.parametrize("head_dim, q_heads, kv_heads, page_size", [(128, 32, 4, 16), (128, 64, 4, 16), (64, 8, 2, 32)])
def test_qkv_norm_rope_store_compiles_for_sm90a(head_dim, q_heads, kv_heads, page_size):
    assert compiled_qkv_norm_rope_store(head_dim, q_heads, kv_heads, page_size) is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qkv_norm_rope_store_reference_is_the_unfused_ops(dtype):
    """Off the GPU the fused op is the model's unfused path: q/k norm + RoPE and the cache's two
    index writes, on column slices of the fused projection output."""
    gen = torch.Generator().manual_seed(3)
    t, qh, kvh, d, ps, eps = 6, 4, 2, 64, 4, 1e-6
    qkv = torch.randn(t, (qh + 2 * kvh) * d, generator=gen).to(dtype)
    qw, kw = ((1 + 0.1 * torch.randn(d, generator=gen)).to(dtype) for _ in range(2))
    angles = torch.randn(t, d // 2, generator=gen)
    cos, sin = torch.cat((angles, angles), -1).cos().to(dtype), torch.cat((angles, angles), -1).sin().to(dtype)
    pool = torch.randn(5, 2, kvh, ps, d, generator=gen).to(dtype)
    pages, offsets = torch.tensor([4, 0, 2, 2, 1, 3]), torch.tensor([3, 1, 0, 2, 1, 3])
    expect_pool = pool.clone()
    q, k, v = qkv.view(t, -1, d).split([qh, kvh, kvh], dim=1)
    expect_pool[pages, 0, :, offsets, :] = qk_norm_rope(k, kw, cos, sin, eps)
    expect_pool[pages, 1, :, offsets, :] = v
    got_q = qkv_norm_rope_store(qkv, qh, kvh, qw, kw, cos, sin, eps, pool, pages, offsets)
    assert torch.equal(got_q, qk_norm_rope(q, qw, cos, sin, eps))
    assert torch.equal(pool, expect_pool)


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
    pool, slots = torch.zeros(3, 2, 2, 4, 64), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="do not hold 4 q and 2 kv heads"):
        qkv_norm_rope_store(torch.zeros(4, 7 * 64), 4, 2, torch.ones(64), torch.ones(64), torch.zeros(4, 64), torch.zeros(4, 64), 1e-6, pool, slots, slots)
    with pytest.raises(ValueError, match="pages and offsets"):
        qkv_norm_rope_store(torch.zeros(4, 8 * 64), 4, 2, torch.ones(64), torch.ones(64), torch.zeros(4, 64), torch.zeros(4, 64), 1e-6, pool, slots[:3], slots)
