"""The scheduler's view of the cluster, rebuilt from heartbeats alone.

Each member (a decode rank or a prefill instance) is known by its last heartbeat.
Between heartbeats the scheduler adds what it has itself placed there (`pending_*`),
so that a burst of requests does not all land on the member that looked emptiest
half a second ago. The next heartbeat replaces the estimate with the member's own
numbers; the decode rank's reservation stays the source of truth (it may refuse).
The estimate only grows between heartbeats (it cannot see the requests that finished
meanwhile): where short requests turn over faster than the ranks beat, it reaches a
rank's batch cap while the rank has room. So when the estimate leaves no decode rank, a
rank whose last heartbeat alone shows room is asked all the same, until it refuses
(`Member.refused`, until its next heartbeat), instead of the request waiting for that heartbeat.

A decode rank that missed a reservation reply is a suspect (`Suspicion`, kept by key, not on
its `Member`: the next heartbeat replaces the Member, and a rank's heartbeats may go on while
its reservations stall): placement skips it until it answers again (services/scheduler/suspects.py).

Prefix affinity (`prefill_for`): a prefill instance's prefix cache only helps prompts that
land on it, so prompts whose first KV page is the same go to the same instance while its
queue is not much longer than the least loaded one's. The instance is picked by rendezvous
hashing of the first page's key over the live instances with a prefix cache (those whose
heartbeat carries ``prefix_cache``; with caching off there is nothing to be near, and the
least loaded instance serves): every scheduler replica picks the same one, and an instance
joining or leaving moves only its share of prefixes. The key is salted with the request's
``cache_salt`` as prefill salts its pages' keys, so a salt's prompts gather where its pages are.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from schemas.internal import Heartbeat
from services.liveness import Hearing, MemberKey
from shared.prefix_keys import page_keys


@dataclass
class Member:
    hb: Heartbeat
    seen: float  # time.monotonic() of the last heartbeat
    pending_pages: int = 0
    pending_batch: int = 0
    pending_tokens: int = 0
    refused: bool = False  # refused a reservation since this heartbeat: asked again only by the estimate

    @property
    def free_pages(self) -> int:
        return self.hb.kv_free_pages - self.pending_pages

    @property
    def batch(self) -> int:
        return self.hb.batch_size + self.pending_batch

    @property
    def queued_tokens(self) -> int:
        return self.hb.queued_tokens + self.pending_tokens

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // max(self.hb.page_size, 1))


@dataclass(frozen=True)
class Suspicion:
    started_at: float  # of the process that missed a reply: a restarted rank (a new started_at) is not suspect
    since: float  # time.monotonic() of the miss


@dataclass
class Registry:
    expiry_s: float
    model: str = ""  # only members serving this model are considered ("" = any)
    members: dict[MemberKey, Member] = field(default_factory=dict)
    # The scheduler's own hearing: silence counts only while it was listening. None: by the clock alone.
    hearing: Hearing | None = None
    suspects: dict[MemberKey, Suspicion] = field(default_factory=dict)

    def update(self, hb: Heartbeat) -> None:
        if self.model and hb.model != self.model:
            return
        key = (hb.role, hb.instance, hb.rank)
        self.members[key] = Member(hb=hb, seen=time.monotonic())

    def expire(self) -> list[MemberKey]:
        """Drop members silent for longer than the expiry; returns their keys."""
        now = time.monotonic()
        gone = [k for k, m in self.members.items() if self._silence(m, now) > self.expiry_s]
        for k in gone:
            del self.members[k]
        return gone

    def _silence(self, member: Member, now: float) -> float:
        return self.hearing.silence(member.seen, now) if self.hearing is not None else now - member.seen

    def suspect(self, key: MemberKey) -> Suspicion | None:
        """Mark a registered member suspect; None when it is not registered or already suspect."""
        member = self.members.get(key)
        if member is None or self.is_suspect(member):
            return None
        self.suspects[key] = suspicion = Suspicion(started_at=member.hb.started_at, since=time.monotonic())
        return suspicion

    def is_suspect(self, member: Member) -> bool:
        suspicion = self.suspects.get((member.hb.role, member.hb.instance, member.hb.rank))
        return suspicion is not None and suspicion.started_at == member.hb.started_at

    def of_role(self, role: str) -> list[Member]:
        return [m for m in self.members.values() if m.hb.role == role and not m.hb.draining]

    def decode_candidates(self, num_tokens: int) -> list[Member]:
        """Decode ranks, not suspect, with room for `num_tokens` of KV and a batch below their cap by
        the estimate, most free KV first; when none has, those with room by their last heartbeat alone
        that have not refused since (module doc)."""
        live = [m for m in self.of_role("decode") if not self.is_suspect(m)]
        fits = [m for m in live if m.batch < m.hb.max_batch and m.free_pages >= m.pages_for(num_tokens)]
        if not fits:
            fits = [m for m in live if not m.refused and m.hb.batch_size < m.hb.max_batch and m.hb.kv_free_pages >= m.pages_for(num_tokens)]
        return sorted(fits, key=lambda m: (-m.free_pages, m.batch, m.hb.instance, m.hb.rank))

    def prefill_for(self, input_ids: Sequence[int], slack_tokens: int, cache_salt: str | None = None) -> Member | None:
        """The prefill instance for a prompt: the one its first KV page hashes to (module doc; the
        key salted with the request's ``cache_salt``, as prefill keys its pages) if
        that one's queue is at most ``slack_tokens`` longer than the least loaded one's, else the
        least loaded. A prompt with no full page before its last token (nothing any cache could
        reuse), instances that report no page size or no prefix cache, or ``slack_tokens`` 0: the
        least loaded."""
        live = self.of_role("prefill")
        least = _least_loaded(live)
        if least is None or slack_tokens <= 0:
            return least
        candidates = [m for m in live if m.hb.prefix_cache is not None and 0 < m.hb.page_size < len(input_ids)]
        if not candidates:
            return least
        first_page_keys: dict[int, bytes] = {}  # by page size: instances may differ, the key is hashed once per size
        for m in candidates:
            if m.hb.page_size not in first_page_keys:
                (first_page_keys[m.hb.page_size],) = page_keys(input_ids[: m.hb.page_size], m.hb.page_size, cache_salt)
        preferred = max(candidates, key=lambda m: (affinity_score(m.hb.instance, first_page_keys[m.hb.page_size]), m.hb.instance))
        return preferred if preferred.queued_tokens <= least.queued_tokens + slack_tokens else least


def _least_loaded(prefill: list[Member]) -> Member | None:
    """The prefill instance with the fewest queued input tokens."""
    return min(prefill, key=lambda m: (m.queued_tokens, m.hb.instance), default=None)


def affinity_score(instance: str, first_page_key: bytes) -> bytes:
    """Rendezvous score of a prefill instance for a prompt whose first KV page has key
    ``first_page_key`` (``shared.prefix_keys.page_keys``): the highest wins."""
    return hashlib.blake2b(first_page_key + instance.encode(), digest_size=8).digest()
