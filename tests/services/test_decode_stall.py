"""A decode rank whose peer rank hangs stops counting as alive, instead of holding the requests
placed on it until their deadlines.

The ranks of a decode instance step in lockstep (every step is a collective). With one rank hung
(SIGSTOP here: a stuck GPU or process), the others block in their next step while their own
heartbeats go on: before `decode.stall_s` the scheduler kept placing requests on them and the
gateways waited for those until their deadlines (600 s by default). Now a rank whose step has run
`stall_s` withholds its heartbeats: the request fails as `unavailable`, not `timeout`.
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

stack = stack_fixture("split-nodes.yml", scale={"gateway": 1, "scheduler": 1}, env={"MOEBUS_DECODE_STALL_S": str(STALL_S)})


def _rank1_expired(stack) -> bool:  # type: ignore[no-untyped-def]
    return any(e.get("member") == ["decode", "decode-0", 1] for e in log_events(stack, "member_expired"))


def test_a_rank_waiting_on_a_hung_peer_fails_its_requests_as_unavailable_before_their_deadline(stack):
    rank1 = rank1_pid(stack, "decode")

    async def go() -> tuple[GenerateError, float]:
        async with session(stack.url) as (client, watch):
            await watch.wait_for(lambda w: len(w.live("prefill")) == 1 and len(w.live("decode")) == 2, 30, "the stack")
            os.kill(rank1, signal.SIGSTOP)
            try:
                until = time.monotonic() + 10
                while not _rank1_expired(stack):  # from now on the scheduler places on rank 0 only
                    assert time.monotonic() < until, "the scheduler kept decode-0/1"
                    await asyncio.sleep(0.1)
                started = time.monotonic()
                with pytest.raises(GenerateError) as failed:
                    await client.generate(GenerateRequest(prompt="a hung peer", max_tokens=8, temperature=0, timeout_ms=int(DEADLINE_S * 1000)))
                waited = time.monotonic() - started
            finally:
                os.kill(rank1, signal.SIGCONT)
            reply = await served_again(client, 20)  # the step ends, the ranks beat again and serve
            assert reply.usage.completion_tokens == 4
            watch.latest.clear()  # judge by heartbeats sent from now on
            await watch.wait_for(lambda w: len(w.live("decode")) == 2 and all_kv_free(w), 10, "both ranks, every KV page free")
            return failed.value, waited

    error, waited = run(go())
    assert error.code == "unavailable", error
    assert waited < STALL_S + 6, f"answered after {waited:.1f}s"
