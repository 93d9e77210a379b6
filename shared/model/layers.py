"""The model's operators as small, separate functions.

RoPE angles, linear (plain, FP8 block-scaled or MXFP8), paged attention, MoE
experts, dense SwiGLU MLP (RMSNorm and RoPE, and the router's softmax + top-k, are
`kernels.norm_rope` and `kernels.router`: reference and kernel side by side). The
torch reference ops follow transformers' Qwen3-MoE code, so that fp32 results agree
with it to rounding. Attention runs in fp32 internally (as SDPA / flash
kernels accumulate) and rounds only its output.

Where a model runs the kernels (`kernels.ops.use_kernels`, decided once when the
model is built): `moe_experts` takes the grouped-GEMM path of `kernels.moe` for
experts prepared as `FusedGateUp` (bf16, FP8 block-scaled or MXFP8), attention
is `paged_attention_sdpa`, and the norms, RoPE and the router's top-k are fused
kernels. A quantized projection outside the grouped GEMM
(attention, dense MLPs) reaches `linear` already dequantized when the model runs the
kernels (`shared.model.weights.dequantize_dense`, once at load); on the reference
path `linear` dequantizes it on every call.

Decode batches (one query per sequence) take the paged decode attention kernel of
`kernels.paged_attention` inside `paged_attention_sdpa`: K/V read straight from the pool
(``MOEBUS_DECODE_ATTENTION=sdpa`` turns it off; they then gather their pages for SDPA with
a mask). Prefill batches (several queries per sequence) take one of three routes
(`prefill_attention_route`), all causal to the bottom right (each sequence's queries after its
cached tokens) and none with [queries x keys] memory: several sequences gather their keys from
the pages at once and run one variable-length flash attention call, so short prompts cost no
launch per sequence (`varlen_prefill_attention`); one sequence alone runs a flash call of its
own, which splits a long context over CTAs (`per_sequence_prefill_attention`); and sequences
that bring only a few new tokens each (a prefix-cache hit with a short suffix) run through the
decode kernel, every query a decode row whose context ends at its own position
(`queries_as_decode_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kernels.moe import grouped_moe
from kernels.ops import env_mode
from kernels._cute_runtime import sm_count
from kernels.paged_attention import (CTAS_PER_SM_TARGET, MAX_GRID_DIM, kernel_supports, paged_decode_attention, paged_multi_query_attention,
                                     prepare_paged_decode_attention, queries_per_cta)
from shared.kvcache import PagedKVCache
from shared.model.quant_formats import BlockFp8Weight, Mxfp8Weight
from shared.model.weights import FusedGateUp, Linear


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[T, head_dim]`` for the default (unscaled) RoPE at integer positions."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def linear(x: torch.Tensor, w: Linear) -> torch.Tensor:
    """``x @ w.T``; an FP8 block-scaled or MXFP8 weight is dequantized first (the reference path)."""
    if isinstance(w, (BlockFp8Weight, Mxfp8Weight)):
        w = w.dequantize(x.dtype)
    return F.linear(x, w)


@dataclass(frozen=True)
class PrefillKeys:
    """Where a prefill batch's keys are, for `_prefill_attention`: every sequence's visible tokens
    in order, sequence after sequence, as rows of a layer's pool viewed as
    ``[pages * 2 * kv_heads * page_size, head_dim]`` (one row: one head's K or V of one token)."""

    rows: torch.Tensor  # [2, K, kv_heads]: K then V, key, head
    cu_q: torch.Tensor  # [B + 1] int32: where each sequence's queries start in the batch's T rows
    cu_k: torch.Tensor  # [B + 1] int32: where each sequence's keys start in the K gathered ones
    max_q: int
    max_k: int

    @classmethod
    def build(cls, meta: AttentionMetadata, pool_shape: torch.Size) -> PrefillKeys:
        if meta.host_lens is None:
            raise ValueError("prefill attention needs the batch's host_lens (ForwardBatch.build sets them)")
        _, two, kv_heads, page_size, _ = pool_shape
        q_lens, k_lens = [n for n, _ in meta.host_lens], [length for _, length in meta.host_lens]
        device = meta.page_tables.device
        cu = torch.tensor([[0, *accumulate(q_lens)], [0, *accumulate(k_lens)]], dtype=torch.int32, device=device)
        keys = sum(k_lens)
        seq = torch.repeat_interleave(torch.arange(len(k_lens), device=device), cu[1].diff().long(), output_size=keys)
        pos = torch.arange(keys, device=device) - cu[1, :-1][seq]  # each key's position in its sequence
        first_row = meta.page_tables[seq, pos // page_size] * (two * kv_heads * page_size) + pos % page_size  # K, head 0
        head_rows = (torch.arange(two, device=device)[:, None] * kv_heads + torch.arange(kv_heads, device=device)) * page_size
        return cls(first_row[None, :, None] + head_rows[:, None, :], cu[0], cu[1], max(q_lens), max(k_lens))


@dataclass(frozen=True)
class QueriesAsDecode:
    """A prefill batch seen as a decode batch, for `queries_as_decode_attention`: query ``i`` of a sequence
    with ``n`` new tokens and ``L`` in all reads that sequence's pages with context ``L - n + i + 1``
    (exactly the keys its causal mask shows it). A sequence's queries go ``per_cta`` at a time to one
    kernel CTA (`kernels.paged_attention.paged_multi_query_attention`), its last CTA's spare places
    repeating its last query (computed, never read)."""

    rows: torch.Tensor  # [P, per_cta]: each place's query, an index into the batch's T rows
    page_tables: torch.Tensor  # [P, pages]: the page table of each CTA's sequence
    context_lens: torch.Tensor  # [P, per_cta], nondecreasing along a row
    slots: torch.Tensor  # [T]: where each query's result is among the P * per_cta places

    @classmethod
    def build(cls, meta: AttentionMetadata, per_cta: int) -> QueriesAsDecode:
        if meta.host_lens is None:
            raise ValueError("prefill attention needs the batch's host_lens (ForwardBatch.build sets them)")
        n = meta.query_lens
        ctas = (n + per_cta - 1) // per_cta  # per sequence
        total = sum(-(-q // per_cta) for q, _ in meta.host_lens)
        first_cta, first_query = ctas.cumsum(0) - ctas, n.cumsum(0) - n
        seq = torch.repeat_interleave(torch.arange(len(meta.host_lens), device=n.device), ctas, output_size=total)
        place = torch.arange(per_cta, device=n.device)
        index = torch.minimum((torch.arange(total, device=n.device) - first_cta[seq])[:, None] * per_cta + place, n[seq, None] - 1)
        slots = (first_cta[meta.token_seq] + meta.token_idx // per_cta) * per_cta + meta.token_idx % per_cta
        context = (meta.context_lens - n)[seq, None] + index + 1
        return cls(first_query[seq, None] + index, meta.page_tables[seq], context, slots)


@dataclass
class AttentionMetadata:
    """Where a batch's tokens sit: per-sequence query spans, cache lengths and page tables.

    Sequences are padded to ``max_q`` queries and ``num_pages * page_size`` keys so the
    reference attention is a handful of batched matmuls.
    """

    page_tables: torch.Tensor  # [B, P] page ids, padded with a valid id
    context_lens: torch.Tensor  # [B] tokens in the cache after this step (keys visible to the last query)
    query_lens: torch.Tensor  # [B]
    token_seq: torch.Tensor  # [T] sequence of each flat token
    token_idx: torch.Tensor  # [T] index of each flat token inside its sequence's queries
    max_q: int
    host_lens: tuple[tuple[int, int], ...] | None = None  # (query_len, context_len) per sequence, when built on the host
    prefill_keys: PrefillKeys | None = None  # built by the batch's first prefill attention layer, reused by the others
    page_rows: torch.Tensor | None = None  # `PagedKVCache.page_rows` of page_tables, likewise (the per-sequence route's gather)
    prefill_route: str | None = None  # `prefill_attention_route`'s choice, likewise (host time on every layer)
    as_decode: QueriesAsDecode | None = None  # likewise, for batches `queries_as_decode_attention` runs

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])


def paged_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal GQA attention of ``q [T, Hq, D]`` against the paged K/V: ``[T, Hq, D]``.

    A query at index ``i`` of a sequence with ``n`` new tokens and ``L`` cached tokens
    in total sits at position ``L - n + i`` and sees keys ``0 .. L - n + i``.
    """
    t, hq, d = q.shape
    if meta.num_seqs == 0:
        return q.new_zeros((t, hq, d))
    k, v = cache.gather(layer, meta.page_tables)  # [B, Hkv, Lmax, D]
    b, hkv, lmax, _ = k.shape
    group = hq // hkv
    # Scores, softmax and the weighted sum in fp32 whatever the dtype, as fused
    # (flash) attention kernels accumulate; only the output is rounded to q's dtype.
    qp = _padded_queries(q.float(), meta).view(b, meta.max_q, hkv, group, d).permute(0, 2, 3, 1, 4)  # [B, Hkv, g, Qmax, D]
    scores = torch.matmul(qp, k.float()[:, :, None].transpose(-1, -2)) * scale  # [B, Hkv, g, Qmax, Lmax]
    visible = _visible_keys(meta, lmax)  # [B, Qmax, Lmax]
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v.float()[:, :, None])  # [B, Hkv, g, Qmax, D]
    out = out.permute(0, 3, 1, 2, 4).reshape(b, meta.max_q, hq, d).to(q.dtype)
    return out[meta.token_seq, meta.token_idx]


DECODE_ATTENTION_ENV = "MOEBUS_DECODE_ATTENTION"  # "kernel" (default) or "sdpa"
DECODE_ATTENTION_MODES = ("kernel", "sdpa")


def decode_attention_mode() -> str:
    """The mode ``MOEBUS_DECODE_ATTENTION`` names (``kernel`` when unset); ValueError for any other value."""
    return env_mode(DECODE_ATTENTION_ENV, DECODE_ATTENTION_MODES)


def decode_attention_kernel(q_heads: int, kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `paged_attention_sdpa` runs decode batches of this shape through the paged decode
    attention kernel: on CUDA, for shapes the kernel takes, unless ``MOEBUS_DECODE_ATTENTION=sdpa``."""
    return decode_attention_mode() == "kernel" and device.type == "cuda" and kernel_supports(q_heads, kv_heads, head_dim, page_size, dtype) is None


def prepare_decode_attention(q_heads: int, kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Compile the decode attention kernels `paged_attention_sdpa` will run for this shape (all of
    them: a warm-up's short contexts would not reach the split-context combine); False when
    decode batches of this shape keep the gather + SDPA path."""
    if not decode_attention_kernel(q_heads, kv_heads, head_dim, page_size, dtype, device):
        return False
    return prepare_paged_decode_attention(q_heads, kv_heads, head_dim, page_size)


def paged_attention_sdpa(q: torch.Tensor, cache: PagedKVCache, layer: int, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """`paged_attention` through fused kernels, in q's dtype (the GPU path).

    A decode batch (one query per sequence, flat tokens in sequence order) runs the paged
    decode attention kernel where `decode_attention_kernel` says so, else `folded_attention`;
    a batch with several queries per sequence (prefill) runs `_prefill_attention`.
    """
    t, hq, d = q.shape
    if meta.num_seqs == 0:
        return q.new_zeros((t, hq, d))
    pool = cache.pools[layer]
    if meta.max_q == 1 and t == meta.num_seqs and decode_attention_kernel(hq, pool.shape[2], d, pool.shape[3], q.dtype, q.device):
        return paged_decode_attention(q, pool, meta.page_tables, meta.context_lens, scale)
    if meta.max_q > 1:
        return _prefill_attention(q, cache, layer, meta, scale)
    return folded_attention(q, cache, layer, meta, scale)


def folded_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Gather + SDPA of a whole batch at once: the query heads sharing a KV head are folded
    into the query rows (``[B, Hkv, g * Qmax, D]``), so it is plain multi-head attention with a
    ``[B, g * Qmax, Lmax]`` mask, which SDPA's memory-efficient kernel takes (no K/V copy per
    query head). `paged_attention_sdpa`'s path for decode batches the kernel does not take;
    on prefill batches the mask grows with queries x keys (``bench.prefill_attention`` times it)."""
    t, hq, d = q.shape
    k, v = cache.gather(layer, meta.page_tables)  # [B, Hkv, Lmax, D]
    b, hkv, lmax, _ = k.shape
    group, max_q = hq // hkv, meta.max_q
    qp = _padded_queries(q, meta).view(b, max_q, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, group * max_q, d)
    visible = _visible_keys(meta, lmax)[:, None, None].expand(b, 1, group, max_q, lmax).reshape(b, 1, group * max_q, lmax)
    out = F.scaled_dot_product_attention(qp, k, v, attn_mask=visible, scale=scale)  # [B, Hkv, g * Qmax, D]
    out = out.view(b, hkv, group, max_q, d).permute(0, 3, 1, 2, 4).reshape(b, max_q, hq, d)
    return out[meta.token_seq, meta.token_idx]


# Prefill batches of few queries per sequence run as decode batches (`queries_as_decode_attention`):
# up to AS_DECODE_MAX_QUERIES per sequence where the batch's cached tokens are at least its new ones (a
# prefix-cache hit), up to AS_DECODE_FRESH_MAX_QUERIES otherwise. Measured on one H200 (bench.prefill_attention,
# the GPU's own time), one query a CTA (7757fe48ef32): after 1024-4096 cached tokens the decode route took
# 0.07-0.86x the varlen call's time up to 32 new tokens a sequence (64 prompts of 4 after 4096: 310 against
# 2832 us at 30B heads); at 48 with 8 or 64 prompts 1.2-1.3x at 30B heads (8 query heads per KV head: half
# the kernel's 16 MMA rows idle) and 0.74-0.82x at 235B heads (16 per KV head). With two 30B queries a CTA
# (`as_decode_queries_per_cta`, 0129684c39f2) 48 new tokens took 0.62-0.83x (64 x 48 after 1024: 615 against
# 792 us; one prompt of 48, one query a CTA: 0.60-0.64x); 64 was not measured with them (one query a CTA:
# 1.55-1.7x at 30B heads, 1.0-1.09x at 235B). Fresh prompts, whose context grows with their own length, gained at
# 4 new tokens (64 x 4: 16.8 against 51.5 us), were within 8% either way at 16 (8 x 16: 10.2 against 12.5 us;
# 64 x 16: 60.0 against 55.6) and lost 1.3-1.9x at 32 with 8 or 64 prompts (64 x 32: 120 against 63 us).
# One sequence alone runs a flash call of its own (`per_sequence_prefill_attention`) past
# AS_DECODE_ONE_SEQUENCE_MAX_QUERIES new tokens after a cached context, past AS_DECODE_FRESH_MAX_QUERIES without one.
# FlashAttention-2's batched kernel splits a long context over CTAs where its query blocks are few (its split
# heuristic; the times below bear it out), where the varlen kernel runs one CTA per 128 queries and query head, each
# walking the whole context, and leaves most SMs idle. One H200, the GPU's own time (bench.prefill_attention,
# 149267955909), Qwen3-30B heads, one prompt after 16384 cached: 24 / 32 / 64 / 128 new tokens took 90 / 90 / 92 /
# 146 us that way against the decode route's 158 / 161 / 305 / 293 and the varlen call's 548-554; after 1024 cached
# the decode route kept a lead up to 32 (18.7 against 21.1 us at 24) and lost from 40; at 235B heads after 16384
# the two were level at 24-32 (144 against 145 us) and 16 stayed with the decode route (78 against 144). With 3
# sequences a call each lost to the decode route up to 40 new tokens after 4096 (139 against 89 us at 40) and to
# the varlen call after 1024 (60-74 against 58-61 us at 40-128), so batches of several keep those routes. In
# whole forwards (bench.prefill_step, 16 of Qwen3-30B's layers, FP8 experts, graphed, after 4096 cached; each arm
# from its own tree, B N N B, 6540701a47ef against a02b4b8f509f) one prompt of 64 / 128 / 512 new tokens took 4.43 /
# 4.44-4.45 / 6.59 ms of GPU time a call per sequence against the varlen call's 6.04-6.05 / 6.26-6.27 / 7.12-7.13,
# but 24 took 3.77 against the decode route's 3.56-3.57 (the single-layer bench had the call ahead there, perhaps
# from K/V left in L2 between its repetitions); 48 took 4.27 against the decode route's 4.61 (149267955909), 32 ran
# the decode route in both arms (3.78). Hence one sequence's own cap.
AS_DECODE_MAX_QUERIES = 48
AS_DECODE_FRESH_MAX_QUERIES = 16
AS_DECODE_ONE_SEQUENCE_MAX_QUERIES = 32


def _prefill_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """`paged_attention_sdpa` of a batch with several queries per sequence: the route
    `prefill_attention_route` picks."""
    if meta.prefill_route is None:
        meta.prefill_route = prefill_attention_route(meta, q.shape[1], cache.pools[layer].shape, q.dtype, q.device)
    if meta.prefill_route == "as_decode":
        return queries_as_decode_attention(q, cache, layer, meta, scale)
    if meta.prefill_route == "per_sequence":
        return per_sequence_prefill_attention(q, cache, layer, meta, scale)
    return varlen_prefill_attention(q, cache, layer, meta, scale)


def prefill_attention_route(meta: AttentionMetadata, q_heads: int, pool_shape: torch.Size, dtype: torch.dtype, device: torch.device) -> str:
    """How `_prefill_attention` runs a prefill batch:

    * ``"as_decode"`` for few queries per sequence (after a cached context at least as long as the new tokens
      `AS_DECODE_MAX_QUERIES`, or `AS_DECODE_ONE_SEQUENCE_MAX_QUERIES` for one sequence alone;
      `AS_DECODE_FRESH_MAX_QUERIES` otherwise), on CUDA where the decode kernel takes the shape
      (`decode_attention_kernel`);
    * else ``"per_sequence"`` for one sequence, and off CUDA;
    * else ``"varlen"``."""
    _, _, hkv, page_size, d = pool_shape
    new = meta.token_seq.shape[0]
    few_new = meta.max_q <= AS_DECODE_FRESH_MAX_QUERIES
    if not few_new and meta.max_q <= (AS_DECODE_MAX_QUERIES if meta.num_seqs > 1 else AS_DECODE_ONE_SEQUENCE_MAX_QUERIES):
        few_new = sum(length - n for n, length in meta.host_lens) >= new if meta.host_lens is not None else False
    if few_new and new <= MAX_GRID_DIM and decode_attention_kernel(q_heads, hkv, d, page_size, dtype, device):
        return "as_decode"
    return "per_sequence" if device.type != "cuda" or meta.num_seqs == 1 else "varlen"


def queries_as_decode_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """A prefill batch through the paged decode attention kernel, every query a decode query of its own.

    Query ``i`` of ``n`` after ``L - n`` cached tokens sees keys ``0 .. L - n + i``: the keys a decode
    query with context ``L - n + i + 1`` sees, so the batch is a decode batch over the same pages
    (`QueriesAsDecode`), a sequence's queries sharing a CTA as far as its 16 MMA rows hold their heads
    (2 at Qwen3-30B's 8 query heads per KV head, 1 at 235B's 16). Each CTA reads its sequence's K/V
    again (from L2 when they run together), but the kernel splits every context over CTAs, where
    the varlen flash call runs one CTA per 128 queries and query head and walks the whole
    context in it: a prefix-cache hit with a short suffix leaves that call a few dozen CTAs.
    """
    t, hq, d = q.shape
    pool = cache.pools[layer]
    if meta.as_decode is None:
        meta.as_decode = QueriesAsDecode.build(meta, as_decode_queries_per_cta(t, hq, pool.shape[2], q.device))
    view = meta.as_decode
    if view.rows.shape[1] == 1:  # one query a CTA: places are the queries in order, no gather either way
        return paged_decode_attention(q, pool, view.page_tables, view.context_lens.view(-1), scale)
    out = paged_multi_query_attention(q[view.rows], pool, view.page_tables, view.context_lens, scale)  # [P, per_cta, Hq, D]
    return out.view(-1, hq, d)[view.slots]


def as_decode_queries_per_cta(num_queries: int, q_heads: int, kv_heads: int, device: torch.device) -> int:
    """How many queries of a sequence `queries_as_decode_attention` gives one kernel CTA: as many as their
    heads fill (`kernels.paged_attention.queries_per_cta`) once a CTA per query and KV head would already
    fill the GPU (`CTAS_PER_SM_TARGET` per SM), else 1. Measured on one H200 (bench.prefill_step, 16 of
    Qwen3-30B's layers graphed after 1024 cached tokens, 68139045cc1e): two queries a CTA took 4.19-4.20 /
    4.81 / 4.18-4.19 ms of GPU time at 8x16 / 32x8 / 4x32 new tokens against one's 4.40 / 5.23-5.25 /
    4.41 (64a08ec7448a), but 2.37-2.38 / 3.28 at 1x8 / 1x32 against 2.21-2.22 / 3.14: with few queries,
    halving the CTAs and the extra packing copies cost more than the K/V reads saved."""
    if device.type != "cuda" or num_queries * kv_heads < CTAS_PER_SM_TARGET * sm_count(device):
        return 1
    return queries_per_cta(q_heads, kv_heads)


def varlen_prefill_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """A prefill batch in one gather and one call (CUDA).

    A sequence's ``n`` queries follow ``L - n`` cached tokens: query ``i`` sees keys ``0 .. L - n + i``,
    the causal mask aligned to the bottom right. Every sequence's ``L`` keys are gathered from the
    pages into one ``[K, kv_heads, D]`` K and V (one row gather, `PrefillKeys`), then one
    variable-length flash attention call (FlashAttention-2's varlen kernel, whose causal mask is
    bottom-right, GQA native) runs the whole batch: no mask tensor, no K/V copy per query head, and
    no launch per sequence. The loop it replaced (page gather + SDPA per sequence) cost ~0.2 ms of
    launches per prompt and layer: on one H200 (bench.prefill_attention, 30B heads, 9705db4f) 64
    prompts of 128 tokens after a shared 1024-token cached prefix took 10.2 ms per layer that way
    and 0.92 ms in the varlen call; 7 fresh prompts of 1152 tokens 1.57 ms and 0.41 ms.
    """
    if not q.is_cuda:
        raise ValueError(f"the varlen flash attention call runs on CUDA, got q on {q.device}")
    pool = cache.pools[layer]
    if meta.prefill_keys is None:
        meta.prefill_keys = PrefillKeys.build(meta, pool.shape)
    keys = meta.prefill_keys
    k, v = pool.view(-1, pool.shape[-1])[keys.rows]  # [K, kv_heads, D] each, contiguous
    return torch.ops.aten._flash_attention_forward(q.contiguous(), k, v, keys.cu_q, keys.cu_k, keys.max_q, keys.max_k, 0.0, True, False,
                                                   scale=scale)[0]


def per_sequence_prefill_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """A prefill batch a sequence at a time: the batch's pages gathered at once (`PagedKVCache.gather`),
    then each sequence's queries against its keys, causal to the bottom right: on CUDA one call of
    FlashAttention-2's batched kernel (GQA native; it splits a long context over CTAs where its query
    blocks are few), called directly rather than through SDPA's causal-bias dispatch (~0.1 ms of host
    time a call); elsewhere SDPA. One fresh prompt alone, 8k / 32k tokens, took 946 / 14054 us of GPU
    time this way against the varlen call's 1753 / 24408 (Qwen3-30B heads, one H200, 9f3109401542)."""
    if meta.host_lens is None:
        raise ValueError("prefill attention needs the batch's host_lens (ForwardBatch.build sets them)")
    if meta.page_rows is None:
        meta.page_rows = cache.page_rows(meta.page_tables)
    k, v = cache.gather(layer, meta.page_tables, meta.page_rows)  # [B, Hkv, pages * page_size, D]
    outs = []
    start = 0
    for b, (n, length) in enumerate(meta.host_lens):
        queries, k_seq, v_seq = q[start : start + n], k[b : b + 1, :, :length], v[b : b + 1, :, :length]
        if q.is_cuda:  # [1, tokens, heads, D] views; FlashAttention-2's causal mask is bottom-right
            o = torch.ops.aten._flash_attention_forward(queries[None], k_seq.transpose(1, 2), v_seq.transpose(1, 2), None, None, n, length,
                                                        0.0, True, False, scale=scale)[0][0]
        else:
            o = F.scaled_dot_product_attention(queries.transpose(0, 1)[None], k_seq, v_seq, attn_mask=causal_lower_right(n, length), scale=scale,
                                               enable_gqa=True)[0].transpose(0, 1)
        outs.append(o)
        start += n
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _padded_queries(q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """``q [T, Hq, D]`` scattered to ``[B, Qmax, Hq, D]`` (zeros where a sequence has fewer queries)."""
    qp = q.new_zeros((meta.num_seqs, meta.max_q, *q.shape[1:]))
    qp[meta.token_seq, meta.token_idx] = q
    return qp


def _visible_keys(meta: AttentionMetadata, lmax: int) -> torch.Tensor:
    """``[B, Qmax, Lmax]``: key ``j`` is visible to query ``i`` of sequence ``b`` (causal, after the cached prefix).

    Every query row sees at least key 0, so no softmax row is empty.
    """
    device = meta.context_lens.device
    query_pos = (meta.context_lens - meta.query_lens)[:, None] + torch.arange(meta.max_q, device=device)[None, :]
    return torch.arange(lmax, device=device)[None, None, :] <= query_pos[:, :, None]


def _expert(w: Linear, e: int) -> Linear:
    if isinstance(w, BlockFp8Weight):
        return BlockFp8Weight(w.weight[e], w.scale_inv[e], w.block)
    if isinstance(w, Mxfp8Weight):
        return Mxfp8Weight(w.weight[e], w.scale_e8m0[e], w.block_size)
    return w[e]


def grouped_expert_weights(w13: FusedGateUp, w2: Linear) -> dict[str, torch.Tensor | None]:
    """The weight arguments of `kernels.moe.grouped_moe` / `expert_ffn` for prepared experts.

    ``w2`` is bf16, or E4M3 in the same format as ``w13`` (FP8 block-scaled: fp32
    ``scale_inv``; MXFP8: uint8 E8M0 exponents).
    """
    if isinstance(w2, BlockFp8Weight):
        return dict(w13_interleaved=w13.weight, w2=w2.weight, w13_scale=w13.scale, w2_scale=w2.scale_inv.float())
    if isinstance(w2, Mxfp8Weight):
        return dict(w13_interleaved=w13.weight, w2=w2.weight, w13_mx_scale=w13.scale_e8m0, w2_mx_scale=w2.scale_e8m0)
    return dict(w13_interleaved=w13.weight, w2=w2)


def moe_experts(x: torch.Tensor, w13: Linear | FusedGateUp, w2: Linear, topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_start: int) -> torch.Tensor:
    """Weighted sum of this rank's experts ``[expert_start, expert_start + E_local)`` per token.

    Routing entries that name another rank's expert contribute nothing here; their
    owner adds them (all-reduce in prefill, combine in decode). Experts prepared for
    the kernels (``w13`` a `FusedGateUp`) run `kernels.moe.grouped_moe`; plain ones
    the reference below, which accumulates the weighted sum in fp32 and rounds once,
    as the grouped path's combine does.
    """
    if isinstance(w13, FusedGateUp):
        return grouped_moe(x, topk_ids=topk_ids, topk_weights=topk_weights, expert_start=expert_start,
                           **grouped_expert_weights(w13, w2))
    out = torch.zeros_like(x, dtype=torch.float32)
    local = topk_ids - expert_start
    hit = (local >= 0) & (local < w13.shape[0])
    for e in torch.unique(local[hit]).tolist():
        token, slot = torch.where(local == e)
        h = swiglu(linear(x[token], _expert(w13, e)))
        y = linear(h, _expert(w2, e)) * topk_weights[token, slot, None]
        out.index_add_(0, token, y.float())
    return out.to(x.dtype)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for the fused ``[..., 2I]`` projection (gate first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def dense_mlp(x: torch.Tensor, w13: Linear, w2: Linear) -> torch.Tensor:
    """SwiGLU MLP with the fused gate/up weight ``[2I, H]`` and down weight ``[H, I]``."""
    return linear(swiglu(linear(x, w13)), w2)
