"""GPU: the fused add + RMSNorm and per-head RMSNorm + RoPE kernels against their torch references.

Both sides round at the same places (kernels.norm_rope's doc); they may differ where
an fp32 sum of squares, added in another order (and rsqrt's last bit), moves a bf16
rounding: then by one unit of bf16 (2^-8 relative) of the element, after RoPE of
the two terms that make it. Bounds: every element within 2^-7 |ref| + 2^-9 rms(ref),
and at most 1% of elements not bit-identical. The residual sum h + delta has no
reduction in it: it must be bit-identical.
"""

from __future__ import annotations

import pytest
import torch

from kernels.norm_rope import add_rms_norm, apply_rope_reference, qk_norm_rope, qkv_norm_rope_store, rms_norm_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

EPS = 1e-6


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    got, ref = got.float(), ref.float()
    rms = ref.pow(2).mean().sqrt()
    assert ((got - ref).abs() <= 2.0**-7 * ref.abs() + 2.0**-9 * rms).all(), float((got - ref).abs().max())
    assert (got != ref).float().mean() <= 0.01


@pytest.mark.parametrize("rows", [1, 64, 333])
@pytest.mark.parametrize("hidden", [2048, 4096, 136])
@pytest.mark.parametrize("residual", [True, False])
def test_add_rms_norm_matches_reference(rows, hidden, residual):
    gen = torch.Generator(device="cuda").manual_seed(rows * hidden)
    h = torch.randn(rows, hidden, device="cuda", generator=gen).to(torch.bfloat16) * 3
    delta = torch.randn(rows, hidden, device="cuda", generator=gen).to(torch.bfloat16) if residual else None
    weight = (1 + 0.2 * torch.randn(hidden, device="cuda", generator=gen)).to(torch.bfloat16)
    s, x = add_rms_norm(h, delta, weight, EPS)
    s_ref, x_ref = add_rms_norm(h, delta, weight, EPS, use_kernel=False)
    assert torch.equal(s, s_ref)
    _close(x, x_ref)


