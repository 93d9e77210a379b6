"""Next-token sampling: penalties, greedy, temperature, top-k, top-p, per-request seeds, logprobs
and the most likely tokens at each position (``top_logprobs``). The parameters a request gives
and their checks are `shared.model.sampling_params` (no torch: the gateway validates with them).

Reproducibility: a request with a seed owns a `torch.Generator`, and its row is
drawn only from that generator, with a draw whose size does not depend on the
batch (one exponential variate per vocabulary entry, then ``argmax(p / q)``,
which picks token ``i`` with probability ``p_i``). The same seed therefore yields
the same tokens whatever else shares the batch — on the same device type, since
CPU and CUDA generators produce different streams.

Order, as in vLLM: the logit adjustments first (greedy rows included): ``logit_bias`` added
to its tokens' logits, ``min_tokens``' ban of the ending tokens (`Sampler.sample`'s ``banned``
rows) while a row has fewer outputs than that, and the penalties; then temperature, ``min_p``
(drop tokens less likely than ``min_p`` times the most likely one), top-k, and top-p over the
distribution top-k left. Penalties: ``repetition_penalty``
(transformers' and vLLM's: a logit of a token seen in the prompt or the output is
divided by it when positive, multiplied when negative), then OpenAI's
``frequency_penalty`` and ``presence_penalty`` over the output so far (subtract
``frequency * count + presence`` from the logit of every generated token). Logprobs
are those of the raw logits (``log_softmax`` before penalties, temperature and
filtering), as vLLM reports them by default; so are a row's ``top_logprobs`` alternatives
(`top_logprobs`), computed only for the rows that ask for them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from shared.model.sampling_params import SamplingParams


def adjust_logits(logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None,
                  banned: Sequence[Sequence[int]] | None) -> torch.Tensor:
    """fp32 ``logits [B, V]`` after each row's logit bias, banned tokens and penalties (module
    doc): the tensor itself when no row has any, else a copy."""
    biased = [(i, token, bias) for i, p in enumerate(params) for token, bias in p.logit_bias]
    banned_cells = [(i, token) for i, ids in enumerate(banned or ()) for token in ids]
    penalized = any(p.penalized for p in params)
    if not biased and not banned_cells and not penalized:
        return logits
    out = logits.clone()
    device = logits.device
    # One index tensor and one value tensor for the whole batch (not one pair per row): each
    # is a host-to-device copy on CUDA, paid every decode step while a biased request runs.
    if biased:
        rows, ids, values = zip(*biased, strict=True)
        cells = torch.tensor([rows, ids], dtype=torch.long, device=device)
        out[cells[0], cells[1]] += torch.tensor(values, dtype=out.dtype, device=device)  # a row's ids are distinct
    if banned_cells:
        cells = torch.tensor(banned_cells, dtype=torch.long, device=device).T
        out[cells[0], cells[1]] = -math.inf
    if penalized:
        if histories is None or len(histories) != len(params):
            raise ValueError("sampling with penalties needs every row's (prompt ids, output ids)")
        _apply_penalties_(out, params, histories)
    return out


def _apply_penalties_(out: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[tuple[Sequence[int], Sequence[int]]]) -> None:
    """Each row's penalties applied to fp32 ``out [B, V]`` in place (module doc); rows without
    penalties are unchanged."""
    device = out.device
    for i, p in enumerate(params):
        if not p.penalized:
            continue
        prompt, output = histories[i]
        if p.repetition_penalty != 1 and (prompt or output):
            seen = torch.unique(torch.tensor([*prompt, *output], dtype=torch.long, device=device))
            row = out[i, seen]
            out[i, seen] = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and output:
            ids, counts = torch.unique(torch.tensor(output, dtype=torch.long, device=device), return_counts=True)
            out[i, ids] -= p.frequency_penalty * counts.to(out.dtype) + p.presence_penalty


@dataclass(frozen=True)
class TopLogprobs:
    """The most likely tokens at one position, most likely first, and their logprobs."""

    token_ids: list[int]
    logprobs: list[float]


def top_logprobs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> list[TopLogprobs | None]:
    """Each row's ``params[i].top_logprobs`` most likely tokens under ``log_softmax(logits)``
    (None for a row that asks for none). Pass the raw logits: the alternatives are reported
    before penalties and temperature, like the chosen token's logprob. Only the rows that
    ask are computed, in one ``topk`` at the largest k asked."""
    rows = [i for i, p in enumerate(params) if p.top_logprobs > 0]
    out: list[TopLogprobs | None] = [None] * len(params)
    if not rows:
        return out
    k = min(max(params[i].top_logprobs for i in rows), logits.shape[-1])
    index = torch.tensor(rows, device=logits.device)
    values, ids = torch.log_softmax(logits[index].float(), dim=-1).topk(k, dim=-1)
    for row, row_ids, row_values in zip(rows, ids.tolist(), values.tolist(), strict=True):
        n = params[row].top_logprobs
        out[row] = TopLogprobs(row_ids[:n], row_values[:n])
    return out


@dataclass(frozen=True)
class PromptLogprobs:
    """Prompt tokens ``first, first + 1, ...``: each one's log-probability given the tokens
    before it and, when asked, the most likely tokens at its position."""

    first: int  # the prompt index of the first token covered (1 for a prompt run from its start)
    logprobs: list[float]
    top: list[TopLogprobs] | None


PROMPT_ROWS_PER_PASS = 512  # a long prompt's [T, vocab] logits at once would take gigabytes


def prompt_logprobs(logits_of: Callable[[int, int], torch.Tensor], next_ids: Sequence[int], k: int) -> tuple[list[float], list[TopLogprobs] | None]:
    """For each prompt row ``r`` (``len(next_ids)`` of them): the log-probability of
    ``next_ids[r]`` (the prompt token that row predicts) under ``log_softmax`` of its raw
    logits, and with ``k`` > 0 the ``k`` most likely tokens. ``logits_of(a, b)`` gives rows
    ``a..b-1``'s logits; it is called for ``PROMPT_ROWS_PER_PASS`` rows at a time, so the
    logits of a long prompt never exist at once."""
    chosen: list[float] = []
    top: list[TopLogprobs] | None = [] if k > 0 else None
    for start in range(0, len(next_ids), PROMPT_ROWS_PER_PASS):
        end = min(start + PROMPT_ROWS_PER_PASS, len(next_ids))
        rows = torch.log_softmax(logits_of(start, end).float(), dim=-1)
        ids = torch.tensor(list(next_ids[start:end]), dtype=torch.long, device=rows.device)
        chosen += rows.gather(1, ids[:, None])[:, 0].tolist()
        if top is not None:
            values, alt = rows.topk(min(k, rows.shape[-1]), dim=-1)
            top += [TopLogprobs(i, v) for i, v in zip(alt.tolist(), values.tolist(), strict=True)]
    return chosen, top


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def request_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The request's own generator (None without a seed)."""
    return None if params.seed is None else make_generator(params.seed, device)


