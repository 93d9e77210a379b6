"""One prefill instance: a TP group of ranks running prompts together.

Rank 0 (the leader) is the only rank on NATS: it queues the tasks the scheduler
sends, forms batches (up to `max_batch_tokens` computed and `max_batch_context_tokens`
prompt tokens, and the free KV pages), and
broadcasts each batch to its peers over the process group. Every rank then runs the
batch (`services.prefill.batch.BatchRunner`): its forward, and the sends of its own KV heads
to the decode rank while later layers compute. The ranks agree on which transfers succeeded,
and the leader publishes the first tokens and tells the decode ranks to start.

Prefix caching (`shared.prefix_cache`, setting ``prefix_caching``): the leader plans how many
of each task's leading KV pages it reuses, by its own index, when it forms the batch
(`Planned.cached_pages`, broadcast with it), and sizes the batch by the tokens it computes (not
the cached ones) and by the pages an allocation can get (`PageBudget`). What every rank then
reuses is agreed by the ranks (`services.prefill.batch`).

A queued task the leader cannot plan (its page keys, its prefix lookup) fails alone; a task
some rank cannot prepare, or whose forward or KV send fails, fails with its batch's outcome
(`services.prefill.batch`). What leaves the group untrusted (a collective or the pages' release
failing after the forward) still stops the instance, loudly, but the leader first fails the
batch's requests with `internal`.

The leader watches the gateways' heartbeats (`PeerLiveness`, as the decode ranks do):
a queued task whose gateway has been silent for `gateway_expiry_s` of time the leader
was listening, or restarted, is dropped (`prefill_orphaned`) instead of run: nobody is
left to read its tokens, and its decode rank frees the reservation on its own.

Only the leader is on the bus. A step of the group (a batch, or an idle tick's broadcast) that
has run `stall_s` means a rank is hung: the leader withholds its heartbeats (`StepWatch`) until
the step ends, so that gateways and schedulers count the instance gone.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from nats.aio.msg import Msg

from schemas import subjects
from schemas.api import ErrorCode
from schemas.internal import Cancel, Heartbeat, PrefillTask, StageError, StartDecode, TokenBatch
from services.common import Heartbeater, StepWatch, cancel_applies, prefill_stage, release_reservation
from services.liveness import PeerLiveness, gateway_key
from services.model_rank import prompt_candidates, top_candidates
from services.prefill.batch import BatchRunner, BatchTimes, Outcome, PageBudget, Planned
from shared.bus import Bus, BusError, Deadline, PayloadTooLarge, pack, unpack
from shared.histogram import QUEUE_BOUNDS_S, Buckets
from shared.logging import bind_request, get_logger
from shared.model.runner import ModelRunner
from shared.prefix_cache import PrefixCache
from shared.settings import PrefillSettings
from shared.transfer import TransferWorker

log = get_logger(__name__)

IDLE_TICK_S = 1.0  # the leader broadcasts an empty batch this often so peers never time out


@dataclass
class Queued:
    task: PrefillTask
    gateway_started_at: float  # the gateway's start time when the task arrived (0.0: not heard yet)
    arrived_at: float  # time.monotonic() when the task arrived: its wait until a batch takes it is `queue_time`
    keys: list[bytes] | None = None  # the prompt's page keys, once hashed (a task may head the queue for several plans)


class PrefillGroup:
    """One rank of a prefill instance: on the leader, the NATS side (the task queue, forming batches,
    reporting their outcomes); on every rank, the loop that runs each batch with its peers (`run`)."""

    def __init__(self, settings: PrefillSettings, runner: ModelRunner, worker: TransferWorker, rank: int, world: int, bus: Bus | None) -> None:
        self.settings = settings
        self.runner = runner
        self.rank = rank
        self.world = world
        self.bus = bus  # the leader's; None on peers
        self.prefix = PrefixCache(runner.cache.allocator, runner.cache.layout.page_size, enabled=settings.prefix_caching)
        self.batch_runner = BatchRunner(settings, runner, worker, rank, world, self.prefix)  # every rank's part of each batch
        self.queue: deque[Queued] = deque()
        self.gateways = PeerLiveness(("prefill", settings.instance, rank), settings.heartbeat_interval_s, settings.gateway_expiry_s,
                                     time.monotonic(), roles=("gateway",))
        self.in_flight_tokens = 0
        self.plan_ms = 0.0  # the leader's time forming the last batch (BatchTimes.plan_ms)
        self.arrived = asyncio.Event()
        self.draining = False
        self.name = prefill_stage(settings.instance)
        self.queue_time = Buckets(QUEUE_BOUNDS_S)  # the leader's: seconds from a task's arrival to the batch that takes it
        # The leader's step under way (a batch, or an idle tick's broadcast: every rank takes part). Past stall_s a
        # rank is hung: its heartbeats still going out, gateways would wait for its requests until their deadlines
        # and schedulers would queue more here; withheld, the gateways fail them as `unavailable` after
        # `stage_expiry_s` and the schedulers drop the instance until it beats again.
        self.batch_under_way: list[Planned] = []
        self.stall_watch = StepWatch(settings.stall_s, self._log_stall)
        self.heartbeater = Heartbeater(bus, settings, "prefill", self._status, withhold=self.stall_watch.stalled) if bus is not None else None

    # ------------------------------------------------------------ leader: NATS side

    async def start(self) -> None:
        assert self.bus is not None and self.heartbeater is not None
        await self.bus.subscribe(subjects.prefill_task(self.settings.instance), self._on_task, concurrent=False)
        await self.bus.subscribe(subjects.CTL_CANCEL, self._on_cancel, concurrent=False)
        await self.bus.subscribe(subjects.HEARTBEAT_ALL, self._on_heartbeat, concurrent=False)
        self.heartbeater.start()

    def _log_stall(self) -> None:
        log.error("prefill_stalled", request_ids=[p.task.job.request_id for p in self.batch_under_way], queued=len(self.queue),
                  stall_s=self.settings.stall_s)

    def _status(self) -> dict[str, Any]:
        """The leader's heartbeat fields: the whole group's queue and KV sends (every rank's shards)."""
        return {
            "draining": self.draining,
            "queued_tokens": self.in_flight_tokens + sum(len(q.task.job.input_ids) for q in self.queue),
            "queued_requests": len(self.queue),
            "transfer": self.batch_runner.group_transfers if self.world > 1 else self.batch_runner.transfer_metrics.stats(),
            "prefix_cache": self.prefix.stats() if self.prefix.enabled else None,  # None: the scheduler's affinity skips this instance
            "prefill_queue_seconds": self.queue_time.snapshot(),
            "page_size": self.runner.cache.layout.page_size,  # the scheduler's prefix affinity hashes the first page
        }

    async def _on_task(self, msg: Msg) -> None:
        task = unpack(msg.data, PrefillTask)
        now = time.monotonic()
        self.queue.append(Queued(task, self.gateways.placed(gateway_key(task.job.gateway), now), now))
        self.arrived.set()

    async def _on_cancel(self, msg: Msg) -> None:
        cancel = unpack(msg.data, Cancel)
        if not cancel_applies(cancel, self.name):
            return
        for queued in [q for q in self.queue if q.task.job.request_id == cancel.request_id]:
            self.queue.remove(queued)

    async def _on_heartbeat(self, msg: Msg) -> None:
        self.gateways.heard(unpack(msg.data, Heartbeat), time.monotonic())

    def _drop_orphans(self) -> None:
        """Drop the queued tasks of gateways that stopped (module doc)."""
        now = time.monotonic()
        for queued in [q for q in self.queue if self.gateways.stopped(gateway_key(q.task.job.gateway), q.gateway_started_at, now)]:
            self.queue.remove(queued)
            log.info("prefill_orphaned", request_id=queued.task.job.request_id, gateway=queued.task.job.gateway)

    async def drain(self) -> None:
        self.draining = True
        if self.heartbeater is not None:
            await self.heartbeater.announce()
        self.arrived.set()

    async def close(self) -> None:
        if self.heartbeater is not None:
            await self.heartbeater.stop()

    async def _take_batch(self, drain_deadline: Deadline | None) -> list[Planned] | None:
        """The next batch ([] on an idle tick), or None when drained."""
        if not self.queue:
            if self.draining:
                # Tasks placed just before our draining heartbeat may still be on the way.
                await asyncio.sleep(2 * self.settings.heartbeat_interval_s)
                if not self.queue:
                    return None
            self.arrived.clear()
            try:
                async with asyncio.timeout(IDLE_TICK_S):
                    await self.arrived.wait()
            except TimeoutError:
                return []
        self._drop_orphans()
        if drain_deadline is not None and drain_deadline.expired:
            while self.queue:
                await self._fail(self.queue.popleft().task, "unavailable", "prefill instance shut down before the request ran")
            return None
        planning = time.perf_counter()
        batch: list[Planned] = []
        tokens = context = 0  # tokens the batch computes, prompt tokens it attends over
        budget = PageBudget(self.prefix)
        layout = self.runner.cache.layout
        while self.queue:
            head = self.queue[0]
            task = head.task
            try:
                if head.keys is None:
                    head.keys = self.batch_runner.prompt_keys(task)
                hits = self.batch_runner.cached_pages(task, head.keys)
            except Exception as e:  # this task cannot be planned: it fails alone, the batch formed so far runs
                self.queue.popleft()
                log.exception("prefill_plan_failed", request_id=task.job.request_id)
                await self._fail(task, "internal", f"prefill could not plan the request: {type(e).__name__}: {e}")
                continue
            n = len(task.job.input_ids)
            computed, needed = n - len(hits) * layout.page_size, layout.pages_for(n) - len(hits)
            fits = needed <= budget.left(hits)
            over = tokens + computed > self.settings.max_batch_tokens or context + n > self.settings.max_batch_context_tokens
            if batch and (over or not fits):
                break
            self.queue.popleft()
            if Deadline(task.job.deadline).expired:
                await self._fail(task, "timeout", "deadline passed while queued for prefill")
                continue
            if not fits:
                await self._fail(task, "invalid_request", f"prompt of {n} tokens exceeds this prefill instance's KV capacity")
                continue
            batch.append(Planned(task, len(hits), head.keys))
            self.queue_time.observe(time.monotonic() - head.arrived_at)
            tokens += computed
            context += n
            budget.take(hits, needed)
        self.in_flight_tokens = context
        self.plan_ms = (time.perf_counter() - planning) * 1000
        return batch

    # ------------------------------------------------------------ every rank

    async def run(self) -> None:
        """Serve until the leader has drained (peers follow its broadcasts)."""
        drain_deadline: Deadline | None = None
        while True:
            batch: list[Planned] | None = None
            if self.rank == 0:
                if self.draining and drain_deadline is None:
                    drain_deadline = Deadline.after(self.settings.drain_timeout_s)
                batch = await self._take_batch(drain_deadline)
                # Each step, an idle tick's empty broadcast too, waits for every rank: `stall_watch` times it.
                self.batch_under_way = batch or []
                self.stall_watch.begin()
            planned = batch  # the leader's, to fail its requests if the group breaks before there are outcomes
            try:
                if self.world > 1:
                    batch = await asyncio.to_thread(self._broadcast, batch)
                if batch is None:
                    return
                if not batch:
                    self.stall_watch.end()
                    continue
                outcomes, times = await self.batch_runner.prefill(batch)
            except Exception as e:
                # What BatchRunner.prefill does not turn into failed outcomes leaves this rank's state or the group
                # untrusted (a collective or a page release that failed):
                # serving on could run forwards the ranks disagree on, so the instance stops (a TP group's
                # supervisor stops every rank). The batch's requests hear why first, and their decode
                # ranks free the reservations (_fail).
                if self.rank == 0 and planned:
                    log.exception("prefill_group_failed", request_ids=[p.task.job.request_id for p in planned])
                    for p in planned:
                        await self._fail(p.task, "internal", f"prefill instance failed: {type(e).__name__}: {e}")
                raise
            if self.rank == 0:
                reporting = time.perf_counter()
                await self._report(outcomes)
                times.plan_ms, times.report_ms = self.plan_ms, (time.perf_counter() - reporting) * 1000
                self._log_batch(outcomes, times)
                self.stall_watch.end()
            self.in_flight_tokens = 0

    def _broadcast(self, batch: list[Planned] | None) -> list[Planned] | None:
        box: list[object] = [None if batch is None else [(pack(p.task), p.cached_pages) for p in batch]]
        dist.broadcast_object_list(box, src=0)
        payload = box[0]
        if self.rank == 0 or payload is None:
            return batch  # the leader keeps its own plan (keys hashed while planning)
        tasks = [(unpack(b, PrefillTask), n) for b, n in payload]  # type: ignore[union-attr]
        return [Planned(task, n, self.batch_runner.prompt_keys(task)) for task, n in tasks]

    # ------------------------------------------------------------ leader: results

    def _log_batch(self, outcomes: list[Outcome], times: BatchTimes) -> None:
        """One ``prefill_batch`` event per batch: its sizes, how its forward ran (``forward_path``: graph_replay,
        graph_capture or eager, `shared.model.prefill_graphs`) and where its time went (`BatchTimes`)."""
        prompt_tokens = sum(len(o.task.job.input_ids) for o in outcomes)
        cached_tokens = sum(o.cached_tokens for o in outcomes)
        graphs = self.runner.prefill_graphs
        path = graphs.last_path.value if graphs is not None and graphs.last_path is not None else "eager"
        log.info("prefill_batch", request_ids=[o.task.job.request_id for o in outcomes], requests=len(outcomes), failed=sum(o.error is not None for o in outcomes), prompt_tokens=prompt_tokens,
                 cached_tokens=cached_tokens, computed_tokens=prompt_tokens - cached_tokens, forward_path=path,
                 **{name: round(ms, 2) for name, ms in vars(times).items()})

    async def _report(self, outcomes: list[Outcome]) -> None:
        for o in outcomes:
            with bind_request(request_id=o.task.job.request_id):
                try:
                    await self._report_one(o)
                except PayloadTooLarge as e:
                    # E.g. the prompt logprobs of a long prompt: this request fails, the instance serves on
                    # (the error escaped the batch loop and the whole instance exited).
                    await self._fail(o.task, "invalid_request", f"too large for the bus ({e}); ask for fewer prompt_logprobs or a shorter prompt")
                except BusError as e:
                    # NATS away for long (the outbound buffer is full): nothing can go out now, the request's
                    # gateway fails it when it reconnects, the decode rank's lease frees its pages.
                    log.warning("prefill_publish_failed", error=str(e))
                except Exception as e:
                    # Building this request's messages failed: the batch's pages are settled already, so
                    # only this request fails (the error escaped the batch loop and the instance exited).
                    log.exception("prefill_report_failed")
                    await self._fail(o.task, "internal", f"prefill could not report the first token: {type(e).__name__}: {e}")

    async def _report_one(self, o: Outcome) -> None:
        """The request's first token to its gateway, then StartDecode to its decode rank (or its failure)."""
        assert self.bus is not None
        job = o.task.job
        if o.error is not None or o.output is None:
            # Failing after the deadline, typically a KV send cut off by a lease that ends at the
            # deadline, is the deadline passing: `timeout`, as the gateway says at its deadline.
            code: ErrorCode = o.code or ("timeout" if Deadline(job.deadline).expired else "unavailable")
            await self._fail(o.task, code, o.error or "prefill failed")
            return
        out = o.output
        prompt_logprobs, prompt_tops = prompt_candidates(out)
        first = TokenBatch(
            request_id=job.request_id,
            start=0,
            token_ids=[out.token_id],
            logprobs=[out.logprob] if out.logprob is not None else None,
            top_logprobs=top_candidates(out),
            prompt_logprobs=prompt_logprobs,
            prompt_top_logprobs=prompt_tops,
            finish_reason=out.finish_reason,  # type: ignore[arg-type]
            compute_ms=o.compute_ms,
            cached_tokens=o.cached_tokens,
        )
        await self.bus.publish(subjects.tokens(job.gateway, job.request_id), pack(first))
        place = o.task.placement
        if out.finish_reason is not None:
            # Done at the first token: its decode rank only has to free its reservation. Nobody else
            # may act (an untargeted cancel could also end the request at its gateway, or free the
            # same request id's reservation on another rank). Every rank's KV sends finished (the
            # batch agreed on it), yet the last chunks may reach the decode rank after this message.
            await release_reservation(self.bus, job.request_id, place.decode_instance, place.decode_rank, "finished at the first token", kv_sent=True)
            return
        start = StartDecode(job=job, first_token=out.token_id, first_logprob=out.logprob, generator_state=o.generator_state)
        await self.bus.publish(subjects.decode_start(place.decode_instance, place.decode_rank), pack(start))
        log.info("prefilled", prompt_tokens=len(job.input_ids), cached_tokens=o.cached_tokens, compute_ms=round(o.compute_ms, 2))

    async def _fail(self, task: PrefillTask, code: ErrorCode, message: str) -> None:
        assert self.bus is not None
        job = task.job
        log.info("prefill_task_failed", request_id=job.request_id, code=code, reason=message)
        try:
            await self.bus.publish(subjects.tokens(job.gateway, job.request_id), pack(StageError(request_id=job.request_id, code=code, message=message, stage=self.name)))
        except BusError as e:  # NATS away: the gateway fails the request on reconnect
            log.warning("stage_error_lost", request_id=job.request_id, code=code, error=str(e))
        # The decode rank is the one stage holding anything for the request (its reservation); the
        # gateway ends the request on the StageError above, not on a cancel.
        place = task.placement
        await release_reservation(self.bus, job.request_id, place.decode_instance, place.decode_rank, f"prefill: {message}")

