"""Automatic prefix caching: KV pages of earlier prompts reused by later prompts that start alike.

A prefill rank keeps the *full* KV pages its prompts filled after they are done, indexed by
their chained keys (`shared.prefix_keys.page_keys`: a key names a page's whole prefix, not one
page's tokens). Partial pages (a prompt's tail) are never cached: their free slots would be
written by the next owner.

A later prompt whose leading full pages have cached keys takes those pages (`match`,
`acquire`) and runs only the rest of its tokens from that position (the runner's
``num_cached``). At least one prompt token is always left to run, because the first output
token is sampled from the last prompt row's logits.

Pages and their owners:

* *running*: allocated to a request (``refs`` > 0 if also cached: several requests may share
  a cached page; a referenced page is never evicted);
* *evictable*: cached, no request holds it; it stays cached until an allocation needs a
  page and the allocator's free list is empty, then the least recently released goes first
  (`alloc`). A request releases its pages deepest first, so a prefix loses its tail before
  its head (a page whose parent is gone is unreachable by `match`, which walks from the
  first page);
* *free*: in the `PageAllocator`'s free list.

`available` = free + evictable is what an allocation may get: the cache never makes an
allocation fail that would have succeeded without it, which is also why the cache needs no
size bound of its own (it holds only pages nobody else wants yet).

Every rank of a TP group computes the same keys, so each finds its own KV heads of the same
pages under the same key (whether a rank still holds a page depends on its own evictions: the
prefill group agrees on what each prompt reuses). A caller that needs a prompt's keys for
several operations hashes once (`page_keys`) and passes them along. Disabled (``enabled=False``), `match` finds nothing and
`release` frees every page: the allocator behaves as without a cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

from schemas.internal import PrefixCacheStats
from shared.kvcache import InvalidPages, OutOfPages, PageAllocator
from shared.prefix_keys import page_keys


class PrefixCache:
    """The cached full pages of one rank's KV pool, on top of its `PageAllocator` (module doc).

    Every page a request uses goes through here: `match` + `acquire` for the cached ones,
    `alloc` for the rest, `release` when the request is done with them.
    """

    def __init__(self, allocator: PageAllocator, page_size: int, enabled: bool = True) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.enabled = enabled
        self._page_of: dict[bytes, int] = {}  # key -> cached page
        self._key_of: dict[int, bytes] = {}  # cached page -> key
        self._refs: dict[int, int] = {}  # cached page -> requests holding it
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached pages nobody holds, least recently released first
        self._lookups = self._hits = self._lookup_tokens = self._hit_tokens = self._evictions = 0

    # ------------------------------------------------------------ state

    @property
    def cached_pages(self) -> int:
        """Pages holding a cached prefix (held by requests or evictable)."""
        return len(self._key_of)

    @property
    def evictable_pages(self) -> int:
        return len(self._evictable)

    def available(self, pinned: Collection[int] = ()) -> int:
        """Pages an allocation can get now: free plus evictable, less the evictable ones in
        ``pinned`` (pages a batch being planned will reuse, so must not evict for itself)."""
        return self.allocator.num_free + len(self._evictable) - sum(1 for p in set(pinned) if p in self._evictable)

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(lookups=self._lookups, hits=self._hits, lookup_tokens=self._lookup_tokens, hit_tokens=self._hit_tokens,
                                evictions=self._evictions, cached_pages=self.cached_pages, evictable_pages=self.evictable_pages)

    # ------------------------------------------------------------ a request's pages

    def match(self, token_ids: Sequence[int], keys: Sequence[bytes] | None = None) -> list[int]:
        """The cached pages of the longest run of leading full pages of ``token_ids`` whose
        prefix is cached, leaving at least one token uncached. Changes nothing. ``keys``: the
        prompt's `page_keys`, when the caller has them (else hashed here)."""
        if not self.enabled or len(token_ids) <= 1:
            return []
        usable = (len(token_ids) - 1) // self.page_size  # full pages that still leave a token to run
        if keys is None:
            keys = page_keys(token_ids[: usable * self.page_size], self.page_size)
        elif len(keys) != len(token_ids) // self.page_size:
            raise InvalidPages(f"{len(keys)} page keys for a prompt of {len(token_ids) // self.page_size} full pages")
        pages: list[int] = []
        for key in keys[:usable]:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def acquire(self, pages: Sequence[int], prompt_tokens: int) -> None:
        """Hold ``pages`` (a `match` of a prompt of ``prompt_tokens`` tokens) for one request:
        they cannot be evicted until its `release`. Counted as one lookup in the stats (when enabled)."""
        unknown = [p for p in pages if p not in self._key_of]
        if unknown:
            raise InvalidPages(f"acquiring pages that are not cached: {unknown}")
        for page in pages:
            self._refs[page] += 1
            self._evictable.pop(page, None)
        if not self.enabled:
            return
        self._lookups += 1
        self._lookup_tokens += prompt_tokens
        if pages:
            self._hits += 1
            self._hit_tokens += len(pages) * self.page_size

    def alloc(self, n: int) -> list[int]:
        """``n`` fresh pages, evicting the least recently released cached pages when the free
        list is short. All or nothing: `OutOfPages` evicts nothing and allocates nothing."""
        short = n - self.allocator.num_free
        if short > len(self._evictable):
            raise OutOfPages(n, self.available())
        for _ in range(max(0, short)):
            page, _ = self._evictable.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
            del self._refs[page]
            self.allocator.free([page])
            self._evictions += 1
        return self.allocator.alloc(n)

    def release(self, token_ids: Sequence[int], page_table: Sequence[int], cached_pages: int, computed: bool,
                keys: Sequence[bytes] | None = None) -> None:
        """A request is done with its pages: ``page_table`` covers ``token_ids`` (its prompt), the
        first ``cached_pages`` of it from `match`/`acquire`, the rest from `alloc`; ``keys`` as in `match`.

        ``computed``: the K/V of every prompt token is in the pages (the forward succeeded);
        then the full pages not cached yet are cached (unless another request cached the same
        prefix first: the duplicate page is freed). The rest is freed. Held pages become
        evictable once no request holds them, deepest first (module doc)."""
        full = len(token_ids) // self.page_size
        if len(page_table) != -(-len(token_ids) // self.page_size) or not 0 <= cached_pages <= full:
            raise InvalidPages(f"page table of {len(page_table)} pages ({cached_pages} cached) does not fit a prompt of {len(token_ids)} tokens")
        if not (self.enabled and computed):
            keys = []
        elif keys is None:
            keys = page_keys(token_ids, self.page_size)
        elif len(keys) != full:
            raise InvalidPages(f"{len(keys)} page keys for a prompt of {full} full pages")
        to_free = list(page_table[full:])
        for i in reversed(range(full)):
            page = page_table[i]
            if i >= cached_pages:  # computed by this request
                if not keys or keys[i] in self._page_of:
                    to_free.append(page)
                    continue
                self._page_of[keys[i]], self._key_of[page], self._refs[page] = page, keys[i], 1
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._evictable[page] = None  # most recently released: evicted last
        if to_free:
            self.allocator.free(to_free)
