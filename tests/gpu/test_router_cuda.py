"""GPU: the fused router softmax + top-k kernel against its torch reference (transformers' ops).

The kernel's fp32 softmax sums run in another order than torch's, so a probability may
differ in its last bit: expert ids must agree, in order, except for tokens where two
neighbours among the k+1 largest probabilities are within 1e-6 relative (a near tie), and
weights within one bf16 unit (2^-8 relative) of the reference's. Exact ties take the lower expert id.
"""

from __future__ import annotations

import pytest
import torch

from kernels.router import route_topk, route_topk_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _check(logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, top_k: int, renormalize: bool) -> None:
    ref_w, ref_ids = route_topk_reference(logits, top_k, renormalize)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32).sort(dim=-1, descending=True).values
    # Any two neighbours among the k+1 largest within 1e-6 (bf16 logits tie exactly often):
    # rounding, or torch's own tie order, may order or pick them either way.
    head = probs[:, : top_k + 1]
    near_tie = ((head[:, :-1] - head[:, 1:]) <= 1e-6 * head[:, :-1]).any(dim=-1)
    same = (ids == ref_ids).all(dim=-1)
    assert (same | near_tie).all(), f"{int((~same & ~near_tie).sum())} tokens picked other experts without a near tie"
    w, r = weights[same].float(), ref_w[same].float()
    assert ((w - r).abs() <= 2.0**-8 * r.abs() + 1e-7).all(), float((w - r).abs().max())


@pytest.mark.parametrize("experts, top_k", [(128, 8), (64, 4), (256, 8), (32, 1)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens", [1, 64, 1000])
def test_route_topk_matches_reference(experts, top_k, renormalize, tokens):
    gen = torch.Generator(device="cuda").manual_seed(experts * tokens + top_k)
    logits = (torch.randn(tokens, experts, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    weights, ids = route_topk(logits, top_k, renormalize)
    _check(logits, weights, ids, top_k, renormalize)


def test_exact_ties_take_the_lower_expert_id():
    logits = torch.zeros(3, 128, device="cuda", dtype=torch.bfloat16)
    logits[:, 100] = 1.0
    weights, ids = route_topk(logits, 4, True)
    assert ids.tolist() == [[100, 0, 1, 2]] * 3
    expect = torch.softmax(logits.float(), -1)[0, [100, 0, 1, 2]]
    torch.testing.assert_close(weights[0].float(), (expect / expect.sum()).to(torch.bfloat16).float(), rtol=2.0**-8, atol=0)


def test_router_replays_in_a_cuda_graph_on_new_logits():
    logits = torch.zeros(48, 128, device="cuda", dtype=torch.bfloat16)
    route_topk(logits, 8, True)  # compile and load before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = route_topk(logits, 8, True)
    for seed in (1, 2):
        logits.copy_(torch.randn(logits.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)) * 3)
        graph.replay()
        torch.cuda.synchronize()
        _check(logits, weights, ids, 8, True)
