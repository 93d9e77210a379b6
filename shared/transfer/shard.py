"""Shard mapping and the packed staging format.

A prefill TP rank holds KV heads ``[start, end)`` of every layer. It packs a group of
layers of one request into one contiguous chunk laid out
``[layers, 2 (K/V), heads, num_tokens, head_dim]``: token-contiguous per head, so the
chunk is independent of either side's page size. The decode rank scatters the chunk
into its reserved pages (all heads).

Both directions are two torch copy kernels per layer group, whatever the number of
pages or layers in it: one ``index_select`` (pack) or ``index_copy_`` (scatter) over
the group's full pages, and the same op over the partial last page. The bytes are
moved as 8-byte words (the head_dim row seen as int64), so the kernels handle a quarter
of the elements a bf16 copy would; the result is bit-identical by construction. This is
the UCX path's format; the same-host CUDA IPC path packs nothing (``direct_write``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.kvcache import PagedKVCache


@dataclass(frozen=True)
class KVHeadShard:
    """The global KV heads ``[start, end)`` a TP rank holds, and whether it sends them.

    When TP > num_kv_heads every head is replicated over several ranks; only the
    lowest rank of each replica group sends, so each head lands exactly once.
    """

    start: int
    end: int
    sends: bool

    @property
    def num_heads(self) -> int:
        return self.end - self.start


def kv_head_shard(tp_rank: int, tp_size: int, num_kv_heads: int) -> KVHeadShard:
    """KV heads of ``tp_rank`` in a TP group of ``tp_size`` (same split as the model's loader)."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside a TP group of {tp_size}")
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} KV heads do not split evenly over TP={tp_size}")
        per_rank = num_kv_heads // tp_size
        return KVHeadShard(tp_rank * per_rank, (tp_rank + 1) * per_rank, True)
    head = tp_rank * num_kv_heads // tp_size
    first_replica = tp_rank == 0 or (tp_rank - 1) * num_kv_heads // tp_size != head
    return KVHeadShard(head, head + 1, first_replica)


def chunk_nbytes(num_layers: int, num_heads: int, num_tokens: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one packed chunk."""
    return num_layers * 2 * num_heads * num_tokens * head_dim * dtype.itemsize


def chunk_view(buf: torch.Tensor, num_layers: int, num_heads: int, num_tokens: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """A ``uint8`` staging buffer seen as ``[layers, 2, heads, tokens, head_dim]`` of ``dtype``."""
    n = chunk_nbytes(num_layers, num_heads, num_tokens, head_dim, dtype)
    return buf[:n].view(dtype).view(num_layers, 2, num_heads, num_tokens, head_dim)


def _word_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The widest integer dtype (<= 8 bytes) every tensor can be viewed as along its last dim."""
    for word in (torch.int64, torch.int32, torch.int16):
        if all(_viewable_as(t, word) for t in tensors):
            return word
    return tensors[0].dtype


def _viewable_as(t: torch.Tensor, word: torch.dtype) -> bool:
    size = t.element_size()
    if size > word.itemsize or t.stride(-1) != 1:
        return False
    return all(x * size % word.itemsize == 0 for x in (t.shape[-1], t.storage_offset(), *t.stride()[:-1]))


def pack_layers(cache: PagedKVCache, layers: range, page_table: torch.Tensor, num_tokens: int, out: torch.Tensor) -> None:
    """Gather ``num_tokens`` tokens of every local head of ``layers`` into ``out`` (a chunk view).

    ``page_table`` (on the cache's device) lists the sequence's pages in order. One gather
    covers all full pages of the whole layer group, one the partial last page.
    """
    ps, heads = cache.layout.page_size, cache.layout.kv_heads
    full, rem = divmod(num_tokens, ps)
    src = cache.storage[layers.start : layers.stop]  # [L, pages, 2, H, ps, D]
    word = _word_dtype(src, out)
    src, out = src.view(word), out.view(word)
    dim = out.shape[-1]
    if full:
        # [L, 2, H, full*ps, D] seen page-major as [L, full, 2, H, ps, D]: one gather writes it.
        paged = out[:, :, :, : full * ps].view(len(layers), 2, heads, full, ps, dim).permute(0, 3, 1, 2, 4, 5)
        torch.index_select(src, 1, page_table[:full], out=paged)
    if rem:
        # The partial last page, same gather on its first ``rem`` tokens. A 1-element index
        # slice (page_table[full] would be a 0-d tensor, turned into an int with a device sync).
        torch.index_select(src[:, :, :, :, :rem], 1, page_table[full : full + 1], out=out[:, :, :, full * ps :].unsqueeze(1))


def scatter_layers(cache: PagedKVCache, layers: range, heads: range, page_table: torch.Tensor, num_tokens: int, chunk: torch.Tensor) -> None:
    """Write a chunk view (heads ``heads`` of ``layers``) into the pages of ``page_table``."""
    ps = cache.layout.page_size
    full, rem = divmod(num_tokens, ps)
    dst = cache.storage[layers.start : layers.stop, :, :, heads.start : heads.stop]  # [L, pages, 2, h, ps, D]
    word = _word_dtype(dst, chunk)
    dst, chunk = dst.view(word), chunk.view(word)
    dim = chunk.shape[-1]
    if full:
        paged = chunk[:, :, :, : full * ps].view(len(layers), 2, len(heads), full, ps, dim).permute(0, 3, 1, 2, 4, 5)
        dst.index_copy_(1, page_table[:full], paged)
    if rem:
        dst[:, :, :, :, :rem].index_copy_(1, page_table[full : full + 1], chunk[:, :, :, full * ps :].unsqueeze(1))
