"""Which serving stages the gateway still hears, judged only over time it was itself listening.

The gateway fails a request whose prefill or decode process died (or restarted) once that
stage has been silent for `stage_expiry_s`, instead of at the request's deadline. Silence
is counted only while the gateway could have heard the stage: its own heartbeat travels
the same way as every stage's (its event loop -> NATS -> its event loop), so while its own
beats do not come back it is not reading anyone's (its process starved of CPU, a pause of
the whole host, a stalled NATS server), and that time is not held against the stages.
Without this, a gateway resuming from such a stall judged the stages by the clock before
it had read the heartbeats waiting in its socket, and failed requests whose stages had
never stopped.

Times are `time.monotonic()` values passed in by the caller.
"""

from __future__ import annotations

from schemas.internal import Heartbeat

StageKey = tuple[str, str, int]  # (role, instance, rank)

# The gateway's own heartbeat comes back every interval; a gap longer than this many
# intervals means it was not listening (one late beat under load is still listening).
DEAF_AFTER_INTERVALS = 2.0


class StageLiveness:
    """The last heartbeat heard from every stage, and since when the gateway has been listening."""

    def __init__(self, own: StageKey, interval_s: float, expiry_s: float, now: float) -> None:
        """`own`: the gateway's own heartbeat key; `interval_s`: the heartbeat interval (every
        service beats this often); `expiry_s`: heard silence after which a stage counts as
        stopped; `now`: the gateway starts listening here."""
        self.own = own
        self.interval_s = interval_s
        self.expiry_s = expiry_s
        self.heard_at: dict[StageKey, tuple[float, float]] = {}  # stage -> (last heard, its started_at)
        self.own_heard_at = now
        self.listening_since = now  # end of the gateway's last deaf spell

    @property
    def deaf_after_s(self) -> float:
        return DEAF_AFTER_INTERVALS * self.interval_s

    def heard(self, hb: Heartbeat, now: float) -> None:
        """A heartbeat read from the bus (every role's: the gateway's own one is the reference)."""
        key = (hb.role, hb.instance, hb.rank)
        if key == self.own:
            if now - self.own_heard_at > self.deaf_after_s:
                self.listening_since = now  # we were deaf until now: silence counts from here
            self.own_heard_at = now
        elif hb.role in ("prefill", "decode"):
            self.heard_at[key] = (now, hb.started_at)

    def placed(self, key: StageKey, now: float) -> float:
        """A request was placed on `key`: as good as a heartbeat if none was heard yet.
        Returns the stage's start time as last heard (0.0: unknown, restarts go unnoticed)."""
        return self.heard_at.setdefault(key, (now, 0.0))[1]

    def stopped(self, key: StageKey, started_at: float, now: float) -> bool:
        """Whether the stage a request was placed on (when it had started at `started_at`)
        restarted since, or has been silent for `expiry_s` of time the gateway was listening.

        While the gateway's own beats are overdue it hears nobody, so it judges nobody: if
        nothing at all comes back (the gateway cut off from NATS), the request's deadline
        ends it instead.
        """
        last, current_start = self.heard_at.get(key, (now, 0.0))
        if started_at and current_start != started_at:
            return True
        if now - self.own_heard_at > self.deaf_after_s:
            return False
        return now - max(last, self.listening_since) > self.expiry_s
