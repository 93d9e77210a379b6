"""The padded piecewise prefill forward of `shared.model.prefill_graphs.PrefillGraphs`, on the CPU.

``capture=False`` runs exactly the pieces a CUDA graph would capture (same static buffers,
same token-bucket padding, same scratch page, attention eager between them) eagerly, so
the padding logic is checked here in fp32 against the plain forward: fresh prompts, several
prompts in one batch, chunks after cached prefixes, batches in two buckets and one past the
largest. tests/gpu/test_prefill_graphs_cuda.py checks graph replays against this path on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import random_prompts, rel_err

from shared.model import model as model_module
from shared.model.cuda_graphs import ForwardPath
from shared.model.model import ForwardBatch, SequenceChunk
from shared.model.prefill_graphs import PrefillGraphs, prefill_token_buckets
from shared.model.runner import ModelRunner
from shared.model.sampling_params import SamplingParams

NAME = "gqa2_top2_nonorm_sharded"  # MoE: padded rows must reach no expert
PAGE = 4


def test_token_buckets_are_fine_above_256_and_end_at_the_limit():
    assert prefill_token_buckets(2048) == [16, 32, 64, 128, 256, *range(512, 2049, 256)]
    assert prefill_token_buckets(300) == [16, 32, 64, 128, 256, 300]
    assert prefill_token_buckets(600) == [16, 32, 64, 128, 256, 512, 600]
    assert prefill_token_buckets(40) == [16, 32, 40]
    assert prefill_token_buckets(10) == [10]
    with pytest.raises(ValueError):
        prefill_token_buckets(0)


def _runner(path, num_pages: int = 40) -> ModelRunner:
    return ModelRunner.from_dir(path, num_pages=num_pages, page_size=PAGE)


def test_padded_pieces_match_the_plain_forward(tiny_checkpoint):
    """Two runners on one checkpoint fed the same batches: one through the padded pieces, one
    through the plain forward. Hidden states agree to fp32 rounding (a CPU GEMM's rounding depends
    on its row count), the sequences' K/V likewise, padding writes the scratch page only, and each
    layer is reported done once, in order."""
    path = tiny_checkpoint(NAME)
    padded, plain = _runner(path), _runner(path)
    layers = padded.model.config.num_layers
    prompts = random_prompts([7, 5, 9, 12, 20, 6, 30], seed=4)

    def tables(n: int) -> list[int]:
        got = [r.cache.allocator.alloc(r.cache.layout.pages_for(n)) for r in (padded, plain)]
        assert got[0] == got[1]
        return got[0]

    t = [tables(len(prompts[0]))]  # page 0 is a sequence's: a padded field left at zero would name it
    graphs = PrefillGraphs(padded.model, padded.cache, max_tokens=32, capture=False)
    assert graphs.buckets == [16, 32]
    assert plain.cache.allocator.alloc(1) == [graphs.scratch_page] and graphs.scratch_page not in t[0]  # the allocators in step
    t += [tables(len(p)) for p in prompts[1:]]
    batches = [
        [SequenceChunk(prompts[1], 0, t[1]), SequenceChunk(prompts[2], 0, t[2])],  # two prompts, 14 tokens: bucket 16
        [SequenceChunk(prompts[0], 0, t[0])],  # one fresh prompt: rows 7-13 were real rows of the batch before
        [SequenceChunk(prompts[3][5:], 5, t[3]), SequenceChunk(prompts[4][8:], 8, t[4])],  # after cached prefixes: 19 tokens, bucket 32
        [SequenceChunk(prompts[5], 0, t[5]), SequenceChunk(prompts[6], 0, t[6])],  # 36 tokens: past the largest bucket, eager
    ]
    # The cached prefixes of batch 3, written by plain forwards in both runners.
    for r in (padded, plain):
        for i, n in ((3, 5), (4, 8)):
            r.model.forward(ForwardBatch.build([SequenceChunk(prompts[i][:n], 0, t[i])], PAGE, r.cache.device), r.cache)
    paths = []
    for chunks in batches:
        done: list[int] = []
        got = graphs.hidden_states(ForwardBatch.build(chunks, PAGE, padded.cache.device), done.append)
        paths.append(graphs.last_path)
        want = plain.model.hidden_states(ForwardBatch.build(chunks, PAGE, plain.cache.device), plain.cache)
        assert got.shape == want.shape == (sum(len(c.token_ids) for c in chunks), padded.model.config.hidden_size)
        assert rel_err(got, want) <= 1e-5, f"{len(chunks)} chunks: {rel_err(got, want):.2e}"
        assert done == list(range(layers))
    assert paths == [ForwardPath.CAPTURE, ForwardPath.REPLAY, ForwardPath.CAPTURE, ForwardPath.EAGER]
    assert graphs.stats() == {"graph_replay": 1, "graph_capture": 2, "eager": 1, "buckets": 0}
    real = sorted(p for table in t for p in table)
    assert graphs.scratch_page not in real
    assert rel_err(padded.cache.storage[:, real], plain.cache.storage[:, real]) <= 1e-5
    others = [p for p in range(padded.cache.layout.num_pages) if p not in real]
    written = (padded.cache.storage[:, others] != 0).flatten(2).any(-1).any(0)
    assert [others[i] for i in written.nonzero().flatten().tolist()] == [graphs.scratch_page]


def test_padded_rows_reach_no_expert(tiny_checkpoint, monkeypatch):
    """The experts see the real rows' routes only: every padded row's routing ids are -1 (no expert's)."""
    runner = _runner(tiny_checkpoint(NAME))
    graphs = PrefillGraphs(runner.model, runner.cache, max_tokens=16, capture=False)
    seen: list[torch.Tensor] = []
    real_moe = model_module.ops.moe_experts

    def recording(x, w13, w2, topk_ids, topk_weights, expert_start):
        seen.append(topk_ids.clone())
        return real_moe(x, w13, w2, topk_ids, topk_weights, expert_start)

    monkeypatch.setattr(model_module.ops, "moe_experts", recording)
    table = runner.cache.allocator.alloc(2)
    graphs.hidden_states(ForwardBatch.build([SequenceChunk([3, 1, 4, 1, 5], 0, table)], PAGE, runner.cache.device))
    assert len(seen) == runner.model.config.num_layers
    for ids in seen:
        assert ids.shape[0] == 16
        assert (ids[:5] >= 0).all() and (ids[5:] == -1).all()


def test_runner_with_prefill_graphs_samples_the_same_tokens_and_prompt_logprobs(tiny_checkpoint):
    """ModelRunner.prefill through the padded pieces vs the plain forward: seeded sampling gives the
    same first tokens; logprobs and prompt logprobs agree to fp32 rounding; the scratch page stays taken."""
    path = tiny_checkpoint(NAME)
    results = []
    for graphed in (True, False):
        runner = _runner(path, num_pages=30)
        if graphed:
            runner.use_prefill_graphs(max_tokens=64, capture=False)
            assert runner.usable_pages == runner.cache.allocator.num_free == runner.cache.layout.num_pages - 1
        params = [SamplingParams(temperature=0.8, seed=3 + i, max_tokens=4, logprobs=True, prompt_logprobs=p) for i, p in enumerate((2, -1, 0))]
        seqs = [runner.add(str(i), p, params[i]) for i, p in enumerate(random_prompts([9, 14, 6], seed=8))]
        outputs = runner.prefill(seqs)
        if graphed:
            assert runner.prefill_graphs.last_path is ForwardPath.CAPTURE
        results.append(([o.token_id for o in outputs], torch.tensor([o.logprob for o in outputs]),
                        [o.prompt_logprobs for o in outputs]))
    (ids, logprobs, prompts), (want_ids, want_logprobs, want_prompts) = results
    assert ids == want_ids
    assert torch.allclose(logprobs, want_logprobs, rtol=0, atol=1e-5)
    assert prompts[1] is None and want_prompts[1] is None
    for got, want in ((prompts[0], want_prompts[0]), (prompts[2], want_prompts[2])):
        assert got.first == want.first == 1 and len(got.logprobs) == len(want.logprobs) > 0
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), rtol=0, atol=1e-5)
    assert [t.token_ids for t in prompts[0].top] == [t.token_ids for t in want_prompts[0].top]


