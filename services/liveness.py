"""Whether this process is hearing the bus: the reference for judging others' silence.

The gateway (stages serving a request) and the scheduler (its registry) count a process
as gone once its heartbeats stop. But silence is only evidence while the watcher itself
was reading: its own heartbeat travels the same way as everyone's (its event loop ->
NATS -> its event loop), so while its own beats do not come back it hears nobody (its
process starved of CPU, a pause of the whole host, a stalled NATS server). A watcher
that judged by the clock alone, resuming from such a stall, could run its check before
reading the heartbeats waiting in its socket and drop members that never stopped.

Times are `time.monotonic()` values passed in by the caller.
"""

from __future__ import annotations

from schemas.internal import Heartbeat

MemberKey = tuple[str, str, int]  # (role, instance, rank)

# Our own heartbeat comes back every interval; a gap longer than this many intervals
# means we were not listening (one late beat under load is still listening).
DEAF_AFTER_INTERVALS = 2.0


def member_key(hb: Heartbeat) -> MemberKey:
    return (hb.role, hb.instance, hb.rank)


class Hearing:
    """Since when this process has been hearing its own heartbeats come back."""

    def __init__(self, own: MemberKey, interval_s: float, now: float) -> None:
        """`own`: this process's heartbeat key; `interval_s`: its heartbeat interval (every
        service beats this often); `now`: it starts listening here."""
        self.own = own
        self.deaf_after_s = DEAF_AFTER_INTERVALS * interval_s
        self.own_heard_at = now
        self.listening_since = now  # end of the last deaf spell

    def heard(self, hb: Heartbeat, now: float) -> None:
        """Any heartbeat read from the bus; only our own one moves the reference."""
        if member_key(hb) == self.own:
            if now - self.own_heard_at > self.deaf_after_s:
                self.listening_since = now  # deaf until now: silence counts from here
            self.own_heard_at = now

    def silence(self, last_heard: float, now: float) -> float:
        """How long a member last heard at `last_heard` has been silent while we listened;
        0.0 while our own beats are overdue (we hear nobody, so we judge nobody: a watcher
        cut off from NATS altogether leaves the decision to deadlines)."""
        if now - self.own_heard_at > self.deaf_after_s:
            return 0.0
        return max(0.0, now - max(last_heard, self.listening_since))
