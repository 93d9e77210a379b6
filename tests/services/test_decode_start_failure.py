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
raises one, once, for one request.  The same for a `ProtocolError` (a shard that does not fit the
reservation: a prefill/decode mismatch), which a retry would meet again: `internal`, it was
`unavailable`. The KV the prefill sent for it is real, and so is the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from schemas import subjects
from schemas.api import GenerateRequest
from schemas.internal import Job, KVReservation, ReserveKV, SamplingSpec, StartDecode, TokenBatch, TokenMessage
from schemas.transfer import KVTransferDescriptor
from services.client import GenerateError
from services.decode.rank import DecodeRank
from shared.bus import Bus, connect, pack, unpack
from shared.kvcache import KVLayout, PagedKVCache
from shared.model.runner import ModelRunner
from shared.settings import DecodeSettings
from shared.transfer import KVReceiver, KVSender, ProtocolError, TransferWorker, UnknownTransfer, kv_head_shard

from services_helpers import HeartbeatWatch, run, session, stack_fixture

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("cpu_rank_transports")]

stack = stack_fixture("single-node.yml", scale={"decode": 0})

DECODE = "decode-inproc"
PROMPT = "The capital of France is"
MANY_TOKENS = 64  # steps enough for a StartDecode published after the first tokens to arrive while the request runs


class FailOnceReceiver(KVReceiver):
    """A real receiver whose wait for `request_id`'s KV raises `error` once instead of returning."""

    def __init__(self, *args: Any, request_id: str, error: Exception, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail = {request_id: error}

    async def wait_complete(self, request_id: str, timeout: float) -> list[int]:
        if (error := self.fail.pop(request_id, None)) is not None:
            raise error
        return await super().wait_complete(request_id, timeout)


@contextlib.asynccontextmanager
async def _decode_rank(url: str, tiny_model: Path, receiver: type[KVReceiver], **receiver_args: Any) -> AsyncIterator[tuple[DecodeRank, asyncio.Task[None], TransferWorker]]:
    """A decode rank of the stack in this process, stepping; its step loop's task (to check it still runs) and its UCX worker."""
    settings = DecodeSettings(nats_url=url, model=str(tiny_model), model_name=tiny_model.resolve().name, instance=DECODE, warmup=False)
    async with connect(settings.nats_url, "decode-inproc") as bus:
        runner = ModelRunner.from_dir(tiny_model, num_pages=settings.kv_pages, page_size=settings.page_size, device="cpu")
        worker = await TransferWorker.create()
        rank = DecodeRank(settings, bus, runner, receiver(worker, runner.cache, **receiver_args), 0, 1)
        await rank.start()
        loop = asyncio.create_task(rank.run())
        try:
            yield rank, loop, worker
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)  # a loop that died is the test's to report, after clean-up
            await rank.close()
            worker.close()


async def _stack_sees_the_rank(watch: HeartbeatWatch) -> None:
    await watch.wait_for(lambda w: [hb.instance for hb in w.live("decode")] == [DECODE] and len(w.live("prefill")) == 1, 10,
                         "the in-process decode rank and the prefill")
    await asyncio.sleep(1.0)  # the scheduler has heard the rank too


async def _pages_back(rank: DecodeRank, free: int, timeout: float = 3.0) -> tuple[int, dict[str, Any]]:
    """The rank's free page count and reservations once the pages are back (or `timeout` passed)."""
    allocator = rank.runner.cache.allocator
    until = time.monotonic() + timeout
    while (allocator.num_free != free or rank.reserved) and time.monotonic() < until:
        await asyncio.sleep(0.05)
    return allocator.num_free, dict(rank.reserved)


@pytest.mark.parametrize("error", [UnknownTransfer("injected: the receiver has no such reservation"), RuntimeError("injected bug"),
                                   ProtocolError("start-fails", "injected: undecodable shard header")],
                         ids=["unknown-transfer", "bug", "protocol-error"])
def test_a_start_that_fails_unexpectedly_ends_the_request_frees_its_pages_and_the_rank_serves_on(stack, tiny_model: Path, tokenizer, hf_greedy, error):
    async def go():  # type: ignore[no-untyped-def]
        async with _decode_rank(stack.url, tiny_model, FailOnceReceiver, request_id="start-fails", error=error) as (rank, loop, _), \
                session(stack.url) as (client, watch):
            await _stack_sees_the_rank(watch)
            free = rank.runner.cache.allocator.num_free
            began = time.monotonic()
            with pytest.raises(GenerateError) as failed:
                await client.generate(GenerateRequest(prompt=PROMPT, max_tokens=8, temperature=0, request_id="start-fails", timeout_ms=10_000))
            waited = time.monotonic() - began
            after = await _pages_back(rank, free)
            response = await client.generate(GenerateRequest(prompt=PROMPT, max_tokens=8, temperature=0, request_id="next"))
            return failed.value, waited, free, after, response, loop.done()

    failed, waited, free, (free_after, reserved_after), response, loop_ended = run(go())
    assert failed.code == "internal" and type(error).__name__ in failed.message, failed
    assert waited < 5, f"the error took {waited:.1f}s: the client waited for its deadline"
    assert reserved_after == {}, f"the failed start left its reservation behind: {reserved_after}"
    assert free_after == free, f"{free - free_after} KV pages did not come back"
    assert not loop_ended, "the rank's step loop ended"
    assert response.token_ids == hf_greedy(tuple(tokenizer.encode(PROMPT)), 8)


