"""Warm-up of a model rank before it reports ready: dummy work through the serving code paths.

The first forward of each shape bucket compiles CuTeDSL kernels (~6 s on 2x H200 for
the first batch of an instance); a rank that said ready before that would make its
first users wait. So a rank runs, before its first heartbeat,

* prefill: one forward over a short prompt and, for MoE models, one over a prompt just
  long enough that the grouped GEMM's token count per local expert passes each bound of
  its tile buckets (`kernels.grouped_gemm.tile_bucket_bounds`: past 64 the 128-row tiles,
  past 512 the widest bf16 tiles for small experts and FP8's TMA-stored tiles; for MXFP8
  experts also past 8, 16 and 32, the swapped decode tiles' token counts), so every bucket a batch can reach is compiled before
  the first request — a forward is skipped when no real batch could reach its bucket
  (`max_batch_tokens`, KV pages); with prefill CUDA graphs (`shared.model.prefill_graphs`),
  one over a prompt of each token bucket's size as well, each twice: the first captures the
  bucket's pieces (unless a shorter prompt in the bucket did), the second replays them;
* decode: lockstep steps (`services.decode.lockstep.Lockstep`, the step loop's own
  path) over a batch of one sequence and over a full batch of `max_batch` (or as many
  sequences of 2 tokens as the KV pages hold, the most a real step can carry), and for MoE
  models the first batch past each tile-bucket bound below it: the contiguous layout's
  three buckets, and the two ends of the masked layout of a DP x EP instance (its tiles
  picked from the rows a step brings each expert, its dispatch/combine sized by
  `max_batch`). With
  CUDA graphs (`shared.model.cuda_graphs`), every batch bucket up to that largest batch
  instead, each twice: the first step captures the bucket's graph (page bucket 1; longer
  contexts capture theirs on first use), the second replays it.

Before either, the paged decode attention kernels are compiled
(`shared.model.layers.prepare_decode_attention`): decode runs them, and so does a prefill batch of
few new tokens per sequence (a prefix-cache hit with a short suffix,
`shared.model.layers.prefill_attention_route`); the warm-up's short contexts would not reach the
combine of split long contexts.

The ranks of an instance run it together: every step is collective (TP all-reduces,
the expert all-to-all, the lockstep's all-reduce), and every rank derives the same
steps from the same settings and checkpoint.

Nothing is left behind: the dummy sequences are greedy (no random draw: a seeded
request's tokens and the shared sampling stream are unchanged), the KV they wrote is
zeroed (the cache is as loaded, but for the graphs' scratch page, which no sequence
reads) and their pages freed, and no heartbeat, request or transfer counter exists yet
to count them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from kernels.grouped_gemm import tile_bucket_bounds
from services.decode.lockstep import GroupState, Lockstep
from shared.logging import get_logger
from shared.model.config import Mxfp8Quantization
from shared.model.kv_budget import dummy_tokens
from shared.model.layers import prepare_decode_attention
from shared.model.runner import ModelRunner, SequenceState
from shared.model.sampling_params import SamplingParams
from shared.settings import DecodeSettings, PrefillSettings

log = get_logger(__name__)

SHORT_PROMPT_TOKENS = 16  # a typical short prompt (and the decode-sized GEMM bucket)
GREEDY = SamplingParams(temperature=0.0, max_tokens=2)  # greedy: draws nothing from any generator


class WarmupFailed(RuntimeError):
    """The rank could not run its warm-up; it must not report ready."""


def prefill_warmup_lengths(runner: ModelRunner, max_batch_tokens: int) -> list[int]:
    """Prompt lengths of the prefill warm-up forwards (see the module docstring)."""
    layout = runner.cache.layout
    fits = min(max_batch_tokens, runner.cache.allocator.num_free * layout.page_size)
    short = min(SHORT_PROMPT_TOKENS, fits)
    graphs = runner.prefill_graphs
    buckets = [b for b in graphs.buckets if b <= fits] if graphs is not None else []
    return sorted({short, *buckets, *(n for n in tokens_past_tile_bounds(runner) if short < n <= fits)})


def tokens_past_tile_bounds(runner: ModelRunner) -> list[int]:
    """For each grouped-GEMM tile-bucket bound, the fewest tokens of a forward whose rows per
    local expert pass it (none for a dense model). Inputs are replicated over the TP group:
    each rank's local experts see all T tokens, T * top_k rows over experts_per_rank groups."""
    config = runner.model.config
    if not config.is_moe:
        return []
    bounds = tile_bucket_bounds(isinstance(config.quantization, Mxfp8Quantization))
    return [bound * runner.model.experts_per_rank // config.top_k + 1 for bound in bounds]


def decode_warmup_batches(runner: ModelRunner, max_batch: int) -> list[int]:
    """Batch sizes of the decode warm-up steps: 1 and the largest batch a real step can reach
    (`max_batch`, or fewer when the free KV pages cannot hold that many sequences of 2 tokens),
    the first batch past each tile-bucket bound below it (a sequence brings one token a step);
    with CUDA graphs, every graph batch bucket up to that largest batch as well."""
    layout, free = runner.cache.layout, runner.cache.allocator.num_free
    largest = min(max_batch, free // layout.pages_for(2))
    if largest < 1:
        raise _failed(
            "decode",
            f"kv_pages={layout.num_pages} of page_size={layout.page_size} cannot hold one sequence of 2 tokens "
            f"(a prompt token and a generated one) in its {free} free pages: this decode rank could serve no request",
        )
    graphs = runner.decode_graphs
    buckets = [b for b in graphs.batch_buckets if b <= largest] if graphs is not None else []
    past_bounds = [b for b in tokens_past_tile_bounds(runner) if b < largest]
    return sorted({1, largest, *past_bounds, *buckets})


class Borrowed:
    """The dummy sequences of one warm-up step and the KV pages they hold."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.seqs: list[SequenceState] = []
        self.pages: list[int] = []

    def add(self, seq_id: str, prompt: list[int], output_ids: Sequence[int] = ()) -> SequenceState:
        """A greedy sequence whose pages cover its prompt, outputs and the next token (the
        runner allocates nothing more, so every page it writes is in `pages`)."""
        cache = self.runner.cache
        pages = cache.allocator.alloc(cache.layout.pages_for(len(prompt) + len(output_ids)))
        self.pages.extend(pages)
        num_cached = len(prompt) if output_ids else 0
        seq = self.runner.add(seq_id, prompt, GREEDY, page_table=pages, num_cached=num_cached, output_ids=output_ids)
        self.seqs.append(seq)
        return seq

    def give_back(self) -> None:
        """Zero the KV written into the pages and free them (the runner may have freed some)."""
        if self.pages:
            self.runner.cache.storage[:, self.pages] = 0
        for seq in reversed(self.seqs):
            self.runner.release(seq)


Step = Callable[[Borrowed], None]


def warm_up_prefill(runner: ModelRunner, settings: PrefillSettings) -> None:
    """Prefill forwards over dummy prompts (every rank of the TP group, same order)."""
    vocab = runner.model.config.vocab_size
    _prepare_decode_attention(runner)

    def forward(i: int, n: int) -> Step:
        def run(borrowed: Borrowed) -> None:
            runner.prefill([borrowed.add(f"warmup-prefill-{i}", dummy_tokens(n, vocab, offset=i))])

        return run

    lengths = prefill_warmup_lengths(runner, settings.max_batch_tokens)
    buckets = runner.prefill_graphs.buckets if runner.prefill_graphs is not None else []
    # A graph bucket's length runs twice: its pieces captured (by it, or by a shorter length in the bucket),
    # then replayed, before the rank reports ready.
    phases = {n: ("", "_replay") if n in buckets else ("",) for n in lengths}
    _run("prefill", runner, [(f"prefill_{n}_tokens{phase}", forward(i, n)) for i, n in enumerate(lengths) for phase in phases[n]])


def warm_up_decode(runner: ModelRunner, settings: DecodeSettings, world: int) -> None:
    """Lockstep decode steps over dummy batches (every rank of the DP group, same order).

    Each dummy sequence holds a 1-token prompt as if its KV had arrived (zeros in a fresh
    cache) and its first token, so the step feeds one token per sequence like a real one.
    """
    lockstep = Lockstep(runner, world)
    vocab = runner.model.config.vocab_size
    _prepare_decode_attention(runner)

    def step(batch: int) -> Step:
        def run(borrowed: Borrowed) -> None:
            prompts, firsts = dummy_tokens(batch, vocab), dummy_tokens(batch, vocab, offset=1)
            seqs = [borrowed.add(f"warmup-decode-{i}", [prompts[i]], output_ids=[firsts[i]]) for i in range(batch)]
            result = lockstep.step(seqs, want_exit=False)
            if result.state is not GroupState.STEPPED:
                raise _failed("decode", f"the group did not step the warm-up batch ({result.state.value})")

        return run

    steps = [(f"decode_batch_{b}", step(b)) for b in decode_warmup_batches(runner, settings.max_batch)]
    if runner.decode_graphs is not None:  # capture, then replay each bucket's graph before reporting ready
        steps = [(f"{name}_{phase}", run) for name, run in steps for phase in ("capture", "replay")]
    _run("decode", runner, steps)


def _prepare_decode_attention(runner: ModelRunner) -> None:
    """Compile the paged decode attention kernels the model's attention may run (module doc)."""
    model = runner.model
    if model.kernels:
        prepare_decode_attention(model.heads.num_q, model.local_kv_heads, model.config.head_dim, runner.cache.layout.page_size,
                                 model.dtype, runner.cache.device)


def _run(service: str, runner: ModelRunner, steps: Sequence[tuple[str, Step]]) -> None:
    """Run `steps` in order, giving their pages back after each (also on failure); log the time."""
    started = time.perf_counter()
    timings: dict[str, float] = {}
    for name, step in steps:
        t0 = time.perf_counter()
        borrowed = Borrowed(runner)
        try:
            step(borrowed)
        except WarmupFailed:
            raise
        except Exception as e:
            raise _failed(service, f"step {name} failed: {type(e).__name__}: {e}", step=name) from e
        finally:
            borrowed.give_back()
        timings[name] = round(time.perf_counter() - t0, 3)
    if runner.cache.device.type == "cuda":
        torch.cuda.synchronize(runner.cache.device)  # compiled and run, not just queued
    log.info("warmup.done", duration_s=round(time.perf_counter() - started, 3), steps=timings)


def _failed(service: str, reason: str, **fields: object) -> WarmupFailed:
    """Log `warmup.failed` and return the error to raise."""
    error = WarmupFailed(f"{service} warm-up: {reason}")
    log.error("warmup.failed", error=str(error), **fields)
    return error
