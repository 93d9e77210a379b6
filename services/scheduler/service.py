"""Scheduler: places each request on a decode rank (KV reserved there) and a prefill instance.

State is only the registry (from heartbeats) plus the requests waiting for capacity,
so a restarted scheduler is placing again one heartbeat interval after it starts. Until it has
listened for `heartbeat_expiry_s`, a role it has heard no member of is not yet absent: a request
waits out that roll call before it is answered `unavailable` for it (at once after it).
A request that cannot be placed at once waits in a queue, as vLLM's do, served first come, first
served, or, under `scheduling_policy` "priority" (vLLM's), by (`Job.priority`, arrival), lower
first; "fcfs" refuses a priority other than 0, as vLLM does. Unlike vLLM's, a request that comes
first in line never preempts a running one: decode ranks reserve a request's KV up front and keep
it to the end. A request that waits is first given an interim answer (`SubmitAck.queued_by`) that
tells the gateway to wait for the final one until the request's deadline while this scheduler's
heartbeats go on. At most `max_queued` requests wait (beyond: `overloaded` at once), each until
its deadline (`timeout`) or, with `queue_wait_ms` set, at most that long (`overloaded`). A
stopping scheduler bounds the wait too: what still waits when its `drain_timeout_s` runs out is
answered `unavailable` before the scheduler closes its connection.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import time
from collections.abc import Awaitable, Callable

import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from schemas import subjects
from schemas.api import ErrorCode
from schemas.internal import Cancel, Heartbeat, Job, KVReservation, Placement, PrefillTask, ReserveKV, SubmitAck, SubmitJob
from services.common import Heartbeater, cancel_applies, release_reservation
from services.liveness import Hearing
from services.scheduler.registry import Member, Registry
from services.scheduler.suspects import SuspectRanks
from shared.bus import BadReply, Bus, BusError, Deadline, PayloadTooLarge, RequestTimeout, pack, unpack
from shared.logging import bind_request, get_logger
from shared.settings import SchedulerSettings
from shared.tasks import cancel_and_wait

log = get_logger(__name__)

# How many of the first waiting requests in line try to place themselves when capacity may have come (a
# heartbeat, a request leaving the queue); the others keep their place in line without trying, so the
# queue is served about in its order (the first few may overtake each other, as their placements run
# at once). Woken all on every heartbeat and every 0.25 s, 4096 waiters behind 8 full
# decode ranks kept the event loop so busy that it took in 18 of 100 heartbeats sent in 5 s (2-core
# box); this way it spends 2% of a core whatever the queue's length.
PLACING_AT_ONCE = 16


class Refused(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _past(reply_by: float) -> bool:
    """Whether the gateway has stopped waiting for the answer to a submit (`SubmitJob.reply_by`)."""
    return bool(reply_by) and time.time() > reply_by


class Scheduler:
    def __init__(self, settings: SchedulerSettings, bus: Bus) -> None:
        self.settings = settings
        self.bus = bus
        self.hearing = Hearing(("scheduler", settings.instance, 0), settings.heartbeat_interval_s, time.monotonic())
        self.registry = Registry(expiry_s=settings.heartbeat_expiry_s, model=settings.model_name, hearing=self.hearing)
        self.placed = 0
        # Requests cancelled while waiting here for capacity, with the cancel's reason (their refusal says it)
        self.cancelled: dict[str, str] = {}
        # The requests in `place`, each with the event that wakes it to try again.
        self.queue: dict[str, asyncio.Event] = {}
        # The same requests in line, as (priority, arrival number, id) kept sorted: under "fcfs" every priority is
        # 0, so a newcomer goes at the end. bisect, not a heap: the head window is a slice, and a request leaving
        # from anywhere (placed, cancelled, timed out) is found in O(log n) and cut out with one memmove.
        self.line: list[tuple[int, int, str]] = []
        self._arrivals = itertools.count()
        self.suspects = SuspectRanks(settings, bus, self.registry)
        self.draining = False
        self.drain_deadline: Deadline | None = None  # set by `stop`: the submits still waiting then are answered `unavailable`
        self._none_waiting = asyncio.Event()  # no submit in `place`: a stop waits for this
        self._none_waiting.set()
        self._submit_sub: Subscription | None = None
        self.heartbeater = Heartbeater(bus, settings, "scheduler", lambda: {"draining": self.draining, "queued_requests": len(self.queue),
                                                                           "suspect_ranks": self.suspects.names()})
        self._expiry: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.bus.subscribe(subjects.HEARTBEAT_ALL, self._on_heartbeat, concurrent=False)
        self._submit_sub = await self.bus.subscribe(subjects.SUBMIT, self._on_submit, queue=subjects.SCHEDULER_QUEUE)
        await self.bus.subscribe(subjects.CTL_CANCEL, self._on_cancel, concurrent=False)
        self.heartbeater.start()
        self._expiry = asyncio.get_running_loop().create_task(self._expire_loop())  # kept: the loop holds tasks weakly

    async def stop(self) -> None:
        """SIGTERM: say `draining` (the HTTP frontend's /health fails at once when no other scheduler
        is left, instead of once the heartbeats expire), leave the schedulers' queue group (the
        submits already routed here are still answered: `Bus.stop_taking`), and wait until every
        submit here is answered: placed, refused as usual, or, still waiting for capacity when
        `drain_timeout_s` runs out, `unavailable`. Those answers go out before the bus drain, whose
        timeout would otherwise cancel a submit waiting past it unanswered.
        Then stop beating."""
        self.draining = True
        self.drain_deadline = Deadline.after(self.settings.drain_timeout_s)
        await self.heartbeater.announce()
        if self._submit_sub is not None:
            await self.bus.stop_taking(self._submit_sub, self.settings.drain_timeout_s)
        for woken in self.queue.values():
            woken.set()  # the submits waiting take the drain's deadline now
        await self._answered()
        await self.heartbeater.stop()
        await self.suspects.stop()
        if self._expiry is not None:
            await cancel_and_wait(self._expiry)

    async def _answered(self) -> None:
        """Until no submit is in `place`. Each ends at the drain's deadline, or soon after when a
        placement was under way then (its reservation requests, each bounded by `reserve_timeout_ms`).
        Bounded all the same, at twice `drain_timeout_s`: the bus drain has what is left."""
        await asyncio.sleep(0)  # the submits `stop_taking` handed on start, each counting as waiting in its first step
        try:
            async with asyncio.timeout(2 * self.settings.drain_timeout_s):
                await self._none_waiting.wait()
        except TimeoutError:
            log.warning("submits_unanswered_at_stop", waiting=len(self.queue), timeout_s=2 * self.settings.drain_timeout_s)

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_expiry_s / 3)
            for key in self.registry.expire():
                log.warning("member_expired", member=key)

    async def _on_heartbeat(self, msg: Msg) -> None:
        hb = unpack(msg.data, Heartbeat)
        self.hearing.heard(hb, time.monotonic())  # our own beat coming back: we are listening
        if hb.role not in ("decode", "prefill"):
            return
        self.registry.update(hb)
        self._wake_head()

    async def _on_cancel(self, msg: Msg) -> None:
        cancel = unpack(msg.data, Cancel)
        if cancel.request_id in self.queue and cancel_applies(cancel, None):
            # The first cancel's reason: a gateway that hears a client's cancel passes it on, then, its request
            # failed by it, cancels again ("request failed at the gateway") before this waiter has woken to refuse.
            self.cancelled.setdefault(cancel.request_id, cancel.reason)
            self.queue[cancel.request_id].set()

    def _wake_head(self) -> None:
        """Capacity may have come: the first waiting requests in line try again (`PLACING_AT_ONCE`)."""
        for _, _, request_id in self.line[:PLACING_AT_ONCE]:
            self.queue[request_id].set()

    def _at_head(self, place_in_line: tuple[int, int, str]) -> bool:
        return bisect.bisect_left(self.line, place_in_line) < PLACING_AT_ONCE

    async def _on_submit(self, msg: Msg) -> None:
        """Every submit gets a SubmitAck: a placement or a typed error (a gateway left without one
        would wait out its submit timeout and then call the scheduler gone), after an interim one
        (`queued_by`) when the request has to wait for capacity."""
        try:
            submit = unpack(msg.data, SubmitJob)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("bad_submit", error=str(e))
            await msg.respond(pack(SubmitAck(request_id="", error_code="invalid_request", error_message=f"malformed SubmitJob: {e}")))
            return
        job = submit.job

        async def queued() -> None:
            await msg.respond(pack(SubmitAck(request_id=job.request_id, queued_by=self.settings.instance)))

        with bind_request(request_id=job.request_id):
            try:
                placement = await self.place(job, submit.reply_by, queued)
                ack = SubmitAck(request_id=job.request_id, placement=placement)
            except Refused as e:
                log.info("refused", code=e.code, reason=str(e))
                ack = SubmitAck(request_id=job.request_id, error_code=e.code, error_message=str(e))
            except Exception as e:  # noqa: BLE001 - a bug or a peer's bad answer: the gateway must hear at once
                log.exception("submit_failed")
                ack = SubmitAck(request_id=job.request_id, error_code="internal", error_message=f"scheduler: {type(e).__name__}: {e}")
            await msg.respond(pack(ack))

    async def place(self, job: Job, reply_by: float = 0.0, queued: Callable[[], Awaitable[None]] | None = None) -> Placement:
        """Reserve KV on a decode rank, hand the task to a prefill instance; wait in line for room.
        `reply_by`: the Unix time at which the gateway stops waiting for the first answer (0: no bound);
        `queued`: sends that first answer, an interim one, when the request has to wait (after it the
        gateway waits until the request's deadline)."""
        deadline = Deadline(job.deadline)
        if deadline.expired:
            raise Refused("timeout", "deadline passed before scheduling")
        if job.priority and self.settings.scheduling_policy == "fcfs":  # vLLM's check
            raise Refused("invalid_request", f"priority {job.priority}: priority scheduling is not enabled "
                                             f"(scheduler.scheduling_policy is 'fcfs'; MOEBUS_SCHEDULER_SCHEDULING_POLICY=priority enables it)")
        self._check_fits_anywhere(job)
        if len(self.queue) >= self.settings.max_queued:
            raise Refused("overloaded", f"{len(self.queue)} requests already waiting for capacity")
        if job.request_id in self.queue:
            raise Refused("invalid_request", f"request_id {job.request_id!r} is already waiting for capacity here")
        queue_wait_s = self.settings.queue_wait_ms / 1000
        wait_until = Deadline(min(job.deadline, time.time() + queue_wait_s)) if queue_wait_s else deadline
        woken = self.queue[job.request_id] = asyncio.Event()
        place_in_line = (job.priority, next(self._arrivals), job.request_id)
        bisect.insort(self.line, place_in_line)
        self._none_waiting.clear()
        try:
            while True:
                woken.clear()  # a wake from now on (during the attempt) makes the next wait return at once
                if job.request_id in self.cancelled:
                    raise Refused("cancelled", f"cancelled while waiting for capacity: {self.cancelled[job.request_id]}")
                if _past(reply_by):
                    # This scheduler was stalled (or the submit slow to come): the gateway has answered
                    # its client, and its cancel may have come before the submit and been ignored.
                    raise Refused("unavailable", "the gateway stopped waiting for this submit")
                if self._at_head(place_in_line):
                    placement = await self._try_place(job)
                    if placement is not None and (job.request_id in self.cancelled or _past(reply_by)):
                        # Cancelled while we reserved, or the gateway's wait ended meanwhile: either way it
                        # has forgotten the request and will not cancel again after our answer.
                        why = f"cancelled while being placed: {self.cancelled.get(job.request_id, 'the gateway stopped waiting')}"
                        await self.bus.publish(subjects.CTL_CANCEL, pack(Cancel(job.request_id, why)))
                        raise Refused("cancelled", why)
                    if placement is not None:
                        self.placed += 1
                        return placement
                # No member of a role yet, heard for too short a time to call it absent (a scheduler just started
                # or back from a deaf spell): wait for the roll call rather than answer `unavailable` for a role
                # whose beats are on their way, as a restarted scheduler did under load. After it, an absent
                # role is answered at once: no capacity is coming to wait for.
                roll_call_s = self._unsure_of_absence()
                if deadline.expired or (not roll_call_s and (wait_until.expired or self._role_missing())):
                    break
                if self.drain_deadline is not None and self.drain_deadline.expired:
                    raise Refused("unavailable", f"scheduler {self.settings.instance} stopped before capacity came for this request "
                                                 f"(its drain_timeout_s of {self.settings.drain_timeout_s:g} s ran out); retry")
                if queued is not None:
                    await queued()
                    queued, reply_by = None, 0.0  # the gateway waits for the final answer until the deadline now
                until = Deadline(min(job.deadline, time.time() + roll_call_s)) if wait_until.expired else wait_until
                if self.drain_deadline is not None:
                    until = Deadline(min(until.at, self.drain_deadline.at))
                # The first in line retries now and then as well (a reservation refused, a member expired); the others
                # only when woken. Were the rest of the head window on a timer too, one firing in the loop pass just
                # before a heartbeat's would try, and take the room, ahead of those the heartbeat wakes in line order.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(until.timeout(cap=0.25 if self.line[0] == place_in_line else None)):
                        await woken.wait()
        finally:
            del self.queue[job.request_id]
            del self.line[bisect.bisect_left(self.line, place_in_line)]
            if not self.queue:
                self._none_waiting.set()
            self.cancelled.pop(job.request_id, None)
            self._wake_head()  # the next in line moves up
        if deadline.expired:
            raise Refused("timeout", "deadline passed while waiting for capacity")
        if not self.registry.of_role("decode"):
            raise Refused("unavailable", "no decode instance is registered")
        if not self.registry.of_role("prefill"):
            raise Refused("unavailable", "no prefill instance is registered")
        raise Refused("overloaded", self._no_capacity(job))

    def _unsure_of_absence(self) -> float:
        """Seconds this scheduler must still listen before a role with no registered member counts as absent
        (one `heartbeat_expiry_s` since it started listening: every live member beats within it); 0.0 when
        every role has a member or it has listened that long."""
        if not self._role_missing():
            return 0.0
        return self.hearing.unsure_for(self.settings.heartbeat_expiry_s, time.monotonic())

    def _role_missing(self) -> bool:
        return not (self.registry.of_role("decode") and self.registry.of_role("prefill"))

    def _no_capacity(self, job: Job) -> str:
        """Why no decode rank took `job` within `queue_wait_ms`, by their last heartbeats: full batches, or too
        little free KV for prompt + max_tokens, which a rank reserves up front (a vLLM user expects the
        request to queue, and looks for the knob: max_tokens, the batch, the KV pages)."""
        decode = self.registry.of_role("decode")
        num_tokens = len(job.input_ids) + job.max_tokens
        full = [m for m in decode if m.hb.batch_size >= m.hb.max_batch]
        short = [m for m in decode if m not in full and m.hb.kv_free_pages < m.pages_for(num_tokens)]
        why = []
        if full:
            why.append(f"{len(full)} of {len(decode)} decode ranks at their max batch ({', '.join(sorted({str(m.hb.max_batch) for m in full}))})")
        if short:
            most = max(m.hb.kv_free_pages * m.hb.page_size for m in short)
            why.append(f"{len(short)} of {len(decode)} without free KV for prompt + max_tokens = {num_tokens} tokens, "
                       f"reserved up front (at most {most} tokens free)")
        if not why:
            why.append("the decode ranks with room refused the reservation or did not answer it")
        return f"no capacity within {self.settings.queue_wait_ms} ms: {'; '.join(why)}"

    def _check_fits_anywhere(self, job: Job) -> None:
        """A request larger than every decode rank's whole KV cache would only wait and fail: say so now."""
        decode = self.registry.of_role("decode")
        num_tokens = len(job.input_ids) + job.max_tokens
        if decode and all(m.pages_for(num_tokens) > m.hb.kv_total_pages for m in decode):
            largest = max(m.hb.kv_total_pages * m.hb.page_size for m in decode)
            raise Refused("invalid_request", f"prompt + max_tokens = {num_tokens} tokens; the largest decode rank holds {largest} tokens of KV")

    async def _try_place(self, job: Job) -> Placement | None:
        prefill = self.registry.prefill_for(job.input_ids, self.settings.prefix_affinity_tokens, job.cache_salt)
        if prefill is None:
            return None
        # The prompt counts in the instance's queue from the moment it is chosen, not once placed:
        # placements of a burst run concurrently (each waits for its reservation), and would all
        # pick the instance that looked least loaded before any of them counted.
        prefill.pending_tokens += len(job.input_ids)
        placed = False
        try:
            num_tokens = len(job.input_ids) + job.max_tokens
            for decode in self.registry.decode_candidates(num_tokens):
                if self.registry.is_suspect(decode):  # missed a reply to a placement running alongside since the list was made
                    continue
                reservation = await self._reserve(decode, job, num_tokens)
                if reservation is None:
                    continue
                placement = Placement(decode_instance=decode.hb.instance, decode_rank=decode.hb.rank, prefill_instance=prefill.hb.instance)
                task = PrefillTask(job=job, placement=placement, descriptor=reservation.descriptor)
                try:
                    await self.bus.publish(subjects.prefill_task(prefill.hb.instance), pack(task))
                except BusError as e:
                    await release_reservation(self.bus, job.request_id, decode.hb.instance, decode.hb.rank, "prefill task not sent")
                    code: ErrorCode = "invalid_request" if isinstance(e, PayloadTooLarge) else "unavailable"
                    raise Refused(code, f"the prefill task could not be sent: {e}") from e
                placed = True
                log.info("placed", decode=f"{decode.hb.instance}/{decode.hb.rank}", prefill=prefill.hb.instance, num_tokens=num_tokens)
                return placement
            return None
        finally:
            if not placed:
                prefill.pending_tokens -= len(job.input_ids)

    async def _reserve(self, decode: Member, job: Job, num_tokens: int) -> KVReservation | None:
        """Ask the rank for pages; on refusal, count it full until its next heartbeat; on silence (or an
        answer we cannot read), skip it until it answers a probe (services/scheduler/suspects.py).

        The pages count as taken from the moment we ask, so that concurrent placements
        spread over the ranks instead of all picking the one that looked emptiest.
        """
        pages = decode.pages_for(num_tokens)
        decode.pending_pages += pages
        decode.pending_batch += 1
        timeout = self.settings.reserve_timeout_ms / 1000
        now = time.time()
        request = ReserveKV(
            request_id=job.request_id,
            gateway=job.gateway,
            prompt_tokens=len(job.input_ids),
            max_tokens=job.max_tokens,
            lease_until=min(job.deadline, now + self.settings.lease_s),
            reply_by=now + timeout,
            deadline=job.deadline,
        )
        subject = subjects.decode_reserve(decode.hb.instance, decode.hb.rank)
        try:
            reply = await self.bus.request(subject, request, KVReservation, timeout=timeout)
        except BusError as e:
            log.warning("reserve_failed", decode=f"{decode.hb.instance}/{decode.hb.rank}", error=str(e))
            self.suspects.missed(decode, e)
            # The rank may have reserved all the same: its answer came late or was lost (`reply_by`
            # stops most such reservations, this the rest), or came in a form we cannot read (another
            # version). Released there only: the request may be placed on another rank meanwhile.
            if isinstance(e, RequestTimeout | BadReply):
                why = "stopped waiting for" if isinstance(e, RequestTimeout) else "could not read"
                await release_reservation(self.bus, job.request_id, decode.hb.instance, decode.hb.rank,
                                          f"the scheduler {why} the rank's reservation reply")
            return None
        if not reply.ok or reply.descriptor is None:
            log.info("reserve_refused", decode=f"{decode.hb.instance}/{decode.hb.rank}", reason=reply.reason)
            decode.pending_pages = decode.hb.kv_free_pages  # looks full until it says otherwise
            decode.refused = True
            return None
        return reply
