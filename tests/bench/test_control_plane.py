"""bench.control_plane's load generator (no timing here: the bench measures, this checks its shape)."""

from __future__ import annotations

import asyncio

from bench.control_plane import closed_loop


def test_closed_loop_starts_no_send_ahead_of_its_clients() -> None:
    """``concurrency`` clients, each sending its next as its last is answered: no submission is
    waiting its turn inside the loop while others are timed (the semaphore version ran every waiting
    submission's first step ahead of the first answers, whose latency counted it)."""
    tasks_seen: list[int] = []
    in_flight = 0
    most_in_flight = 0

    async def send(i: int) -> bool:
        nonlocal in_flight, most_in_flight
        tasks_seen.append(len(asyncio.all_tasks()))
        in_flight += 1
        most_in_flight = max(most_in_flight, in_flight)
        await asyncio.sleep(0)
        in_flight -= 1
        return i % 2 == 0

    async def run() -> list[bool]:
        return await closed_loop(range(100), 4, send)

    assert asyncio.run(run()) == [i % 2 == 0 for i in range(100)]
    assert most_in_flight == 4
    assert max(tasks_seen) <= 4 + 1, f"{max(tasks_seen)} tasks alive for 4 clients (plus the main one)"
