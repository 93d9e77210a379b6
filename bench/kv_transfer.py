"""KV transfer benchmark: one request's KV, prefill rank(s) -> one decode rank (issue 3, DESIGN §5).

For each prompt length it measures, in the same run:

* ``peer_copy``  - one torch copy of the request's KV bytes from the prefill device to the
  decode device (GPU 0 -> the decode GPU; on CPU a memcpy between two tensors): the ceiling.
* ``peer_copy_ranks`` - layouts of several sending ranks (CUDA): each sender process copies
  its share of the bytes (its heads) with torch to the decode GPU, all starting at one
  instant; the time until the last ended. On two GPUs the ranks share GPU 0 as the
  engine's senders do, so their copies take turns on it as their kernels do; a row's
  ``ratio_to_peer_copy_ranks`` (strict) and ``..._from_ready`` compare with it.
* ``raw_ucxx``   - one tagged ucxx send of one contiguous buffer of that size between the
  two processes: what UCX itself gives.
* ``engine``     - the TransferEngine (KVSender -> KVReceiver), all layers ready at once
  (``mark_all_layers_done``; up to ec7439571435 the layers were reported one by one from
  a thread, which with chunks formed from the layers ready so far split off a small
  first chunk): pack per layer group, UCX chunks, scatter into scattered decode pages; timed from the
  sender's construction to the decode side holding the pages (wall clock of one host;
  ``ratio_to_peer_copy``, the strict measure: it counts the sender's set-up, which in the
  services up to 488c9f91cf04 preceded the batch's forward on the request's path and now
  overlaps it, ``shared.transfer.LayerReports``) and from the KV ready to the same point
  (``ready_to_held_us``, ``ratio_to_peer_copy_from_ready``: what a user waits for after
  the prefill's last layer). Here the KV is on the GPU before the sender exists, and the
  ready clock starts right before ``mark_all_layers_done`` is called: whatever the engine
  does once told counts (on the CUDA IPC path: enqueueing the writes, which now happens
  inside that call, not on the event loop afterwards; up to 21ebb95 the clock started when
  the call had returned, leaving out ~0.15 ms at 6k), nothing before it does,
  for each prefill layout of ``--prefill-ranks`` (default 1 and 2: TP=1, and 2 ranks with 2
  of the 4 KV heads each; with more ranks than KV heads only one replica of each head
  sends, as in the services). Senders pack into their worker's send pool, as in the services.
  Each row also carries the median per-phase times both sides record
  (``TransferRecord.phases_s``), ``start_us`` (sender built -> first header at the decode
  rank) and ``notify_us`` (request complete -> ``wait_complete`` returned).
* clocks     - strict starts in the prefill process right before ``KVSender(...)``: it counts
  the whole set-up (layout checks, the peer mapping and route lookups, both page tables
  written into a kept parameter slot, checked and uploaded), the report that enqueues the
  writes (marking the stream, the launch), the kernel, the decode side seeing the landing
  event complete, and ``wait_complete`` returning. What it does not count is made once per
  process, as a serving prefill rank makes it: the compiled kernel, landing and spare events
  (``prepare_direct_writes`` at start), and per (local storage, decode storage, head shard,
  stream) the kept route with its parameter slots, built by the first transfer of each
  row (verified, then dropped). From KV ready starts right before
  ``mark_all_layers_done``.
* placement  - the decode rank sits on the GPU after the prefill ranks of the largest layout
  (``--prefill-ranks 4`` on 8 GPUs: prefill ranks on GPUs 0-3, decode on GPU 4), or on the
  last GPU when there is none after them, the prefill ranks then sharing GPUs 0..last-1
  (`plan_placement`). On two GPUs that is the original layout (all prefill ranks on GPU 0,
  decode on GPU 1) and the rows are as before; any other placement adds ``sender_gpus`` and
  ``decode_gpu`` to the case. ``peer_copy`` and ``raw_ucxx`` run GPU 0 -> the decode GPU.
* ``path``       - every engine row runs per path on CUDA: ``ucx`` (staged chunks over UCX, the
  decode receiver built with ``cuda_ipc=False``, one row per ``--chunk-mib``) and
  ``cuda_ipc`` (the same-host fast path: the decode receiver exports its KV storage, the
  sender writes straight from its pages into the decode pages over NVLink with one kernel
  per layer group and announces them with a small UCX message as it issues them). On CPU
  only ``ucx``; ``--paths`` runs a subset.
* page sizes     - ``--prefill-page-size`` takes a list: every layout and path runs once per
  prefill page size against the decode's ``--page-size`` (default on CUDA 16 and 32 against
  16: the shipped equal-page default and a mismatch; on CPU 16).
* ``overlap``    - TP=1 again (per path), the sender fed layer by layer by a prefill forward that
  runs real work on the prefill GPU: per layer one bf16 matmul ``[tokens, hidden] x
  [hidden, layer_params / hidden]``, the FLOPs of one Qwen3-235B layer's projections and
  its 8 active experts at that token count (attention scores left out, so the real layer
  is longer); ``on_layer_done`` after each layer is enqueued, as the model does. On CPU
  the compute is simulated (``--layer-us-per-1k`` of ``time.sleep`` per layer).
  ``exposed_us``: last layer computed -> KV landed; ``hidden_pct`` = 1 - exposed / engine
  time without compute; ``compute_slowdown_pct``: the forward with the transfer running
  vs the same forward alone.

The overlap runs for the first prefill page size only. ``--modes`` runs everything once per ucxx configuration (``future`` or ``poll`` completion
delivery, ``thread`` or ``thread-polling`` progress, optional ``UCX_*`` settings), each
with fresh processes; the overlap runs in the first mode only. The
first engine transfer of each configuration is checked bit for bit against the reference
on the decode side, then dropped. Usage::

    python -m bench.kv_transfer --device cpu                      # TCP loopback, small sizes
    python -m bench.kv_transfer --device cuda --tokens 1024,6144,32768
    python -m bench.kv_transfer --device cuda --prefill-ranks 1,2,4  # 4 TP ranks -> decode on GPU 4 (8 GPUs)
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
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog
import torch

from bench.results import print_table, record
from schemas.transfer import KVTransferDescriptor
from shared.kvcache import KVLayout, PagedKVCache
from shared.transfer import KVReceiver, KVSender, StagingPool, TransferRecord, TransferWorker, kv_head_shard, prepare_direct_writes
from shared.transfer.worker import ucx_buffer

BENCH = "kv_transfer"
DTYPE = torch.bfloat16
# Qwen3-235B-A22B, per layer and token: q/k/v/o projections (4096x8192, 2x 4096x512,
# 8192x4096), router (4096x128) and 8 active experts (3x 4096x1536 each).
QWEN3_235B_LAYER_PARAMS = 4096 * 8192 + 2 * 4096 * 512 + 8192 * 4096 + 4096 * 128 + 8 * 3 * 4096 * 1536
QWEN3_235B_HIDDEN = 4096


# -- placement --------------------------------------------------------------------------


class PlacementError(ValueError):
    """Prefill layouts that cannot be placed on the GPUs at hand."""


@dataclass(frozen=True)
class Placement:
    """GPUs of one run: the decode rank's, and those of each layout's sending prefill ranks."""

    decode_gpu: int
    senders: dict[int, list[tuple[int, int]]]  # TP size -> [(TP rank, GPU)] of the ranks that send

    def slots(self, tp: int) -> list[tuple[int, int]]:
        """The prefill process each sender of layout ``tp`` runs in: ``(GPU, n)``, its n-th on that GPU.

        Layouts run one after another, so they share processes: slot ``(0, 0)`` is TP=1's rank
        and rank 0 of every layout.
        """
        seen: dict[int, int] = {}
        out = []
        for _, gpu in self.senders[tp]:
            out.append((gpu, seen.get(gpu, 0)))
            seen[gpu] = seen.get(gpu, 0) + 1
        return out

    def case_fields(self, tp: int) -> dict[str, Any]:
        """Placement fields of a result's case: none for the original two-GPU layout."""
        if self.decode_gpu == 1:  # every prefill rank on GPU 0 (r % 1), decode on GPU 1
            return {}
        return {"sender_gpus": [gpu for _, gpu in self.senders[tp]], "decode_gpu": self.decode_gpu}


