"""A service that serves has frozen its startup heap (`services.common.freeze_startup_heap`),
so that the garbage collector's full collections no longer walk its imports on the event loop.

Runs the scheduler's and the HTTP frontends' own entry points in this process, against a real
nats-server, and reads this process' frozen count (which only `gc.freeze` raises)."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from services import http
from services.scheduler.__main__ import serve as serve_scheduler
from shared.settings import OpenAISettings, SchedulerSettings


async def _until_frozen(entry: Coroutine[Any, Any, None], timeout_s: float = 10.0) -> int:
    """Run a service entry point until this process' heap is frozen; the frozen count (0: never)."""
    task = asyncio.create_task(entry)
    try:
        deadline = time.monotonic() + timeout_s
        while gc.get_freeze_count() == 0 and time.monotonic() < deadline and not task.done():
            await asyncio.sleep(0.02)
        if task.done():
            task.result()  # the entry point failed: say why
        return gc.get_freeze_count()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _no_route(conn: http.Connection) -> None:
    conn.keep = False


ENTRIES: dict[str, Callable[[str], Coroutine[Any, Any, None]]] = {
    "scheduler": lambda url: serve_scheduler(SchedulerSettings(nats_url=url, model_name="heap", instance="heap")),
    "http frontend": lambda url: http.listen("openai", _no_route, "/v1", OpenAISettings(nats_url=url, port=0)),
}


@pytest.mark.parametrize("entry", ENTRIES)
def test_ready_service_has_frozen_its_startup_heap(entry: str, nats_server: tuple[int, list[Any]]) -> None:
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    try:
        frozen = asyncio.run(_until_frozen(ENTRIES[entry](f"nats://127.0.0.1:{nats_server[0]}")))
    finally:
        gc.unfreeze()  # the rest of the test session collects as before
    assert frozen > 10_000, f"the {entry}, serving, froze {frozen} objects (its imports alone are more)"
