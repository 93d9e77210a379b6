"""A prefill instance whose follower rank hangs stops counting as alive, instead of holding the
requests placed on it until their deadlines.

Only the leader of a TP group is on the bus: with a follower hung (SIGSTOP here: a GPU or a
process stuck), the leader blocks in the batch's broadcast or collectives and its heartbeats
still go out. Before `prefill.stall_s`, the gateways waited for such requests until their
deadlines (600 s by default) and the schedulers placed more there: on `moebus up` with
PREFILL_TP=2, every request of a steady load answered `timeout` at its 30 s deadline. Now the
leader withholds its heartbeats once a batch has run `stall_s`: the gateway fails the request
as `unavailable` (`stage_expiry_s` later), and the instance serves again once its rank resumes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from schemas.api import GenerateRequest
from services.client import GenerateError

from services_helpers import all_kv_free, log_events, rank1_pid, run, served_again, session, stack_fixture

pytestmark = pytest.mark.slow

STALL_S = 2.0
DEADLINE_S = 20.0

stack = stack_fixture("split-nodes.yml", scale={"gateway": 1, "scheduler": 1}, env={"MOEBUS_PREFILL_STALL_S": str(STALL_S)})


def test_a_hung_tp_follower_fails_its_requests_as_unavailable_before_their_deadline(stack):
    follower = rank1_pid(stack, "prefill")

    async def go() -> tuple[GenerateError, float]:
        async with session(stack.url) as (client, watch):
            await watch.wait_for(lambda w: len(w.live("prefill")) == 1 and len(w.live("decode")) == 2, 30, "the stack")
            os.kill(follower, signal.SIGSTOP)
            try:
                await asyncio.sleep(1.5)
                assert watch.live("prefill", within_s=1.0), "the leader stopped beating: the SIGSTOP hit the leader"
                started = time.monotonic()
                with pytest.raises(GenerateError) as failed:
                    await client.generate(GenerateRequest(prompt="a hung rank", max_tokens=8, temperature=0, timeout_ms=int(DEADLINE_S * 1000)))
                waited = time.monotonic() - started
            finally:
                os.kill(follower, signal.SIGCONT)
            reply = await served_again(client, 20)  # the stuck batch ends, the leader beats again and serves
            assert reply.usage.completion_tokens == 4
            watch.latest.clear()  # judge by heartbeats sent from now on
            await watch.wait_for(all_kv_free, 10, "every KV page free")
            return failed.value, waited

    error, waited = run(go())
    assert error.code == "unavailable", error
    assert waited < STALL_S + 6, f"answered after {waited:.1f}s"
    assert log_events(stack, "prefill_stalled")
