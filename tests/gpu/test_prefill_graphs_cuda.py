"""GPU: prefill forwards as piecewise CUDA-graph replays (`shared.model.prefill_graphs.PrefillGraphs`) against eager.

A tiny bf16 Qwen3-MoE with kernel shapes (hidden 128, 16 experts of intermediate 128, top-4:
the grouped-GEMM path) is loaded three times on one GPU, each with its own KV cache:
``graphed`` (pieces captured and replayed), ``padded`` (the same padded pieces run eagerly:
what the CPU tests check against the plain forward) and ``plain`` (the eager forward). They
run the same prefill batches: fresh prompts alone and together, chunks after cached
prefixes, a smaller batch in a bucket after a larger one, and one past the largest bucket.

Every replay must equal the eager padded pieces bit for bit (the same kernels on the same
shapes), and agree with the plain forward to bf16 rounding; the sequences' K/V must agree
with the plain runner's, padding must write the scratch page only, and each layer must be
reported done once, in order. With bf16 weights and with block-FP8 ones (the checkpoint
converted by `moebus quantize`).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPES = dict(layers=3, hidden=128, heads=4, kv_heads=2, head_dim=64, experts=16, top_k=4, moe_intermediate=128,
              vocab=512, tokenizer=False, dtype="float32", seed=5)
PAGE, PAGES, MAX_TOKENS = 4, 256, 64  # buckets 16, 32, 64
# Prompt lengths; each batch: (prompt index, cached prefix) per sequence.
LENGTHS = [11, 40, 9, 23, 30, 50, 26]
# Tokens and buckets: 40 (64), 20 (32), 33 (64), 9 (16), 76 (past 64: eager), 5 (16), 27 (32); each bucket's later
# batches are smaller than its first, so the rows of a batch before are padding now.
BATCHES = [[(1, 0)], [(0, 0), (2, 0)], [(3, 8), (4, 12)], [(2, 0)], [(5, 0), (6, 0)], [(0, 6)], [(1, 20), (3, 16)]]
PATHS = ["graph_capture", "graph_capture", "graph_replay", "graph_capture", "eager", "graph_replay", "graph_replay"]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="module", params=["bf16", "fp8-block"])
def checkpoint(request, tmp_path_factory) -> str:
    from shared.model.quantize import quantize_checkpoint
    from shared.model.tiny import make_tiny

    path = make_tiny(tmp_path_factory.mktemp("prefill_graphs"), **SHAPES)
    if request.param == "bf16":
        return str(path)
    out = tmp_path_factory.mktemp("prefill_graphs_fp8") / "model"
    quantize_checkpoint(path, out, request.param)
    return str(out)


def test_piece_replays_equal_eager_on_one_gpu(checkpoint):
    from shared.model.cuda_graphs import ForwardPath
    from shared.model.model import ForwardBatch, SequenceChunk
    from shared.model.runner import ModelRunner

    torch.cuda.set_device(0)
    common = dict(num_pages=PAGES, page_size=PAGE, dtype=torch.bfloat16, device="cuda:0")
    graphed, padded, plain = (ModelRunner.from_dir(checkpoint, **common) for _ in range(3))
    assert graphed.model.moe_reference_reason is None  # the grouped GEMM
    graphs = graphed.use_prefill_graphs(MAX_TOKENS)
    eager_pieces = padded.use_prefill_graphs(MAX_TOKENS, capture=False)
    assert graphs.buckets == [16, 32, 64]
    assert plain.cache.allocator.alloc(1) == [graphs.scratch_page] == [eager_pieces.scratch_page]
    runners = (graphed, padded, plain)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, SHAPES["vocab"], (n,), generator=g).tolist() for n in LENGTHS]
    tables = []
    for p in prompts:
        got = [r.cache.allocator.alloc(r.cache.layout.pages_for(len(p))) for r in runners]
        assert got[0] == got[1] == got[2]
        tables.append(got[0])
    layers = graphed.model.config.num_layers
    report = []
    for b, batch in enumerate(BATCHES):
        # The cached prefixes, written by the plain forward in all three runners.
        for r in runners:
            for idx, cached in batch:
                if cached:
                    r.model.forward(ForwardBatch.build([SequenceChunk(prompts[idx][:cached], 0, tables[idx])], PAGE, r.cache.device), r.cache)
        chunks = [SequenceChunk(prompts[idx][cached:], cached, tables[idx]) for idx, cached in batch]
        done: list[int] = []
        got = graphs.hidden_states(ForwardBatch.build(chunks, PAGE, graphed.cache.device), done.append)
        eager = eager_pieces.hidden_states(ForwardBatch.build(chunks, PAGE, padded.cache.device))
        want = plain.model.hidden_states(ForwardBatch.build(chunks, PAGE, plain.cache.device), plain.cache)
        report.append((b, sum(len(c.token_ids) for c in chunks), graphs.last_path.value, torch.equal(got, eager),
                       (got.float() - eager.float()).abs().max().item(), _rel_err(got, want), done))
    for b, tokens, path, equal, max_abs, rel, done in report:
        print(f"batch {b}: {tokens} tokens, {path}, replay==eager pieces {equal} (max_abs {max_abs:.2e}), rel_err vs plain {rel:.2e}")
    print(f"stats {graphs.stats()}")
    assert [r[2] for r in report] == PATHS
    assert all(r[3] for r in report), "a replay differs from the eager padded pieces"
    assert all(r[5] <= 2e-2 for r in report), "graphed hidden states far from the plain forward"
    assert all(r[6] == list(range(layers)) for r in report)
    assert graphs.counts[ForwardPath.REPLAY] == 3 and graphs.stats()["buckets"] == 3
    real = sorted(p for t in tables for p in t)
    assert _rel_err(graphed.cache.storage[:, real], plain.cache.storage[:, real]) <= 2e-2
    assert torch.equal(graphed.cache.storage[:, real], padded.cache.storage[:, real])
    others = [p for p in range(PAGES) if p not in real]
    written = (graphed.cache.storage[:, others] != 0).flatten(2).any(-1).any(0)
    assert [others[i] for i in written.nonzero().flatten().tolist()] == [graphs.scratch_page]
