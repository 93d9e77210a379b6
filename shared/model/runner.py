"""ModelRunner: the model, its paged KV cache and the sampler, stepping a changing batch.

Used by the offline generator and by the services' prefill and decode ranks (no
messaging in here). A `SequenceState` holds one request's tokens, page table,
how many of its tokens are already in the cache, its sampling parameters and
its own generator. Each `step` feeds every sequence the tokens it has not cached
yet (the whole prompt on prefill, the last sampled token on decode), allocates
the pages they need all-or-nothing (`OutOfPages` leaves nothing allocated),
runs one forward and samples one token per sequence. Sequences may join or
leave between steps (continuous batching).

With `use_decode_graphs` (off by default; the decode service turns it on on CUDA), steps
that feed one token per sequence run through `shared.model.cuda_graphs.DecodeGraphs`:
CUDA-graph replays per batch and page bucket. With `use_prefill_graphs` (the prefill service
turns it on on CUDA) other steps run through `shared.model.prefill_graphs.PrefillGraphs`:
piecewise CUDA graphs per token bucket, attention eager between them. The offline generator
stays eager, an independent reference for the services.

Under the prefill layout every TP rank computes identical logits, and with the
same per-request generators samples identical tokens, so no broadcast is needed.
Under the decode layout a rank with no sequences still runs the forward (empty
batch) so the expert all-to-all of the other ranks can complete.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shared.kvcache import KVLayout, OutOfPages, PagedKVCache
from shared.model.config import GenerationConfig
from shared.model.cuda_graphs import DecodeGraphs, EventLog
from shared.model.model import ForwardBatch, LayerCallback, Qwen3Model, SequenceChunk
from shared.model.prefill_graphs import PrefillGraphs
from shared.model.sampling import PromptLogprobs, Sampler, TopLogprobs, prompt_logprobs, request_generator, top_logprobs
from shared.model.sampling_params import SamplingParams
from shared.parallel import Collectives, Topology


@dataclass
class SequenceState:
    seq_id: str
    prompt_len: int
    params: SamplingParams
    token_ids: list[int]  # prompt followed by the generated tokens
    page_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # leading tokens whose K/V are in the cache
    generator: torch.Generator | None = None
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (EOS / stop token) or "length" (max_tokens)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class StepOutput:
    seq_id: str
    token_id: int
    logprob: float | None
    finish_reason: str | None
    top_logprobs: TopLogprobs | None = None  # when the sequence asks for them
    prompt_logprobs: PromptLogprobs | None = None  # the prompt tokens this step covered, when asked


class ModelRunner:
    def __init__(self, model: Qwen3Model, cache: PagedKVCache, eos_token_ids: Sequence[int] = (), sampler: Sampler | None = None, release_finished: bool = True) -> None:
        """``release_finished=False`` keeps a finished sequence's pages until `release`
        (a prefill rank frees them only after its KV transfer has completed)."""
        self.model, self.cache = model, cache
        self.eos_token_ids = frozenset(eos_token_ids)
        self.sampler = sampler or Sampler()
        self.release_finished = release_finished
        self.decode_graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path, *, num_pages: int | Callable[[Qwen3Model], int], page_size: int = 16, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", topology: Topology = Topology.single(), comm: Collectives | None = None, release_finished: bool = True, max_tokens_per_rank: int | None = None) -> ModelRunner:
        """``num_pages``: the KV cache's pages, or a function of the loaded model that decides them (a share of
        GPU memory, `shared.model.kv_budget`). ``max_tokens_per_rank``: see `Qwen3Model` (a decode rank passes
        its batch cap)."""
        model = Qwen3Model.load(model_dir, topology, comm, dtype, device, max_tokens_per_rank=max_tokens_per_rank)
        c = model.config
        if callable(num_pages):
            num_pages = num_pages(model)
        cache = PagedKVCache(KVLayout(c.num_layers, num_pages, model.local_kv_heads, page_size, c.head_dim, dtype), device)
        eos = GenerationConfig.from_dir(model_dir).eos_token_ids
        return cls(model, cache, eos, release_finished=release_finished)

    def use_decode_graphs(self, max_batch: int, max_graphs: int, capture: bool = True, log: EventLog | None = None) -> DecodeGraphs:
        """Run decode steps of up to ``max_batch`` sequences as CUDA-graph replays from now on
        (at most ``max_graphs`` graphs; see `DecodeGraphs`, which takes one KV page as scratch
        and reports captures and fallbacks to ``log``). ``capture=False`` runs the same padded
        static-buffer forward eagerly (CPU tests)."""
        self.decode_graphs = DecodeGraphs(self.model, self.cache, max_batch, max_graphs, capture, log)
        return self.decode_graphs

    def use_prefill_graphs(self, max_tokens: int, capture: bool = True, log: EventLog | None = None) -> PrefillGraphs:
        """Run steps of up to ``max_tokens`` tokens that the decode graphs do not take as piecewise
        CUDA graphs from now on (see `PrefillGraphs`, which takes one KV page as scratch and reports
        captures to ``log``). ``capture=False`` runs the same padded pieces eagerly (CPU tests)."""
        self.prefill_graphs = PrefillGraphs(self.model, self.cache, max_tokens, capture, log)
        return self.prefill_graphs

    @property
    def usable_pages(self) -> int:
        """KV pages sequences can hold: all but the graphs' scratch pages."""
        return self.cache.layout.num_pages - sum(g is not None for g in (self.decode_graphs, self.prefill_graphs))

    def add(self, seq_id: str, prompt_ids: Sequence[int], params: SamplingParams, *, page_table: Sequence[int] = (), num_cached: int = 0, output_ids: Sequence[int] = ()) -> SequenceState:
        """A new sequence. A decode rank whose KV arrived by transfer passes the reserved
        ``page_table``, ``num_cached=len(prompt_ids)`` and the first token in ``output_ids``."""
        if not prompt_ids:
            raise ValueError(f"sequence {seq_id}: empty prompt")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"sequence {seq_id}: prompt token id outside the vocabulary [0, {vocab})")
        if any(t >= vocab for t, _ in params.logit_bias):
            raise ValueError(f"sequence {seq_id}: logit_bias names a token outside the vocabulary [0, {vocab})")
        return SequenceState(
            seq_id=seq_id,
            prompt_len=len(prompt_ids),
            params=params,
            token_ids=[*prompt_ids, *output_ids],
            page_table=list(page_table),
            num_cached=num_cached,
            generator=request_generator(params, self.cache.device),
        )

    def prefill(self, seqs: Sequence[SequenceState], on_layer_done: LayerCallback | None = None) -> list[StepOutput]:
        """Run the uncached prompt of each sequence and sample its first token."""
        return self.step(seqs, on_layer_done)

    def decode(self, seqs: Sequence[SequenceState]) -> list[StepOutput]:
        """One new token per sequence (each must have exactly one uncached token)."""
        for s in seqs:
            if len(s.token_ids) - s.num_cached != 1:
                raise ValueError(f"sequence {s.seq_id}: decode needs exactly one uncached token, has {len(s.token_ids) - s.num_cached}")
        return self.step(seqs)

    def step(self, seqs: Sequence[SequenceState], on_layer_done: LayerCallback | None = None) -> list[StepOutput]:
        for s in seqs:
            if s.finished:
                raise ValueError(f"sequence {s.seq_id} already finished ({s.finish_reason})")
        if not seqs and not self._must_join_empty_steps:
            return []
        self._allocate(seqs)
        chunks = [SequenceChunk(s.token_ids[s.num_cached :], s.num_cached, s.page_table) for s in seqs]
        # Sequences asking for prompt logprobs whose prompt tokens this step runs: every row's hidden state.
        wants_prompt = any(s.params.prompt_logprobs >= 0 and s.num_cached < s.prompt_len - 1 for s in seqs)
        prompts: list[PromptLogprobs | None] = [None] * len(seqs)
        if self.decode_graphs is not None and on_layer_done is None and all(len(c.token_ids) == 1 for c in chunks):
            logits = self.decode_graphs.forward(chunks)
        else:
            batch = ForwardBatch.build(chunks, self.cache.layout.page_size, self.cache.device)
            if self.prefill_graphs is not None:
                hidden = self.prefill_graphs.hidden_states(batch, on_layer_done)
            else:
                hidden = self.model.hidden_states(batch, self.cache, on_layer_done)
            if wants_prompt:
                prompts = self._prompt_logprobs(seqs, hidden)
            logits = self.model.logits(hidden[batch.last_token])
        if not seqs:
            return []
        params = [s.params for s in seqs]
        # Penalties look at each sequence's prompt and output so far (built only when asked for).
        histories = [(s.token_ids[: s.prompt_len], s.output_ids) for s in seqs] if any(p.penalized for p in params) else None
        banned = [self._ending_ids(s) if len(s.output_ids) < s.params.min_tokens else () for s in seqs]
        tokens, logprobs = self.sampler.sample(logits.float(), params, [s.generator for s in seqs], histories, banned)
        # From the raw logits, and only when some sequence asks (no cost otherwise).
        tops = top_logprobs(logits, params) if any(p.top_logprobs for p in params) else [None] * len(seqs)
        outputs = []
        for i, (s, token) in enumerate(zip(seqs, tokens.tolist())):
            s.num_cached = len(s.token_ids)
            s.token_ids.append(token)
            lp = float(logprobs[i]) if logprobs is not None and s.params.logprobs else None
            if lp is not None:
                s.logprobs.append(lp)
            if (token in self.eos_token_ids and not s.params.ignore_eos) or token in s.params.stop_token_ids:
                s.finish_reason = "stop"
            elif len(s.output_ids) >= s.params.max_tokens:
                s.finish_reason = "length"
            if s.finished and self.release_finished:
                self.release(s)
            outputs.append(StepOutput(s.seq_id, token, lp, s.finish_reason, tops[i], prompts[i]))
        return outputs

    def _ending_ids(self, seq: SequenceState) -> tuple[int, ...]:
        """The tokens that would end ``seq`` now: what ``min_tokens`` bans until it is reached."""
        eos = () if seq.params.ignore_eos else tuple(self.eos_token_ids)
        return (*eos, *seq.params.stop_token_ids)

    def _prompt_logprobs(self, seqs: Sequence[SequenceState], hidden: torch.Tensor) -> list[PromptLogprobs | None]:
        """From the final hidden states of every row of the step: each asking sequence's prompt
        tokens that its rows predict (row j of a chunk from position c predicts token c + j + 1).
        lm_head runs over those rows only, a pass at a time (`prompt_logprobs`)."""
        out: list[PromptLogprobs | None] = []
        row = 0
        for s in seqs:
            length = len(s.token_ids) - s.num_cached
            covered = min(length, s.prompt_len - 1 - s.num_cached)  # rows that predict a prompt token
            if s.params.prompt_logprobs >= 0 and covered > 0:
                first = s.num_cached + 1
                def logits_of(a: int, b: int, start: int = row) -> torch.Tensor:
                    return self.model.logits(hidden[start + a : start + b])

                chosen, top = prompt_logprobs(logits_of, s.token_ids[first : first + covered], s.params.prompt_logprobs)
                out.append(PromptLogprobs(first, chosen, top))
            else:
                out.append(None)
            row += length
        return out

    def release(self, seq: SequenceState) -> None:
        """Give the sequence's pages back (idempotent)."""
        if seq.page_table:
            self.cache.allocator.free(seq.page_table)
            seq.page_table = []

    @property
    def _must_join_empty_steps(self) -> bool:
        topo = self.model.topology
        return topo.ep_size > 1 and not topo.inputs_replicated

    def _allocate(self, seqs: Sequence[SequenceState]) -> None:
        layout, allocator = self.cache.layout, self.cache.allocator
        needs = [max(0, layout.pages_for(len(s.token_ids)) - len(s.page_table)) for s in seqs]
        if sum(needs) > allocator.num_free:
            raise OutOfPages(sum(needs), allocator.num_free)
        for s, n in zip(seqs, needs):
            s.page_table.extend(allocator.alloc(n))
