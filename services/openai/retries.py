"""Which errors of `moebus openai` a client should retry on its own, said in the headers that OpenAI's
Python SDK (and the clients built on it: LangChain, LlamaIndex, ...) reads.

The SDK retries an error answer (twice by default) when its ``x-should-retry`` header says
``true``; never when it says ``false``; else when its status is 408, 409, 429 or 500 and above. It
waits ``retry-after-ms`` (milliseconds), else ``Retry-After`` (seconds) when given and positive (up to
a bound: 60 s in older releases, 120 s in newer ones), else an exponential backoff from 0.5 s with
jitter. So a header is sent only where the status alone would make the SDK do the wrong thing:

============================  ======  =========================================  ==========================
moebus code                   status  headers                                    retried by the SDK
============================  ======  =========================================  ==========================
``overloaded``                503     ``Retry-After: 1``, ``retry-after-ms:      yes, after 1 s
                                      1000``
``unavailable``               503     none                                       yes (its backoff)
``timeout``                   504     ``x-should-retry: false``                  no
``cancelled``                 409     ``x-should-retry: false``                  no
``internal``                  500     ``x-should-retry: false``                  no
``invalid_request``,          400,    none                                       no
``unknown_model``             404
``invalid_api_key`` and the   401,    none                                       408 only (a request not
HTTP layer's refusals         404,                                               received in time: its
                              405,                                               resend may be)
                              408,
                              413
============================  ======  =========================================  ==========================

Why: ``overloaded`` is the stack's queue full (a gateway's ``max_in_flight``, a scheduler's
``max_queued``), or no decode rank took the request within a ``queue_wait_ms`` the operator set:
the same request fits once running ones end, which takes about a second at least
(``OVERLOADED_RETRY_AFTER_MS``). ``unavailable`` is a stage gone or restarting
(or this frontend stopping: another replica serves the retry): the SDK's own growing backoff fits a
restart of unknown length. A ``timeout`` is the request's own deadline (the gateway's
``default_timeout_ms``): a retry re-runs the whole generation under the same deadline, most likely to
the same end, and triples the work of a stack already too slow for it; the client decides (fewer
``max_tokens``, a longer deadline). ``cancelled`` is a deliberate ``llm.cancel``: a retry would undo
it (the SDK retries 409 as a lock timeout). ``internal`` is a bug or an unexpected failure: the same
request most likely meets it again, and a retry only hides it and repeats its load. A stream that
already sent its first event is answered 200 and its error comes as its last event: no client can
retry that, whatever the code.
"""

from __future__ import annotations

from services.openai.protocol import ERRORS

# The stack queues every request it can hold until its deadline (`shared.settings.SchedulerSettings`),
# so `overloaded` says thousands wait already: room comes as running requests end, over seconds, and
# a retry sooner would only add load. A whole second, as Retry-After counts in seconds; the SDK's own
# backoff without it starts at 0.5 s.
OVERLOADED_RETRY_AFTER_MS = 1000

NO_RETRY = {"x-should-retry": "false"}
HEADERS: dict[str, dict[str, str]] = {
    "overloaded": {"Retry-After": str(OVERLOADED_RETRY_AFTER_MS // 1000), "retry-after-ms": str(OVERLOADED_RETRY_AFTER_MS)},
    "timeout": NO_RETRY,
    "cancelled": NO_RETRY,
    "internal": NO_RETRY,
}


def retry_headers(code: str) -> dict[str, str]:
    """The retry headers of an error answer with moebus code ``code``; a code with no status of its
    own (none of `ERRORS`) is answered as ``internal`` (`services.openai.protocol.error_body`), so with its headers."""
    return HEADERS.get(code if code in ERRORS else "internal", {})
