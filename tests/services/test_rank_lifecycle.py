"""`services.model_rank.run_until_stopped`, the serve-drain-close lifecycle of a decode rank and a
prefill group: the rank is closed (heartbeats stopped, KV receiver closed) however it ends, and
what ended it still propagates. Before, a loop that raised skipped the close (`await loop` raised
first), and so did a drain that raised or a cancel of the caller, which also left the loop running.

A pure control-flow contract, so the rank loop is a stand-in that records what was called."""

from __future__ import annotations

import asyncio

import pytest

from services.model_rank import run_until_stopped


class Loop:
    """A RankLoop: `run` waits until drained (or raises `fails_with`), recording the calls."""

    def __init__(self, fails_with: Exception | None = None, drain_fails: bool = False, swallows_cancel: bool = False) -> None:
        self.fails_with = fails_with
        self.drain_fails = drain_fails
        self.swallows_cancel = swallows_cancel
        self.calls: list[str] = []
        self.drained = asyncio.Event()
        self.running = asyncio.Event()
        self.last_step = asyncio.Event()
        self.run_ended = False

    async def run(self) -> None:
        self.running.set()
        try:
            if self.fails_with is not None:
                raise self.fails_with
            if self.swallows_cancel:
                await self.drained.wait()
                self.last_step.set()
                try:
                    await asyncio.sleep(3600)  # the drained group's last step
                except asyncio.CancelledError:
                    return  # ends as if it finished: the cancel is not raised
            await self.drained.wait()  # never set when the drain fails
        finally:
            self.run_ended = True

    async def drain(self) -> None:
        self.calls.append("drain")
        if self.drain_fails:
            raise RuntimeError("drain failed")
        self.drained.set()

    async def close(self) -> None:
        self.calls.append("close")


def test_a_loop_that_raises_is_drained_and_closed_and_its_error_propagates() -> None:
    loop = Loop(fails_with=RuntimeError("step failed"))

    async def go() -> None:
        await run_until_stopped(loop, asyncio.Event())

    with pytest.raises(RuntimeError, match="step failed"):
        asyncio.run(go())
    assert loop.calls == ["drain", "close"]


def test_a_drain_that_raises_ends_the_loop_and_closes_and_its_error_propagates() -> None:
    loop = Loop(drain_fails=True)

    async def go() -> None:
        stop = asyncio.Event()
        stop.set()
        await run_until_stopped(loop, stop)

    with pytest.raises(RuntimeError, match="drain failed"):
        asyncio.run(go())
    assert loop.run_ended, "the loop still ran after run_until_stopped raised"
    assert loop.calls == ["drain", "close"]


def test_a_cancel_of_the_caller_ends_the_loop_closes_and_is_raised() -> None:
    loop = Loop()

    async def go() -> bool:
        stopping = asyncio.ensure_future(run_until_stopped(loop, asyncio.Event()))
        await loop.running.wait()
        stopping.cancel()
        await asyncio.wait({stopping}, timeout=10.0)
        return stopping.cancelled()

    assert asyncio.run(go()), "run_until_stopped did not end cancelled"
    assert loop.run_ended, "the loop still ran after its caller was cancelled"
    assert loop.calls == ["close"]


def test_a_cancel_the_loop_swallows_while_the_group_drains_is_still_raised() -> None:
    loop = Loop(swallows_cancel=True)

    async def go() -> bool:
        stop = asyncio.Event()
        stopping = asyncio.ensure_future(run_until_stopped(loop, stop))
        stop.set()
        await loop.last_step.wait()  # run_until_stopped awaits the loop since its drain returned
        stopping.cancel()
        await asyncio.wait({stopping}, timeout=10.0)
        return stopping.cancelled()

    assert asyncio.run(go()), "run_until_stopped returned as if never cancelled: the loop swallowed the cancel it handed on"
    assert loop.calls == ["drain", "close"]
