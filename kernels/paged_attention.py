"""Paged decode attention: one query per sequence against its K/V in the paged pool.

``paged_decode_attention(q, pool, page_tables, context_lens, scale)``:

* ``q`` ``[B, Hq, D]``: each sequence's one new query (the decode step);
* ``pool`` ``[num_pages, 2, Hkv, page_size, D]``: one layer's KV pool (K then V, HND inside
  a page: ``shared.kvcache.PagedKVCache``);
* ``page_tables`` ``[B, P]`` int32 or int64: each sequence's pages in order, padded with
  any valid page id; ``context_lens`` ``[B]`` int32 or int64: sequence ``b`` sees keys
  ``0 .. context_lens[b] - 1`` (a length of 0 gives zeros);
* returns ``[B, Hq, D]`` in ``q``'s dtype. GQA: query head ``i`` reads KV head ``i // (Hq / Hkv)``.

On CUDA bf16 tensors of a supported shape (``kernel_supports``: up to 16 query heads per KV
head, ``D`` 64 or 128, page sizes dividing 16 or multiples of 16) it runs the
CuTeDSL kernel (``kernels.paged_attention_sm90``): K/V read straight from the pool once,
the query heads of a KV head sharing each load through tensor-core MMAs, fp32 scores,
online softmax and accumulation, the context split over CTAs (flash-decoding) so that small
batches and long contexts fill the GPU. Lengths and page ids are read on the GPU and the
launch shape depends only on tensor shapes: it can be captured in a CUDA graph. Elsewhere
it runs ``paged_decode_attention_reference`` (fp32). Slots of a sequence's last page past
its length are read and given weight 0, so they must hold finite values (the model's
pools do: zeroed at start, then only ever written with K/V).

``paged_multi_query_attention`` runs ``n`` queries of each sequence (a prefill's new tokens after
a cached prefix, each a decode query whose context ends at its own position): where ``n`` times the
query heads per KV head fit the kernel's 16 rows, one CTA takes them all, every K/V load feeding
each of them (the query heads of a Qwen3-30B rank, 8 per KV head, fill only half the rows alone).

Kernels are compiled once per (rows per KV head, queries per CTA, head dim, page size, index widths)
and cached (``prepare_paged_decode_attention`` compiles ahead); batch, page-table width and
split count are launch arguments.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels._cute_runtime import sm_count

INDEX_DTYPES = (torch.int32, torch.int64)
MAX_GROUP = 16  # query heads per KV head: the 16 rows of the kernel's MMA tile
HEAD_DIMS = (64, 128)  # the fragment layout takes multiples of 64; larger ones would spill the accumulator
TILE = 16  # tokens per MMA tile of the kernel (the n of Q @ K^T, the k of P @ V)
# Split rule (flash-decoding): split a (sequence, KV head) over CTAs only while the CTAs stay within this
# many per SM, and no split shorter than MIN_TILES_PER_SPLIT tiles (two per warp); each split writes fp32
# partials that a second kernel merges.  Measured on one H200 (Qwen3 30B / 235B heads, contexts 512-8192,
# every split count of 1-32): with 4 KV heads, one split was fastest at 64 and 128 sequences (2 or 4 CTAs
# per SM already; the old target of 4 CTAs per SM took 2-3 splits there, 3-27% slower: 30B at 64
# sequences of 512 tokens 28.6 against 22.6 us) and four at 16 sequences (6 splits 10-40% slower than 4).
CTAS_PER_SM_TARGET = 2
MIN_TILES_PER_SPLIT = 8
MAX_GRID_DIM = 65535  # batch and KV heads are grid dimensions


class PagedAttentionError(ValueError):
    """Arguments the paged decode attention cannot take; the message names the tensor."""


def _check(cond: bool, msg: Callable[[], str]) -> None:
    # The message is built only on failure: formatting every message ahead took ~20 us of host
    # time a call, paid per layer by prefill batches that run as decode queries.
    if not cond:
        raise PagedAttentionError(msg())


def check_arguments(q: torch.Tensor, pool: torch.Tensor, page_tables: torch.Tensor, context_lens: torch.Tensor) -> None:
    """Shapes, dtypes and devices (see the module doc); raises ``PagedAttentionError``."""
    _check(q.dim() == 3, lambda: f"q must be [batch, q_heads, head_dim], got shape {tuple(q.shape)}")
    _check(pool.dim() == 5 and pool.shape[1] == 2,
           lambda: f"pool must be [num_pages, 2, kv_heads, page_size, head_dim], got shape {tuple(pool.shape)}")
    b, hq, d = q.shape
    _, _, hkv, _, pool_d = pool.shape
    _check(pool_d == d, lambda: f"pool head_dim {pool_d} differs from q's {d}")
    _check(hkv > 0 and hq % hkv == 0, lambda: f"q_heads {hq} must be a multiple of the pool's kv_heads {hkv}")
    _check(pool.dtype == q.dtype, lambda: f"pool dtype {pool.dtype} differs from q's {q.dtype}")
    _check(page_tables.dim() == 2 and page_tables.shape[0] == b and page_tables.shape[1] > 0,
           lambda: f"page_tables must be [batch={b}, pages >= 1], got shape {tuple(page_tables.shape)}")
    _check(context_lens.shape == (b,), lambda: f"context_lens must be [batch={b}], got shape {tuple(context_lens.shape)}")
    for name, t in (("page_tables", page_tables), ("context_lens", context_lens)):
        _check(t.dtype in INDEX_DTYPES, lambda: f"{name} must be int32 or int64, got {t.dtype}")
    devices = {t.device for t in (q, pool, page_tables, context_lens)}
    _check(len(devices) == 1, lambda: f"q, pool, page_tables and context_lens must be on one device, got {sorted(map(str, devices))}")


def kernel_supports(q_heads: int, kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype) -> str | None:
    """None when the CUDA kernel takes this shape, else why not (the caller keeps another path)."""
    if dtype != torch.bfloat16:
        return f"dtype {dtype} (the kernel takes bfloat16)"
    if q_heads % kv_heads or q_heads // kv_heads > MAX_GROUP:
        return f"{q_heads} query heads over {kv_heads} KV heads (the kernel takes up to {MAX_GROUP} per KV head)"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (the kernel takes {HEAD_DIMS})"
    if not (TILE % page_size == 0 or page_size % TILE == 0):
        return f"page_size {page_size} (the kernel takes divisors or multiples of {TILE})"
    return None


def choose_splits(batch: int, kv_heads: int, max_tiles: int, num_sms: int) -> int:
    """How many CTAs share one (sequence, KV head): from static shapes only (graph capturable)."""
    fits = CTAS_PER_SM_TARGET * num_sms // (batch * kv_heads)
    return max(1, min(fits, max_tiles // MIN_TILES_PER_SPLIT))


def paged_decode_attention_reference(q: torch.Tensor, pool: torch.Tensor, page_tables: torch.Tensor, context_lens: torch.Tensor,
                                     scale: float) -> torch.Tensor:
    """fp32 definition of ``paged_decode_attention`` (returns fp32): gather, mask, softmax, weighted sum."""
    check_arguments(q, pool, page_tables, context_lens)
    b, hq, d = q.shape
    _, _, hkv, ps, _ = pool.shape
    p = page_tables.shape[1]
    kv = pool[page_tables.long()].float()  # [B, P, 2, Hkv, ps, D]
    k, v = kv.permute(2, 0, 3, 1, 4, 5).reshape(2, b, hkv, p * ps, d).unbind(0)
    qf = q.float().view(b, hkv, hq // hkv, d)
    scores = torch.einsum("bhgd,bhld->bhgl", qf, k) * scale
    visible = torch.arange(p * ps, device=q.device)[None, :] < context_lens.long()[:, None]  # [B, L]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a sequence of length 0 sees nothing: zeros
    return torch.einsum("bhgl,bhld->bhgd", probs, v).reshape(b, hq, d)


def paged_decode_attention(q: torch.Tensor, pool: torch.Tensor, page_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of each sequence's one query over its paged K/V: ``[B, Hq, D]`` in q's dtype (module doc).

    ``out`` (CUDA path): where to write the result (``[B, Hq, D]``, q's dtype, contiguous).
    """
    check_arguments(q, pool, page_tables, context_lens)
    b, hq, d = q.shape
    _, _, hkv, ps, _ = pool.shape
    reason = kernel_supports(hq, hkv, d, ps, q.dtype)
    if not q.is_cuda or reason is not None:
        result = paged_decode_attention_reference(q, pool, page_tables, context_lens, scale).to(q.dtype)
        return result if out is None else out.copy_(result)
    _check(pool.is_contiguous(), lambda: f"the kernel needs a contiguous pool, got strides {pool.stride()}")
    _check(b <= MAX_GRID_DIM and hkv <= MAX_GRID_DIM, lambda: f"batch {b} or kv_heads {hkv} above the grid limit {MAX_GRID_DIM}")
    if out is None:
        out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    _check(out.shape == (b, hq, d) and out.dtype == q.dtype and out.is_contiguous(),
           lambda: f"out must be contiguous {q.dtype} {(b, hq, d)}, got {out.dtype} {tuple(out.shape)}")
    if b == 0:
        return out
    from kernels import paged_attention_sm90  # CuTeDSL is imported only on the GPU path

    splits = choose_splits(b, hkv, page_tables.shape[1] * ps // TILE, sm_count(q.device))
    paged_attention_sm90.launch(q.contiguous(), pool, page_tables.contiguous(), context_lens.contiguous(), scale, splits, out)
    return out


def queries_per_cta(q_heads: int, kv_heads: int) -> int:
    """How many queries of one sequence `paged_multi_query_attention` packs into a CTA's 16 MMA rows."""
    return max(1, MAX_GROUP // (q_heads // kv_heads))


def paged_multi_query_attention(q: torch.Tensor, pool: torch.Tensor, page_tables: torch.Tensor, context_lens: torch.Tensor,
                                scale: float) -> torch.Tensor:
    """``n`` queries per sequence as decode queries sharing the sequence's pages: ``q`` ``[B, n, Hq, D]``,
    ``context_lens`` ``[B, n]`` (query ``j`` of sequence ``b`` sees keys ``0 .. context_lens[b, j] - 1``,
    nondecreasing along ``j``: the kernel runs a sequence's tiles up to its last query's length);
    returns ``[B, n, Hq, D]`` in q's dtype.

    Where ``n`` times the query heads per KV head fit the kernel's 16 MMA rows (`queries_per_cta`), one
    CTA takes all ``n`` queries of a (sequence, KV head, split), each K/V load feeding every one of them
    (rows ``r`` of KV head ``h``: query ``r // g``'s head ``h * g + r % g``, packed here and unpacked after);
    otherwise each query runs as a sequence of its own (`paged_decode_attention`).
    """
    _check(q.dim() == 4 and q.shape[1] > 0 and context_lens.shape == q.shape[:2],
           lambda: f"q must be [batch, n >= 1, q_heads, head_dim] and context_lens [batch, n], got {tuple(q.shape)} and {tuple(context_lens.shape)}")
    b, n, hq, d = q.shape
    check_arguments(q[:, 0], pool, page_tables, context_lens[:, 0])
    _, _, hkv, ps, _ = pool.shape
    g = hq // hkv
    if not q.is_cuda or kernel_supports(n * hq, hkv, d, ps, q.dtype) is not None:  # (also when n * g > 16)
        flat = paged_decode_attention(q.reshape(b * n, hq, d), pool, page_tables.repeat_interleave(n, dim=0), context_lens.reshape(-1), scale)
        return flat.view(b, n, hq, d)
    _check(pool.is_contiguous(), lambda: f"the kernel needs a contiguous pool, got strides {pool.stride()}")
    _check(b <= MAX_GRID_DIM and hkv <= MAX_GRID_DIM, lambda: f"batch {b} or kv_heads {hkv} above the grid limit {MAX_GRID_DIM}")
    packed_q = q.reshape(b, n, hkv, g, d).transpose(1, 2).reshape(b, hkv * n * g, d)
    packed_out = torch.empty_like(packed_q)
    if b > 0:
        from kernels import paged_attention_sm90  # CuTeDSL is imported only on the GPU path

        splits = choose_splits(b, hkv, page_tables.shape[1] * ps // TILE, sm_count(q.device))
        paged_attention_sm90.launch(packed_q, pool, page_tables.contiguous(), context_lens.contiguous(), scale, splits, packed_out)
    return packed_out.view(b, hkv, n, g, d).transpose(1, 2).reshape(b, n, hq, d)


def prepare_paged_decode_attention(q_heads: int, kv_heads: int, head_dim: int, page_size: int,
                                   index_dtype: torch.dtype = torch.int64) -> bool:
    """Compile the kernels of this shape ahead of the first call (the split kernel and the combine
    of split contexts, for one query per CTA and for `paged_multi_query_attention`'s packed CTAs);
    False when the kernel does not take the shape (bf16 assumed)."""
    if kernel_supports(q_heads, kv_heads, head_dim, page_size, torch.bfloat16) is not None:
        return False
    from kernels import paged_attention_sm90

    width = torch.empty((), dtype=index_dtype).element_size()
    group, packed = q_heads // kv_heads, queries_per_cta(q_heads, kv_heads)
    paged_attention_sm90.compiled_split(group, head_dim, page_size, width, width)
    paged_attention_sm90.compiled_combine(group, head_dim)
    if packed > 1:  # `paged_multi_query_attention`'s CTAs of several queries
        paged_attention_sm90.compiled_split(group * packed, head_dim, page_size, width, width, packed)
        paged_attention_sm90.compiled_combine(group * packed, head_dim)
    return True
