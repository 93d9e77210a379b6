"""Liveness under load: silence is held against a stage (gateway) or a member (scheduler)
only while the watcher was listening, and expiries leave room for late heartbeats.

A pytest run on a loaded 2-core box once failed a healthy request with "decode ... stopped
responding": a process that does not get the CPU (the gateway, the decode rank, or the
whole host) reads or sends heartbeats late. The unit tests feed `PeerLiveness` and the
scheduler's `Registry` heartbeats at chosen times (no sleeps); the stack test pauses real
processes with SIGSTOP, as a starved or paused host does, with margins of seconds.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from schemas.api import GenerateRequest
from schemas.internal import Heartbeat, Role
from services.liveness import Hearing, PeerLiveness
from services.scheduler.registry import Registry
from shared.settings import DecodeSettings, GatewaySettings, SchedulerSettings, SettingsError, load_settings

from services_helpers import run, session, stack_fixture

GATEWAY = ("gateway", "gw", 0)
DECODE = ("decode", "decode-0", 0)
EXPIRY = 2.0


def beat(key: tuple[str, str, int], started_at: float = 100.0) -> Heartbeat:
    role: Role = key[0]  # type: ignore[assignment]
    return Heartbeat(role=role, instance=key[1], rank=key[2], model="m", version="v", started_at=started_at)


def listening_gateway(until: float, decode_beats_until: float) -> PeerLiveness:
    """A gateway that heard its own beat and the decode rank's every 0.5 s from t=0."""
    live = PeerLiveness(GATEWAY, interval_s=0.5, expiry_s=EXPIRY, now=0.0, roles=("prefill", "decode"))
    live.placed(DECODE, 0.0)
    t = 0.0
    while t <= until:
        live.heard(beat(GATEWAY), t)
        if t <= decode_beats_until:
            live.heard(beat(DECODE), t)
        t += 0.5
    return live


def test_a_stage_silent_while_the_gateway_listens_stops_after_the_expiry():
    live = listening_gateway(until=10.0, decode_beats_until=1.0)  # the decode rank's last beat: t=1.0
    assert not live.stopped(DECODE, 100.0, 1.0 + EXPIRY - 0.1)
    assert live.stopped(DECODE, 100.0, 1.0 + EXPIRY + 0.1)


def test_silence_while_the_gateway_was_deaf_is_not_held_against_the_stage():
    # Both beat until t=1.0; then the gateway reads nothing until t=5.0 (its process starved,
    # the host paused). Its watch tick runs first: before it reads the waiting heartbeats.
    live = listening_gateway(until=1.0, decode_beats_until=1.0)
    assert not live.stopped(DECODE, 100.0, 5.0)  # by the clock alone: 4 s of silence > expiry
    # It reads its own beat first; the decode rank's arrives a moment later.
    live.heard(beat(GATEWAY), 5.01)
    assert not live.stopped(DECODE, 100.0, 5.02)
    live.heard(beat(DECODE), 5.03)
    assert not live.stopped(DECODE, 100.0, 5.03 + EXPIRY - 0.1)


def test_a_stage_that_stays_silent_after_the_gateway_recovers_stops_one_expiry_later():
    live = listening_gateway(until=1.0, decode_beats_until=1.0)
    for t in (5.0, 5.5, 6.0, 6.5, 7.0, 7.5):  # the gateway hears itself again from t=5.0; the decode rank never
        live.heard(beat(GATEWAY), t)
    assert not live.stopped(DECODE, 100.0, 5.0 + EXPIRY - 0.1)
    assert live.stopped(DECODE, 100.0, 5.0 + EXPIRY + 0.1)


def test_a_restarted_stage_stops_its_requests_at_once():
    live = listening_gateway(until=1.0, decode_beats_until=1.0)
    live.heard(beat(DECODE, started_at=200.0), 1.2)  # same key, new process
    assert live.stopped(DECODE, 100.0, 1.2)
    assert not live.stopped(DECODE, 200.0, 1.2)  # a request placed on the new process


