"""Messages between moebus services (msgpack on the wire, DESIGN §2).

Times that cross processes are absolute Unix times in seconds (`deadline`), so that
every hop can compute what is left of the request's budget without carrying a
start time around.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from schemas.api import ErrorCode, FinishReason
from schemas.transfer import KVTransferDescriptor


class SamplingSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Resolved sampling parameters (the gateway filled in every default)."""

    temperature: float  # 0 = greedy
    top_p: float
    top_k: int  # 0 = no top-k cut
    seed: int | None  # None: nondeterministic
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = none
    min_p: float = 0.0  # 0 = none
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, sorted by id
    min_tokens: int = 0  # the ending tokens are banned until this many tokens were generated


class Job(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Everything every stage needs to know about one request."""

    request_id: str
    gateway: str  # gateway id: token batches go to tok.<gateway>.<request_id>
    input_ids: list[int]
    max_tokens: int
    sampling: SamplingSpec
    stop_token_ids: list[int]  # EOS ids of the model and the request's stop_token_ids; stop strings are the gateway's business
    logprobs: bool
    deadline: float  # Unix time after which nobody works on this request any more
    top_logprobs: int = 0  # with logprobs: the most likely tokens to report at each position
    ignore_eos: bool = False  # the model's EOS ids end nothing (they are then not in stop_token_ids either)
    prompt_logprobs: int = -1  # -1: none; else the prompt tokens' logprobs with this many alternatives
    cache_salt: str | None = None  # the request's: its prompt's prefix-cache keys are salted with it (shared.prefix_keys)
    priority: int = 0  # the request's: under the scheduler's "priority" policy, lower is placed first


class SubmitJob(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    job: Job
    # Unix time after which the gateway no longer waits for the first answer (it has answered its
    # client `unavailable`): a scheduler that gets to the submit later (it was stalled) refuses it
    # instead of placing work nobody reads. Once it answered `queued_by`, the request's deadline
    # bounds the wait instead. 0: no bound.
    reply_by: float = 0.0


class Placement(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    decode_instance: str
    decode_rank: int
    prefill_instance: str


class SubmitAck(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The scheduler's answer: placed (prefill task sent), or a typed refusal. A scheduler that cannot
    place the request at once first answers that it queued it (`queued_by`, neither placement nor error),
    on the same reply subject: the final answer follows when capacity comes, or at the request's deadline."""

    request_id: str
    placement: Placement | None = None
    error_code: ErrorCode | None = None
    error_message: str = ""
    queued_by: str = ""  # an interim answer: the instance id of the scheduler holding the request in its queue


class ReserveKV(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Ask a decode rank to hold KV pages for prompt + completion until `lease_until`."""

    request_id: str
    gateway: str  # told when the lease expires unused
    prompt_tokens: int  # KV that prefill will write
    max_tokens: int  # room the decode rank keeps for the completion
    lease_until: float  # Unix time; the rank frees the pages if StartDecode has not come by then
    # Unix time after which the scheduler no longer waits for the answer: a rank that gets to the
    # request later refuses it, as a reservation made then would be held for nobody. 0: no bound.
    reply_by: float = 0.0
    # The request's deadline (Unix time): a lease that ends at it ends the request as `timeout`.
    # 0: unknown (an older scheduler).
    deadline: float = 0.0


class KVReservation(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    request_id: str
    ok: bool
    descriptor: KVTransferDescriptor | None = None  # where prefill ranks write the KV (when ok)
    reason: str = ""  # why not (when not ok)


class PrefillTask(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    job: Job
    placement: Placement
    descriptor: KVTransferDescriptor


class StartDecode(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Prefill -> decode rank: the KV is (being) written, here is the first token."""

    job: Job
    first_token: int
    first_logprob: float | None
    generator_state: bytes | None  # the seeded sampler's state after the first token (reproducibility)


class TopCandidates(msgspec.Struct, forbid_unknown_fields=True, array_like=True):
    """The most likely tokens at one position, most likely first, with their log-probabilities."""

    token_ids: list[int]
    logprobs: list[float]


class TokenBatch(msgspec.Struct, forbid_unknown_fields=True, tag="tokens", tag_field="type", kw_only=True):
    """Tokens `start .. start+len(token_ids)-1` of a request's completion."""

    request_id: str
    start: int  # index of token_ids[0] in the completion (prefill sends 0, decode 1, 2, ...)
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[TopCandidates] | None = None  # per token, when the job asks for top_logprobs
    prompt_logprobs: list[float] | None = None  # prefill's batch, when the job asks: prompt tokens 1.. given the ones before
    prompt_top_logprobs: list[TopCandidates] | None = None  # and their alternatives (prompt_logprobs > 0)
    finish_reason: FinishReason | None = None  # set on the last batch of the request
    compute_ms: float = 0.0  # model time spent producing these tokens (prefill pass / decode steps)
    cached_tokens: int = 0  # prefill's batch: prompt tokens whose KV came from the prefix cache (not computed)


class StageError(msgspec.Struct, forbid_unknown_fields=True, tag="error", tag_field="type", kw_only=True):
    """A stage gave up on a request; terminal for the gateway."""

    request_id: str
    code: ErrorCode
    message: str
    stage: str  # e.g. "decode:d0/1"


TokenMessage = TokenBatch | StageError

Role = Literal["gateway", "scheduler", "prefill", "decode"]


class TransferStats(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """KV transfers since start: a decode rank's receiver (whole requests), or a prefill
    instance's senders (every rank's shards, summed; reported by its leader)."""

    completed: int = 0
    bytes_total: int = 0
    seconds_total: float = 0.0  # summed wall time of the completed transfers
    failures: dict[str, int] = {}  # by cause: peer_failed, lease_expired, timeout, cancelled, ...


class PrefixCacheStats(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A prefill instance's prefix cache since start (its leader's; every rank decides alike)."""

    lookups: int = 0  # requests that looked for cached pages (not those asking for prompt logprobs)
    hits: int = 0  # of them, requests that reused at least one page
    lookup_tokens: int = 0  # prompt tokens of the looked-up requests
    hit_tokens: int = 0  # of them, tokens whose KV came from the cache
    evictions: int = 0  # cached pages evicted to make room
    cached_pages: int = 0  # pages holding a cached prefix now (held by requests or evictable)
    evictable_pages: int = 0  # of them, pages no request holds


class LatencySummary(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Percentiles over the latest ``count`` samples of a gateway's window of finished requests."""

    count: int
    p50_ms: float
    p90_ms: float
    p99_ms: float


class Histogram(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Observations since start in fixed buckets, as Prometheus keeps them: ``buckets[i]`` counts
    the observations <= ``bounds[i]`` (cumulative, so non-decreasing); ``count`` counts them all
    (the ``+Inf`` bucket) and ``sum`` adds them up."""

    bounds: list[float]  # upper bounds, ascending, without +Inf
    buckets: list[int]  # one cumulative count per bound
    count: int = 0
    sum: float = 0.0


class RequestStats(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A gateway's requests since it started: every final reply counted once, by outcome,
    latency percentiles over its most recent finished requests, and histograms of every
    finished request since start (services/gateway/stats.py has their bucket bounds)."""

    outcomes: dict[str, int] = {}  # finished: "stop" / "length"; failed: the error code (overloaded, timeout, ...)
    prompt_tokens: int = 0  # of finished requests
    completion_tokens: int = 0
    ttft: LatencySummary | None = None  # arrival to first token
    tpot: LatencySummary | None = None  # per output token after the first (requests of 2+ tokens)
    ttft_seconds: Histogram | None = None  # arrival to first token
    tpot_seconds: Histogram | None = None  # a request's mean time per output token after the first (2+ tokens)
    e2e_seconds: Histogram | None = None  # arrival to final reply
    queue_seconds: Histogram | None = None  # arrival to placement by a scheduler (Timing.queue_ms)
    prompt_tokens_per_request: Histogram | None = None
    completion_tokens_per_request: Histogram | None = None
    itl_seconds: Histogram | None = None  # each gap between a request's token arrivals after the first
    prefill_seconds: Histogram | None = None  # placement to first token (Timing.ttft_ms - queue_ms)
    decode_seconds: Histogram | None = None  # first token to last


class Heartbeat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Published ~2 Hz on ctl.heartbeat.<role>.<instance>.<rank>; the registry is built from these."""

    role: Role
    instance: str
    rank: int
    model: str
    version: str
    started_at: float
    draining: bool = False  # takes no new work, finishing what it has
    # decode ranks
    kv_total_pages: int = 0
    kv_free_pages: int = 0  # pages neither in use nor reserved
    page_size: int = 0
    batch_size: int = 0  # running + reserved requests
    max_batch: int = 0
    decode_steps: dict[str, int] = {}  # this rank's decode forwards by path: graph_replay, graph_capture, eager
    # model ranks (decode ranks, prefill leaders)
    transfer: TransferStats | None = None
    # prefill instances
    queued_tokens: int = 0  # input tokens queued or running
    queued_requests: int = 0
    prefix_cache: PrefixCacheStats | None = None
    prefill_queue_seconds: Histogram | None = None  # the leader's: each task's wait from arrival until a batch takes it
    # schedulers
    suspect_ranks: list[str] = []  # decode ranks ("instance/rank") skipped after a missed reservation reply
    # gateways
    in_flight: int = 0
    requests: RequestStats | None = None


class Cancel(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """ctl.cancel fan-out: every stage drops the request and frees what it holds for it.

    With ``stage`` set (a name as in ``StageError.stage``), only that stage frees what it holds
    for the request and nobody else acts on it: the request goes on elsewhere (a scheduler
    releasing a reservation it stopped waiting for). Defaults are not encoded, so a cancel
    without ``stage`` is the same bytes as before the field existed.
    """

    request_id: str
    reason: str
    stage: str = ""
    # Set by a prefill releasing a reservation whose KV it sent in full (the request ended at its
    # first token): the decode rank lets that KV land, a completed transfer, before freeing it.
    kv_sent: bool = False