def plan_placement(layouts: list[int], kv_heads: int, gpus: int) -> Placement:
    """Place prefill layouts of ``layouts`` TP ranks and one decode rank on ``gpus`` GPUs.

    The decode rank takes the GPU after the largest layout's ranks, or the last GPU when
    there is none after them; rank ``r`` of every layout runs on GPU ``r % decode_gpu``, so
    no prefill rank shares the decode rank's GPU. Only the ranks that send (one replica of
    each KV head, `kv_head_shard`) get a process.
    """
    if gpus < 2:
        raise PlacementError(f"the KV transfer benchmark needs 2 GPUs (prefill and decode), {gpus} visible")
    if not layouts or min(layouts) < 1:
        raise PlacementError(f"--prefill-ranks must be positive TP sizes, got {layouts}")
    decode_gpu = min(max(layouts), gpus - 1)
    senders = {}
    for tp in layouts:
        try:
            shards = [kv_head_shard(rank, tp, kv_heads) for rank in range(tp)]
        except ValueError as e:
            raise PlacementError(f"--prefill-ranks {tp}: {e}") from None
        senders[tp] = [(rank, rank % decode_gpu) for rank, shard in enumerate(shards) if shard.sends]
    return Placement(decode_gpu, senders)


def visible_devices(own: int, others: list[int]) -> str:
    """``CUDA_VISIBLE_DEVICES`` of a process on GPU ``own`` that must also see ``others`` (own GPU first)."""
    return ",".join(str(g) for g in [own, *sorted(set(others) - {own})])


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
        self.receivers: dict[str, KVReceiver] = {}  # decode process: one per path, same cache and staging
        self.raw: torch.Tensor | None = None
        self.layer_work: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # x, w, y of the per-layer matmul
        self.peer_bufs: tuple[torch.Tensor, torch.Tensor] | None = None  # source here, destination on the decode GPU (peer_copy_at)
        self._decode_staging: StagingPool | None = None

    def _release_device_memory(self) -> None:
        """Give the previous size's buffers back before allocating the next (32k tokens is ~6 GiB a copy)."""
        self.layer_work = None
        self.peer_bufs = None
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
        self.receivers = {}
        self.cache = None
        self.raw = None
        self._release_device_memory()
        pages = -(-tokens // c["page_size"])
        self.cache = PagedKVCache(KVLayout(c["layers"], 2 * pages + 8, c["kv_heads"], c["page_size"], c["head_dim"], DTYPE), self.device)
        # Scatter the free list so the reserved page ids are not contiguous.
        ids = self.cache.allocator.alloc(self.cache.layout.num_pages)
        self.cache.allocator.free(random.Random(1).sample(ids, len(ids)))
        if self._decode_staging is None:  # long-lived, as a decode rank's
            self._decode_staging = StagingPool(c["slot_mib"] << 20, 4, self.device)
        self.receivers = {"ucx": KVReceiver(self.worker, self.cache, staging=self._decode_staging, cuda_ipc=False)}
        if self.device.type == "cuda":
            self.receivers["cuda_ipc"] = KVReceiver(self.worker, self.cache, staging=self._decode_staging, cuda_ipc=True)

    async def reserve(self, request_id: str, tokens: int, path: str) -> bytes:
        return msgspec.msgpack.encode(self.receivers[path].reserve(request_id, tokens, lease_s=120.0))

    async def wait(self, request_id: str, tokens: int, verify_seed: int | None, path: str) -> dict[str, Any]:
        receiver = self.receivers[path]
        pages = await receiver.wait_complete(request_id, timeout=120.0)
        t_done = time.time()
        exact = None
        if verify_seed is not None:
            c, table = self.cfg, torch.tensor(pages, device=self.device)
            exact = all(
                torch.equal(torch.stack(self.cache.read(layer, table, tokens)), _reference_layer(verify_seed, layer, c["kv_heads"], tokens, c["head_dim"], self.device))
                for layer in range(c["layers"])
            )
        self.cache.allocator.free(pages)
        rec: TransferRecord = receiver.metrics.recent[-1]
        completed_unix = rec.started_unix + rec.phases_s["first_header"] + rec.wall_s
        return {"t_done": t_done, "exact": exact, "first_header_unix": rec.started_unix + rec.phases_s["first_header"], "completed_unix": completed_unix, "wall_s": rec.wall_s, "phases_s": rec.phases_s, "path": rec.path}

    async def raw_recv(self, nbytes: int, tag: int) -> float:
        if self.raw is None or self.raw.numel() != nbytes:
            self.raw = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        await self.worker.recv(tag, ucx_buffer(self.raw))
        self._sync()
        return time.time()

    # prefill side
    async def prefill_setup(self, tokens: int, tp: int, rank: int, seed: int, page_size: int) -> None:
        c = self.cfg
        self.cache = None
        self.raw = None
        self._release_device_memory()
        self.shard = kv_head_shard(rank, tp, c["kv_heads"])
        ps = page_size
        pages = -(-tokens // ps)
        self.cache = PagedKVCache(KVLayout(c["layers"], pages + 8, self.shard.num_heads, ps, c["head_dim"], DTYPE), self.device)
        self.table = random.Random(rank).sample(range(self.cache.layout.num_pages), pages)
        slot_pages, offsets = self.cache.slots(torch.tensor(self.table, device=self.device), torch.arange(tokens, device=self.device))
        for layer in range(c["layers"]):
            kv = _reference_layer(seed, layer, c["kv_heads"], tokens, c["head_dim"], self.device)[:, self.shard.start : self.shard.end]
            self.cache.write(layer, slot_pages, offsets, kv[0].transpose(0, 1), kv[1].transpose(0, 1))
        if self.device.type == "cuda" and rank == 0 and tp == 1:
            gen = torch.Generator(device=self.device).manual_seed(seed)
            n = c["layer_params"] // c["hidden"]
            x = torch.randn(tokens, c["hidden"], generator=gen, device=self.device).to(DTYPE)
            w = (torch.randn(c["hidden"], n, generator=gen, device=self.device) / c["hidden"] ** 0.5).to(DTYPE)
            self.layer_work = (x, w, torch.empty(tokens, n, dtype=DTYPE, device=self.device))
        self._sync()

    async def send(self, descriptor: bytes, compute: str, layer_s: float, chunk_bytes: int) -> dict[str, Any]:
        desc = msgspec.msgpack.decode(descriptor, type=KVTransferDescriptor)
        t_start = time.time()
        one_layer = 2 * self.shard.num_heads * desc.num_tokens * self.cfg["head_dim"] * DTYPE.itemsize
        sender = KVSender(self.worker, self.cache, desc, self.table, self.shard, timeout_s=120.0, chunk_bytes=max(chunk_bytes, one_layer))
        if compute == "none":  # the KV is all there: one report, full chunks
            t_last_layer = time.time()  # the KV is ready now: issuing its writes is part of the transfer
            sender.mark_all_layers_done()
        else:
            t_last_layer = await asyncio.to_thread(self._forward, compute, layer_s, sender)
        rec = await sender.finish()
        return {"t_start": t_start, "t_last_layer": t_last_layer, "chunks": rec.chunks, "wall_s": rec.wall_s, "phases_s": rec.phases_s, "path": rec.path}

    async def compute_only(self, compute: str, layer_s: float) -> float:
        """Seconds of the same forward without a transfer."""
        started = time.time()
        return await asyncio.to_thread(self._forward, compute, layer_s, None) - started

    def _forward(self, compute: str, layer_s: float, sender: KVSender | None) -> float:
        """Run in a thread like the model's forward: per layer, compute then ``on_layer_done``."""
        for layer in range(self.cfg["layers"]):
            if compute == "matmul":
                assert self.layer_work is not None
                x, w, y = self.layer_work
                torch.matmul(x, w, out=y)
            elif compute == "sleep":
                time.sleep(layer_s)
            if sender is not None:
                sender.on_layer_done(layer)
        self._sync()
        return time.time()

    async def peer_copy_at(self, nbytes: int, start_unix: float) -> float:
        """One torch copy of ``nbytes`` from this process's GPU to the decode GPU (``cuda:1`` in a
        prefill process: own GPU first, then the decode's), begun at ``start_unix`` so that the
        senders of a layout copy at once; returns when it ended (unix time)."""
        if self.peer_bufs is None or self.peer_bufs[0].numel() != nbytes:
            self.peer_bufs = (torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=self.device), torch.empty(nbytes, dtype=torch.uint8, device="cuda:1"))
            torch.cuda.synchronize("cuda:1")
            self._sync()
        src, dst = self.peer_bufs
        while time.time() < start_unix:
            pass
        dst.copy_(src)
        torch.cuda.synchronize("cuda:1")
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
        prepare_direct_writes(device, DTYPE, cfg["head_dim"])  # as a prefill rank does at start: no compile in a transfer
    os.environ.update(cfg["ucx_env"])  # read when the UCX context is created, just below
    worker = await TransferWorker.create(cfg["progress_mode"], python_future=cfg["python_future"], send_slot_bytes=cfg["slot_mib"] << 20)
    child = _Child(worker, device, cfg)
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
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible  # own GPU first; the peer stays visible for cuda_ipc
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_child_main, args=(device_kind, cfg, self.inbox, self.outbox), daemon=True)
        self.proc.start()
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
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


