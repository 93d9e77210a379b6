"""Benchmark: one decode step of a Qwen3-MoE-shaped model, reference ops vs kernels.

`shared.model.model.Qwen3Model.forward` with random weights built directly on the
GPU, shapes of ``--model`` (`bench.decode_budget.MODELS`): ``qwen3-30b-a3b`` (the
default: 48 layers, hidden 2048, 32 q / 4 KV heads of 128, 128 experts top-8,
moe_intermediate 768, vocab 151936) or ``qwen3-235b-a22b`` (94 layers, hidden 4096,
64 q / 4 KV heads, moe_intermediate 1536). Experts are bf16, or with ``--weights fp8``
block FP8 (E4M3 + fp32 128x128 scales, drawn in bf16 and quantized one expert at a
time); attention, router and embeddings stay bf16 (what a model on the kernel path
runs for an FP8 checkpoint too: `shared.model.weights.dequantize_dense`). A paged KV cache holds
``--context`` random tokens per sequence. Up to three implementations run in one
process (``--impls``), on the same weights and cache:

* ``torch-reference``: the torch reference ops of `shared.model.layers`
  (per-expert loops, fp32 attention), no CUDA graphs — the baseline;
* ``kernels``: the model's kernel path (grouped-GEMM MoE of `kernels.moe`, SDPA
  attention), eager;
* ``kernels+cuda-graph``: the same forward captured once per batch in a CUDA
  graph and replayed (what a decode rank with graphs per batch bucket runs).

The reference runs first; the experts are then converted in place to the
kernels' layout (no second copy of the weights). Each kernel line carries the
reference's figures of the same run as a peer and their ratio.

Next to each measured tokens/s stands the HBM roofline of that step: the bytes
it must move at least (attention and router weights, the experts the batch's
tokens hit, lm_head, embedding rows, the K/V it reads; `bench.decode_budget.step_bytes`)
divided by 4.1 TB/s. The number of experts hit is the expectation under uniform
routing, ``E * (1 - (1 - k/E) ** B)`` per layer. A device-to-device copy is timed
in the same run to re-measure the bandwidth ceiling.

Before any weights are drawn the layout's memory is checked
(`bench.decode_budget.check_fits`): a model that cannot fit the GPU(s) is refused
with the numbers (e.g. Qwen3-235B with FP8 experts on one GPU, or over EP=2 at 128
requests per rank).

    python -m bench.decode_step [--batches 1 16 64] [--context 512] [--impls torch-reference kernels kernels+cuda-graph]

With ``--ep N`` (N GPUs, one process each) the model runs the decode layout, DP N x
EP N: every rank holds E/N experts and ``--batches`` sequences of its own, and the
MoE layers exchange tokens in every step. Implementations there (all on the
kernels' experts): ``kernels`` (``ep_dispatch``/``ep_combine`` over NCCL
all-to-all with host-known sizes, the reference, eager only), ``kernels+peer-moe``
(`Collectives.decode_moe`: peer-memory dispatch, masked grouped GEMMs, combine)
and the same under a CUDA graph. tokens/s counts all ranks' tokens; rank 0's step
time is reported (the ranks step in lockstep). The roofline there is per GPU: the
bytes one rank must read in a step (its experts the step's ``batch * N`` tokens hit,
the replicated attention/router/lm_head weights, the K/V of its own sequences) over
the device-to-device copy bandwidth each rank measures in the same run (the slowest
rank's, as the ranks step in lockstep).

    python -m bench.decode_step --weights fp8 --batches 64 --impls kernels+cuda-graph --profile 5
    python -m bench.decode_step --ep 2 --batches 16 64
    python -m bench.decode_step --ep 2 --weights fp8 --batches 128 --profile 5   # + where the step's time goes
    python -m bench.decode_step --ep 8 --model qwen3-235b-a22b --weights fp8 --batches 32 64 128
"""

from __future__ import annotations

import argparse
import os
import time
import traceback

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch

