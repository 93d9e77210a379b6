"""One batch of a prefill instance on one rank of its TP group (`services.prefill.group` forms the
batches and reports their outcomes): every rank runs the same batch, in step with its peers, and
what a rank does that its peers must match is agreed by collectives over the process group.

Every rank runs the batch's forward (TP needs all of them) and sends its own KV heads to the
decode rank layer by layer while later layers compute. The ranks agree on which transfers
succeeded (one all-reduce). A batch's senders are built while its forward runs
(``LayerReports``), not before it: their set-up is off the requests' path.

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
untrusted (a collective or the pages' release failing after the forward) raises out of
`BatchRunner.prefill`, and the instance stops (`PrefillGroup.run`).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from schemas.api import ErrorCode
from schemas.internal import PrefillTask, TransferStats
from services.model_rank import sampling_params
from shared.logging import get_logger
from shared.model.runner import ModelRunner, SequenceState, StepOutput
from shared.prefix_cache import PrefixCache
from shared.prefix_keys import page_keys
from shared.settings import PrefillSettings
from shared.transfer import KVSender, LayerReports, LayoutMismatch, TransferError, TransferMetrics, TransferWorker, kv_head_shard

log = get_logger(__name__)

ON_ANOTHER_RANK = "on another rank of the TP group (its log names the error)"


@dataclass(frozen=True)
class Planned:
    """A task of a batch and how many of its leading KV pages it reuses from the prefix cache:
    the leader's plan, then what every rank of the group finds, at most that (`BatchRunner._agree_reuse`)."""

    task: PrefillTask
    cached_pages: int
    keys: list[bytes] | None = None  # this rank's page keys of the prompt, salted (`BatchRunner.prompt_keys`; None: caching is off)


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
    # None: its KV transfer failed (a peer gone, a lease or a timeout): `PrefillGroup._report_one` says `timeout`
    # past the request's deadline, else `unavailable`. A failure of moebus itself says `internal`.
    code: ErrorCode | None = None


@dataclass(frozen=True)
class Prepared:
    """One task of a batch as this rank prepared it (`BatchRunner._prepare`)."""

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



class BatchRunner:
    """Runs the batches of one rank of a prefill TP group (`prefill`), every rank the same batch
    in step; the leader forms them (`PrefillGroup`) with the same prefix cache."""

    def __init__(self, settings: PrefillSettings, runner: ModelRunner, worker: TransferWorker, rank: int, world: int, prefix: PrefixCache) -> None:
        self.settings = settings
        self.runner = runner
        self.worker = worker
        self.world = world
        self.prefix = prefix
        self.shard = kv_head_shard(rank, world, runner.model.config.num_kv_heads)
        self.transfer_metrics = TransferMetrics()  # this rank's senders
        self.group_transfers = TransferStats()  # every rank's senders, summed after each batch (the leader's heartbeat)

    def prompt_keys(self, task: PrefillTask) -> list[bytes] | None:
        """The prompt's page keys (None with caching off: nothing looks them up)."""
        return page_keys(task.job.input_ids, self.prefix.page_size, task.job.cache_salt) if self.prefix.enabled else None

    def cached_pages(self, task: PrefillTask, keys: list[bytes] | None) -> list[int]:
        """The cached pages this rank's index finds for the task (none for a task asking for
        prompt logprobs: it needs every prompt row's logits)."""
        return [] if task.job.prompt_logprobs >= 0 else self.prefix.match(task.job.input_ids, keys)

    async def _agree_reuse(self, planned: list[Planned]) -> tuple[list[Planned], list[list[int]] | None, str]:
        """The batch with the cached pages every rank reuses per task (`Planned.cached_pages`: the
        least of the leader's plan and of what each rank's index finds), this rank's cached pages
        of each task (at least that many; None: its lookup failed, it prepares nothing, the error
        is the last item). Every rank of a TP group joins the one all-reduce, its lookup failed or not."""
        found: list[list[int]] | None = None
        failure = ON_ANOTHER_RANK
        try:
            found = [self.cached_pages(p.task, p.keys)[: p.cached_pages] for p in planned]
        except Exception as e:  # a bug: this rank prepares none of the batch, every rank fails its tasks (`prefill`)
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

    async def prefill(self, planned: list[Planned]) -> tuple[list[Outcome], BatchTimes]:
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
        # A failure from here on (a collective, the pages' release) leaves the group untrusted: `PrefillGroup.run` stops it.
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

