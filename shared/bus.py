"""NATS plumbing every service uses: connection, codecs, request/stream helpers, deadlines.

- `connect()` owns the connection through an AsyncExitStack; leaving it drains
  subscriptions (in-flight handlers finish) before the connection closes.
- Public payloads are JSON unless the message says `Content-Type: application/msgpack`;
  internal payloads are always msgpack (DESIGN §2).
- Handlers run as separate tasks so that one slow request never blocks a subject.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, TypeVar

import msgspec
import nats
from nats.aio.client import Client as NATSClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import ConnectionClosedError, MaxPayloadError, NoRespondersError, OutboundBufferLimitError
from nats.errors import Error as NATSError
from nats.errors import TimeoutError as NATSTimeoutError

from shared.logging import get_logger
from shared.tasks import cancel_and_wait, no_lost_cancel, spawn

T = TypeVar("T")
log = get_logger(__name__)

MSGPACK = "application/msgpack"
JSON = "application/json"
CONTENT_TYPE = "Content-Type"
# A client that sends this header (milliseconds) gets a `Keepalive` reply whenever that long
# passed without another reply, so it can tell a gateway that died from a long request.
KEEPALIVE_HEADER = "Moebus-Keepalive-Ms"
KEEPALIVE_MS_RANGE = (100, 60_000)

Handler = Callable[[Msg], Awaitable[None]]


class BusError(Exception):
    """A request over the bus failed (no responder, timeout)."""


class NoResponders(BusError):
    pass


class RequestTimeout(BusError):
    pass


class Silent(BusError):
    """The responder sent nothing, not even a keepalive, for longer than it promised."""


class Unreachable(BusError):
    """No NATS server accepted the connection within the connect timeout, or a message could not
    go out (connection closed, or the server away until the outbound buffer filled)."""


class Reconnected(BusError):
    """The connection was re-established while replies were due: some may have been lost."""


class BadReply(BusError):
    """A reply came but is not the message the request expects (a peer of another version, or a bug)."""


class PayloadTooLarge(BusError):
    """A message above the NATS server's ``max_payload`` (as the server announced it: 8 MiB as
    `moebus up` and the compose files start it, 1 MiB nats-server's own default): not sent."""


# How often the streams' shared watch asks each waiting stream's `gone` whether its responder is gone.
GONE_CHECK_S = 0.25
# A drain cancels the handlers still running at its timeout and gives their cleanup this long to
# end before the connection closes (a handler that ignores its cancel is logged and left).
HANDLER_CANCEL_S = 2.0


# ---------------------------------------------------------------- deadlines


@dataclass(frozen=True)
class Deadline:
    """An absolute Unix time; comparable across processes on synchronized hosts."""

    at: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.time() + seconds)

    def remaining(self) -> float:
        return self.at - time.time()

    @property
    def expired(self) -> bool:
        return self.remaining() <= 0

    def timeout(self, cap: float | None = None) -> float:
        """Seconds left, at least a millisecond (for APIs that reject 0), at most `cap`."""
        left = max(self.remaining(), 0.001)
        return left if cap is None else min(left, cap)


# ---------------------------------------------------------------- codecs


@lru_cache(maxsize=None)
def _json_decoder(type_: Any) -> msgspec.json.Decoder:
    return msgspec.json.Decoder(type_)


@lru_cache(maxsize=None)
def _msgpack_decoder(type_: Any) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(type_)


_json_encoder = msgspec.json.Encoder()
_msgpack_encoder = msgspec.msgpack.Encoder()


def content_type(msg: Msg) -> str:
    """The public content type a message asked for: msgpack if its header says so, else JSON."""
    headers = msg.headers or {}
    value = headers.get(CONTENT_TYPE, "").split(";")[0].strip().lower()
    return MSGPACK if value == MSGPACK else JSON


def keepalive_interval(msg: Msg) -> float | None:
    """Seconds between keepalives a request asked for (``KEEPALIVE_HEADER``), None if it asked
    for none; ``ValueError`` naming the header when its value is not an integer in range."""
    value = (msg.headers or {}).get(KEEPALIVE_HEADER)
    if value is None:
        return None
    low, high = KEEPALIVE_MS_RANGE
    if not value.strip().isdigit() or not low <= int(value) <= high:
        raise ValueError(f"header {KEEPALIVE_HEADER} must be an integer number of milliseconds in [{low}, {high}], got {value!r}")
    return int(value) / 1000


def encode_public(obj: Any, ctype: str = JSON) -> bytes:
    return _msgpack_encoder.encode(obj) if ctype == MSGPACK else _json_encoder.encode(obj)


