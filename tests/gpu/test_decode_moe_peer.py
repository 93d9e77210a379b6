"""GPU, 2 processes: the decode layout's peer-memory MoE layer against the NCCL path, in a real model.

A tiny bf16 Qwen3-MoE (kernel-shaped: hidden 128, moe_intermediate 128, 16 experts,
top-4) runs DP2 x EP2 on two GPUs. On each rank two runners load the same shard
over the same `CudaCollectives`: one built with ``max_tokens_per_rank`` (its MoE
layers take `PeerDecodeMoE`: peer-memory dispatch, masked grouped GEMMs, combine)
and one without (``ep_dispatch`` over NCCL all-to-all, the contiguous grouped
GEMM, ``ep_combine``). Both round activations to bf16 at the same places and
accumulate in fp32, so their logits must agree to bf16 rounding (relative L2
error <= 1e-2 here; the values seen are printed) and greedy decoding must give the
same tokens.

Batches are uneven (rank 0: three prompts, rank 1: one) and include steps where
rank 1 has no tokens at all (its sequence joins late). The same checks run on an
FP8 block-quantized copy of the checkpoint (FP8 payload in the dispatch), and on an
MXFP8 copy, whose peer path quantizes the received rows for FP8 math
(`kernels.grouped_gemm_mxfp8.fp8_math_pays`) where the NCCL path multiplies bf16 rows:
there the logits agree to FP8 activation rounding (relative L2 error <= 5e-2, a bound
set before this case first ran on two GPUs) and greedy tokens are not compared. Last,
for both checkpoints, one MoE layer call is captured in a CUDA graph and replayed
with fresh inputs: the capture fails if the layer synchronises with the host, and
each replay must equal an eager call on the same inputs bit for bit. (With FP8 the
received activation scales, one 128-channel block a token here, are copied into the
grouped GEMM's padded scale rows inside the graph.)
"""

from __future__ import annotations

import pytest
import torch

from kernels._local_group import run_local_group

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

SHAPES = dict(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=64, experts=16, top_k=4, moe_intermediate=128,
              vocab=512, tokenizer=False, dtype="float32", seed=3)
MAX_TOKENS = 32  # per rank; the prefill batch below has 19 tokens on rank 0
PROMPTS = {0: [[5, 17, 300, 41, 9, 77, 120], [8, 2, 250, 61, 33], [400, 7, 19, 3, 88, 91, 12]], 1: [[13, 240, 6, 71]]}
JOIN_AT = {0: [0, 0, 2], 1: [3]}  # rank 1 steps with zero tokens until step 3
STEPS, NEW_TOKENS = 10, 6
PAGE = 16


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _prefill_logits(runner, prompts: list[list[int]]) -> torch.Tensor:
    from shared.model.model import ForwardBatch, SequenceChunk

    pages = runner.cache.allocator.alloc(sum(runner.cache.layout.pages_for(len(p)) for p in prompts))
    chunks, used = [], 0
    for p in prompts:
        n = runner.cache.layout.pages_for(len(p))
        chunks.append(SequenceChunk(p, 0, pages[used : used + n]))
        used += n
    logits = runner.model.forward(ForwardBatch.build(chunks, PAGE, runner.cache.device), runner.cache, all_logits=True)
    runner.cache.allocator.free(pages)
    return logits


