"""Transfer metrics: exact bytes and wall time per transfer, failures by cause."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import asdict, dataclass, field

import msgspec

from schemas.internal import TransferStats


@dataclass(frozen=True)
class TransferRecord:
    """One finished transfer as seen by one side (a sender's shard, or a receiver's request)."""

    request_id: str
    nbytes: int
    wall_s: float  # first byte posted/announced -> last chunk landed (scattered, on the receiver)
    chunks: int
    started_unix: float = 0.0  # wall clock when this side started (sender built / reservation made)
    phases_s: dict[str, float] = field(default_factory=dict)  # where the time went (see sender/receiver)
    path: str = "ucx"  # "ucx" (staged chunks), "cuda_ipc" (direct writes, same host), or "cuda_ipc+ucx" (a mix of shards)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.wall_s / 1e9 if self.wall_s > 0 else 0.0


class PhaseTimes:
    """Seconds per phase of one transfer, summed over its chunks (chunks overlap, so
    per-chunk phases can add up to more than the wall time)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + max(0.0, seconds)


@dataclass
class TransferMetrics:
    """Counters one side exports in its heartbeat (``stats()``)."""

    completed: int = 0
    bytes_total: int = 0
    seconds_total: float = 0.0
    failures: Counter[str] = field(default_factory=Counter)
    recent: deque[TransferRecord] = field(default_factory=lambda: deque(maxlen=64))

    def record_ok(self, record: TransferRecord) -> None:
        self.completed += 1
        self.bytes_total += record.nbytes
        self.seconds_total += record.wall_s
        self.recent.append(record)

    def record_failure(self, cause: str) -> None:
        self.failures[cause] += 1

    def stats(self) -> TransferStats:
        """The counters as the heartbeat carries them."""
        return TransferStats(completed=self.completed, bytes_total=self.bytes_total, seconds_total=self.seconds_total,
                             failures=dict(self.failures))

    def snapshot(self) -> dict[str, object]:
        """Plain dict for logs and tests: the counters, mean GB/s, the last transfer."""
        return {
            **msgspec.structs.asdict(self.stats()),
            "mean_gbps": self.bytes_total / self.seconds_total / 1e9 if self.seconds_total > 0 else 0.0,
            "last": asdict(self.recent[-1]) | {"gbps": self.recent[-1].gbps} if self.recent else None,
        }
