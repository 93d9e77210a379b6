"""One bad request fails alone, one bad batch fails its own requests, neither the prefill instance.

A real stack (compose/single-node.yml's gateway, scheduler and decode rank on a real
nats-server) whose only prefill instance is a real `PrefillGroup` in this process, on the tiny
checkpoint. No client input reaches the failures tested here (the gateway refuses the prompts
the runner would), so they are injected into the real components by subclasses, for one
prompt only (`POISON`):

- the runner's `add` raises while the batch is prepared (after its pages were taken), the
  leader cannot hash the prompt's page keys while it plans the batch, or the forward raises:
  the request gets `internal` naming the exception at once (a forward's exception was reported
  as `unavailable`), the prefill's pages and the decode rank's reservation come back, and the
  same instance serves the next request (before, the exception ended the instance: the request
  waited for its deadline, every later one failed);
- the runner's `add` raises for one request of a batch of two: that request fails alone and the
  other one runs (it failed with its batch);
- the ranks' agreement after the forward raises (a collective failing: the group can no longer
  be trusted): the instance stops, loudly, but the request gets `internal` before it does and
  the decode rank frees its reservation;
- in a TP group of 2 (gloo, spawned processes, `prefill_workers.tp_rank`, no bus) rank 1
  alone cannot prepare a task (its `add` raises, or its pages are short): both ranks fail that
  task alone with `internal` and give its pages back (rank 0 no longer enters a forward that
  rank 1 never joins), and run the rest of its batch, their pages staying alike; then the
  leader alone has a prompt's pages cached and plans to reuse them: both ranks reuse none (what
  rank 1 has) and run it, and both caches hold its pages after.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from schemas.api import GenerateRequest
from services.client import Client, GenerateError
from services.launch import LocalStack
from services.model_rank import prepare_rank_environment
from services.prefill.batch import BatchRunner
from services.prefill.group import PrefillGroup
from shared.bus import connect
from shared.model.runner import ModelRunner
from shared.settings import PrefillSettings
from shared.transfer import TransferWorker, prepare_direct_writes

from prefill_workers import POISON, FailingForwardRunner, PoisonedRunner, run_tp_pair, tp_rank
from services_helpers import HeartbeatWatch, all_kv_free, compose_specs, run, session, start_specs

pytestmark = pytest.mark.slow

INSTANCE = "prefill-in-process"


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    specs = [s for s in compose_specs("single-node.yml", tiny_model) if s.role in ("gateway", "scheduler", "decode")]
    stack = start_specs(specs, tiny_model, tmp_path_factory.mktemp("stack-logs"))
    try:
        yield stack
    finally:
        stack.stop()


def running_batches_on(batch_runner_cls: type[BatchRunner]) -> type[PrefillGroup]:
    """The real group, whose batches run on ``batch_runner_cls`` (a `BatchRunner` with a fault injected)."""

    class Group(PrefillGroup):
        def __init__(self, settings, runner, worker, rank, world, bus) -> None:  # type: ignore[no-untyped-def]
            super().__init__(settings, runner, worker, rank, world, bus)
            self.batch_runner = batch_runner_cls(settings, runner, worker, rank, world, self.prefix)

    return Group


class UnplannableBatches(BatchRunner):
    """The real batch runner, which cannot hash the `POISON` prompt's page keys while the leader plans a batch."""

    def prompt_keys(self, task):  # type: ignore[no-untyped-def]
        if task.job.input_ids == POISON:
            raise RuntimeError("injected: the page keys cannot be hashed")
        return super().prompt_keys(task)


