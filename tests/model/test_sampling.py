"""Sampler: greedy, seeded reproducibility, top-k / top-p / min-p masks, logit bias, banned tokens,
penalties, logprobs, top logprobs, validation."""

from __future__ import annotations

import math

import pytest
import torch

from shared.model.sampling import PROMPT_ROWS_PER_PASS, Sampler, adjust_logits, make_generator, prompt_logprobs, request_generator, top_logprobs
from shared.model.sampling_params import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, InvalidSamplingParams, SamplingParams

VOCAB = 97


def _random_logits(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, VOCAB, generator=make_generator(seed)) * 3


def test_greedy_is_argmax_and_ignores_generators() -> None:
    logits = _random_logits(6)
    params = [SamplingParams(temperature=0.0, top_k=5, top_p=0.5, seed=i) for i in range(6)]
    tokens, logprobs = Sampler().sample(logits, params, [request_generator(p) for p in params])
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert tokens.dtype == torch.int64
    assert logprobs is None


def _draw_sequence(params: SamplingParams, position: int, others: list[SamplingParams], steps: int) -> list[int]:
    """Tokens of the request `params` over `steps` steps, sitting at row `position`
    of a batch whose other rows are `others` (their logits differ every step)."""
    sampler = Sampler(default_generator=make_generator(12345 + position))
    batch = others[:position] + [params] + others[position:]
    generators = [request_generator(p) for p in batch]
    out = []
    for step in range(steps):
        logits = _random_logits(len(batch), seed=1000 + step + 7 * position)
        # the row of our request always sees the same logits at a given step
        logits[position] = _random_logits(1, seed=step)[0]
        tokens, _ = sampler.sample(logits, batch, generators)
        out.append(int(tokens[position]))
    return out


def test_seeded_sampling_is_independent_of_batch_composition() -> None:
    request = SamplingParams(temperature=1.3, top_k=40, top_p=0.95, seed=2024)
    alone = _draw_sequence(request, 0, [], steps=24)
    crowded = [
        SamplingParams(temperature=0.7, seed=5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0, top_p=0.5),  # unseeded: shared stream
    ]
    assert _draw_sequence(request, 2, crowded, steps=24) == alone
    assert _draw_sequence(request, 3, crowded, steps=24) == alone
    other_seed = SamplingParams(temperature=1.3, top_k=40, top_p=0.95, seed=2025)
    # a different seed must give a different stream (proves the seed is used)
    assert _draw_sequence(other_seed, 0, [], steps=24) != alone
    # and the draws are really random, not a greedy walk
    assert len(set(alone)) > 8


def _frequencies(logits_row: torch.Tensor, params: SamplingParams, draws: int) -> torch.Tensor:
    batch = [params] * draws
    generators = [make_generator(seed) for seed in range(draws)]
    tokens, _ = Sampler().sample(logits_row.expand(draws, -1).clone(), batch, generators)
    return torch.bincount(tokens, minlength=logits_row.numel()).double() / draws


def _assert_matches(freq: torch.Tensor, expected: torch.Tensor, draws: int) -> None:
    # tokens with probability 0 must never appear; the rest within 5 binomial sigmas
    assert torch.all(freq[expected == 0] == 0), f"masked token drawn: {freq}"
    sigma = torch.sqrt(expected * (1 - expected) / draws)
    assert torch.all((freq - expected).abs() <= 5 * sigma + 1e-12), f"{freq} vs {expected}"


DRAWS = 6000
PROBS = torch.tensor([0.05, 0.40, 0.10, 0.30, 0.15])


def test_plain_temperature_sampling_matches_softmax() -> None:
    logits = PROBS.log() * 2.0  # temperature 2 undoes the factor
    _assert_matches(_frequencies(logits, SamplingParams(temperature=2.0), DRAWS), PROBS, DRAWS)


