"""A request's moebus id from its ``X-Request-Id`` header or its body's ``request_id``, whatever the client sent.

vLLM's precedence: the header, when given, is the id; else the body's ``request_id`` (vLLM's field
of both endpoints); else a fresh one. A body's ``request_id`` is taken as the same value sent as the
header would be (below): its UTF-8 bytes, as the HTTP parser reads a header's (Latin-1).

vLLM takes any value as the request's id. Proxies and tracers send values the stack's id syntax
(`services.gateway.admission`: 1-128 letters, digits, '-', '_') does not take: AWS ALB's
``Root=1-67891233-abcdef012345678912345678``, ids with dots, colons or slashes, a 128-hex id with
a suffix. A tracing header must never fail a request, so a value that is a valid id is the id (as
in vLLM), and any other gives an id derived from it: its disallowed characters replaced, a prefix
of it when too long, and always a short hash of the whole value, so that distinct values ("a.b"
and "a_b", two long ids that differ only at their end) get distinct ids. The answer's header
echoes the client's value, which is what it correlates on (one that cannot go back as it came: the id).
"""

from __future__ import annotations

import hashlib
import re
import uuid
from dataclasses import dataclass

# The id syntax, with room for the "-<choice>" suffix of n choices and batched prompts (the gateway takes 128).
MAX_CHARS = 100
_VALID = re.compile(rf"[A-Za-z0-9_-]{{1,{MAX_CHARS}}}")
_DISALLOWED = re.compile(r"[^A-Za-z0-9_-]")
_HASH_CHARS = 12  # 48 bits: among 10,000 values in flight at once, two share an id with odds under 1e-6 (n**2 / 2**49)
# A value echoed as it came: visible ASCII, space and tab (RFC 9110 5.5). `services.http` refuses a
# head with a bare CR or LF (which, echoed, would end the answer's header and start another one), and
# a byte past ASCII would not go back as it came (the head is read as Latin-1, written as UTF-8). Any
# other value's answer names the id instead.
_ECHOED = re.compile(r"[\t\x20-\x7e]*")


@dataclass(frozen=True)
class RequestId:
    """``id``: the request's moebus id; ``header``: the answer's X-Request-Id; ``client``: the
    client's X-Request-Id, None when it sent none (logged beside ``id``)."""

    id: str
    header: str
    client: str | None


def of_request(header: str | None, body: str | None) -> RequestId:
    """The ids of a request with X-Request-Id ``header`` and body ``request_id`` ``body`` (module doc)."""
    return from_header(header or (body.encode().decode("latin-1") if body else None))


def from_header(value: str | None) -> RequestId:
    """The ids of a request whose X-Request-Id header is ``value`` (None or empty: a fresh id)."""
    if not value:
        fresh = uuid.uuid4().hex
        return RequestId(fresh, fresh, None)
    request_id = value if _VALID.fullmatch(value) else _derived(value)
    return RequestId(request_id, value if _ECHOED.fullmatch(value) else request_id, value)


def _derived(value: str) -> str:
    # The parser decoded the header as Latin-1: encoding it back gives the bytes the client sent.
    digest = hashlib.blake2b(value.encode("latin-1"), digest_size=_HASH_CHARS // 2).hexdigest()
    return f"{_DISALLOWED.sub('_', value[:MAX_CHARS - _HASH_CHARS - 1])}-{digest}"
