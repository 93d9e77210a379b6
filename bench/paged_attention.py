"""Paged decode attention: the kernel (``kernels.paged_attention``) vs gather + SDPA, one layer.

Decode attention of ``--batches`` sequences of ``--contexts`` cached tokens each (one query
per sequence, page size 16, head_dim 128, bf16) for the head shapes of Qwen3-30B-A3B
(32 query / 4 KV heads, 8 per KV head) and Qwen3-235B-A22B (64 / 4, 16 per KV head),
the pages of every sequence at random ids of the pool. Two implementations in the same
run, on the same cache and queries:

* ``kernel``: ``kernels.paged_attention.paged_decode_attention``, K/V read from the pool;
* ``gather_sdpa``: ``shared.model.layers.paged_attention_sdpa`` with
  ``MOEBUS_DECODE_ATTENTION=sdpa``, the path decode took before the kernel
  (``PagedKVCache.gather`` into a dense copy, then torch SDPA with a mask).

Each is captured in a CUDA graph of one call per layer of a cache of several layers
(at least ~4x the L2 of KV in total, as a model's layers are: no call finds its K/V in
L2) and timed over ``--reps`` replays (CUDA events, median), per call. ``gbps`` is the K/V
bytes the sequences' lengths cover over that time; ``hbm_copy_gbps`` a device-to-device
copy of 1 GiB timed eagerly in the same run (bytes read plus written; a graph's memcpy
node is slower), the ceiling to compare with. Before timing, the kernel's output is
compared with gather + SDPA's (``rel_err_vs_sdpa``, relative norm of the bf16 outputs).

    python -m bench.paged_attention [--models 30b 235b] [--batches 32 64 128] [--contexts 512 4096 16384]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from bench.results import print_table, record
from bench.timing import capture_graph, event_time_us
from kernels.paged_attention import paged_decode_attention
from shared.kvcache import KVLayout, PagedKVCache
from shared.model import layers

BENCH = "paged_attention"
HEADS = {"30b": (32, 4), "235b": (64, 4)}  # query heads, KV heads
HEAD_DIM, PAGE = 128, 16
L2_DEFEAT_BYTES = 512 << 20  # KV of all layers of a case together: several times the H200's 50 MB L2
MAX_LAYERS = 8


def _copy_gbps(reps: int) -> float:
    """Device-to-device copy of 1 GiB, read plus written bytes per second. Eager, not graphed: a
    graph's memcpy node runs on the copy engines (2.69 TB/s at fec297f6042a, where the eager copy
    does ~4.2), below what SM kernels read."""
    src = torch.empty(1 << 29, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    us = statistics.median(event_time_us(lambda: dst.copy_(src)) for _ in range(reps))
    return 2 * src.numel() * 2 / (us * 1e-6) / 1e9


def _case(batch: int, context: int, hq: int, hkv: int, gen: torch.Generator):
    """A multi-layer cache of random K/V, random page tables, the decode batch's metadata and queries."""
    pages = -(-context // PAGE)
    kv_bytes = batch * context * hkv * HEAD_DIM * 2 * 2
    num_layers = max(1, min(MAX_LAYERS, -(-L2_DEFEAT_BYTES // kv_bytes)))
    num_pages = batch * pages + 1
    cache = PagedKVCache(KVLayout(num_layers, num_pages, hkv, PAGE, HEAD_DIM, torch.bfloat16), "cuda")
    for pool in cache.pools:
        pool.normal_()
    tables = torch.randperm(num_pages, generator=gen)[: batch * pages].view(batch, pages).cuda()
    dev = torch.device("cuda")
    meta = layers.AttentionMetadata(page_tables=tables, context_lens=torch.full((batch,), context, dtype=torch.long, device=dev),
                                    query_lens=torch.ones(batch, dtype=torch.long, device=dev),
                                    token_seq=torch.arange(batch, device=dev), token_idx=torch.zeros(batch, dtype=torch.long, device=dev),
                                    max_q=1)
    q = torch.randn((batch, hq, HEAD_DIM), generator=gen).to(dev, torch.bfloat16)
    return cache, meta, q, kv_bytes


def _time_per_call(fn, num_layers: int, reps: int) -> float:
    """Median microseconds of one call, from graph replays of one call per layer."""
    graph = capture_graph(lambda: [fn(i) for i in range(num_layers)], repeat=1, warmup=True)
    graph.replay()
    us = statistics.median(event_time_us(graph.replay) for _ in range(reps))
    del graph
    return us / num_layers


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", choices=list(HEADS), default=list(HEADS))
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 16384])
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.paged_attention needs a CUDA GPU")
    gen = torch.Generator().manual_seed(0)
    copy_gbps = _copy_gbps(a.reps)
    scale = HEAD_DIM**-0.5
    rows = []
    for model in a.models:
        hq, hkv = HEADS[model]
        for batch in a.batches:
            for context in a.contexts:
                cache, meta, q, kv_bytes = _case(batch, context, hq, hkv, gen)
                ours_fn = lambda i: paged_decode_attention(q, cache.pools[i], meta.page_tables, meta.context_lens, scale)  # noqa: E731
                sdpa_fn = lambda i: layers.paged_attention_sdpa(q, cache, i, meta, scale)  # noqa: E731
                saved = os.environ.get(layers.DECODE_ATTENTION_ENV)
                os.environ[layers.DECODE_ATTENTION_ENV] = "sdpa"
                try:
                    want = sdpa_fn(0).float()
                    got = ours_fn(0).float()
                    rel_err = ((got - want).norm() / want.norm()).item()
                    sdpa_us = _time_per_call(sdpa_fn, cache.layout.num_layers, a.reps)
                finally:
                    if saved is None:
                        os.environ.pop(layers.DECODE_ATTENTION_ENV)
                    else:
                        os.environ[layers.DECODE_ATTENTION_ENV] = saved
                ours_us = _time_per_call(ours_fn, cache.layout.num_layers, a.reps)
                case = {"model": f"qwen3-{model}-heads", "q_heads": hq, "kv_heads": hkv, "head_dim": HEAD_DIM, "page_size": PAGE,
                        "batch": batch, "context": context, "layers_rotated": cache.layout.num_layers, "dtype": "bfloat16"}
                metrics = {"latency_us": ours_us, "gbps": kv_bytes / (ours_us * 1e-6) / 1e9, "speedup_vs_gather_sdpa": sdpa_us / ours_us,
                           "rel_err_vs_sdpa": rel_err, "kv_mib": kv_bytes / 2**20, "hbm_copy_gbps": copy_gbps}
                peer = {"latency_us": sdpa_us, "gbps": kv_bytes / (sdpa_us * 1e-6) / 1e9}
                record(BENCH, case, metrics, {"gather_sdpa": peer})
                rows.append({"model": model, "batch": batch, "context": context, "kv_MiB": kv_bytes / 2**20, "kernel_us": ours_us,
                             "kernel_GBps": metrics["gbps"], "sdpa_us": sdpa_us, "sdpa_GBps": peer["gbps"],
                             "speedup": metrics["speedup_vs_gather_sdpa"], "rel_err": rel_err})
                del cache, meta, q
                torch.cuda.empty_cache()
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (read + write)")
    print_table(rows, ["model", "batch", "context", "kv_MiB", "kernel_us", "kernel_GBps", "sdpa_us", "sdpa_GBps", "speedup", "rel_err"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
