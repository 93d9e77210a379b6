"""Parity with transformers' own Qwen3-MoE / Qwen3 implementation on the same checkpoint."""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import CONFIGS, DEVICES, hf_model, random_prompts, rel_err

from shared.kvcache import KVLayout, PagedKVCache
from shared.model.model import ForwardBatch, Qwen3Model, SequenceChunk
from shared.model.runner import ModelRunner
from shared.model.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """HF greedy continuation, stopping at the checkpoint's EOS like the runner."""
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, top_k=None, top_p=None, temperature=None)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_logits_match_transformers(tiny_checkpoint, name, device):
    path = tiny_checkpoint(name)
    model, hf = Qwen3Model.load(path, device=device), hf_model(path)
    c = model.config
    cache = PagedKVCache(KVLayout(c.num_layers, 32, model.local_kv_heads, 4, c.head_dim, torch.float32), device)
    prompts = random_prompts([7, 13, 1])
    # Non-contiguous, out-of-order pages so a page-table bug cannot hide.
    tables = [[9, 2], [5, 0, 11, 3], [7]]
    batch = ForwardBatch.build([SequenceChunk(p, 0, t) for p, t in zip(prompts, tables)], 4, torch.device(device))
    logits = model.forward(batch, cache, all_logits=True).cpu()
    offset = 0
    for p in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0]
        assert rel_err(logits[offset : offset + len(p)], ref) <= 1e-4
        offset += len(p)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_continuations_match_transformers_with_changing_batch(tiny_checkpoint, name, device):
    """A and B start together, C joins after 10 steps, B leaves after 12 tokens."""
    path = tiny_checkpoint(name)
    hf = hf_model(path)
    runner = ModelRunner.from_dir(path, num_pages=64, page_size=4, device=device)
    prompts = dict(zip("ABC", random_prompts([5, 11, 3], seed=7)))
    limits = {"A": 32, "B": 12, "C": 32}
    seqs = {k: runner.add(k, prompts[k], SamplingParams(temperature=0.0, max_tokens=limits[k])) for k in "AB"}
    runner.prefill([seqs["A"], seqs["B"]])
    for step in range(64):
        if step == 10:
            seqs["C"] = runner.add("C", prompts["C"], GREEDY)
            runner.prefill([seqs["C"]])
        active = [s for s in seqs.values() if not s.finished]
        if not active:
            break
        runner.decode(active)
    # All pages came back once every sequence finished.
    assert runner.cache.allocator.num_free == 64
    eos = set(runner.eos_token_ids)
    for k, s in seqs.items():
        expected = hf_greedy(hf, prompts[k], limits[k])
        assert s.output_ids == expected, k
        assert s.finish_reason == ("stop" if expected[-1] in eos else "length")


def test_tiny_greedy_continuation_is_varied(tiny_checkpoint):
    """The init of make-tiny must give many distinct greedy tokens, or parity proves little."""
    path = tiny_checkpoint("gqa2_top2_nonorm_sharded")
    runner = ModelRunner.from_dir(path, num_pages=16, page_size=4)
    for prompt in random_prompts([4, 9], seed=3):
        s = runner.add("x", prompt, GREEDY)
        runner.prefill([s])
        while not s.finished:
            runner.decode([s])
        assert len(set(s.output_ids)) >= 16, s.output_ids
