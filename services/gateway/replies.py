"""The reply subject of one `llm.generate` request, as the gateway writes to it.

Every reply goes out encoded in the content type the request asked for and is counted
(`RequestCounters`: final replies by outcome, a completed one with its request's
`TokenTimes`, which the gateway fills in as the tokens arrive). A client that asked for keepalives
(`shared.bus.KEEPALIVE_HEADER`) also gets a `Keepalive` once per interval, e.g. while
its request waits for capacity, runs its prefill or decodes a long unary completion:
without them such a client could not tell that a gateway which died after accepting
its request will never answer, and would wait out its whole deadline.

The keepalives also tell the gateway whether the client is still there. Each goes out
as a NATS request, so when nothing subscribes to the reply subject any more (the
client's process died, its connection dropped, or it stopped reading and unsubscribed)
the server answers "no responders" at once; the gateway then cancels the request
instead of decoding, for nobody, until `max_tokens` or the deadline. A client that
asked for no keepalives gets no such probe (a plain NATS request takes the first
message on its inbox as the answer), and its request runs to its end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from schemas.api import Keepalive
from services.gateway.stats import RequestCounters, TokenTimes
from shared.bus import Bus, encode_public

MAX_PROBE_WAIT_S = 1.0  # a "no responders" answer takes one round trip to the NATS server


class Replies:
    """Replies to one request on `subject`, in `ctype`, counted in `counters` with the request's `tokens`."""

    def __init__(self, bus: Bus, subject: str, ctype: str, counters: RequestCounters) -> None:
        self.bus = bus
        self.subject = subject
        self.ctype = ctype
        self.counters = counters
        self.tokens = TokenTimes()

    async def send(self, obj: Any) -> None:
        """Publish ``obj``; counted once sent (``PayloadTooLarge``: over the server's max_payload, not sent)."""
        await self.bus.publish(self.subject, encode_public(obj, self.ctype))
        self.counters.reply(obj, self.tokens)

    async def keep_alive(self, interval_s: float, request_id: str, client_gone: Callable[[], None]) -> None:
        """Until cancelled: a `Keepalive` every `interval_s`; `client_gone()` (then return) once
        nothing subscribes to the reply subject."""
        probe_s = min(interval_s / 2, MAX_PROBE_WAIT_S)  # long enough for the server's "no responders"
        while True:
            await asyncio.sleep(interval_s - probe_s)
            keepalive = encode_public(Keepalive(request_id=request_id), self.ctype)
            if not await self.bus.has_listener(self.subject, keepalive, wait_s=probe_s):
                client_gone()
                return
