"""`shared.tasks.spawn`: a task its starter does not await is held until it is done, then let go.

The hazard is real: the control task below, started with a plain `create_task` and held by
nothing, is garbage-collected while it still waits (asyncio holds tasks only weakly)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

from shared.tasks import spawn


async def _waits_forever() -> None:
    # On a future only this coroutine references: nothing outside its task can reach the task.
    await asyncio.get_running_loop().create_future()


def test_a_spawned_task_outlives_a_garbage_collection_that_takes_an_unheld_one_and_is_let_go_when_done():
    async def go() -> tuple[bool, bool, int, int, list[str]]:
        loop = asyncio.get_running_loop()
        destroyed: list[str] = []  # "Task was destroyed but it is pending!", from the collected control
        loop.set_exception_handler(lambda _loop, context: destroyed.append(context["message"]))
        tasks: set[asyncio.Task[Any]] = set()
        unheld = weakref.ref(loop.create_task(_waits_forever()))
        held = weakref.ref(spawn(tasks, _waits_forever()))
        await asyncio.sleep(0)  # both run up to their wait
        gc.collect()
        unheld_alive, held_alive = unheld() is not None, held() is not None
        waiting = len(tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        quick = spawn(tasks, asyncio.sleep(0))
        await quick
        return unheld_alive, held_alive, waiting, len(tasks), destroyed

    unheld_alive, held_alive, waiting, left, destroyed = asyncio.run(go())
    assert not unheld_alive and destroyed, "the control task was not collected: this test shows nothing here"
    assert held_alive and waiting == 1, "the spawned task was garbage-collected while it waited"
    assert left == 0, "finished tasks stay in the set"
