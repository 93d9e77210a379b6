"""KV transfer benchmark: one request's KV, prefill rank(s) -> one decode rank (issue 3, DESIGN §5).

For each prompt length it measures, in the same run:

* ``peer_copy``  - one torch copy of the request's KV bytes from the prefill device to the
  decode device (GPU0 -> GPU1; on CPU a memcpy between two tensors): the ceiling.
* ``raw_ucxx``   - one tagged ucxx send of one contiguous buffer of that size between the
  two processes: what UCX itself gives.
* ``engine``     - the TransferEngine (KVSender -> KVReceiver), all layers ready at once:
  pack per layer group, UCX chunks, scatter into scattered decode pages; timed from the
  sender's start to the receiver's completion (wall clock of one host), for prefill
  TP=1 and a 2-rank layout (each rank 2 of the 4 KV heads, both on the prefill device).
* ``overlap``    - TP=1 again, with the sender fed layer by layer by a simulated prefill:
  a fixed compute time per layer (``--layer-us-per-1k`` per 1k prompt tokens; a
  ``torch.cuda._sleep`` kernel on GPU, ``time.sleep`` on CPU, not a measured model
  forward). ``exposed_ms`` is the time from the last layer's compute to the KV having
  landed; ``hidden_pct`` = 1 - exposed / engine time without compute.

The first engine transfer of each configuration is checked bit for bit against the
reference on the decode side. Usage::

    python -m bench.kv_transfer --device cpu                      # TCP loopback, small sizes
    python -m bench.kv_transfer --device cuda --tokens 1024,6144,32768
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import os
import random
import statistics
import time
from typing import Any

import msgspec
import structlog
import torch

from bench.results import print_table, record
from schemas.transfer import KVTransferDescriptor
from shared.kvcache import KVLayout, PagedKVCache
from shared.transfer import KVReceiver, KVSender, StagingPool, TransferWorker, kv_head_shard
from shared.transfer.worker import ucx_buffer

BENCH = "kv_transfer"
DTYPE = torch.bfloat16


# -- child processes --------------------------------------------------------------------


def _reference_layer(seed: int, layer: int, heads: int, tokens: int, head_dim: int, device: torch.device) -> torch.Tensor:
    """Layer ``layer`` of the unsharded reference KV: ``[2, heads, tokens, head_dim]``, same on every device."""
    gen = torch.Generator(device=device).manual_seed(seed * 1000 + layer)
    return torch.randn(2, heads, tokens, head_dim, generator=gen, device=device).to(DTYPE)


class _Child:
    """State of one benchmark process (decode rank or prefill rank); ops are called by name."""

    def __init__(self, worker: TransferWorker, device: torch.device, cfg: dict[str, Any]) -> None:
        self.worker, self.device, self.cfg = worker, device, cfg
        self.cache: Any = None  # PagedKVCache once set up for a prompt length
        self.receiver: Any = None  # KVReceiver (decode process)
        self.raw: torch.Tensor | None = None
        self._pool: StagingPool | None = None

    def _staging(self) -> StagingPool:
        """The process's long-lived staging pool (as a service rank keeps one), made on first use."""
        if self._pool is None:
            self._pool = StagingPool(self.cfg["slot_mib"] << 20, 4, self.device)
        return self._pool

    def _release_device_memory(self) -> None:
        """Give the previous size's buffers back before allocating the next (32k tokens is ~6 GiB a copy)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    async def address(self) -> bytes:
        return self.worker.address

    # decode side
    async def decode_setup(self, tokens: int) -> None:
        c = self.cfg
        self.receiver = None
        self.cache = None
        self.raw = None
        self._release_device_memory()
        pages = -(-tokens // c["page_size"])
        self.cache = PagedKVCache(KVLayout(c["layers"], 2 * pages + 8, c["kv_heads"], c["page_size"], c["head_dim"], DTYPE), self.device)
        # Scatter the free list so the reserved page ids are not contiguous.
        ids = self.cache.allocator.alloc(self.cache.layout.num_pages)
        self.cache.allocator.free(random.Random(1).sample(ids, len(ids)))
        self.receiver = KVReceiver(self.worker, self.cache, staging=self._staging())

    async def reserve(self, request_id: str, tokens: int) -> bytes:
        return msgspec.msgpack.encode(self.receiver.reserve(request_id, tokens, lease_s=120.0))

    async def wait(self, request_id: str, tokens: int, verify_seed: int | None) -> dict[str, Any]:
        pages = await self.receiver.wait_complete(request_id, timeout=120.0)
        t_done = time.time()
        exact = None
        if verify_seed is not None:
            c, table = self.cfg, torch.tensor(pages, device=self.device)
            exact = all(
                torch.equal(torch.stack(self.cache.read(layer, table, tokens)), _reference_layer(verify_seed, layer, c["kv_heads"], tokens, c["head_dim"], self.device))
                for layer in range(c["layers"])
            )
        self.cache.allocator.free(pages)
        return {"t_done": t_done, "exact": exact, "receiver_wall_s": self.receiver.metrics.recent[-1].wall_s}

    async def raw_recv(self, nbytes: int, tag: int) -> float:
        if self.raw is None or self.raw.numel() != nbytes:
            self.raw = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        await self.worker.recv(tag, ucx_buffer(self.raw))
        self._sync()
        return time.time()

    # prefill side
    async def prefill_setup(self, tokens: int, tp: int, rank: int, seed: int) -> None:
        c = self.cfg
        self.cache = None
        self.raw = None
        self._release_device_memory()
        self.shard = kv_head_shard(rank, tp, c["kv_heads"])
        ps = c["prefill_page_size"]
        pages = -(-tokens // ps)
        self.cache = PagedKVCache(KVLayout(c["layers"], pages + 8, self.shard.num_heads, ps, c["head_dim"], DTYPE), self.device)
        self.table = random.Random(rank).sample(range(self.cache.layout.num_pages), pages)
        slot_pages, offsets = self.cache.slots(torch.tensor(self.table, device=self.device), torch.arange(tokens, device=self.device))
        for layer in range(c["layers"]):
            kv = _reference_layer(seed, layer, c["kv_heads"], tokens, c["head_dim"], self.device)[:, self.shard.start : self.shard.end]
            self.cache.write(layer, slot_pages, offsets, kv[0].transpose(0, 1), kv[1].transpose(0, 1))
        self._sync()

    async def send(self, descriptor: bytes, layer_s: float, chunk_mib: int) -> dict[str, Any]:
        desc = msgspec.msgpack.decode(descriptor, type=KVTransferDescriptor)
        t_start = time.time()
        sender = KVSender(self.worker, self.cache, desc, self.table, self.shard, timeout_s=120.0, chunk_bytes=chunk_mib << 20, staging=self._staging())
        t_last_layer = await asyncio.to_thread(self._simulated_forward, sender, layer_s)
        rec = await sender.finish()
        return {"t_start": t_start, "t_last_layer": t_last_layer, "chunks": rec.chunks, "sender_wall_s": rec.wall_s}

    def _simulated_forward(self, sender: KVSender, layer_s: float) -> float:
        """Run in a thread like a real forward: per layer, 'compute' then ``on_layer_done``."""
        cycles = int(layer_s * self.cfg["sleep_cycles_per_s"]) if self.device.type == "cuda" else 0
        for layer in range(self.cfg["layers"]):
            if layer_s and cycles:
                torch.cuda._sleep(cycles)
            elif layer_s:
                time.sleep(layer_s)
            sender.on_layer_done(layer)
        self._sync()
        return time.time()

    async def raw_send(self, address: bytes, nbytes: int, tag: int) -> float:
        if self.raw is None or self.raw.numel() != nbytes:
            self.raw = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=self.device)
            self._sync()
        t_start = time.time()
        await self.worker.send(address, tag, ucx_buffer(self.raw))
        return t_start


def _child_main(device_kind: str, cfg: dict[str, Any], inbox: Any, outbox: Any) -> None:
    asyncio.run(_child_async(device_kind, cfg, inbox, outbox))


async def _child_async(device_kind: str, cfg: dict[str, Any], inbox: Any, outbox: Any) -> None:
    # Per-transfer info events would drown the table; warnings (failures) still show.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    device = torch.device("cuda", 0) if device_kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)  # CUDA context before UCX starts
    child = _Child(await TransferWorker.create(cfg["progress_mode"]), device, cfg)
    loop = asyncio.get_running_loop()
    pending = set()
    while True:
        job, op, kwargs = await loop.run_in_executor(None, inbox.get)
        if op == "stop":
            break

        async def run(job: int = job, op: str = op, kwargs: dict[str, Any] = kwargs) -> None:
            try:
                outbox.put((job, True, await getattr(child, op)(**kwargs)))
            except Exception as e:  # surfaced in the parent
                outbox.put((job, False, f"{type(e).__name__}: {e}"))

        task = loop.create_task(run())
        pending.add(task)
        task.add_done_callback(pending.discard)
    child.worker.close()


class _Proc:
    def __init__(self, ctx: Any, device_kind: str, cfg: dict[str, Any], visible: str | None) -> None:
        if visible is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible  # own GPU first; the peer stays visible for cuda_ipc
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_child_main, args=(device_kind, cfg, self.inbox, self.outbox), daemon=True)
        self.proc.start()
        self._jobs = 0
        self._done: dict[int, Any] = {}

    def submit(self, op: str, **kwargs: Any) -> int:
        self._jobs += 1
        self.inbox.put((self._jobs, op, kwargs))
        return self._jobs

    def result(self, job: int) -> Any:
        while job not in self._done:
            j, ok, payload = self.outbox.get(timeout=300)
            if not ok:
                raise RuntimeError(f"benchmark process {self.proc.pid}: {payload}")
            self._done[j] = payload
        return self._done.pop(job)

    def call(self, op: str, **kwargs: Any) -> Any:
        return self.result(self.submit(op, **kwargs))

    def stop(self) -> None:
        self.inbox.put((0, "stop", {}))
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


# -- measurements -----------------------------------------------------------------------


def _peer_copy_s(nbytes: int, device_kind: str, iters: int) -> float:
    if device_kind == "cuda":
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda:0")
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    else:
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        dst = torch.empty(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(iters + 1):
        if device_kind == "cuda":
            torch.cuda.synchronize("cuda:0")
            torch.cuda.synchronize("cuda:1")
        t0 = time.perf_counter()
        dst.copy_(src)
        if device_kind == "cuda":
            torch.cuda.synchronize("cuda:1")
            torch.cuda.synchronize("cuda:0")
        times.append(time.perf_counter() - t0)
    assert torch.equal(dst[:4096].cpu(), src[:4096].cpu())
    return statistics.median(times[1:])


def _raw_ucxx_s(decode: _Proc, prefill: _Proc, nbytes: int, iters: int) -> float:
    address = decode.call("address")
    times = []
    for i in range(iters + 1):
        recv = decode.submit("raw_recv", nbytes=nbytes, tag=(1 << 62) + i)
        t_start = prefill.call("raw_send", address=address, nbytes=nbytes, tag=(1 << 62) + i)
        times.append(decode.result(recv) - t_start)
    return statistics.median(times[1:])


def _engine_runs(decode: _Proc, prefills: list[_Proc], tokens: int, seed: int, iters: int, layer_s: float, chunk_mib: int, tag: str) -> list[dict[str, Any]]:
    """``iters`` + 1 transfers (the first warms registration caches and is verified, then dropped)."""
    runs = []
    for i in range(iters + 1):
        rid = f"{tag}-{tokens}-{chunk_mib}-{i}"
        desc = decode.call("reserve", request_id=rid, tokens=tokens)
        wait = decode.submit("wait", request_id=rid, tokens=tokens, verify_seed=seed if i == 0 else None)
        sends = [p.submit("send", descriptor=desc, layer_s=layer_s, chunk_mib=chunk_mib) for p in prefills]
        sent = [p.result(s) for p, s in zip(prefills, sends)]
        got = decode.result(wait)
        if i == 0:
            if not got["exact"]:
                raise RuntimeError(f"{rid}: decode pages differ from the reference")
            continue
        t_start = min(s["t_start"] for s in sent)
        runs.append({
            "total_s": got["t_done"] - t_start,
            "exposed_s": got["t_done"] - max(s["t_last_layer"] for s in sent),
            "chunks": sent[0]["chunks"],
            "sender_wall_s": max(s["sender_wall_s"] for s in sent),  # first chunk posted -> last chunk sent
            "receiver_wall_s": got["receiver_wall_s"],  # first header -> last chunk scattered
        })
    return runs


def _calibrate_sleep_cycles() -> float:
    """GPU clock cycles per second of ``torch.cuda._sleep`` on cuda:0."""
    torch.cuda._sleep(1_000_000)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    return 50_000_000 / (start.elapsed_time(end) / 1e3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--tokens", default=None, help="comma-separated prompt lengths (default cpu: 128,512,1024; cuda: 1024,6144,32768)")
    ap.add_argument("--layers", type=int, default=94)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16, help="decode page size")
    ap.add_argument("--prefill-page-size", type=int, default=32)
    ap.add_argument("--chunk-mib", default="64", help="comma-separated target packed chunk sizes (layers per chunk follow from it)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--progress-mode", choices=["thread", "thread-polling"], default="thread", help="ucxx progress thread: epoll-driven or spinning")
    ap.add_argument("--layer-us-per-1k", type=float, default=150.0, help="simulated prefill compute per layer per 1k tokens (us)")
    args = ap.parse_args(argv)
    chunk_list = [int(c) for c in args.chunk_mib.split(",")]
    tokens_list = [int(t) for t in (args.tokens or ("128,512,1024" if args.device == "cpu" else "1024,6144,32768")).split(",")]
    if args.device == "cpu":
        os.environ.setdefault("UCX_TLS", "tcp,self")
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    cfg = {
        "layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "page_size": args.page_size,
        "prefill_page_size": args.prefill_page_size,
        # Staging: 4 slots a process, each the largest chunk asked for and at least one whole layer.
        "slot_mib": max(*chunk_list, -(-2 * args.kv_heads * max(tokens_list) * args.head_dim * DTYPE.itemsize // 2**20)),
        "sleep_cycles_per_s": 0.0,
        "progress_mode": args.progress_mode,
    }
    if args.device == "cuda":
        if torch.cuda.device_count() < 2:
            raise SystemExit("--device cuda needs two GPUs")
        cfg["sleep_cycles_per_s"] = _calibrate_sleep_cycles()
    ctx = mp.get_context("spawn")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpu = args.device == "cuda"
    decode = _Proc(ctx, args.device, cfg, "1,0" if gpu else None)
    prefills = [_Proc(ctx, args.device, cfg, "0,1" if gpu else None) for _ in range(2)]
    if visible is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    bytes_per_token = args.layers * 2 * args.kv_heads * args.head_dim * DTYPE.itemsize
    rows = []
    try:
        for tokens in tokens_list:
            nbytes = tokens * bytes_per_token
            seed = tokens
            decode.call("decode_setup", tokens=tokens)
            peer_s = _peer_copy_s(nbytes, args.device, args.iters)
            prefills[0].call("prefill_setup", tokens=tokens, tp=1, rank=0, seed=seed)
            raw_s = _raw_ucxx_s(decode, prefills[0], nbytes, args.iters)
            print(f"# {tokens} tokens: peer copy {nbytes / peer_s / 1e9:.1f} GB/s, raw ucxx {nbytes / raw_s / 1e9:.1f} GB/s", flush=True)
            layer_s = args.layer_us_per_1k * 1e-6 * tokens / 1024
            peers = {
                "peer_copy": {"gbps": nbytes / peer_s / 1e9, "latency_us": peer_s * 1e6},
                "raw_ucxx": {"gbps": nbytes / raw_s / 1e9, "latency_us": raw_s * 1e6, "ratio_to_peer_copy": peer_s / raw_s},
            }
            runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
            overlap: dict[int, list[dict[str, Any]]] = {}
            for chunk_mib in chunk_list:
                runs["tp1", chunk_mib] = _engine_runs(decode, prefills[:1], tokens, seed, args.iters, 0.0, chunk_mib, "tp1")
                overlap[chunk_mib] = _engine_runs(decode, prefills[:1], tokens, seed, args.iters, layer_s, chunk_mib, "overlap")
            for rank, p in enumerate(prefills):
                p.call("prefill_setup", tokens=tokens, tp=2, rank=rank, seed=seed)
            for chunk_mib in chunk_list:
                runs["tp2", chunk_mib] = _engine_runs(decode, prefills, tokens, seed, args.iters, 0.0, chunk_mib, "tp2")
            for (layout, chunk_mib), layout_runs in runs.items():
                eng_s = statistics.median(r["total_s"] for r in layout_runs)
                metrics = {
                    "gbps": nbytes / eng_s / 1e9,
                    "latency_us": eng_s * 1e6,
                    "ratio_to_peer_copy": peer_s / eng_s,
                    "ratio_to_raw_ucxx": raw_s / eng_s,
                    "chunks_per_rank": layout_runs[0]["chunks"],
                    "sender_wall_us": statistics.median(r["sender_wall_s"] for r in layout_runs) * 1e6,
                    "receiver_wall_us": statistics.median(r["receiver_wall_s"] for r in layout_runs) * 1e6,
                }
                if layout == "tp1":
                    exposed_s = statistics.median(r["exposed_s"] for r in overlap[chunk_mib])
                    metrics |= {
                        "sim_layer_compute_us": layer_s * 1e6,
                        "sim_prefill_compute_us": layer_s * args.layers * 1e6,
                        "exposed_after_prefill_us": exposed_s * 1e6,
                        "hidden_pct": 100.0 * max(0.0, 1.0 - exposed_s / eng_s),
                    }
                case = {"tokens": tokens, "layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": "bfloat16", "bytes": nbytes, "prefill_layout": layout, "decode_page_size": args.page_size, "prefill_page_size": args.prefill_page_size, "chunk_mib": chunk_mib, "transport": "ucx " + os.environ.get("UCX_TLS", "default"), "progress_mode": args.progress_mode}
                record(BENCH, case, metrics, peers)
                rows.append({"tokens": tokens, "MiB": nbytes / 2**20, "layout": layout, "chunk_MiB": chunk_mib, "engine_GBps": metrics["gbps"], "raw_ucxx_GBps": peers["raw_ucxx"]["gbps"], "peer_copy_GBps": peers["peer_copy"]["gbps"], "engine/peer": metrics["ratio_to_peer_copy"], "engine/raw": metrics["ratio_to_raw_ucxx"], "chunks": metrics["chunks_per_rank"], "exposed_us": metrics.get("exposed_after_prefill_us", ""), "hidden_pct": metrics.get("hidden_pct", "")})
    finally:
        for p in (decode, *prefills):
            p.stop()
    print_table(rows, ["tokens", "MiB", "layout", "chunk_MiB", "engine_GBps", "raw_ucxx_GBps", "peer_copy_GBps", "engine/peer", "engine/raw", "chunks", "exposed_us", "hidden_pct"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
