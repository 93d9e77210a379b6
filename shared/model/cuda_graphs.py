"""Decode steps as CUDA-graph replays, one graph per (batch bucket, page bucket).

A decode step feeds one token per sequence, so with a fixed number of rows ``B`` and
page-table width ``P`` its forward has static shapes (attention gathers ``[B, P]``
pages and masks by ``context_lens``). `DecodeGraphs` keeps the inputs of such a
forward in static device buffers sized for the largest bucket and captures, on first
use of a bucket, ``Qwen3Model.forward`` over views of their first rows. A step with
``b`` sequences needing ``p`` pages is copied into the smallest bucket holding it,
the graph replayed, and the first ``b`` rows of the logits returned; sampling stays
outside the graph.

Padding never touches a real sequence's KV: padded rows (token 0 at position 0) write
their K/V to a scratch page reserved from the allocator for the life of the object,
and every padded page-table entry, of padded rows and of real ones, names that page
(attention masks them by ``context_lens``). Padded rows are real tokens to the MoE
layers (routed, computed, discarded), and a rank of a DP x EP group with no
sequences replays the smallest bucket with padding only, so that its expert
all-to-all still takes part in the step.

Capture happens in the step that first uses a bucket: its forward runs eagerly on the
static buffers (compiling kernels and setting up libraries outside the graph; these
are that step's logits) and is then captured, which records without running, so every
rank still runs exactly one forward per step. All graphs draw memory from one shared
pool; they never run concurrently and each output is copied out before the next
replay. At most ``max_graphs`` are captured; a step outside the buckets, or needing a
new bucket beyond that bound, runs the plain eager forward (logged once per cause).

A capture that raises is logged and leaves that bucket to the eager forward; the step
that tried keeps the logits of its eager run.

``capture=False`` runs the same padded forward eagerly on the same static buffers,
on any device: the CPU tests compare it with the unpadded step.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import Protocol

import torch

from shared.kvcache import PagedKVCache
from shared.model import layers as ops
from shared.model.model import ForwardBatch, Qwen3Model, SequenceChunk

# Rows of the per-step field buffer, one column per batch row.
TOKEN, POSITION, SLOT_PAGE, SLOT_OFFSET, CONTEXT_LEN = range(5)
NUM_FIELDS = 5


class ForwardPath(enum.Enum):
    REPLAY = "graph_replay"  # a captured graph ran
    CAPTURE = "graph_capture"  # first use of a bucket: padded eager forward, then captured
    EAGER = "eager"  # outside the buckets or past the graph bound: the plain forward


class EventLog(Protocol):
    """Where `DecodeGraphs` reports its events: a structlog logger in the services. The model
    runtime itself does not import structlog (GPU machines run it without)."""

    def info(self, event: str, **fields: object) -> None: ...
    def warning(self, event: str, **fields: object) -> None: ...
    def error(self, event: str, **fields: object) -> None: ...


class StdlibEventLog:
    """`EventLog` over the standard library's logging (the default outside the services)."""

    def __init__(self) -> None:
        self._log = logging.getLogger(__name__)

    def info(self, event: str, **fields: object) -> None:
        self._log.info("%s %s", event, fields)

    def warning(self, event: str, **fields: object) -> None:
        self._log.warning("%s %s", event, fields)

    def error(self, event: str, **fields: object) -> None:
        self._log.error("%s %s", event, fields)


def powers_of_two_up_to(limit: int) -> list[int]:
    """1, 2, 4, ... below ``limit``, then ``limit`` itself."""
    if limit < 1:
        raise ValueError(f"bucket limit must be >= 1, got {limit}")
    sizes, n = [], 1
    while n < limit:
        sizes.append(n)
        n *= 2
    return [*sizes, limit]


def smallest_bucket(buckets: Sequence[int], n: int) -> int | None:
    """The smallest bucket holding ``n`` (None when none does)."""
    return next((b for b in buckets if b >= n), None)


def graphs_unsupported(model: Qwen3Model) -> str | None:
    """Why this model's decode forward cannot be captured (None when it can)."""
    topo = model.topology
    if model.device.type != "cuda":
        return f"the model is on {model.device.type}, graphs are CUDA only"
    if not model.kernels:
        return "the model runs the torch reference ops (MOEBUS_KERNELS=reference), whose MoE syncs with the host"
    if model.config.is_moe and model.moe_reference_reason is not None:
        return f"the experts run the reference ops ({model.moe_reference_reason})"
    if topo.tp_size > 1 and not model.comm.all_reduce_in_graphs:
        return f"the tensor-parallel all-reduce ({type(model.comm).__name__}) cannot be captured"
    if topo.ep_size > 1 and not topo.inputs_replicated and model.decode_moe is None:
        return "the expert all-to-all runs over NCCL with sizes known on the host"
    return None


