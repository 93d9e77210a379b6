"""ModelRunner and forward-pass behaviour the services rely on (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import random_prompts, rel_err

from shared.kvcache import OutOfPages
from shared.model.model import ForwardBatch, SequenceChunk
from shared.model.runner import ModelRunner
from shared.model.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
NAME = "gqa2_top2_nonorm_sharded"


def test_on_layer_done_runs_in_order_after_that_layers_kv_is_written(tiny_checkpoint):
    runner = ModelRunner.from_dir(tiny_checkpoint(NAME), num_pages=8, page_size=4)
    prompt = random_prompts([6])[0]
    seen: list[tuple[int, list[bool]]] = []

    def written() -> list[bool]:  # page 0 of each layer holds K of token 0 once that layer ran
        return [bool(pool[0, 0].abs().sum() > 0) for pool in runner.cache.pools]

    s = runner.add("a", prompt, GREEDY)
    runner.prefill([s], on_layer_done=lambda i: seen.append((i, written())))
    layers = runner.model.config.num_layers
    assert [i for i, _ in seen] == list(range(layers))
    for i, flags in seen:
        assert flags == [j <= i for j in range(layers)]


def test_chunked_prefill_and_multi_token_steps_match_one_shot_prefill(tiny_checkpoint):
    runner = ModelRunner.from_dir(tiny_checkpoint(NAME), num_pages=16, page_size=4)
    prompt = random_prompts([13], seed=4)[0]
    model, cache = runner.model, runner.cache
    whole = model.forward(ForwardBatch.build([SequenceChunk(prompt, 0, [0, 1, 2, 3])], 4, cache.device), cache, all_logits=True)
    table = [9, 4, 12, 7]
    first = model.forward(ForwardBatch.build([SequenceChunk(prompt[:5], 0, table)], 4, cache.device), cache, all_logits=True)
    rest = model.forward(ForwardBatch.build([SequenceChunk(prompt[5:], 5, table)], 4, cache.device), cache, all_logits=True)
    assert rel_err(torch.cat([first, rest]), whole) <= 1e-5


def test_out_of_pages_is_typed_and_allocates_nothing(tiny_checkpoint):
    runner = ModelRunner.from_dir(tiny_checkpoint(NAME), num_pages=4, page_size=4)
    small, big = (runner.add(k, p, GREEDY) for k, p in zip("ab", random_prompts([3, 30])))
    with pytest.raises(OutOfPages) as info:
        runner.prefill([small, big])
    assert info.value.requested == 1 + 8 and runner.cache.allocator.num_free == 4
    assert small.page_table == [] and small.num_cached == 0
    runner.prefill([small])  # the batch without the big one still fits
    assert len(small.output_ids) == 1


def test_decode_rank_adopts_kv_that_arrived_from_elsewhere(tiny_checkpoint):
    """What a decode rank does after a KV transfer: pages it reserved, filled from another
    cache, plus the first token sampled by prefill; decoding continues identically."""
    path = tiny_checkpoint(NAME)
    prefill_rank = ModelRunner.from_dir(path, num_pages=16, page_size=4)
    decode_rank = ModelRunner.from_dir(path, num_pages=16, page_size=4)
    prompt = random_prompts([10], seed=9)[0]
    params = SamplingParams(temperature=0.0, max_tokens=10)

    reference = prefill_rank.add("ref", prompt, params)
    prefill_rank.prefill([reference])
    while not reference.finished:
        prefill_rank.decode([reference])

    sender = ModelRunner.from_dir(path, num_pages=16, page_size=4, release_finished=False)
    s = sender.add("x", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    sender.prefill([s])
    assert s.finish_reason == "length" and s.page_table  # pages kept until the transfer is done
    reserved = decode_rank.cache.allocator.alloc(len(s.page_table))[::-1]
    for src_pool, dst_pool in zip(sender.cache.pools, decode_rank.cache.pools):
        dst_pool[reserved] = src_pool[s.page_table]
    sender.release(s)
    assert sender.cache.allocator.num_free == 16

    adopted = decode_rank.add("x", prompt, params, page_table=reserved, num_cached=len(prompt), output_ids=s.output_ids)
    while not adopted.finished:
        decode_rank.decode([adopted])
    assert adopted.output_ids == reference.output_ids


@pytest.mark.parametrize(("prompt", "match"), [([], "empty prompt"), ([5, 10**6], "outside the vocabulary")])
def test_bad_prompts_are_rejected(tiny_checkpoint, prompt, match):
    runner = ModelRunner.from_dir(tiny_checkpoint(NAME), num_pages=4, page_size=4)
    with pytest.raises(ValueError, match=match):
        runner.add("a", prompt, GREEDY)


def _generate(runner: ModelRunner, prompt: list[int], params: SamplingParams) -> tuple[list[int], str | None]:
    s = runner.add("s", prompt, params)
    runner.prefill([s])
    while not s.finished:
        runner.decode([s])
    return s.output_ids, s.finish_reason


def test_ignore_eos_generates_past_the_models_eos_but_not_past_a_stop_id(tiny_checkpoint):
    path = tiny_checkpoint(NAME)
    prompt = random_prompts([5], seed=7)[0]
    free, _ = _generate(ModelRunner.from_dir(path, num_pages=8, page_size=4), prompt, GREEDY)
    base = ModelRunner.from_dir(path, num_pages=8, page_size=4)
    eos_runner = ModelRunner(base.model, base.cache, eos_token_ids=[free[1]])  # EOS: a token this prompt produces greedily

    def upto(token: int) -> list[int]:  # the free output up to that token's first appearance
        return free[: free.index(token) + 1]

    assert _generate(eos_runner, prompt, GREEDY) == (upto(free[1]), "stop")
    ignoring = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert _generate(eos_runner, prompt, ignoring) == (free, "length")
    stop_id = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=(free[3],))
    assert _generate(eos_runner, prompt, stop_id) == (upto(free[3]), "stop")


def test_min_tokens_bans_eos_and_stop_ids_until_reached_and_logit_bias_forces_tokens(tiny_checkpoint):
    path = tiny_checkpoint(NAME)
    prompt = random_prompts([5], seed=7)[0]
    base = ModelRunner.from_dir(path, num_pages=8, page_size=4)
    eos, stop_id = 3, 11
    runner = ModelRunner(base.model, base.cache, eos_token_ids=[eos])
    forced_eos = SamplingParams(temperature=0.0, max_tokens=8, logit_bias={eos: 100})
    assert _generate(runner, prompt, forced_eos) == ([eos], "stop")  # +100 makes EOS the first token
    out, reason = _generate(runner, prompt, SamplingParams(temperature=0.0, max_tokens=8, logit_bias={eos: 100}, min_tokens=3))
    assert reason == "stop" and len(out) == 4 and out[-1] == eos and eos not in out[:3]
    # a stop id is banned the same way, and a forced ordinary token is generated every step
    both = SamplingParams(temperature=0.0, max_tokens=8, logit_bias={stop_id: 100, 20: 50}, stop_token_ids=(stop_id,), min_tokens=2)
    assert _generate(runner, prompt, both) == ([20, 20, stop_id], "stop")
    with pytest.raises(ValueError, match="logit_bias"):
        runner.add("x", prompt, SamplingParams(logit_bias={base.model.config.vocab_size: 1.0}))


def test_prompt_logprobs_are_each_positions_log_softmax_and_leave_the_batch_alone(tiny_checkpoint):
    path = tiny_checkpoint(NAME)
    prompt, other_prompt = random_prompts([9, 5], seed=5)
    ref = ModelRunner.from_dir(path, num_pages=16, page_size=4)
    teacher = ref.model.forward(ForwardBatch.build([SequenceChunk(prompt, 0, [0, 1, 2])], 4, ref.cache.device), ref.cache, all_logits=True)
    expected = torch.log_softmax(teacher.float(), dim=-1)[:-1]  # row j predicts prompt token j + 1
    alone = ModelRunner.from_dir(path, num_pages=16, page_size=4)
    plain_outs = alone.prefill([alone.add("b", other_prompt, GREEDY), alone.add("a", prompt, GREEDY)])

    runner = ModelRunner.from_dir(path, num_pages=16, page_size=4)
    lm_head_rows: list[int] = []
    logits = runner.model.logits
    runner.model.logits = lambda x: (lm_head_rows.append(x.shape[0]), logits(x))[1]  # type: ignore[method-assign]
    asking = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=3)
    outs = runner.prefill([runner.add("b", other_prompt, GREEDY), runner.add("a", prompt, asking)])
    assert sorted(lm_head_rows) == [2, 8]  # the asking prompt's 8 rows and the 2 last tokens: not the other prompt's rows
    got = outs[1].prompt_logprobs
    assert outs[0].prompt_logprobs is None and got is not None and got.first == 1
    assert torch.allclose(torch.tensor(got.logprobs), expected[torch.arange(8), torch.tensor(prompt[1:])], atol=1e-5)
    assert got.top is not None and [t.token_ids for t in got.top] == expected.topk(3, dim=-1).indices.tolist()
    assert [o.token_id for o in outs] == [o.token_id for o in plain_outs]  # sampling saw the same last-token logits
    s = runner.add("c", prompt, SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=0))
    none_top = runner.prefill([s])[0].prompt_logprobs
    assert none_top is not None and none_top.top is None and len(none_top.logprobs) == 8
