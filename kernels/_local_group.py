"""Run a function on W local processes joined in a torch.distributed group.

Used by the multi-rank tests and benchmarks of the communication kernels: each
rank is a spawned process (CUDA needs fresh processes), gets ``cuda:rank`` when
the backend is NCCL, and returns a picklable result. A rank that raises, dies
or outlives ``timeout`` fails the whole run with the rank's traceback, and the
other ranks are killed (a rank waiting on a dead peer would otherwise spin).
"""

from __future__ import annotations

import functools
import io
import os
import queue
import socket
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# NVLink multicast is forbidden on this hardware; every process we start inherits this.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


class LocalGroupError(RuntimeError):
    """A rank of a local process group failed."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, results) -> None:
    os.environ.update(NO_MULTICAST_ENV)
    try:
        # Tensors cross as plain bytes: torch's shared-memory handles would need the
        # sending process alive until the parent has read them.
        buf = io.BytesIO()
        torch.save(fn(rank, world, port, *args), buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # report everything, including assertion failures, to the parent
        results.put((rank, False, traceback.format_exc()))


def _in_group(backend: str, fn: Callable[..., Any], rank: int, world: int, port: int, *args: Any) -> Any:
    """``fn(rank, world, *args)`` inside a process group of ``backend`` rendezvousing on ``port``."""
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank) if backend == "nccl" else None)
    try:
        return fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_local_group(fn: Callable[..., Any], world: int, backend: str, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` processes in one group; return the results by rank."""
    return spawn_ranks(functools.partial(_in_group, backend, fn), world, *args, timeout=timeout)


def spawn_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world, port, *args)`` on ``world`` processes that join no group themselves
    (``port`` is free for their rendezvous); return the results by rank."""
    os.environ.update(NO_MULTICAST_ENV)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, fn, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    try:
        while len(out) + len(errors) < world:
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                errors.append(f"timed out after {timeout:.0f} s waiting for ranks {sorted(set(range(world)) - set(out))}")
                break
            if ok:
                out[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise LocalGroupError("\n".join(errors))
    return [out[r] for r in range(world)]
