"""The keys of a prompt's full KV pages: what a prefill rank's prefix cache (`shared.prefix_cache`)
stores pages under, and what the scheduler's prefix affinity hashes (services/scheduler/registry.py).

Page ``i`` of a prompt is keyed by ``blake2b(key of page i - 1, token ids of page i)`` (the first
page's parent is the empty key). A key therefore names a whole prefix, not one page's tokens: the
same tokens after a different prefix never match, because their K/V differ. Partial pages (a
prompt's tail) have no key.

Keys are computed with blake2b (128 bits) over the token ids as little-endian int64, so every
process computes the same keys: the ranks of a TP group, each holding its own KV heads of the same
pages, find the same pages under the same key, and a scheduler computes the key a prefill instance
will look up. Hashing a prompt of 1152 tokens takes ~0.1 ms, so a caller that needs its keys for
several operations hashes once and passes them along.

This module imports nothing of the model runtime: the scheduler, which never imports torch, uses it.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

KEY_BYTES = 16


def page_keys(token_ids: Sequence[int], page_size: int) -> list[bytes]:
    """The chained key of every full page of ``token_ids`` (module doc), in order."""
    tokens = array("q", token_ids)  # int64, packed once for every page
    if sys.byteorder != "little":
        tokens.byteswap()
    raw, step = tokens.tobytes(), page_size * tokens.itemsize
    keys: list[bytes] = []
    parent = b""
    for start in range(0, len(token_ids) // page_size * step, step):
        parent = hashlib.blake2b(parent + raw[start : start + step], digest_size=KEY_BYTES).digest()
        keys.append(parent)
    return keys
