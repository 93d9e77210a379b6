"""The retry headers of `moebus openai`'s errors (`services.openai.retries`), against a real stack
(compose/single-node.yml, tiny model, real nats-server) whose gateway takes one request at a time
(``max_in_flight`` 1: a second one is ``overloaded`` at once) and gives each a deadline of 3 s
(``default_timeout_ms``: a long generation is a ``timeout``). OpenAI's SDK retries 408, 409, 429 and
5xx unless ``x-should-retry`` says otherwise, and waits ``retry-after-ms`` / ``Retry-After``."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable

import pytest

from services.openai.retries import retry_headers

from services_helpers import frontend_address, run, session, stack_fixture

pytestmark = pytest.mark.slow

DEADLINE_MS = 3000
stack = stack_fixture("single-node.yml", env={"MOEBUS_GATEWAY_MAX_IN_FLIGHT": "1", "MOEBUS_GATEWAY_DEFAULT_TIMEOUT_MS": str(DEADLINE_MS)})
RETRY_HEADERS = ("x-should-retry", "retry-after", "retry-after-ms")
# Longer than any deadline here at the tiny model's pace; EOS ignored, so it cannot end early.
LONG = {"prompt": "Count slowly:", "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
# Refused by the gateway: at once `overloaded` while its place is taken (it counts requests in flight
# first), else `invalid_request`; it never takes the place itself.
PROBE = {"prompt": "hi", "max_tokens": 0}


@pytest.fixture(scope="module")
def frontend(stack) -> tuple[str, int]:
    return frontend_address(stack)


def call(addr: tuple[str, int], body: object, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], dict]:
    """(status, headers with lower-case names, decoded body) of one POST /v1/completions."""
    conn = http.client.HTTPConnection(*addr, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, json.loads(raw) if raw.startswith(b"{") else {"raw": raw.decode()}
    finally:
        conn.close()


def in_background(fn: Callable[[], tuple[int, dict[str, str], dict]]) -> Callable[[], tuple[int, dict[str, str], dict]]:
    """Run ``fn`` in a thread; the returned function waits for its result."""
    result: list[tuple[int, dict[str, str], dict]] = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()

    def wait() -> tuple[int, dict[str, str], dict]:
        thread.join(timeout=60)
        assert result, "the request did not end"
        return result[0]

    return wait


def overloaded_while_one_runs(frontend: tuple[str, int], body: object) -> tuple[int, dict[str, str], dict]:
    """The answer to ``body`` (a `PROBE`) once the gateway's one place is taken (503: the long request
    started in the background is in flight)."""
    deadline = time.monotonic() + 10
    while True:
        status, headers, answer = call(frontend, body)
        if status == 503:
            return status, headers, answer
        assert time.monotonic() < deadline, f"the long request never took the gateway's place: {status} {answer}"
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [False, True])
def test_overloaded_says_when_to_retry_and_a_timeout_not_to(frontend, stream):
    """While one request runs, another is `overloaded` (503, retried by the SDK) with Retry-After
    (seconds) and retry-after-ms; the running one ends in its deadline, `timeout` (504), which the SDK
    would retry but for ``x-should-retry: false``. A stream refused before its first event gets the
    same headers."""
    long = in_background(lambda: call(frontend, LONG))
    _, headers, answer = overloaded_while_one_runs(frontend, PROBE | {"stream": stream})
    ended = long()  # before any assertion: a failure must not leave the gateway's place taken for the next test
    assert answer["error"]["code"] == "overloaded", answer
    assert (headers.get("retry-after"), headers.get("retry-after-ms"), headers.get("x-should-retry")) == ("1", "1000", None), headers
    status, headers, answer = ended
    assert (status, answer["error"]["code"]) == (504, "timeout"), (status, answer)
    assert headers.get("x-should-retry") == "false" and "retry-after" not in headers and "retry-after-ms" not in headers, headers


def test_a_cancelled_request_is_not_to_be_retried(stack, frontend):
    """A request cancelled through llm.cancel is a 409, which the SDK retries (a lock timeout) unless told not to."""
    cancelled = in_background(lambda: call(frontend, LONG, {"X-Request-Id": "retry-cancelled"}))
    overloaded_while_one_runs(frontend, PROBE)  # the long request is in flight

    async def cancel() -> None:
        async with session(stack.url) as (client, _):
            await client.cancel("retry-cancelled", "cancelled by the test")

    run(cancel())
    status, headers, answer = cancelled()
    assert (status, answer["error"]["code"]) == (409, "cancelled"), (status, answer)
    assert headers.get("x-should-retry") == "false" and "retry-after" not in headers, headers


def test_refusals_of_the_request_as_sent_carry_no_retry_header(frontend):
    """A 400 is not retried by the SDK anyway: no header says otherwise."""
    status, headers, answer = call(frontend, PROBE)
    assert (status, answer["error"]["code"]) == (400, "invalid_request"), (status, answer)
    assert not [h for h in RETRY_HEADERS if h in headers], headers


def test_internal_errors_and_codes_without_a_status_are_not_to_be_retried():
    """`internal` (500: a bug, which the same request meets again) and a code the frontend has no
    status for (answered as `internal`) say ``x-should-retry: false``; `unavailable` leaves the 503 to the SDK's backoff."""
    assert retry_headers("internal") == retry_headers("no_such_code") == {"x-should-retry": "false"}
    assert retry_headers("unavailable") == retry_headers("invalid_request") == {}

