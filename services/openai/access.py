"""Who may call `moebus openai`: its API key (vLLM's ``--api-key``) and browsers' cross-origin rules
(CORS, vLLM's ``--allowed-origins``, ``--allow-credentials``, ``--allowed-methods``, ``--allowed-headers``,
which vLLM hands to Starlette's CORSMiddleware: `Cors` answers as that middleware does).

With a key (or several: vLLM's ``--api-key K1 K2``, so that clients can move to a new key before the
old one is dropped), a request for a path under ``/v1`` needs ``Authorization: Bearer <key>``, any of
them; without it, or with another key, it is a 401 whose ``WWW-Authenticate`` says ``Bearer`` (RFC
6750). The other paths (``/health``, ``/ping``, ``/version``, vLLM's ``/tokenize`` and
``/detokenize``, and the 404 that says where ``/metrics`` is) stay open, as vLLM leaves them, for
probes and scrapers that hold no key; so does every ``OPTIONS`` request, as vLLM's key check skips
them all: CORS preflights (`Cors.preflight`), which browsers send without credentials, and the
others too, which no route serves (a 405 naming the methods the path takes, or a 404). They reach no
model and tell only the route table, public as OpenAI's API is; answering them as vLLM does keeps a
client or proxy that probes with ``OPTIONS`` seeing the same answers from both servers.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from services.http import HttpError, Request
from shared.settings import OpenAISettings

GUARDED_PREFIX = "/v1"
# Starlette's: what "*" in allowed_methods stands for, the request headers a browser may always send,
# and how long a browser may keep a preflight's answer.
ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
SAFELISTED_HEADERS = frozenset({"accept", "accept-language", "content-language", "content-type"})
MAX_AGE_S = 600


def guarded(path: str) -> bool:
    """Whether ``path`` needs the API key: ``/v1`` and what is under it."""
    return path == GUARDED_PREFIX or path.startswith(GUARDED_PREFIX + "/")


class ApiKey:
    """The keys every guarded request must carry one of (`check`)."""

    def __init__(self, keys: list[str]) -> None:
        # Compared as SHA-256 digests: hmac.compare_digest takes the same time for any two digests,
        # where comparing the keys themselves would give away the key's length.
        self._digests = [hashlib.sha256(key.encode()).digest() for key in keys]

    def check(self, req: Request) -> None:
        """`HttpError` 401 unless ``req``, for a guarded path and not ``OPTIONS``, says ``Authorization:
        Bearer <one of the keys>``. The message never repeats what the client sent."""
        if req.method == "OPTIONS" or not guarded(req.path):
            return
        scheme, _, given = req.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise HttpError(401, "no API key: send it as 'Authorization: Bearer <key>' (the key of moebus openai --api-key)",
                            {"WWW-Authenticate": "Bearer"})
        # Header values are read as latin-1: encoding them back gives the bytes sent, a key of UTF-8 bytes too.
        digest = hashlib.sha256(given.encode("latin-1")).digest()
        # Every key compared, none skipped once one matched: the time taken does not tell which key it was.
        if sum(hmac.compare_digest(digest, mine) for mine in self._digests) == 0:
            raise HttpError(401, "invalid API key", {"WWW-Authenticate": 'Bearer error="invalid_token"'})


@dataclass(frozen=True)
class Preflight:
    """The answer to a CORS preflight: 200, or 400 naming what the policy refuses."""

    status: int
    body: bytes
    headers: dict[str, str]


class Cors:
    """A cross-origin policy, as Starlette's CORSMiddleware applies it."""

    def __init__(self, origins: list[str], credentials: bool, methods: list[str], headers: list[str]) -> None:
        self.any_origin = "*" in origins
        self.origins = frozenset(origins)
        self.credentials = credentials
        self.methods = ALL_METHODS if "*" in methods else tuple(methods)
        self.any_header = "*" in headers
        self.headers = SAFELISTED_HEADERS | {h.lower() for h in headers}
        # An answer names the origin it allows (and varies with it) unless every origin is allowed
        # without credentials: a browser refuses "*" on an answer to a request with credentials.
        self.explicit = not self.any_origin or credentials

    @classmethod
    def of(cls, settings: OpenAISettings) -> Cors:
        return cls(settings.allowed_origins, settings.allow_credentials, settings.allowed_methods, settings.allowed_headers)

    def allows(self, origin: str) -> bool:
        return self.any_origin or origin in self.origins

    def answer_headers(self, req: Request) -> dict[str, str]:
        """The CORS headers of any answer to ``req``, an error or a stream included: none without an
        ``Origin``; ``Vary: Origin`` where the answer depends on it; the allowed origin (or "*")."""
        origin = req.headers.get("origin")
        if origin is None:
            return {}
        headers = {"Vary": "Origin"} if self.explicit else {}
        if self.allows(origin):
            headers["Access-Control-Allow-Origin"] = origin if self.explicit else "*"
            if self.credentials:
                headers["Access-Control-Allow-Credentials"] = "true"
        return headers

    def preflight(self, req: Request) -> Preflight | None:
        """The answer to ``req`` when it is a preflight (``OPTIONS`` with ``Origin`` and
        ``Access-Control-Request-Method``), else None: 200 with the methods and headers allowed, or
        400 ``Disallowed CORS origin, method, headers`` (those refused), as Starlette answers."""
        origin, method = req.headers.get("origin"), req.headers.get("access-control-request-method")
        if req.method != "OPTIONS" or origin is None or method is None:
            return None
        headers = self.answer_headers(req) | {"Access-Control-Allow-Methods": ", ".join(self.methods), "Access-Control-Max-Age": str(MAX_AGE_S)}
        refused = [] if self.allows(origin) else ["origin"]
        if method not in self.methods:
            refused.append("method")
        requested = req.headers.get("access-control-request-headers")
        if self.any_header:
            if requested is not None:  # "*" is no wildcard on an answer to a request with credentials: the headers asked for
                headers["Access-Control-Allow-Headers"] = requested
        else:
            headers["Access-Control-Allow-Headers"] = ", ".join(sorted(self.headers))
            if requested is not None and any(h.strip().lower() not in self.headers for h in requested.split(",")):
                refused.append("headers")
        if refused:
            return Preflight(400, f"Disallowed CORS {', '.join(refused)}".encode(), headers)
        return Preflight(200, b"OK", headers)