class PairingGroup(PrefillGroup):
    """The real group, whose leader forms no batch until two tasks are queued (or it drains), so
    that the test's two prompts run as one batch; it notes the size of each batch it forms."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.sizes: list[int] = []

    async def _take_batch(self, drain_deadline):  # type: ignore[no-untyped-def]
        while len(self.queue) < 2 and not self.draining:
            await asyncio.sleep(0.01)
        batch = await super()._take_batch(drain_deadline)
        if batch:
            self.sizes.append(len(batch))
        return batch


class BrokenReleaseBatches(BatchRunner):
    """The real batch runner, whose release of the pages after the forward raises for a batch of the `POISON`
    prompt (as a collective failing there would on a TP group: a group of one rank has none)."""

    poisoned = False

    async def prefill(self, planned):  # type: ignore[no-untyped-def]
        self.poisoned = any(p.task.job.input_ids == POISON for p in planned)
        return await super().prefill(planned)

    def _give_back(self, planned, page_tables, computed):  # type: ignore[no-untyped-def]
        if self.poisoned:
            raise RuntimeError("injected: the pages' release failed")
        return super()._give_back(planned, page_tables, computed)


@contextlib.asynccontextmanager
async def prefill_instance(url: str, tiny_model: Path, watch: HeartbeatWatch, runner_cls: type[ModelRunner] = ModelRunner,
                           group_cls: type[PrefillGroup] = PrefillGroup) -> AsyncIterator[tuple[PrefillGroup, asyncio.Task[None]]]:
    """A prefill instance of one rank in this process, as `services.prefill` runs it (warm-up skipped),
    until the scheduler can place prompts on it; drained at the end if it still serves."""
    settings = PrefillSettings(model=str(tiny_model), model_name=tiny_model.resolve().name, nats_url=url, instance=INSTANCE, warmup=False)
    prepare_rank_environment("cpu", 1)
    runner = runner_cls.from_dir(tiny_model, num_pages=settings.kv_pages, page_size=settings.page_size, release_finished=False)
    worker = await TransferWorker.create()
    prepare_direct_writes(runner.cache.device, runner.cache.layout.dtype, runner.cache.layout.head_dim)
    try:
        async with connect(url, INSTANCE) as bus:
            group = group_cls(settings, runner, worker, 0, 1, bus)
            await group.start()
            serving = asyncio.create_task(group.run())
            try:
                await watch.wait_for(lambda w: any(hb.instance == INSTANCE for hb in w.live("prefill")), 10, "the in-process prefill's heartbeat")
                yield group, serving
            finally:
                if not serving.done():
                    await group.drain()
                    await asyncio.wait_for(serving, 30)
                await group.close()
    finally:
        worker.close()


async def poisoned_request(client: Client) -> tuple[GenerateError, float]:
    """The `POISON` prompt's error and how long it took (its deadline is 20 s away)."""
    started = time.monotonic()
    with pytest.raises(GenerateError) as failed:
        await client.generate(GenerateRequest(input_ids=POISON, max_tokens=4, temperature=0, timeout_ms=20_000))
    return failed.value, time.monotonic() - started


async def decode_pages_freed(watch: HeartbeatWatch, timeout: float) -> None:
    """Until a decode heartbeat sent after now shows every page free (the lease is 30 s: only a cancel frees them sooner)."""
    now = time.monotonic()
    await watch.wait_for(lambda w: all(w.seen_at[k] > now + 0.1 for k in w.seen_at if k[0] == "decode") and all_kv_free(w), timeout,
                         "the decode rank's pages back")


@pytest.mark.parametrize(("runner_cls", "group_cls", "expected"), [
    (PoisonedRunner, PrefillGroup, "prefill could not prepare the request: RuntimeError: injected: sequence"),
    (ModelRunner, running_batches_on(UnplannableBatches), "prefill could not plan the request: RuntimeError: injected: the page keys cannot be hashed"),
    (FailingForwardRunner, PrefillGroup, "prefill forward failed: RuntimeError: injected: the forward failed"),
], ids=["prepare", "plan", "forward"])
def test_a_request_that_fails_in_prefill_gets_internal_and_the_instance_serves_on(stack, tiny_model, tokenizer, hf_greedy, runner_cls, group_cls, expected):
    clean = tokenizer.encode("The capital of France is")

    async def go():  # type: ignore[no-untyped-def]
        async with session(stack.url) as (client, watch), prefill_instance(stack.url, tiny_model, watch, runner_cls, group_cls) as (group, serving):
            error, elapsed = await poisoned_request(client)
            prefill_free = group.prefix.allocator.num_free
            await decode_pages_freed(watch, 5)
            after = await client.generate(GenerateRequest(input_ids=clean, max_tokens=4, temperature=0, timeout_ms=20_000))
            return error, elapsed, prefill_free, group.settings.kv_pages, after, serving.done()

    error, elapsed, prefill_free, kv_pages, after, stopped = run(go())
    assert error.code == "internal" and error.message.startswith(f"prefill:{INSTANCE}"), error
    assert expected in error.message, error.message
    assert elapsed < 5.0  # not the deadline's 20 s
    assert prefill_free == kv_pages  # the pages its batch took came back (nothing else held any)
    assert after.token_ids == hf_greedy(tuple(clean), 4) and not stopped


