"""The reply subject of one `llm.generate` request, as the gateway writes to it.

Every reply goes out encoded in the content type the request asked for and is counted
(`RequestCounters`: final replies by outcome). A client that asked for keepalives
(`shared.bus.KEEPALIVE_HEADER`) also gets a `Keepalive` whenever the interval passed
without another reply, e.g. while its request waits for capacity, runs its prefill or
decodes a long unary completion: without them such a client could not tell that a
gateway which died after accepting its request will never answer, and would wait out
its whole deadline.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from schemas.api import Keepalive
from services.gateway.stats import RequestCounters
from shared.bus import Bus, encode_public


class Replies:
    """Replies to one request on `subject`, in `ctype`, counted in `counters`."""

    def __init__(self, bus: Bus, subject: str, ctype: str, counters: RequestCounters) -> None:
        self.bus = bus
        self.subject = subject
        self.ctype = ctype
        self.counters = counters
        self.last_sent = time.monotonic()

    async def send(self, obj: Any) -> None:
        self.counters.reply(obj)
        self.last_sent = time.monotonic()
        await self.bus.publish(self.subject, encode_public(obj, self.ctype))

    async def keep_alive(self, interval_s: float, request_id: str) -> None:
        """Until cancelled: a `Keepalive` each time `interval_s` passed since the last reply."""
        while True:
            await asyncio.sleep(max(0.0, self.last_sent + interval_s - time.monotonic()))
            if time.monotonic() - self.last_sent >= interval_s:
                await self.send(Keepalive(request_id=request_id))
