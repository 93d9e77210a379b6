"""Which serving stages the gateway still hears.

The gateway fails a request whose prefill or decode process died (or restarted) once that
stage has been silent for `stage_expiry_s` of time the gateway itself was listening
(`services.liveness.Hearing`), instead of at the request's deadline.

Times are `time.monotonic()` values passed in by the caller.
"""

from __future__ import annotations

from schemas.internal import Heartbeat
from services.liveness import Hearing, MemberKey, member_key

StageKey = MemberKey


class StageLiveness:
    """The last heartbeat heard from every stage, judged against the gateway's own hearing."""

    def __init__(self, own: StageKey, interval_s: float, expiry_s: float, now: float) -> None:
        """`own`: the gateway's own heartbeat key; `interval_s`: the heartbeat interval;
        `expiry_s`: heard silence after which a stage counts as stopped; `now`: the gateway
        starts listening here."""
        self.hearing = Hearing(own, interval_s, now)
        self.expiry_s = expiry_s
        self.heard_at: dict[StageKey, tuple[float, float]] = {}  # stage -> (last heard, its started_at)

    def heard(self, hb: Heartbeat, now: float) -> None:
        """A heartbeat read from the bus (every role's: the gateway's own one is the reference)."""
        self.hearing.heard(hb, now)
        if hb.role in ("prefill", "decode"):
            self.heard_at[member_key(hb)] = (now, hb.started_at)

    def placed(self, key: StageKey, now: float) -> float:
        """A request was placed on `key`: as good as a heartbeat if none was heard yet.
        Returns the stage's start time as last heard (0.0: unknown, restarts go unnoticed)."""
        return self.heard_at.setdefault(key, (now, 0.0))[1]

    def stopped(self, key: StageKey, started_at: float, now: float) -> bool:
        """Whether the stage a request was placed on (when it had started at `started_at`)
        restarted since, or has been silent for `expiry_s` of time the gateway was listening."""
        last, current_start = self.heard_at.get(key, (now, 0.0))
        if started_at and current_start != started_at:
            return True
        return self.hearing.silence(last, now) > self.expiry_s