def test_top_k_keeps_exactly_the_k_most_likely_renormalised() -> None:
    freq = _frequencies(PROBS.log(), SamplingParams(top_k=3), DRAWS)
    expected = torch.tensor([0.0, 0.40, 0.0, 0.30, 0.15]) / 0.85
    _assert_matches(freq, expected, DRAWS)


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    # sorted: 0.40, 0.30, 0.15 (cum 0.85 >= 0.8) -> the 0.10 and 0.05 tokens go
    freq = _frequencies(PROBS.log(), SamplingParams(top_p=0.8), DRAWS)
    _assert_matches(freq, torch.tensor([0.0, 0.40, 0.0, 0.30, 0.15]) / 0.85, DRAWS)
    # a small top_p leaves only the most likely token
    freq = _frequencies(PROBS.log(), SamplingParams(top_p=0.1), 200)
    assert freq[1] == 1.0


def test_top_p_applies_to_the_distribution_left_by_top_k() -> None:
    # top_k=2 leaves {0.40, 0.30} -> renormalised 0.571, 0.429; top_p=0.5 keeps only the first
    freq = _frequencies(PROBS.log(), SamplingParams(top_k=2, top_p=0.5), 300)
    assert freq[1] == 1.0
    # top_p=0.6 needs both
    freq = _frequencies(PROBS.log(), SamplingParams(top_k=2, top_p=0.6), DRAWS)
    _assert_matches(freq, torch.tensor([0.0, 0.40, 0.0, 0.30, 0.0]) / 0.70, DRAWS)


def test_min_p_drops_tokens_below_min_p_times_the_most_likely() -> None:
    # p_max 0.40: min_p 0.3 keeps p >= 0.12 -> {0.40, 0.30, 0.15}; after temperature 1
    freq = _frequencies(PROBS.log(), SamplingParams(min_p=0.3), DRAWS)
    _assert_matches(freq, torch.tensor([0.0, 0.40, 0.0, 0.30, 0.15]) / 0.85, DRAWS)
    # on the tempered distribution: temperature 0.5 squares the probabilities (0.16, 0.09, 0.0225, ...)
    # so min_p 0.3 keeps p^2 >= 0.048: {0.40, 0.30} only
    freq = _frequencies(PROBS.log(), SamplingParams(temperature=0.5, min_p=0.3), DRAWS)
    _assert_matches(freq, torch.tensor([0.0, 0.16, 0.0, 0.09, 0.0]) / 0.25, DRAWS)


def test_logit_bias_shifts_logits_for_greedy_and_sampled_rows_and_not_the_logprobs() -> None:
    logits = _random_logits(3)
    low = int(logits[0].argmin())
    params = [SamplingParams(temperature=0.0, logprobs=True, logit_bias={low: 100}),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, seed=4, logit_bias={int(logits[2].argmax()): -100})]
    tokens, logprobs = Sampler().sample(logits, params, [request_generator(p) for p in params])
    assert int(tokens[0]) == low  # +100 lifts the least likely token over every other
    assert int(tokens[1]) == int(logits[1].argmax())  # a row without a bias is untouched
    assert logprobs is not None  # the chosen token's logprob is of the raw logits (module doc)
    torch.testing.assert_close(logprobs[0], torch.log_softmax(logits[0], dim=-1)[low])
    # -100 makes the most likely token (p ~ e^-100 relative) practically never drawn
    freq = _frequencies(logits[2], params[2], 2000)
    assert freq[int(logits[2].argmax())] == 0
    # an exact bias is added: +2 on token 1 of PROBS multiplies its odds by e^2
    biased = PROBS * torch.tensor([1, math.e**2, 1, 1, 1])
    _assert_matches(_frequencies(PROBS.log(), SamplingParams(logit_bias={1: 2.0}), DRAWS), biased / biased.sum(), DRAWS)


def test_banned_tokens_are_never_picked_by_their_rows_only() -> None:
    logits = _random_logits(2)
    top = [int(i) for i in logits.argmax(dim=-1)]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)]
    tokens, _ = Sampler().sample(logits, params, [None, None], banned=[(top[0],), ()])
    assert int(tokens[0]) != top[0] and int(tokens[0]) == int(logits[0].topk(2).indices[1])
    assert int(tokens[1]) == top[1]
    with pytest.raises(ValueError, match="banned"):
        Sampler().sample(logits, params, [None, None], banned=[()])