@pytest.mark.parametrize("tokens, heads", [(1, 4), (64, 32), (300, 8)])
@pytest.mark.parametrize("head_dim", [128, 64])
def test_qk_norm_rope_matches_reference(tokens, heads, head_dim):
    gen = torch.Generator(device="cuda").manual_seed(tokens * heads + head_dim)
    x = torch.randn(tokens, heads, head_dim, device="cuda", generator=gen).to(torch.bfloat16) * 2
    weight = (1 + 0.2 * torch.randn(head_dim, device="cuda", generator=gen)).to(torch.bfloat16)
    angles = torch.rand(tokens, head_dim // 2, device="cuda", generator=gen) * 1000
    cos = torch.cat((angles, angles), -1).cos().to(torch.bfloat16)
    sin = torch.cat((angles, angles), -1).sin().to(torch.bfloat16)
    got = qk_norm_rope(x, weight, cos, sin, EPS)
    _close(got, apply_rope_reference(rms_norm_reference(x, weight, EPS), cos, sin))


def test_kernels_replay_in_a_cuda_graph_on_new_inputs():
    rows, hidden, heads, d = 48, 2048, 4, 128
    h = torch.zeros(rows, hidden, device="cuda", dtype=torch.bfloat16)
    delta, weight = torch.zeros_like(h), torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    q = torch.zeros(rows, heads, d, device="cuda", dtype=torch.bfloat16)
    qw = torch.ones(d, device="cuda", dtype=torch.bfloat16)
    cos, sin = torch.ones(rows, d, device="cuda", dtype=torch.bfloat16), torch.zeros(rows, d, device="cuda", dtype=torch.bfloat16)
    add_rms_norm(h, delta, weight, EPS), qk_norm_rope(q, qw, cos, sin, EPS)  # compile and load before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        s, x = add_rms_norm(h, delta, weight, EPS)
        r = qk_norm_rope(q, qw, cos, sin, EPS)
    for seed in (1, 2):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        for t in (h, delta, q):
            t.copy_(torch.randn(t.shape, device="cuda", generator=gen))
        weight.copy_(1 + 0.2 * torch.randn(hidden, device="cuda", generator=gen))
        angles = torch.rand(rows, d // 2, device="cuda", generator=gen) * 100
        cos.copy_(torch.cat((angles, angles), -1).cos()), sin.copy_(torch.cat((angles, angles), -1).sin())
        graph.replay()
        torch.cuda.synchronize()
        s_ref, x_ref = add_rms_norm(h, delta, weight, EPS, use_kernel=False)
        assert torch.equal(s, s_ref)
        _close(x, x_ref)
        _close(r, apply_rope_reference(rms_norm_reference(q, qw, EPS), cos, sin))


def _qkv_case(tokens: int, q_heads: int, kv_heads: int, head_dim: int, page_size: int, seed: int):
    """A fused projection output, norm weights, angles, a paged pool with random contents and
    distinct random slots for the tokens."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    heads = q_heads + 2 * kv_heads
    qkv = (torch.randn(tokens, heads * head_dim, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    qw, kw = ((1 + 0.2 * torch.randn(head_dim, device="cuda", generator=gen)).to(torch.bfloat16) for _ in range(2))
    angles = torch.rand(tokens, head_dim // 2, device="cuda", generator=gen) * 1000
    cos = torch.cat((angles, angles), -1).cos().to(torch.bfloat16)
    sin = torch.cat((angles, angles), -1).sin().to(torch.bfloat16)
    num_pages = -(-tokens // page_size) * 3
    pool = torch.randn(num_pages, 2, kv_heads, page_size, head_dim, device="cuda", generator=gen).to(torch.bfloat16)
    slots = torch.randperm(num_pages * page_size, device="cuda", generator=gen)[:tokens]
    return qkv, qw, kw, cos, sin, pool, slots // page_size, slots % page_size


@pytest.mark.parametrize("tokens, q_heads, kv_heads, head_dim, page_size", [
    (1, 32, 4, 128, 16), (128, 32, 4, 128, 16), (300, 64, 4, 128, 16), (37, 8, 2, 64, 32)])
def test_qkv_norm_rope_store_matches_reference(tokens, q_heads, kv_heads, head_dim, page_size):
    """q, the K slots (normed and rotated) and the V slots (copied) against the unfused reference
    ops on the same pool; every other slot of the pool keeps its contents."""
    qkv, qw, kw, cos, sin, pool, pages, offsets = _qkv_case(tokens, q_heads, kv_heads, head_dim, page_size, tokens + head_dim)
    ref_pool = pool.clone()
    q_ref = qkv_norm_rope_store(qkv, q_heads, kv_heads, qw, kw, cos, sin, EPS, ref_pool, pages, offsets, use_kernel=False)
    q = qkv_norm_rope_store(qkv, q_heads, kv_heads, qw, kw, cos, sin, EPS, pool, pages, offsets)
    torch.cuda.synchronize()
    _close(q, q_ref)
    _close(pool[pages, 0, :, offsets], ref_pool[pages, 0, :, offsets])
    assert torch.equal(pool[pages, 1, :, offsets], qkv.view(tokens, -1, head_dim)[:, q_heads + kv_heads:])
    written = torch.zeros(pool.shape[0], pool.shape[3], dtype=torch.bool, device="cuda")
    written[pages, offsets] = True
    untouched = ~written[:, None, None, :, None].expand_as(pool)
    assert torch.equal(pool[untouched], ref_pool[untouched])


def test_qkv_norm_rope_store_replays_in_a_cuda_graph():
    tokens, q_heads, kv_heads, d, ps = 24, 16, 4, 128, 16
    qkv, qw, kw, cos, sin, pool, pages, offsets = _qkv_case(tokens, q_heads, kv_heads, d, ps, 5)
    qkv_norm_rope_store(qkv, q_heads, kv_heads, qw, kw, cos, sin, EPS, pool, pages, offsets)  # compile and load before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = qkv_norm_rope_store(qkv, q_heads, kv_heads, qw, kw, cos, sin, EPS, pool, pages, offsets)
    for seed in (1, 2):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        qkv.copy_(torch.randn(qkv.shape, device="cuda", generator=gen))
        offsets.copy_((offsets + seed) % ps)
        graph.replay()
        torch.cuda.synchronize()
        ref_pool = pool.clone()
        q_ref = qkv_norm_rope_store(qkv, q_heads, kv_heads, qw, kw, cos, sin, EPS, ref_pool, pages, offsets, use_kernel=False)
        _close(q, q_ref)
        _close(pool[pages, 0, :, offsets], ref_pool[pages, 0, :, offsets])
        assert torch.equal(pool[pages, 1, :, offsets], ref_pool[pages, 1, :, offsets])