def _peer_copy_s(nbytes: int, device_kind: str, iters: int, dst_gpu: int) -> float:
    """Median seconds of one copy GPU 0 -> ``dst_gpu`` (on CPU: a memcpy)."""
    src_dev, dst_dev = "cuda:0", f"cuda:{dst_gpu}"
    if device_kind == "cuda":
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=src_dev)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)
    else:
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        dst = torch.empty(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(iters + 1):
        if device_kind == "cuda":
            torch.cuda.synchronize(src_dev)
            torch.cuda.synchronize(dst_dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        if device_kind == "cuda":
            torch.cuda.synchronize(dst_dev)
            torch.cuda.synchronize(src_dev)
        times.append(time.perf_counter() - t0)
    assert torch.equal(dst[:4096].cpu(), src[:4096].cpu())
    return statistics.median(times[1:])


def _peer_copy_ranks_s(senders: list[_Proc], nbytes_each: list[int], iters: int) -> float:
    """Median seconds from a common start until every sender's own torch copy of its share
    (``nbytes_each``) to the decode GPU ended: the copy engines' ceiling for the layout, its
    processes sharing GPUs as the layout's senders do."""
    times = []
    for _ in range(iters + 1):
        start = time.time() + 0.05  # past the job hand-off to every process
        jobs = [p.submit("peer_copy_at", nbytes=n, start_unix=start) for p, n in zip(senders, nbytes_each)]
        times.append(max(p.result(j) for p, j in zip(senders, jobs)) - start)
    return statistics.median(times[1:])


def _raw_ucxx_s(decode: _Proc, prefill: _Proc, nbytes: int, iters: int) -> float:
    address = decode.call("address")
    times = []
    for i in range(iters + 1):
        recv = decode.submit("raw_recv", nbytes=nbytes, tag=(1 << 62) + i)
        t_start = prefill.call("raw_send", address=address, nbytes=nbytes, tag=(1 << 62) + i)
        times.append(decode.result(recv) - t_start)
    return statistics.median(times[1:])


def _engine_runs(decode: _Proc, prefills: list[_Proc], tokens: int, seed: int, iters: int, compute: str, layer_s: float, chunk_bytes: int, tag: str, path: str) -> list[dict[str, Any]]:
    """``iters`` + 1 transfers (the first warms registration caches and compiles, is verified, then dropped)."""
    runs = []
    for i in range(iters + 1):
        rid = f"{tag}-{path}-{tokens}-{chunk_bytes}-{i}"
        desc = decode.call("reserve", request_id=rid, tokens=tokens, path=path)
        wait = decode.submit("wait", request_id=rid, tokens=tokens, verify_seed=seed if i == 0 else None, path=path)
        sends = [p.submit("send", descriptor=desc, compute=compute, layer_s=layer_s, chunk_bytes=chunk_bytes) for p in prefills]
        sent = [p.result(s) for p, s in zip(prefills, sends)]
        got = decode.result(wait)
        paths = {got["path"], *(s["path"] for s in sent)}
        if paths != {path}:
            raise RuntimeError(f"{rid}: asked for the {path} path, the transfer took {sorted(paths)}")
        if i == 0:
            if not got["exact"]:
                raise RuntimeError(f"{rid}: decode pages differ from the reference")
            continue
        t_start = min(s["t_start"] for s in sent)
        send_phases = {k: max(s["phases_s"].get(k, 0.0) for s in sent) for k in sent[0]["phases_s"]}  # slowest rank
        runs.append({
            "total_s": got["t_done"] - t_start,
            "exposed_s": got["t_done"] - max(s["t_last_layer"] for s in sent),
            "forward_s": max(s["t_last_layer"] for s in sent) - t_start,
            "start_s": got["first_header_unix"] - t_start,
            "notify_s": got["t_done"] - got["completed_unix"],
            "chunks": sent[0]["chunks"],
            "sender_wall_s": max(s["wall_s"] for s in sent),  # first chunk posted -> last chunk sent
            "receiver_wall_s": got["wall_s"],  # first header -> last chunk scattered
            **{f"send_{k}": v for k, v in send_phases.items()},
            **{f"recv_{k}": v for k, v in got["phases_s"].items()},
        })
    return runs


def _overlap(decode: _Proc, prefill: _Proc, runs: dict[tuple[str, int, str, int], list[dict[str, Any]]], paths: list[str], tokens: int, seed: int, iters: int,
             compute: str, layer_s: float, overlap_chunk: int, first_chunk: int, gpu: bool, cfg: dict[str, Any], page_size: int) -> dict[str, dict[str, Any]]:
    """TP=1 fed layer by layer by a prefill forward (module doc, ``overlap``), per path; needs TP=1's
    engine ``runs`` (the transfer alone) and ``prefill`` set up as TP=1's rank."""
    alone = [prefill.call("compute_only", compute=compute, layer_s=layer_s) for _ in range(iters + 1)][1:]
    compute_s = statistics.median(alone)
    overlap = {}
    for path in paths:
        alone_runs = runs.get(("tp1", overlap_chunk, path, page_size)) or runs.get(("tp1", first_chunk, path, page_size))
        if alone_runs is None:
            continue
        with_kv = _engine_runs(decode, [prefill], tokens, seed, iters, compute, layer_s, overlap_chunk << 20, "overlap", path)
        engine_alone_s = statistics.median(r["total_s"] for r in alone_runs)
        exposed_s = statistics.median(r["exposed_s"] for r in with_kv)
        overlap[path] = {
            "compute": compute,
            "layer_matmul_n": cfg["layer_params"] // cfg["hidden"] if gpu else 0,
            "overlap_chunk_mib": overlap_chunk,
            "prefill_compute_us": compute_s * 1e6,
            "exposed_after_prefill_us": exposed_s * 1e6,
            "hidden_pct": 100.0 * max(0.0, 1.0 - exposed_s / engine_alone_s),
            "compute_slowdown_pct": 100.0 * (statistics.median(r["forward_s"] for r in with_kv) / compute_s - 1.0),
        }
    return overlap


def _median_us(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs) * 1e6


def _parse_modes(text: str) -> list[tuple[str, bool, str, dict[str, str]]]:
    """``future/thread,poll/thread-polling/UCX_X=1+UCX_Y=2`` -> [(name, python_future, progress_mode, UCX env)]."""
    modes = []
    for spec in text.split(","):
        delivery, progress, *env = spec.split("/", 2)
        pairs = [kv.partition("=") for kv in env[0].split("+")] if env else []
        if delivery not in ("future", "poll") or progress not in ("thread", "thread-polling") or any(not k.startswith("UCX_") or not sep for k, sep, _ in pairs):
            raise SystemExit(f"--modes: {spec!r} is not <future|poll>/<thread|thread-polling>[/UCX_A=x+UCX_B=y]")
        modes.append((spec, delivery == "future", progress, {k: v for k, _, v in pairs}))
    return modes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--tokens", default=None, help="comma-separated prompt lengths (default cpu: 128,512,1024; cuda: 1024,6144,32768)")
    ap.add_argument("--layers", type=int, default=94)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16, help="decode page size")
    ap.add_argument("--prefill-page-size", default=None, help="comma-separated prefill page sizes, each run against the decode's --page-size (default cpu: 16; cuda: 16,32)")
    ap.add_argument("--chunk-mib", default="256", help="comma-separated target packed chunk sizes of the ucx rows (at least one layer; layers per chunk follow); cuda_ipc rows pack nothing")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--modes", default=None, help="comma-separated ucxx configurations <future|poll>/<thread|thread-polling>[/UCX_A=x+UCX_B=y] (default: future/thread-polling on cuda, future/thread on cpu)")
    ap.add_argument("--overlap-iters", type=int, default=2, help="timed overlap transfers (and forwards alone) per size, first mode only; 0 skips the overlap")
    ap.add_argument("--overlap-chunk-mib", type=int, default=None, help="chunk size of the overlap runs (default: the first of --chunk-mib)")
    ap.add_argument("--layer-us-per-1k", type=float, default=150.0, help="CPU only: simulated prefill compute per layer per 1k tokens (us)")
    ap.add_argument("--prefill-ranks", default="1,2", help="comma-separated prefill TP sizes, one layout each (placement: module doc)")
    ap.add_argument("--paths", default=None, help="comma-separated engine paths to run (default cuda: ucx,cuda_ipc; cpu: ucx)")
    args = ap.parse_args(argv)
    try:
        layouts = [int(n) for n in args.prefill_ranks.split(",")]
    except ValueError:
        ap.error(f"--prefill-ranks: {args.prefill_ranks!r} is not a comma-separated list of integers")
    chunk_list = [int(c) for c in args.chunk_mib.split(",")]
    page_sizes = [int(p) for p in (args.prefill_page_size or ("16" if args.device == "cpu" else "16,32")).split(",")]
    overlap_chunk = args.overlap_chunk_mib or chunk_list[0]
    tokens_list = [int(t) for t in (args.tokens or ("128,512,1024" if args.device == "cpu" else "1024,6144,32768")).split(",")]
    modes = _parse_modes(args.modes or ("future/thread-polling" if args.device == "cuda" else "future/thread"))
    if args.device == "cpu":
        os.environ.setdefault("UCX_TLS", "tcp,self")
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    one_layer_mib = -(-2 * args.kv_heads * max(tokens_list) * args.head_dim * DTYPE.itemsize // 2**20)
    cfg = {
        "layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "page_size": args.page_size,
        # Staging slots (4 per process and side): the largest chunk asked for, at least one whole layer.
        "slot_mib": max(*chunk_list, overlap_chunk, one_layer_mib),
        "layer_params": QWEN3_235B_LAYER_PARAMS, "hidden": QWEN3_235B_HIDDEN,
    }
    gpu = args.device == "cuda"
    try:  # on CPU every process runs on the host: the placement only names process slots
        placement = plan_placement(layouts, args.kv_heads, torch.cuda.device_count() if gpu else 2)
    except PlacementError as e:
        raise SystemExit(str(e)) from None
    decode_gpu = placement.decode_gpu
    layout_fields = {f"tp{tp}": placement.case_fields(tp) for tp in layouts}
    compute = "matmul" if gpu else "sleep"
    paths = args.paths.split(",") if args.paths else ["ucx", "cuda_ipc"] if gpu else ["ucx"]
    if not set(paths) <= ({"ucx", "cuda_ipc"} if gpu else {"ucx"}):
        ap.error(f"--paths: {args.paths!r} names a path this device has not (cuda: ucx, cuda_ipc; cpu: ucx)")
    ctx = mp.get_context("spawn")
    bytes_per_token = args.layers * 2 * args.kv_heads * args.head_dim * DTYPE.itemsize
    peer_s = {tokens: _peer_copy_s(tokens * bytes_per_token, args.device, args.iters, decode_gpu) for tokens in tokens_list}
    rows, phase_rows = [], []
    for mode, python_future, progress_mode, ucx_env in modes:
        mode_cfg = cfg | {"python_future": python_future, "progress_mode": progress_mode, "ucx_env": ucx_env}
        slots = sorted({slot for tp in layouts for slot in placement.slots(tp)})
        decode = _Proc(ctx, args.device, mode_cfg, visible_devices(decode_gpu, [g for g, _ in slots]) if gpu else None)
        prefill_procs = {slot: _Proc(ctx, args.device, mode_cfg, visible_devices(slot[0], [decode_gpu]) if gpu else None) for slot in slots}
        first = prefill_procs[(0, 0)]  # TP=1's rank, and rank 0 of every layout
        try:
            for tokens in tokens_list:
                nbytes = tokens * bytes_per_token
                seed = tokens
                decode.call("decode_setup", tokens=tokens)
                raw_s = _raw_ucxx_s(decode, first, nbytes, args.iters)
                print(f"# {mode} {tokens} tokens: peer copy {nbytes / peer_s[tokens] / 1e9:.1f} GB/s, raw ucxx {nbytes / raw_s / 1e9:.1f} GB/s", flush=True)
                layer_s = args.layer_us_per_1k * 1e-6 * tokens / 1024
                peers = {
                    "peer_copy": {"gbps": nbytes / peer_s[tokens] / 1e9, "latency_us": peer_s[tokens] * 1e6},
                    "raw_ucxx": {"gbps": nbytes / raw_s / 1e9, "latency_us": raw_s * 1e6, "ratio_to_peer_copy": peer_s[tokens] / raw_s},
                }
                runs: dict[tuple[str, int, str, int], list[dict[str, Any]]] = {}

                def engine(key: tuple[str, int, str, int], procs: list[_Proc]) -> None:
                    # A path that fails (e.g. CUDA IPC refused) costs its rows, not the others.
                    try:
                        runs[key] = _engine_runs(decode, procs, tokens, seed, args.iters, "none", 0.0, key[1] << 20, f"{key[0]}-ps{key[3]}", key[2])
                    except RuntimeError as e:
                        print(f"# {mode} {tokens} tokens {key}: FAILED {e}", flush=True)

                overlap: dict[str, dict[str, float]] = {}
                ranks_peer_s: dict[str, float] = {}  # layout -> its senders' own peer copies at once (several senders only)
                for page_size in page_sizes:
                    for tp in layouts:
                        senders = [prefill_procs[slot] for slot in placement.slots(tp)]
                        for (rank, _), p in zip(placement.senders[tp], senders):
                            p.call("prefill_setup", tokens=tokens, tp=tp, rank=rank, seed=seed, page_size=page_size)
                        for path in paths:
                            for chunk_mib in chunk_list if path == "ucx" else chunk_list[:1]:  # only UCX chunks
                                engine((f"tp{tp}", chunk_mib, path, page_size), senders)
                        if gpu and len(senders) > 1 and f"tp{tp}" not in ranks_peer_s:
                            shares = [nbytes * kv_head_shard(rank, tp, args.kv_heads).num_heads // args.kv_heads for rank, _ in placement.senders[tp]]
                            ranks_peer_s[f"tp{tp}"] = _peer_copy_ranks_s(senders, shares, args.iters)
                        if tp == 1 and args.overlap_iters and mode == modes[0][0] and page_size == page_sizes[0]:  # needs TP=1's set-up
                            overlap = _overlap(decode, first, runs, paths, tokens, seed, args.overlap_iters, compute, layer_s, overlap_chunk, chunk_list[0], gpu, cfg, page_size)
                for (layout, chunk_mib, path, page_size), layout_runs in runs.items():
                    eng_s = statistics.median(r["total_s"] for r in layout_runs)
                    ready_s = statistics.median(r["exposed_s"] for r in layout_runs)  # all layers reported -> decode holds the pages
                    phase_keys = sorted(k for k in layout_runs[0] if k.startswith(("send_", "recv_")))
                    metrics = {
                        "gbps": nbytes / eng_s / 1e9,
                        "latency_us": eng_s * 1e6,
                        "ratio_to_peer_copy": peer_s[tokens] / eng_s,  # strict: from the sender's construction
                        "ready_to_held_us": ready_s * 1e6,
                        "ratio_to_peer_copy_from_ready": peer_s[tokens] / ready_s,  # from the KV ready (all layers reported)
                        "ratio_to_raw_ucxx": raw_s / eng_s,
                        "chunks_per_rank": layout_runs[0]["chunks"],
                        "start_us": _median_us(layout_runs, "start_s"),
                        "notify_us": _median_us(layout_runs, "notify_s"),
                        "sender_wall_us": _median_us(layout_runs, "sender_wall_s"),
                        "receiver_wall_us": _median_us(layout_runs, "receiver_wall_s"),
                        **{f"{k}_us": _median_us(layout_runs, k) for k in phase_keys},
                    }
                    if layout == "tp1" and chunk_mib == overlap_chunk and page_size == page_sizes[0]:
                        metrics |= overlap.get(path, {})
                    layout_peers = peers
                    if layout in ranks_peer_s:
                        ranks_s = ranks_peer_s[layout]
                        metrics |= {"ratio_to_peer_copy_ranks": ranks_s / eng_s, "ratio_to_peer_copy_ranks_from_ready": ranks_s / ready_s}
                        layout_peers = peers | {"peer_copy_ranks": {"gbps": nbytes / ranks_s / 1e9, "latency_us": ranks_s * 1e6}}
                    case = {"path": path, "tokens": tokens, "layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": "bfloat16", "bytes": nbytes, "prefill_layout": layout, "decode_page_size": args.page_size, "prefill_page_size": page_size, "chunk_mib": chunk_mib,
                            "transport": "ucx " + os.environ.get("UCX_TLS", "default"), "progress_mode": progress_mode, "completions": "future" if python_future else "poll", "ucx_env": ucx_env,
                            **layout_fields[layout]}
                    record(BENCH, case, metrics, layout_peers)
                    rows.append({"tokens": tokens, "MiB": nbytes / 2**20, "mode": mode, "path": path, "layout": layout, "ps": page_size, "chunk_MiB": chunk_mib, "engine_GBps": metrics["gbps"], "raw_ucxx_GBps": peers["raw_ucxx"]["gbps"], "peer_copy_GBps": peers["peer_copy"]["gbps"], "engine/peer": metrics["ratio_to_peer_copy"], "ready/peer": metrics["ratio_to_peer_copy_from_ready"], "ready/ranks_peer": metrics.get("ratio_to_peer_copy_ranks_from_ready", ""), "engine/raw": metrics["ratio_to_raw_ucxx"], "chunks": metrics["chunks_per_rank"], "exposed_us": metrics.get("exposed_after_prefill_us", ""), "hidden_pct": metrics.get("hidden_pct", ""), "slowdown_pct": metrics.get("compute_slowdown_pct", "")})
                    phase_rows.append({"tokens": tokens, "mode": mode, "path": path, "layout": layout, "ps": page_size, "total_us": metrics["latency_us"], "ready_us": metrics["ready_to_held_us"], "start_us": metrics["start_us"], "s_setup_us": metrics.get("send_setup_us", ""), "s_pack_us": metrics.get("send_pack_us", ""), "s_issue_us": metrics.get("send_issue_us", ""), "s_cwait_us": metrics.get("send_compute_wait_us", ""), "s_write_us": metrics.get("send_write_us", ""), "s_wire_us": metrics.get("send_wire_us", ""), "r_post_us": metrics.get("recv_post_us", ""), "r_wire_us": metrics.get("recv_wire_us", ""), "r_scatter_us": metrics.get("recv_scatter_us", ""), "r_wall_us": metrics["receiver_wall_us"], "notify_us": metrics["notify_us"]})
        finally:
            for p in (decode, *prefill_procs.values()):
                p.stop()
    print_table(rows, ["tokens", "MiB", "mode", "path", "layout", "ps", "chunk_MiB", "engine_GBps", "raw_ucxx_GBps", "peer_copy_GBps", "engine/peer", "ready/peer", "ready/ranks_peer", "engine/raw", "chunks", "exposed_us", "hidden_pct", "slowdown_pct"])
    print()
    print_table(phase_rows, ["tokens", "mode", "path", "layout", "ps", "total_us", "ready_us", "start_us", "s_setup_us", "s_pack_us", "s_issue_us", "s_cwait_us", "s_write_us", "s_wire_us", "r_post_us", "r_wire_us", "r_scatter_us", "r_wall_us", "notify_us"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
