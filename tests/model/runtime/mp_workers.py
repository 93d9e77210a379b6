"""Rank entry points for the multi-process tests (spawned, so they live in an importable module)."""

from __future__ import annotations

from pathlib import Path

import torch

from shared.model.model import ForwardBatch, SequenceChunk
from shared.model.runner import ModelRunner
from shared.model.sampling_params import SamplingParams
from shared.parallel import Topology, init_distributed

PAGE_SIZE = 4


def run_rank(rank: int, world: int, layout: str, port: int, model_dir: str, prompts: list[list[int]], join_at: list[int], max_tokens: list[int], out_dir: str, device_type: str = "cpu") -> None:
    """Prefill logits of this rank's prompts, then a greedy run in which sequence ``i``
    joins at step ``join_at[i]``; results saved to ``out_dir/rank<r>.pt``.

    ``prompts`` are this rank's own (decode layout) or the shared ones (prefill layout).
    With ``device_type="cuda"`` rank r runs on GPU r over NCCL, else on the CPU over gloo.
    """
    device = torch.device(f"cuda:{rank}") if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    topology = Topology.prefill(world, rank) if layout == "prefill" else Topology.decode(world, rank)
    comm = init_distributed(topology, device, master_port=port)
    try:
        runner = ModelRunner.from_dir(model_dir, num_pages=64, page_size=PAGE_SIZE, topology=topology, comm=comm, device=device)
        logits = _prefill_logits(runner, prompts)
        tokens = _greedy_run(runner, prompts, join_at, max_tokens)
        torch.save({"logits": logits.cpu(), "tokens": tokens}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def _prefill_logits(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    """All-position logits of every prompt in one batch (an empty batch on an idle rank)."""
    pages = runner.cache.allocator.alloc(sum(runner.cache.layout.pages_for(len(p)) for p in prompts))
    chunks, used = [], 0
    for p in prompts:
        n = runner.cache.layout.pages_for(len(p))
        chunks.append(SequenceChunk(p, 0, pages[used : used + n]))
        used += n
    batch = ForwardBatch.build(chunks, PAGE_SIZE, runner.cache.device)
    logits = runner.model.forward(batch, runner.cache, all_logits=True)
    runner.cache.allocator.free(pages)
    return logits


def _greedy_run(runner: ModelRunner, prompts: list[list[int]], join_at: list[int], max_tokens: list[int]) -> list[list[int]]:
    """Lockstep loop: every rank runs the same number of steps, idle or not."""
    seqs = [None] * len(prompts)
    total_steps = max([j + m for j, m in zip(join_at, max_tokens)], default=0)
    common_steps = 48  # >= total_steps on every rank of the test
    assert total_steps <= common_steps
    for step in range(common_steps):
        joining = [i for i, j in enumerate(join_at) if j == step]
        for i in joining:
            seqs[i] = runner.add(str(i), prompts[i], SamplingParams(temperature=0.0, max_tokens=max_tokens[i]))
        batch = [s for s in seqs if s is not None and not s.finished]
        runner.step(batch)
    return [s.output_ids for s in seqs]


def prefill_pieces_rank(rank: int, world: int, model_dir: str, prompts: list[list[int]]) -> dict:
    """A prefill-layout rank (already in a gloo group): how `all_agree` answers (True everywhere; True on rank 0
    only; False everywhere), then the same batches through the padded pieces of `PrefillGraphs` (``capture=False``,
    the all-reduces over the padded rows) and through the plain forward of a second runner."""
    from shared.model.prefill_graphs import PrefillGraphs
    from shared.parallel import TorchCollectives

    topology = Topology.prefill(world, rank)
    comm = TorchCollectives(topology)
    agreed = [comm.all_agree(ok) for ok in (True, rank == 0, False)]
    padded, plain = (ModelRunner.from_dir(model_dir, num_pages=40, page_size=PAGE_SIZE, topology=topology, comm=comm) for _ in range(2))
    graphs = PrefillGraphs(padded.model, padded.cache, max_tokens=32, capture=False)
    assert plain.cache.allocator.alloc(1) == [graphs.scratch_page]  # the allocators in step
    tables = [padded.cache.allocator.alloc(padded.cache.layout.pages_for(len(p))) for p in prompts]
    assert [plain.cache.allocator.alloc(plain.cache.layout.pages_for(len(p))) for p in prompts] == tables
    got, want, paths = [], [], []
    for batch in ([0, 1], [2], [0, 1, 2]):  # buckets 16 (a replay next), 32, and past 32: eager
        chunks = [SequenceChunk(prompts[i], 0, tables[i]) for i in batch]
        got.append(graphs.hidden_states(ForwardBatch.build(chunks, PAGE_SIZE, padded.cache.device)))
        paths.append(graphs.last_path.value if graphs.last_path is not None else None)
        want.append(plain.model.hidden_states(ForwardBatch.build(chunks, PAGE_SIZE, plain.cache.device), plain.cache))
    return {"agreed": agreed, "got": got, "want": want, "paths": paths}
