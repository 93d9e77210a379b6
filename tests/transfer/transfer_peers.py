"""Peer processes for the transfer tests: one decode rank or one prefill TP rank per process,
each with its own UCX worker, driven through multiprocessing queues (spawn). On CPU the
peers talk over TCP loopback; with ``device="cuda"`` each process keeps UCX's default
transports and sees its own GPU first (``visible``), the other one second.

Commands are ``(job_id, op, kwargs)``; replies ``(job_id, kind, payload)`` with kind
``"done"`` (the op's return value) or ``"progress"`` (a prefill send reached its
kill point). Ops run as concurrent tasks, so several transfers can be in flight.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import os
import queue
import random
import time
from typing import Any

import msgspec
import torch

from schemas.transfer import KVTransferDescriptor
from shared.kvcache import KVLayout, PagedKVCache
from shared.transfer import KVReceiver, KVSender, StagingPool, TransferError, TransferWorker, kv_head_shard, prepare_direct_writes
from shared.transfer.streams import side_stream

DTYPE = torch.bfloat16
UCX_ENV = {"UCX_TLS": "tcp,self", "UCX_WARN_UNUSED_ENV_VARS": "n"}


def reference_kv(seed: int, layers: int, heads: int, tokens: int, head_dim: int) -> torch.Tensor:
    """The unsharded prefill KV of one request: ``[layers, 2, heads, tokens, head_dim]``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layers, 2, heads, tokens, head_dim, generator=gen).to(DTYPE)


