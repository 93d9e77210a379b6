"""One prefill instance: a TP group of ranks running prompts together.

Rank 0 (the leader) is the only rank on NATS: it queues the tasks the scheduler
sends, forms batches (up to `max_batch_tokens` computed and `max_batch_context_tokens`
prompt tokens, and the free KV pages), and
broadcasts each batch to its peers over the process group. Every rank then runs
the batch's forward — TP needs all of them — and sends its own KV heads to the
decode rank layer by layer while later layers compute. The ranks agree on which
transfers succeeded (one all-reduce), and the leader publishes the first tokens
and tells the decode ranks to start. A batch's senders are built while its forward
runs (``LayerReports``), not before it: their set-up is off the requests' path.

Prefix caching (`shared.prefix_cache`, setting ``prefix_caching``): every rank keeps the
full KV pages of its finished prompts, and a prompt whose leading full pages are cached
reuses them and runs only the rest. Each rank holds its own heads of the same pages, so every
rank's forward must reuse the same number of them: the leader plans how many pages each task
reuses when it forms the batch (`Planned.cached_pages`, broadcast with it), and before any page
is taken the ranks agree on what each task reuses: the least of the plan and of what each
rank's own index finds (one all-reduce MIN of an int64 per task). The ranks' indexes can differ:
a rank short of pages takes none for a task its peers allocate, evicting cached pages, and the
task fails on every rank (below), so the peers have lost pages that rank keeps. A task then
reuses the prefix every rank still has and computes the rest; its pages' release caches on each
rank the pages of that prompt its index lacked, so the indexes agree on it again. A task asking for
prompt logprobs reuses nothing (every prompt row's logits are needed) but still leaves its
pages cached. The batch is sized by the tokens it computes (not the cached ones) and by the
pages an allocation can get (free plus evictable, less the cached pages the batch reuses); a
rank that must compute more than the leader planned may be short of pages for a task, which then
fails alone (below). Each rank hashes a prompt's page keys once (`Planned.keys`) for its lookup
and its release. Whether a batch's pages enter the cache depends on whether the forward
succeeded on every rank (one agreed flag).

One bad request fails alone, one bad batch fails its own requests, neither the instance. Each
rank prepares a batch's tasks one by one (its pages, its sequence): a task it cannot prepare
holds nothing but pages it gives back, and on a TP group the ranks agree which tasks every rank
prepared before any of them enters the forward (one all-reduce of a flag per task): every rank
drops the same tasks, whose requests fail with `internal` naming the error, and runs the
others. A KV sender that fails to be built or to finish fails its request's delivery, which
the ranks already agree on. The codes say whose failure it was: a forward that raises, or a
sender that cannot be built, is `internal` (a bug, or prefill and decode layouts that
differ); a KV transfer that fails is `timeout` past the request's deadline, else
`unavailable` (its decode rank is gone or dropped the reservation). What leaves the group
untrusted (a collective or the pages' release failing after the forward) still stops the
instance, loudly, but the leader first fails the batch's requests with `internal`. A queued
task the leader cannot plan (its page keys, its prefix lookup) fails alone.

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
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from nats.aio.msg import Msg

from schemas import subjects
from schemas.api import ErrorCode
from schemas.internal import Cancel, Heartbeat, PrefillTask, StageError, StartDecode, TokenBatch, TransferStats
from services.common import Heartbeater, StepWatch, cancel_applies, prefill_stage, release_reservation
from services.liveness import PeerLiveness, gateway_key
from services.model_rank import prompt_candidates, sampling_params, top_candidates
from shared.bus import Bus, BusError, Deadline, PayloadTooLarge, pack, unpack
from shared.histogram import QUEUE_BOUNDS_S, Buckets
from shared.logging import bind_request, get_logger
from shared.model.runner import ModelRunner, SequenceState, StepOutput
from shared.prefix_cache import PrefixCache
from shared.prefix_keys import page_keys
from shared.settings import PrefillSettings
from shared.transfer import KVSender, LayerReports, LayoutMismatch, TransferError, TransferMetrics, TransferWorker, kv_head_shard

log = get_logger(__name__)

IDLE_TICK_S = 1.0  # the leader broadcasts an empty batch this often so peers never time out
ON_ANOTHER_RANK = "on another rank of the TP group (its log names the error)"


@dataclass
class Queued:
    task: PrefillTask
    gateway_started_at: float  # the gateway's start time when the task arrived (0.0: not heard yet)
    arrived_at: float  # time.monotonic() when the task arrived: its wait until a batch takes it is `queue_time`
    keys: list[bytes] | None = None  # the prompt's page keys, once hashed (a task may head the queue for several plans)


@dataclass(frozen=True)
class Planned:
    """A task of a batch and how many of its leading KV pages it reuses from the prefix cache:
    the leader's plan, then what every rank of the group finds, at most that (`PrefillGroup._agree_reuse`)."""

    task: PrefillTask
    cached_pages: int
    keys: list[bytes] | None = None  # this rank's page keys of the prompt (`PrefillGroup._page_keys`; None: hashed where needed)


