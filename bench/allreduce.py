"""All-reduce on W GPUs: our CuTeDSL kernels vs NCCL vs torch symmetric memory.

Every implementation is timed the same way: ``ops`` all-reduces captured in one
CUDA graph, the graph replayed ``reps`` times between CUDA events, per-op time =
median replay time / ops. Sizes 8 KiB .. 256 MiB of bf16, doubling. Peers, same
run: ``nccl`` (torch.distributed, NVLS off), ``symm_one_shot`` / ``symm_two_shot``
(``torch.ops.symm_mem.one_shot_all_reduce`` / ``two_shot_all_reduce_``, multicast
disabled, in place on a symmetric buffer), our kernels forced to one-shot (up to
32 MiB) / two-shot (every size) — the rows the one-/two-shot threshold is read
from — and, from 16 MiB, our two-shot with other pipeline steps and CTA counts
(``ours_two_shot_step<MiB>M``, ``ours_two_shot_ctas<n>``), the rows the two-shot
defaults are read from. Bus bandwidth is ``bytes * 2 (W-1) / W / time`` (the
NCCL convention).

    python -m bench.allreduce [--max-mib 256] [--world W]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.distributed as dist

from bench.timing import capture_graph, event_time_us
from kernels._local_group import run_local_group

KIB, MIB = 1 << 10, 1 << 20
ONE_SHOT_MAX_TIMED = 32 * MIB
STEP_VARIANTS_MIB = (8, 32, 64)
CTA_VARIANTS = (132, 66)


def _sizes(max_bytes: int) -> list[int]:
    sizes, s = [], 8 * KIB
    while s <= max_bytes:
        sizes.append(s)
        s *= 2
    return sizes


def _ops_for(nbytes: int) -> int:
    return 64 if nbytes <= MIB else 16 if nbytes <= 16 * MIB else 4


def _time_graph(fn, ops: int, reps: int = 7) -> float:
    """Median per-op microseconds of ``ops`` calls of ``fn`` captured in one graph."""
    graph = capture_graph(fn, ops, warmup=True)
    times = []
    for _ in range(reps + 1):
        dist.barrier()
        torch.cuda.synchronize()
        times.append(event_time_us(graph.replay) / ops)
    return statistics.median(times[1:])  # the first replay pays one-time costs


def _with(comm, attr: str, value, fn):
    """``fn`` run with ``comm.<attr>`` set to ``value`` for the call (also while capturing)."""
    def call():
        saved = getattr(comm, attr)
        setattr(comm, attr, value)
        try:
            return fn()
        finally:
            setattr(comm, attr, saved)
    return call


def _bench_rank(rank: int, world: int, max_bytes: int) -> list[dict]:
    import torch.distributed._symmetric_memory as symm_mem

    from kernels.allreduce import CudaAllReduce

    group = dist.group.WORLD
    comm = CudaAllReduce(group)
    comm.warmup((torch.bfloat16,))
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(group.group_name)
    symm_buf = symm_mem.empty(max_bytes // 2, dtype=torch.bfloat16, device="cuda")
    symm_mem.rendezvous(symm_buf, group)
    has_symm_ops = hasattr(torch.ops, "symm_mem") and hasattr(torch.ops.symm_mem, "two_shot_all_reduce_")
    rows = []
    for nbytes in _sizes(max_bytes):
        n = nbytes // 2
        x = torch.randn(n, device="cuda").bfloat16()
        out = torch.empty_like(x)
        nccl_buf = x.clone()
        sx = symm_buf[:n]
        sx.copy_(x)
        ops = _ops_for(nbytes)
        two_shot = lambda: comm(x, out=out, algorithm="two_shot")  # noqa: E731
        cases = {
            "ours": lambda: comm(x, out=out),
            "ours_two_shot": two_shot,
            "nccl": lambda: dist.all_reduce(nccl_buf),
        }
        if nbytes <= ONE_SHOT_MAX_TIMED:
            cases["ours_one_shot"] = lambda: comm(x, out=out, algorithm="one_shot")
        if nbytes >= 16 * MIB:
            for step in STEP_VARIANTS_MIB:
                cases[f"ours_two_shot_step{step}M"] = _with(comm, "two_shot_chunk_bytes", step * MIB, two_shot)
            for ctas in CTA_VARIANTS:
                cases[f"ours_two_shot_ctas{ctas}"] = _with(comm, "max_blocks", ctas, two_shot)
        if has_symm_ops:
            cases["symm_two_shot"] = lambda: torch.ops.symm_mem.two_shot_all_reduce_(sx, "sum", group.group_name)
            if nbytes <= ONE_SHOT_MAX_TIMED:
                cases["symm_one_shot"] = lambda: torch.ops.symm_mem.one_shot_all_reduce(sx, "sum", group.group_name)
        row = {"bytes": nbytes, "algorithm": comm.choose(nbytes)}
        for name, fn in cases.items():
            try:
                row[name] = _time_graph(fn, ops)
            except RuntimeError as e:  # a peer op that cannot run here is reported, not fatal
                row[name] = float("nan")
                print(f"rank {rank}: {name} at {nbytes} B failed: {e}", file=sys.stderr)
            # the NCCL and symm-mem buffers grow by x world per op; keep them finite
            nccl_buf.copy_(x)
            sx.copy_(x)
        rows.append(row)
        if rank == 0:  # record as we go: a run cut short keeps the sizes it finished
            _record(row, world)
    return rows


def _busbw(nbytes: int, world: int, us: float) -> float:
    return nbytes * 2 * (world - 1) / world / (us * 1e-6) / 1e9


def _record(r: dict, world: int) -> None:
    from bench.results import record

    peers = {k: {"latency_us": v, "busbw_gbps": _busbw(r["bytes"], world, v)} for k, v in r.items() if k not in ("bytes", "algorithm", "ours")}
    record("allreduce", {"bytes": r["bytes"], "dtype": "bf16", "world": world, "algorithm": r["algorithm"], "timing": "cuda_graph"},
           {"latency_us": r["ours"], "busbw_gbps": _busbw(r["bytes"], world, r["ours"]), "vs_nccl_latency_ratio": r["ours"] / r["nccl"],
            "vs_nccl_busbw_ratio": r["nccl"] / r["ours"]}, peers)
    print(f"{_fmt_size(r['bytes'])}: ours {r['ours']:.1f} us, nccl {r['nccl']:.1f} us", flush=True)


def main(argv: list[str] | None = None) -> int:
    from bench.results import print_table

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-mib", type=int, default=256)
    p.add_argument("--world", type=int, default=torch.cuda.device_count())
    args = p.parse_args(argv)
    world = args.world
    rows = run_local_group(_bench_rank, world, "nccl", args.max_mib * MIB, timeout=900)[0]
    nan = float("nan")
    table = []
    for r in rows:
        busbw = lambda us: _busbw(r["bytes"], world, us)  # noqa: E731
        best_variant = min((v for k, v in r.items() if k.startswith("ours_two_shot_")), default=nan)
        table.append({"size": _fmt_size(r["bytes"]), "algo": r["algorithm"], "ours_us": r["ours"], "nccl_us": r["nccl"],
                      "ours/nccl": r["ours"] / r["nccl"], "ours_1shot": r.get("ours_one_shot", nan),
                      "ours_2shot": r["ours_two_shot"], "2shot_best_variant": best_variant,
                      "symm_1shot": r.get("symm_one_shot", nan), "symm_2shot": r.get("symm_two_shot", nan),
                      "ours_busbw": busbw(r["ours"]), "nccl_busbw": busbw(r["nccl"]), "busbw_vs_nccl": r["nccl"] / r["ours"]})
    print_table(table, list(table[0]))
    return 0


def _fmt_size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


if __name__ == "__main__":
    sys.exit(main())
