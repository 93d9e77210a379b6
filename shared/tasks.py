"""Tasks that their starter does not await, held until they are done; stopping them without losing
a cancel of the one who stops them.

The event loop keeps only weak references to tasks: one that nothing else holds may be
garbage-collected before it finishes (asyncio's `create_task` documentation). `spawn` starts
such a task into a set its owner keeps: the set holds the task until it is done, and tells its
owner what is still running when it shuts down. An owner that must find one of its tasks again
(a heartbeat or expiry loop to cancel, a probe by member, a sender's sends in order) holds it in
an attribute, dict or list of its own instead, and ends it with `cancel_and_wait`.

A cancel can get lost on its way out of an await: a task waiting on another task hands a cancel it
gets to that task, and gets it back as that task's CancelledError, which the usual
``task.cancel(); with suppress(CancelledError): await task`` then swallows as the stopped task's;
and Python 3.11's `asyncio.wait_for` (under nats-py's request, flush and drain) returns a result
that arrives in the same turn of the loop as a cancel and drops the cancel. The task then carries
on past its owner's cancel (an `asyncio.timeout` around it never fires). `no_lost_cancel` raises
such a cancel at the end of its block: `Task.cancelling` counts every cancel requested.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


def spawn(tasks: set[asyncio.Task[Any]], coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """Run `coro` as a task held in `tasks` until it is done."""
    task = asyncio.get_running_loop().create_task(coro)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return task


@contextlib.contextmanager
def no_lost_cancel() -> Iterator[None]:
    """Raise CancelledError when the block ends normally although the running task was cancelled
    within it (the cancel was swallowed on the way: see the module doc)."""
    task = asyncio.current_task()
    assert task is not None, "no_lost_cancel runs in a task"
    cancels = task.cancelling()
    yield
    if task.cancelling() > cancels:
        raise asyncio.CancelledError


async def cancel_and_wait(*tasks: asyncio.Future[Any]) -> None:
    """Cancel ``tasks`` and wait until every one ended. Their CancelledError is theirs, not raised
    here; the first other exception one of them ended with is, once all ended. A cancel of the
    caller meanwhile is raised once they ended."""
    for task in tasks:
        task.cancel()
    errors: list[Exception] = []
    with no_lost_cancel():
        for task in tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception as e:  # noqa: BLE001 - raised below, once every task ended
                errors.append(e)
    if errors:
        raise errors[0]
