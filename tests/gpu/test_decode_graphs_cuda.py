"""GPU: decode steps as CUDA-graph replays (`shared.model.cuda_graphs.DecodeGraphs`) against eager.

A tiny bf16 Qwen3-MoE with kernel shapes (hidden 128, 16 experts of intermediate 128,
top-4: the grouped-GEMM path) is loaded three times on a GPU, each with its own KV cache:
``graphed`` (graphs captured and replayed), ``padded`` (the same padded static-buffer
forward run eagerly: what the CPU tests check against the plain step) and ``plain``
(`ForwardBatch.build`, eager). They are fed the same tokens step by step (each prompt
token by token, then the plain runner's greedy choice), with sequences joining,
crossing page boundaries (page size 4) and leaving (pages freed and reused).

Every graph replay must equal the eager padded forward bit for bit, and both must
agree with the plain step to bf16 rounding; with bf16 weights and with block-FP8 ones (the
checkpoint converted by `moebus quantize`). Once on one GPU (ep 1), once as DP2 x EP2
on two GPUs with `PeerDecodeMoE`, where rank 1 has no sequences in the first steps
and after its sequence leaves: it replays the smallest bucket with padding only,
which its peer's all-to-all needs.
"""

from __future__ import annotations

import pytest
import torch

from kernels._local_group import run_local_group

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPES = dict(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=64, experts=16, top_k=4, moe_intermediate=128,
              vocab=512, tokenizer=False, dtype="float32", seed=3)
PAGE, PAGES, MAX_BATCH, STEPS = 4, 64, 6, 14
# (prompt, join step, steps alive) per sequence, by rank.
SCRIPTS = {
    0: [([5, 17, 300, 41, 9], 0, 14), ([8, 2, 250], 0, 5), ([400, 7, 19, 3, 88, 91], 2, 9), ([13, 240], 3, 4), ([60, 61, 62], 4, 10),
        ([1, 2, 3, 4], 5, 8)],
    1: [([13, 240, 6, 71], 3, 6)],  # rank 1: no sequences in steps 0-2 and 9-13
}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _drive(graphed, padded, plain, script) -> dict:
    """Run the script through the three runners (see the module doc); per-step comparisons."""
    from shared.model.cuda_graphs import ForwardPath
    from shared.model.model import ForwardBatch, SequenceChunk

    runners = (graphed, padded, plain)
    assert plain.cache.allocator.alloc(1) == [graphed.decode_graphs.scratch_page] == [padded.decode_graphs.scratch_page]
    seqs: dict[int, dict] = {}
    steps, paths, tables_seen = [], [], set()
    for step in range(STEPS):
        for i, (prompt, join, live) in enumerate(script):
            if join == step:
                seqs[i] = {"fed": [], "next": prompt[0], "prompt": prompt, "table": [], "left": live}
        for s in seqs.values():
            need = plain.cache.layout.pages_for(len(s["fed"]) + 1)
            if need > len(s["table"]):
                new = [r.cache.allocator.alloc(need - len(s["table"])) for r in runners]
                assert new[0] == new[1] == new[2]
                s["table"] += new[0]
        chunks = [SequenceChunk([s["next"]], len(s["fed"]), list(s["table"])) for s in seqs.values()]
        got = graphed.decode_graphs.forward(chunks)
        paths.append(graphed.decode_graphs.last_path.value)
        eager = padded.decode_graphs.forward(chunks)
        want = plain.model.forward(ForwardBatch.build(chunks, PAGE, plain.cache.device), plain.cache)
        steps.append({"rows": len(chunks), "equal": torch.equal(got, eager), "max_abs": (got.float() - eager.float()).abs().max().item() if chunks else 0.0,
                      "rel_err_plain": _rel_err(got, want) if chunks else 0.0,
                      "argmax_agree": (got.argmax(-1) == want.argmax(-1)).float().mean().item() if chunks else 1.0})
        tables_seen.update(p for c in chunks for p in c.page_table)
        for row, (i, s) in enumerate(list(seqs.items())):
            s["fed"].append(s["next"])
            n = len(s["fed"])
            s["next"] = s["prompt"][n] if n < len(s["prompt"]) else int(want[row].argmax())
            s["left"] -= 1
            if s["left"] == 0:
                for r in runners:
                    r.cache.allocator.free(list(s["table"]))
                del seqs[i]
    graphs = graphed.decode_graphs
    return {"steps": steps, "paths": paths, "stats": graphs.stats(), "pool_bytes": graphs.pool_bytes(),
            "buckets": sorted(graphs._graphs), "scratch_used": graphs.scratch_page in tables_seen,
            "replays": graphs.counts[ForwardPath.REPLAY]}


