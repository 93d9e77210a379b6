"""A model rank's warm-up (services/warmup.py) in process, on the tiny checkpoint: it leaves
nothing behind (KV, pages, random streams, later outputs) and fails with a typed error.
That the ranks of the services warm up before their first heartbeat, also in TP and DP
groups, is checked on the running stacks (test_pipeline.py, test_parallel_stack.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels.grouped_gemm import SWAPPED_TOKEN_TILES, TILE_BUCKET_BOUNDS
from services.warmup import WarmupFailed, decode_warmup_batches, prefill_warmup_lengths, warm_up_decode, warm_up_prefill
from shared.model.cuda_graphs import ForwardPath
from shared.model.runner import ModelRunner
from shared.model.sampling_params import SamplingParams
from shared.settings import DecodeSettings, PrefillSettings

PROMPT = [11, 4051, 9, 77, 1203, 5, 88]
REQUESTS = [
    SamplingParams(temperature=0.0, max_tokens=6),  # greedy
    SamplingParams(temperature=0.9, top_k=20, seed=1234, max_tokens=6),  # its own generator
    SamplingParams(temperature=0.9, max_tokens=6),  # torch's global stream
]


def _generate(prefill: ModelRunner, decode: ModelRunner) -> list[list[int]]:
    """Each request prefilled on `prefill`, its KV copied into `decode`'s pages, decoded there
    (a miniature of the services' handoff, without the transfer)."""
    outputs = []
    for i, params in enumerate(REQUESTS):
        seq = prefill.add(f"r{i}", PROMPT, params)
        (first,) = prefill.prefill([seq])
        pages = decode.cache.allocator.alloc(decode.cache.layout.pages_for(len(PROMPT) + params.max_tokens))
        decode.cache.storage[:, pages[: len(seq.page_table)]] = prefill.cache.storage[:, seq.page_table]
        prefill.release(seq)
        running = decode.add(f"r{i}", PROMPT, params, page_table=pages, num_cached=len(PROMPT), output_ids=[first.token_id])
        if running.generator is not None:
            running.generator.set_state(seq.generator.get_state())
        while not running.finished and first.finish_reason is None:
            decode.decode([running])
        decode.release(running)
        outputs.append(running.output_ids)
    return outputs


def _runners(model: Path) -> tuple[ModelRunner, ModelRunner]:
    prefill = ModelRunner.from_dir(model, num_pages=64, page_size=16, release_finished=False)
    decode = ModelRunner.from_dir(model, num_pages=64, page_size=16, max_tokens_per_rank=8)
    return prefill, decode


def test_warm_up_leaves_kv_pages_and_random_streams_as_loaded_and_outputs_unchanged(tiny_model: Path):
    torch.manual_seed(99)  # the unseeded request draws from torch's global stream
    reference = _generate(*_runners(tiny_model))
    torch.manual_seed(99)
    prefill, decode = _runners(tiny_model)
    rng = torch.get_rng_state()
    warm_up_prefill(prefill, PrefillSettings(model=str(tiny_model), kv_pages=64, max_batch_tokens=1024))
    warm_up_decode(decode, DecodeSettings(model=str(tiny_model), kv_pages=64, max_batch=8), world=1)
    assert torch.equal(torch.get_rng_state(), rng)
    for runner in (prefill, decode):
        assert runner.cache.allocator.num_free == runner.cache.layout.num_pages
        assert not runner.cache.storage.any()  # every KV the dummy sequences wrote is zeroed
    assert _generate(prefill, decode) == reference


def test_prefill_warm_up_reaches_every_grouped_gemm_tile_bucket_a_batch_can(tiny_model: Path):
    runner = ModelRunner.from_dir(tiny_model, num_pages=300, page_size=16, release_finished=False)
    experts, top_k = runner.model.experts_per_rank, runner.model.config.top_k

    def bucket(tokens: int) -> int:
        """0 = decode-sized tiles, then one more for each bound the tokens per local expert pass."""
        return sum(tokens * top_k / experts > bound for bound in TILE_BUCKET_BOUNDS)

    lengths = prefill_warmup_lengths(runner, max_batch_tokens=300 * 16)
    assert [bucket(n) for n in lengths] == list(range(len(TILE_BUCKET_BOUNDS) + 1))
    assert all(bucket(n - 1) < bucket(n) for n in lengths[1:])  # each the shortest prompt of its bucket
    assert max(lengths) <= 300 * 16
    # A batch cap below the largest bucket: no real batch reaches it, so neither does the warm-up.
    assert prefill_warmup_lengths(runner, max_batch_tokens=max(lengths) - 1) == lengths[:-1]
    # Nor when the KV pages cannot hold such a prompt (64 pages of 16 tokens).
    small = ModelRunner.from_dir(tiny_model, num_pages=64, page_size=16, release_finished=False)
    assert prefill_warmup_lengths(small, max_batch_tokens=300 * 16) == [n for n in lengths if n <= 64 * 16]


def test_prefill_warm_up_captures_and_replays_every_graph_bucket_that_fits(tiny_model: Path):
    """With prefill graphs (the padded pieces run eagerly on the CPU), each token bucket a batch can reach is
    one prompt long twice: captured, then replayed; the KV pages are given back and zeroed but the scratch page."""
    runner = ModelRunner.from_dir(tiny_model, num_pages=40, page_size=16, release_finished=False)
    graphs = runner.use_prefill_graphs(max_tokens=1024, capture=False)
    fits = (40 - 1) * 16  # the scratch page is taken
    lengths = prefill_warmup_lengths(runner, max_batch_tokens=4096)
    assert [b for b in graphs.buckets if b <= fits] == [16, 32, 64, 128, 256, 512] and set(lengths) >= {16, 32, 64, 128, 256, 512}
    assert 768 not in lengths and max(lengths) <= fits
    warm_up_prefill(runner, PrefillSettings(model=str(tiny_model), kv_pages=40, max_batch_tokens=4096))
    forwards = sum(2 if n in graphs.buckets else 1 for n in lengths if n <= 1024)
    assert graphs.counts[ForwardPath.CAPTURE] == 6 and graphs.counts[ForwardPath.REPLAY] == forwards - 6
    assert graphs.counts[ForwardPath.EAGER] == sum(n > 1024 for n in lengths)
    assert runner.cache.allocator.num_free == 40 - 1
    others = [p for p in range(40) if p != graphs.scratch_page]
    assert not runner.cache.storage[:, others].any()


def test_prefill_warm_up_of_mxfp8_experts_reaches_every_swapped_decode_tile(tiny_model: Path, tmp_path: Path):
    """MXFP8 experts compile a kernel per swapped decode tile (8, 16, 32 or 64 tokens per expert): the warm-up
    passes those bounds too, on a real MXFP8 checkpoint written by `moebus quantize`."""
    from shared.model.quantize import quantize_checkpoint

    quantize_checkpoint(tiny_model, tmp_path / "mxfp8", "mxfp8")
    runner = ModelRunner.from_dir(tmp_path / "mxfp8", num_pages=300, page_size=16, release_finished=False)
    experts, top_k = runner.model.experts_per_rank, runner.model.config.top_k
    bounds = (*SWAPPED_TOKEN_TILES[:-1], *TILE_BUCKET_BOUNDS)

    def bucket(tokens: int) -> int:
        return sum(tokens * top_k / experts > bound for bound in bounds)

    lengths = prefill_warmup_lengths(runner, max_batch_tokens=300 * 16)
    assert [bucket(n) for n in lengths] == list(range(len(bounds) + 1))
    # the bf16 checkpoint it came from compiles no swapped tiles, and its warm-up skips those bounds
    bf16 = ModelRunner.from_dir(tiny_model, num_pages=300, page_size=16, release_finished=False)
    assert len(prefill_warmup_lengths(bf16, max_batch_tokens=300 * 16)) == len(TILE_BUCKET_BOUNDS) + 1


def test_decode_warm_up_steps_the_largest_batch_the_kv_pages_can_hold(tiny_model: Path):
    roomy = ModelRunner.from_dir(tiny_model, num_pages=64, page_size=16, max_tokens_per_rank=8)
    assert decode_warmup_batches(roomy, max_batch=8) == [1, 8]
    tight = ModelRunner.from_dir(tiny_model, num_pages=5, page_size=1, max_tokens_per_rank=4)
    assert decode_warmup_batches(tight, max_batch=4) == [1, 2]  # 2-token sequences: two fit in 5 pages
    warm_up_decode(tight, DecodeSettings(model=str(tiny_model), kv_pages=5, page_size=1, max_batch=4), world=1)
    assert tight.cache.allocator.num_free == 5 and not tight.cache.storage.any()


def test_decode_warm_up_steps_a_batch_in_every_tile_bucket_below_the_largest(tiny_model: Path):
    largest = 2100  # 8 experts, top-2: past the last bound, so the two ends alone skip the middle bucket
    runner = ModelRunner.from_dir(tiny_model, num_pages=largest + 100, page_size=16, max_tokens_per_rank=largest)
    experts, top_k = runner.model.experts_per_rank, runner.model.config.top_k

    def bucket(batch: int) -> int:  # a decode step brings one token per sequence
        return sum(batch * top_k / experts > bound for bound in TILE_BUCKET_BOUNDS)

    assert bucket(largest) == len(TILE_BUCKET_BOUNDS)
    batches = decode_warmup_batches(runner, max_batch=largest)
    assert batches[0] == 1 and batches[-1] == largest
    assert {bucket(b) for b in batches} == set(range(len(TILE_BUCKET_BOUNDS) + 1))  # every bucket
    assert all(bucket(b - 1) < bucket(b) for b in batches[1:-1])  # each the smallest batch of its bucket


def test_decode_warm_up_with_no_room_for_one_sequence_fails_typed(tiny_model: Path):
    runner = ModelRunner.from_dir(tiny_model, num_pages=1, page_size=1, max_tokens_per_rank=4)
    with pytest.raises(WarmupFailed, match=r"kv_pages=1 of page_size=1 cannot hold one sequence of 2 tokens"):
        warm_up_decode(runner, DecodeSettings(model=str(tiny_model), kv_pages=1, page_size=1, max_batch=4), world=1)
    assert runner.cache.allocator.num_free == 1


def test_a_failing_warm_up_step_is_a_typed_error_naming_the_step(tiny_model: Path):
    runner = ModelRunner.from_dir(tiny_model, num_pages=64, page_size=16, release_finished=False)
    runner.model.weights.lm_head = runner.model.weights.lm_head[:, :-1]  # a broken checkpoint: wrong lm_head shape
    with pytest.raises(WarmupFailed, match=r"prefill warm-up: step prefill_16_tokens failed: RuntimeError") as info:
        warm_up_prefill(runner, PrefillSettings(model=str(tiny_model), kv_pages=64))
    assert isinstance(info.value.__cause__, RuntimeError)
    assert runner.cache.allocator.num_free == 64