def test_tp2_padded_pieces_match_the_plain_tp2_forward(tiny_checkpoint):
    """Two prefill-layout ranks over gloo: the padded pieces all-reduce the bucket's rows (padding included)
    after o_proj and after the experts, and give each rank the plain TP2 forward's hidden states; the
    ranks' `all_agree` (how they agree on a bucket's capture) says False as soon as one rank does."""
    from kernels._local_group import run_local_group
    from mp_workers import prefill_pieces_rank

    prompts = random_prompts([6, 5, 29], seed=12)  # batches of 11, 29 and 40 tokens: buckets 16 and 32, then eager
    results = run_local_group(prefill_pieces_rank, 2, "gloo", str(tiny_checkpoint(NAME)), prompts, timeout=240)
    for rank, res in enumerate(results):
        assert res["agreed"] == [True, False, False], (rank, res["agreed"])
        assert res["paths"] == ["graph_capture", "graph_capture", "eager"], (rank, res["paths"])
        for got, want in zip(res["got"], res["want"]):
            assert got.shape == want.shape
            assert rel_err(got, want) <= 1e-5, (rank, rel_err(got, want))
    for got0, got1 in zip(results[0]["got"], results[1]["got"]):
        assert torch.equal(got0, got1)  # the ranks' residual streams are replicated


def test_prefill_graphs_need_the_kernel_path_on_cuda(tiny_checkpoint):
    runner = _runner(tiny_checkpoint(NAME))
    with pytest.raises(ValueError, match="prefill CUDA graphs unavailable: .*cpu"):
        runner.use_prefill_graphs(max_tokens=64)
    assert runner.prefill_graphs is None and runner.cache.allocator.num_free == runner.cache.layout.num_pages
