"""`moebus openai` with vLLM's ``--api-key`` and CORS settings, against a real stack
(compose/single-node.yml, tiny model, real nats-server) whose `openai` service reads them from
``MOEBUS_OPENAI_API_KEY`` and ``MOEBUS_OPENAI_ALLOWED_ORIGINS``: the ``/v1`` paths need the key (any
of several, on frontends of their own), the probes, vLLM's ``/tokenize`` and ``/detokenize`` and
``OPTIONS`` requests do not, and a browser's preflight and every answer carry the CORS headers of an
allowed origin."""

from __future__ import annotations

import http.client
import json
import os
from collections.abc import Iterator

import pytest

from services_helpers import frontend_address, log_events, openai_frontend, stack_fixture

pytestmark = pytest.mark.slow

KEY = "sk-moebus-test-8c1f0e"
APP = "https://app.example"
stack = stack_fixture("single-node.yml", env={"MOEBUS_OPENAI_API_KEY": KEY, "MOEBUS_OPENAI_ALLOWED_ORIGINS": json.dumps([APP])})


@pytest.fixture(scope="module")
def frontend(stack) -> tuple[str, int]:
    return frontend_address(stack)


def call(addr: tuple[str, int], method: str, path: str, headers: dict[str, str] | None = None,
         body: object | None = None) -> tuple[int, dict[str, str], bytes]:
    """(status, headers with lower-case names, body) of one request."""
    conn = http.client.HTTPConnection(*addr, timeout=60)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


COMPLETION = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}


@pytest.mark.parametrize(("headers", "challenge", "says"), [
    ({}, "Bearer", "no API key"),
    (bearer("sk-wrong"), 'Bearer error="invalid_token"', "invalid API key"),
    (bearer(KEY + "x"), 'Bearer error="invalid_token"', "invalid API key"),  # the key as a prefix is no key
    ({"Authorization": f"Basic {KEY}"}, "Bearer", "no API key"),  # another scheme
])
def test_v1_paths_without_the_key_get_openais_401(frontend, headers, challenge, says):
    for method, path, body in [("GET", "/v1/models", None), ("POST", "/v1/completions", COMPLETION), ("POST", "/v1/chat/completions", {})]:
        status, got, raw = call(frontend, method, path, headers, body)
        assert status == 401 and got["www-authenticate"] == challenge, (path, status, got, raw)
        error = json.loads(raw)["error"]
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, "invalid_api_key"), error
        assert says in error["message"] and KEY not in error["message"], error


def test_the_key_is_served_and_the_probes_need_none(frontend):
    status, _, raw = call(frontend, "GET", "/v1/models", bearer(KEY))
    assert status == 200 and json.loads(raw)["object"] == "list", raw
    status, _, raw = call(frontend, "POST", "/v1/completions", {"Authorization": f"bearer {KEY}"}, COMPLETION)  # the scheme in any case
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 4, raw
    for method, path in [("GET", "/health"), ("GET", "/ping"), ("POST", "/ping"), ("GET", "/version")]:
        assert call(frontend, method, path)[0] == 200, path
    status, _, raw = call(frontend, "GET", "/metrics")  # not served, and says where it is, to a scraper holding no key
    assert status == 404 and "moebus metrics" in json.loads(raw)["error"]["message"], raw


ROTATED = ["sk-moebus-old-41d2", "sk-moebus-new-93a7"]


