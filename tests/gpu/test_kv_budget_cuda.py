"""GPU: KV pages from a share of GPU memory (`shared.model.kv_budget`, vLLM's gpu_memory_utilization).

A tiny bf16 Qwen3-MoE on the kernel path is loaded with its pages decided by the share: the cache
must fill what the weights, the profiled activations and the memory outside torch leave of it and
no more, grow with the share, and a share too small for the weights, or larger than the free
memory, is refused with the figures.
"""

from __future__ import annotations

import functools
import gc

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPES = dict(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=64, experts=16, top_k=4, moe_intermediate=128,
              vocab=512, tokenizer=False, dtype="bfloat16", seed=5)
PAGE = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from shared.model.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("kv_budget"), **SHAPES)


def _load(path, utilization: float, lengths: list[int]):
    from shared.model.kv_budget import DeviceMemory, pages_from_memory
    from shared.model.runner import ModelRunner

    device = torch.device("cuda", torch.cuda.current_device())
    baseline = DeviceMemory.measure(device, utilization)
    pages = functools.partial(pages_from_memory, baseline=baseline, utilization=utilization, page_size=PAGE,
                              dtype=torch.bfloat16, profile_lengths=lengths, activation_copies=2)
    return ModelRunner.from_dir(path, num_pages=pages, page_size=PAGE, dtype=torch.bfloat16, device=device), baseline


def test_the_cache_takes_what_the_share_leaves(tiny):
    total = torch.cuda.mem_get_info()[1]
    utilization = round(torch.cuda.mem_get_info()[0] / total * 0.02, 4) or 0.001  # ~2% of what is free: a few GiB
    runner, baseline = _load(tiny, utilization, [1] * 32)
    layout = runner.cache.layout
    cache_bytes = runner.cache.storage.numel() * runner.cache.storage.element_size()
    assert layout.num_pages > 512  # far more than the kv_pages default for a model this small
    torch.cuda.synchronize()
    used_by_rank = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0] - baseline.used - baseline.torch_held
    assert used_by_rank <= utilization * total  # weights + cache + outside torch within the share
    # and the cache is what is left: less than one page's worth, plus the two activation copies, short of it
    page_bytes = cache_bytes // layout.num_pages
    assert utilization * total - used_by_rank < 0.05 * utilization * total + page_bytes
    # the rank still runs its largest step
    assert torch.isfinite(runner.model.forward(*_prompts(runner, [1] * 32))).all()
    del runner
    torch.cuda.empty_cache()
    bigger, _ = _load(tiny, 2 * utilization, [1] * 32)
    assert bigger.cache.layout.num_pages > 1.9 * layout.num_pages


def test_impossible_shares_are_refused_with_the_figures(tiny):
    from shared.model.kv_budget import DeviceMemory, KVBudgetError

    gc.collect()
    torch.cuda.empty_cache()  # as measure() does first: what is free then is what the share is checked against
    free, total = torch.cuda.mem_get_info()
    with pytest.raises(KVBudgetError, match="only .* GiB are free.*torch in this process"):
        DeviceMemory.measure(torch.device("cuda", torch.cuda.current_device()), min(1.0, free / total + 0.01))
    with pytest.raises(KVBudgetError, match="leaves no room for a KV cache.*weights and buffers take"):
        _load(tiny, 1e-7, [1] * 32)  # ~14 KB of an H200: not even the weights


@pytest.mark.parametrize("service", ["decode", "prefill"])
def test_a_rank_started_with_a_share_sizes_its_cache_from_it(tiny, service):
    """Through `start_model_rank`, as the services start their ranks: a decode rank profiles ``max_batch`` one-token
    sequences, a prefill rank one prompt of ``max_batch_tokens``; either then fits its share and runs that forward."""
    from services.model_rank import start_model_rank
    from shared.parallel import Topology
    from shared.settings import DecodeSettings, PrefillSettings

    free, total = torch.cuda.mem_get_info()
    utilization = round(free / total * 0.02, 4)
    if service == "decode":
        settings = DecodeSettings(model=str(tiny), device="cuda", dtype="bfloat16", gpu_memory_utilization=utilization,
                                  page_size=PAGE, max_batch=32)
        lengths = [1] * settings.max_batch
    else:
        settings = PrefillSettings(model=str(tiny), device="cuda", dtype="bfloat16", gpu_memory_utilization=utilization,
                                   page_size=PAGE, max_batch_tokens=2048)
        lengths = [settings.max_batch_tokens]
    runner = start_model_rank(settings, getattr(Topology, service)(1, 0), 0)
    layout = runner.cache.layout
    assert layout.num_pages > settings.kv_pages  # not the kv_pages default: the share decided
    assert layout.num_pages * layout.bytes_per_token * PAGE <= utilization * total
    logits = runner.model.forward(*_prompts(runner, lengths))  # the profiled forward still runs beside the full cache
    assert logits.shape == (len(lengths), runner.model.config.vocab_size) and torch.isfinite(logits).all()


def _prompts(runner, lengths: list[int]):
    from shared.model.model import ForwardBatch, SequenceChunk

    chunks = []
    for i, n in enumerate(lengths):
        pages = runner.cache.allocator.alloc(-(-n // PAGE))
        chunks.append(SequenceChunk([(i + t) % 500 + 1 for t in range(n)], 0, pages))
    return ForwardBatch.build(chunks, PAGE, runner.cache.device), runner.cache
