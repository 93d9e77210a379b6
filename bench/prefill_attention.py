"""Prefill attention of a batch of prompts: the model's routes vs plain flash.

``--seqs`` sequences of ``--prompts`` new tokens each, every one after the same ``--cached``
tokens already in the pages (one long prompt with ``--seqs 1``; many short prompts after a
prefix-cache hit: ``--seqs 64 --prompts 128 --cached 1024``, the pages of the prefix shared by
all of them as the prefix cache shares them), page size 16, head_dim 128, bf16, the head shapes
of one rank of Qwen3-30B-A3B (32 query / 4 KV heads) and Qwen3-235B-A22B (64 / 4). Implementations
in the same run on the same queries and K/V:

* ``ours``: ``shared.model.layers.paged_attention_sdpa``, what the model runs: the route
  `layers.prefill_attention_route` picks (``route`` in the table), one of the next three,
  timed with the batch's plan already built, as every layer after the first finds it;
  ``plan_us`` is what building that plan adds to the first layer (`layers.PrefillKeys.build`,
  `layers.QueriesAsDecode.build` or `PagedKVCache.page_rows`);
* ``varlen``: `layers.varlen_prefill_attention` (every sequence's keys gathered from the pages in
  one row gather, one variable-length flash attention call);
* ``per_sequence``: `layers.per_sequence_prefill_attention` (the batch's pages gathered at once, then
  FlashAttention-2's batched kernel a sequence at a time, which splits long contexts over CTAs where
  its query blocks are few: a launch per sequence and layer); result lines before it became a route
  name this arm ``loop`` (then a page gather and SDPA's dispatch per sequence, the same kernel);
* ``as_decode``: `layers.queries_as_decode_attention` (each query a decode query of the paged
  decode attention kernel, a sequence's queries sharing CTAs where `layers.as_decode_queries_per_cta`
  packs them), up to 128 queries per sequence where the kernel takes the shape;
* ``folded``: ``shared.model.layers.folded_attention`` (query heads folded into rows under a
  ``[B, g * n, L]`` boolean mask), where it fits in memory;
* ``flash_peer``: flash attention on K/V already contiguous, no paging, the ceiling (SDPA for
  one sequence, the varlen kernel for several).

Each is timed eagerly (CUDA events, median of ``--reps`` after a warm-up call: ``*_us``, which
counts the host's issue time where it is longer than the GPU's) and by the GPU's own time
(`bench.timing.gpu_time`: ``*_gpu_us``, what it costs between graph pieces that keep the GPU
busy), with its peak memory beyond the inputs (``torch.cuda.max_memory_allocated``). ``tflops`` counts the causal
attention FLOPs (4 * visible keys * head_dim per query and query head). A path that runs out of
memory is reported as such.

    python -m bench.prefill_attention [--models 30b 235b] [--seqs 1] [--prompts 2048 8192 32768] [--cached 0 4096]
    python -m bench.prefill_attention --models 30b --seqs 64 7 --prompts 128 1152 --cached 1024 0
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from bench.results import print_table, record
from bench.timing import event_time_us, gpu_time
from shared.kvcache import KVLayout, PagedKVCache
from shared.model import layers
from shared.model.model import ForwardBatch, SequenceChunk

BENCH = "prefill_attention"
HEADS = {"30b": (32, 4), "235b": (64, 4)}  # query heads, KV heads
HEAD_DIM, PAGE = 128, 16


def _measure(fn: Callable[[], torch.Tensor], reps: int) -> tuple[float, float, torch.Tensor, float | None] | None:
    """(median µs, peak MiB beyond what was allocated before, output, the GPU's own median µs), or None
    when out of memory."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    try:
        out = fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - before) / 2**20
        us = statistics.median(event_time_us(fn) for _ in range(reps))
        gpu_s = gpu_time(fn, out.device, reps)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None
    return us, peak, out, None if gpu_s is None else gpu_s * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", choices=list(HEADS), default=list(HEADS))
    ap.add_argument("--seqs", type=int, nargs="+", default=[1], help="sequences per batch")
    ap.add_argument("--prompts", type=int, nargs="+", default=[2048, 8192, 32768], help="new tokens per sequence")
    ap.add_argument("--cached", type=int, nargs="+", default=[0, 4096], help="tokens before them (shared pages when several sequences)")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.prefill_attention needs a CUDA GPU")
    if any(c % PAGE for c in a.cached):
        raise SystemExit(f"--cached must be whole pages ({PAGE} tokens): a cached prefix is")
    dev, scale = torch.device("cuda"), HEAD_DIM**-0.5
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for model in a.models:
        hq, hkv = HEADS[model]
        for seqs in a.seqs:
            for n in a.prompts:
                for cached in a.cached:
                    length, own = cached + n, -(-n // PAGE)
                    pages = cached // PAGE + seqs * own
                    cache = PagedKVCache(KVLayout(1, pages, hkv, PAGE, HEAD_DIM, torch.bfloat16), dev)
                    cache.pools[0].normal_(generator=gen)
                    ids = torch.randperm(pages, generator=gen, device=dev).tolist()  # pages at random ids
                    prefix, rest = ids[: cached // PAGE], ids[cached // PAGE :]
                    chunks = [SequenceChunk([0] * n, cached, prefix + rest[s * own : (s + 1) * own]) for s in range(seqs)]
                    meta = ForwardBatch.build(chunks, PAGE, dev).attn
                    q = torch.randn((seqs * n, hq, HEAD_DIM), generator=gen, device=dev, dtype=torch.bfloat16)
                    route = layers.prefill_attention_route(meta, hq, cache.pools[0].shape, q.dtype, dev)
                    per_cta = layers.as_decode_queries_per_cta(seqs * n, hq, hkv, dev)
                    plans = {"as_decode": lambda: layers.QueriesAsDecode.build(meta, per_cta), "per_sequence": lambda: cache.page_rows(meta.page_tables),
                             "varlen": lambda: layers.PrefillKeys.build(meta, cache.pools[0].shape)}
                    plan_us = statistics.median(event_time_us(plans[route]) for _ in range(a.reps))
                    k, v = cache.gather(0, meta.page_tables)
                    k, v = k[:, :, :length], v[:, :, :length]
                    if seqs == 1:
                        qh, k1, v1 = q.transpose(0, 1)[None].contiguous(), k.contiguous(), v.contiguous()
                        peer_fn = lambda: F.scaled_dot_product_attention(qh, k1, v1, attn_mask=causal_lower_right(n, length), scale=scale,  # noqa: E731
                                                                         enable_gqa=True)[0].transpose(0, 1)
                    else:
                        kf, vf = (t.transpose(1, 2).reshape(seqs * length, hkv, HEAD_DIM).contiguous() for t in (k, v))
                        cu_q = torch.arange(0, seqs * n + 1, n, dtype=torch.int32, device=dev)
                        cu_k = torch.arange(0, seqs * length + 1, length, dtype=torch.int32, device=dev)
                        peer_fn = lambda: torch.ops.aten._flash_attention_forward(q, kf, vf, cu_q, cu_k, n, length, 0.0, True, False,  # noqa: E731
                                                                                  scale=scale)[0]
                    flops = 4 * hq * HEAD_DIM * seqs * sum(cached + i + 1 for i in range(n))
                    arms = {
                        "ours": lambda: layers.paged_attention_sdpa(q, cache, 0, meta, scale),
                        "varlen": lambda: layers.varlen_prefill_attention(q, cache, 0, meta, scale),
                        "per_sequence": lambda: layers.per_sequence_prefill_attention(q, cache, 0, meta, scale),
                        "folded": lambda: layers.folded_attention(q, cache, 0, meta, scale),
                        "flash_peer": peer_fn,
                    }
                    if n <= 128 and layers.decode_attention_kernel(hq, hkv, HEAD_DIM, PAGE, q.dtype, dev):
                        arms["as_decode"] = lambda: layers.queries_as_decode_attention(q, cache, 0, meta, scale)
                    results = {name: _measure(fn, a.reps) for name, fn in arms.items()}
                    ours, peer = results["ours"], results["flash_peer"]
                    assert ours is not None and peer is not None, "the model's path and the flash peer must fit"
                    def err(out: torch.Tensor) -> float:
                        return ((out.float() - peer[2].float()).norm() / peer[2].float().norm()).item()

                    rel_err = err(ours[2])
                    case = {"route": route, "model": f"qwen3-{model}-heads", "q_heads": hq, "kv_heads": hkv, "head_dim": HEAD_DIM, "page_size": PAGE,
                            "seqs": seqs, "new_tokens": n, "cached_tokens": cached, "dtype": "bfloat16"}
                    metrics = {"latency_us": ours[0], "gpu_us": ours[3], "plan_us": plan_us, "tflops": flops / ours[0] / 1e6, "peak_extra_mib": ours[1],
                               "rel_err_vs_peer": rel_err, "ratio_to_flash_peer": peer[0] / ours[0]}
                    peers = {name: {"latency_us": r[0], "gpu_us": r[3], "tflops": flops / r[0] / 1e6, "peak_extra_mib": r[1], "rel_err_vs_peer": err(r[2])}
                             for name, r in results.items() if name != "ours" and r is not None}
                    record(BENCH, case, metrics, peers)
                    per_seq, folded, varlen, as_decode = (results.get(name) for name in ("per_sequence", "folded", "varlen", "as_decode"))
                    rows.append({"model": model, "seqs": seqs, "new": n, "cached": cached, "route": route, "ours_us": ours[0], "plan_us": plan_us,
                                 "ours_gpu_us": ours[3], "varlen_us": varlen[0] if varlen else "-", "varlen_gpu_us": varlen[3] if varlen else "-",
                                 "as_decode_us": as_decode[0] if as_decode else "-", "as_decode_gpu_us": as_decode[3] if as_decode else "-",
                                 "ours_TFLOPs": metrics["tflops"], "ours_MiB": ours[1], "per_seq_us": per_seq[0] if per_seq else "OOM",
                                 "per_seq_gpu_us": per_seq[3] if per_seq else "-",
                                 "peer_us": peer[0], "ours/peer": metrics["ratio_to_flash_peer"], "folded_us": folded[0] if folded else "OOM",
                                 "rel_err": rel_err})
                    del cache, meta, q, k, v, results, ours, peer, per_seq, folded, varlen, as_decode, peer_fn, arms
                    torch.cuda.empty_cache()
    print_table(rows, ["model", "seqs", "new", "cached", "route", "ours_us", "ours_gpu_us", "plan_us", "varlen_us", "varlen_gpu_us", "as_decode_us",
                       "as_decode_gpu_us", "ours_TFLOPs", "ours_MiB", "per_seq_us", "per_seq_gpu_us", "peer_us", "ours/peer", "folded_us", "rel_err"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