@dataclass
class BatchTimes:
    """Where one batch's time went on this rank (milliseconds); the leader logs them with the
    batch's sizes as the ``prefill_batch`` event."""

    plan_ms: float = 0.0  # the leader forming the batch: prefix lookups and fit checks
    pages_ms: float = 0.0  # agreeing on the cached pages reused, holding them, allocating the others, adding the sequences
    senders_ms: float = 0.0  # building the KV senders, on the event loop while the forward runs
    forward_ms: float = 0.0  # the forward with its first-token sampling, in its thread
    transfer_ms: float = 0.0  # forward done and senders built -> every sender finished
    settle_ms: float = 0.0  # agreeing on the outcomes, caching or freeing the pages, summing transfer stats
    report_ms: float = 0.0  # the leader publishing the first tokens and the decode starts


@dataclass
class Outcome:
    task: PrefillTask
    cached_tokens: int
    output: StepOutput | None
    error: str | None  # None: KV delivered by every rank
    generator_state: bytes | None  # the seeded sampler after the first token
    compute_ms: float
    code: ErrorCode | None = None  # the error's code; None: a KV transfer that failed, `timeout` past the deadline, else `unavailable`


@dataclass(frozen=True)
class Failure:
    """Why one request of a batch failed on this rank."""

    message: str
    # None: its KV transfer failed (a peer gone, a lease or a timeout): `_report_one` says `timeout`
    # past the request's deadline, else `unavailable`. A failure of moebus itself says `internal`.
    code: ErrorCode | None = None


@dataclass(frozen=True)
class Prepared:
    """One task of a batch as this rank prepared it (`PrefillGroup._prepare`)."""

    pages: list[int]  # its page table, held by this rank ([]: this rank could not get its pages)
    seq: SequenceState | None  # None: not prepared here, ``error`` says why
    error: str | None = None


class PageBudget:
    """The KV pages a batch allocates against what the prefix cache can give them: free plus
    evictable pages, less the cached pages the batch reuses (its own allocations must not evict
    them). The leader sizes each batch with it and every rank takes the batch's pages by it, so
    a rank whose pages are as the leader's takes every task's pages."""

    def __init__(self, prefix: PrefixCache) -> None:
        self.prefix = prefix
        self.reused: set[int] = set()
        self.new_pages = 0

    def left(self, hits: list[int]) -> int:
        """New pages a further task reusing ``hits`` could still get."""
        return self.prefix.available(self.reused.union(hits)) - self.new_pages

    def take(self, hits: list[int], needed: int) -> None:
        """Count a task reusing ``hits`` and allocating ``needed`` new pages into the batch."""
        self.reused.update(hits)
        self.new_pages += needed


