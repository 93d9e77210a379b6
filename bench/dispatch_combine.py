"""Decode DP-EP dispatch + combine on W GPUs: peer-memory kernels vs the NCCL reference.

hidden 4096, 128 experts (128 / W per rank), top-8, bf16 payload (and FP8 for ours),
1 / 32 / 128 / 256 tokens per rank (``--tokens``), random routing over all experts.
W = ``--world`` (default 2, the first W GPUs; EP sizes 2..16 that divide 128), recorded as
``ep`` in each case.

* ours: ``rounds`` full rounds (dispatch_send, dispatch_recv, combine_send,
  combine_recv; no expert compute in between) captured in one CUDA graph: per-round
  time = median replay / rounds. Dispatch and combine alone: a graph per phase
  pair, replayed alternately between events (these include one graph launch each).
  At the default grid (`ctas_per_peer`) for bf16 and FP8; bf16 rounds also with
  ``CPP_SWEEP`` CTAs per peer, to see how the grid size moves the time.
* reference: `DispatchCombineReference` over NCCL ``all_to_all_single`` (it needs
  host-side split sizes, so it runs eagerly), dispatch and combine timed separately.
* ``nccl_a2a_only``: one ``all_to_all_single`` of the dispatch payload, graph-timed —
  the floor of any NCCL-based dispatch, before routing work.

    python -m bench.dispatch_combine [--world 8] [--tokens 1 32 128 256]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.distributed as dist

from bench.timing import capture_graph, ranks_time_us
from kernels._local_group import run_local_group

HIDDEN, EXPERTS, TOPK = 4096, 128, 8
TOKENS = (1, 32, 128, 256)
CPP_SWEEP = (64, 128)  # other CTAs-per-peer grid sizes timed for bf16 (each on its own peer memory)


def _time_phases(dc, x, ids, w, n, y, out, row: dict, key: str, split: bool) -> None:
    """Round time (``rounds`` rounds in one graph) and, with ``split``, dispatch and combine alone."""

    def dispatch():
        dc.dispatch_send(x, ids, w, n)
        dc.dispatch_recv()

    def combine():
        dc.combine_send(y)
        dc.combine_recv(ids, n, out)

    def round_():
        dispatch()
        combine()

    round_()
    rounds = 20
    full = capture_graph(round_, rounds)
    row[f"{key}_round_us"] = ranks_time_us(full.replay, reps=10) / rounds
    if not split:
        return
    g_dispatch, g_combine = capture_graph(dispatch, 1), capture_graph(combine, 1)
    d_times, c_times = [], []
    for _ in range(30):
        dist.barrier()
        torch.cuda.synchronize()
        e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        e[0].record()
        g_dispatch.replay()
        e[1].record()
        g_combine.replay()
        e[2].record()
        e[2].synchronize()
        d_times.append(e[0].elapsed_time(e[1]) * 1e3)
        c_times.append(e[1].elapsed_time(e[2]) * 1e3)
    row[f"{key}_dispatch_us"] = statistics.median(d_times)
    row[f"{key}_combine_us"] = statistics.median(c_times)


def _bench_rank(rank: int, world: int, token_counts: list[int]) -> list[dict]:
    from kernels.dispatch_combine import DispatchCombine, DispatchCombineReference, ctas_per_peer

    rows = []
    for tokens in token_counts:
        g = torch.Generator(device="cuda").manual_seed(tokens * 10 + rank)
        x = torch.randn(tokens, HIDDEN, generator=g, device="cuda").bfloat16()
        ids = torch.rand(tokens, EXPERTS, generator=g, device="cuda").topk(TOPK, dim=1).indices.int().contiguous()
        w = torch.rand(tokens, TOPK, generator=g, device="cuda")
        n = torch.tensor([tokens], dtype=torch.int32, device="cuda")
        out = torch.empty(tokens, HIDDEN, dtype=torch.bfloat16, device="cuda")
        default_cpp = ctas_per_peer(tokens, world)
        row = {"tokens": tokens, "ctas_per_peer": default_cpp}
        # (payload, CTAs per peer, metric key): the defaults, then other grid sizes for bf16.
        variants = [("bf16", default_cpp, "ours_bf16"), ("fp8", default_cpp, "ours_fp8")]
        variants += [("bf16", c, f"ours_bf16_cpp{c}") for c in CPP_SWEEP if c < tokens and c != default_cpp]
        for payload, cpp, key in variants:
            dc = DispatchCombine(dist.group.WORLD, EXPERTS, tokens, HIDDEN, TOPK, payload, cpp=cpp)
            y = torch.randn(dc.num_local, dc.capacity, HIDDEN, device="cuda").bfloat16()
            _time_phases(dc, x, ids, w, n, y, out, row, key, split=cpp == default_cpp)
            del dc
            torch.cuda.synchronize()
            dist.barrier()

        ref = DispatchCombineReference(dist.group.WORLD, EXPERTS, tokens, HIDDEN, TOPK)
        recv = ref.dispatch(x, ids, w, n)
        y_ref = torch.randn(recv[0].shape, device="cuda").bfloat16()
        row["ref_dispatch_us"] = ranks_time_us(lambda: ref.dispatch(x, ids, w, n), reps=20)
        row["ref_combine_us"] = ranks_time_us(lambda: ref.combine(y_ref, recv[2], recv[3], ids, n), reps=20)
        a2a_in = torch.randn(tokens * TOPK * HIDDEN, device="cuda").bfloat16()
        a2a_out = torch.empty_like(a2a_in)
        graph = capture_graph(lambda: dist.all_to_all_single(a2a_out, a2a_in), 10)
        row["nccl_a2a_only_us"] = ranks_time_us(graph.replay, reps=10) / 10
        rows.append(row)
    return rows


def check_world(world: int, gpus: int) -> str | None:
    """Why ``world`` ranks cannot run here with ``gpus`` visible GPUs (None when they can)."""
    from kernels._cute_comm import MAX_PEERS

    if not 2 <= world <= MAX_PEERS:
        return f"--world {world}: the dispatch/combine kernels take EP sizes 2..{MAX_PEERS}"
    if EXPERTS % world:
        return f"--world {world}: {EXPERTS} experts do not split evenly over {world} ranks"
    if world > gpus:
        return f"--world {world} needs {world} GPUs (one rank each), {gpus} visible"
    return None


def main(argv: list[str] | None = None) -> int:
    from bench.results import print_table, record

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2, help="EP size: ranks, one per GPU (GPUs 0..W-1)")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="tokens per rank")
    a = ap.parse_args(argv)
    if min(a.tokens) < 1:
        ap.error(f"--tokens must be positive, got {a.tokens}")
    problem = check_world(a.world, torch.cuda.device_count())
    if problem:
        ap.error(problem)
    world = a.world
    rows = run_local_group(_bench_rank, world, "nccl", a.tokens, timeout=600)[0]
    table = []
    for r in rows:
        case = {"tokens_per_rank": r["tokens"], "hidden": HIDDEN, "experts": EXPERTS, "topk": TOPK, "ep": world, "timing": "cuda_graph",
                "ctas_per_peer": r["ctas_per_peer"]}
        ref_total = r["ref_dispatch_us"] + r["ref_combine_us"]
        metrics = {k[5:]: v for k, v in r.items() if k.startswith("ours_")}
        metrics["speedup_bf16_round_vs_reference"] = ref_total / r["ours_bf16_round_us"]
        peers = {"nccl_all_to_all_reference": {"dispatch_us": r["ref_dispatch_us"], "combine_us": r["ref_combine_us"], "round_us": ref_total},
                 "nccl_a2a_only": {"latency_us": r["nccl_a2a_only_us"]}}
        record("dispatch_combine", case, metrics, peers)
        table.append({"tokens": r["tokens"], "bf16_round": r["ours_bf16_round_us"], "bf16_disp": r["ours_bf16_dispatch_us"],
                      "bf16_comb": r["ours_bf16_combine_us"], "fp8_round": r["ours_fp8_round_us"], "ref_disp": r["ref_dispatch_us"],
                      "ref_comb": r["ref_combine_us"], "speedup": ref_total / r["ours_bf16_round_us"], "a2a_only": r["nccl_a2a_only_us"],
                      "cpp": r["ctas_per_peer"], **{f"bf16_cpp{c}": r.get(f"ours_bf16_cpp{c}_round_us", "") for c in CPP_SWEEP}})
    print_table(table, list(table[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
