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

from kernels.norm_rope import add_rms_norm, apply_rope_reference, qk_norm_rope, rms_norm_reference

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
