"""A submit's answers on `sched.submit` (DESIGN §2): a scheduler that cannot place the request at once
first answers that it queued it (`SubmitAck.queued_by`), then, on the same reply subject, with the
final answer (a placement or a typed refusal). nats-py's request-reply keeps only the first answer,
so they are read from an inbox of the submit's own (`Bus.stream`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import msgspec
from nats.aio.msg import Msg

from schemas import subjects
from schemas.internal import SubmitAck, SubmitJob
from shared.bus import BadReply, Bus, Deadline, pack, unpack


def answers(bus: Bus, submit: SubmitJob, deadline: Deadline, gone: Callable[[], str] | None = None) -> AsyncIterator[Msg]:
    """Send ``submit``; its answers until the final one (`Bus.stream`'s errors: RequestTimeout at ``deadline``,
    Silent once ``gone`` says why the scheduler holding the request is gone)."""
    return bus.stream(subjects.SUBMIT, pack(submit), lambda msg: not unpack(msg.data, SubmitAck).queued_by, deadline, gone=gone)


def read_ack(msg: Msg) -> SubmitAck:
    """One answer; BadReply when it is no SubmitAck (a scheduler of another version, or a bug)."""
    try:
        return unpack(msg.data, SubmitAck)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise BadReply(f"the reply on {msg.subject} is not a valid SubmitAck: {e}") from e


async def final_ack(bus: Bus, submit: SubmitJob, deadline: Deadline) -> SubmitAck:
    """The final answer to ``submit``, however long it waited in a queue (tools and tests: no heartbeat watch)."""
    async for msg in answers(bus, submit, deadline):
        ack = read_ack(msg)
    return ack
