"""Decode ranks that missed a reservation reply: skipped for placement until they answer a probe.

A rank that does not answer a `ReserveKV` within `reserve_timeout_ms` (its process stalled,
its event loop blocked, its reply lost) would cost every request asked there that whole wait
before the next rank is tried. Its heartbeats do not prove it answers again: they come from
another task than its reservation handler, and a rank whose handler is stuck may go on
beating. What proves it is an answer on the rank's reserve subject, so the scheduler probes:
a `ReserveKV` whose `reply_by` and lease are long past, which a rank refuses without reserving
anything (whatever its clock says), and any well-formed answer within `reserve_timeout_ms`
brings the rank back. The first probe goes out `reserve_timeout_ms` after the miss; each missed
probe doubles the wait, up to `suspect_probe_max_s`: a briefly slow rank is back within about
a second, a stalled one costs a probe every few seconds and no request any more waiting.

A rank that restarts (a new `started_at`) is a new process and not suspect; one that leaves
the registry (silent past the heartbeat expiry) is forgotten here too.
"""

from __future__ import annotations

import asyncio
import itertools
import time

from structlog.contextvars import unbind_contextvars

from schemas import subjects
from schemas.internal import KVReservation, ReserveKV
from services.liveness import MemberKey
from services.scheduler.registry import Member, Registry, Suspicion
from shared.bus import Bus, BusError
from shared.logging import get_logger
from shared.settings import SchedulerSettings
from shared.tasks import cancel_and_wait

log = get_logger(__name__)

LONG_PAST = 1.0  # Unix time (1970): a probe's `reply_by` and lease, past on any clock; 0 would mean "no bound"


def rank_name(key: MemberKey) -> str:
    return f"{key[1]}/{key[2]}"


class SuspectRanks:
    """Marks decode ranks suspect in the registry and probes each until it answers, restarts or leaves."""

    def __init__(self, settings: SchedulerSettings, bus: Bus, registry: Registry) -> None:
        self.bus = bus
        self.registry = registry
        self.timeout_s = settings.reserve_timeout_ms / 1000
        self.max_delay_s = settings.suspect_probe_max_s
        self.probe_ids = (f"probe-{settings.instance}-{n}" for n in itertools.count())
        self._probes: dict[MemberKey, asyncio.Task[None]] = {}

    def names(self) -> list[str]:
        """The suspect ranks as "instance/rank" (the scheduler's heartbeat)."""
        return sorted(rank_name(key) for key, m in self.registry.members.items() if self.registry.is_suspect(m))

    def missed(self, member: Member, error: BusError) -> None:
        """`member` did not answer a reservation (`error`): skip it and probe it, unless that is under way."""
        key = (member.hb.role, member.hb.instance, member.hb.rank)
        suspicion = self.registry.suspect(key)
        if suspicion is None:
            return
        log.warning("decode_rank_suspect", decode=rank_name(key), error=str(error))
        self._probes[key] = asyncio.get_running_loop().create_task(self._probe_until_back(key, suspicion))  # kept: the loop holds tasks weakly

    async def stop(self) -> None:
        await cancel_and_wait(*self._probes.values())  # each removes itself as it ends (the arguments are a copy)

    async def _probe_until_back(self, key: MemberKey, suspicion: Suspicion) -> None:
        unbind_contextvars("request_id")  # the task started with the context of the request that met the miss
        delay, probes = self.timeout_s, 0
        try:
            while True:
                await asyncio.sleep(delay)
                member = self.registry.members.get(key)
                if member is None:  # expired: nothing to place there; a rank that beats again is heard anew
                    return
                if member.hb.started_at != suspicion.started_at:
                    log.info("decode_rank_back", decode=rank_name(key), why="restarted", suspect_s=round(time.monotonic() - suspicion.since, 3))
                    return
                probes += 1
                if await self._answers(key):
                    log.info("decode_rank_back", decode=rank_name(key), why="answered a probe", probes=probes,
                             suspect_s=round(time.monotonic() - suspicion.since, 3))
                    return
                delay = min(2 * delay, self.max_delay_s)
        finally:
            if self.registry.suspects.get(key) is suspicion:
                del self.registry.suspects[key]
            if self._probes.get(key) is asyncio.current_task():
                del self._probes[key]

    async def _answers(self, key: MemberKey) -> bool:
        _, instance, rank = key
        probe = ReserveKV(request_id=next(self.probe_ids), gateway="", prompt_tokens=0, max_tokens=0, lease_until=LONG_PAST, reply_by=LONG_PAST)
        try:
            await self.bus.request(subjects.decode_reserve(instance, rank), probe, KVReservation, timeout=self.timeout_s)
        except BusError:
            return False
        return True
