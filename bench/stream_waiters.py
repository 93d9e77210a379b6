"""CPU a process spends on reply streams that wait (DESIGN §7): requests queued at a scheduler.

A gateway holds one `Bus.stream` per request queued at a scheduler (`services.submit.answers`),
each waiting for its final answer with a check of whether that scheduler is gone (`gone`).
This starts a real nats-server, a responder that answers nothing (so the requests are taken,
as a queueing scheduler takes them), and N such waiting streams in one process, then measures
that process's CPU time (user + system) over a window in which nothing arrives: the cost of
waiting alone, per waiter count.

    python -m bench.stream_waiters [--waiters 0,256,1024,4096] [--window-s 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
from pathlib import Path

from bench.results import print_table, record
from services.launch import start_nats_server
from services.ranks import free_port
from shared.bus import Deadline, Silent, connect
from shared.settings import NatsServerSettings

BENCH = "stream_waiters"
SUBJECT = "bench.waiters"


async def measure(url: str, waiters: int, window_s: float) -> dict[str, float]:
    """CPU seconds per wall second of this process while ``waiters`` streams wait with a `gone` check."""
    async with connect(url, "bench-waiters") as bus:
        async def silent(_msg) -> None:  # takes each request, answers nothing
            return None

        await bus.subscribe(SUBJECT, silent)
        checks = 0

        def gone() -> str:
            nonlocal checks
            checks += 1
            return ""

        async def wait() -> None:
            with contextlib.suppress(Silent, TimeoutError):
                async for _ in bus.stream(SUBJECT, b"", lambda _m: True, Deadline.after(window_s + 30), gone=gone):
                    pass

        tasks = [asyncio.create_task(wait()) for _ in range(waiters)]
        await asyncio.sleep(1.0)  # every stream subscribed and its request out
        checks = 0
        cpu0, wall0 = time.process_time(), time.monotonic()
        await asyncio.sleep(window_s)
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"cpu_fraction": cpu / wall, "gone_checks_per_s": checks / wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--waiters", default="0,256,1024,4096", help="comma list of waiting stream counts")
    ap.add_argument("--window-s", type=float, default=5.0)
    args = ap.parse_args(argv)
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        server = start_nats_server(port, NatsServerSettings(), Path(tmp))
        try:
            rows = []
            for n in (int(w) for w in args.waiters.split(",") if w):
                metrics = asyncio.run(measure(f"nats://127.0.0.1:{port}", n, args.window_s))
                record(BENCH, {"waiters": n, "window_s": args.window_s}, metrics)
                rows.append({"waiters": n, **metrics})
        finally:
            server.terminate()
            server.wait()
    print_table(rows, ["waiters", "cpu_fraction", "gone_checks_per_s"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
