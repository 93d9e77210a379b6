"""One decode rank: KV reservations, sequence admission, the step loop, token publishing.

Each rank is addressable on its own subjects (`decode.<instance>.<rank>.reserve` and
`.start`) and owns its sequences and KV cache; the model step runs off the event loop
(so NATS, UCX completions and heartbeats keep flowing) in lockstep with the other
ranks of the instance.

While its batch stays the same, the worker thread runs step after step (`_chain`): it hands
each step's tokens to the event loop, which publishes them while the next step computes. Going
back to the loop between steps put two thread wake-ups and the publishing between every two
forwards: time outside the model that every token paid. The chain ends, and the loop rebuilds
the batch, when a sequence finishes, is cancelled or passes its deadline, when the loop sets
`work` (a start, a cancel, a drain, an orphaned request, a token it could not publish), or when
the group goes idle.

A reservation holds the pages the transfer fills (the prompt) plus room for
`max_tokens`, so a running sequence never needs pages mid-flight. It ends in one of:
`StartDecode` (the sequence runs), cancel, or its lease — then every page is freed
and the gateway hears why.

The rank also watches the heartbeats of the gateways it serves (`PeerLiveness`): a
gateway silent for `gateway_expiry_s` of time the rank was listening, or restarted, can
no longer read its requests' tokens, so they are dropped and their pages freed instead
of decoding on to their deadlines (the gateway still gets `unavailable` for each: one that
was only stalled reads it when it resumes). A lockstep step that has run `stall_s` (a rank of
the instance hung) withholds this rank's heartbeats until it ends (`StepWatch`).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from nats.aio.msg import Msg

from schemas import subjects
from schemas.api import ErrorCode
from schemas.internal import Cancel, Heartbeat, Job, KVReservation, ReserveKV, StageError, StartDecode, TokenBatch
from services.common import Heartbeater, StepWatch, cancel_applies, decode_stage
from services.decode.lockstep import GroupState, Lockstep, StepResult
from services.liveness import PeerLiveness, gateway_key
from services.model_rank import sampling_params, top_candidates
from shared.bus import Bus, BusError, Deadline, pack, unpack
from shared.kvcache import OutOfPages
from shared.logging import bind_request, get_logger
from shared.model.runner import ModelRunner, SequenceState
from shared.settings import DecodeSettings
from shared.tasks import spawn
from shared.transfer import KVReceiver, LeaseExpired, ProtocolError, TransferError, TransferTimeout

log = get_logger(__name__)


@dataclass
class Reservation:
    request_id: str
    gateway: str
    extra_pages: list[int]  # completion room beyond the transferred prompt pages
    gateway_started_at: float  # the gateway's start time as last heard at reservation (0.0: unknown)
    lease_is_deadline: bool  # the lease ends at the request's deadline: its end is the request's `timeout`
    lease: asyncio.TimerHandle | None = None
    starting: bool = False  # StartDecode arrived, waiting for the KV to land


@dataclass
class Running:
    job: Job
    seq: SequenceState
    gateway_started_at: float
    cancelled: str | None = None  # reason, when cancelled while a step was in flight
    steps: Counter[str] = field(default_factory=Counter)  # decode steps by forward path (graph_replay, eager, ...)


class DecodeRank:
    def __init__(self, settings: DecodeSettings, bus: Bus, runner: ModelRunner, receiver: KVReceiver, rank: int, world: int) -> None:
        self.settings = settings
        self.bus = bus
        self.runner = runner
        self.receiver = receiver
        self.rank = rank
        self.lockstep = Lockstep(runner, world)
        self.name = decode_stage(settings.instance, rank)
        self.reserved: dict[str, Reservation] = {}
        self.running: dict[str, Running] = {}
        self._drops: set[asyncio.Task[None]] = set()  # reservations being dropped from a lease timer (held until done)
        self.work = asyncio.Event()  # the batch must change: a start, a cancel, a drain (also ends a `_chain`)
        self.draining = False
        self.step_paths: Counter[str] = Counter()  # steps of this rank's sequences by forward path (heartbeat)
        # A lockstep step past stall_s: a rank of the instance is hung (the others wait for it in every step's
        # collectives). Its heartbeats still going out, gateways would wait for this rank's requests until their
        # deadlines and schedulers would place more here; withheld, the gateways fail them as `unavailable`
        # after `stage_expiry_s` and the schedulers drop the rank until it beats again.
        self.stall_watch = StepWatch(settings.stall_s, lambda: log.error("decode_stalled", request_ids=list(self.running),
                                                                   stall_s=settings.stall_s))
        self.heartbeater = Heartbeater(bus, settings, "decode", self._status, rank=rank, withhold=self.stall_watch.stalled)
        self.gateways = PeerLiveness(("decode", settings.instance, rank), settings.heartbeat_interval_s, settings.gateway_expiry_s,
                                     time.monotonic(), roles=("gateway",))

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        inst, rank = self.settings.instance, self.rank
        await self.bus.subscribe(subjects.decode_reserve(inst, rank), self._on_reserve, concurrent=False)
        await self.bus.subscribe(subjects.decode_start(inst, rank), self._on_start)
        await self.bus.subscribe(subjects.CTL_CANCEL, self._on_cancel, concurrent=False)
        await self.bus.subscribe(subjects.HEARTBEAT_ALL, self._on_heartbeat, concurrent=False)
        self.heartbeater.start()

    async def run(self) -> None:
        """The step loop; returns when every rank of the instance has drained."""
        drain_deadline: Deadline | None = None
        idle_polls = 0
        while True:
            if self.draining and drain_deadline is None:
                drain_deadline = Deadline.after(self.settings.drain_timeout_s)
            if drain_deadline is not None and drain_deadline.expired:
                await self._fail_all("unavailable", "decode rank shut down before the request finished")
            want_exit = self.draining and not self.running and not self.reserved
            self.work.clear()  # before the snapshot: a start arriving after it wakes the idle wait
            batch = list(self.running.values())
            self.stall_watch.begin()
            result = await self._steps(batch, want_exit)
            self.stall_watch.end()
            if result.state is GroupState.EXIT:
                return
            if result.state is GroupState.IDLE:
                # Alone, sleep until work arrives. In a group the others may get work we cannot
                # see, so poll, backing off while idle (CPU) and restarting fast after work.
                idle_polls += 1
                idle_s = min(self.settings.idle_poll_ms, 2.0 ** min(idle_polls, 8)) / 1000 if self.lockstep.world > 1 else 0.25
                try:
                    async with asyncio.timeout(idle_s):
                        await self.work.wait()
                except TimeoutError:
                    pass
                continue
            idle_polls = 0
            await self._publish(batch, result, self._tokens(batch, result), final=True)
            await self._expire_deadlines()
            await self._drop_orphans()

    async def _steps(self, batch: list[Running], want_exit: bool) -> StepResult:
        """Steps of ``batch`` in a worker thread (`_chain`) until its last one, which is returned;
        the tokens of those before it are published here while the chain goes on."""
        loop = asyncio.get_running_loop()
        handed: asyncio.Queue[tuple[StepResult, list[TokenBatch]] | None] = asyncio.Queue()

        def hand_off(item: tuple[StepResult, list[TokenBatch]] | None) -> None:
            loop.call_soon_threadsafe(handed.put_nowait, item)

        chain = asyncio.ensure_future(asyncio.to_thread(self._chain, batch, want_exit, hand_off))
        while (item := await handed.get()) is not None:  # in step order; None: the chain ended
            await self._publish(batch, *item, final=False)
            if any(self._orphaned()):
                self.work.set()  # dropped once the chain ends
        return await chain

    def _chain(self, batch: list[Running], want_exit: bool, hand_off: Callable[[tuple[StepResult, list[TokenBatch]] | None], None]) -> StepResult:
        """Lockstep steps of ``batch`` (in a worker thread) while it may stay the same; each step's
        result but the last goes to ``hand_off`` with its tokens, built here (a token's position is
        that of its step); the last is returned, then ``hand_off(None)``. In a group every rank
        still takes part in every step: a rank's steps are in the same order whether its loop or
        its chain runs them."""
        seqs = [r.seq for r in batch]
        try:
            while True:
                result = self.lockstep.step(seqs, want_exit)
                if result.state is not GroupState.STEPPED or not self._batch_stays(batch, result):
                    return result
                hand_off((result, self._tokens(batch, result)))
                self.stall_watch.begin()  # each step of a chain is watched on its own
        finally:
            hand_off(None)

    def _batch_stays(self, batch: list[Running], result: StepResult) -> bool:
        """Whether the next step may run ``batch`` as it is, without the loop (`_chain`)."""
        if self.work.is_set() or self.draining or any(out.finish_reason is not None for out in result.outputs):
            return False
        now = time.time()
        return all(r.cancelled is None and r.job.deadline >= now for r in batch)

    async def drain(self) -> None:
        """Stop taking reservations; `run` finishes the running sequences and returns."""
        self.draining = True
        await self.heartbeater.announce()
        self.work.set()

    async def close(self) -> None:
        await asyncio.gather(*self._drops, return_exceptions=True)  # a lease end still being told to its gateway goes out before the bus closes
        await self.heartbeater.stop()
        await self.receiver.close()

    def _status(self) -> dict[str, Any]:
        """This rank's heartbeat fields: its KV pages and batch, its decode steps, its KV transfers."""
        layout = self.runner.cache.layout
        return {
            "draining": self.draining,
            "kv_total_pages": self.runner.usable_pages,
            "kv_free_pages": self.runner.cache.allocator.num_free,
            "page_size": layout.page_size,
            "batch_size": len(self.running) + len(self.reserved),
            "max_batch": self.settings.max_batch,
            "decode_steps": dict(self.step_paths),
            "transfer": self.receiver.metrics.stats(),
        }

    # ------------------------------------------------------------ reservations

    async def _on_reserve(self, msg: Msg) -> None:
        req = unpack(msg.data, ReserveKV)
        with bind_request(request_id=req.request_id):
            reply = self._reserve(req)
            log.debug("reserve", ok=reply.ok, reason=reply.reason)
        await msg.respond(pack(reply))

    def _reserve(self, req: ReserveKV) -> KVReservation:
        def refuse(reason: str) -> KVReservation:
            return KVReservation(request_id=req.request_id, ok=False, reason=reason)

        if req.reply_by and time.time() > req.reply_by:
            # The scheduler has stopped waiting (placed the request elsewhere or refused it):
            # pages reserved now would be held for nobody until the lease ends.
            return refuse("the scheduler stopped waiting for this answer")
        if self.draining:
            return refuse("draining")
        if len(self.running) + len(self.reserved) >= self.settings.max_batch:
            return refuse(f"batch full ({self.settings.max_batch})")
        if req.request_id in self.reserved or req.request_id in self.running:
            return refuse("request already holds a reservation here")
        lease_s = req.lease_until - time.time()
        if lease_s <= 0:
            return refuse("lease already expired")
        layout = self.runner.cache.layout
        allocator = self.runner.cache.allocator
        total = layout.pages_for(req.prompt_tokens + req.max_tokens)
        if total > allocator.num_free:
            return refuse(f"out of KV pages: {total} needed, {allocator.num_free} free")
        try:
            descriptor = self.receiver.reserve(req.request_id, req.prompt_tokens, lease_s)
        except (OutOfPages, ValueError) as e:
            return refuse(str(e))
        extra = allocator.alloc(total - len(descriptor.page_ids))
        res = Reservation(req.request_id, req.gateway, extra, self.gateways.placed(gateway_key(req.gateway), time.monotonic()),
                          lease_is_deadline=0 < req.deadline <= req.lease_until)
        res.lease = asyncio.get_running_loop().call_later(lease_s, self._lease_ended, res)
        self.reserved[req.request_id] = res
        return KVReservation(request_id=req.request_id, ok=True, descriptor=descriptor)

    def _lease_ended(self, res: Reservation) -> None:
        if self.reserved.get(res.request_id) is res and not res.starting:
            code, message = ("timeout", "deadline passed before prefill delivered the KV") if res.lease_is_deadline else \
                ("unavailable", "KV reservation lease ended before prefill delivered")
            spawn(self._drops, self._drop_reservation(res, code, message))

    async def _drop_reservation(self, res: Reservation, code: ErrorCode | None, message: str, *, once_landed: bool = False) -> None:
        """Free everything a reservation holds; tell the gateway unless it asked for this.
        ``once_landed``: the KV pages once the KV already sent has landed (`KVReceiver.cancel`)."""
        if self.reserved.pop(res.request_id, None) is None:
            return
        if res.lease is not None:
            res.lease.cancel()
        self.receiver.cancel(res.request_id, once_landed=once_landed)
        self.runner.cache.allocator.free(res.extra_pages)
        log.info("reservation_dropped", request_id=res.request_id, reason=message)
        if code is not None:
            await self._send_error(res.gateway, res.request_id, code, message)

    # ------------------------------------------------------------ start / cancel

    async def _on_start(self, msg: Msg) -> None:
        start = unpack(msg.data, StartDecode)
        job = start.job
        with bind_request(request_id=job.request_id):
            res = self.reserved.get(job.request_id)
            if (res is not None and res.starting) or (res is None and job.request_id in self.running):
                # A second StartDecode for the request: the first one claims the pages (and, should it
                # fail, frees them) and runs it; failing or starting it again here would free them twice.
                log.warning("decode_start_duplicate")
                return
            if res is None:
                await self._send_error(job.gateway, job.request_id, "unavailable", "no KV reservation for this request (its lease ended or it was cancelled)")
                return
            res.starting = True  # from now on this handler, not the lease, ends the reservation
            pages: list[int] = []  # the prompt's pages once claimed from the receiver: then ours to free
            try:
                pages = await self.receiver.wait_complete(job.request_id, Deadline(job.deadline).timeout())
                self._begin(res, start, pages)
            except TransferError as e:
                # The wait ends at the deadline (TransferTimeout), as may the lease: a deadline that passes is `timeout`.
                # A cancel or lease end while we waited cancels the receiver too, so wait_complete raised.
                # A chunk that does not fit the reservation (ProtocolError) is a prefill/decode mismatch or a bug,
                # which a retry meets again: `internal`, not `unavailable`.
                timed_out = isinstance(e, TransferTimeout) or (isinstance(e, LeaseExpired) and res.lease_is_deadline)
                code = "timeout" if timed_out else "internal" if isinstance(e, ProtocolError) else "unavailable"
                await self._drop_reservation(res, code, f"KV transfer failed: {type(e).__name__}: {e}")
            except Exception as e:  # noqa: BLE001 - whatever failed, the pages must come back and the gateway must hear
                # e.g. a sampler state from a prefill on another device type (its size differs), or a
                # receiver that no longer knows the reservation (UnknownTransfer).
                log.exception("decode_start_failed")
                self.runner.cache.allocator.free(pages)
                await self._drop_reservation(res, "internal", f"decode could not start the sequence: {type(e).__name__}: {e}")

    def _begin(self, res: Reservation, start: StartDecode, pages: list[int]) -> None:
        """Run the request whose prompt KV landed in `pages`; if this raises, the reservation is untouched."""
        job = start.job
        prompt = job.input_ids
        seq = self.runner.add(job.request_id, prompt, sampling_params(job), page_table=pages + res.extra_pages,
                              num_cached=len(prompt), output_ids=[start.first_token])
        if seq.generator is not None and start.generator_state is not None:
            seq.generator.set_state(torch.frombuffer(bytearray(start.generator_state), dtype=torch.uint8))
        del self.reserved[job.request_id]
        if res.lease is not None:
            res.lease.cancel()
        self.running[job.request_id] = Running(job, seq, res.gateway_started_at)
        log.info("decode_started", prompt_tokens=len(prompt))
        self.work.set()

    async def _on_cancel(self, msg: Msg) -> None:
        cancel = unpack(msg.data, Cancel)
        if not cancel_applies(cancel, self.name):
            return
        if (res := self.reserved.get(cancel.request_id)) is not None:
            await self._drop_reservation(res, None, cancel.reason, once_landed=cancel.kv_sent)
        elif (entry := self.running.get(cancel.request_id)) is not None:
            entry.cancelled = cancel.reason  # freed after the step in flight, in _publish
            self.work.set()  # ends a chain of steps (`_chain`)

    # ------------------------------------------------------------ after a step

    @staticmethod
    def _tokens(batch: list[Running], result: StepResult) -> list[TokenBatch]:
        """Each sequence's token of the step just run (its position: the sequence's output so far)."""
        return [
            TokenBatch(
                request_id=entry.job.request_id,
                start=len(entry.seq.output_ids) - 1,
                token_ids=[out.token_id],
                logprobs=[out.logprob] if out.logprob is not None else None,
                top_logprobs=top_candidates(out),
                finish_reason=out.finish_reason,  # type: ignore[arg-type]
                compute_ms=result.compute_ms,
            )
            for entry, out in zip(batch, result.outputs, strict=True)
        ]

    async def _publish(self, batch: list[Running], result: StepResult, tokens: list[TokenBatch], final: bool) -> None:
        """Send a step's tokens. ``final``: the chain's last step, the batch is the loop's again:
        finished, cancelled and unpublishable sequences are freed. Before that their sequences may
        still be in a step: a cancelled one gets no more tokens, one whose token cannot go out is
        cancelled, and both are freed after the chain (`work`)."""
        if batch:
            self.step_paths[result.path] += 1
        for entry, token in zip(batch, tokens, strict=True):
            rid = entry.job.request_id
            entry.steps[result.path] += 1
            if entry.cancelled is not None:
                if final:
                    self._finish(entry)
                    log.info("decode_cancelled", request_id=rid, reason=entry.cancelled)
                continue
            try:
                await self.bus.publish(subjects.tokens(entry.job.gateway, rid), pack(token))
            except BusError as e:
                # NATS has been away for long (its outbound buffer is full): this token is lost, so the
                # request cannot complete (its gateway fails what was in flight when it reconnects).
                # Free it rather than decode on for nobody, and keep the rank serving.
                log.warning("decode_publish_failed", request_id=rid, error=str(e))
                if final:
                    self._finish(entry)
                else:
                    entry.cancelled = f"its token could not be published: {e}"
                    self.work.set()
                continue
            if token.finish_reason is not None:
                self._finish(entry)
                log.info("decode_finished", request_id=rid, finish_reason=token.finish_reason, tokens=len(entry.seq.output_ids),
                         steps=dict(entry.steps))

    def _finish(self, entry: Running) -> None:
        self.running.pop(entry.job.request_id, None)
        self.runner.release(entry.seq)

    async def _expire_deadlines(self) -> None:
        """Requests past their deadline stop here even if no gateway is left to cancel them."""
        now = time.time()
        for entry in [e for e in self.running.values() if e.job.deadline < now]:
            self._finish(entry)
            await self._send_error(entry.job.gateway, entry.job.request_id, "timeout", "deadline passed during decode")

    async def _on_heartbeat(self, msg: Msg) -> None:
        self.gateways.heard(unpack(msg.data, Heartbeat), time.monotonic())

    async def _drop_orphans(self) -> None:
        """Free the requests (running or reserved) of gateways that stopped: nobody reads their tokens.

        The gateway is told all the same: one that was only stalled (not dead) reads the error once
        it resumes and fails the request at once, instead of waiting for tokens until its deadline;
        a dead one's subject has no subscriber, and NATS drops the message."""
        reason = f"the decode rank dropped the request: its gateway restarted or was silent for {self.settings.gateway_expiry_s:g}s"
        running, reserved = self._orphaned()
        for entry in running:
            self._finish(entry)
            log.info("decode_orphaned", request_id=entry.job.request_id, gateway=entry.job.gateway, tokens=len(entry.seq.output_ids))
            await self._send_error(entry.job.gateway, entry.job.request_id, "unavailable", reason)
        for res in reserved:
            await self._drop_reservation(res, "unavailable", reason)

    def _orphaned(self) -> tuple[list[Running], list[Reservation]]:
        """The running requests and the reservations whose gateway stopped (`_drop_orphans`)."""
        now = time.monotonic()

        def stopped(gateway: str, started_at: float) -> bool:
            return self.gateways.stopped(gateway_key(gateway), started_at, now)

        return [e for e in self.running.values() if stopped(e.job.gateway, e.gateway_started_at)], \
            [r for r in self.reserved.values() if stopped(r.gateway, r.gateway_started_at)]

    async def _fail_all(self, code: ErrorCode, message: str) -> None:
        for entry in list(self.running.values()):
            self._finish(entry)
            await self._send_error(entry.job.gateway, entry.job.request_id, code, message)
        for res in list(self.reserved.values()):
            await self._drop_reservation(res, code, message)

    async def _send_error(self, gateway: str, request_id: str, code: ErrorCode, message: str) -> None:
        error = StageError(request_id=request_id, code=code, message=message, stage=self.name)
        try:
            await self.bus.publish(subjects.tokens(gateway, request_id), pack(error))
        except BusError as e:  # the request is already freed; its gateway fails it on reconnect or at its deadline
            log.warning("stage_error_lost", request_id=request_id, code=code, error=str(e))