def _greedy(runner, prompts: list[list[int]], join_at: list[int]) -> list[list[int]]:
    from shared.model.sampling_params import SamplingParams

    seqs: list = [None] * len(prompts)
    for step in range(STEPS):  # every rank runs every step, with or without sequences
        for i, j in enumerate(join_at):
            if j == step:
                seqs[i] = runner.add(str(i), prompts[i], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
        runner.step([s for s in seqs if s is not None and not s.finished])
    return [s.output_ids for s in seqs]


def _graph_replays_match_eager(model, rank: int) -> float:
    """Capture one MoE layer call in a CUDA graph; replays with fresh inputs must equal eager calls."""
    from kernels.router import route_topk

    layer = model.weights.layers[0].mlp
    c = model.config
    t = 11 if rank == 0 else 5

    def inputs(seed: int):
        g = torch.Generator(device="cuda").manual_seed(100 * seed + rank)
        x = torch.randn(t, c.hidden_size, generator=g, device="cuda").bfloat16()
        weights, ids = route_topk(torch.nn.functional.linear(x, layer.router), c.top_k, c.norm_topk_prob)
        return x, ids, weights

    static = inputs(0)
    model.decode_moe(*static, layer)  # warm-up outside the graph (first launches)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = model.decode_moe(*static, layer)
    torch.cuda.current_stream().wait_stream(stream)
    worst = 0.0
    for seed in (1, 2):
        fresh = inputs(seed)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        replayed = out.clone()
        eager = model.decode_moe(*fresh, layer)
        assert torch.equal(replayed, eager), f"rank {rank}: graph replay {seed} differs from the eager call"
        worst = max(worst, (replayed.float() - eager.float()).abs().max().item())
    return worst


def _rank(rank: int, world: int, checkpoints: dict[str, str]) -> dict:
    from shared.model.runner import ModelRunner
    from shared.parallel import Topology
    from shared.parallel_cuda import CudaCollectives, PeerDecodeMoE

    topology = Topology.decode(world, rank)
    comm = CudaCollectives(topology)
    report = {}
    for name, path in checkpoints.items():
        common = dict(num_pages=64, page_size=PAGE, dtype=torch.bfloat16, device=f"cuda:{rank}", topology=topology, comm=comm)
        peer = ModelRunner.from_dir(path, max_tokens_per_rank=MAX_TOKENS, **common)
        nccl = ModelRunner.from_dir(path, **common)
        assert isinstance(peer.model.decode_moe, PeerDecodeMoE), peer.model.moe_reference_reason
        assert nccl.model.decode_moe is None
        prompts = PROMPTS[rank]
        got, want = _prefill_logits(peer, prompts), _prefill_logits(nccl, prompts)
        # A forward in which only rank 0 has tokens: rank 1 joins with an empty batch.
        solo = prompts[:1] if rank == 0 else []
        solo_got, solo_want = _prefill_logits(peer, solo), _prefill_logits(nccl, solo)
        tokens_peer, tokens_nccl = _greedy(peer, prompts, JOIN_AT[rank]), _greedy(nccl, prompts, JOIN_AT[rank])
        report[name] = {
            "rel_err": _rel_err(got, want),
            "max_abs": (got.float() - want.float()).abs().max().item(),
            "solo_rel_err": _rel_err(solo_got, solo_want) if solo else 0.0,
            "solo_shapes": (tuple(solo_got.shape), tuple(solo_want.shape)),
            "tokens": (tokens_peer, tokens_nccl),
            "argmax_agree": (got.argmax(-1) == want.argmax(-1)).float().mean().item(),
        }
        report[name]["graph_max_abs"] = _graph_replays_match_eager(peer.model, rank)
    return report


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    from shared.model.quantize import quantize_checkpoint
    from shared.model.tiny import make_tiny

    root = tmp_path_factory.mktemp("decode_moe")
    plain = make_tiny(root / "bf16", **SHAPES)
    quantize_checkpoint(plain, root / "fp8", "fp8-block")
    quantize_checkpoint(plain, root / "mxfp8", "mxfp8")
    return {"bf16": str(plain), "fp8": str(root / "fp8"), "mxfp8": str(root / "mxfp8")}


# Per checkpoint: the logits' relative error bound, peer path against NCCL path, and whether greedy tokens
# must agree (MXFP8: the peer path alone quantizes activations, see the module doc)
AGREEMENT = {"bf16": (1e-2, True), "fp8": (1e-2, True), "mxfp8": (5e-2, False)}


def test_peer_decode_moe_matches_nccl_path(checkpoints):
    reports = run_local_group(_rank, 2, "nccl", checkpoints, timeout=200)
    for rank, report in enumerate(reports):
        for name, r in report.items():
            print(f"rank {rank} {name}: logits rel_err {r['rel_err']:.2e} max_abs {r['max_abs']:.3e} "
                  f"solo rel_err {r['solo_rel_err']:.2e} argmax agreement {r['argmax_agree']:.3f} "
                  f"graph max_abs {r['graph_max_abs']:.1e}")
            bound, same_tokens = AGREEMENT[name]
            assert r["rel_err"] <= bound and r["solo_rel_err"] <= bound, f"rank {rank} {name}: {r}"
            solo_rows = len(PROMPTS[0][0]) if rank == 0 else 0
            assert r["solo_shapes"] == ((solo_rows, SHAPES["vocab"]),) * 2
            tokens_peer, tokens_nccl = r["tokens"]
            assert tokens_peer == tokens_nccl or not same_tokens, f"rank {rank} {name}: greedy tokens differ"
            assert all(len(t) == NEW_TOKENS for t in tokens_peer)
