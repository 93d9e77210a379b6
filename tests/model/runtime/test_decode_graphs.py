"""The padded static-buffer decode step of `shared.model.cuda_graphs.DecodeGraphs`, on the CPU.

``capture=False`` runs exactly the forward a CUDA graph would capture (same static
buffers, same bucket padding, same scratch page) eagerly, so the padding logic is
checked here in fp32 against the plain step over the same rows bit for bit, and over
the real rows only to fp32 rounding: padded batch rows, page-table padding to a
page bucket, sequences crossing a page boundary,
finished sequences freeing pages that new ones reuse, and the scratch page staying
out of every sequence's hands. tests/gpu/test_decode_graphs_cuda.py checks graph replays
against this path on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import random_prompts, rel_err

from shared.model.cuda_graphs import DecodeGraphs, ForwardPath, graphs_unsupported, powers_of_two_up_to, smallest_bucket
from shared.model.model import ForwardBatch, SequenceChunk
from shared.model.runner import ModelRunner
from shared.model.sampling_params import SamplingParams

NAME = "gqa2_top2_nonorm_sharded"  # MoE: padded rows are routed and computed too
PAGE = 4


def test_buckets_are_powers_of_two_capped_by_the_limit():
    assert powers_of_two_up_to(1) == [1]
    assert powers_of_two_up_to(3) == [1, 2, 3]
    assert powers_of_two_up_to(32) == [1, 2, 4, 8, 16, 32]
    assert powers_of_two_up_to(40) == [1, 2, 4, 8, 16, 32, 40]
    assert [smallest_bucket([1, 2, 4, 6], n) for n in (1, 3, 5, 6, 7)] == [1, 4, 6, 6, None]
    with pytest.raises(ValueError):
        powers_of_two_up_to(0)


def _runner(path, num_pages: int = 24) -> ModelRunner:
    return ModelRunner.from_dir(path, num_pages=num_pages, page_size=PAGE)


def test_padded_forward_matches_the_plain_step(tiny_checkpoint):
    """Three runners on one checkpoint, fed the same tokens: one through the padded buffers
    (``padded``); one through `ForwardBatch.build` over the same rows, the padding rows
    written out as sequences on its own scratch page (``rows``: bit for bit, page-table
    padding included, as the rows of a CPU GEMM depend on how many there are); one over
    the real sequences only (``plain``: equal up to that fp32 rounding, same argmax)."""
    path = tiny_checkpoint(NAME)
    padded, rows, plain = _runner(path), _runner(path), _runner(path)
    graphs = DecodeGraphs(padded.model, padded.cache, max_batch=6, max_graphs=64, capture=False)
    for r in (rows, plain):  # keep the allocators in step: the scratch page is the first page
        assert r.cache.allocator.alloc(1) == [graphs.scratch_page]
    prompts = random_prompts([3, 7, 1, 5, 2], seed=11)
    # Sequence i joins at step join[i] and leaves after live[i] steps (its pages freed, reused later).
    join, live = [0, 0, 1, 3, 4], [9, 2, 6, 4, 5]
    runners = (padded, rows, plain)
    seqs: dict[int, dict] = {}
    buckets, seen_pages = set(), set()
    exact_steps = 0
    for step in range(10):
        for i, j in enumerate(join):
            if j == step:
                prompt = prompts[i]
                tables = [r.cache.allocator.alloc(r.cache.layout.pages_for(len(prompt))) for r in runners]
                assert tables[0] == tables[1] == tables[2]
                for r in runners:  # prefill unpadded in all three: the same K/V
                    r.model.forward(ForwardBatch.build([SequenceChunk(prompt, 0, tables[0])], PAGE, r.cache.device), r.cache)
                seqs[i] = {"tokens": list(prompt), "table": tables[0], "left": live[i]}
        for s in seqs.values():  # a page for the token fed now when it crosses into a new one
            need = padded.cache.layout.pages_for(len(s["tokens"]))
            if need > len(s["table"]):
                new = [r.cache.allocator.alloc(need - len(s["table"])) for r in runners]
                assert new[0] == new[1] == new[2]
                s["table"] += new[0]
        # The last token of each sequence is fed (its K/V not yet cached).
        chunks = [SequenceChunk([s["tokens"][-1]], len(s["tokens"]) - 1, list(s["table"])) for s in seqs.values()]
        got = graphs.forward(chunks)
        bucket = smallest_bucket(graphs.batch_buckets, len(chunks))
        padding = [SequenceChunk([0], 0, [graphs.scratch_page])] * (bucket - len(chunks))
        exact = rows.model.forward(ForwardBatch.build(chunks + padding, PAGE, rows.cache.device), rows.cache)[: len(chunks)]
        close = plain.model.forward(ForwardBatch.build(chunks, PAGE, plain.cache.device), plain.cache)
        assert got.shape == close.shape == (len(chunks), padded.model.config.vocab_size)
        # Bit for bit on the CI machines so far; on one AVX-512/AMX Xeon (2026-11-30, same torch wheel, older
        # commits too) a row came out 2.4e-6 apart at step 6, the CPU kernels' rounding depending on more than
        # the shapes there (not pinned down). Padding that leaked into real rows would be far beyond that.
        assert torch.equal(got, exact) or (rel_err(got, exact) <= 1e-6 and torch.equal(got.argmax(-1), exact.argmax(-1))), (
            f"step {step}: max diff {(got - exact).abs().max().item():.3e}")
        if chunks:  # (a step with no sequences, as an idle rank of a DP x EP group runs, has no rows)
            assert rel_err(got, close) <= 1e-5 and torch.equal(got.argmax(-1), close.argmax(-1)), f"step {step}"
            exact_steps += torch.equal(got, close)
        assert graphs.last_path in (ForwardPath.CAPTURE, ForwardPath.REPLAY)
        buckets.add(len(chunks))
        seen_pages.update(p for c in chunks for p in c.page_table)
        for i, s in list(seqs.items()):
            s["tokens"].append(int(got[list(seqs).index(i)].argmax()))
            s["left"] -= 1
            if s["left"] == 0:
                for r in runners:
                    r.cache.allocator.free(list(s["table"]))
                del seqs[i]
    assert graphs.scratch_page not in seen_pages
    # The sequences' K/V is the same in both bucket-shaped runs (padding wrote to the scratch page only).
    real = sorted(seen_pages)
    kv_padded, kv_rows = padded.cache.storage[:, real], rows.cache.storage[:, real]
    assert torch.equal(kv_padded, kv_rows) or rel_err(kv_padded, kv_rows) <= 1e-6  # (the rounding above)
    assert graphs.counts[ForwardPath.CAPTURE] >= 3 and graphs.counts[ForwardPath.REPLAY] >= 3, graphs.stats()
    assert graphs.counts[ForwardPath.EAGER] == 0
    assert {0, 3, 4} <= buckets  # 0: padding only; 3: one padded row in the bucket of 4
    assert {k[1] for k in graphs._graphs} >= {2, 4}, graphs._graphs  # page-table padding to page buckets
    assert exact_steps >= 1  # a full bucket is bit for bit the plain step


def test_an_empty_step_runs_the_smallest_bucket_and_returns_no_rows(tiny_checkpoint):
    runner = _runner(tiny_checkpoint(NAME))
    graphs = runner.use_decode_graphs(max_batch=4, max_graphs=8, capture=False)
    before = runner.cache.storage.clone()
    logits = graphs.forward([])
    assert logits.shape == (0, runner.model.config.vocab_size)
    assert graphs.last_path is ForwardPath.CAPTURE and (1, 1) in graphs._graphs
    changed = (runner.cache.storage != before).flatten(2).any(-1)  # [layers, pages]
    assert changed.any() and set(changed.nonzero()[:, 1].tolist()) == {graphs.scratch_page}


def test_runner_with_padded_steps_samples_the_same_tokens_and_logprobs(tiny_checkpoint):
    """ModelRunner.decode through the padded path vs the plain one: seeded sampling at
    temperature 0.8 gives the same tokens, logprobs and top-logprob alternatives (5 / none /
    20 per sequence, one sequence penalised) agree to fp32 rounding; pages come back."""
    path = tiny_checkpoint(NAME)
    outputs = []
    for graphed in (True, False):
        runner = _runner(path, num_pages=20)
        graphs = runner.use_decode_graphs(max_batch=4, max_graphs=64, capture=False) if graphed else None
        free_at_start = runner.cache.allocator.num_free
        params = [SamplingParams(temperature=0.8, seed=7 + i, max_tokens=n, logprobs=True, top_logprobs=k, presence_penalty=penalty)
                  for i, (n, k, penalty) in enumerate([(9, 5, 0.0), (3, 0, 0.0), (6, 20, 1.5)])]
        seqs = [runner.add(str(i), p, params[i]) for i, p in enumerate(random_prompts([6, 3, 8], seed=5))]
        steps = [runner.prefill(seqs)]
        while running := [s for s in seqs if not s.finished]:
            steps.append(runner.decode(running))
            if graphs is not None:
                assert all(graphs.scratch_page not in s.page_table for s in seqs)
        assert runner.cache.allocator.num_free == free_at_start
        tops = {s.seq_id: [o.top_logprobs for step in steps for o in step if o.seq_id == s.seq_id] for s in seqs}
        outputs.append(([s.output_ids for s in seqs], torch.tensor([lp for s in seqs for lp in s.logprobs]), tops))
        if graphs is not None:
            assert graphs.counts[ForwardPath.EAGER] == 0 and graphs.counts[ForwardPath.REPLAY] > 0, graphs.stats()
            assert runner.cache.allocator.num_free == runner.usable_pages == runner.cache.layout.num_pages - 1  # the scratch page stays taken
    (ids, logprobs, tops), (want_ids, want_logprobs, want_tops) = outputs
    assert ids == want_ids and [len(t) for t in ids] == [9, 3, 6]
    assert torch.allclose(logprobs, want_logprobs, rtol=0, atol=1e-5), (logprobs - want_logprobs).abs().max()
    assert tops["1"] == want_tops["1"] == [None] * 3
    for seq_id, k in (("0", 5), ("2", 20)):
        assert [t.token_ids for t in tops[seq_id]] == [t.token_ids for t in want_tops[seq_id]]
        got, want = (torch.tensor([t.logprobs for t in x[seq_id]]) for x in (tops, want_tops))
        assert got.shape == (len(ids[int(seq_id)]), k) and torch.allclose(got, want, rtol=0, atol=1e-5)
        assert torch.all(got[:, :-1] >= got[:, 1:])  # most likely first
    # A chosen token that ranks among the alternatives has the same logprob there.
    per_seq = torch.split(logprobs, [len(t) for t in ids])
    ranked = [(lp, top.logprobs[top.token_ids.index(t)]) for s in range(3)
              for t, lp, top in zip(ids[s], per_seq[s].tolist(), tops[str(s)], strict=True) if top and t in top.token_ids]
    assert ranked and all(abs(a - b) < 1e-5 for a, b in ranked)


def test_steps_beyond_the_buckets_or_the_graph_bound_run_eagerly(tiny_checkpoint):
    path = tiny_checkpoint(NAME)
    runner, plain = _runner(path), _runner(path)
    graphs = runner.use_decode_graphs(max_batch=2, max_graphs=2, capture=False)
    plain.cache.allocator.alloc(1)
    tables = [runner.cache.allocator.alloc(2) for _ in range(3)]
    for t in tables:
        assert plain.cache.allocator.alloc(2) == t

    def step(n: int, start: int) -> None:
        chunks = [SequenceChunk([10 + i], start, tables[i]) for i in range(n)]
        got = graphs.forward(chunks)
        want = plain.model.forward(ForwardBatch.build(chunks, PAGE, plain.cache.device), plain.cache)
        assert torch.equal(got, want)

    step(3, 0)  # 3 sequences > max_batch 2
    assert graphs.last_path is ForwardPath.EAGER
    step(1, 0)  # bucket (1, 1)
    step(2, 5)  # bucket (2, 2)
    step(1, 5)  # (1, 2): a third bucket, past max_graphs=2
    assert graphs.last_path is ForwardPath.EAGER
    step(2, 6)  # (2, 2) again
    assert graphs.last_path is ForwardPath.REPLAY
    assert graphs.stats() == {"graph_replay": 1, "graph_capture": 2, "eager": 2, "graphs": 0}


def test_graphs_need_the_kernel_path_on_cuda(tiny_checkpoint):
    runner = _runner(tiny_checkpoint(NAME))
    assert "cpu" in graphs_unsupported(runner.model)
    with pytest.raises(ValueError, match="CUDA graphs unavailable"):
        runner.use_decode_graphs(max_batch=4, max_graphs=4)
    assert runner.decode_graphs is None and runner.cache.allocator.num_free == runner.cache.layout.num_pages