def test_adjust_logits_biases_and_bans_exactly_the_named_cells_of_every_row() -> None:
    logits = _random_logits(4)
    params = [SamplingParams(logit_bias={3: 2.5, 90: -7}), SamplingParams(), SamplingParams(logit_bias={3: -1, 5: 100}), SamplingParams()]
    banned = [(), (3, 4), (90,), ()]
    out = adjust_logits(logits, params, None, banned)
    expected = logits.clone()
    for row, p in enumerate(params):
        for token, bias in p.logit_bias:
            expected[row, token] = logits[row, token] + bias
        for token in banned[row]:
            expected[row, token] = -math.inf
    assert torch.equal(out, expected)
    assert torch.equal(logits, _random_logits(4))  # the caller's logits are not modified
    assert adjust_logits(logits, [SamplingParams()] * 4, None, [()] * 4) is logits  # nothing asked: no copy


def test_logit_bias_dict_is_normalised_to_sorted_pairs() -> None:
    params = SamplingParams(logit_bias={7: -1, 2: 3.5})
    assert params.logit_bias == ((2, 3.5), (7, -1.0))
    assert hash(params) == hash(SamplingParams(logit_bias=[(7, -1.0), (2, 3.5)]))


def test_logprobs_are_log_softmax_of_raw_logits() -> None:
    logits = _random_logits(5)
    params = [
        SamplingParams(temperature=0.0, logprobs=True),
        SamplingParams(temperature=0.5, top_k=3, logprobs=True, seed=1),
        SamplingParams(temperature=1.5, top_p=0.3, logprobs=True, seed=2),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=1.0, logprobs=True),
    ]
    tokens, logprobs = Sampler().sample(logits, params, [request_generator(p) for p in params])
    assert logprobs is not None and logprobs.dtype == torch.float32
    expected = torch.log_softmax(logits.double(), dim=-1)[torch.arange(5), tokens]
    torch.testing.assert_close(logprobs.double(), expected, rtol=0, atol=1e-5)
    assert torch.all(logprobs <= 0)


def test_sampler_rejects_mismatched_batch() -> None:
    with pytest.raises(ValueError, match="2 logits rows"):
        Sampler().sample(_random_logits(2), [SamplingParams()], [None])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", -0.2),
        ("top_k", -1),
        ("top_k", 2.5),
        ("seed", -3),
        ("seed", 2**64),
        ("max_tokens", 0),
        ("logprobs", 1),
        ("stop_token_ids", (1, -2)),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", math.inf),
        ("top_logprobs", -1),
        ("top_logprobs", MAX_TOP_LOGPROBS + 1),
        ("top_logprobs", 2.0),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("min_tokens", -1),
        ("min_tokens", 17),  # above max_tokens (16)
        ("logit_bias", {3: 100.5}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {2.0: 1.0}),
        ("logit_bias", ((1, 1.0), (1, 2.0))),
        ("logit_bias", {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}),
        ("logit_bias", [1, 2]),
    ],
)
def test_invalid_params_raise_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidSamplingParams, match=field):
        SamplingParams(**{field: value})


def test_valid_edge_params_are_accepted() -> None:
    params = SamplingParams(temperature=0, top_p=1, top_k=0, seed=2**64 - 1, stop_token_ids=[1, 2])
    assert params.greedy and params.stop_token_ids == (1, 2)


def test_penalties_follow_openai_and_transformers_definitions() -> None:
    """Row 0: presence and frequency over the output (OpenAI: minus frequency * count + presence);
    row 1: repetition over prompt and output (transformers: positive logits divided, negative
    multiplied), then the others; row 2: none. Greedy picks from the penalised logits; logprobs
    stay those of the raw logits."""
    logits = _random_logits(3)
    prompt, output = [3, 5, 5], [7, 7, 7, 9, 5]
    params = [SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25, logprobs=True),
              SamplingParams(temperature=0, repetition_penalty=1.7, frequency_penalty=0.1),
              SamplingParams(temperature=0)]
    expect = logits.clone()
    for token, count in ((7, 3), (9, 1), (5, 1)):
        expect[0, token] -= 0.25 * count + 0.5
    for token in (3, 5, 7, 9):
        value = expect[1, token]
        expect[1, token] = value / 1.7 if value > 0 else value * 1.7
    for token, count in ((7, 3), (9, 1), (5, 1)):
        expect[1, token] -= 0.1 * count
    tokens, logprobs = Sampler().sample(logits, params, [None] * 3, [(prompt, output)] * 3)
    assert torch.equal(tokens, expect.argmax(dim=-1))
    assert torch.equal(logprobs, torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1))


