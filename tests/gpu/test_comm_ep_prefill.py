"""GPU prefill expert-parallel exchange: select -> (stand-in expert op) -> combine -> all-reduce.

Single GPU: the CuTeDSL select/combine kernels against the torch reference on
random and skewed routing (all tokens on one expert, tokens with no local expert),
group alignment 1 and 128, 32 to 1000 local experts. Every visible GPU (TP = EP = 2, 4 or 8, inputs
replicated): the full exchange with our all-reduce equals one process applying
all experts.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from kernels import ep_prefill as ep
from kernels._local_group import run_local_group

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _routing(tokens: int, experts: int, topk: int, kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g, device="cuda")
    if kind == "skewed":
        scores[:, 3] += 2.0  # every token picks expert 3
        scores[: tokens // 3, experts // 2 :] += 4.0  # a third of the tokens only pick from the upper half
    return scores.topk(topk, dim=1).indices.int()


def _expert_op(rows: torch.Tensor, row_expert: torch.Tensor) -> torch.Tensor:
    """Stand-in for the expert GEMMs: a per-expert scale, so a row sent to the wrong group shows."""
    return (rows.float() * (row_expert.float()[:, None] + 1) / 16).to(rows.dtype)


def _row_experts(sel: ep.SelectedRows, expert_start: int) -> torch.Tensor:
    rows = torch.arange(sel.rows.shape[0], device=sel.rows.device)
    return torch.searchsorted(sel.offsets[1:].long(), rows, right=True) + expert_start


@pytest.mark.parametrize("kind", ["random", "skewed"])
@pytest.mark.parametrize("align", [1, 128])
@pytest.mark.parametrize("experts,start,num_local", [(64, 16, 32), (128, 0, 128), (1024, 24, 1000)],
                         ids=["32-local", "128-local", "1000-local"])  # one, four, up to 32 experts per scan lane
# int32 ids with fp32 weights, and the router's own int64 ids with bf16 weights (read as they are, no conversion)
@pytest.mark.parametrize("ids_dtype,w_dtype", [(torch.int32, torch.float32), (torch.int64, torch.bfloat16)],
                         ids=["int32-fp32", "int64-bf16"])
def test_select_and_combine_match_reference(kind, align, experts, start, num_local, ids_dtype, w_dtype):
    tokens, hidden, topk = 3001, 1024, 8
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    ids = _routing(tokens, experts, topk, kind, seed=5 if kind == "random" else 6).to(ids_dtype)
    w = torch.rand(tokens, topk, device="cuda").to(w_dtype)
    ours = ep.ep_select(x, ids, start, num_local, align)
    ref = ep.ep_select_reference(x, ids, start, num_local, align)
    torch.cuda.synchronize()
    assert torch.equal(ours.counts, ref.counts) and torch.equal(ours.offsets, ref.offsets)
    assert torch.equal(ours.row_of < 0, ref.row_of < 0)
    valid = ours.row_of >= 0
    token_of = torch.arange(tokens, device="cuda")[:, None].expand(-1, topk)
    assert torch.equal(ours.rows[ours.row_of[valid].long()], x[token_of[valid]]), "a row holds the wrong token"
    expert_of_row = _row_experts(ours, start)
    assert torch.equal(expert_of_row[ours.row_of[valid].long()], ids[valid].long()), "a row sits in the wrong expert group"
    assert len(set(ours.row_of[valid].tolist())) == int(valid.sum()), "two (token, slot) pairs share a row"

    y = _expert_op(ours.rows, expert_of_row)
    out = ep.ep_combine(y, ours.row_of, w)
    expected = ep.ep_combine_reference(_expert_op(ref.rows, _row_experts(ref, start)), ref.row_of, w)
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)
    # the same weights given as fp32 combine to the same bits: the kernel's bf16 -> fp32 read is exact
    assert torch.equal(out, ep.ep_combine(y, ours.row_of, w.float()))


@pytest.mark.parametrize("hidden", [1024, 2048 + 384])  # 8 and 19 K blocks: scale rows of 8 and 20 floats
def test_fp8_rows_move_with_their_scales(hidden):
    """E4M3 rows quantized before the gather arrive byte for byte with their scale rows, which keep the
    quantizer's padded layout (what the FP8 grouped GEMM reads)."""
    from kernels.act_quant import quantize_act, scale_row_stride

    tokens, experts, topk = 2001, 128, 8
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    ids = _routing(tokens, experts, topk, "skewed", seed=9).long()
    q, scale = quantize_act(x)
    sel = ep.ep_select(q, ids, 16, 96, align=16, x_scale=scale)
    ref = ep.ep_select_reference(q, ids, 16, 96, align=16, x_scale=scale)
    torch.cuda.synchronize()
    assert torch.equal(sel.offsets, ref.offsets) and torch.equal(sel.row_of < 0, ref.row_of < 0)
    valid = sel.row_of >= 0
    token = torch.arange(tokens, device="cuda")[:, None].expand(-1, topk)[valid]
    rows = sel.row_of[valid].long()
    assert torch.equal(sel.rows[rows].view(torch.uint8), q[token].view(torch.uint8))
    assert torch.equal(sel.scales[rows], scale[token])
    assert sel.scales.stride() == (scale_row_stride(scale.shape[1]), 1) and sel.scales.data_ptr() % 16 == 0


def _exchange_rank(rank: int, world: int, kind: str) -> bool:
    from kernels.allreduce import all_reduce

    tokens, hidden, experts, topk = 2050, 2048, 32, 4
    num_local = experts // world
    g = torch.Generator(device="cuda").manual_seed(17)  # same seed: inputs are replicated across the group
    x = torch.randn(tokens, hidden, generator=g, device="cuda").bfloat16()
    w = torch.rand(tokens, topk, generator=g, device="cuda")
    ids = _routing(tokens, experts, topk, kind, seed=23)
    sel = ep.ep_select(x, ids, rank * num_local, num_local)
    partial = ep.ep_combine(_expert_op(sel.rows, _row_experts(sel, rank * num_local)), sel.row_of, w)
    out = all_reduce(partial)
    full = ep.ep_select_reference(x, ids, 0, experts)
    expected = ep.ep_combine_reference(_expert_op(full.rows, _row_experts(full, 0)), full.row_of, w)
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    parts = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(parts, out)
    assert all(torch.equal(p, parts[0]) for p in parts), "ranks disagree after the all-reduce"
    return True


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("kind", ["random", "skewed"])
def test_tp_ep_exchange_equals_all_experts_in_one_process(kind):
    world = min(torch.cuda.device_count(), 8)  # 32 experts split evenly over 2, 4 or 8 ranks
    assert run_local_group(_exchange_rank, world, "nccl", kind, timeout=240) == [True] * world
