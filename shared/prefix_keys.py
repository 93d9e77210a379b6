"""The keys of a prompt's full KV pages: what a prefill rank's prefix cache (`shared.prefix_cache`)
stores pages under, and what the scheduler's prefix affinity hashes (services/scheduler/registry.py).

Page ``i`` of a prompt is keyed by ``blake2b(key of page i - 1, token ids of page i)`` (the first
page's parent is the empty key). A key therefore names a whole prefix, not one page's tokens: the
same tokens after a different prefix never match, because their K/V differ. Partial pages (a
prompt's tail) have no key.

A request's ``cache_salt`` (vLLM's: prefix-cache isolation between tenants, so that one cannot
learn from its cache hits what another's prompts were) is the first page's parent instead:
the salt hashed under a personalization of its own, so that no salted key is
the key of an unsalted prefix, nor of one with another salt. Requests share pages exactly when
they have the same salt (or none) and the same leading pages.

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


def _salt_key(salt: str | None) -> bytes:
    """The parent of a prompt's first page: empty without a salt, else the salt's own key (module doc)."""
    if salt is None:
        return b""
    return hashlib.blake2b(salt.encode(), digest_size=KEY_BYTES, person=b"moebus-salt").digest()


def page_keys(token_ids: Sequence[int], page_size: int, salt: str | None = None) -> list[bytes]:
    """The chained key of every full page of ``token_ids`` under ``salt`` (module doc), in order."""
    tokens = array("q", token_ids)  # int64, packed once for every page
    if sys.byteorder != "little":
        tokens.byteswap()
    raw, step = tokens.tobytes(), page_size * tokens.itemsize
    keys: list[bytes] = []
    parent = _salt_key(salt)
    for start in range(0, len(token_ids) // page_size * step, step):
        parent = hashlib.blake2b(parent + raw[start : start + step], digest_size=KEY_BYTES).digest()
        keys.append(parent)
    return keys
