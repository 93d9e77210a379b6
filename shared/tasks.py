"""Tasks that their starter does not await, held until they are done.

The event loop keeps only weak references to tasks: one that nothing else holds may be
garbage-collected before it finishes (asyncio's `create_task` documentation). `spawn` starts
such a task into a set its owner keeps: the set holds the task until it is done, and tells its
owner what is still running when it shuts down. An owner that must find one of its tasks again
(a heartbeat or expiry loop to cancel, a probe by member, a sender's sends in order) holds it in
an attribute, dict or list of its own instead.
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
