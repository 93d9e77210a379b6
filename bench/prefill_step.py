"""Benchmark: one prefill forward of a Qwen3-MoE-shaped model on one GPU, reference ops vs kernels.

What a prefill rank runs for each batch of prompts: `shared.model.model.Qwen3Model.forward`
over every new token, its K/V written into the paged cache, logits at each sequence's
last token. Weights are random and built on the GPU as in `bench.decode_step`
(``--model`` shapes, ``--layers`` of them, experts bf16 or with ``--weights fp8`` block
FP8). Each ``--prompts`` case ``SxN`` is S sequences of N new tokens, each after
``--cached`` tokens already in the cache (random K/V: a prefix-cache hit).

Implementations, in one process on the same weights and cache:

* ``torch-reference``: the torch reference ops of `shared.model.layers` (per-expert
  loops, fp32 attention) — the peer;
* ``kernels``: the model's kernel path (the grouped-GEMM MoE of `kernels.moe`, fused
  norms, router and q/k/v kernels, varlen flash attention), eager;
* ``kernels+cuda-graph``: the same kernels as piecewise CUDA graphs per token bucket, attention
  eager between the pieces (`shared.model.prefill_graphs`, as a prefill rank runs batches of up to
  ``--graph-max-tokens``; a case past that runs the eager forward). Padded to its bucket.

Figures per case: tokens/s, forward ms and model TFLOP/s: the matmul FLOPs a forward
must do (attention projections, router, the top-k experts' three GEMMs per token,
causal attention scores and values, lm_head at the last tokens; `forward_flops`)
over its time. A dense bf16 GEMM (8192 cube, `torch.mm`) is timed in the same run as
the ceiling those figures compare to. ``host_issue_ms`` is how long the host takes to
issue one forward with the GPU idle at its start (`bench.timing.issue_time`); near
``forward_ms`` (``host_share`` near 1) the GPU waits for the host: eager prefill of short
prompts is bound by the Python and launch work of each layer, not by the GPU.
``gpu_ms`` is the GPU's own time for the forward, the host having issued all of it in advance
(`bench.timing.gpu_time`: a spin kernel holds the stream meanwhile), and ``gpu_share`` its part of
``forward_ms``: near 1 the forward is as fast as its kernels allow; below, the rest is the GPU
waiting for the host. Left out where the forward waits for the GPU itself (a host sync inside it).
``batch_build_ms``: host time of `ForwardBatch.build` for the case (its indices and their copy
to the device), which a prefill pays per batch before it issues the forward.
``--profile N`` prints the GPU kernels of N kernel-path forwards of the largest case:
where a prefill's time goes.

    python -m bench.prefill_step --weights fp8 --layers 16 --prompts 1x2048 1x8192 8x1024
    python -m bench.prefill_step --weights fp8 --layers 16 --prompts 1x128 1x512 1x1500 8x256 --impls kernels kernels+cuda-graph
    python -m bench.prefill_step --weights fp8 --layers 16 --prompts 4x4096 --impls kernels --profile 3
    python -m bench.prefill_step --tp 2 --model qwen3-235b-a22b --weights fp8 --layers 8 --prompts 1x128 1x2048 --impls kernels kernels+cuda-graph

``--tp N`` runs the forward on N GPUs as a prefill instance of TP=N does (attention heads split, experts
spread over the ranks, every token on every rank, the peer-memory all-reduce after o_proj and after the
experts, inside the pieces of ``kernels+cuda-graph``); rank 0 records (case ``layout: tpN``), and its
TFLOP/s count the whole forward's FLOPs over the group's time.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch

from bench.decode_budget import EXPERT_WEIGHTS, MODELS, DoesNotFit, check_fits, model_config
from bench.decode_step import PAGE_SIZE, model_case, random_weights
from bench.results import print_table, record
from bench.timing import gpu_time, issue_time, kernel_profile, sync, time_step
from shared.kvcache import KVLayout, PagedKVCache
from shared.model.config import ModelConfig
from shared.model.model import ForwardBatch, Qwen3Model, SequenceChunk
from shared.model.prefill_graphs import PrefillGraphs
from shared.model.weights import HeadSplit
from shared.parallel import ShardSpec, Topology

BENCH = "prefill_step"
REFERENCE, KERNELS, GRAPHS = "torch-reference", "kernels", "kernels+cuda-graph"
IMPLS = (REFERENCE, KERNELS, GRAPHS)
_PROMPTS = re.compile(r"^(\d+)x(\d+)$")


def parse_prompts(spec: str) -> tuple[int, int]:
    """``"SxN"`` -> (S sequences, N new tokens each); `ValueError` for anything else or a zero."""
    m = _PROMPTS.match(spec)
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise ValueError(f"prompt case {spec!r}: expected SxN with S sequences and N new tokens each, both >= 1")
    return int(m[1]), int(m[2])


def forward_flops(c: ModelConfig, seqs: int, new: int, cached: int) -> float:
    """Matmul FLOPs of one forward over ``seqs`` sequences of ``new`` tokens after ``cached`` each.

    Per token and layer: q/k/v/o projections, router, and ``top_k`` experts of three
    ``hidden x moe_intermediate`` GEMMs; per layer, causal attention (each new token
    scores every cached key and the new keys up to itself, QK^T and PV: 4 FLOPs per
    head dim); lm_head once per sequence. Norms, RoPE, softmax and SwiGLU are not counted.
    """
    h, d, i = c.hidden_size, c.head_dim, c.moe_intermediate_size
    tokens = seqs * new
    proj = 2 * h * d * (2 * c.num_heads + 2 * c.num_kv_heads)
    moe = 2 * h * c.num_experts + c.top_k * 3 * 2 * h * i
    keys_seen = seqs * (new * cached + new * (new + 1) // 2)
    attn = 4 * d * c.num_heads * keys_seen
    return c.num_layers * (tokens * (proj + moe) + attn) + seqs * 2 * h * c.vocab_size


def dense_gemm_tflops(device: torch.device, n: int = 8192, iters: int = 10) -> float:
    """bf16 ``n^3`` `torch.mm` TFLOP/s: the same run's ceiling for the model figures."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    return 2 * n**3 / time_step(lambda: torch.mm(a, b), device, iters) / 1e12