def test_a_strong_presence_penalty_steers_greedy_off_every_generated_token() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, :4] = torch.tensor([4.0, 3.0, 2.0, 1.0])
    params = [SamplingParams(temperature=0, presence_penalty=2.0)]
    picked = []
    for _ in range(3):
        tokens, _ = Sampler().sample(logits, params, [None], [([], picked)])
        picked.append(int(tokens[0]))
    assert picked == [0, 1, 0]  # then 4 - 2 = 2 < 3: token 1; then 0 and 2 tie at 2 (argmax: the lower id)


def test_penalties_need_the_histories() -> None:
    with pytest.raises(ValueError, match="prompt ids, output ids"):
        Sampler().sample(_random_logits(1), [SamplingParams(repetition_penalty=1.2)], [None])


def test_top_logprobs_are_the_raw_log_softmax_topk_of_the_rows_that_ask() -> None:
    """Rows with penalties and temperature sample from changed logits, but their alternatives
    (like their chosen token's logprob) are the top-k of log_softmax of the raw logits; each row
    gets its own k; rows that ask for none get None. A greedy row's chosen token is its top-1."""
    logits = _random_logits(4, seed=11)
    raw = logits.clone()
    params = [SamplingParams(temperature=0.7, seed=1, presence_penalty=1.5, repetition_penalty=1.3, logprobs=True, top_logprobs=5),
              SamplingParams(temperature=0, logprobs=True),
              SamplingParams(temperature=0, logprobs=True, top_logprobs=MAX_TOP_LOGPROBS),
              SamplingParams(temperature=1.3, top_k=4, seed=2, logprobs=True, top_logprobs=1)]
    histories = [([3, 4], [int(raw[0].argmax()), 9])] * 4
    tokens, logprobs = Sampler().sample(logits, params, [request_generator(p) for p in params], histories)
    assert torch.equal(logits, raw)  # sampling leaves the caller's raw logits alone
    tops = top_logprobs(logits, params)
    assert tops[1] is None
    reference = torch.log_softmax(raw, dim=-1)
    for row, k in ((0, 5), (2, MAX_TOP_LOGPROBS), (3, 1)):
        values, ids = reference[row].topk(k)
        assert tops[row].token_ids == ids.tolist() and len(tops[row].logprobs) == k
        torch.testing.assert_close(torch.tensor(tops[row].logprobs), values, rtol=0, atol=1e-6)
    # The penalised row's top-1 is the raw argmax, which its penalty steered the pick away from.
    assert tops[0].token_ids[0] == int(raw[0].argmax()) != int(tokens[0])
    assert tops[2].token_ids[0] == int(tokens[2]) and tops[2].logprobs[0] == float(logprobs[2])



def test_prompt_logprobs_across_passes_match_log_softmax():
    """More rows than one pass takes (PROMPT_ROWS_PER_PASS): every row's chosen logprob and top-k."""
    g = torch.Generator().manual_seed(11)
    rows = PROMPT_ROWS_PER_PASS * 2 + 37
    logits = torch.randn(rows, 300, generator=g) * 3
    next_ids = torch.randint(0, 300, (rows,), generator=g).tolist()
    passes = []

    def logits_of(a: int, b: int) -> torch.Tensor:
        passes.append(b - a)
        return logits[a:b].to(torch.bfloat16)

    chosen, top = prompt_logprobs(logits_of, next_ids, 4)
    assert passes == [PROMPT_ROWS_PER_PASS, PROMPT_ROWS_PER_PASS, 37]  # never all rows at once
    want = torch.log_softmax(logits.to(torch.bfloat16).float(), dim=-1)
    assert torch.allclose(torch.tensor(chosen), want[torch.arange(rows), torch.tensor(next_ids)], atol=1e-6)
    assert top is not None and len(top) == rows
    assert [t.token_ids for t in top] == want.topk(4, dim=-1).indices.tolist()
    assert prompt_logprobs(lambda a, b: logits[a:b], next_ids[:3], 0)[1] is None
