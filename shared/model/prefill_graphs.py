"""Prefill forwards as piecewise CUDA graphs, one set of pieces per token bucket.

An eager prefill of a short prompt is bound by the host: each layer issues ~25 torch ops
and ten kernel launches (~0.5 ms of host time a layer with FP8 experts on an H200 host,
README's "Known gaps"), longer than the GPU needs for them under ~2k tokens. A prefill's
attention cannot be one graph over a token bucket, as its shape is the batch's sequences
and their cached prefixes; everything else in a layer depends only on the token count.
So, as vLLM's piecewise graphs do, each layer is cut around its attention
(`Qwen3Model.hidden_states` names the cuts):

* piece 0: `Qwen3Model.embed` and layer 0's `attention_input` (q/k/v GEMM, norms, RoPE, the
  K/V store);
* piece i (1 <= i < L): layer i-1's `layer_output` (o_proj, residual adds and norms, the
  router and experts or the dense MLP) and layer i's `attention_input`;
* piece L: layer L-1's `layer_output`, ending in the final norm.

Each piece is captured once per token bucket and replayed; between pieces the layer's
attention runs eagerly over the batch's real rows (`Qwen3Model.attend`, with the batch's
own metadata), reading the queries from a static buffer the piece wrote and writing its
output into another that the next piece reads. A forward of ``T`` tokens is padded to the
smallest bucket holding it (`prefill_token_buckets`); one above the largest bucket runs the
plain eager forward, where the GPU, not the host, bounds it.

Padding never reaches a real row or the experts: padded rows (token 0 at position 0) write
their K/V to a scratch page reserved from the allocator for the life of the object, are
left out of attention (it runs over the real rows only) and are routed to no expert
(`Qwen3Model.layer_output`'s ``padded`` mask), so the grouped GEMM's groups hold the real
rows alone.

Memory: the pieces draw from one graph pool. A piece's residual stream is kept alive only
until the next piece is captured (which reads it), so later captures reuse that memory;
this is sound because pieces run in the order they were captured, one at a time, on one
stream. The queries and attention outputs live in static buffers outside the pool, sized
for the largest bucket; only a bucket's final hidden state and RoPE angles stay in the pool.
The hidden states a forward returns are copied out of the pool before any other replay.

Capture happens on a bucket's first use: the forward runs eagerly over the static buffers
(compiling kernels outside any graph; this step's result), then each piece is captured,
which records without running. A capture that raises is logged and leaves that bucket to
the eager forward, on every rank of a tensor-parallel group (they agree after each capture:
the eager forward all-reduces the real rows, the pieces the bucket's). ``capture=False`` runs
the same padded pieces eagerly on any device (the CPU tests compare them with the plain forward).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import torch

from shared.kvcache import PagedKVCache
from shared.model.cuda_graphs import EventLog, ForwardPath, StdlibEventLog, graphs_unsupported, powers_of_two_up_to, smallest_bucket
from shared.model.model import ForwardBatch, LayerCallback, Qwen3Model, Rope

# Rows of the static per-token field buffer, one column per token.
TOKEN, POSITION, SLOT_PAGE, SLOT_OFFSET = range(4)
NUM_FIELDS = 4
FINE_STEP = 256  # buckets above this are its multiples (powers of two below)
SMALLEST_BUCKET = 16


def prefill_token_buckets(max_tokens: int) -> list[int]:
    """Token buckets up to ``max_tokens``: 16, 32, .. 256, then multiples of 256, then ``max_tokens``.
    Padding a forward costs the dense GEMMs and norms of its padded rows: up to 2x below 256 tokens
    (host-bound there), at most 256 rows above (where the GPU starts to count)."""
    if max_tokens < 1:
        raise ValueError(f"prefill graph max tokens must be >= 1, got {max_tokens}")
    small = [b for b in powers_of_two_up_to(min(max_tokens, FINE_STEP)) if b >= min(SMALLEST_BUCKET, max_tokens)]
    large = list(range(2 * FINE_STEP, max_tokens, FINE_STEP))
    return sorted({*small, *large, max_tokens})


def prefill_graphs_unsupported(model: Qwen3Model) -> str | None:
    """Why this model's prefill pieces cannot be captured (None when they can). Under tensor parallelism
    the pieces hold the all-reduces (after o_proj, after the experts or dense MLP), which the peer-memory
    kernels (`shared.parallel_cuda.CudaCollectives`) run stream-ordered with their flags on the device."""
    topo = model.topology
    if topo.ep_size > 1 and not topo.inputs_replicated:
        return "prefill graphs run the prefill layout (inputs replicated over the expert group), not the decode layout"
    return graphs_unsupported(model)


@dataclass
class _Bucket:
    """A captured bucket: its pieces in order and the final hidden state the last one writes."""

    graphs: list[torch.cuda.CUDAGraph]
    hidden: torch.Tensor  # [rows, H]


class PrefillGraphs:
    """Static prefill inputs and the captured pieces of one rank (see the module doc)."""

    def __init__(self, model: Qwen3Model, cache: PagedKVCache, max_tokens: int, capture: bool = True, log: EventLog | None = None) -> None:
        if capture and (reason := prefill_graphs_unsupported(model)) is not None:
            raise ValueError(f"prefill CUDA graphs unavailable: {reason}")
        self.model, self.cache, self.capture = model, cache, capture
        self.log = log if log is not None else StdlibEventLog()
        self.buckets = prefill_token_buckets(max_tokens)
        # Reserved for good: the allocator never hands it to a sequence.
        self.scratch_page = cache.allocator.alloc(1)[0]
        device, rows = cache.device, self.buckets[-1]
        heads, head_dim = model.heads.num_q, model.config.head_dim
        self._fields = torch.zeros((NUM_FIELDS, rows), dtype=torch.long, device=device)
        self._padding = torch.zeros((NUM_FIELDS, rows), dtype=torch.long, device=device)  # a padded row's fields
        self._padding[SLOT_PAGE] = self.scratch_page
        self._row = torch.arange(rows, device=device)
        self._padded = torch.zeros(rows, dtype=torch.bool, device=device)
        self._q = torch.zeros((rows, heads, head_dim), dtype=model.dtype, device=device)
        self._attn_out = torch.zeros((rows, heads, head_dim), dtype=model.dtype, device=device)
        self._captured: dict[int, _Bucket | None] = {}  # None: bucket seen, capture=False
        self._failed: set[int] = set()
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._stream = torch.cuda.Stream(device) if capture else None
        self.counts: Counter[ForwardPath] = Counter()
        self.last_path: ForwardPath | None = None

    @torch.inference_mode()
    def hidden_states(self, batch: ForwardBatch, on_layer_done: LayerCallback | None = None) -> torch.Tensor:
        """`Qwen3Model.hidden_states` of ``batch`` (built by `ForwardBatch.build`): ``[T, H]``, owned by the caller."""
        tokens = batch.token_ids.shape[0]
        bucket = smallest_bucket(self.buckets, max(1, tokens))
        if bucket is None or bucket in self._failed:
            return self._eager(batch, on_layer_done)
        self._fill(batch, bucket)
        if bucket not in self._captured:
            return self._done(ForwardPath.CAPTURE, self._first_use(bucket, batch, on_layer_done), tokens)
        captured = self._captured[bucket]
        if captured is None:  # capture=False
            return self._done(ForwardPath.REPLAY, self._run(bucket, batch, on_layer_done), tokens)
        return self._done(ForwardPath.REPLAY, self._run(bucket, batch, on_layer_done, captured), tokens)

    def _eager(self, batch: ForwardBatch, on_layer_done: LayerCallback | None) -> torch.Tensor:
        self.counts[ForwardPath.EAGER] += 1
        self.last_path = ForwardPath.EAGER
        return self.model.hidden_states(batch, self.cache, on_layer_done)

    def _done(self, path: ForwardPath, hidden: torch.Tensor, tokens: int) -> torch.Tensor:
        """The real rows, copied out of the graphs' memory before any other replay."""
        self.counts[path] += 1
        self.last_path = path
        return hidden[:tokens].clone()

    def _fill(self, batch: ForwardBatch, rows: int) -> None:
        """Copy the batch's per-token fields into the static buffers, padding them to ``rows``."""
        tokens = batch.token_ids.shape[0]
        self._fields[:, :tokens].copy_(torch.stack((batch.token_ids, batch.positions, batch.slot_pages, batch.slot_offsets)))
        self._fields[:, tokens:rows].copy_(self._padding[:, : rows - tokens])
        torch.ge(self._row[:rows], tokens, out=self._padded[:rows])

    def _piece(self, index: int, rows: int, h: torch.Tensor | None, rope: Rope | None) -> tuple[torch.Tensor, torch.Tensor | None, Rope]:
        """Piece ``index`` over ``rows`` static rows: (residual stream, final hidden state after the last
        piece else None, RoPE angles). Its queries, when it has some, go to the static query buffer."""
        m, f = self.model, self._fields[:, :rows]
        if index == 0:
            h, x, rope = m.embed(f[TOKEN], f[POSITION])
        else:
            assert h is not None and rope is not None  # the previous piece's
            h, x = m.layer_output(index - 1, h, self._attn_out[:rows], self._padded[:rows])
        if index == len(m.weights.layers):
            return h, x, rope
        m.attention_input(index, x, rope, self.cache, f[SLOT_PAGE], f[SLOT_OFFSET], q_out=self._q[:rows])
        return h, None, rope

    def _attend(self, layer: int, batch: ForwardBatch, on_layer_done: LayerCallback | None) -> None:
        """Layer ``layer``'s attention over the real rows, eagerly, between two pieces."""
        tokens = batch.token_ids.shape[0]
        self._attn_out[:tokens].copy_(self.model.attend(layer, self._q[:tokens], self.cache, batch.attn))
        if on_layer_done is not None:
            on_layer_done(layer)

    def _run(self, rows: int, batch: ForwardBatch, on_layer_done: LayerCallback | None, captured: _Bucket | None = None) -> torch.Tensor:
        """A forward over the static buffers: the pieces replayed (``captured``) or run eagerly."""
        h, hidden, rope = None, None, None
        for index in range(len(self.model.weights.layers) + 1):
            if captured is not None:
                captured.graphs[index].replay()
            else:
                h, hidden, rope = self._piece(index, rows, h, rope)
            if index < len(self.model.weights.layers):
                self._attend(index, batch, on_layer_done)
        if captured is not None:
            return captured.hidden
        assert hidden is not None
        return hidden

    def _first_use(self, rows: int, batch: ForwardBatch, on_layer_done: LayerCallback | None) -> torch.Tensor:
        """This step's hidden states from an eager run over the static buffers; then the pieces captured."""
        if not self.capture:
            self._captured[rows] = None
            return self._run(rows, batch, on_layer_done)
        assert self._stream is not None
        started = time.perf_counter()
        with torch.cuda.device(self.cache.device):
            current = torch.cuda.current_stream()
            self._stream.wait_stream(current)
            with torch.cuda.stream(self._stream):  # first launches (compilation, library set-up) outside the graphs
                hidden = self._run(rows, batch, on_layer_done)
            hidden.record_stream(current)
            captured, error = None, None
            try:
                captured = self._capture(rows)
            except Exception as e:  # an op that cannot be captured: this step's result stands, the bucket runs eagerly
                error = f"{type(e).__name__}: {e}"
            finally:
                current.wait_stream(self._stream)
        # A TP group's ranks must all replay or all run eagerly: the two paths all-reduce different row counts.
        if not self.model.comm.all_agree(error is None):
            self._failed.add(rows)
            self.log.error("prefill_graph.capture_failed", token_bucket=rows, error=error or "failed on another rank of the group")
            return hidden
        self._captured[rows] = captured
        self.log.info("prefill_graph.captured", token_bucket=rows, pieces=len(self.model.weights.layers) + 1,
                      seconds=round(time.perf_counter() - started, 3), buckets=len(self._captured))
        return hidden

    def _capture(self, rows: int) -> _Bucket:
        graphs: list[torch.cuda.CUDAGraph] = []
        h, hidden, rope = None, None, None
        for index in range(len(self.model.weights.layers) + 1):
            graph = torch.cuda.CUDAGraph()
            # thread_local: the event loop's thread may use CUDA (KV transfers) while this one captures.
            with torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
                # The previous residual stream is dropped once this piece (its only reader) is captured.
                h, hidden, rope = self._piece(index, rows, h, rope)
            graphs.append(graph)
        assert hidden is not None
        return _Bucket(graphs, hidden)

    def stats(self) -> dict[str, int]:
        """Forwards by path and buckets captured (for logs)."""
        return {**{p.value: self.counts[p] for p in ForwardPath}, "buckets": sum(b is not None for b in self._captured.values())}