def prefill_chunks(c: ModelConfig, seqs: int, new: int, cached: int, page_stride: int) -> list[SequenceChunk]:
    """``seqs`` prompts of ``new`` random tokens after ``cached`` tokens each; sequence ``s``
    owns pages ``s, s + page_stride, ...`` of the pool (non-contiguous, as a real pool)."""
    pages = -(-(cached + new) // PAGE_SIZE)
    gen = torch.Generator().manual_seed(seqs * 1_000_003 + new)
    return [SequenceChunk(torch.randint(0, c.vocab_size, (new,), generator=gen).tolist(), cached,
                          [p * page_stride + s for p in range(pages)]) for s in range(seqs)]


def build_time(chunks: list[SequenceChunk], device: torch.device, iters: int) -> float:
    """Median wall seconds of `ForwardBatch.build` of ``chunks`` (its copy to ``device`` included): host
    work a prefill does per batch before it issues the forward."""
    times = []
    for _ in range(iters + 1):  # the first is a warm-up
        sync(device)
        t0 = time.perf_counter()
        ForwardBatch.build(chunks, PAGE_SIZE, device)
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", nargs="+", default=["1x2048", "1x8192", "8x1024"], help="cases SxN: S sequences of N new tokens")
    ap.add_argument("--cached", type=int, default=0, help="tokens already cached per sequence (a prefix hit)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--impls", nargs="+", choices=IMPLS, default=[REFERENCE, KERNELS],
                    help="implementations, in this order (the reference first when present)")
    ap.add_argument("--model", choices=list(MODELS), default="qwen3-30b-a3b", help="shapes (bench.decode_budget.MODELS)")
    ap.add_argument("--weights", choices=EXPERT_WEIGHTS, default="bf16", help="expert weights: bf16 or block FP8 (attention etc. stay bf16)")
    ap.add_argument("--layers", type=int, default=None, help="override (fewer layers to save time; recorded in the case)")
    ap.add_argument("--experts", type=int, default=None, help="override (quick CPU checks)")
    ap.add_argument("--vocab", type=int, default=None, help="override (quick CPU checks)")
    ap.add_argument("--profile", type=int, default=0, metavar="FORWARDS", help="print the kernel profile of FORWARDS kernel-path forwards of the largest case")
    ap.add_argument("--graph-max-tokens", type=int, default=2048, help="largest token bucket of kernels+cuda-graph (the prefill setting cuda_graph_max_tokens)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks, one GPU each (the prefill layout: heads split, experts spread, "
                                                       "the peer-memory all-reduce); rank 0 records")
    a = ap.parse_args(argv)
    try:
        cases = [parse_prompts(p) for p in a.prompts]
    except ValueError as e:
        ap.error(str(e))
    if a.cached < 0 or a.profile < 0 or a.iters < 1:
        ap.error("--cached and --profile must not be negative and --iters must be positive")
    if a.graph_max_tokens < 1:
        ap.error("--graph-max-tokens must be positive")
    if GRAPHS in a.impls and a.device.startswith("cpu"):
        ap.error(f"{GRAPHS} needs a CUDA device")
    if a.tp < 1 or (a.tp > 1 and (a.device != "cuda" or a.tp > torch.cuda.device_count())):
        ap.error(f"--tp {a.tp} needs that many GPUs and --device cuda (this machine has {torch.cuda.device_count()})")
    c = model_config(a.model, layers=a.layers, experts=a.experts, vocab=a.vocab)
    if a.tp > 1 and (c.num_experts % a.tp or c.num_heads % a.tp):
        ap.error(f"--tp {a.tp} must divide the {c.num_experts} experts and {c.num_heads} attention heads")
    if a.device.startswith("cuda"):
        device = torch.device(a.device)
        try:
            check_fits(a.model, c, a.tp, max(s for s, _ in cases), a.cached + max(n for _, n in cases), PAGE_SIZE, a.weights,
                       torch.cuda.get_device_properties(device).total_memory)
        except DoesNotFit as e:
            ap.error(str(e))
    if a.tp == 1:
        rows = measure(0, 1, a, c, cases)
    else:
        from kernels._local_group import run_local_group

        rows = run_local_group(measure, a.tp, "nccl", a, c, cases, timeout=1800)[0]
    print_table(rows, ["impl", "prompts", "tokens_per_s", "forward_ms", "gpu_ms", "gpu_share", "host_issue_ms", "host_share", "batch_build_ms", "model_tflops", "speedup_vs_reference", "speedup_vs_eager_kernels",
                       "fraction_of_dense_gemm", "dense_bf16_gemm_tflops"])
    return 0


def measure(rank: int, world: int, a: argparse.Namespace, c: ModelConfig, cases: list[tuple[int, int]]) -> list[dict]:
    """Every implementation and case on this rank (one of ``world`` tensor-parallel ranks, in their process
    group already when ``world > 1``); rank 0 records each as it is measured and returns the table rows."""
    device, dtype = (torch.device("cuda", rank) if world > 1 else torch.device(a.device)), torch.bfloat16
    topology, comm = Topology.single(), None
    if world > 1:
        from shared.parallel_cuda import CudaCollectives

        topology = Topology.prefill(world, rank)
        comm = CudaCollectives(topology)
    max_seqs = max(s for s, _ in cases)
    longest = a.cached + max(n for _, n in cases)
    torch.manual_seed(rank)
    weights = random_weights(c, dtype, device, rank, world, a.weights, tp_size=world)
    pages_per_seq = -(-longest // PAGE_SIZE)
    kv_heads = HeadSplit.for_rank(c, ShardSpec(tp_rank=rank, tp_size=world)).num_kv
    # One page more than the prompts hold: the prefill graphs' scratch page (the prompts' pages are taken first).
    cache = PagedKVCache(KVLayout(c.num_layers, max_seqs * pages_per_seq + 1, kv_heads, PAGE_SIZE, c.head_dim, dtype), device)
    cache.allocator.alloc(max_seqs * pages_per_seq)
    for pool in cache.pools:
        pool.normal_()  # the cached prefixes' K/V
    chunks = {(s, n): prefill_chunks(c, s, n, a.cached, max_seqs) for s, n in cases}
    batches = {sn: ForwardBatch.build(cs, PAGE_SIZE, device) for sn, cs in chunks.items()}
    build_ms = {sn: build_time(cs, device, a.iters) * 1e3 for sn, cs in chunks.items()}
    ceiling = dense_gemm_tflops(device) if device.type == "cuda" else None

    times: dict[tuple[str, int, int], float] = {}
    rows: list[dict] = []

    def report(impl: str, s: int, n: int, seconds: float, issue_s: float, gpu_s: float | None) -> None:
        times[(impl, s, n)] = seconds
        if rank != 0:
            return
        tflops = forward_flops(c, s, n, a.cached) / seconds / 1e12
        metrics = {"tokens_per_s": s * n / seconds, "forward_ms": seconds * 1e3, "model_tflops": tflops,
                   "host_issue_ms": issue_s * 1e3, "host_share": issue_s / seconds, "batch_build_ms": build_ms[(s, n)]}
        if gpu_s is not None:
            metrics |= {"gpu_ms": gpu_s * 1e3, "gpu_share": gpu_s / seconds}
        if ceiling is not None:
            metrics |= {"dense_bf16_gemm_tflops": ceiling, "fraction_of_dense_gemm": tflops / ceiling}
        peers = {}
        ref = times.get((REFERENCE, s, n))
        if impl != REFERENCE and ref is not None:
            metrics["speedup_vs_reference"] = ref / seconds
            peers[REFERENCE] = {"tokens_per_s": s * n / ref, "forward_ms": ref * 1e3}
        eager = times.get((KERNELS, s, n))
        if impl == GRAPHS and eager is not None:  # the same kernels issued eagerly, same run
            metrics["speedup_vs_eager_kernels"] = eager / seconds
            peers[KERNELS] = {"tokens_per_s": s * n / eager, "forward_ms": eager * 1e3}
        case = model_case(a.model, c, a.weights) | {"seqs": s, "new_tokens": n, "cached_tokens": a.cached, "dtype": "bfloat16", "impl": impl}
        if world > 1:  # model TFLOP/s stay the whole forward's: the group's, over its GPUs
            case["layout"] = f"tp{world}"
        record(BENCH, case, metrics, peers)
        rows.append({"impl": impl, "prompts": f"{s}x{n}", **metrics})

    # The reference first: converting the experts for the kernels replaces their plain layout (the two
    # kernel impls share one model).
    model = graphs = None
    for impl in [i for i in IMPLS if i in a.impls]:
        if model is None or impl == REFERENCE:
            model = Qwen3Model(c, weights, topology, comm, kernels=impl != REFERENCE)
        if impl == GRAPHS:
            graphs = PrefillGraphs(model, cache, a.graph_max_tokens)
        for (s, n), batch in batches.items():
            if impl == GRAPHS:
                forward = lambda: model.logits(graphs.hidden_states(batch)[batch.last_token])  # noqa: E731
            else:
                forward = lambda: model.forward(batch, cache)  # noqa: E731
            gpu_s = gpu_time(forward, device, a.iters) if impl != REFERENCE else None  # the reference syncs in its experts' loops
            report(impl, s, n, time_step(forward, device, a.iters), issue_time(forward, device, a.iters), gpu_s)
        if impl == KERNELS and a.profile and device.type == "cuda":
            s, n = max(batches, key=lambda sn: sn[0] * sn[1])
            profile = kernel_profile(lambda: model.forward(batches[(s, n)], cache), device, a.profile)
            if rank == 0:
                print(f"{KERNELS} {s}x{n}, {a.profile} forwards:\n{profile}", flush=True)
        if impl == REFERENCE:
            model = None
        sync(device)
    if graphs is not None and rank == 0:
        print(f"{GRAPHS}: {graphs.stats()}", flush=True)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