def test_a_request_that_cannot_be_prepared_fails_alone_and_the_rest_of_its_batch_runs(stack, tiny_model, tokenizer, hf_greedy):
    clean = tokenizer.encode("The capital of France is")

    async def go():  # type: ignore[no-untyped-def]
        async with session(stack.url) as (client, watch), prefill_instance(stack.url, tiny_model, watch, PoisonedRunner, PairingGroup) as (group, _):
            served = client.generate(GenerateRequest(input_ids=clean, max_tokens=4, temperature=0, timeout_ms=20_000))
            (error, _), response = await asyncio.gather(poisoned_request(client), served)
            await decode_pages_freed(watch, 5)
            return error, response, group.sizes, group.prefix.allocator.num_free, group.settings.kv_pages

    error, response, sizes, prefill_free, kv_pages = run(go())
    assert sizes == [2]  # one batch held both
    assert error.code == "internal" and "prefill could not prepare the request: RuntimeError: injected: sequence" in error.message, error
    assert response.token_ids == hf_greedy(tuple(clean), 4)
    assert prefill_free == kv_pages  # neither prompt has a full page to cache: every page came back


def test_a_batch_that_leaves_the_group_untrusted_fails_its_request_before_the_instance_stops(stack, tiny_model):
    async def go():  # type: ignore[no-untyped-def]
        async with session(stack.url) as (client, watch), prefill_instance(stack.url, tiny_model, watch, group_cls=running_batches_on(BrokenReleaseBatches)) as (_, serving):
            error, elapsed = await poisoned_request(client)
            await decode_pages_freed(watch, 5)
            with pytest.raises(RuntimeError, match="injected: the pages' release failed"):
                await asyncio.wait_for(serving, 5)
            return error, elapsed

    error, elapsed = run(go())
    assert error.code == "internal" and error.message.startswith(f"prefill:{INSTANCE}"), error
    assert "prefill instance failed: RuntimeError: injected: the pages' release failed" in error.message, error.message
    assert elapsed < 5.0


def test_a_task_a_tp_rank_cannot_prepare_fails_alone_on_every_rank(tiny_model, tmp_path):
    leader, peer = run_tp_pair(tp_rank, tiny_model, tmp_path)
    for ran, code, error in (leader["short"][0], peer["short"][0], leader["isolated"][1], peer["isolated"][1]):
        assert ran and code == "internal" and "dtype" in error, (leader, peer)  # every rank prepared it: it ran (its KV is refused: another dtype)
    elsewhere = "prefill could not prepare the request: on another rank of the TP group (its log names the error)"
    assert leader["poisoned"] == ["internal", elsewhere, 32]
    assert peer["poisoned"] == ["internal", "prefill could not prepare the request: RuntimeError: injected: sequence r0-0 cannot be added", 32]
    assert leader["short"][1] == [False, "internal", elsewhere]
    assert peer["short"][1] == [False, "internal", "prefill could not prepare the request: its KV pages are short on this rank (its log says how short)"]
    assert leader["isolated"][0] == [False, "internal", elsewhere]
    assert peer["isolated"][0] == [False, "internal", "prefill could not prepare the request: RuntimeError: injected: sequence r2-0 cannot be added"]
    assert leader["short"][2] == peer["short"][2] == [2, 30]  # the ranks' pages stay alike: the run task's full pages cached, the rest free
    assert leader["isolated"][2] == peer["isolated"][2] == [4, 28]
    for ran, code, error, cached_tokens, *_ in (leader["diverged"], peer["diverged"]):
        assert ran and code == "internal" and "dtype" in error and cached_tokens == 0, (leader, peer)
    assert leader["diverged"][4:] == peer["diverged"][4:] == [6, 26]  # rank 1 cached the prompt's 2 full pages, the leader freed its copies