class PrefillGroup:
    def __init__(self, settings: PrefillSettings, runner: ModelRunner, worker: TransferWorker, rank: int, world: int, bus: Bus | None) -> None:
        self.settings = settings
        self.runner = runner
        self.worker = worker
        self.rank = rank
        self.world = world
        self.bus = bus  # the leader's; None on peers
        self.shard = kv_head_shard(rank, world, runner.model.config.num_kv_heads)
        self.prefix = PrefixCache(runner.cache.allocator, runner.cache.layout.page_size, enabled=settings.prefix_caching)
        self.queue: deque[Queued] = deque()
        self.gateways = PeerLiveness(("prefill", settings.instance, rank), settings.heartbeat_interval_s, settings.gateway_expiry_s,
                                     time.monotonic(), roles=("gateway",))
        self.in_flight_tokens = 0
        self.plan_ms = 0.0  # the leader's time forming the last batch (BatchTimes.plan_ms)
        self.arrived = asyncio.Event()
        self.draining = False
        self.name = prefill_stage(settings.instance)
        self.transfer_metrics = TransferMetrics()  # this rank's senders
        self.group_transfers = TransferStats()  # every rank's senders, summed after each batch (the leader's heartbeat)
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
            "transfer": self.group_transfers if self.world > 1 else self.transfer_metrics.stats(),
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
            await self.heartbeater.beat()
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
                    head.keys = self._page_keys(task)
                hits = self._cached_pages(task, head.keys)
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

    def _page_keys(self, task: PrefillTask) -> list[bytes] | None:
        """The prompt's page keys (None with caching off: nothing looks them up)."""
        return page_keys(task.job.input_ids, self.prefix.page_size) if self.prefix.enabled else None

    def _cached_pages(self, task: PrefillTask, keys: list[bytes] | None) -> list[int]:
        """The cached pages this rank's index finds for the task (none for a task asking for
        prompt logprobs: it needs every prompt row's logits)."""
        return [] if task.job.prompt_logprobs >= 0 else self.prefix.match(task.job.input_ids, keys)

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
                outcomes, times = await self._prefill(batch)
            except Exception as e:
                # What _prefill does not turn into failed outcomes leaves this rank's state or the group
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
        return [Planned(task, n, self._page_keys(task)) for task, n in tasks]

    async def _agree_reuse(self, planned: list[Planned]) -> tuple[list[Planned], list[list[int]] | None, str]:
        """The batch with the cached pages every rank reuses per task (`Planned.cached_pages`: the
        least of the leader's plan and of what each rank's index finds), this rank's cached pages
        of each task (at least that many; None: its lookup failed, it prepares nothing, the error
        is the last item). Every rank of a TP group joins the one all-reduce, its lookup failed or not."""
        found: list[list[int]] | None = None
        failure = ON_ANOTHER_RANK
        try:
            found = [self._cached_pages(p.task, p.keys)[: p.cached_pages] for p in planned]
        except Exception as e:  # a bug: this rank prepares none of the batch, every rank fails its tasks (`_prefill`)
            log.exception("prefill_lookup_failed", request_ids=[p.task.job.request_id for p in planned])
            failure = f"{type(e).__name__}: {e}"
        mine = [0] * len(planned) if found is None else [len(f) for f in found]
        reuse = await asyncio.to_thread(self._min, mine) if self.world > 1 else mine
        for p, n, m in zip(planned, reuse, mine, strict=True):
            if n < m:
                log.info("prefill_reuse_agreed", request_id=p.task.job.request_id, planned=p.cached_pages, found=m, reused=n)
        return [replace(p, cached_pages=n) for p, n in zip(planned, reuse, strict=True)], found, failure

    def _take_pages(self, planned: list[Planned], found: list[list[int]]) -> list[list[int] | None]:
        """Every task's page table: its agreed cached pages (the first ``cached_pages`` of what this
        rank ``found``), then new ones; None for a task whose pages this rank cannot get (it fails
        alone, `_prepare`).

        The tasks are admitted in order by the rule the leader sized the batch with (`PageBudget`),
        so a rank whose pages are as the leader's and that reuses what the leader planned admits
        them all; a rank that is short holds nothing for the tasks it does not admit. The admitted
        tasks' cached pages are all held before any allocation, so that one task's allocation
        cannot evict pages a later task reuses, and the allocations cannot fail half way."""
        hits = [f[: p.cached_pages] for p, f in zip(planned, found, strict=True)]
        layout = self.runner.cache.layout
        needs = [layout.pages_for(len(p.task.job.input_ids)) - len(found) for p, found in zip(planned, hits, strict=True)]
        budget = PageBudget(self.prefix)
        admitted: list[bool] = []
        for p, found, n in zip(planned, hits, needs, strict=True):
            left = budget.left(found)
            if n <= left:
                budget.take(found, n)
            else:
                log.warning("prefill_pages_short", request_id=p.task.job.request_id, needed=n, available=left)
            admitted.append(n <= left)
        for p, found, ok in zip(planned, hits, admitted, strict=True):
            if ok and p.task.job.prompt_logprobs < 0:
                self.prefix.acquire(found, len(p.task.job.input_ids))
        return [found + self.prefix.alloc(n) if ok else None for found, n, ok in zip(hits, needs, admitted, strict=True)]

    def _prepare(self, planned: list[Planned], found: list[list[int]]) -> list[Prepared]:
        """Every task's page table and sequence, each task on its own: one whose pages this rank
        cannot get, or whose sequence cannot be added, is not prepared (`Prepared.error`), the
        others are. Raises only what fails the batch as a whole (`_take_pages`: before any page is held)."""
        page_size = self.runner.cache.layout.page_size
        prepared: list[Prepared] = []
        for p, pages in zip(planned, self._take_pages(planned, found), strict=True):
            job = p.task.job
            if pages is None:
                prepared.append(Prepared([], None, "its KV pages are short on this rank (its log says how short)"))
                continue
            try:
                seq = self.runner.add(job.request_id, job.input_ids, sampling_params(job), page_table=pages, num_cached=p.cached_pages * page_size)
            except Exception as e:  # this request cannot run; the rest of the batch can
                log.exception("prefill_prepare_failed", request_id=job.request_id)
                prepared.append(Prepared(pages, None, f"{type(e).__name__}: {e}"))
            else:
                prepared.append(Prepared(pages, seq))
        return prepared

    def _give_back(self, planned: list[Planned], page_tables: list[list[int]], computed: bool) -> None:
        """The batch's pages back to the prefix cache: cached when ``computed`` on every rank, else freed."""
        for p, pages in zip(planned, page_tables, strict=True):
            self.prefix.release(p.task.job.input_ids, pages, p.cached_pages, computed, p.keys)

    async def _prefill(self, planned: list[Planned]) -> tuple[list[Outcome], BatchTimes]:
        """Agree on the cached pages each task reuses (`_agree_reuse`), prepare the batch, fail the
        tasks some rank could not prepare (each alone, with `internal`; every rank drops the same
        ones: one all-reduce of a flag per task) and run the others (`_compute`). A task that one
        rank did not prepare must not enter a forward its peers run: every rank gives its pages
        back, in the same order as its peers."""
        times = BatchTimes()
        taking = time.perf_counter()
        planned, found, failure = await self._agree_reuse(planned)
        prepared: list[Prepared] | None = None
        if found is not None:
            try:
                prepared = self._prepare(planned, found)
            except Exception as e:  # the batch as a whole (a bug): no task runs, no page is held
                log.exception("prefill_prepare_failed", request_ids=[p.task.job.request_id for p in planned])
                failure = f"{type(e).__name__}: {e}"
        if prepared is None:
            prepared = [Prepared([], None, failure) for _ in planned]
        local = [m.seq is not None for m in prepared]
        everywhere = await asyncio.to_thread(self._agree, local) if self.world > 1 else local
        outcomes: dict[int, Outcome] = {}
        kept: list[int] = []
        for i, (p, mine, ok) in enumerate(zip(planned, prepared, everywhere, strict=True)):
            if ok:
                kept.append(i)
                continue
            if mine.pages:
                self._give_back([p], [mine.pages], computed=False)
            outcomes[i] = Outcome(p.task, 0, None, f"prefill could not prepare the request: {mine.error or ON_ANOTHER_RANK}", None, 0.0, code="internal")
        times.pages_ms = (time.perf_counter() - taking) * 1000
        if kept:
            seqs: list[SequenceState] = []
            for i in kept:
                seq = prepared[i].seq
                assert seq is not None  # kept: every rank prepared it, this one included
                seqs.append(seq)
            ran = await self._compute([planned[i] for i in kept], [prepared[i].pages for i in kept], seqs, times)
            outcomes.update(zip(kept, ran, strict=True))
        return [outcomes[i] for i in range(len(planned))], times

    async def _compute(self, planned: list[Planned], page_tables: list[list[int]], seqs: list[SequenceState], times: BatchTimes) -> list[Outcome]:
        """Run the prepared tasks (the same on every rank): the forward, their KV sends, then the
        ranks' agreement and the pages' release. One outcome per task."""
        batch = [p.task for p in planned]
        page_size = self.runner.cache.layout.page_size

        def run_forward() -> Sequence[StepOutput]:
            began = time.perf_counter()
            try:
                return self.runner.prefill(seqs, reports.on_layer_done)
            finally:
                times.forward_ms = (time.perf_counter() - began) * 1000

        # The senders are built while the forward runs (their set-up overlaps its first layers,
        # LayerReports): each gets the layers reported before it existed, then the rest.
        reports = LayerReports(self.runner.cache.device)
        started = time.perf_counter()
        forward = asyncio.ensure_future(asyncio.to_thread(run_forward))
        senders: list[KVSender | None] = []
        failures: list[Failure | None] = []
        try:
            for task, pages in zip(batch, page_tables, strict=True):
                sender, failure = None, None
                if self.shard.sends:
                    try:
                        sender = KVSender(self.worker, self.runner.cache, task.descriptor, pages, self.shard, timeout_s=self.settings.transfer_timeout_s,
                                          metrics=self.transfer_metrics)
                        reports.attach(sender)
                    except LayoutMismatch as e:  # the deployment's prefill and decode KV layouts differ: no stage is gone, retrying will not help
                        failure = Failure(str(e), "internal")
                    except Exception as e:  # this request's KV cannot go; the ranks agree on that below, the batch runs on
                        log.exception("kv_sender_failed", request_id=task.job.request_id)
                        failure = Failure(f"KV sender failed: {type(e).__name__}: {e}", "internal")
                senders.append(sender)
                failures.append(failure)
            times.senders_ms = (time.perf_counter() - started) * 1000
        except BaseException:
            for sender in senders:
                if sender is not None:
                    sender.cancel()
            await asyncio.wait([forward])  # the forward's thread uses the batch's state: let it end first
            raise
        forward_error: str | None = None
        try:
            outputs: Sequence[StepOutput | None] = await forward
        except Exception as e:
            forward_error = f"{type(e).__name__}: {e}"
            log.exception("prefill_failed", request_ids=[t.job.request_id for t in batch])
            outputs = [None] * len(seqs)
            for sender in senders:
                if sender is not None:
                    sender.cancel()
        compute_ms = (time.perf_counter() - started) * 1000
        for i, sender in enumerate(senders):
            if sender is not None:
                try:
                    await sender.finish()
                except TransferError as e:  # a peer gone, a lease or a timeout ended it: `_report_one` picks the code
                    failures[i] = failures[i] or Failure(f"KV transfer failed: {e}")
                except Exception as e:  # this request's KV did not arrive, which the ranks agree on below
                    log.exception("kv_transfer_failed", request_id=batch[i].job.request_id)
                    failures[i] = failures[i] or Failure(f"KV transfer failed: {type(e).__name__}: {e}", "internal")
        settling = time.perf_counter()
        times.transfer_ms = (settling - started) * 1000 - compute_ms
        # A failure from here on (a collective, the pages' release) leaves the group untrusted: `run` stops it.
        flags = [f is None for f in failures] + [forward_error is None]
        # Alone, the flags are already agreed: no thread hop between the forward and the first token.
        *delivered, computed = await asyncio.to_thread(self._agree, flags) if self.world > 1 else flags
        self._give_back(planned, page_tables, computed)
        for seq in seqs:
            seq.page_table = []
        if self.world > 1:
            self.group_transfers = await asyncio.to_thread(self._sum_transfer_stats)
        times.settle_ms = (time.perf_counter() - settling) * 1000
        outcomes: list[Outcome] = []
        for p, seq, out, ok, failure in zip(planned, seqs, outputs, delivered, failures, strict=True):
            if not computed:
                # A forward that raised (here or on a peer) is a bug or an unexpected failure, whatever
                # the deadline says: `internal`, naming the exception (the failing rank's log has it all).
                failure, out = Failure(f"prefill forward failed: {forward_error or ON_ANOTHER_RANK}", "internal"), None
            elif ok:
                failure = None
            else:
                failure = failure or Failure("KV transfer failed on another rank of the TP group")
            generator_state = None if seq.generator is None else seq.generator.get_state().numpy().tobytes()
            outcomes.append(Outcome(p.task, p.cached_pages * page_size, out, None if failure is None else failure.message, generator_state, compute_ms,
                                    code=None if failure is None else failure.code))
        return outcomes

    def _agree(self, ok: list[bool]) -> list[bool]:
        """Flags true on every rank: a task runs only if every rank prepared it; a request is
        delivered only if every rank delivered its heads; a batch's pages are cached only if
        every rank computed them."""
        return [bool(x) for x in self._min([int(x) for x in ok])]

    def _min(self, values: list[int]) -> list[int]:
        """Each value's least over the group (one all-reduce MIN)."""
        if self.world == 1:
            return values
        reduced = torch.tensor(values, dtype=torch.int64, device=self.runner.cache.device)
        dist.all_reduce(reduced, op=dist.ReduceOp.MIN)
        return [int(x) for x in reduced.tolist()]

    def _sum_transfer_stats(self) -> TransferStats:
        """Every rank's KV send totals, summed: only the leader heartbeats, but each rank sends its own heads."""
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, self.transfer_metrics.stats())
        failures: Counter[str] = Counter()
        for stats in gathered:
            failures.update(stats.failures)
        return TransferStats(completed=sum(t.completed for t in gathered), bytes_total=sum(t.bytes_total for t in gathered),
                             seconds_total=sum(t.seconds_total for t in gathered), failures=dict(failures))

    # ------------------------------------------------------------ leader: results

    def _log_batch(self, outcomes: list[Outcome], times: BatchTimes) -> None:
        """One ``prefill_batch`` event per batch: its sizes and where its time went (`BatchTimes`)."""
        prompt_tokens = sum(len(o.task.job.input_ids) for o in outcomes)
        cached_tokens = sum(o.cached_tokens for o in outcomes)
        log.info("prefill_batch", request_ids=[o.task.job.request_id for o in outcomes], requests=len(outcomes), failed=sum(o.error is not None for o in outcomes), prompt_tokens=prompt_tokens,
                 cached_tokens=cached_tokens, computed_tokens=prompt_tokens - cached_tokens,
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
            # same request id's reservation on another rank).
            await release_reservation(self.bus, job.request_id, place.decode_instance, place.decode_rank, "finished at the first token")
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
