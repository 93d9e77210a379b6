"""OpenAI's ``n`` and batched prompts: the choices of one HTTP request as moebus requests, run at once.

The engine serves one sequence per request, so the frontend fans out: choice ``i`` of
prompt ``p`` (completions take a list of prompts) is a request of its own with request id
``<id>-<p * n + i>`` (just ``<id>`` for one prompt and ``n`` 1) and, when the body gives a
``seed``, the seed ``seed + i`` (mod 2**64): the same body gives the same choices again,
and choice 0 is what the body with ``n: 1`` gives. Without a seed each choice draws on its
own. The first choice that fails fails the whole answer with its
error, and the others are cancelled (``llm.cancel``); so are all of them when the HTTP
client hangs up (the server cancels `ids`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import msgspec

from schemas.api import GenerateChunk, GenerateRequest, GenerateResponse
from services.client import Client
from shared.tasks import cancel_and_wait

_SEEDS = 2**64


def choice_requests(gens: list[GenerateRequest], n: int) -> list[GenerateRequest]:
    """The moebus requests of one OpenAI request: ``n`` per prompt (``gens``, one per prompt,
    carry the request's id and seed), choice ``p * n + i`` the ``i``-th of prompt ``p``."""
    if len(gens) == 1 and n == 1:
        return gens
    return [msgspec.structs.replace(gen, request_id=f"{gen.request_id}-{p * n + i}", seed=None if gen.seed is None else (gen.seed + i) % _SEEDS)
            for p, gen in enumerate(gens) for i in range(n)]


class Choices:
    """Runs the choice requests of one OpenAI request through ``client``."""

    def __init__(self, client: Client, gens: list[GenerateRequest]) -> None:
        self.client = client
        self.gens = gens
        self.ids = [g.request_id for g in gens]

    async def responses(self) -> list[GenerateResponse]:
        """Every choice's response, in choice order; the first failure (a `GenerateError`) is raised."""
        tasks = [asyncio.ensure_future(self.client.generate(g)) for g in self.gens]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failed = [t for t in tasks if t.done() and t.exception() is not None]
            if failed:
                await self._cancel_unfinished(tasks)
                raise failed[0].exception()  # type: ignore[misc]
            return [t.result() for t in tasks]
        finally:
            await _stop(tasks)

    async def chunks(self) -> AsyncIterator[tuple[int, GenerateChunk]]:
        """(choice index, chunk) of every choice's stream, as they arrive; the first failure is raised."""
        queue: asyncio.Queue[tuple[int, GenerateChunk | BaseException | None]] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for chunk in self.client.stream(self.gens[i]):
                    queue.put_nowait((i, chunk))
                queue.put_nowait((i, None))
            except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
                queue.put_nowait((i, e))

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(self.gens))]
        running = len(tasks)
        try:
            while running:
                i, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    await self._cancel_unfinished(tasks)
                    raise item
                else:
                    yield i, item
        finally:
            await _stop(tasks)

    async def _cancel_unfinished(self, tasks: list[asyncio.Future]) -> None:
        """The gateway drops the choices still running (stopping our side of them is `_stop`'s job)."""
        for request_id, task in zip(self.ids, tasks, strict=True):
            if not task.done():
                await self.client.cancel(request_id, "another choice of the same request failed")


async def _stop(tasks: list[asyncio.Future]) -> None:
    with contextlib.suppress(Exception):  # the first failure was raised already (`responses`, `chunks`): the others add nothing
        await cancel_and_wait(*tasks)
