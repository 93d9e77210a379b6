"""`GET /health` of `moebus openai` says whether the stack can serve, not only whether a gateway
answers: a real stack (compose/single-node.yml, tiny model, real nats-server) first without a
decode instance, then with one that joins, then with it stopped again."""

from __future__ import annotations

import time

import pytest

from services_helpers import frontend_address, health, stack_fixture

pytestmark = pytest.mark.slow

stack = stack_fixture("single-node.yml", scale={"decode": 0})


def wait_health(addr: tuple[str, int], status: int, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        got, body = health(addr)
        if got == status:
            return body
        assert time.monotonic() < deadline, f"/health stayed {got} ({body.strip()}), expected {status}"
        time.sleep(0.2)


def test_health_fails_while_no_decode_rank_serves_and_recovers_when_one_joins(stack):
    addr = frontend_address(stack)
    # The gateway answers llm.models (what /health checked alone), but every request would fail.
    status, body = health(addr)
    assert status == 503 and "no decode heard in the last 2 s" in body, body
    decode = stack.start_replica("decode")
    wait_health(addr, 200)
    stack.stop_replica(decode)  # drains, then stops beating: unhealthy within the expiry
    body = wait_health(addr, 503, timeout=30.0)
    assert "no decode" in body, body


def test_readiness_counts_processes_that_take_work_within_the_expiry():
    from schemas.internal import Heartbeat
    from services.openai.readiness import StackReadiness

    def hb(role: str, rank: int = 0, draining: bool = False) -> Heartbeat:
        return Heartbeat(role=role, instance=f"{role}-0", rank=rank, model="tiny", version="0.1", started_at=0.0, draining=draining)

    r = StackReadiness(expiry_s=2.0)
    assert r.missing(0.0) == ["gateway", "scheduler", "prefill", "decode"]
    for role in ("gateway", "scheduler", "decode"):
        r.on_heartbeat(hb(role), 10.0)
    r.on_heartbeat(hb("prefill", rank=1), 10.0)  # a TP follower alone takes no tasks
    assert r.missing(10.5) == ["prefill"]
    r.on_heartbeat(hb("prefill", rank=0), 10.5)
    assert r.missing(11.0) == []
    r.on_heartbeat(hb("decode", draining=True), 11.0)  # finishing its requests, taking none
    assert r.missing(11.5) == ["decode"]
    r.on_heartbeat(hb("decode"), 11.5)
    assert r.missing(12.4) == ["gateway", "scheduler"]  # heard at 10.0, 2.4 s ago; prefill (10.5) and decode within 2 s