class DecodeGraphs:
    """Static decode inputs and the captured graphs of one rank (see the module doc)."""

    def __init__(self, model: Qwen3Model, cache: PagedKVCache, max_batch: int, max_graphs: int, capture: bool = True, log: EventLog | None = None) -> None:
        if capture and (reason := graphs_unsupported(model)) is not None:
            raise ValueError(f"CUDA graphs unavailable: {reason}")
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
        layout = cache.layout
        self.model, self.cache, self.capture, self.max_graphs = model, cache, capture, max_graphs
        self.log = log if log is not None else StdlibEventLog()
        self.page_size = layout.page_size
        # Reserved for good: the allocator never hands it to a sequence.
        self.scratch_page = cache.allocator.alloc(1)[0]
        longest = min(layout.pages_for(model.config.max_position_embeddings), layout.num_pages - 1)
        self.batch_buckets = powers_of_two_up_to(max_batch)
        self.page_buckets = powers_of_two_up_to(max(1, longest))
        device, bmax = cache.device, self.batch_buckets[-1]
        self._fields = torch.zeros((NUM_FIELDS, bmax), dtype=torch.long, device=device)
        self._rows = torch.arange(bmax, device=device)  # last_token and token_seq: one token per row
        self._ones = torch.ones(bmax, dtype=torch.long, device=device)
        self._zeros = torch.zeros(bmax, dtype=torch.long, device=device)
        self._tables: dict[int, torch.Tensor] = {}  # page bucket -> [bmax, pages], made before any capture using it
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph | None] = {}  # None: bucket prepared, capture=False
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._stream = torch.cuda.Stream(device) if capture else None
        self._failed: set[tuple[int, int]] = set()  # buckets whose capture raised: eager from then on
        self._logged_fallbacks: set[str] = set()
        self.counts: Counter[ForwardPath] = Counter()
        self.last_path: ForwardPath | None = None

    def forward(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor:
        """Logits ``[len(chunks), V]`` of a decode step (one new token per chunk)."""
        if any(len(c.token_ids) != 1 for c in chunks):
            raise ValueError("a graphed decode step takes exactly one new token per sequence")
        pages = max((self.cache.layout.pages_for(c.start + 1) for c in chunks), default=1)
        bucket = (smallest_bucket(self.batch_buckets, max(1, len(chunks))), smallest_bucket(self.page_buckets, pages))
        if bucket[0] is None or bucket[1] is None:
            return self._eager(chunks, "outside the buckets", batch=len(chunks), max_batch=self.batch_buckets[-1],
                               pages=pages, max_pages=self.page_buckets[-1])
        if bucket in self._failed:
            return self._eager(chunks, "capture failed", batch_bucket=bucket[0], page_bucket=bucket[1])
        known = bucket in self._graphs
        if not known and len(self._graphs) >= self.max_graphs:
            return self._eager(chunks, "graph bound reached", max_graphs=self.max_graphs, batch_bucket=bucket[0], page_bucket=bucket[1])
        batch = self._fill(chunks, *bucket)
        if not known:
            return self._done(ForwardPath.CAPTURE, self._first_use(bucket, batch), len(chunks))
        graph = self._graphs[bucket]
        if graph is None:  # capture=False
            return self._done(ForwardPath.REPLAY, self.model.forward(batch, self.cache), len(chunks))
        with torch.cuda.device(self.cache.device):  # on this device's current stream, after the input copies
            graph.replay()
        return self._done(ForwardPath.REPLAY, self._outputs[bucket], len(chunks))

    def _done(self, path: ForwardPath, logits: torch.Tensor, rows: int) -> torch.Tensor:
        """The step's first ``rows`` logits, copied out of the static output before any other replay."""
        self.counts[path] += 1
        self.last_path = path
        return logits[:rows].clone()

    def _eager(self, chunks: Sequence[SequenceChunk], cause: str, **detail: int) -> torch.Tensor:
        if cause not in self._logged_fallbacks:  # once per cause: a busy rank would repeat it every step
            self._logged_fallbacks.add(cause)
            self.log.warning("decode_graph.eager_fallback", reason=cause, **detail)
        batch = ForwardBatch.build(chunks, self.page_size, self.cache.device)
        self.counts[ForwardPath.EAGER] += 1
        self.last_path = ForwardPath.EAGER
        return self.model.forward(batch, self.cache)

    def _fill(self, chunks: Sequence[SequenceChunk], rows: int, pages: int) -> ForwardBatch:
        """Copy the step's inputs into the static buffers (padding to the bucket); the bucket's batch of views."""
        ps, scratch, pages_for = self.page_size, self.scratch_page, self.cache.layout.pages_for
        # Host lists, then one copy per buffer. Padded rows: token 0 at position 0, its K/V and
        # every padded table entry on the scratch page, seeing its own key only.
        fields = [[0] * rows, [0] * rows, [scratch] * rows, [0] * rows, [1] * rows]
        table = [[scratch] * pages for _ in range(rows)]
        for b, c in enumerate(chunks):
            need = pages_for(c.start + 1)
            if len(c.page_table) < need:
                raise ValueError(f"sequence {b}: page table has {len(c.page_table)} pages, {need} needed for {c.start + 1} tokens")
            for row, value in zip(fields, (c.token_ids[0], c.start, c.page_table[c.start // ps], c.start % ps, c.start + 1)):
                row[b] = value
            table[b][:need] = c.page_table[:need]
        if pages not in self._tables:
            self._tables[pages] = torch.full((self._rows.shape[0], pages), scratch, dtype=torch.long, device=self.cache.device)
        self._fields[:, :rows].copy_(torch.tensor(fields))
        self._tables[pages][:rows].copy_(torch.tensor(table))
        f = self._fields
        return ForwardBatch(
            token_ids=f[TOKEN, :rows], positions=f[POSITION, :rows], slot_pages=f[SLOT_PAGE, :rows],
            slot_offsets=f[SLOT_OFFSET, :rows], last_token=self._rows[:rows],
            attn=ops.AttentionMetadata(page_tables=self._tables[pages][:rows], context_lens=f[CONTEXT_LEN, :rows],
                                       query_lens=self._ones[:rows], token_seq=self._rows[:rows], token_idx=self._zeros[:rows], max_q=1),
        )

    def _first_use(self, bucket: tuple[int, int], batch: ForwardBatch) -> torch.Tensor:
        """This step's logits from an eager forward over the static buffers; then capture it (recording only)."""
        if not self.capture:
            self._graphs[bucket] = None
            return self.model.forward(batch, self.cache)
        with torch.cuda.device(self.cache.device):
            return self._capture(bucket, batch)

    def _capture(self, bucket: tuple[int, int], batch: ForwardBatch) -> torch.Tensor:
        started = time.perf_counter()
        current = torch.cuda.current_stream()
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            logits = self.model.forward(batch, self.cache)  # first launches (compilation, library set-up) outside the graph
        logits.record_stream(current)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the event loop's thread may use CUDA (KV transfers) while this one captures.
            with torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
                out = self.model.forward(batch, self.cache)
        except Exception as e:  # an op that cannot be captured: this step's logits stand, the bucket runs eagerly
            self._failed.add(bucket)
            self.log.error("decode_graph.capture_failed", batch_bucket=bucket[0], page_bucket=bucket[1], error=f"{type(e).__name__}: {e}")
            return logits
        finally:
            current.wait_stream(self._stream)
        self._graphs[bucket], self._outputs[bucket] = graph, out
        self.log.info("decode_graph.captured", batch_bucket=bucket[0], page_bucket=bucket[1], seconds=round(time.perf_counter() - started, 3),
                 graphs=len(self._graphs), pool_bytes=self.pool_bytes())
        return logits

    def pool_bytes(self) -> int:
        """Bytes the graphs' shared memory pool holds on the device (its allocator segments)."""
        if self._pool is None:
            return 0
        index = self.cache.device.index if self.cache.device.index is not None else torch.cuda.current_device()
        return sum(s["total_size"] for s in torch.cuda.memory_snapshot()
                   if s["device"] == index and tuple(s.get("segment_pool_id", ())) == tuple(self._pool))

    def stats(self) -> dict[str, int]:
        """Forwards by path and graphs captured (for logs)."""
        return {**{p.value: self.counts[p] for p in ForwardPath}, "graphs": sum(g is not None for g in self._graphs.values())}
