"""KV copy kernel alone: one request's KV pages GPU 0 -> GPU 1 over NVLink.

What the CUDA IPC transfer's write costs without the transfer around it (issue 3): the
Qwen3-235B KV (94 layers, 4 KV heads, head_dim 128, bf16) of one request, every layer in
one launch of ``kernels.kv_copy.KVCopy``, from a pool on GPU 0 into scattered pages of a
pool on GPU 1 (peer access between the two, as the IPC mapping gives), against one torch
copy of all 4 heads' bytes GPU 0 -> GPU 1 (the copy engines) in the same run. Layouts:

* ``tp1``        - all 4 heads, page 16 -> 16: one row per page (32 KiB rows);
* ``shard2``     - 2 heads into heads [2, 4), page 16 -> 16: one row per K/V half (8 KiB);
* ``pages32``    - all 4 heads, page 32 -> 16: one row per head and block (4 KiB).

Each layout's copy is checked byte for byte against the torch reference at the first
prompt length (destination poisoned first), then timed: median wall time of ``--iters``
copies, both GPUs synchronized before and after each, the kernel and the peer copy taking
turns. Host cost, as a transfer meets it (once per request, after the process idled):
``setup_us`` (building the ``KVCopy`` along the layout's kept ``CopyRoute``: launch
parameters and page tables uploaded) and
``launch_us`` (one ``copy`` call of every layer), each the median over ``--iters`` calls
made 20 ms after the previous one.

A bulk-copy-engine path (``cp.async.bulk`` global -> shared -> peer global, a334c51) was
measured here against the kernel's register path and dropped: over 7 shapes (8-16 KiB
chunks, 2-8 stages, 1-4 CTAs per SM) it wrote 351-368 GB/s, the register path 356-367 in
the same layouts, the best bulk shape at most 1% above it (6k and 32k tokens, peer copy
386-395; bench/results/kv_copy.jsonl, 21ebb95+h29-bulk2): SM-issued writes over NVLink
top out there whichever unit issues them.

    python -m bench.kv_copy --tokens 6144,32768
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.results import print_table, record
from kernels.kv_copy import CopyRoute, KVCopy, kv_copy_reference, prepare_kv_copy
from shared.transfer.direct_write import plan_rows

BENCH = "kv_copy"
DTYPE = torch.bfloat16
LAYOUTS = {  # name -> (source heads, head start, source page size, destination page size)
    "tp1": (4, 0, 16, 16),
    "shard2": (2, 2, 16, 16),
    "pages32": (4, 0, 32, 16),
}


def _wall_s(fn, iters: int) -> float:
    times = []
    for _ in range(iters + 1):
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _host_costs(build, layers: int, iters: int) -> tuple[float, float]:
    """Median host seconds of building a copy and of launching it, each call 20 ms after the
    last (the copies run between the calls: only the host's part is timed)."""
    setup, launch = [], []
    for _ in range(iters):
        time.sleep(0.02)
        t0 = time.perf_counter()
        copy = build()
        setup.append(time.perf_counter() - t0)
        time.sleep(0.02)
        t0 = time.perf_counter()
        copy.copy(range(layers))
        launch.append(time.perf_counter() - t0)
        torch.cuda.synchronize(0)
    return statistics.median(setup), statistics.median(launch)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="6144,32768")
    ap.add_argument("--layers", type=int, default=94)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < 2:
        raise SystemExit("bench.kv_copy needs 2 GPUs")
    src_dev, dst_dev = torch.device("cuda", 0), torch.device("cuda", 1)
    torch.cuda.set_device(src_dev)
    prepare_kv_copy(src_dev, 16)
    rows = []
    for n, tokens in enumerate(int(t) for t in args.tokens.split(",")):
        nbytes = tokens * args.layers * 2 * 4 * args.head_dim * DTYPE.itemsize
        flat_src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=src_dev)
        flat_dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)
        _wall_s(lambda: flat_dst.copy_(flat_src), 1)  # also enables peer access GPU 0 -> GPU 1
        for layout in args.layouts.split(","):
            src_heads, head_start, src_ps, dst_ps = LAYOUTS[layout]
            src_pages, dst_pages = -(-tokens // src_ps), -(-tokens // dst_ps)
            src = torch.randn(args.layers, src_pages + 4, 2, src_heads, src_ps, args.head_dim, device=src_dev).to(DTYPE)
            dst = torch.empty(args.layers, 2 * dst_pages + 4, 2, 4, dst_ps, args.head_dim, dtype=DTYPE, device=dst_dev)
            g = torch.Generator().manual_seed(tokens)
            src_table = torch.randperm(src_pages + 4, generator=g)[:src_pages]
            dst_table = torch.randperm(2 * dst_pages + 4, generator=g)[:dst_pages]
            rows_of = plan_rows(src, dst, head_start)
            route = CopyRoute(src, dst, rows_of)  # kept per pool pair, as a sender keeps it per storage pair
            moved = tokens * args.layers * 2 * src_heads * args.head_dim * DTYPE.itemsize
            copy = KVCopy(route, src_table, dst_table, tokens)
            runs = {"register": lambda: copy.copy(range(args.layers))}  # the kernel's one path (module doc)
            checked: dict[str, bool | str] = {name: "" for name in runs}
            if n == 0:  # byte for byte against the reference, the destination poisoned before each copy
                dst.view(torch.uint8).fill_(0xFF)
                expected = dst.clone()
                kv_copy_reference(src.to(dst_dev), src_table.to(dst_dev), expected, dst_table.to(dst_dev), range(args.layers), head_start, tokens)
                for name, run in runs.items():
                    dst.view(torch.uint8).fill_(0xFF)
                    torch.cuda.synchronize(dst_dev)  # the fill runs on GPU 1's stream, the copy on GPU 0's
                    run()
                    torch.cuda.synchronize(src_dev)
                    checked[name] = bool(torch.equal(dst.view(torch.uint8), expected.view(torch.uint8)))
                    if not checked[name]:
                        raise SystemExit(f"{layout} {name} at {tokens} tokens: the copy differs from the reference")
                del expected
            setup_s, launch_s = _host_costs(lambda: KVCopy(route, src_table, dst_table, tokens), args.layers, args.iters)
            times: dict[str, list[float]] = {name: [] for name in [*runs, "peer copy"]}
            for _ in range(args.iters):  # the kernel and the peer copy take turns, so a drift of clocks or link hits both alike
                for name, run in runs.items():
                    times[name].append(_wall_s(run, 1))
                times["peer copy"].append(_wall_s(lambda: flat_dst.copy_(flat_src), 1))
            peer_s = statistics.median(times["peer copy"])
            for name in runs:
                seconds = statistics.median(times[name])
                metrics = {"gbps": moved / seconds / 1e9, "latency_us": seconds * 1e6, "ratio_to_peer_copy": (moved / seconds) / (nbytes / peer_s),
                           "setup_us": setup_s * 1e6, "launch_us": launch_s * 1e6}
                case = {"tokens": tokens, "layout": layout, "path": name, "row_bytes": rows_of.heads_per_row * rows_of.block * args.head_dim * DTYPE.itemsize, "bytes": moved, "layers": args.layers}
                record(BENCH, case, metrics, {"peer_copy": {"gbps": nbytes / peer_s / 1e9, "latency_us": peer_s * 1e6}})
                rows.append({"tokens": tokens, "layout": layout, "row_B": case["row_bytes"], "path": name, "GBps": metrics["gbps"],
                             "peer_GBps": nbytes / peer_s / 1e9, "ratio": metrics["ratio_to_peer_copy"], "setup_us": setup_s * 1e6, "launch_us": launch_s * 1e6,
                             "checked": checked[name]})
            del src, dst, runs, copy, route
            torch.cuda.empty_cache()
        del flat_src, flat_dst
    print_table(rows, ["tokens", "layout", "row_B", "path", "GBps", "peer_GBps", "ratio", "setup_us", "launch_us", "checked"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