def decode_public(data: bytes, type_: type[T] | Any, ctype: str = JSON) -> T:
    """Decode and validate; raises msgspec.DecodeError / msgspec.ValidationError. A payload nested
    deeper than msgspec can follow (a value of a free-form field, e.g. ``chat_template_kwargs``,
    a thousand arrays deep) is a DecodeError too: msgspec raises RecursionError for it."""
    decoder = _msgpack_decoder(type_) if ctype == MSGPACK else _json_decoder(type_)
    try:
        return decoder.decode(data)
    except RecursionError as e:
        raise msgspec.DecodeError(f"nested too deeply ({e})") from None


def pack(obj: Any) -> bytes:
    """Internal payloads: msgpack."""
    return _msgpack_encoder.encode(obj)


def unpack(data: bytes, type_: type[T] | Any) -> T:
    return _msgpack_decoder(type_).decode(data)


# ---------------------------------------------------------------- the bus


@dataclass(eq=False)
class _StreamWait:
    """What wakes a stream waiting for replies (`Bus.stream`): a reply, a reconnect, or its `gone` naming why."""

    gone: Callable[[], str] | None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    gone_why: str = ""
    gone_error: Exception | None = None  # what `gone` raised, raised in the stream


class Bus:
    """A connected NATS client plus the handler tasks it runs. Build with `connect()`."""

    def __init__(self, nc: NATSClient, name: str) -> None:
        self.nc = nc
        self.name = name
        self._tasks: set[asyncio.Task[None]] = set()
        self._subs: list[Subscription] = []
        self._reconnect_callbacks: list[Callable[[], None]] = []
        self.reconnects = 0  # connections re-established since connect()
        self._waiting: set[_StreamWait] = set()  # the streams waiting for replies (`stream`)
        self._gone_watch: asyncio.Task[None] | None = None

    def on_reconnect(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` each time the connection is re-established after a loss.

        NATS delivers at most once: what was published to this process while it was
        disconnected is gone, so work that waits on such messages must not wait on.
        """
        self._reconnect_callbacks.append(callback)

    def _reconnected(self) -> None:
        self.reconnects += 1
        log.warning("nats_reconnected", client=self.name)
        for wait in self._waiting:
            wait.wake.set()
        for callback in self._reconnect_callbacks:
            callback()

    async def _watch_gone(self) -> None:
        """While streams with a `gone` check wait, ask each every GONE_CHECK_S and wake those it names
        gone: one task for all of them, where a timer per stream woke every waiting stream as often
        (a gateway with thousands of requests queued spent a third of a core on that)."""
        while any(w.gone is not None for w in self._waiting):
            await asyncio.sleep(GONE_CHECK_S)
            for wait in list(self._waiting):
                if wait.gone is None or wait.gone_why or wait.gone_error:
                    continue
                try:
                    wait.gone_why = wait.gone()
                except Exception as e:  # noqa: BLE001 - the stream that asked raises it, as when it asked itself
                    wait.gone_error = e
                if wait.gone_why or wait.gone_error:
                    wait.wake.set()

    async def subscribe(self, subject: str, handler: Handler, queue: str = "", concurrent: bool = True) -> Subscription:
        """Run `handler(msg)` for each message. `concurrent`: each message in its own task.

        Exceptions in a handler are logged, never propagated: one bad message must not
        stop a subscription.
        """

        async def run(msg: Msg) -> None:
            try:
                await handler(msg)
            except Exception:
                log.exception("handler_failed", subject=msg.subject)

        async def dispatch(msg: Msg) -> None:
            if concurrent:
                spawn(self._tasks, run(msg)).set_name(msg.subject)  # named: a drain that has to cancel it says which
            else:
                await run(msg)

        sub = await self.nc.subscribe(subject, queue=queue, cb=dispatch)
        self._subs.append(sub)
        return sub

    async def publish(self, subject: str, payload: bytes, headers: dict[str, str] | None = None, reply: str = "") -> None:
        """Raises PayloadTooLarge for a message the server would refuse, Unreachable when it cannot
        go out: the connection is closed, or the server is away for so long that the messages held
        for it while reconnecting fill nats-py's outbound buffer (2 MiB)."""
        try:
            await self.nc.publish(subject, payload, reply=reply, headers=headers)
        except MaxPayloadError as e:
            raise self._too_large(subject, payload) from e
        except (OutboundBufferLimitError, ConnectionClosedError) as e:
            raise Unreachable(f"a message on {subject} could not go out: {type(e).__name__}: {e}") from e

    def _too_large(self, subject: str, payload: bytes) -> PayloadTooLarge:
        return PayloadTooLarge(f"a message of {len(payload)} bytes on {subject} exceeds the NATS server's max_payload of {self.nc.max_payload} bytes")

    async def nats_request(self, subject: str, payload: bytes, timeout: float, headers: dict[str, str] | None = None) -> Msg:
        """nats-py's request-reply (its errors unchanged), without losing a cancel: nats-py waits for
        the reply with asyncio.wait_for, which on Python 3.11 returns a reply that arrives in the same
        turn of the event loop as a cancel and drops the cancel. A cancel requested meanwhile and not
        delivered is raised here (`no_lost_cancel`)."""
        with no_lost_cancel():
            return await self.nc.request(subject, payload, timeout=timeout, headers=headers)

    async def has_listener(self, subject: str, payload: bytes, headers: dict[str, str] | None = None, wait_s: float = 1.0) -> bool:
        """Deliver `payload` on `subject` and tell whether anything subscribes to it.

        The message goes out as a request: when nothing subscribes, the server answers at
        once with "no responders" (False). A subscriber need not answer: a reply, or
        none within `wait_s`, means the message reached one (True). So does any other
        failure (this connection down or reconnecting): unknown is not "gone".
        """
        try:
            await self.nats_request(subject, payload, wait_s, headers)
        except MaxPayloadError as e:
            raise self._too_large(subject, payload) from e
        except NoRespondersError:
            return False
        except nats.errors.Error:  # a timeout (delivered, no answer), or no connection to tell
            pass
        return True

    async def checked_request(self, subject: str, payload: bytes, timeout: float, headers: dict[str, str] | None = None) -> Msg:
        """`nats_request` with typed errors for size / no responder / timeout."""
        try:
            return await self.nats_request(subject, payload, timeout, headers)
        except MaxPayloadError as e:
            raise self._too_large(subject, payload) from e
        except NoRespondersError as e:
            raise NoResponders(f"no responder on {subject}") from e
        except NATSTimeoutError as e:
            raise RequestTimeout(f"no reply on {subject} within {timeout:.3f}s") from e

    async def request(self, subject: str, obj: Any, reply_type: type[T] | Any, timeout: float) -> T:
        """Internal msgpack request-reply with a timeout; typed errors for no responder / timeout / size / bad reply."""
        msg = await self.checked_request(subject, pack(obj), timeout)
        try:
            return unpack(msg.data, reply_type)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise BadReply(f"the reply on {subject} is not a valid {getattr(reply_type, '__name__', reply_type)}: {e}") from e

    async def stream(
        self,
        subject: str,
        payload: bytes,
        is_last: Callable[[Msg], bool],
        deadline: Deadline,
        headers: dict[str, str] | None = None,
        silence_s: float | None = None,
        gone: Callable[[], str] | None = None,
    ) -> AsyncIterator[Msg]:
        """Send one request and yield every reply until `is_last(reply)` or the deadline.

        Raises PayloadTooLarge for a request the server would refuse, NoResponders when
        nobody listens on `subject`, RequestTimeout when the deadline passes before the last reply, Silent when `silence_s` passes without
        any reply (for a responder that promised keepalives) or when `gone` (asked while a reply
        is due, every `GONE_CHECK_S`, by one watch task for all streams) says why the responder is gone, and
        Reconnected when the connection was re-established meanwhile (NATS delivers at most once: replies sent
        while it was down are gone, and waiting on would last until the deadline).
        A waiting stream wakes only for a reply, a reconnect, its `gone`, its silence or its deadline.
        """
        inbox = self.nc.new_inbox()
        # Replies go into a queue of ours, read under asyncio.timeout: nats-py's next_msg waits with
        # asyncio.wait_for, which on Python 3.11 returns a reply that arrives in the same turn of the
        # event loop as a cancel and drops the cancel, so a cancelled reader read on to the stream's end.
        replies: asyncio.Queue[Msg] = asyncio.Queue()
        wait = _StreamWait(gone)

        async def take(msg: Msg) -> None:
            replies.put_nowait(msg)
            wait.wake.set()

        sub = await self.nc.subscribe(inbox, cb=take)
        reconnects = self.reconnects
        self._waiting.add(wait)
        if gone is not None and (self._gone_watch is None or self._gone_watch.done()):
            self._gone_watch = asyncio.get_running_loop().create_task(self._watch_gone())
        try:
            await self.publish(subject, payload, headers, reply=inbox)
            last_reply = time.monotonic()
            while True:
                if self.reconnects != reconnects:
                    raise Reconnected(f"the NATS connection was re-established while replies on {subject} were due; some may have been lost")
                if replies.empty():
                    if wait.gone_error:
                        raise wait.gone_error
                    if wait.gone_why:
                        raise Silent(wait.gone_why)
                    quiet = None if silence_s is None else max(silence_s - (time.monotonic() - last_reply), 0.0)
                    try:
                        async with asyncio.timeout(deadline.timeout(quiet)):
                            await wait.wake.wait()
                    except TimeoutError as e:
                        if deadline.expired:
                            raise RequestTimeout(f"no final reply on {subject} before the deadline") from e
                        if silence_s is not None and time.monotonic() - last_reply >= silence_s:
                            if await self._replies_unread(sub, replies, deadline.timeout(cap=silence_s)):
                                continue  # the silence was our own event loop's stall, not the responder's
                            # Say which side went quiet: with this connection down (the server gone, reconnecting) the
                            # responder may be fine, and whoever reads the error (an HTTP client, an operator) looks there.
                            why = "the responder stopped answering" if self.nc.is_connected else "this process's NATS connection is down (reconnecting)"
                            raise Silent(f"no reply on {subject} for {silence_s:g}s: {why}") from e
                        continue
                    wait.wake.clear()
                    continue
                msg = replies.get_nowait()
                last_reply = time.monotonic()
                if msg.headers and msg.headers.get("Status") == "503":
                    raise NoResponders(f"no responder on {subject}")
                yield msg
                if is_last(msg):
                    return
        finally:
            self._waiting.discard(wait)
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _replies_unread(self, sub: Subscription, replies: asyncio.Queue[Msg], timeout: float) -> bool:
        """Whether replies to `sub` have reached this process and wait to be read. When our own event loop
        stalled (CPU starvation, a long synchronous call) for longer than the silence allowed, it resumes
        with the timeout of `stream`'s wait and the replies waiting in the socket due in the same turn,
        and the timeout runs first: the responder looked silent while its keepalives sat unread. A PING /
        PONG round trip reads everything the server sent before the PONG into the subscription."""
        if not self.nc.is_connected:
            return False
        try:
            with no_lost_cancel():  # nats-py's flush waits with asyncio.wait_for (see `nats_request`)
                await self.nc.flush(timeout)
        except NATSError:
            return False
        return not replies.empty() or sub.pending_msgs > 0

    async def _cancel_handlers(self, running: set[asyncio.Task[None]], timeout: float) -> None:
        """Cancel the handlers that outlived the drain's `timeout` and wait, at most `HANDLER_CANCEL_S`,
        for them to end: their cleanup (a `finally` that answers its requester or releases what it
        holds) runs while the connection is still open, not after it closed. Each is logged."""
        for task in running:
            log.warning("handler_cancelled", client=self.name, subject=task.get_name(), drain_timeout_s=timeout)
            task.cancel()
        _, stuck = await asyncio.wait(running, timeout=HANDLER_CANCEL_S)
        for task in stuck:
            log.error("handler_ignored_cancel", client=self.name, subject=task.get_name(), waited_s=HANDLER_CANCEL_S)

    async def stop_taking(self, sub: Subscription, timeout: float = 10.0) -> None:
        """End ``sub`` without losing what was already routed to it. The server may have sent it
        messages this process has not read yet (its socket, nats-py's buffers): a plain unsubscribe
        drops them, and a request among them (a client's `llm.generate` to a gateway in a queue
        group, a gateway's submit to a scheduler) then waits out its deadline for an answer nobody
        is writing. Draining tells the server to stop, waits for its answer (by then every message
        routed here has arrived) and hands them to the handler (each in its task when concurrent).
        With no answer within ``timeout`` (the connection down: nothing more arrives either) it
        unsubscribes.

        nats-py's drain (2.16, pinned) alone loses messages: it queues its UNSUB for the flusher task
        but writes its PING to the socket at once, so the PING reaches the server first, the PONG comes
        back before the server stopped routing here, the subscription is removed, and what the server
        routed here in between is dropped unread (here, 3-6 of 10 drains of one member of a queue group
        of two under a steady publisher lost 20-30 messages each, tests/services/test_bus_stop_taking.py; in the rolling-restart test, a client's request at a stopping
        gateway or a gateway's submit at a stopping scheduler, which then waited out its timeout).
        So the UNSUB is written first (`_unsubscribe_on_server`); drain's own repeats it, which the
        server ignores."""
        if sub in self._subs:
            self._subs.remove(sub)
        try:
            async with asyncio.timeout(timeout):
                await self._unsubscribe_on_server(sub)
                await sub.drain()
        except Exception:  # noqa: BLE001 - closed, reconnecting, already ended, or no answer in time
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _unsubscribe_on_server(self, sub: Subscription) -> None:
        """Send ``sub``'s UNSUB and wait until nats-py's flusher has written it to the socket (private
        nats-py API, see `stop_taking`): a PING sent after this reaches the server after it."""
        await self.nc._send_unsubscribe(sub._id)
        await self.nc._flush_pending(force_flush=True)

    async def drain(self, timeout: float = 10.0) -> None:
        """Stop taking messages (`stop_taking`), let in-flight handlers finish (up to `timeout`),
        cancel those still running and wait for them (`_cancel_handlers`), flush, close."""
        subs, self._subs = self._subs, []
        await asyncio.gather(*(self.stop_taking(sub, timeout) for sub in subs))
        if self._tasks:
            _, running = await asyncio.wait(set(self._tasks), timeout=timeout)
            if running:
                await self._cancel_handlers(running, timeout)
        if self._gone_watch is not None:  # streams of tasks other than handlers may still wait
            await cancel_and_wait(self._gone_watch)
        if not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await self.nc.drain()


# How long a close waits for nats-py's reconnect loop to take one of its repeated cancels.
RECONNECT_END_S = 5.0


async def _end_reconnecting(nc: NATSClient, name: str) -> None:
    """End nats-py's reconnect loop (private API, nats-py pinned) when its close left it running.
    nats-py 2.16 cancels it once; on Python 3.11 a cancel that meets a connect attempt as it fails
    comes out of `asyncio.wait_for` as the attempt's error, which the loop catches and retries: it
    ran on after the close, and `asyncio.run`'s last cancel can meet the same fate, so the process
    (a gateway stopped while its NATS server was gone) never exited. Cancelled again until it ends:
    each new cancel most likely finds it in its 0.25 s back-off, where nothing swallows it."""
    task = nc._reconnection_task
    if task is None or task.done():
        return
    try:
        async with asyncio.timeout(RECONNECT_END_S):
            while not task.done():
                task.cancel()
                await asyncio.wait([task], timeout=0.05)
    except TimeoutError:
        log.error("nats_reconnect_loop_survived_close", client=name, waited_s=RECONNECT_END_S)


@contextlib.asynccontextmanager
async def connect(url: str, name: str, connect_timeout: float = 5.0, drain_timeout: float = 10.0) -> AsyncIterator[Bus]:
    """Connect to NATS; on exit drain (handlers finish) and close.

    Fails fast (after `connect_timeout`) when no server listens, instead of retrying forever.
    """
    connected = False
    repeats: set[str] = set()
    bus: Bus | None = None

    async def on_error(e: Exception) -> None:
        error = f"{type(e).__name__}: {e}"
        if not connected:  # the first connect retries every 0.25 s: log each distinct error once
            if error in repeats:
                return
            repeats.add(error)
        log.warning("nats_error", error=error)

    async def on_reconnected() -> None:
        if bus is not None:
            bus._reconnected()

    async with contextlib.AsyncExitStack() as stack:
        # Once connected, reconnect forever (a restarted server is waited for); but nats-py
        # applies the same unbounded retry to the *first* connect, which would then hang
        # silently on a wrong URL: bound that one by the connect timeout.
        # A comma-separated list of servers (a cluster's seeds) as the nats CLI and the Go client take it.
        servers = [server.strip() for server in url.split(",")]
        try:
            async with asyncio.timeout(connect_timeout):
                nc = await nats.connect(
                    servers,
                    name=name,
                    error_cb=on_error,
                    reconnected_cb=on_reconnected,
                    connect_timeout=connect_timeout,
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.25,
                )
        except TimeoutError as e:
            raise Unreachable(f"no NATS server answered at {url} within {connect_timeout:g}s") from e
        except NATSError as e:  # raised at once for a URL nats-py cannot use ('', 'nats://', tls:// without a context)
            raise Unreachable(f"cannot connect to {url!r}: {e} (a NATS URL is e.g. nats://127.0.0.1:4222; several: separated by commas)") from None
        connected = True

        async def close() -> None:
            with contextlib.suppress(OSError):  # the server is gone: nothing is left to flush to it
                await nc.close()
            await _end_reconnecting(nc, name)

        stack.push_async_callback(close)
        bus = Bus(nc, name)
        stack.push_async_callback(bus.drain, drain_timeout)
        yield bus
