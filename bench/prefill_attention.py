"""Prefill attention of one long prompt: the model's path vs the folded mask path vs plain flash SDPA.

One sequence of ``--prompts`` new tokens after ``--cached`` tokens already in its pages (a
prefix-cache hit or a later chunk), page size 16, head_dim 128, bf16, the head shapes of one
rank of Qwen3-30B-A3B (32 query / 4 KV heads) and Qwen3-235B-A22B (64 / 4). Three
implementations in the same run on the same queries and K/V:

* ``ours``: ``shared.model.layers.paged_attention_sdpa`` (what the model runs: the sequence's
  pages gathered, SDPA with a bottom-right causal mask, GQA on flash attention);
* ``folded``: ``shared.model.layers.folded_attention``, the path prefill took before (query
  heads folded into rows under a ``[g * n, L]`` boolean mask), where it fits in memory;
* ``flash_peer``: torch SDPA (``is_causal`` / bottom-right, ``enable_gqa``) on K/V already
  contiguous: no paging, the ceiling.

Each is timed eagerly (CUDA events, median of ``--reps`` after a warm-up call), with its peak
memory beyond the inputs (``torch.cuda.max_memory_allocated``). ``tflops`` counts the causal
attention FLOPs (4 * n * visible keys * head_dim per query head). A path that runs out of
memory is reported as such.

    python -m bench.prefill_attention [--models 30b 235b] [--prompts 2048 8192 32768] [--cached 0 4096]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from bench.results import print_table, record
from bench.timing import event_time_us
from shared.kvcache import KVLayout, PagedKVCache
from shared.model import layers
from shared.model.model import ForwardBatch, SequenceChunk

BENCH = "prefill_attention"
HEADS = {"30b": (32, 4), "235b": (64, 4)}  # query heads, KV heads
HEAD_DIM, PAGE = 128, 16


def _measure(fn: Callable[[], torch.Tensor], reps: int) -> tuple[float, float, torch.Tensor] | None:
    """(median µs, peak MiB beyond what was allocated before, output), or None when out of memory."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    try:
        out = fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - before) / 2**20
        us = statistics.median(event_time_us(fn) for _ in range(reps))
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None
    return us, peak, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", choices=list(HEADS), default=list(HEADS))
    ap.add_argument("--prompts", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--cached", type=int, nargs="+", default=[0, 4096])
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.prefill_attention needs a CUDA GPU")
    dev, scale = torch.device("cuda"), HEAD_DIM**-0.5
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for model in a.models:
        hq, hkv = HEADS[model]
        for n in a.prompts:
            for cached in a.cached:
                length = cached + n
                pages = -(-length // PAGE)
                cache = PagedKVCache(KVLayout(1, pages, hkv, PAGE, HEAD_DIM, torch.bfloat16), dev)
                cache.pools[0].normal_(generator=gen)
                table = torch.randperm(pages, generator=gen, device=dev).tolist()  # pages at random ids
                meta = ForwardBatch.build([SequenceChunk([0] * n, cached, table)], PAGE, dev).attn
                q = torch.randn((n, hq, HEAD_DIM), generator=gen, device=dev, dtype=torch.bfloat16)
                k, v = cache.gather(0, meta.page_tables)
                k, v = k[:, :, :length].contiguous(), v[:, :, :length].contiguous()
                qh = q.transpose(0, 1)[None].contiguous()
                flops = 4 * hq * HEAD_DIM * sum(cached + i + 1 for i in range(n))
                arms = {
                    "ours": lambda: layers.paged_attention_sdpa(q, cache, 0, meta, scale),
                    "folded": lambda: layers.folded_attention(q, cache, 0, meta, scale),
                    "flash_peer": lambda: F.scaled_dot_product_attention(qh, k, v, attn_mask=causal_lower_right(n, length), scale=scale, enable_gqa=True),
                }
                results = {name: _measure(fn, a.reps) for name, fn in arms.items()}
                ours, folded, peer = results["ours"], results["folded"], results["flash_peer"]
                assert ours is not None and peer is not None, "the model's path and the flash peer must fit"
                rel_err = ((ours[2].float() - peer[2][0].transpose(0, 1).float()).norm() / peer[2].float().norm()).item()
                case = {"model": f"qwen3-{model}-heads", "q_heads": hq, "kv_heads": hkv, "head_dim": HEAD_DIM, "page_size": PAGE,
                        "new_tokens": n, "cached_tokens": cached, "dtype": "bfloat16"}
                metrics = {"latency_us": ours[0], "tflops": flops / ours[0] / 1e6, "peak_extra_mib": ours[1], "rel_err_vs_peer": rel_err,
                           "ratio_to_flash_peer": peer[0] / ours[0]}
                peers = {"flash_peer": {"latency_us": peer[0], "tflops": flops / peer[0] / 1e6, "peak_extra_mib": peer[1]}}
                if folded is not None:
                    peers["folded"] = {"latency_us": folded[0], "tflops": flops / folded[0] / 1e6, "peak_extra_mib": folded[1]}
                record(BENCH, case, metrics, peers)
                rows.append({"model": model, "new": n, "cached": cached, "ours_us": ours[0], "ours_TFLOPs": metrics["tflops"],
                             "ours_MiB": ours[1], "peer_us": peer[0], "ours/peer": metrics["ratio_to_flash_peer"],
                             "folded_us": folded[0] if folded else "OOM", "folded_MiB": folded[1] if folded else "OOM", "rel_err": rel_err})
                del cache, meta, q, k, v, qh, results, ours, folded, peer
                torch.cuda.empty_cache()
    print_table(rows, ["model", "new", "cached", "ours_us", "ours_TFLOPs", "ours_MiB", "peer_us", "ours/peer", "folded_us", "folded_MiB", "rel_err"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
