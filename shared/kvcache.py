"""Paged KV cache: one pool per layer in HND layout, and the page allocator.

Pool shape per layer: ``[num_pages, 2, kv_heads, page_size, head_dim]`` (index 0 of
the second axis is K, 1 is V). Inside a page every head's tokens are contiguous, so
the block ``pool[p, kv, h0:h1]`` is one contiguous range of memory: a prefill rank
that owns heads ``[h0, h1)`` can write its share of a page with one copy (DESIGN §5).

A sequence's KV lives in the pages of its *page table* (a list of page ids, in
order); token ``t`` of the sequence is at page ``table[t // page_size]``, offset
``t % page_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class KVCacheError(Exception):
    """Base class of KV cache errors."""


class OutOfPages(KVCacheError):
    """The allocator cannot satisfy a request; nothing was allocated."""

    def __init__(self, requested: int, free: int) -> None:
        super().__init__(f"out of KV pages: requested {requested}, {free} free")
        self.requested = requested
        self.free = free


class InvalidPages(KVCacheError):
    """A page id that is out of range, duplicated, or not currently allocated."""


@dataclass(frozen=True)
class KVLayout:
    """Geometry of one rank's KV cache; the same on every layer."""

    num_layers: int
    num_pages: int
    kv_heads: int
    page_size: int
    head_dim: int
    dtype: torch.dtype

    @property
    def page_shape(self) -> tuple[int, int, int, int]:
        return (2, self.kv_heads, self.page_size, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes across all layers (K and V, all local heads)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.kv_heads * self.head_dim * elem

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)


class PageAllocator:
    """Free list of page ids. Allocation is all-or-nothing and O(n) in pages asked."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        # Pop from the end; start with low ids at the end so first allocations are 0, 1, 2...
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(n, len(self._free))
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        bad = [p for p in pages if p not in self._used]
        if bad or len(set(pages)) != len(pages):
            raise InvalidPages(f"freeing pages that are not allocated (or twice): {bad or pages}")
        self._used.difference_update(pages)
        self._free.extend(reversed(pages))


class PagedKVCache:
    """The per-layer pools of one rank plus the slot arithmetic the model uses."""

    def __init__(self, layout: KVLayout, device: torch.device | str = "cpu") -> None:
        self.layout = layout
        # One allocation for all layers, ``[layers, num_pages, 2, kv_heads, page_size, head_dim]``;
        # ``pools`` are its per-layer views. The KV transfer packs/scatters a whole group of
        # layers with one op over ``storage[l0:l1]`` instead of one per layer.
        self.storage = torch.zeros((layout.num_layers, layout.num_pages, *layout.page_shape), dtype=layout.dtype, device=device)
        self.pools: list[torch.Tensor] = list(self.storage.unbind(0))
        self.allocator = PageAllocator(layout.num_pages)

    @property
    def device(self) -> torch.device:
        return self.pools[0].device

    def slots(self, page_table: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(page id, offset in page) of each logical position of one sequence."""
        ps = self.layout.page_size
        return page_table[positions // ps], positions % ps

    def write(self, layer: int, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens. ``k``/``v``: ``[T, kv_heads, head_dim]``; pages/offsets: ``[T]``."""
        pool = self.pools[layer]
        pool[pages, 0, :, offsets, :] = k.to(pool.dtype)
        pool[pages, 1, :, offsets, :] = v.to(pool.dtype)

    def read(self, layer: int, page_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the first ``length`` tokens of one sequence, each ``[kv_heads, length, head_dim]``."""
        ps = self.layout.page_size
        n_pages = -(-length // ps)
        blocks = self.pools[layer][page_table[:n_pages]]  # [P, 2, H, ps, D]
        H, D = self.layout.kv_heads, self.layout.head_dim
        kv = blocks.permute(1, 2, 0, 3, 4).reshape(2, H, n_pages * ps, D)[:, :, :length]
        return kv[0], kv[1]

    def page_rows(self, page_tables: torch.Tensor) -> torch.Tensor:
        """The row index `gather` reads for ``page_tables`` ``[B, P]``: ``[2, B, kv_heads, P]``.

        Every layer's pool has the same shape, so a forward can build it once and pass it to
        each layer's `gather` (building it is a few small torch ops: ~60 us of host time per
        layer on an H200 host, in a prefill forward that the host's issue rate bounds).
        """
        kv_heads = self.layout.kv_heads
        kv_head = torch.arange(2 * kv_heads, device=page_tables.device).view(2, 1, kv_heads, 1)  # K/V half * H + head
        return page_tables[None, :, None, :] * (2 * kv_heads) + kv_head

    def gather(self, layer: int, page_tables: torch.Tensor, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a batch of sequences, each ``[B, kv_heads, P * page_size, head_dim]``.

        ``page_tables`` is ``[B, P]``: each row a sequence's pages, padded with any valid
        page id; the caller masks positions past each sequence's length. ``rows``:
        `page_rows` of ``page_tables``, when the caller kept it from another layer.
        """
        # One row gather straight into [2, B, H, P, ps * D]: a row is one K or V head of a
        # page (ps * D contiguous elements), so a flat row index per (K/V, sequence, head,
        # page) lets torch's vectorized dim-0 gather write K and V in the layout attention
        # reads, with no second pass. (Gathering [B, P, 2, H, ps, D] and permuting it took a
        # strided copy of 3x the gather's own time on an H200; indexing the pool along a
        # non-leading dim instead fell back to a slow generic index kernel.)
        pool = self.pools[layer]
        n_pages, two, H, ps, D = pool.shape
        b, p = page_tables.shape
        if rows is None:
            rows = self.page_rows(page_tables)
        kv = pool.view(n_pages * two * H, ps * D)[rows].view(two, b, H, p * ps, D)
        return kv[0], kv[1]
