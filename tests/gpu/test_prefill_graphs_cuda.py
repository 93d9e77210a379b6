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

With two GPUs the same runs as a TP2 prefill group (one process per GPU, the peer-memory
all-reduce inside the pieces): each rank's replays must equal its eager padded pieces, and both
ranks must hold the same hidden states; one rank's capture of a bucket is made to fail, and both
must then run that bucket eagerly.
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


class _Events:
    """An `EventLog` that keeps the events (the errors here)."""

    def __init__(self) -> None:
        self.errors: list[tuple[str, dict]] = []

    def info(self, event: str, **fields: object) -> None:
        pass

    def warning(self, event: str, **fields: object) -> None:
        pass

    def error(self, event: str, **fields: object) -> None:
        self.errors.append((event, fields))


def _compare(checkpoint: str, device: str, topology=None, comm=None, failed_bucket: int | None = None, fail_here: bool = False) -> dict:  # type: ignore[no-untyped-def]
    """Run BATCHES through ``graphed``, ``padded`` and ``plain`` runners on ``device`` (as a rank of ``topology``
    when given) and check them. ``failed_bucket``: a bucket whose capture fails on some rank of the group (on this
    one with ``fail_here``), so that every rank must run it eagerly from then on. Returns what the caller compares
    across ranks: the graphed hidden states, the capture errors logged and the paths' counts."""
    from shared.model.model import ForwardBatch, SequenceChunk
    from shared.model.runner import ModelRunner
    from shared.parallel import Topology

    common = dict(num_pages=PAGES, page_size=PAGE, dtype=torch.bfloat16, device=device, topology=topology or Topology.single(), comm=comm)
    graphed, padded, plain = (ModelRunner.from_dir(checkpoint, **common) for _ in range(3))
    assert graphed.model.moe_reference_reason is None  # the grouped GEMM
    events = _Events()
    graphs = graphed.use_prefill_graphs(MAX_TOKENS, log=events)
    if fail_here:
        capture = graphs._capture

        def failing(rows: int):  # type: ignore[no-untyped-def]
            if rows == failed_bucket:
                raise RuntimeError(f"made to fail at bucket {rows}")
            return capture(rows)

        graphs._capture = failing  # type: ignore[method-assign]
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
    report, hidden = [], []
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
        hidden.append(got.cpu())
        report.append((b, sum(len(c.token_ids) for c in chunks), graphs.last_path.value, torch.equal(got, eager),
                       (got.float() - eager.float()).abs().max().item(), _rel_err(got, want), done))
    for b, tokens, path, equal, max_abs, rel, done in report:
        print(f"{device} batch {b}: {tokens} tokens, {path}, replay==eager pieces {equal} (max_abs {max_abs:.2e}), rel_err vs plain {rel:.2e}")
    print(f"{device} stats {graphs.stats()}")
    assert failed_bucket in (None, 32)
    paths = [("eager" if failed_bucket and b == 6 else p) for b, p in enumerate(PATHS)]  # batch 6: bucket 32's second use
    assert [r[2] for r in report] == paths
    assert all(r[3] for r in report), "a replay differs from the eager padded pieces"
    assert all(r[5] <= 2e-2 for r in report), "graphed hidden states far from the plain forward"
    assert all(r[6] == list(range(layers)) for r in report)
    real = sorted(p for t in tables for p in t)
    assert _rel_err(graphed.cache.storage[:, real], plain.cache.storage[:, real]) <= 2e-2
    assert torch.equal(graphed.cache.storage[:, real], padded.cache.storage[:, real])
    others = [p for p in range(PAGES) if p not in real]
    written = (graphed.cache.storage[:, others] != 0).flatten(2).any(-1).any(0)
    assert [others[i] for i in written.nonzero().flatten().tolist()] == [graphs.scratch_page]
    return {"hidden": hidden, "errors": events.errors, "stats": graphs.stats()}


def test_piece_replays_equal_eager_on_one_gpu(checkpoint):
    torch.cuda.set_device(0)
    result = _compare(checkpoint, "cuda:0")
    assert result["stats"] == {"graph_replay": 3, "graph_capture": 3, "eager": 1, "buckets": 3} and not result["errors"]


def _tp2_rank(rank: int, world: int, port: int, checkpoint: str) -> dict:
    import torch.distributed as dist

    from shared.parallel import Topology, init_distributed

    device = torch.device("cuda", rank)
    topology = Topology.prefill(world, rank)
    comm = init_distributed(topology, device, master_port=port)  # the peer-memory all-reduce (CudaCollectives)
    try:
        assert type(comm).__name__ == "CudaCollectives" and comm.all_reduce_in_graphs
        return _compare(checkpoint, f"cuda:{rank}", topology, comm, failed_bucket=32, fail_here=rank == 1)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_piece_replays_hold_the_all_reduces_and_the_ranks_agree_on_a_failed_capture(checkpoint):
    """A TP2 prefill group: its pieces capture the peer-memory all-reduces after o_proj and after the experts
    (the kernels' flags and epoch on the device, so replays go on), and every replay equals the eager padded
    pieces on each rank, both ranks holding the same residual stream. Rank 1's capture of bucket 32 is made to
    fail: both ranks then run that bucket eagerly (the eager forward all-reduces the real rows, the pieces the
    bucket's: a rank alone on either path would mismatch its peer's all-reduce), rank 0 saying why."""
    from kernels._local_group import spawn_ranks

    results = spawn_ranks(_tp2_rank, 2, checkpoint, timeout=600)
    for got0, got1 in zip(results[0]["hidden"], results[1]["hidden"]):
        assert torch.equal(got0, got1)
    assert results[0]["stats"] == results[1]["stats"] == {"graph_replay": 2, "graph_capture": 3, "eager": 2, "buckets": 2}, results
    (event0, fields0), = results[0]["errors"]
    (event1, fields1), = results[1]["errors"]
    assert event0 == event1 == "prefill_graph.capture_failed" and fields0["token_bucket"] == fields1["token_bucket"] == 32
    assert fields0["error"] == "failed on another rank of the group" and "made to fail at bucket 32" in fields1["error"], (fields0, fields1)