from bench.decode_budget import EXPERT_WEIGHTS, MODELS, DoesNotFit, check_fits, model_config, step_bytes
from bench.results import print_table, record
from bench.timing import capture_graph, kernel_profile, sync, time_step
from shared.kvcache import KVLayout, PagedKVCache
from shared.model.config import ModelConfig
from shared.model.model import ForwardBatch, Qwen3Model, SequenceChunk
from shared.model.quant_formats import FP8_DTYPE, WEIGHT_BLOCK, BlockFp8Weight, quantize_block_fp8
from shared.model.weights import AttentionWeights, HeadSplit, LayerWeights, Linear, ModelWeights, MoEWeights
from shared.parallel import ShardSpec

BENCH = "decode_step"
REFERENCE, KERNELS, GRAPHED = "torch-reference", "kernels", "kernels+cuda-graph"
EP_NCCL, EP_PEER, EP_PEER_GRAPHED = "kernels", "kernels+peer-moe", "kernels+peer-moe+cuda-graph"  # --ep modes
IMPLS = (REFERENCE, KERNELS, GRAPHED)
HBM_BYTES_PER_S = 4.1e12  # H200 HBM copy bandwidth measured for this project (notes/GPU.md)
PAGE_SIZE = 16



def random_block_fp8(experts: int, rows: int, cols: int, device: torch.device) -> BlockFp8Weight:
    """Random experts ``[experts, rows, cols]`` (std 0.02) in block FP8, quantized one expert at a
    time so that no bf16 copy of all of them is ever held."""
    bn, bk = WEIGHT_BLOCK
    weight = torch.empty(experts, rows, cols, dtype=FP8_DTYPE, device=device)
    scale_inv = torch.empty(experts, -(-rows // bn), -(-cols // bk), dtype=torch.float32, device=device)
    for e in range(experts):
        q = quantize_block_fp8(torch.empty(rows, cols, dtype=torch.bfloat16, device=device).normal_(0.0, 0.02), WEIGHT_BLOCK)
        weight[e], scale_inv[e] = q.weight, q.scale_inv
    return BlockFp8Weight(weight, scale_inv, WEIGHT_BLOCK)


def random_weights(c: ModelConfig, dtype: torch.dtype, device: torch.device, ep_rank: int = 0, ep_size: int = 1, expert_weights: str = "bf16",
                   tp_size: int = 1) -> ModelWeights:
    """Weights drawn on the device (no checkpoint): std 0.02 like HF's init, norms at one.

    Experts: expert-parallel rank ``ep_rank`` of ``ep_size``'s share (all of them by default),
    in ``dtype`` or, with ``expert_weights="fp8"``, block FP8. Attention: the heads of TP rank
    ``ep_rank`` of ``tp_size`` (the prefill layout, where the TP group is the expert group), all by default.
    """

    def w(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02)

    def experts(rows: int, cols: int) -> Linear:
        return random_block_fp8(local, rows, cols, device) if expert_weights == "fp8" else w(local, rows, cols)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype, device=device)

    h, d, i = c.hidden_size, c.head_dim, c.moe_intermediate_size
    local = c.num_experts // ep_size
    heads = HeadSplit.for_rank(c, ShardSpec(tp_rank=ep_rank if tp_size > 1 else 0, tp_size=tp_size))
    layers = [
        LayerWeights(
            input_norm=ones(h),
            post_attention_norm=ones(h),
            attn=AttentionWeights(w(heads.num_q * d, h), w(heads.num_kv * d, h), w(heads.num_kv * d, h), w(h, heads.num_q * d), ones(d), ones(d)),
            mlp=MoEWeights(router=w(c.num_experts, h), w13=experts(2 * i, h), w2=experts(h, i), expert_start=ep_rank * local),
        )
        for _ in range(c.num_layers)
    ]
    return ModelWeights(embed=w(c.vocab_size, h), layers=layers, final_norm=ones(h), lm_head=w(c.vocab_size, h))


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * 10 / (time.perf_counter() - t0)


def cache_and_batches(c: ModelConfig, batch_sizes: list[int], context: int, dtype: torch.dtype, device: torch.device) -> tuple[PagedKVCache, dict[int, ForwardBatch]]:
    """A paged KV cache of random K/V holding ``context`` tokens per sequence, and one
    decode step's batch (one new token per sequence) for each batch size."""
    pages_per_seq = -(-(context + 1) // PAGE_SIZE)
    cache = PagedKVCache(KVLayout(c.num_layers, max(batch_sizes) * pages_per_seq, c.num_kv_heads, PAGE_SIZE, c.head_dim, dtype), device)
    for pool in cache.pools:
        pool.normal_()
    batches = {}
    for b in batch_sizes:
        # Sequence s owns pages [s * pages_per_seq, ...) of the pool, interleaved order to be non-contiguous.
        tables = [[p * max(batch_sizes) + s for p in range(pages_per_seq)] for s in range(b)]
        chunks = [SequenceChunk([(7 * s + 1) % c.vocab_size], context, tables[s]) for s in range(b)]
        batches[b] = ForwardBatch.build(chunks, PAGE_SIZE, device)
    return cache, batches


def model_case(model: str, c: ModelConfig, expert_weights: str) -> dict[str, object]:
    """The model part of a result's case (``expert_weights`` only when not bf16, so older rows keep their case)."""
    case: dict[str, object] = {"model": f"{model}-shapes", "layers": c.num_layers, "experts": c.num_experts, "top_k": c.top_k, "vocab": c.vocab_size}
    return case | ({"expert_weights": expert_weights} if expert_weights != "bf16" else {})


def _expert_parallel_rank(rank: int, world: int, model: str, c: ModelConfig, expert_weights: str, batch_sizes: list[int], context: int, iters: int,
                          profile_steps: int) -> list[dict]:
    """One DP x EP rank; rank 0 records each ``(impl, batch per rank)`` as soon as it is measured
    (a run cut short keeps what it finished) and returns the table rows. With ``profile_steps``
    rank 0 prints the kernel profile of that many graph replays at the largest batch."""
    import torch.distributed as dist

    from shared.parallel import Topology
    from shared.parallel_cuda import CudaCollectives

    device, dtype = torch.device("cuda", rank), torch.bfloat16
    torch.manual_seed(rank)
    # The ranks step in lockstep: the slowest GPU's copy bandwidth bounds them all.
    bandwidth = torch.tensor([copy_bandwidth(device)], device=device)
    dist.all_reduce(bandwidth, op=dist.ReduceOp.MIN)
    topology = Topology.decode(world, rank)
    comm = CudaCollectives(topology)
    weights = random_weights(c, dtype, device, rank, world, expert_weights)
    cache, batches = cache_and_batches(c, batch_sizes, context, dtype, device)
    # Both models share the weights (the first converts the experts for the kernels in place).
    nccl = Qwen3Model(c, weights, topology, comm, kernels=True)
    peer = Qwen3Model(c, weights, topology, comm, kernels=True, max_tokens_per_rank=max(batch_sizes))
    nccl_s: dict[int, float] = {}
    rows: list[dict] = []

    def report(impl: str, b: int, seconds: float) -> None:
        if impl == EP_NCCL:
            nccl_s[b] = seconds
        if rank != 0:
            return
        nbytes, hit = step_bytes(c, b, context, dtype.itemsize, expert_weights, world)
        roof_s = nbytes / bandwidth.item()
        metrics = {"tokens_per_s": b * world / seconds, "tokens_per_s_per_gpu": b / seconds, "step_ms": seconds * 1e3,
                   "roofline_tokens_per_s_per_gpu": b / roof_s, "roofline_step_ms": roof_s * 1e3, "fraction_of_roofline": roof_s / seconds,
                   "bytes_per_step_per_gpu_gb": nbytes / 1e9, "experts_hit_per_layer_per_gpu": hit, "copy_bandwidth_gbps": bandwidth.item() / 1e9}
        peers = {}
        if impl != EP_NCCL:
            metrics["speedup_vs_nccl_all_to_all"] = nccl_s[b] / seconds
            peers[EP_NCCL] = {"tokens_per_s": b * world / nccl_s[b], "step_ms": nccl_s[b] * 1e3}
        case = model_case(model, c, expert_weights) | {"layout": f"dp{world}xep{world}", "batch_per_rank": b, "context": context,
                                                         "dtype": "bfloat16", "impl": impl}
        record(BENCH, case, metrics, peers)
        print(f"{impl} batch/rank {b}: {metrics['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, roofline {metrics['roofline_tokens_per_s_per_gpu']:.0f}", flush=True)
        rows.append({"impl": impl, "batch_per_rank": b, **metrics})

    for b, batch in batches.items():
        report(EP_NCCL, b, time_step(lambda: nccl.forward(batch, cache), device, iters))
    for b, batch in batches.items():
        report(EP_PEER, b, time_step(lambda: peer.forward(batch, cache), device, iters))
    for b, batch in batches.items():
        try:
            replay = capture_graph(lambda: peer.forward(batch, cache), repeat=1, warmup=True).replay
        except Exception:  # capture can fail where eager runs (on every rank alike); keep the eager results
            print(f"rank {rank} {EP_PEER_GRAPHED} batch {b}: capture failed, not recorded:\n{traceback.format_exc()}", flush=True)
            break
        report(EP_PEER_GRAPHED, b, time_step(replay, device, iters))
        if profile_steps and b == max(batch_sizes):
            table = kernel_profile(replay, device, profile_steps)
            if rank == 0:
                print(f"{EP_PEER_GRAPHED} batch/rank {b}, rank 0, {profile_steps} steps:\n{table}", flush=True)
    return rows


def run_expert_parallel(model: str, c: ModelConfig, world: int, expert_weights: str, batch_sizes: list[int], context: int, iters: int,
                        profile_steps: int = 0) -> int:
    """The ``--ep`` mode (see the module doc): one process per GPU, rank 0 records."""
    from kernels._local_group import run_local_group

    rows = run_local_group(_expert_parallel_rank, world, "nccl", model, c, expert_weights, batch_sizes, context, iters, profile_steps, timeout=900)[0]
    print_table(rows, ["impl", "batch_per_rank", "tokens_per_s", "tokens_per_s_per_gpu", "roofline_tokens_per_s_per_gpu", "fraction_of_roofline",
                       "step_ms", "speedup_vs_nccl_all_to_all", "bytes_per_step_per_gpu_gb", "experts_hit_per_layer_per_gpu", "copy_bandwidth_gbps"])
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=512, help="tokens already cached per sequence")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS),
                    help="single-GPU implementations to run, reference first when present (--ep runs its own three)")
    ap.add_argument("--layers", type=int, default=None, help="override (fewer layers to save time; recorded in the case)")
    ap.add_argument("--experts", type=int, default=None, help="override (quick CPU checks)")
    ap.add_argument("--vocab", type=int, default=None, help="override (quick CPU checks)")
    ap.add_argument("--ep", type=int, default=1, help="GPUs of a DP x EP decode layout (one process each; see the module doc)")
    ap.add_argument("--model", choices=list(MODELS), default="qwen3-30b-a3b", help="shapes (bench.decode_budget.MODELS)")
    ap.add_argument("--weights", choices=EXPERT_WEIGHTS, default="bf16", help="expert weights: bf16 or block FP8 (attention etc. stay bf16)")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="print the kernel profile of STEPS graph replays at the largest batch (with --ep: rank 0's)")
    a = ap.parse_args(argv)
    device, dtype = torch.device(a.device), torch.bfloat16
    if min(a.batches) < 1 or a.context < 0:
        ap.error("--batches must be positive and --context not negative")
    c = model_config(a.model, layers=a.layers, experts=a.experts, vocab=a.vocab)
    if a.ep < 1 or c.num_experts % a.ep:
        ap.error(f"--ep {a.ep}: {c.num_experts} experts do not split evenly over {a.ep} GPUs")
    if device.type != "cuda" and a.ep > 1:
        ap.error("--ep needs CUDA devices")
    if device.type != "cuda" and a.ep == 1 and GRAPHED in a.impls:
        ap.error(f"{GRAPHED} needs a CUDA device")
    if device.type == "cuda":
        if a.ep > torch.cuda.device_count():
            ap.error(f"--ep {a.ep} needs {a.ep} GPUs (one rank each), {torch.cuda.device_count()} visible")
        try:
            check_fits(a.model, c, a.ep, max(a.batches), a.context, PAGE_SIZE, a.weights, torch.cuda.get_device_properties(device).total_memory)
        except DoesNotFit as e:
            ap.error(str(e))
    if a.ep > 1:
        return run_expert_parallel(a.model, c, a.ep, a.weights, a.batches, a.context, a.iters, a.profile)
    torch.manual_seed(0)
    weights = random_weights(c, dtype, device, expert_weights=a.weights)
    cache, batches = cache_and_batches(c, a.batches, a.context, dtype, device)
    bandwidth = copy_bandwidth(device)

    step_s: dict[tuple[str, int], float] = {}
    rows = []

    def report(impl: str, b: int, seconds: float) -> None:
        step_s[(impl, b)] = seconds
        nbytes, experts_hit = step_bytes(c, b, a.context, dtype.itemsize, a.weights)
        roof_s = nbytes / HBM_BYTES_PER_S
        metrics = {
            "tokens_per_s": b / seconds,
            "step_ms": seconds * 1e3,
            "roofline_tokens_per_s": b / roof_s,
            "roofline_step_ms": roof_s * 1e3,
            "fraction_of_roofline": roof_s / seconds,
            "bytes_per_step_gb": nbytes / 1e9,
            "experts_hit_per_layer": experts_hit,
            "copy_bandwidth_gbps": bandwidth / 1e9,
        }
        peers = {}
        ref = step_s.get((REFERENCE, b))
        if impl != REFERENCE and ref is not None:
            metrics["speedup_vs_reference"] = ref / seconds
            peers[REFERENCE] = {"tokens_per_s": b / ref, "step_ms": ref * 1e3}
        case = model_case(a.model, c, a.weights) | {"batch": b, "context": a.context, "dtype": "bfloat16", "impl": impl}
        record(BENCH, case, metrics, peers)
        rows.append({"impl": impl, "batch": b, **metrics})

    # The reference first: converting the experts for the kernels replaces their plain layout.
    if REFERENCE in a.impls:
        model = Qwen3Model(c, weights, kernels=False)
        for b, batch in batches.items():
            report(REFERENCE, b, time_step(lambda: model.forward(batch, cache), device, a.iters))
    if KERNELS in a.impls or GRAPHED in a.impls:
        model = Qwen3Model(c, weights, kernels=True)
        if KERNELS in a.impls:
            for b, batch in batches.items():
                report(KERNELS, b, time_step(lambda: model.forward(batch, cache), device, a.iters))
        if GRAPHED in a.impls:
            for b, batch in batches.items():
                try:
                    replay = capture_graph(lambda: model.forward(batch, cache), repeat=1, warmup=True).replay
                except Exception:  # capture can fail where eager runs; report it and keep the eager results
                    print(f"{GRAPHED} batch {b}: capture failed, not recorded:\n{traceback.format_exc()}", flush=True)
                    break
                report(GRAPHED, b, time_step(replay, device, a.iters))
                if a.profile and b == max(a.batches):
                    print(f"{GRAPHED} batch {b}, {a.profile} steps:\n{kernel_profile(replay, device, a.profile)}", flush=True)
    print_table(rows, ["impl", "batch", "tokens_per_s", "step_ms", "speedup_vs_reference", "roofline_tokens_per_s", "fraction_of_roofline",
                       "bytes_per_step_gb", "experts_hit_per_layer", "copy_bandwidth_gbps"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
