"""Multi-rank instances: one process per rank, supervised as a unit.

A prefill instance (TP group) and a decode instance (DP x EP group) are groups of
processes that run collectives together; a group that lost a member can only hang,
so the supervisor stops every rank as soon as one dies and exits non-zero (the
instance disappears from the registry; its requests fail over the heartbeat watch).
SIGTERM/SIGINT are forwarded so every rank drains. Ranks die with the supervisor
(PR_SET_PDEATHSIG), so killing the supervisor never leaves orphans holding KV.

An instance of one rank runs in the calling process, without a supervisor.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from shared.logging import get_logger

log = get_logger(__name__)

RankMain = Callable[[Any, int, int, int], None]  # (settings, rank, world, dist_port)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Linux: receive `sig` when the parent process dies (PR_SET_PDEATHSIG); no-op elsewhere."""
    if sys.platform == "linux":
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, sig)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:
            os._exit(1)  # the parent died before prctl took effect


def _rank_entry(rank_main: RankMain, settings: Any, rank: int, world: int, port: int) -> None:
    die_with_parent()
    rank_main(settings, rank, world, port)


def run_group(rank_main: RankMain, settings: Any, world: int, dist_port: int, drain_timeout_s: float) -> int:
    """Run `world` ranks of `rank_main` (in-process when world == 1); returns the exit status."""
    if world == 1:
        rank_main(settings, 0, 1, dist_port)
        return 0
    port = dist_port or free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_entry, args=(rank_main, settings, r, world, port), name=f"rank{r}") for r in range(world)]
    for p in procs:
        p.start()

    stop_requested_at: float | None = None

    def forward(signum: int, _frame: Any) -> None:
        nonlocal stop_requested_at
        stop_requested_at = stop_requested_at or time.monotonic()
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)

    failed = False
    alive = list(procs)
    while alive:
        mp.connection.wait([p.sentinel for p in alive], timeout=0.5)
        for p in [p for p in alive if not p.is_alive()]:
            alive.remove(p)
            if p.exitcode != 0 and not failed:
                log.error("rank_died", rank=procs.index(p), exitcode=p.exitcode)
                failed = True
                _stop(alive, grace_s=2.0)  # the others would block in their next collective
        if stop_requested_at and time.monotonic() - stop_requested_at > drain_timeout_s + 5.0:
            log.error("ranks_did_not_drain", timeout_s=drain_timeout_s)
            _stop(alive, grace_s=0.0)
            failed = True
    return 1 if failed else 0


def _stop(procs: list[mp.Process], grace_s: float) -> None:
    """SIGTERM, then SIGKILL whatever is still running after `grace_s`."""
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGTERM)
    end = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
