"""Gateway: the public face (`llm.generate`, `llm.models`, `llm.cancel`; `llm.tokenize` and
`llm.detokenize` in services/gateway/tokenization.py).

Per request: decode + admit (typed errors at once), submit to the scheduler, then
relay the token batches arriving on `tok.<gateway>.<request>` to the client as one
reply or a stream of chunks. The gateway also watches the heartbeats of the processes
serving each request: a scheduler holding it in its queue, or a prefill or decode process
running it, that dies fails its requests with `unavailable` within `stage_expiry_s` (of time
the gateway itself was listening: services/liveness.py), well before their deadlines. When the gateway's own NATS
connection is re-established (a restarted server), token batches published to it
meanwhile are gone (NATS delivers at most once): every request in flight fails with
`unavailable` at once, and its stages are told to drop it, instead of waiting for
tokens that will not come until its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
from nats.aio.msg import Msg

from schemas import subjects
from schemas.api import (
    CancelRequest,
    ErrorCode,
    ErrorInfo,
    ErrorReply,
    GenerateChunk,
    GenerateRequest,
    GenerateResponse,
    ModelCard,
    ModelList,
    Timing,
    Usage,
)
from schemas.internal import Cancel, Heartbeat, Job, Placement, StageError, SubmitJob, TokenBatch, TokenMessage
from services.common import Heartbeater, cancel_applies, decode_stage, prefill_stage
from services.gateway.admission import Admission, Admitted, Rejected, cheap
from services.gateway.completion import Completion, Delta, TokensLost
from services.gateway.replies import Replies
from services.gateway.stats import RequestCounters, TokenTimes
from services.gateway.tokenization import Tokenization
from services.liveness import MemberKey, PeerLiveness
from services.submit import answers, read_ack
from shared.bus import BadReply, Bus, BusError, Deadline, NoResponders, PayloadTooLarge, Silent, content_type, decode_public, encode_public, keepalive_interval, pack, unpack
from shared.logging import bind_request, get_logger
from shared.model.tokenizer import Tokenizer
from shared.settings import GatewaySettings

log = get_logger(__name__)


def _admitted_inline(req: GenerateRequest) -> bool:
    """Whether admission is cheap enough for the event loop (`Gateway._admit`): token ids or a prompt
    within `INLINE_ADMISSION_MAX` (`cheap`)."""
    return cheap(req.input_ids if req.input_ids is not None else req.prompt)


def _from_serving_stage(flight: Flight, error: StageError) -> bool:
    """Whether ``error`` comes from the gateway or a stage serving the request. A decode rank that
    answered its reservation after the scheduler gave up on it (and placed the request elsewhere)
    still holds that reservation, and reports its lease's end on the request's token subject: that
    must not fail the request running on the placed rank."""
    placed = flight.placement
    role = error.stage.partition(":")[0]
    if placed is None or role not in ("decode", "prefill"):
        return True
    return error.stage in (decode_stage(placed.decode_instance, placed.decode_rank), prefill_stage(placed.prefill_instance))


class Failed(Exception):
    """Terminal failure of one request, with the code the client sees."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Flight:
    """A request between admission and its final reply."""

    admitted: Admitted
    inbox: asyncio.Queue[TokenMessage] = field(default_factory=asyncio.Queue)
    aborted: asyncio.Future[StageError] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    unanswered_submit: asyncio.Task[Placement] | None = None  # the scheduler's answer, still due after an abort
    placement: Placement | None = None
    watched: dict[MemberKey, float] = field(default_factory=dict)  # stage -> its started_at when placed

    def abort(self, error: StageError) -> None:
        """End the request from the gateway's side (cancel, shutdown), whatever phase it is in."""
        self.inbox.put_nowait(error)  # read by the token loop
        if not self.aborted.done():
            self.aborted.set_result(error)  # read while the scheduler is still placing the request