def _runners(path: str, device: str, **options):
    from shared.model.runner import ModelRunner

    common = dict(num_pages=PAGES, page_size=PAGE, dtype=torch.bfloat16, device=device, **options)
    graphed = ModelRunner.from_dir(path, max_tokens_per_rank=MAX_BATCH, **common)
    padded = ModelRunner.from_dir(path, max_tokens_per_rank=MAX_BATCH, **common)
    plain = ModelRunner.from_dir(path, **common)
    graphed.use_decode_graphs(MAX_BATCH, max_graphs=32)
    padded.use_decode_graphs(MAX_BATCH, max_graphs=32, capture=False)
    return graphed, padded, plain


def _check(report: dict, who: str) -> None:
    for i, s in enumerate(report["steps"]):
        print(f"{who} step {i}: rows {s['rows']} path {report['paths'][i]} replay==eager {s['equal']} (max_abs {s['max_abs']:.2e}) "
              f"rel_err vs plain {s['rel_err_plain']:.2e} argmax agree {s['argmax_agree']:.2f}")
    print(f"{who}: {report['stats']} buckets {report['buckets']} pool_bytes {report['pool_bytes']}")
    assert all(s["equal"] for s in report["steps"]), f"{who}: a graph replay differs from the eager padded forward"
    assert all(s["rel_err_plain"] <= 2e-2 for s in report["steps"]), f"{who}: graphed logits far from the plain step"
    assert report["stats"]["eager"] == 0 and report["replays"] >= 5 and report["stats"]["graphs"] == len(report["buckets"]) >= 2
    assert not report["scratch_used"]
    assert report["pool_bytes"] > 0


@pytest.fixture(scope="module", params=["bf16", "fp8-block"])
def checkpoint(request, tmp_path_factory) -> str:
    """The tiny checkpoint in bf16, and converted by `moebus quantize` to block FP8 (Qwen's FP8
    format: experts through the FP8 grouped GEMM, the other projections dequantized per call)."""
    from shared.model.quantize import quantize_checkpoint
    from shared.model.tiny import make_tiny

    path = make_tiny(tmp_path_factory.mktemp("decode_graphs"), **SHAPES)
    if request.param == "bf16":
        return str(path)
    out = tmp_path_factory.mktemp("decode_graphs_fp8") / "model"
    quantize_checkpoint(path, out, request.param)
    return str(out)


def test_graph_replays_equal_eager_on_one_gpu(checkpoint):
    torch.cuda.set_device(0)
    graphed, padded, plain = _runners(checkpoint, "cuda:0")
    assert graphed.model.decode_moe is None and graphed.model.moe_reference_reason is None  # grouped GEMM, ep 1
    report = _drive(graphed, padded, plain, SCRIPTS[0])
    _check(report, "1 GPU")
    assert any((b, p) in report["buckets"] for b in (4, 6) for p in (2, 4, 8))  # padded rows and page buckets > 1


def _rank(rank: int, world: int, checkpoint: str) -> dict:
    from shared.parallel import Topology
    from shared.parallel_cuda import CudaCollectives, PeerDecodeMoE

    topology = Topology.decode(world, rank)
    graphed, padded, plain = _runners(checkpoint, f"cuda:{rank}", topology=topology, comm=CudaCollectives(topology))
    assert isinstance(graphed.model.decode_moe, PeerDecodeMoE) and isinstance(padded.model.decode_moe, PeerDecodeMoE)
    assert plain.model.decode_moe is None  # the NCCL all-to-all reference
    return _drive(graphed, padded, plain, SCRIPTS[rank])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_graph_replays_equal_eager_in_dp2_ep2_with_an_idle_rank(checkpoint):
    reports = run_local_group(_rank, 2, "nccl", checkpoint, timeout=200)
    for rank, report in enumerate(reports):
        _check(report, f"DP2xEP2 rank {rank}")
    idle = [i for i, s in enumerate(reports[1]["steps"]) if s["rows"] == 0]
    assert idle and all(reports[1]["paths"][i] in ("graph_capture", "graph_replay") for i in idle)
