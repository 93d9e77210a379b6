"""All-reduce on W GPUs: our CuTeDSL kernels vs NCCL vs torch symmetric memory.

Every implementation is timed the same way: ``ops`` all-reduces captured in one
CUDA graph, the graph replayed ``reps`` times between CUDA events, per-op time =
median replay time / ops. Sizes 8 KiB .. ``--max-mib`` of bf16, doubling, then the
``--also-mib`` sizes (only ``ours`` and ``nccl``). Peers, same run: ``nccl``
(torch.distributed, NVLS off), ``symm_one_shot`` / ``symm_two_shot``
(``torch.ops.symm_mem.one_shot_all_reduce`` / ``two_shot_all_reduce_``, multicast
disabled, in place on a symmetric buffer), our kernels forced to each algorithm
(``ours_lamport`` up to the Lamport slot size, ``ours_lamport_two_shot`` up to 16 MiB,
``ours_one_shot`` up to 32 MiB, ``ours_two_shot`` at every size) — the rows the
switches are read from — and the launch-shape variants the defaults are read from: up
to 4 MiB the two one-shot kernels and the data-as-flag two-shot with other threads per
CTA and CTA caps (``ours_lamport_t<threads>``, ``ours_lamport_ctas<n>``,
``ours_one_shot_t<threads>``, ``ours_lamport_two_shot_t<threads>``,
``ours_lamport_two_shot_ctas<n>``), from 16 MiB the two-shot
with other pipeline steps and CTA counts (``ours_two_shot_step<MiB>M``,
``ours_two_shot_ctas<n>``). Bus bandwidth is ``bytes * 2 (W-1) / W / time`` (the
NCCL convention).

    python -m bench.allreduce [--max-mib 256] [--also-mib 64 256] [--world W]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys

import torch
import torch.distributed as dist

from bench.timing import capture_graph, event_time_us
from kernels._local_group import run_local_group

KIB, MIB = 1 << 10, 1 << 20
ONE_SHOT_MAX_TIMED = 32 * MIB
LAMPORT_TWO_SHOT_MAX_TIMED = 16 * MIB
STEP_VARIANTS_MIB = (8, 32, 64)
CTA_VARIANTS = (132, 66)
ONE_SHOT_VARIANTS_MAX = 4 * MIB
LAMPORT_THREAD_VARIANTS = (128, 256, 1024)
LAMPORT_CTA_VARIANTS = (132, 66)
ONE_SHOT_THREAD_VARIANTS = (256, 1024)
LAMPORT_TWO_SHOT_THREAD_VARIANTS = (128, 256, 512, 1024)  # less the default
# Launch-shape variants in the table: of the one-shot kernels, of the data-as-flag two-shot.
ONE_SHOT_VARIANT = re.compile(r"ours_(lamport|one_shot)_(t|ctas)\d+$")
LAMPORT_TWO_SHOT_VARIANT = re.compile(r"ours_lamport_two_shot_(t|ctas)\d+$")


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


def _bench_rank(rank: int, world: int, max_bytes: int, also_bytes: list[int]) -> list[dict]:
    import torch.distributed._symmetric_memory as symm_mem

    from kernels.allreduce import CudaAllReduce

    group = dist.group.WORLD
    comm = CudaAllReduce(group)
    comm.warmup((torch.bfloat16,))
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(group.group_name)
    symm_buf = symm_mem.empty(max_bytes // 2, dtype=torch.bfloat16, device="cuda")
    symm_mem.rendezvous(symm_buf, group)
    sizes = _sizes(max_bytes) + [b for b in also_bytes if b > max_bytes]
    has_symm_ops = hasattr(torch.ops, "symm_mem") and hasattr(torch.ops.symm_mem, "two_shot_all_reduce_")
    rows = []
    for nbytes in sizes:
        n = nbytes // 2
        x = torch.randn(n, device="cuda").bfloat16()
        out = torch.empty_like(x)
        nccl_buf = x.clone()
        ops = _ops_for(nbytes)
        cases = {"ours": lambda: comm(x, out=out), "nccl": lambda: dist.all_reduce(nccl_buf)}
        row = {"bytes": nbytes, "algorithm": comm.choose(nbytes)}
        if nbytes > max_bytes:  # an --also-mib size: the default and NCCL only
            rows.append(_time_cases(row, cases, ops, rank, x, [nccl_buf]))
            if rank == 0:
                _record(row, world)
            continue
        sx = symm_buf[:n]
        sx.copy_(x)
        two_shot = lambda: comm(x, out=out, algorithm="two_shot")  # noqa: E731
        lamport = lambda: comm(x, out=out, algorithm="lamport")  # noqa: E731
        one_shot = lambda: comm(x, out=out, algorithm="one_shot")  # noqa: E731
        lamport_two_shot = lambda: comm(x, out=out, algorithm="lamport_two_shot")  # noqa: E731
        cases["ours_two_shot"] = two_shot
        if nbytes <= comm.lamport_slot_bytes:
            cases["ours_lamport"] = lamport
        if nbytes <= LAMPORT_TWO_SHOT_MAX_TIMED:
            cases["ours_lamport_two_shot"] = lamport_two_shot
        if nbytes <= ONE_SHOT_MAX_TIMED:
            cases["ours_one_shot"] = one_shot
        if nbytes <= ONE_SHOT_VARIANTS_MAX:
            for threads in LAMPORT_THREAD_VARIANTS:
                cases[f"ours_lamport_t{threads}"] = _with(comm, "one_shot_threads", threads, lamport)
            for ctas in LAMPORT_CTA_VARIANTS:
                cases[f"ours_lamport_ctas{ctas}"] = _with(comm, "max_blocks", ctas, lamport)
            for threads in ONE_SHOT_THREAD_VARIANTS:
                cases[f"ours_one_shot_t{threads}"] = _with(comm, "one_shot_threads", threads, one_shot)
            for threads in (t for t in LAMPORT_TWO_SHOT_THREAD_VARIANTS if t != comm.lamport_two_shot_threads):
                cases[f"ours_lamport_two_shot_t{threads}"] = _with(comm, "lamport_two_shot_threads", threads, lamport_two_shot)
            for ctas in LAMPORT_CTA_VARIANTS:
                cases[f"ours_lamport_two_shot_ctas{ctas}"] = _with(comm, "max_blocks", ctas, lamport_two_shot)
        if nbytes >= 16 * MIB:
            for step in STEP_VARIANTS_MIB:
                cases[f"ours_two_shot_step{step}M"] = _with(comm, "two_shot_chunk_bytes", step * MIB, two_shot)
            for ctas in CTA_VARIANTS:
                cases[f"ours_two_shot_ctas{ctas}"] = _with(comm, "max_blocks", ctas, two_shot)
        if has_symm_ops:
            cases["symm_two_shot"] = lambda: torch.ops.symm_mem.two_shot_all_reduce_(sx, "sum", group.group_name)
            if nbytes <= ONE_SHOT_MAX_TIMED:
                cases["symm_one_shot"] = lambda: torch.ops.symm_mem.one_shot_all_reduce(sx, "sum", group.group_name)
        rows.append(_time_cases(row, cases, ops, rank, x, [nccl_buf, sx]))
        if rank == 0:  # record as we go: a run cut short keeps the sizes it finished
            _record(row, world)
    return rows


def _time_cases(row: dict, cases: dict, ops: int, rank: int, x: torch.Tensor, in_place: list[torch.Tensor]) -> dict:
    """Time every case into ``row``; the ``in_place`` buffers are reset to ``x`` after each case."""
    for name, fn in cases.items():
        try:
            row[name] = _time_graph(fn, ops)
        except RuntimeError as e:  # a peer op that cannot run here is reported, not fatal
            row[name] = float("nan")
            print(f"rank {rank}: {name} at {row['bytes']} B failed: {e}", file=sys.stderr)
        # the NCCL and symm-mem buffers grow by x world per op; keep them finite
        for buf in in_place:
            buf.copy_(x)
    return row


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
    p.add_argument("--also-mib", type=int, nargs="*", default=[], help="extra sizes above --max-mib: default and NCCL only")
    p.add_argument("--world", type=int, default=torch.cuda.device_count())
    args = p.parse_args(argv)
    world = args.world
    rows = run_local_group(_bench_rank, world, "nccl", args.max_mib * MIB, [m * MIB for m in args.also_mib], timeout=900)[0]
    nan = float("nan")
    table = []
    for r in rows:
        busbw = lambda us: _busbw(r["bytes"], world, us)  # noqa: E731
        best = lambda prefix: min((v for k, v in r.items() if k.startswith(prefix)), default=nan)  # noqa: E731
        variants = {k: v for k, v in r.items() if ONE_SHOT_VARIANT.match(k)}
        best_1shot_variant = min(variants, key=variants.get, default="-")
        l2s_variants = {k: v for k, v in r.items() if LAMPORT_TWO_SHOT_VARIANT.match(k)}
        best_l2s_variant = min(l2s_variants, key=l2s_variants.get, default="-")
        table.append({"size": _fmt_size(r["bytes"]), "algo": r["algorithm"], "ours_us": r["ours"], "nccl_us": r["nccl"],
                      "ours/nccl": r["ours"] / r["nccl"], "ours_lamport": r.get("ours_lamport", nan),
                      "ours_1shot": r.get("ours_one_shot", nan), "best_1shot_variant": best_1shot_variant,
                      "its_us": variants.get(best_1shot_variant, nan),
                      "ours_lamport_2shot": r.get("ours_lamport_two_shot", nan),
                      "best_l2shot_variant": best_l2s_variant.removeprefix("ours_lamport_two_shot_"),
                      "l2shot_variant_us": l2s_variants.get(best_l2s_variant, nan),
                      "ours_2shot": r.get("ours_two_shot", nan), "2shot_best_variant": best("ours_two_shot_"),
                      "symm_1shot": r.get("symm_one_shot", nan), "symm_2shot": r.get("symm_two_shot", nan),
                      "ours_busbw": busbw(r["ours"]), "nccl_busbw": busbw(r["nccl"]), "busbw_vs_nccl": r["nccl"] / r["ours"]})
    print_table(table, list(table[0]))
    return 0


def _fmt_size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


if __name__ == "__main__":
    sys.exit(main())