async def _send_kv(worker: TransferWorker, descriptor: KVTransferDescriptor) -> None:
    """Stand in for a one-rank prefill: send the reserved prompt's KV (zeros: its values do not matter here)
    from `worker` (the decode rank's: over UCX to itself, as the transfer tests do)."""
    lay = descriptor.layout
    cache = PagedKVCache(KVLayout(lay.num_layers, -(-descriptor.num_tokens // lay.page_size), lay.kv_heads, lay.page_size, lay.head_dim,
                                  getattr(torch, lay.dtype)), "cpu")
    sender = KVSender(worker, cache, descriptor, list(range(cache.layout.num_pages)), kv_head_shard(0, 1, lay.kv_heads), timeout_s=10)
    for layer in range(lay.num_layers):
        sender.on_layer_done(layer)
    await sender.finish()


async def _token_messages(bus: Bus, gateway: str) -> list[TokenMessage]:
    """What the decode rank publishes to `gateway`'s token subjects from now on."""
    messages: list[TokenMessage] = []

    async def on_message(msg) -> None:  # type: ignore[no-untyped-def]
        messages.append(unpack(msg.data, TokenMessage))

    await bus.subscribe(subjects.tokens_all(gateway), on_message, concurrent=False)
    await bus.nc.flush()
    return messages


def test_a_second_start_for_a_request_already_starting_or_running_is_ignored(stack, tiny_model: Path):
    """StartDecode published twice for one request, both arriving while its KV is still on the
    way, and a third time once it runs: the request starts once, runs to its end, and its pages
    come back once. (Failing the duplicate instead would free the pages the first start claims,
    under the running sequence; answering the late one "no reservation" would fail the request.)
    The test stands in for the scheduler (the reservation) and the prefill (the starts, the KV)."""
    async def go():  # type: ignore[no-untyped-def]
        async with _decode_rank(stack.url, tiny_model, KVReceiver) as (rank, loop, worker), session(stack.url) as (client, watch):
            await _stack_sees_the_rank(watch)
            gateway = watch.live("gateway")[0].instance  # alive, so the rank keeps the request; it ignores the tokens of an unknown id
            messages = await _token_messages(client.bus, gateway)
            free = rank.runner.cache.allocator.num_free
            job = Job(request_id="started-twice", gateway=gateway, input_ids=list(range(1, 9)), max_tokens=MANY_TOKENS,
                      sampling=SamplingSpec(temperature=0.0, top_p=1.0, top_k=0, seed=None), stop_token_ids=[], logprobs=False,
                      ignore_eos=True, deadline=time.time() + 30)
            reserve = ReserveKV(request_id=job.request_id, gateway=gateway, prompt_tokens=len(job.input_ids), max_tokens=job.max_tokens,
                                lease_until=job.deadline, reply_by=time.time() + 5, deadline=job.deadline)
            reservation = await client.bus.request(subjects.decode_reserve(DECODE, 0), reserve, KVReservation, timeout=5)
            assert reservation.ok and reservation.descriptor is not None, reservation
            start = pack(StartDecode(job=job, first_token=1, first_logprob=None, generator_state=None))
            for _ in range(2):
                await client.bus.publish(subjects.decode_start(DECODE, 0), start)
            await client.bus.nc.flush()
            await asyncio.sleep(0.5)  # both starts wait for the KV
            await _send_kv(worker, reservation.descriptor)
            until = time.monotonic() + 10
            while not messages and time.monotonic() < until:
                await asyncio.sleep(0.01)
            assert "started-twice" in rank.running, "the request finished before the late start could be sent"
            await client.bus.publish(subjects.decode_start(DECODE, 0), start)
            while not any(isinstance(m, TokenBatch) and m.finish_reason for m in messages) and time.monotonic() < until:
                await asyncio.sleep(0.05)
            after = await _pages_back(rank, free)
            await asyncio.sleep(0.3)  # anything published late
            return messages, free, after, loop.done()

    messages, free, (free_after, reserved_after), loop_ended = run(go())
    assert not loop_ended, "the rank's step loop ended"
    batches = [m for m in messages if isinstance(m, TokenBatch)]
    assert [m for m in messages if not isinstance(m, TokenBatch)] == [], messages
    assert sum(len(b.token_ids) for b in batches) == MANY_TOKENS - 1 and batches[-1].finish_reason == "length", batches  # the first token came with the start
    assert (free_after, reserved_after) == (free, {}), f"{free - free_after} KV pages did not come back, reservations {reserved_after}"
