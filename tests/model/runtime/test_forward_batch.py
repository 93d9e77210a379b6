"""`ForwardBatch.build` against a per-token definition of every index it builds (CPU).

The build makes its index tensors with torch ops on the host and moves them in one copy; here each
field is recomputed token by token from the chunks, for batches mixing fresh prompts, cached
prefixes, decode steps and page tables longer than needed, and bad chunks are refused.
"""

from __future__ import annotations

import random

import pytest
import torch

from shared.model.model import ForwardBatch, SequenceChunk

PAGE = 16


def _chunks(seed: int) -> list[SequenceChunk]:
    rng = random.Random(seed)
    chunks = []
    for _ in range(rng.randint(1, 6)):
        start = rng.choice([0, 0, rng.randint(1, 100)])
        n = rng.choice([1, rng.randint(1, 300)])
        pages = -(-(start + n) // PAGE) + rng.randint(0, 3)  # a table may hold more pages than needed
        chunks.append(SequenceChunk([rng.randrange(151_000) for _ in range(n)], start, rng.sample(range(10_000), pages)))
    return chunks


def _per_token(chunks: list[SequenceChunk]) -> dict[str, list]:
    out: dict[str, list] = {k: [] for k in ("token_ids", "positions", "slot_pages", "slot_offsets", "token_seq", "token_idx", "last_token")}
    for b, c in enumerate(chunks):
        for i, tok in enumerate(c.token_ids):
            p = c.start + i
            for key, value in zip(out, (tok, p, c.page_table[p // PAGE], p % PAGE, b, i)):
                out[key].append(value)
        out["last_token"].append(len(out["token_ids"]) - 1)
    max_pages = max(-(-(c.start + len(c.token_ids)) // PAGE) for c in chunks)
    out["page_tables"] = [list(c.page_table[:max_pages]) + [c.page_table[0]] * (max_pages - len(c.page_table[:max_pages])) for c in chunks]
    out["context_lens"] = [c.start + len(c.token_ids) for c in chunks]
    out["query_lens"] = [len(c.token_ids) for c in chunks]
    return out


@pytest.mark.parametrize("seed", range(12))
def test_every_index_matches_its_per_token_definition(seed):
    chunks = _chunks(seed)
    batch = ForwardBatch.build(chunks, PAGE, torch.device("cpu"))
    want = _per_token(chunks)
    got = {k: getattr(batch, k) for k in ("token_ids", "positions", "slot_pages", "slot_offsets", "last_token")}
    got |= {k: getattr(batch.attn, k) for k in ("page_tables", "context_lens", "query_lens", "token_seq", "token_idx")}
    for key, tensor in got.items():
        assert tensor.dtype == torch.long, key
        assert tensor.tolist() == want[key], key
    assert batch.attn.max_q == max(want["query_lens"])
    assert batch.attn.host_lens == tuple(zip(want["query_lens"], want["context_lens"]))


def test_an_empty_batch_has_empty_indices():
    batch = ForwardBatch.build([], PAGE, torch.device("cpu"))
    assert batch.token_ids.shape == (0,) and batch.attn.page_tables.shape == (0, 1) and batch.attn.max_q == 0


def test_a_chunk_without_tokens_or_pages_is_refused():
    with pytest.raises(ValueError, match="sequence 1 of the batch has no new tokens"):
        ForwardBatch.build([SequenceChunk([1], 0, [0]), SequenceChunk([], 3, [1])], PAGE, torch.device("cpu"))
    with pytest.raises(ValueError, match="page table has 1 pages, 2 needed for 17 tokens"):
        ForwardBatch.build([SequenceChunk(list(range(17)), 0, [5])], PAGE, torch.device("cpu"))
