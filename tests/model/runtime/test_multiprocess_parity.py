"""Sharded parity in real multi-process gloo runs: TP=2, TP=4 (prefill layout, with
num_kv_heads=2 < TP=4 so KV heads are replicated) and DP=2 x EP=2 (decode layout)
give the same logits (fp32, <= 1e-4) and greedy tokens as one process."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from mp_workers import run_rank
from runtime_helpers import GPU, random_prompts, rel_err

from services.ranks import free_port
from shared.model.runner import ModelRunner

pytestmark = pytest.mark.slow

SHARDED = dict(layers=3, heads=8, kv_heads=2, experts=8, top_k=2, norm_topk_prob=True, mlp_only_layers=[1], intermediate=128)
PROMPTS = random_prompts([6, 9, 3], seed=11)
JOIN_AT = [0, 0, 5]
MAX_TOKENS = [20, 8, 20]


@pytest.fixture(scope="module")
def sharded_model(tiny_checkpoint):
    return tiny_checkpoint("sharded", **SHARDED)


@pytest.fixture(scope="module")
def single_process(sharded_model):
    """Reference: the same prompts, joins and limits in one process."""
    from mp_workers import _greedy_run, _prefill_logits

    runner = ModelRunner.from_dir(sharded_model, num_pages=64, page_size=4)
    logits = _prefill_logits(runner, PROMPTS)
    per_prompt = list(torch.split(logits, [len(p) for p in PROMPTS]))
    return per_prompt, _greedy_run(runner, PROMPTS, JOIN_AT, MAX_TOKENS)


def spawn(world: int, layout: str, model_dir, per_rank_args, tmp_path, device_type: str = "cpu") -> list[dict]:
    """Run `run_rank` in ``world`` spawned processes and collect what each saved."""
    port = free_port()

    def args(r):
        prompts, join_at, max_tokens = per_rank_args(r)
        return (r, world, layout, port, str(model_dir), prompts, join_at, max_tokens, str(tmp_path), device_type)

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=run_rank, args=args(r)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0] * world, f"rank exit codes {codes}"
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


TWO_GPUS = [*GPU, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


@pytest.mark.parametrize(("tp", "device_type"), [(2, "cpu"), (4, "cpu"), pytest.param(2, "cuda", marks=TWO_GPUS)])
def test_tensor_parallel_prefill_layout_matches_one_process(sharded_model, single_process, tmp_path, tp, device_type):
    ref_logits, ref_tokens = single_process
    results = spawn(tp, "prefill", sharded_model, lambda r: (PROMPTS, JOIN_AT, MAX_TOKENS), tmp_path, device_type)
    ref = torch.cat(ref_logits)
    for res in results:
        assert rel_err(res["logits"], ref) <= 1e-4
        assert res["tokens"] == ref_tokens


@pytest.mark.parametrize("device_type", ["cpu", pytest.param("cuda", marks=TWO_GPUS)])
def test_dp2_ep2_decode_layout_matches_one_process(sharded_model, single_process, tmp_path, device_type):
    """Rank 0 owns prompts 0 and 1; rank 1 owns prompt 2, which joins at step 5: until then
    rank 1 steps with zero tokens, and after prompt 1 finishes rank 0 steps with fewer."""
    ref_logits, ref_tokens = single_process
    owned = {0: [0, 1], 1: [2]}

    def per_rank(r):
        ids = owned[r]
        return [PROMPTS[i] for i in ids], [JOIN_AT[i] for i in ids], [MAX_TOKENS[i] for i in ids]

    results = spawn(2, "decode", sharded_model, per_rank, tmp_path, device_type)
    for r, res in enumerate(results):
        ids = owned[r]
        assert rel_err(res["logits"], torch.cat([ref_logits[i] for i in ids])) <= 1e-4
        assert res["tokens"] == [ref_tokens[i] for i in ids]