@pytest.fixture(scope="module", params=["flags", "variable"])
def keys_frontend(request, stack) -> Iterator[tuple[str, int]]:
    """A second frontend on the stack with two keys (vLLM's key rotation): ``--api-key K1 K2``, or
    ``MOEBUS_OPENAI_API_KEY`` as a JSON list."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOEBUS_")}  # no key of the caller's shell
    if request.param == "variable":
        env["MOEBUS_OPENAI_API_KEY"] = json.dumps(ROTATED)
    with openai_frontend(stack.url, ["--api-key", *ROTATED] if request.param == "flags" else [], env) as addr:
        yield addr


def test_any_of_several_keys_is_served_and_no_other(keys_frontend):
    for key in ROTATED:
        status, _, raw = call(keys_frontend, "GET", "/v1/models", bearer(key))
        assert status == 200 and json.loads(raw)["object"] == "list", (key, raw)
    for key in [KEY, ROTATED[0] + ROTATED[1], ""]:  # a third key, the two run together, none
        status, got, raw = call(keys_frontend, "GET", "/v1/models", bearer(key))
        assert status == 401 and got["www-authenticate"].startswith("Bearer"), (key, status, raw)
        assert not [k for k in ROTATED if k in raw.decode()], raw


def test_options_needs_no_key_as_in_vllm(frontend):
    """vLLM's key check skips every OPTIONS request, preflight or not; one that is no preflight is
    served by no route: a 405 naming the path's methods (no 401), or a 404."""
    for path, allow in [("/v1/completions", "POST"), ("/v1/models", "GET, HEAD")]:
        status, got, raw = call(frontend, "OPTIONS", path)
        assert (status, got.get("allow")) == (405, allow), (path, status, got, raw)
        assert json.loads(raw)["error"]["code"] == "method_not_allowed", raw
    status, _, raw = call(frontend, "OPTIONS", "/v1/no-such-path")
    assert status == 404 and json.loads(raw)["error"]["code"] == "unknown_url", raw
    status, _, raw = call(frontend, "GET", "/v1/no-such-path")  # any other method still needs the key first
    assert status == 401, raw


def test_tokenize_and_detokenize_need_no_key_as_in_vllm(frontend):
    """vLLM's key guards only its /v1 paths: /tokenize and /detokenize, outside, stay open."""
    status, _, raw = call(frontend, "POST", "/tokenize", body={"prompt": "Hello world"})
    assert status == 200 and json.loads(raw)["count"] == 2, raw
    status, _, raw = call(frontend, "POST", "/detokenize", body={"tokens": json.loads(raw)["tokens"]})
    assert status == 200 and json.loads(raw) == {"prompt": "Hello world"}, raw


def test_a_preflight_needs_no_key_and_allows_the_origin(frontend):
    status, got, raw = call(frontend, "OPTIONS", "/v1/chat/completions", {
        "Origin": APP, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"})
    assert (status, raw) == (200, b"OK"), (status, got, raw)
    assert (got["access-control-allow-origin"], got["vary"], got["access-control-allow-headers"], got["access-control-max-age"]) == \
        (APP, "Origin", "authorization, content-type", "600"), got
    assert "POST" in got["access-control-allow-methods"].split(", "), got
    assert "access-control-allow-credentials" not in got


def test_a_preflight_from_another_origin_is_refused(frontend):
    status, got, raw = call(frontend, "OPTIONS", "/v1/chat/completions", {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert (status, raw) == (400, b"Disallowed CORS origin") and "access-control-allow-origin" not in got, (status, got, raw)


def test_every_answer_to_an_allowed_origin_carries_it(frontend):
    origin = {"Origin": APP}
    status, got, _ = call(frontend, "GET", "/v1/models", origin)  # an error: a page can read why it was refused
    assert status == 401 and (got["access-control-allow-origin"], got["vary"]) == (APP, "Origin"), got
    status, got, _ = call(frontend, "GET", "/health", origin)
    assert status == 200 and got["access-control-allow-origin"] == APP, got
    status, got, _ = call(frontend, "GET", "/v1/models", {"Origin": "https://evil.example"} | bearer(KEY))  # served, but no page of it may read it
    assert status == 200 and "access-control-allow-origin" not in got and got["vary"] == "Origin", got
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    status, got, raw = call(frontend, "POST", "/v1/chat/completions", origin | bearer(KEY), body)
    assert status == 200 and got["content-type"] == "text/event-stream" and got["access-control-allow-origin"] == APP, got
    assert raw.decode().endswith("data: [DONE]\n\n"), raw


def test_the_key_is_in_no_log(stack, frontend):
    call(frontend, "GET", "/v1/models", bearer(KEY))
    call(frontend, "GET", "/v1/models", bearer("sk-wrong"))
    assert [e["path"] for e in log_events(stack, "http_request") if e["status"] == 401], "the refusals are logged"
    logs = {replica.instance: replica.log_path.read_text(errors="replace") for replica in stack.replicas}
    assert not [name for name, text in logs.items() if KEY in text or "sk-wrong" in text]
