"""A scheduler that stalls past the gateway's submit timeout and comes back does not run the
submits the gateways stopped waiting for.

A paused scheduler (SIGSTOP: a starved process, a paused VM) leaves its submits in its socket.
The gateway answers `unavailable` once `submit_timeout_s` passes and cancels the request, but
that cancel may reach the resumed scheduler before the submit does, and a cancel for a request
it does not hold is ignored. Seen on `moebus up` before `SubmitJob.reply_by`: a scheduler stopped
for 12 s then placed all 8 submits it had missed, 2 s after their clients were told
`unavailable`, and prefill and decode ran them to the end (with the default 600 s deadline, a
long completion holds its decode pages for minutes for nobody).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from schemas.api import GenerateRequest
from services.client import GenerateError

from services_helpers import all_kv_free, log_events, run, session, stack_fixture

pytestmark = pytest.mark.slow

SUBMIT_TIMEOUT_S = 1.0

stack = stack_fixture("single-node.yml", env={"MOEBUS_GATEWAY_SUBMIT_TIMEOUT_S": str(SUBMIT_TIMEOUT_S)})


def _events(stack, event: str, request_id: str) -> list[dict]:  # type: ignore[no-untyped-def]
    return [e for e in log_events(stack, event) if e.get("request_id") == request_id]


def test_a_submit_the_gateway_stopped_waiting_for_is_refused_when_the_scheduler_resumes(stack):
    scheduler = next(r for r in stack.replicas if r.role == "scheduler")
    rid = "stale-submit"

    async def go():
        async with session(stack.url) as (client, watch):
            await watch.wait_for(lambda w: len(w.live("decode")) == 1, 30, "the decode rank")
            req = GenerateRequest(prompt="a stalled scheduler", max_tokens=2000, temperature=0, timeout_ms=60_000, request_id=rid)
            os.kill(scheduler.proc.pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                with pytest.raises(GenerateError) as failed:
                    await client.generate(req)
                assert failed.value.code == "unavailable", failed.value
                assert time.monotonic() - started < SUBMIT_TIMEOUT_S + 2
            finally:
                os.kill(scheduler.proc.pid, signal.SIGCONT)
            deadline = time.monotonic() + 10
            while not (_events(stack, "refused", rid) or _events(stack, "placed", rid)):
                assert time.monotonic() < deadline, "the resumed scheduler never answered the stale submit"
                time.sleep(0.1)
            # The stack serves on, and nothing of the stale request is held.
            reply = await client.generate(GenerateRequest(prompt="after", max_tokens=4, temperature=0))
            assert reply.usage.completion_tokens == 4
            watch.latest.clear()  # judge by heartbeats sent from now on
            await watch.wait_for(all_kv_free, 5, "every KV page free")

    run(go())
    assert _events(stack, "placed", rid) == []
    assert _events(stack, "kv.reserved", rid) == []  # no decode rank held pages for it, even briefly
    assert _events(stack, "refused", rid)[0]["code"] == "unavailable"
