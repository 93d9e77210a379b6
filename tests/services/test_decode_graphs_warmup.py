"""The decode warm-up with CUDA graphs on (services/warmup.py + shared/model/cuda_graphs.py), on
the CPU: ``capture=False`` runs the very bucket steps a GPU rank captures and replays. The
warm-up must step every batch bucket twice (capture, then replay), leave every page but the
scratch page free and the KV zeroed outside it, and change no later output."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.warmup import decode_warmup_batches, warm_up_decode
from shared.model.runner import ModelRunner
from shared.model.sampling_params import SamplingParams
from shared.settings import DecodeSettings, SettingsError, load_settings

MAX_BATCH = 6
PROMPT = [11, 4051, 9, 77, 1203, 5, 88]


def _decode(runner: ModelRunner) -> list[int]:
    seq = runner.add("r", PROMPT, SamplingParams(temperature=0.9, seed=5, max_tokens=6))
    runner.prefill([seq])
    while not seq.finished:
        runner.decode([seq])
    return seq.output_ids


def test_warm_up_captures_and_replays_every_batch_bucket_and_leaves_the_cache_clean(tiny_model: Path):
    runner = ModelRunner.from_dir(tiny_model, num_pages=32, page_size=16, max_tokens_per_rank=MAX_BATCH)
    graphs = runner.use_decode_graphs(MAX_BATCH, max_graphs=16, capture=False)
    assert graphs.batch_buckets == [1, 2, 4, MAX_BATCH]
    assert decode_warmup_batches(runner, MAX_BATCH) == [1, 2, 4, MAX_BATCH]
    warm_up_decode(runner, DecodeSettings(model=str(tiny_model), kv_pages=32, max_batch=MAX_BATCH), world=1)
    assert graphs.stats() == {"graph_replay": 4, "graph_capture": 4, "eager": 0, "graphs": 0}
    assert set(graphs._graphs) == {(b, 1) for b in (1, 2, 4, MAX_BATCH)}
    assert runner.cache.allocator.num_free == 31  # all but the scratch page
    others = [p for p in range(32) if p != graphs.scratch_page]
    assert not runner.cache.storage[:, others].any()
    plain = ModelRunner.from_dir(tiny_model, num_pages=32, page_size=16, max_tokens_per_rank=MAX_BATCH)
    assert _decode(runner) == _decode(plain)


def test_cuda_graph_settings_are_typed():
    settings = load_settings(DecodeSettings, "decode", env={"MOEBUS_DECODE_CUDA_GRAPHS": "false", "MOEBUS_DECODE_CUDA_GRAPHS_MAX": "8"})
    assert settings.cuda_graphs is False and settings.cuda_graphs_max == 8
    assert load_settings(DecodeSettings, "decode", env={}).cuda_graphs is True
    with pytest.raises(SettingsError, match=r"Expected `int` >= 1 - at `\$\.cuda_graphs_max`"):
        load_settings(DecodeSettings, "decode", env={"MOEBUS_DECODE_CUDA_GRAPHS_MAX": "0"})