class Peer:
    """Test-side handle of one peer process."""

    def __init__(self, ctx: Any, role: str, *, device: str = "cpu", visible: str | None = None, **config: Any) -> None:
        env = UCX_ENV if device == "cpu" else {"UCX_WARN_UNUSED_ENV_VARS": "n"} | ({"CUDA_VISIBLE_DEVICES": visible} if visible else {})
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # inherited by the spawned child
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_serve, args=(role, device, config, self.inbox, self.outbox), daemon=True)
        self.proc.start()
        if device != "cpu":
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        self._jobs = itertools.count()
        self._stash: list[tuple[int, str, Any]] = []

    def submit(self, op: str, **kwargs: Any) -> int:
        job = next(self._jobs)
        self.inbox.put((job, op, kwargs))
        return job

    def wait(self, job: int, kind: str = "done", reply_timeout: float = 60.0) -> Any:
        deadline = time.monotonic() + reply_timeout
        while True:
            for i, (j, k, payload) in enumerate(self._stash):
                if j == job and k == "crashed":
                    raise RuntimeError(f"peer {self.proc.pid}: job {job} raised {payload}")
                if j == job and k == kind:
                    del self._stash[i]
                    return payload
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"peer {self.proc.pid}: no {kind!r} reply to job {job} within {reply_timeout}s")
            try:
                self._stash.append(self.outbox.get(timeout=min(left, 1.0)))
            except queue.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError(f"peer {self.proc.pid} died (exit code {self.proc.exitcode})") from None

    def call(self, op: str, reply_timeout: float = 60.0, **kwargs: Any) -> Any:
        return self.wait(self.submit(op, **kwargs), reply_timeout=reply_timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            self.inbox.put((-1, "stop", {}))
            self.proc.join(10)
        if self.proc.is_alive():
            self.kill()


def spawn_context() -> Any:
    return mp.get_context("spawn")


# -- child side -------------------------------------------------------------------------


def _serve(role: str, device: str, config: dict[str, Any], inbox: Any, outbox: Any) -> None:
    asyncio.run(_serve_async(role, device, config, inbox, outbox))


async def _serve_async(role: str, device: str, config: dict[str, Any], inbox: Any, outbox: Any) -> None:
    if device == "cuda":
        torch.cuda.set_device(0)
        torch.zeros(1, device="cuda")  # CUDA context before UCX starts
    worker = await TransferWorker.create()
    peer = DecodePeer(worker, device=device, **config) if role == "decode" else PrefillPeer(worker, device=device, **config)
    loop = asyncio.get_running_loop()
    tasks = set()
    while True:
        job, op, kwargs = await loop.run_in_executor(None, inbox.get)
        if op == "stop":
            break

        async def run(job: int = job, op: str = op, kwargs: dict[str, Any] = kwargs) -> None:
            try:
                outbox.put((job, "done", await getattr(peer, op)(job=job, outbox=outbox, **kwargs)))
            except Exception as e:  # reported to the test instead of silently lost
                outbox.put((job, "crashed", f"{type(e).__name__}: {e}"))

        task = loop.create_task(run())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    worker.close()


class DecodePeer:
    """A decode rank with one KV cache (and receiver) per named layout."""

    def __init__(self, worker: TransferWorker, caches: dict[str, dict[str, int]], staging_slot_bytes: int, device: str = "cpu") -> None:
        self.caches = {name: PagedKVCache(KVLayout(dtype=DTYPE, **spec), device) for name, spec in caches.items()}
        self.receivers = {name: KVReceiver(worker, cache, staging=StagingPool(staging_slot_bytes, 4, device)) for name, cache in self.caches.items()}
        self.tokens: dict[str, int] = {}
        for cache in self.caches.values():
            # Shuffle the free list so reservations get scattered, non-monotonic page ids.
            pages = cache.allocator.alloc(cache.layout.num_pages)
            cache.allocator.free(random.Random(7).sample(pages, len(pages)))

    async def reserve(self, cache: str, request_id: str, num_tokens: int, lease_s: float, **_: Any) -> bytes:
        self.tokens[request_id] = num_tokens
        return msgspec.msgpack.encode(self.receivers[cache].reserve(request_id, num_tokens, lease_s))

    async def wait(self, cache: str, request_id: str, timeout: float, **_: Any) -> dict[str, Any]:
        """Wait for the request; on success return its KV read back from the pages (pages stay owned here)."""
        t0 = time.monotonic()
        try:
            pages = await self.receivers[cache].wait_complete(request_id, timeout)
        except (TransferError, KeyError) as e:
            return {"ok": False, "error": type(e).__name__, "message": str(e), "elapsed_s": time.monotonic() - t0}
        return {"ok": True, "pages": pages, "kv": self._read(cache, pages, self.tokens[request_id])}

    async def read(self, cache: str, pages: list[int], num_tokens: int, **_: Any) -> torch.Tensor:
        return self._read(cache, pages, num_tokens)

    def _read(self, cache: str, pages: list[int], num_tokens: int) -> torch.Tensor:
        """``[layers, 2, heads, num_tokens, head_dim]`` read back through the cache's own ``read``."""
        kv_cache = self.caches[cache]
        table = torch.tensor(pages, device=kv_cache.device)
        return torch.stack([torch.stack(kv_cache.read(layer, table, num_tokens)) for layer in range(kv_cache.layout.num_layers)]).cpu()

    async def cancel(self, cache: str, request_id: str, **_: Any) -> bool:
        return self.receivers[cache].cancel(request_id)

    async def free(self, cache: str, pages: list[int], **_: Any) -> None:
        self.caches[cache].allocator.free(pages)

    async def fill(self, cache: str, pages: list[int], value: float, **_: Any) -> None:
        for pool in self.caches[cache].pools:
            pool[torch.tensor(pages, device=pool.device)] = value

    async def status(self, cache: str, **_: Any) -> dict[str, Any]:
        rx = self.receivers[cache]
        return {"free_pages": rx.num_free_pages, "reservations": rx.num_reservations, "quarantined_pages": rx.num_quarantined_pages, "staging_in_use": rx.staging.in_use_bytes, "metrics": rx.metrics.snapshot(), "cuda_ipc": rx.cuda_ipc_export is not None}


class PrefillPeer:
    """One prefill TP rank: builds its local KV shard from the reference and sends it."""

    def __init__(self, worker: TransferWorker, device: str = "cpu", head_dim: int | None = None) -> None:
        self.worker = worker
        self.device = device
        if head_dim is not None:  # as a prefill service does at start: no kernel compile inside a send
            prepare_direct_writes(torch.device(device), DTYPE, head_dim)

    async def ping(self, **_: Any) -> bool:
        return True

    async def send(self, job: int, outbox: Any, descriptor: bytes, tp_rank: int, tp_size: int, page_size: int, seed: int, chunk_bytes: int, timeout_s: float, pace_s: float = 0.0, progress_after_layer: int | None = None, stall_writes_s: float = 0.0, **_: Any) -> dict[str, Any]:
        desc = msgspec.msgpack.decode(descriptor, type=KVTransferDescriptor)
        lay, tokens = desc.layout, desc.num_tokens
        shard = kv_head_shard(tp_rank, tp_size, lay.kv_heads)
        if not shard.sends:
            return {"ok": True, "skipped": True}
        ref = reference_kv(seed, lay.num_layers, lay.kv_heads, tokens, lay.head_dim)[:, :, shard.start : shard.end].to(self.device)
        local = PagedKVCache(KVLayout(lay.num_layers, 3 * -(-tokens // page_size) + 4, shard.num_heads, page_size, lay.head_dim, DTYPE), self.device)
        # A non-contiguous, shuffled page table in the local cache.
        table = random.Random(seed * 31 + tp_rank).sample(range(local.layout.num_pages), local.layout.pages_for(tokens))
        pages, offsets = local.slots(torch.tensor(table, device=self.device), torch.arange(tokens, device=self.device))
        for layer in range(lay.num_layers):
            local.write(layer, pages, offsets, ref[layer, 0].transpose(0, 1), ref[layer, 1].transpose(0, 1))
        if stall_writes_s:  # direct writes queue behind a GPU sleep on their stream (tests of a sender killed meanwhile)
            with torch.cuda.stream(side_stream(local.device, "peer_write")):
                torch.cuda._sleep(int(stall_writes_s * 2e9))  # cycles: ~1 s each 2e9 at H200 clocks
        t0 = time.monotonic()
        sender = KVSender(self.worker, local, desc, table, shard, timeout_s=timeout_s, chunk_bytes=chunk_bytes)
        try:
            for layer in range(lay.num_layers):
                sender.on_layer_done(layer)
                if pace_s:
                    await asyncio.sleep(pace_s)
                if layer == progress_after_layer:
                    outbox.put((job, "progress", layer))
            record = await sender.finish()
            result = {"ok": True, "bytes": record.nbytes, "chunks": record.chunks, "path": record.path}
        except TransferError as e:
            result = {"ok": False, "error": type(e).__name__, "message": str(e), "path": sender.path}
        # held_buffers: this sender's slots; pool_buffers: the whole worker send pool (shared
        # by the sends in flight on this rank; none on the direct CUDA IPC path).
        pool_buffers = sender.staging.in_use_buffers if sender.staging is not None else 0
        return result | {"elapsed_s": time.monotonic() - t0, "held_buffers": sender.held_buffers, "pool_buffers": pool_buffers, "groups": len(sender.layer_groups)}

    async def status(self, **_: Any) -> dict[str, Any]:
        """The worker's send staging pools: buffers and bytes in use (0 when nothing is sending)."""
        pools = self.worker.staging_pools
        return {"pool_buffers": sum(p.in_use_buffers for p in pools), "pool_bytes": sum(p.in_use_bytes for p in pools)}
