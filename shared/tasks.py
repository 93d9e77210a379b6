"""Tasks that their starter does not await, held until they are done.

The event loop keeps only weak references to tasks: one that nothing else holds may be
garbage-collected before it finishes (asyncio's `create_task` documentation). Whoever starts
a task without awaiting it starts it with `spawn`, into a set it keeps: the set holds the task
until it is done, and tells its owner what is still running when it shuts down.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def spawn(tasks: set[asyncio.Task[Any]], coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """Run `coro` as a task held in `tasks` until it is done."""
    task = asyncio.get_running_loop().create_task(coro)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return task
