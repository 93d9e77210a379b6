"""A decode rank's batch changes while it decodes, in process: a real nats-server, a tiny CPU model,
a real KV receiver over UCX (tcp). The rank's worker thread runs step after step while its batch
stays the same (services/decode/rank.py `_chain`); a request that starts, one that is cancelled
and one whose deadline passes must still change the batch at the next step, not when the
requests running beside them finish (each of these waits ended only then when the chain did
not stop for them)."""

from __future__ import annotations

import asyncio
import time

import pytest

from schemas import subjects
from schemas.internal import Cancel, Job, SamplingSpec, StageError, StartDecode, TokenBatch, TokenMessage
from services.decode.rank import DecodeRank, Reservation
from shared.bus import Bus, connect, pack, unpack
from shared.model.runner import ModelRunner
from shared.model.tiny import make_tiny
from shared.settings import DecodeSettings
from shared.transfer import KVReceiver, TransferWorker

from services_helpers import until

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("cpu_rank_transports")]

PROMPT = [1, 2, 3, 4]
ENDLESS = 5000  # tokens: at a few ms per step, tens of seconds of decoding unless something ends the request
WAIT_S = 30.0  # bound of each wait below (each takes well under a second when the rank reacts)


def _job(request_id: str, max_tokens: int, deadline_s: float = 600.0) -> Job:
    return Job(request_id=request_id, gateway="gw", input_ids=PROMPT, max_tokens=max_tokens,
               sampling=SamplingSpec(temperature=0.0, top_p=1.0, top_k=0, seed=None), stop_token_ids=[],
               logprobs=False, ignore_eos=True, deadline=time.time() + deadline_s)


def _run(rank: DecodeRank, runner: ModelRunner, job: Job) -> None:
    """A request as StartDecode leaves it once its KV landed (no prefill here): `_begin` on the rank."""
    pages = runner.cache.allocator.alloc(runner.cache.layout.pages_for(len(PROMPT) + job.max_tokens))
    res = Reservation(job.request_id, job.gateway, extra_pages=[], gateway_started_at=0.0, lease_is_deadline=False)
    rank.reserved[job.request_id] = res
    rank._begin(res, StartDecode(job=job, first_token=5, first_logprob=None, generator_state=None), pages)


class Tokens:
    """What the rank published for each request, in arrival order."""

    def __init__(self) -> None:
        self.messages: dict[str, list[TokenMessage]] = {}

    async def attach(self, bus: Bus) -> None:
        async def on_message(msg) -> None:  # type: ignore[no-untyped-def]
            self.messages.setdefault(msg.subject.rsplit(".", 1)[-1], []).append(unpack(msg.data, TokenMessage))

        await bus.subscribe(subjects.tokens_all("gw"), on_message, concurrent=False)

    def ended(self, request_id: str) -> TokenMessage | None:
        last = (self.messages.get(request_id) or [None])[-1]
        return last if isinstance(last, StageError) or (isinstance(last, TokenBatch) and last.finish_reason is not None) else None


def test_starts_cancels_and_deadlines_change_a_running_batch_at_the_next_step(tmp_path, nats_server):
    port, _ = nats_server
    model = make_tiny(tmp_path / "tiny", seed=3)
    settings = DecodeSettings(nats_url=f"nats://127.0.0.1:{port}", instance="d0", warmup=False, kv_pages=8192, max_batch=8)

    async def scenario() -> None:
        async with connect(settings.nats_url, "decode-test") as bus, connect(settings.nats_url, "gateway-test") as gateway:
            tokens = Tokens()
            await tokens.attach(gateway)
            await gateway.nc.flush()
            runner = ModelRunner.from_dir(model, num_pages=settings.kv_pages, page_size=settings.page_size, device="cpu")
            worker = await TransferWorker.create()
            rank = DecodeRank(settings, bus, runner, KVReceiver(worker, runner.cache), 0, 1)
            await rank.start()
            free_before = runner.cache.allocator.num_free
            loop = asyncio.create_task(rank.run())
            try:
                _run(rank, runner, _job("long", ENDLESS))
                await until(lambda: len(tokens.messages.get("long", [])) >= 3, "the long request's first tokens", WAIT_S)

                # A request that starts beside it joins the batch and finishes first.
                _run(rank, runner, _job("short", 4))
                await until(lambda: tokens.ended("short") is not None, "the short request to finish", WAIT_S)
                assert tokens.ended("long") is None and "long" in rank.running
                short = tokens.messages["short"]
                assert [m.start for m in short] == [1, 2, 3] and short[-1].finish_reason == "length", short  # type: ignore[union-attr]

                # A request whose deadline passes mid-batch fails with `timeout` at the next step.
                _run(rank, runner, _job("late", ENDLESS, deadline_s=0.5))
                await until(lambda: tokens.ended("late") is not None, "the late request to time out", WAIT_S)
                late = tokens.ended("late")
                assert isinstance(late, StageError) and late.code == "timeout", late
                assert tokens.ended("long") is None and "long" in rank.running

                # A cancel ends the long one at the next step: freed, every page back.
                await gateway.publish(subjects.CTL_CANCEL, pack(Cancel("long", "client cancelled")))
                await until(lambda: not rank.running, "the cancelled request to be freed", WAIT_S)
                assert runner.cache.allocator.num_free == free_before
                assert tokens.ended("long") is None and not loop.done(), loop
            finally:
                loop.cancel()
                await rank.receiver.close()
                worker.close()

    asyncio.run(scenario())