class Sampler:
    """Picks one token per row of a logits batch.

    ``default_generator`` serves the rows without a generator of their own (None:
    torch's global stream).
    """

    def __init__(self, default_generator: torch.Generator | None = None) -> None:
        self._default_generator = default_generator

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
        banned: Sequence[Sequence[int]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token ids ``[B]`` (int64) and, if any row asked, their logprobs ``[B]`` (fp32).

        ``histories``: each row's (prompt ids, output ids so far), needed by rows with penalties.
        ``banned``: per row, token ids it must not pick now (``min_tokens``' ending tokens).
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        batch, _ = logits.shape
        if len(params) != batch or len(generators) != batch:
            raise ValueError(
                f"{batch} logits rows but {len(params)} sampling params and {len(generators)} generators"
            )
        if banned is not None and len(banned) != batch:
            raise ValueError(f"{batch} logits rows but {len(banned)} rows of banned tokens")
        raw = logits.float()
        logits = adjust_logits(raw, params, histories, banned)
        tokens = logits.argmax(dim=-1)
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=logits.device)
            probs = self._filtered_probs(logits[rows], [params[i] for i in sampled_rows])
            noise = self._exponential_noise(probs, [generators[i] for i in sampled_rows])
            tokens[rows] = (probs / noise).argmax(dim=-1)
        logprobs = None
        if any(p.logprobs for p in params):
            logprobs = torch.log_softmax(raw, dim=-1).gather(1, tokens[:, None]).squeeze(1)
        return tokens, logprobs

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Probabilities after temperature, min-p, top-k and top-p (masked tokens get 0)."""
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device)
        scaled = logits / temperature[:, None]
        if any(p.min_p > 0 for p in params):
            # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); min_p 0 gives -inf (keeps all)
            floor = scaled.amax(dim=-1) + torch.tensor([p.min_p for p in params], device=device).log()
            scaled = scaled.masked_fill(scaled < floor[:, None], -math.inf)
        if all(p.top_k == 0 and p.top_p == 1 for p in params):
            return torch.softmax(scaled, dim=-1)
        vocab = scaled.shape[-1]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
        top_p = torch.tensor([float(p.top_p) for p in params], device=device)
        # Work in descending order: both filters keep a prefix of the sorted row.
        sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(vocab, device=device)[None, :]
        sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], -math.inf)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the first token always
        # stays (its exclusive sum is 0, which a top_p below float32's least, taken as 0, reaches too).
        mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_logits = sorted_logits.masked_fill((mass_above >= top_p[:, None]) & (rank > 0), -math.inf)
        filtered = torch.full_like(scaled, -math.inf).scatter(-1, order, sorted_logits)
        return torch.softmax(filtered, dim=-1)

    def _exponential_noise(
        self, probs: torch.Tensor, generators: Sequence[torch.Generator | None]
    ) -> torch.Tensor:
        """One Exp(1) variate per (row, token), each seeded row from its own generator."""
        noise = torch.empty_like(probs)
        shared_rows = [i for i, g in enumerate(generators) if g is None]
        if shared_rows:
            draw = torch.empty(len(shared_rows), probs.shape[-1], device=probs.device)
            noise[shared_rows] = draw.exponential_(generator=self._default_generator)
        for i, generator in enumerate(generators):
            if generator is not None:
                noise[i].exponential_(generator=generator)
        # An exact zero would turn p/q into inf (or nan for a masked token).
        return noise.clamp_(min=torch.finfo(noise.dtype).tiny)