class Gateway:
    def __init__(self, settings: GatewaySettings, bus: Bus, admission: Admission, tokenizer: Tokenizer) -> None:
        self.settings = settings
        self.bus = bus
        self.admission = admission
        self.tokenizer = tokenizer
        self.tokenization = Tokenization(bus, admission)
        self.id = settings.instance
        self.flights: dict[str, Flight] = {}
        self.admitting: dict[str, StageError | None] = {}  # request id -> why it ended while admission ran
        self.liveness = PeerLiveness(("gateway", self.id, 0), settings.heartbeat_interval_s, settings.stage_expiry_s, time.monotonic(),
                                     roles=("scheduler", "prefill", "decode"))
        self.counters = RequestCounters(admission.model.max_context)
        self.draining = False
        self.heartbeater = Heartbeater(bus, settings, "gateway", lambda: {"draining": self.draining, "in_flight": len(self.flights),
                                                                         "requests": self.counters.stats()})
        self._generate_sub: Any = None

    async def start(self) -> None:
        self.bus.on_reconnect(self._fail_in_flight_after_reconnect)
        await self.bus.subscribe(subjects.tokens_all(self.id), self._on_tokens, concurrent=False)
        await self.bus.subscribe(subjects.HEARTBEAT_ALL, self._on_heartbeat, concurrent=False)
        await self.bus.subscribe(subjects.CTL_CANCEL, self._on_ctl_cancel, concurrent=False)
        await self.bus.subscribe(subjects.CANCEL, self._on_cancel, queue=subjects.GATEWAY_QUEUE)
        await self.bus.subscribe(subjects.MODELS, self._on_models, queue=subjects.GATEWAY_QUEUE)
        await self.bus.subscribe(subjects.TOKENIZE, self.tokenization.on_tokenize, queue=subjects.GATEWAY_QUEUE)
        await self.bus.subscribe(subjects.DETOKENIZE, self.tokenization.on_detokenize, queue=subjects.GATEWAY_QUEUE)
        self._generate_sub = await self.bus.subscribe(subjects.GENERATE, self._on_generate, queue=subjects.GATEWAY_QUEUE)
        self.heartbeater.start()

    async def drain(self) -> None:
        """SIGTERM: take no new requests, let in-flight ones finish, fail what is left.

        The heartbeats say so at once (`draining`: `moebus status`, `moebus_draining`, and the HTTP
        frontend's /health, which fails once no gateway takes new requests), and a last one after
        the drain carries the final counts, those of the requests that ended since the last beat."""
        self.draining = True
        await self.heartbeater.announce()
        await self.bus.stop_taking(self._generate_sub, self.settings.drain_timeout_s)
        await asyncio.sleep(0)  # the handlers of the requests it still delivered register (`admitting`) in their first step
        deadline = Deadline.after(self.settings.drain_timeout_s)
        while (self.flights or self.admitting) and not deadline.expired:
            await asyncio.sleep(0.05)
        for request_id in self.admitting:
            self.admitting[request_id] = StageError(request_id=request_id, code="unavailable", message="gateway shut down", stage=f"gateway:{self.id}")
        for request_id, flight in list(self.flights.items()):
            flight.abort(StageError(request_id=request_id, code="unavailable", message="gateway shut down", stage=f"gateway:{self.id}"))
        while self.flights or self.admitting:
            await asyncio.sleep(0.01)
        await self.heartbeater.stop()
        await self.heartbeater.announce()

    # ------------------------------------------------------------ bus handlers

    async def _on_models(self, msg: Msg) -> None:
        model = self.admission.model
        card = ModelCard(id=model.name, max_context=model.max_context, max_tokens=self.admission.max_tokens_limit)
        await msg.respond(encode_public(ModelList(models=[card]), content_type(msg)))

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            req = decode_public(msg.data, CancelRequest, content_type(msg))
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.info("bad_cancel", error=str(e))
            return
        await self.bus.publish(subjects.CTL_CANCEL, pack(Cancel(req.request_id, req.reason)))

    async def _on_ctl_cancel(self, msg: Msg) -> None:
        cancel = unpack(msg.data, Cancel)
        if not cancel_applies(cancel, None):
            return  # a stage releasing what it holds; the request goes on elsewhere
        error = StageError(request_id=cancel.request_id, code="cancelled", message=cancel.reason, stage=f"gateway:{self.id}")
        if cancel.request_id in self.admitting:
            self.admitting[cancel.request_id] = error  # answered when its admission returns
        elif (flight := self.flights.get(cancel.request_id)) is not None:
            flight.abort(error)

    async def _on_tokens(self, msg: Msg) -> None:
        request_id = msg.subject.rsplit(".", 1)[-1]
        flight = self.flights.get(request_id)
        if flight is not None:
            flight.inbox.put_nowait(unpack(msg.data, TokenMessage))

    async def _on_heartbeat(self, msg: Msg) -> None:
        self.liveness.heard(unpack(msg.data, Heartbeat), time.monotonic())

    def _fail_in_flight_after_reconnect(self) -> None:
        """Messages to this gateway may have been lost while it was disconnected (module doc)."""
        if self.flights:
            log.warning("in_flight_failed_on_reconnect", requests=len(self.flights))
        for request_id, flight in list(self.flights.items()):
            flight.abort(StageError(request_id=request_id, code="unavailable", stage=f"gateway:{self.id}",
                                    message="the gateway's NATS connection was re-established while the request ran; its tokens may have been lost (retry)"))

    # ------------------------------------------------------------ one request

    async def _on_generate(self, msg: Msg) -> None:
        if not msg.reply:
            return  # published without a reply subject: nobody to answer
        arrival_mono, arrival = time.monotonic(), time.time()
        ctype = content_type(msg)
        replies = Replies(self.bus, msg.reply, ctype, self.counters)
        send = replies.send

        async def send_result(obj: Any) -> None:
            # An answer or chunk over the NATS server's max_payload (e.g. many top / prompt logprobs
            # of a long prompt) fails the request with a typed error, not `internal`.
            try:
                await send(obj)
            except PayloadTooLarge as e:
                raise Failed("invalid_request", f"the reply is too large for the bus ({e}); ask for fewer top_logprobs or "
                                                "prompt_logprobs, or fewer tokens per request, or raise the NATS server's max_payload "
                                                "(MOEBUS_NATS_MAX_PAYLOAD, up to 64 MiB)") from e

        try:
            req = decode_public(msg.data, GenerateRequest, ctype)
        except msgspec.ValidationError as e:
            await self._refuse(send, "invalid_request", str(e), None)
            return
        except msgspec.DecodeError as e:
            await self._refuse(send, "invalid_request", f"malformed {ctype.split('/')[-1]}: {e}", None)
            return
        try:
            try:
                keepalive_s = keepalive_interval(msg)
            except ValueError as e:
                raise Rejected("invalid_request", str(e)) from e
            if len(self.flights) + len(self.admitting) >= self.settings.max_in_flight:
                raise Rejected("overloaded", f"gateway {self.id} has {len(self.flights) + len(self.admitting)} requests in flight")
            admitted, pinger = await self._admit(req, arrival, replies, keepalive_s)
        except Rejected as e:
            await self._refuse(send, e.code, str(e), req.request_id)
            return
        except Exception as e:  # noqa: BLE001 - a bug in admission: the client still gets an answer
            log.exception("admission_failed", request_id=req.request_id)
            await send(ErrorReply(error=ErrorInfo("internal", f"admission failed: {type(e).__name__}: {e}"), request_id=req.request_id))
            return

        request_id = admitted.job.request_id
        flight = Flight(admitted)
        self.flights[request_id] = flight
        with bind_request(request_id=request_id):
            try:
                await self._serve(flight, req.stream, send_result, arrival_mono, replies.tokens)
            except Failed as e:
                log.info("request_failed", code=e.code, reason=str(e))
                await send(ErrorReply(error=ErrorInfo(e.code, str(e)), request_id=request_id))
            except Exception as e:
                log.exception("request_crashed")
                await send(ErrorReply(error=ErrorInfo("internal", f"{type(e).__name__}: {e}"), request_id=request_id))
            finally:
                if pinger is not None:
                    pinger.cancel()
                await self._cancel_late_placement(flight)
                self.flights.pop(request_id, None)  # only now may a new request reuse the id here

    async def _refuse(self, send: Any, code: str, reason: str, request_id: str | None) -> None:
        """Answer a request refused before admission ended, and log it (`rejected`, as an admitted
        request's failure is `request_failed`); `Replies` counts the answer under its code."""
        log.info("rejected", request_id=request_id or None, code=code, reason=reason)
        await send(ErrorReply(error=ErrorInfo(code, reason), request_id=request_id))

    async def _admit(self, req: GenerateRequest, arrival: float, replies: Replies,
                     keepalive_s: float | None) -> tuple[Admitted, asyncio.Task[None] | None]:
        """Admission on a worker thread: tokenizing (and templating) a long prompt takes up to ~0.5 s,
        and meanwhile the gateway keeps relaying every other request's tokens. A short prompt is
        admitted on the loop (`_admitted_inline`): the thread's round trip would cost more than it.

        The request id (a fresh one if the client gave none) is taken (``admitting``) before the
        thread starts, so a cancel or a shutdown arriving during admission is kept and answered once
        admission returns, and a second request with the same id is refused at once.
        The client's keepalives (``keepalive_s``) start then too, and the task sending them is returned
        for the request's end to stop: a client hears nothing else until admission ends, and took the
        gateway for dead after three silent intervals while a prompt near the body limit was
        tokenized (seconds), answering 503 `unavailable` where the gateway was about to say 400.
        """
        request_id = req.request_id or uuid.uuid4().hex
        req = msgspec.structs.replace(req, request_id=request_id)
        if request_id in self.flights or request_id in self.admitting:
            raise Rejected("invalid_request", f"request_id {request_id!r} is already in flight")
        self.admitting[request_id] = None
        pinger = asyncio.create_task(replies.keep_alive(keepalive_s, request_id, lambda: self._client_gone(request_id))) if keepalive_s else None
        try:
            try:
                if _admitted_inline(req):
                    admitted = self.admission.admit(req, self.id, arrival)
                else:
                    admitted = await asyncio.to_thread(self.admission.admit, req, self.id, arrival)
            finally:
                ended = self.admitting.pop(request_id)
            if ended is not None:
                raise Rejected(ended.code, f"{ended.stage}: {ended.message}")
        except BaseException:
            if pinger is not None:
                pinger.cancel()
            raise
        return admitted, pinger

    def _client_gone(self, request_id: str) -> None:
        """Nothing subscribes to the request's reply subject any more (`Replies.keep_alive`): a request
        still in admission is answered so once admission returns (as a cancel), a running one is aborted."""
        log.info("client_gone", request_id=request_id)
        error = StageError(request_id=request_id, code="cancelled", stage=f"gateway:{self.id}",
                           message="the client went away: nothing subscribes to its reply subject any more")
        if request_id in self.admitting:
            self.admitting[request_id] = error
        elif (flight := self.flights.get(request_id)) is not None:
            flight.abort(error)

    async def _serve(self, flight: Flight, stream: bool, send: Any, arrival: float, tokens: TokenTimes) -> None:
        """Place the request, relay its tokens as they arrive (noting when in ``tokens`` for the
        statistics), answer it, and log `completed` with its figures: one line per request to grep."""
        job = flight.admitted.job
        deadline = Deadline(job.deadline)
        try:
            flight.placement = await self._submit(flight, deadline)
            queue_ms = (time.monotonic() - arrival) * 1000
            log.info("placed", decode=f"{flight.placement.decode_instance}/{flight.placement.decode_rank}", prefill=flight.placement.prefill_instance)
            admitted = flight.admitted
            completion = Completion(self.tokenizer.detokenizer(skip_special_tokens=admitted.skip_special_tokens), admitted.stop,
                                    job.max_tokens, self.tokenizer.token_piece, job.input_ids if job.prompt_logprobs >= 0 else None,
                                    job.sampling.min_tokens, admitted.stop_token_ids, admitted.include_stop, admitted.eos_token_ids)
            ttft_ms = None
            chunks = 0
            timing = None  # the final reply's
            while not completion.finished:
                try:
                    delta = completion.add(await self._next_batch(flight, deadline, first=not completion.token_ids))
                except TokensLost as e:
                    raise Failed("unavailable", f"{e} (lost on the way from the decode rank)") from e
                if delta.token_ids:
                    now = time.monotonic()
                    if ttft_ms is None:
                        ttft_ms = (now - arrival) * 1000
                        self.counters.first_token(ttft_ms)
                    self.counters.tokens_arrived(tokens, now)
                if stream and (delta or completion.finished):
                    chunk = self._chunk(job, chunks, delta, completion, arrival, queue_ms, ttft_ms)
                    await send(chunk)
                    timing = chunk.timing
                    chunks += 1
        except Failed:
            await self._cancel_downstream(job.request_id, "request failed at the gateway")
            raise
        if completion.finish_reason == "stop":
            await self._cancel_downstream(job.request_id, "stop string reached")  # decode may still be running
        response = None if stream else GenerateResponse(
            request_id=job.request_id,
            model=self.admission.model.name,
            text=completion.final_text,
            token_ids=completion.token_ids,
            finish_reason=completion.finish_reason,  # type: ignore[arg-type]
            stop_reason=completion.stop_reason,
            usage=Usage(len(job.input_ids), len(completion.token_ids), completion.cached_tokens),
            timing=self._timing(arrival, queue_ms, ttft_ms, completion),
            logprobs=completion.logprobs if job.logprobs else None,
            token_logprobs=completion.token_logprobs if job.logprobs else None,
            prompt_logprobs=completion.prompt_logprobs,
        )
        if response is not None:
            timing = response.timing
        assert timing is not None  # a stream's last chunk has it
        # The final reply's figures (its `usage` and `timing`); logged before a unary reply goes out, so
        # the line is there by the time its client has the answer.
        log.info("completed", finish_reason=completion.finish_reason, prompt_tokens=len(job.input_ids), tokens=len(completion.token_ids),
                 ttft_ms=round(timing.ttft_ms, 3), e2e_ms=round(timing.total_ms, 3))
        if response is not None:
            await send(response)

    def _chunk(self, job: Job, index: int, delta: Delta, completion: Completion, arrival: float, queue_ms: float, ttft_ms: float | None) -> GenerateChunk:
        last = completion.finished
        return GenerateChunk(
            request_id=job.request_id,
            index=index,
            text=delta.text,
            token_ids=delta.token_ids,
            logprobs=delta.logprobs if job.logprobs else None,
            token_logprobs=delta.token_logprobs if job.logprobs else None,
            prompt_logprobs=delta.prompt_logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason if last else None,
            # On every chunk, the tokens so far: what vLLM's stream_options.continuous_usage_stats gives (`moebus openai`).
            usage=Usage(len(job.input_ids), len(completion.token_ids), completion.cached_tokens),
            timing=self._timing(arrival, queue_ms, ttft_ms, completion) if last else None,
        )

    @staticmethod
    def _timing(arrival: float, queue_ms: float, ttft_ms: float | None, completion: Completion) -> Timing:
        total = (time.monotonic() - arrival) * 1000
        return Timing(queue_ms=queue_ms, ttft_ms=ttft_ms if ttft_ms is not None else total, total_ms=total, compute_ms=completion.compute_ms)

    async def _submit(self, flight: Flight, deadline: Deadline) -> Placement:
        """The scheduler's placement; a cancel (or shutdown) while it decides fails the request at once.

        The scheduler may not have seen that cancel (it ignores one that overtakes the request
        on the way there), so its answer is still awaited afterwards: `_cancel_late_placement`.
        """
        asking = asyncio.ensure_future(self._ask_scheduler(flight.admitted.job, deadline))
        await asyncio.wait({asking, flight.aborted}, return_when=asyncio.FIRST_COMPLETED)
        if not asking.done():
            flight.unanswered_submit = asking
            error = flight.aborted.result()
            raise Failed(error.code, f"{error.stage}: {error.message}")
        placement = asking.result()
        now = time.monotonic()
        for key in (("prefill", placement.prefill_instance, 0), ("decode", placement.decode_instance, placement.decode_rank)):
            flight.watched[key] = self.liveness.placed(key, now)
        return placement

    async def _ask_scheduler(self, job: Job, deadline: Deadline) -> Placement:
        """The scheduler's first answer comes within `submit_timeout_s` (silence beyond it: no scheduler
        is left to answer). When it says the request waits in its queue (`SubmitAck.queued_by`), the
        final one follows on the same reply subject (services/submit.py), read until the deadline while
        that scheduler's heartbeats go on: once they stop for `stage_expiry_s`, the request fails
        `unavailable` (checked by the stream's own wait, which wakes every 0.25 s anyway)."""
        first_s = deadline.timeout(cap=self.settings.submit_timeout_s)
        submit = SubmitJob(job=job, reply_by=time.time() + first_s)
        queued_at: list[tuple[MemberKey, float]] = []  # the scheduler holding the request, with its start time then

        def scheduler_gone() -> str:
            stopped = [key for key, started_at in queued_at if self.liveness.stopped(key, started_at, time.monotonic())]
            return f"scheduler {stopped[0][1]}, in whose queue this request waited, stopped responding" if stopped else ""

        try:
            async with contextlib.aclosing(answers(self.bus, submit, deadline, scheduler_gone)) as replies:
                async with asyncio.timeout(first_s):
                    ack = read_ack(await anext(replies))
                if ack.queued_by:
                    key: MemberKey = ("scheduler", ack.queued_by, 0)
                    queued_at.append((key, self.liveness.placed(key, time.monotonic())))
                    ack = read_ack(await anext(replies))
        except NoResponders as e:
            raise Failed("unavailable", "no scheduler is running") from e
        except PayloadTooLarge as e:  # never sent: no scheduler could take it, retrying will not help
            raise Failed("invalid_request", f"the request is too large for the bus ({e}); send a shorter prompt") from e
        except BadReply as e:  # a scheduler of another version, or a bug: waiting will not help
            raise Failed("internal", f"the scheduler's answer could not be read: {e}") from e
        except Silent as e:
            raise Failed("unavailable", str(e)) from e
        except (BusError, TimeoutError) as e:
            if deadline.expired:
                raise Failed("timeout", "deadline passed while waiting for the scheduler") from e
            raise Failed("unavailable", f"the scheduler did not answer: {str(e) or f'nothing within {first_s:.3f}s'}") from e
        if ack.placement is None:
            raise Failed(ack.error_code or "internal", ack.error_message)
        return ack.placement

    async def _cancel_late_placement(self, flight: Flight) -> None:
        """After an abort during placement (the client has its answer): free what the scheduler placed.

        The cancel goes out once the scheduler has answered, so it reaches the decode rank
        after its reservation and the prefill instance after its task, whatever the
        scheduler saw before. Until then the flight holds the request id, so this cancel
        cannot hit a new request that reuses the id on this gateway.
        """
        if flight.unanswered_submit is None:
            return
        with contextlib.suppress(Exception):  # placed, refused or silent: cancel all the same
            await flight.unanswered_submit
        await self._cancel_downstream(flight.admitted.job.request_id, "cancelled while the scheduler placed it")

    async def _next_batch(self, flight: Flight, deadline: Deadline, first: bool) -> TokenBatch:
        """The next token batch; Failed on stage error, cancel, deadline, or a serving stage gone silent."""
        while True:
            try:
                async with asyncio.timeout(deadline.timeout(cap=0.25)):
                    msg = await flight.inbox.get()
            except TimeoutError:
                if deadline.expired:
                    raise Failed("timeout", f"deadline of {flight.admitted.timeout_s:g}s passed") from None
                self._check_stages(flight, first)
                continue
            if isinstance(msg, StageError):
                if not _from_serving_stage(flight, msg):
                    log.info("stage_error_ignored", stage=msg.stage, code=msg.code, reason=msg.message)
                    continue
                raise Failed(msg.code, f"{msg.stage}: {msg.message}")
            return msg

    def _check_stages(self, flight: Flight, first: bool) -> None:
        now = time.monotonic()
        for (role, instance, rank), started_at in flight.watched.items():
            if role == "prefill" and not first:
                continue  # prefill's part is done once a token arrived
            if self.liveness.stopped((role, instance, rank), started_at, now):
                raise Failed("unavailable", f"{role} {instance}/{rank} serving this request stopped responding")

    async def _cancel_downstream(self, request_id: str, reason: str) -> None:
        """Let the scheduler, prefill and decode drop the request and free its KV."""
        await self.bus.publish(subjects.CTL_CANCEL, pack(Cancel(request_id, reason)))
