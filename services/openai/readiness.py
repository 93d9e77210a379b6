"""Whether the stack behind a frontend can serve a request: what ``GET /health`` answers.

A gateway answering ``llm.models`` is not enough: with no decode rank, prefill instance or
scheduler alive every request fails, and a load balancer must stop sending traffic there (as
vLLM's ``/health`` fails once its engine died). The frontend listens to the heartbeats
(``ctl.heartbeat.>``) and keeps each process's latest one (``LatestHeartbeats``, which the
metrics page reads too); the stack can serve while each role on a request's path has a process heard within
``expiry_s`` that takes new work (a prefill instance: its leader, rank 0, which takes the tasks).
"""

from __future__ import annotations

import time

from nats.aio.msg import Msg

from schemas.internal import Heartbeat
from services.liveness import LatestHeartbeats, takes_new_work
from shared.bus import unpack

REQUIRED_ROLES = ("gateway", "scheduler", "prefill", "decode")


class StackReadiness:
    """The processes heard on the bus, and which roles have none that serves."""

    def __init__(self, expiry_s: float) -> None:
        self.expiry_s = expiry_s
        self.heartbeats = LatestHeartbeats(expiry_s)

    def on_heartbeat(self, hb: Heartbeat, now: float) -> None:
        self.heartbeats.record(hb, now)

    async def on_message(self, msg: Msg) -> None:
        """A heartbeat from the bus (``ctl.heartbeat.>``)."""
        self.on_heartbeat(unpack(msg.data, Heartbeat), time.monotonic())

    def missing(self, now: float) -> list[str]:
        """The roles (of ``REQUIRED_ROLES``) with no process heard within ``expiry_s`` that takes new work."""
        serving = {hb.role for hb in self.heartbeats.live(now) if takes_new_work(hb)}
        return [role for role in REQUIRED_ROLES if role not in serving]
