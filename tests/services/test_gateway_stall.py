"""A gateway that stalls past the decode ranks' `gateway_expiry_s` and comes back fails the
requests they dropped at once, instead of waiting for their tokens until the deadline.

The decode rank cannot tell a dead gateway from a stalled one (SIGSTOP here: a starved
process, a paused VM): it drops the requests of one silent for `gateway_expiry_s` and frees
their pages (`decode_orphaned`). A stalled gateway then resumes with those requests in flight,
their decode rank alive and beating: before, it waited for tokens that never came until the
request's deadline (the default is 600 s), and a client without keepalives (the stock `nats`
CLI) with it. Seen on `moebus up` with a 40 s deadline: the client got `timeout` after 40 s.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from schemas.api import GenerateRequest
from services.client import Client, GenerateError

from services_helpers import all_kv_free, log_events, run, session, stack_fixture

pytestmark = pytest.mark.slow

GATEWAY_EXPIRY_S = 1.5  # the least the settings allow: 3 heartbeat intervals
DEADLINE_S = 15.0

stack = stack_fixture("single-node.yml", env={"MOEBUS_DECODE_GATEWAY_EXPIRY_S": str(GATEWAY_EXPIRY_S)})


def test_a_resumed_gateway_fails_at_once_the_requests_a_decode_rank_dropped_while_it_was_stalled(stack):
    gateway = next(r for r in stack.replicas if r.role == "gateway")
    rid = "stalled-gateway"

    async def go() -> tuple[GenerateError, float]:
        async with session(stack.url) as (default_client, watch):
            await watch.wait_for(lambda w: len(w.live("decode")) == 1, 30, "the decode rank")
            client = Client(default_client.bus, keepalive_s=None)  # waits for the gateway's answer alone
            req = GenerateRequest(prompt="a stalled gateway", max_tokens=4000, ignore_eos=True, temperature=0,
                                  timeout_ms=int(DEADLINE_S * 1000), request_id=rid)
            chunks = client.stream(req)
            await chunks.__anext__()  # decoding
            os.kill(gateway.proc.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(2 * GATEWAY_EXPIRY_S)
                until = time.monotonic() + 10
                while not [e for e in log_events(stack, "decode_orphaned") if e["request_id"] == rid]:
                    assert time.monotonic() < until, "the decode rank kept the stalled gateway's request"
                    await asyncio.sleep(0.1)
            finally:
                os.kill(gateway.proc.pid, signal.SIGCONT)
            resumed = time.monotonic()
            with pytest.raises(GenerateError) as failed:
                async for _chunk in chunks:
                    pass
            waited = time.monotonic() - resumed
            watch.latest.clear()  # judge by heartbeats sent from now on
            await watch.wait_for(all_kv_free, 5, "every KV page free")
            return failed.value, waited

    error, waited = run(go())
    assert error.code == "unavailable", error
    assert waited < 3.0, f"answered {waited:.1f}s after the gateway resumed"