def scheduler_registry(own_beats_from: float, now: float) -> tuple[Registry, tuple[str, str, int]]:
    """A registry whose scheduler heard nothing from now-10 s on, then its own beat every 0.5 s
    from `own_beats_from` to `now`; one decode rank, last heard 5 s ago."""
    hearing = Hearing(("scheduler", "s", 0), interval_s=0.5, now=now - 10)
    registry = Registry(expiry_s=1.5, hearing=hearing)
    registry.update(beat(DECODE))
    registry.members[DECODE].seen = now - 5
    t = own_beats_from
    while t <= now:
        hearing.heard(beat(("scheduler", "s", 0)), t)
        t += 0.5
    return registry, DECODE


def test_the_scheduler_drops_only_members_silent_while_it_listened():
    now = time.monotonic()
    deaf, _ = scheduler_registry(own_beats_from=now + 1, now=now)  # no own beat for 10 s: judges nobody
    assert deaf.expire() == []
    recovered, _ = scheduler_registry(own_beats_from=now - 1, now=now)  # listening again for 1 s < 1.5 s
    assert recovered.expire() == []
    listening, key = scheduler_registry(own_beats_from=now - 3, now=now)  # 3 s of listening and silence
    assert listening.expire() == [key]


@pytest.mark.parametrize(
    ("cls", "service", "env", "field"),
    [
        (GatewaySettings, "gateway", {"MOEBUS_HEARTBEAT_INTERVAL_S": "1.0"}, "stage_expiry_s=2"),
        (SchedulerSettings, "scheduler", {"MOEBUS_SCHEDULER_HEARTBEAT_EXPIRY_S": "1.0"}, "heartbeat_expiry_s=1"),
        (DecodeSettings, "decode", {"MOEBUS_DECODE_GATEWAY_EXPIRY_S": "1.0"}, "gateway_expiry_s=1"),
    ],
)
def test_an_expiry_shorter_than_three_heartbeat_intervals_is_rejected(cls, service, env, field):
    assert load_settings(cls, service, env={})  # the defaults leave the margin
    with pytest.raises(SettingsError, match=f"{field} must be at least 3 x heartbeat_interval_s"):
        load_settings(cls, service, env=env)


# ---------------------------------------------------------------- a real stack

stack = stack_fixture("single-node.yml")
PAUSE_S = 2 * EXPIRY  # both paused well past the stage expiry
DECODE_LATER_S = 0.5  # the decode rank resumes after the gateway (its beat cannot be waiting)


@pytest.mark.slow
def test_a_paused_host_fails_no_request_whose_stages_resume(stack):
    """Gateway and decode rank stopped together (a starved or paused host), the gateway resumed
    first: it has heard nothing from the decode rank for longer than the expiry, but it was
    not listening either, so the request goes on once the decode rank beats again."""
    gateway = next(r for r in stack.replicas if r.role == "gateway")
    decode = next(r for r in stack.replicas if r.role == "decode")  # one rank: runs in the replica's process

    async def go():
        async with session(stack.url) as (client, watch):
            await watch.wait_for(lambda w: len(w.live("decode")) == 1, 30, "the decode rank")
            req = GenerateRequest(prompt="paused", max_tokens=4000, temperature=0, timeout_ms=60_000, request_id="paused-host")
            chunks = client.stream(req)
            tokens = len((await chunks.__anext__()).token_ids)
            os.kill(decode.proc.pid, signal.SIGSTOP)
            os.kill(gateway.proc.pid, signal.SIGSTOP)
            try:
                time.sleep(PAUSE_S)  # the whole test process pauses too, as on a paused host
                os.kill(gateway.proc.pid, signal.SIGCONT)
                time.sleep(DECODE_LATER_S)
            finally:
                os.kill(gateway.proc.pid, signal.SIGCONT)
                os.kill(decode.proc.pid, signal.SIGCONT)
            async for chunk in chunks:
                tokens += len(chunk.token_ids)
                if tokens >= 64:  # well past the pause: the request is alive
                    break
            await client.cancel("paused-host")
            return tokens

    assert run(go()) >= 64
