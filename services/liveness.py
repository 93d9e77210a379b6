"""Whether this process is hearing the bus: the reference for judging others' silence.

The gateway (stages serving a request), the scheduler (its registry) and the decode
ranks (gateways whose requests they run) count a process as gone once its heartbeats stop. But silence is only evidence while the watcher itself
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


def takes_new_work(hb: Heartbeat) -> bool:
    """Whether the process of ``hb`` takes new requests: not draining, and of a prefill instance only its
    leader (rank 0), which takes the tasks (its other ranks follow it). The frontend's ``/health`` and
    `moebus status` judge a role present by this."""
    return not hb.draining and (hb.role != "prefill" or hb.rank == 0)


def member_key(hb: Heartbeat) -> MemberKey:
    return (hb.role, hb.instance, hb.rank)


def gateway_key(instance: str) -> MemberKey:
    """The key of gateway ``instance`` (a job's ``gateway`` field)."""
    return ("gateway", instance, 0)


class LatestHeartbeats:
    """The latest heartbeat of every process heard within `expiry_s`: what the bus says the stack is
    now (the frontend's readiness and the metrics page read it; no judging of our own hearing, a
    process that stopped beating simply leaves)."""

    def __init__(self, expiry_s: float) -> None:
        self.expiry_s = expiry_s
        self._latest: dict[MemberKey, tuple[float, Heartbeat]] = {}  # process -> (heard at, its heartbeat)

    def record(self, hb: Heartbeat, now: float) -> None:
        self._latest[member_key(hb)] = (now, hb)

    def live(self, now: float) -> list[Heartbeat]:
        """The processes heard within `expiry_s` of `now` (the others are forgotten), by (role, instance, rank)."""
        self._latest = {key: seen for key, seen in self._latest.items() if now - seen[0] <= self.expiry_s}
        return [hb for _, (_, hb) in sorted(self._latest.items())]


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

    def unsure_for(self, expiry_s: float, now: float) -> float:
        """Seconds until we have listened for `expiry_s` since our last deaf spell (or our start):
        before that, a process we have not heard from may be one whose next beat is still due,
        so its absence says nothing yet. 0.0 once we have."""
        return max(0.0, self.listening_since + expiry_s - now)

    def silence(self, last_heard: float, now: float) -> float:
        """How long a member last heard at `last_heard` has been silent while we listened;
        0.0 while our own beats are overdue (we hear nobody, so we judge nobody: a watcher
        cut off from NATS altogether leaves the decision to deadlines)."""
        if now - self.own_heard_at > self.deaf_after_s:
            return 0.0
        return max(0.0, now - max(last_heard, self.listening_since))


class PeerLiveness:
    """The last heartbeat heard from every process of `roles`, judged against our own hearing.

    The gateway watches the scheduler holding a request in its queue and the prefill and decode
    ranks serving its requests, and fails a request whose stage died (or restarted) once that stage has been silent for
    `expiry_s` of time the gateway itself was listening, instead of at the request's
    deadline; a decode rank watches the gateways it sends tokens to and drops the requests
    of one that died (nobody is left to read them), freeing their KV pages; a prefill
    leader drops the queued tasks of such a gateway instead of running them.
    """

    def __init__(self, own: MemberKey, interval_s: float, expiry_s: float, now: float, roles: tuple[str, ...]) -> None:
        """`own`: this process's heartbeat key; `interval_s`: the heartbeat interval; `expiry_s`:
        heard silence after which a peer counts as stopped; `now`: we start listening here;
        `roles`: the roles watched."""
        self.hearing = Hearing(own, interval_s, now)
        self.expiry_s = expiry_s
        self.roles = roles
        self.heard_at: dict[MemberKey, tuple[float, float]] = {}  # peer -> (last heard, its started_at)

    def heard(self, hb: Heartbeat, now: float) -> None:
        """A heartbeat read from the bus (every role's: our own one is the reference)."""
        self.hearing.heard(hb, now)
        if hb.role in self.roles:
            self.heard_at[member_key(hb)] = (now, hb.started_at)

    def placed(self, key: MemberKey, now: float) -> float:
        """Work now depends on `key`: as good as a heartbeat if none was heard yet.
        Returns the peer's start time as last heard (0.0: unknown, restarts go unnoticed)."""
        return self.heard_at.setdefault(key, (now, 0.0))[1]

    def stopped(self, key: MemberKey, started_at: float, now: float) -> bool:
        """Whether the peer (started at `started_at` when the work was placed) restarted since,
        or has been silent for `expiry_s` of time we were listening."""
        last, current_start = self.heard_at.get(key, (now, 0.0))
        if started_at and current_start != started_at:
            return True
        return self.hearing.silence(last, now) > self.expiry_s
