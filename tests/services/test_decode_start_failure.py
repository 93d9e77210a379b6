"""A decode rank whose start of a sequence fails with an error other than a KV transfer's ends
that request at once and keeps serving: the client gets a typed `internal` error naming the
exception, the reservation's pages come back, and the next request is served in full. Before
the fix only a `TransferError` was caught there: the reservation stayed marked `starting`
(skipped by its lease), its pages and batch slot leaked, and the client waited for its deadline.

Real stack (compose/single-node.yml without its decode service: gateway, scheduler and prefill
processes) whose one decode rank runs in this process (a tiny CPU model, a real KV receiver over
UCX tcp), so the failure can be injected: no real input makes the receiver's `wait_complete`
raise anything but a `TransferError` (its `UnknownTransfer` needs the rank and its receiver to
disagree about a reservation; a plain `RuntimeError` stands for a bug), so a receiver subclass
raises one, once, for one request. The KV the prefill sent for it is real, and so is the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path

import pytest

from schemas.api import GenerateRequest
from services.client import GenerateError
from services.decode.rank import DecodeRank
from shared.bus import connect
from shared.model.runner import ModelRunner
from shared.settings import DecodeSettings
from shared.transfer import KVReceiver, TransferWorker, UnknownTransfer

from services_helpers import run, session, stack_fixture

pytestmark = pytest.mark.slow
os.environ.setdefault("UCX_TLS", "tcp,self")  # as the stack's CPU ranks use (services/model_rank.py)

stack = stack_fixture("single-node.yml", scale={"decode": 0})

DECODE = "decode-inproc"
PROMPT = "The capital of France is"


class FailOnceReceiver(KVReceiver):
    """A real receiver whose wait for `request_id`'s KV raises `error` once instead of returning."""

    def __init__(self, *args, request_id: str, error: Exception, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.fail = {request_id: error}

    async def wait_complete(self, request_id: str, timeout: float) -> list[int]:
        if (error := self.fail.pop(request_id, None)) is not None:
            raise error
        return await super().wait_complete(request_id, timeout)


@pytest.mark.parametrize("error", [UnknownTransfer("injected: the receiver has no such reservation"), RuntimeError("injected bug")],
                         ids=["unknown-transfer", "bug"])
def test_a_start_that_fails_unexpectedly_ends_the_request_frees_its_pages_and_the_rank_serves_on(stack, tiny_model: Path, tokenizer, hf_greedy, error):
    settings = DecodeSettings(nats_url=stack.url, model=str(tiny_model), model_name=tiny_model.resolve().name, instance=DECODE, warmup=False)

    async def go():  # type: ignore[no-untyped-def]
        async with connect(settings.nats_url, "decode-inproc") as bus:
            runner = ModelRunner.from_dir(tiny_model, num_pages=settings.kv_pages, page_size=settings.page_size, device="cpu")
            worker = await TransferWorker.create()
            rank = DecodeRank(settings, bus, runner, FailOnceReceiver(worker, runner.cache, request_id="start-fails", error=error), 0, 1)
            await rank.start()
            loop = asyncio.create_task(rank.run())
            try:
                async with session(stack.url) as (client, watch):
                    await watch.wait_for(lambda w: [hb.instance for hb in w.live("decode")] == [DECODE] and len(w.live("prefill")) == 1, 10,
                                         "the in-process decode rank and the prefill")
                    await asyncio.sleep(1.0)  # the scheduler has heard the rank too
                    free = runner.cache.allocator.num_free
                    began = time.monotonic()
                    with pytest.raises(GenerateError) as failed:
                        await client.generate(GenerateRequest(prompt=PROMPT, max_tokens=8, temperature=0, request_id="start-fails", timeout_ms=10_000))
                    waited = time.monotonic() - began
                    freed_by = time.monotonic() + 3
                    while (runner.cache.allocator.num_free != free or rank.reserved) and time.monotonic() < freed_by:
                        await asyncio.sleep(0.05)
                    after = runner.cache.allocator.num_free, dict(rank.reserved)
                    response = await client.generate(GenerateRequest(prompt=PROMPT, max_tokens=8, temperature=0, request_id="next"))
                    return failed.value, waited, free, after, response, loop.done()
            finally:
                loop.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await loop
                await rank.close()
                worker.close()

    failed, waited, free, (free_after, reserved_after), response, loop_ended = run(go())
    assert failed.code == "internal" and type(error).__name__ in failed.message, failed
    assert waited < 5, f"the error took {waited:.1f}s: the client waited for its deadline"
    assert reserved_after == {}, f"the failed start left its reservation behind: {reserved_after}"
    assert free_after == free, f"{free - free_after} KV pages did not come back"
    assert not loop_ended, "the rank's step loop ended"
    assert response.token_ids == hf_greedy(tuple(tokenizer.encode(PROMPT)), 8)
