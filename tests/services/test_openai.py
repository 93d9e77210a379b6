"""`moebus openai` against a real stack (compose/single-node.yml, tiny model, real nats-server):
the OpenAI endpoints answer what `llm.generate` answers, streams are well-formed server-sent
events, bad requests get OpenAI error objects with the right status, and a client that hangs
up mid-stream cancels its request."""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
import torch

from schemas.api import ChatMessage, GenerateRequest
from services.client import GenerateError
from services.common import moebus_version
from services_helpers import (CHAT_NO_OP_FIELDS, NO_OP_FIELDS, cancelled_requests, frontend_address, log_events, openai_frontend, run, session,
                              stack_fixture, until)

pytestmark = pytest.mark.slow

stack = stack_fixture("single-node.yml")  # its `openai` service is what these tests call


@pytest.fixture(scope="module")
def frontend(stack) -> tuple[str, int]:
    """The compose file's `openai` service of the running stack (on a free port)."""
    return frontend_address(stack)


def call(addr: tuple[str, int], method: str, path: str, body: object | None = None) -> tuple[int, str, bytes]:
    """(status, content type, body) of one request."""
    conn = http.client.HTTPConnection(*addr, timeout=60)
    try:
        payload = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        conn.request(method, path, body=payload, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type", ""), resp.read()
    finally:
        conn.close()


def events(raw: bytes) -> list[str]:
    """The ``data:`` payloads of a server-sent-events body, in order."""
    chunks = raw.decode().split("\n\n")
    assert chunks[-1] == "", "the stream must end with a complete event"
    assert all(c.startswith("data: ") for c in chunks[:-1]), chunks
    return [c.removeprefix("data: ") for c in chunks[:-1]]


def reference(stack, **fields) -> object:
    async def go():
        async with session(stack.url) as (client, _):
            return await client.generate(GenerateRequest(**fields))

    return run(go())


def test_models_lists_the_served_model(frontend, tiny_model):
    status, ctype, body = call(frontend, "GET", "/v1/models")
    assert status == 200 and ctype == "application/json"
    data = json.loads(body)
    assert data["object"] == "list" and [m["id"] for m in data["data"]] == [tiny_model.name]
    card = data["data"][0]
    # vLLM's card, whose max_model_len clients (Open WebUI, LiteLLM, guidellm) read
    assert (card["object"], card["owned_by"], card["root"], card["parent"], card["max_model_len"]) == ("model", "moebus", tiny_model.name, None, 4096)
    assert [p["object"] for p in card["permission"]] == ["model_permission"] and card["permission"][0]["allow_sampling"] is True
    assert call(frontend, "GET", "/health")[:1] == (200,)


def test_models_say_when_the_frontend_started(frontend):
    """A model card's `created` (and its permission's) is a Unix time, as vLLM's is, not 0: when
    this frontend started serving, the same in every answer."""
    cards = []
    for _ in range(2):
        status, _, body = call(frontend, "GET", "/v1/models")
        assert status == 200, body
        cards.append(json.loads(body)["data"][0])
        time.sleep(1.1)  # a time taken at each call would differ
    created = cards[0]["created"]
    assert type(created) is int and time.time() - 3600 < created <= time.time(), created
    assert [c["created"] for c in cards] + [c["permission"][0]["created"] for c in cards] == [created] * 4, cards


def test_ping_and_version_answer_as_vllms(frontend):
    assert call(frontend, "GET", "/ping")[:1] == call(frontend, "POST", "/ping")[:1] == (200,)
    assert call(frontend, "PUT", "/ping")[0] == 405
    status, ctype, body = call(frontend, "GET", "/version")
    assert (status, ctype, json.loads(body)) == (200, "application/json", {"version": moebus_version()})


def test_completion_matches_the_native_api(stack, frontend):
    prompt = "The capital of France is"
    status, _, body = call(frontend, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert status == 200, body
    got = json.loads(body)
    ref = reference(stack, prompt=prompt, max_tokens=12, temperature=0.0)
    assert got["object"] == "text_completion" and got["id"].startswith("cmpl-")
    assert got["choices"][0]["text"] == ref.text and got["choices"][0]["finish_reason"] == ref.finish_reason
    assert got["usage"] == {"prompt_tokens": ref.usage.prompt_tokens, "completion_tokens": ref.usage.completion_tokens,
                            "total_tokens": ref.usage.prompt_tokens + ref.usage.completion_tokens,
                            "prompt_tokens_details": {"cached_tokens": 0}}  # shorter than a KV page: nothing to reuse
    ids = [785, 6722, 315, 9625, 374]  # a token-id prompt goes through as input_ids
    status, _, by_ids = call(frontend, "POST", "/v1/completions", {"prompt": ids, "max_tokens": 12, "temperature": 0})
    assert status == 200, by_ids
    assert json.loads(by_ids)["choices"][0]["text"] == reference(stack, input_ids=ids, max_tokens=12, temperature=0.0).text


def test_openai_and_vllm_fields_at_their_no_op_values_are_served_as_if_absent(frontend):
    """A user trial's clients sent OpenAI's store, metadata, service_tier, modalities,
    reasoning_effort and prediction, and vLLM's extensions at their defaults: each was a 400
    "unknown field". Both endpoints now answer such a body as they answer it without them."""
    for path, body, fields in (("/v1/completions", {"prompt": "The capital of France is"}, NO_OP_FIELDS),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, CHAT_NO_OP_FIELDS)):
        body |= {"max_tokens": 6, "temperature": 0}
        answers = [call(frontend, "POST", path, b) for b in (body, body | fields)]
        assert [status for status, _, _ in answers] == [200, 200], answers
        plain, with_fields = (json.loads(raw)["choices"][0] for _, _, raw in answers)
        assert with_fields == plain


def test_skip_special_tokens_false_spells_them_in_the_text(frontend, tokenizer):
    """vLLM's skip_special_tokens over HTTP, on both endpoints: a completion pushed onto <|im_start|> by
    logit_bias has it three times in its text with false, and nowhere by default (before: a 400)."""
    (im_start,) = tokenizer.encode("<|im_start|>")
    for path, body in (("/v1/completions", {"prompt": "The capital of France is"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        body |= {"max_tokens": 3, "temperature": 0, "logit_bias": {str(im_start): 100}}
        texts = []
        for fields in ({"skip_special_tokens": False}, {}):
            status, _, raw = call(frontend, "POST", path, body | fields)
            assert status == 200, raw
            choice = json.loads(raw)["choices"][0]
            texts.append(choice["text"] if "text" in choice else choice["message"]["content"])
        assert texts == ["<|im_start|>" * 3, ""], (path, texts)


def test_a_priority_under_the_default_fcfs_policy_is_a_400_naming_the_setting(frontend):
    """vLLM's `priority` reaches the scheduler from both endpoints: 0 (or null) is served, another value is
    refused as vLLM refuses it without `--scheduling-policy priority`, a 400 saying which setting enables it."""
    for path, body in (("/v1/completions", {"prompt": "The capital of France is"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        body |= {"max_tokens": 2, "temperature": 0}
        assert [call(frontend, "POST", path, body | {"priority": p})[0] for p in (0, None)] == [200, 200]
        status, _, raw = call(frontend, "POST", path, body | {"priority": 3})
        error = json.loads(raw)["error"]
        assert status == 400 and "priority scheduling is not enabled" in error["message"], raw
        assert "MOEBUS_SCHEDULER_SCHEDULING_POLICY=priority" in error["message"], raw


def test_repetition_penalty_matches_transformers(stack, frontend, hf_greedy):
    """vLLM's extension field, end to end: greedy with repetition_penalty equals transformers'
    generate(repetition_penalty=...) on the same checkpoint, and differs from plain greedy. The
    tiny random model never repeats a token greedily within 24 steps, so a penalty above 1
    changes nothing there; one below 1 rewards the prompt's tokens, which shows."""
    ids = [785, 6722, 315, 9625, 374]
    penalised = hf_greedy(tuple(ids), 24, 0.3)
    assert penalised != hf_greedy(tuple(ids), 24)
    body = {"prompt": ids, "max_tokens": 24, "temperature": 0, "repetition_penalty": 0.3}
    status, _, raw = call(frontend, "POST", "/v1/completions", body)
    assert status == 200, raw
    native = reference(stack, input_ids=ids, max_tokens=24, temperature=0.0, repetition_penalty=0.3)
    assert native.token_ids == penalised
    assert json.loads(raw)["choices"][0]["text"] == native.text


def test_a_top_k_past_the_vocabulary_is_top_k_off_and_fails_no_batch(frontend):
    """top_k at or past the vocabulary keeps every token, as vLLM takes any int: the answer is
    top_k 0's, and requests running beside it are untouched. Such a k went to the ranks as given:
    one past 2**63 overflowed the prefill's int64 tensors and failed its whole batch (a 500 for
    every request batched with it), one past 2**64 the gateway's msgpack encoding (a 500)."""
    body = {"prompt": [785, 6722, 315], "max_tokens": 4, "temperature": 1.0, "seed": 11}
    status, _, raw = call(frontend, "POST", "/v1/completions", body | {"top_k": 0})
    assert status == 200, raw
    want = json.loads(raw)["choices"][0]["text"]
    bodies = [body | {"top_k": k} for k in (151936, 2**63, 10**30)] + [{"prompt": f"bystander {i}", "max_tokens": 4} for i in range(4)]
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda b: call(frontend, "POST", "/v1/completions", b), bodies))
    assert [status for status, _, _ in answers] == [200] * len(bodies), [raw[:200] for _, _, raw in answers]
    assert [json.loads(raw)["choices"][0]["text"] for _, _, raw in answers[:3]] == [want] * 3


def test_a_temperature_below_1e_5_is_greedy_as_in_vllm(frontend):
    """vLLM samples greedily below a temperature of 1e-5. Here the sampler divided its float32
    logits by any temperature above 0: by one below ~1e-38 they were infinite, their softmax NaN,
    and every step picked token 0 ("!!!!!!" for a 6-token answer)."""
    body = {"prompt": [785, 6722, 315], "max_tokens": 6}
    answers = [call(frontend, "POST", "/v1/completions", body | {"temperature": t}) for t in (0, 1e-6, 1e-300)]
    assert [status for status, _, _ in answers] == [200] * 3, answers
    texts = [json.loads(raw)["choices"][0]["text"] for _, _, raw in answers]
    assert texts[1:] == [texts[0]] * 2, texts


def test_a_top_p_below_float32s_least_keeps_the_most_likely_token(frontend):
    """top_p keeps at least the most likely token (as vLLM's does), however small: the sampler's
    float32 top_p of 1e-300 was 0, which dropped every token, and every step picked token 0."""
    body = {"prompt": [785, 6722, 315], "max_tokens": 6}
    answers = [call(frontend, "POST", "/v1/completions", body | fields) for fields in ({"temperature": 0}, {"temperature": 1.0, "top_p": 1e-300})]
    assert [status for status, _, _ in answers] == [200] * 2, answers
    texts = [json.loads(raw)["choices"][0]["text"] for _, _, raw in answers]
    assert texts[1] == texts[0], texts


def test_streamed_chat_is_the_unary_chat_in_pieces(stack, frontend, tiny_model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Say hi"}]}]
    request = {"messages": messages, "max_tokens": 10, "temperature": 0}
    status, _, body = call(frontend, "POST", "/v1/chat/completions", request)
    assert status == 200, body
    unary = json.loads(body)
    ref = reference(stack, messages=[ChatMessage("system", "Be brief."), ChatMessage("user", "Say hi")], max_tokens=10, temperature=0.0)
    assert unary["object"] == "chat.completion" and unary["choices"][0]["message"] == {"role": "assistant", "content": ref.text}

    status, ctype, raw = call(frontend, "POST", "/v1/chat/completions", request | {"stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and ctype == "text/event-stream"
    payloads = events(raw)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] and c["model"] == tiny_model.name for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    pieces = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(p["delta"].get("content", "") for p in pieces) == ref.text
    assert [p["finish_reason"] for p in pieces if p["finish_reason"]] == [ref.finish_reason]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == ref.usage.completion_tokens


def test_continuous_usage_stats_put_each_choices_usage_so_far_on_every_chunk(stack, frontend):
    """vLLM's ``stream_options: {"include_usage": true, "continuous_usage_stats": true}`` (what guidellm
    sends on every streamed request; it was a 400): every chunk carries its choice's usage so far (chat's
    role chunk: none generated yet), the last chunk of a choice its whole usage, and the usage chunk the
    sum; without include_usage, no usage at all, as in vLLM."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    for path, body in (("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 1.0, "seed": 3, "n": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0})):
        unary = json.loads(call(frontend, "POST", path, body)[2])
        status, _, raw = call(frontend, "POST", path, body | {"stream": True, "stream_options": options})
        assert status == 200, raw
        chunks = [json.loads(p) for p in events(raw)[:-1]]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == unary["usage"]
        for i, want in enumerate(unary["choices"]):
            mine = [c for c in chunks[:-1] if c["choices"][0]["index"] == i]
            prompt = unary["usage"]["prompt_tokens"]
            assert all(c["usage"]["prompt_tokens"] == prompt for c in mine)
            counts = [c["usage"]["completion_tokens"] for c in mine]
            assert all(c["usage"]["total_tokens"] == prompt + n for c, n in zip(mine, counts))
            assert counts == sorted(counts) and counts[-1] == (5 if path == "/v1/completions" else 4)
            if path == "/v1/chat/completions":
                assert mine[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""} and counts[0] == 0
            assert mine[-1]["choices"][0]["finish_reason"] == want["finish_reason"]
        status, _, raw = call(frontend, "POST", path, body | {"stream": True, "stream_options": {"continuous_usage_stats": True}})
        assert status == 200 and not any("usage" in json.loads(p) for p in events(raw)[:-1])


@pytest.mark.parametrize("path, body, status, code, says", [
    ("/v1/completions", b"{not json", 400, "invalid_request", "request body: JSON is malformed"),
    ("/v1/completions", b"[1, 2]", 400, "invalid_request", "request body: Expected `object`, got `array`"),
    ("/v1/completions", {"max_tokens": 1}, 400, "invalid_request", "request body: Object missing required field `prompt`"),
    ("/v1/completions", {"prompt": 5}, 400, "invalid_request", "request body: Expected `str | array`, got `int` - at `$.prompt`"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "invalid_request", "Expected `int | null`, got `str` - at `$.max_tokens`"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "invalid_request", "request body: Expected `array`, got `str` - at `$.messages`"),
    ("/v1/completions", {"prompt": "hi", "best_off": 2}, 400, "invalid_request", "best_off"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, 400, "invalid_request", "n must be in [1, 16]"),
    # n x prompts past max_choices (256): one request could fill much of the scheduler's queue (max_queued)
    ("/v1/completions", {"prompt": ["hi"] * 17, "n": 16, "max_tokens": 1}, 400, "invalid_request", "n x prompts = 16 x 17 = 272 choices"),
    ("/v1/completions", {"prompt": "hi", "best_of": 2}, 400, "invalid_request", "not supported by moebus: best_of"),
    ("/v1/completions", {"prompt": "hi", "guided_choice": ["yes", "no"]}, 400, "invalid_request",
     "not supported by moebus: guided_choice (accepted only as null)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low"}, 400, "invalid_request",
     "not supported by moebus: reasoning_effort (accepted only as null)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "store": True}, 400, "invalid_request",
     "not supported by moebus: store (accepted only as null or false)"),
    # completions' `logprobs` is the number of alternatives: named as sent (it is moebus's top_logprobs)
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "invalid_request", "logprobs (alternatives per token) must be an integer in [0, 20], got 21"),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, 400, "invalid_request",
     "logprobs (alternatives per token) must be an integer in [0, 20], got -1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, 400, "invalid_request",
     "top_logprobs must be an integer in [0, 20], got 21"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "invalid_request",
     "top_logprobs needs logprobs: true"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, 400, "invalid_request", "presence_penalty must be in [-2, 2]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "invalid_request", "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "invalid_request", "only text parts"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "stream_options": {"include_usage": True}}, 400, "invalid_request",
     "Stream options can only be defined when `stream=True`."),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stream": False,
                              "stream_options": {"include_usage": False}},
     400, "invalid_request", "Stream options can only be defined when `stream=True`."),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "unknown_model", "gpt-4"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**6}, 400, "invalid_request", "max_tokens"),
    # OpenAI's and vLLM's words for a request too long for the context, which LiteLLM and CrewAI match
    ("/v1/completions", {"prompt": "hello " * 4093, "max_tokens": 5}, 400, "invalid_request",
     "This model's maximum context length is 4096 tokens. However, you requested 4099 tokens (4094 in the prompt, 5 for max_tokens)."),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * 5000}]}, 400, "invalid_request",
     "This model's maximum context length is 4096 tokens. However, the prompt has 5009 tokens"),
    # max_tokens past the context alone (the tiny model's 4096, which gateway.max_tokens_limit, 4096, does not
    # undercut): the same words, as vLLM's; it was "max_tokens must be in [1, 4095], got 4096", which LiteLLM misses
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4096}, 400, "invalid_request",
     "This model's maximum context length is 4096 tokens. However, you requested 4097 tokens (1 in the prompt, 4096 for max_tokens)."),
    # Each of these three was a 500: msgspec's RecursionError; a template variable nested too deep for
    # the chat template (the gateway's `internal`); json.loads, which let a lone surrogate into a
    # request the frontend then could not encode.
    ("/v1/completions", b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, "invalid_request", "request body: nested too deeply"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": ' + b"[" * 900 + b"]" * 900 + b"}}",
     400, "invalid_request", "x: nested deeper than 64 levels"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": "\\ud800"}'}}]}]},
     400, "invalid_request", "messages[1].tool_calls[0].function.arguments: not JSON"),
])
def test_bad_requests_get_openai_errors(frontend, path, body, status, code, says):
    got, ctype, raw = call(frontend, "POST", path, body)
    error = json.loads(raw)["error"]
    assert (got, ctype, error["code"]) == (status, "application/json", code), raw
    assert list(error) == ["message", "type", "param", "code"] and error["param"] is None  # OpenAI's and vLLM's error object
    assert says in error["message"]


def test_a_short_request_is_answered_while_a_long_prompt_is_tokenized(frontend):
    """The gateway tokenizes a long prompt on a worker thread so that the rest keep flowing. tokenizers'
    `encode` held the GIL for all of it: a prompt near the 8 MiB body limit (1.38M tokens, 4-5 s on the
    2-core CPU host) stopped the gateway's event loop, so a short request sent meanwhile was answered
    only after the long one's refusal (and every stream through that gateway stalled as long)."""
    body = json.dumps({"prompt": "hello world " * 690_000, "max_tokens": 5}).encode()
    answered: dict[str, float] = {}

    def long_prompt() -> bytes:
        with socket.create_connection(frontend, timeout=120) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
            raw = b"".join(iter(lambda: s.recv(1 << 16), b""))
        answered["long"] = time.monotonic()
        return raw

    with ThreadPoolExecutor(1) as pool:
        refused = pool.submit(long_prompt)
        time.sleep(0.5)  # its body is in and the gateway tokenizes it (~0.1 s after sending, seconds of work)
        status, _, raw = call(frontend, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        answered["short"] = time.monotonic()
        assert status == 200, raw
        head, _, error = refused.result().partition(b"\r\n\r\n")
    # and the long prompt gets its 400: its tokenizing (seconds) no longer outlasts the keepalives
    # the frontend's client waits for (three 2 s intervals), which made it a 503 `unavailable`
    assert head.startswith(b"HTTP/1.1 400 ") and b"This model's maximum context length is 4096 tokens" in error, head + error[:300]
    assert answered["short"] < answered["long"], "the short request waited for the long prompt's tokenization"


def test_head_is_answered_wherever_get_is(stack, frontend):
    """HEAD (a load balancer's health check, e.g. HAProxy's `option httpchk HEAD /health`, an uptime monitor,
    `curl -I`) was a 405 on every path of both frontends, so such a check marked a serving stack down; RFC 9110
    9.1 has every general-purpose server take it, and vLLM's server does. It gets the GET's head, length
    included, and no body: the next request on the same connection is read right."""
    addresses = {"/health": frontend, "/ping": frontend, "/version": frontend, "/v1/models": frontend,
                 "/metrics": frontend_address(stack, "metrics-0")}
    for path, addr in addresses.items():
        conn = http.client.HTTPConnection(*addr, timeout=60)
        try:
            conn.request("HEAD", path)
            head = conn.getresponse()
            assert (head.status, head.read()) == (200, b""), (path, head.status)
            conn.request("GET", path)  # on the same connection: no stray body bytes before its answer
            get = conn.getresponse()
            body = get.read()
            assert get.status == 200 and get.getheader("Content-Type") == head.getheader("Content-Type"), path
            if path in ("/version", "/v1/models"):  # the same answer each time: the same length
                assert int(head.getheader("Content-Length")) == len(body), path
        finally:
            conn.close()
    conn = http.client.HTTPConnection(*frontend, timeout=60)
    try:
        conn.request("HEAD", "/v1/completions")  # a path that takes POST only
        resp = conn.getresponse()
        assert (resp.status, resp.getheader("Allow"), resp.read()) == (405, "POST", b"")
    finally:
        conn.close()


def test_bad_http_gets_status_codes(stack, frontend):
    def allowed(addr: tuple[str, int], method: str, path: str) -> tuple[int, str | None]:
        conn = http.client.HTTPConnection(*addr, timeout=60)
        try:
            conn.request(method, path)
            resp = conn.getresponse()
            resp.read()
            return resp.status, resp.getheader("Allow")
        finally:
            conn.close()

    # a 405 names the methods the path takes (RFC 9110 15.5.6; vLLM's server does), in both frontends
    assert allowed(frontend, "GET", "/v1/completions") == (405, "POST")
    assert allowed(frontend, "DELETE", "/ping") == (405, "GET, POST, HEAD")
    assert allowed(frontend_address(stack, "metrics-0"), "DELETE", "/metrics") == (405, "GET, HEAD")
    assert call(frontend, "GET", "/v2/anything")[0] == 404
    with socket.create_connection(frontend, timeout=10) as s:  # a digit int() does not read (was a 500)
        s.sendall("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ²\r\n\r\n".encode("latin-1"))
        assert s.recv(4096).startswith(b"HTTP/1.1 400 ")
    with socket.create_connection(frontend, timeout=10) as s:  # a body announced far above the limit is refused unread
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 413 ")
    # A client that sends its whole body without waiting for 100 Continue (Python's http.client,
    # httpx, hence the openai SDK) reads the 413, not a connection reset.
    status, ctype, raw = call(frontend, "POST", "/v1/completions", b"x" * (9 << 20))
    assert (status, ctype) == (413, "application/json"), raw
    assert json.loads(raw)["error"] == {"message": f"request body of {9 << 20} bytes exceeds this server's limit of {8 << 20} bytes (8 MiB)",
                                        "type": "invalid_request_error", "param": None, "code": "request_too_large"}
    # The access log has a line for each of them (written once a handler has unwound: wait for it).
    run(until(lambda: {e["status"] for e in log_events(stack, "http_request")} >= {400, 404, 405, 413}, "the frontend logged every status"))


@pytest.mark.parametrize("request_bytes, status, code", [
    (b"GET /v2/anything HTTP/1.1\r\nHost: x\r\n\r\n", 404, "unknown_url"),  # OpenAI's code for an unknown path
    (b"PUT /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 405, "method_not_allowed"),
    ("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: \u00b2\r\n\r\n".encode("latin-1"), 400, "invalid_request"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n", 413, "request_too_large"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", 408, "request_timeout"),  # headers that never end (10 s)
], ids=["404", "405", "400", "413", "408"])
def test_http_errors_carry_a_code_as_every_other_error_does(frontend, request_bytes, status, code):
    """The HTTP layer's refusals are OpenAI error objects with a string code, as the stack's errors
    are (clients and gateways in front switch on it); they carried null."""
    with socket.create_connection(frontend, timeout=30) as s:
        s.sendall(request_bytes)
        answer = b""
        while data := s.recv(65536):  # the refusal closes the connection
            answer += data
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 %d " % status) and b"Content-Type: application/json" in head, head
    error = json.loads(body)["error"]
    assert (error["code"], error["type"], error["param"]) == (code, "invalid_request_error", None), error


def test_vllms_metrics_path_names_where_the_metrics_are(frontend):
    """vLLM serves /metrics on its API port, so Prometheus configs and curl habits point there: the
    404 says that `moebus metrics` serves them (it listed the routes alone)."""
    status, _, raw = call(frontend, "GET", "/metrics")
    error = json.loads(raw)["error"]
    assert (status, error["code"]) == (404, "unknown_url")
    assert error["message"].startswith("no route '/metrics' (Prometheus metrics are served by `moebus metrics` on a port of its own")


def post(addr: tuple[str, int], body: dict, headers: dict[str, str] | None = None, path: str = "/v1/completions") -> tuple[int, str | None, bytes]:
    """(status, X-Request-Id header, body) of one POST with ``headers``."""
    conn = http.client.HTTPConnection(*addr, timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"} | (headers or {}))
        resp = conn.getresponse()
        return resp.status, resp.getheader("X-Request-Id"), resp.read()
    finally:
        conn.close()


def test_answers_name_their_request_id_in_x_request_id_and_take_the_clients(stack, frontend):
    """vLLM's X-Request-Id: every answer of a completion endpoint (unary, stream, error) names its
    request id in the header, the one in the body's id; a client's header that is a valid id is
    that id, through the gateway (whose log names it)."""
    status, rid, raw = post(frontend, {"prompt": "hi", "max_tokens": 2})
    assert status == 200 and rid and json.loads(raw)["id"] == f"cmpl-{rid}"
    status, rid, raw = post(frontend, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}, path="/v1/chat/completions")
    assert status == 200 and rid and json.loads(events(raw)[0])["id"] == f"chatcmpl-{rid}"
    status, rid, raw = post(frontend, {"prompt": "hi", "model": "gpt-4"})
    assert status == 404 and rid and json.loads(raw)["error"]["code"] == "unknown_model"

    status, rid, raw = post(frontend, {"prompt": "hi", "max_tokens": 2, "n": 2}, {"X-Request-Id": "trace-7f3a_1"})
    assert (status, rid, json.loads(raw)["id"]) == (200, "trace-7f3a_1", "cmpl-trace-7f3a_1")
    assert {"trace-7f3a_1-0", "trace-7f3a_1-1"} <= {e["request_id"] for e in log_events(stack, "completed")}  # choice ids, as for n: 2


def test_a_bodys_request_id_is_the_id_unless_an_x_request_id_header_gives_one(stack, frontend):
    """vLLM's request_id field (both endpoints; it was an unknown field, a 400): the id as the header
    would make it, and echoed; with a header too, the header's (vLLM's precedence)."""
    status, rid, raw = post(frontend, {"prompt": "hi", "max_tokens": 2, "request_id": "body-id_7"})
    assert (status, rid, json.loads(raw)["id"]) == (200, "body-id_7", "cmpl-body-id_7")
    status, rid, raw = post(frontend, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "request_id": "body-id_8"},
                            path="/v1/chat/completions")
    assert (status, rid, json.loads(raw)["id"]) == (200, "body-id_8", "chatcmpl-body-id_8")
    status, rid, raw = post(frontend, {"prompt": "hi", "max_tokens": 2, "request_id": "body-id_9"}, {"X-Request-Id": "header-id_9"})
    assert (status, rid, json.loads(raw)["id"]) == (200, "header-id_9", "cmpl-header-id_9")
    status, rid, raw = post(frontend, {"prompt": "hi", "max_tokens": 2, "request_id": "Root=1-5e1b4151/日本"})  # any value, as a header's
    assert status == 200 and re.fullmatch(r"Root_1-5e1b4151_+-[0-9a-f]{12}", rid) and json.loads(raw)["id"] == f"cmpl-{rid}"
    assert {"body-id_7", "body-id_8", "header-id_9", rid} <= {e["request_id"] for e in log_events(stack, "completed")}


def test_any_x_request_id_is_taken_echoed_and_logged_beside_the_id_made_from_it(stack, frontend):
    """vLLM takes any X-Request-Id; proxies and tracers send ids with '=', dots, colons, slashes, or
    longer than the stack's ids (AWS ALB's Root=..., a 128-hex id with a suffix), and each was a 400:
    a tracing header failed the request. Now the answer's header is the client's value, the request's
    id is made from it (the same for the same value, distinct for distinct ones, "a.b" and the valid
    "a_b" included), and the frontend's access log names both."""
    sent = ["Root=1-67891233-abcdef012345678912345678", "svc.api:v1/trace 7", "a.b", "a_b", "f" * 128 + "-retry1", "f" * 128 + "-retry2",
            "a.b"]
    ids = []
    for value in sent:
        status, rid, raw = post(frontend, {"prompt": "hi", "max_tokens": 2}, {"X-Request-Id": value})
        assert (status, rid) == (200, value), raw
        ids.append(json.loads(raw)["id"].removeprefix("cmpl-"))
    assert all(re.fullmatch(r"[A-Za-z0-9_-]{1,100}", i) for i in ids), ids
    assert ids[3] == "a_b" and ids[6] == ids[2] and len(set(ids)) == len(sent) - 1, ids
    assert set(ids) <= {e["request_id"] for e in log_events(stack, "completed")}  # the gateway ran each under its id
    run(until(lambda: set(zip(sent, ids)) <= {(e.get("client_request_id"), e["request_id"]) for e in log_events(stack, "http_request")},
              "the frontend logged each client's value beside its id"))

    # A bare LF in a value is refused by the HTTP parser (test_openai_keepalive), never written back: no
    # header smuggled into the answer.
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    with socket.create_connection(frontend, timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Request-Id: evil\nSet-Cookie: a=1\r\n"
                  + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        answer = b""
        while data := s.recv(65536):
            answer += data
    head, raw = answer.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0] == "HTTP/1.1 400 Bad Request" and not any(line.lower().startswith("set-cookie") for line in lines), head


@contextlib.contextmanager
def long_stream(addr: tuple[str, int], request_id: str | None = None, **fields: object) -> Iterator[socket.socket]:
    """A streamed completion of 3000 tokens (~15 s of the tiny model here; ``fields`` added to its body),
    sent with ``X-Request-Id: request_id`` when given, on its own connection, once its first event
    arrived; the connection closes on exit."""
    body = json.dumps({"prompt": "Count slowly:", "max_tokens": 3000, "temperature": 0, "stream": True, **fields}).encode()
    id_header = f"X-Request-Id: {request_id}\r\n" if request_id else ""
    with socket.create_connection(addr, timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"{id_header}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        received = b""
        while b"data: " not in received:
            data = s.recv(65536)
            assert data, f"connection closed before any event: {received!r}"
            received += data
        yield s


@pytest.mark.parametrize("value", ["dup-{}", "dup.{}"], ids=["valid", "derived"])
def test_a_request_id_already_in_flight_is_refused(frontend, value):
    """Two requests with the same X-Request-Id at once: the second is refused (400) while the first
    runs, as vLLM refused it before it made client ids unique inside its engine (vLLM PR 27987); a
    value the id is derived from the same way."""
    value = value.format(uuid.uuid4().hex[:12])
    with long_stream(frontend, value):  # the first one runs
        status, rid, raw = post(frontend, {"prompt": "hi", "max_tokens": 2}, {"X-Request-Id": value})
    assert (status, rid) == (400, value) and "is already in flight" in json.loads(raw)["error"]["message"], raw


def test_a_chunked_request_body_is_read_as_uvicorn_reads_it(frontend):
    """A client or proxy that streams its upload sends the body chunked (no Content-Length), which
    vLLM's server takes: the answer is the one of the same body sent whole; chunk extensions and
    trailers are allowed; a chunked body over the limit is a 413, a malformed one a 400."""
    body = json.dumps({"prompt": [785, 6722, 315], "max_tokens": 3, "temperature": 0}).encode()
    whole = json.loads(call(frontend, "POST", "/v1/completions", body)[2])["choices"][0]["text"]

    def send(raw: bytes) -> bytes:
        with socket.create_connection(frontend, timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n" + raw)
            answer = b""
            while data := s.recv(65536):
                answer += data
        return answer

    pieces = [body[:10], body[10:11], body[11:]]
    chunked = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\nX-Trailer: 1\r\n\r\n"
    answer = send(chunked)
    assert answer.startswith(b"HTTP/1.1 200 OK"), answer[:300]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["choices"][0]["text"] == whole
    assert send(b"%x\r\n" % (9 << 20) + b"x" * 100).startswith(b"HTTP/1.1 413 ")  # refused unread
    bad = send(b"zz\r\nhello\r\n0\r\n\r\n")
    assert bad.startswith(b"HTTP/1.1 400 ") and b"malformed chunk size 'zz'" in bad
    assert send(b"f" * 5000 + b"\r\n").startswith(b"HTTP/1.1 400 ")  # was a 500: its 413 message spelt the size


def test_a_client_expecting_100_continue_gets_it_before_sending_its_body(frontend):
    body = json.dumps({"prompt": "hi " * 600, "max_tokens": 2, "temperature": 0}).encode()
    with socket.create_connection(frontend, timeout=30) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nExpect: 100-continue\r\nContent-Length: {len(body)}\r\n\r\n".encode())
        assert s.recv(4096) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(body)
        answer = b""
        while data := s.recv(65536):
            answer += data
    assert answer.startswith(b"HTTP/1.1 200 OK") and json.loads(answer.split(b"\r\n\r\n", 1)[1])["usage"]["completion_tokens"] == 2


def test_client_hanging_up_mid_stream_cancels_the_request(stack, frontend):
    """The request of a client that closes its connection mid-stream is cancelled in the stack (the
    gateway ends it `cancelled` and counts it so), and the frontend logs it once, as 499. Traced by
    its own X-Request-Id, so that neither the other tests' requests nor their order matter."""
    def ends_of(request_id: str) -> list[dict]:
        """The gateway's last word on the request: `request_failed` (with its code) or `completed`."""
        return [e for name in ("request_failed", "completed") for e in log_events(stack, name) if e.get("request_id") == request_id]

    request_id = f"hangup-{uuid.uuid4().hex[:12]}"
    before = run(cancelled_requests(stack.url))
    # 3000 tokens take the tiny model ~15 s here: the hang-up comes long before the request could end.
    with long_stream(frontend, request_id):
        pass  # streaming has begun: the client hangs up (the connection closes)
    # Each hop in turn, so that a failure says which one did not happen.
    run(until(lambda: [e["request_id"] for e in log_events(stack, "openai_client_gone")].count(request_id) == 1,
              "the frontend noticed the client gone", timeout=20))
    run(until(lambda: ends_of(request_id), "the gateway ended the request", timeout=20))
    assert [(e["event"], e.get("code")) for e in ends_of(request_id)] == [("request_failed", "cancelled")], ends_of(request_id)
    deadline = time.monotonic() + 10  # the gateway's next heartbeats count it
    while run(cancelled_requests(stack.url)) == before:
        assert time.monotonic() < deadline, "the gateway ended the request cancelled but its heartbeats never counted it"
        time.sleep(0.2)
    # The frontend's access log: this request once, as 499 (client gone). Its line is written when the
    # request's handler has unwound, which may come after the gateway ended the request: wait for it.
    run(until(lambda: any(e["request_id"] == request_id for e in log_events(stack, "http_request")), "the frontend logged the request"))
    logged = [(e["status"], e["path"]) for e in log_events(stack, "http_request") if e["request_id"] == request_id]
    assert logged == [(499, "/v1/completions")]


def test_bytes_after_the_request_neither_cancel_it_nor_lose_its_answer(frontend):
    """A client that ends its body with a stray CRLF (which servers should tolerate, RFC 9112 2.2)
    still gets the answer, and the CRLF is skipped before its next request on the connection (a
    pipelined one: tests/services/test_openai_keepalive.py). Any byte after the request was once
    taken for a hang-up: the request was cancelled and the connection closed without an answer."""
    body = json.dumps({"prompt": [785, 6722, 315], "max_tokens": 3, "temperature": 0}).encode()
    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    closing = request.replace(b"Host: x\r\n", b"Host: x\r\nConnection: close\r\n")
    whole = json.loads(call(frontend, "POST", "/v1/completions", body)[2])["choices"][0]["text"]
    with socket.create_connection(frontend, timeout=30) as s:
        s.sendall(request + b"\r\n")
        first = http.client.HTTPResponse(s)  # nothing follows its answer before the next request: it reads no further
        first.begin()
        assert (first.status, first.getheader("Connection")) == (200, "keep-alive")
        assert json.loads(first.read())["choices"][0]["text"] == whole
        s.sendall(closing)
        answer = b""
        while data := s.recv(65536):
            answer += data
    assert answer.startswith(b"HTTP/1.1 200 OK") and b"Connection: close\r\n" in answer, answer[:300]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["choices"][0]["text"] == whole


# ---------------------------------------------------------------- log-probabilities and n choices


@pytest.fixture(scope="module")
def hf_log_softmax(tiny_model):
    """transformers' log_softmax over the vocabulary at each generated position (fp32, same
    checkpoint): the independent reference for the reported logprobs and alternatives."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()

    def positions(prompt_ids: list[int], generated: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + generated])).logits[0]
        return torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)

    return positions


def test_completion_logprobs_are_the_models_most_likely_tokens(stack, frontend, hf_log_softmax, tokenizer):
    """Completions' ``logprobs: 3`` (legacy format) and the native API's ``top_logprobs: 3``,
    greedy: at every position the alternatives are transformers' top 3 with their logprobs,
    the generated token is the first of them with the same logprob."""
    ids = [785, 6722, 315, 9625, 374]
    status, _, raw = call(frontend, "POST", "/v1/completions", {"prompt": ids, "max_tokens": 6, "temperature": 0, "logprobs": 3})
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    native = reference(stack, input_ids=ids, max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=3)
    generated = native.token_ids
    want_logprobs, want_ids = hf_log_softmax(ids, generated).topk(3, dim=-1)
    assert len(native.token_logprobs) == len(generated) == 6
    for pos, entry in enumerate(native.token_logprobs):
        assert [t.token_id for t in entry.top_logprobs] == want_ids[pos].tolist()
        torch.testing.assert_close(torch.tensor([t.logprob for t in entry.top_logprobs]), want_logprobs[pos], rtol=0, atol=1e-4)
        top1 = entry.top_logprobs[0]
        assert (entry.token_id, entry.logprob) == (generated[pos], native.logprobs[pos]) == (top1.token_id, top1.logprob)
    legacy = choice["logprobs"]
    assert choice["text"] == native.text and legacy["tokens"] == [tokenizer.decode([t]) for t in generated]
    assert legacy["token_logprobs"] == pytest.approx(native.logprobs, abs=1e-5)
    assert [sorted(d) for d in legacy["top_logprobs"]] == [sorted(tokenizer.decode([t]) for t in row) for row in want_ids.tolist()]
    assert legacy["text_offset"] == [len("".join(legacy["tokens"][:i])) for i in range(6)]
    # Streamed, each chunk has its tokens' part; the text offsets run on across chunks.
    status, _, raw = call(frontend, "POST", "/v1/completions", {"prompt": ids, "max_tokens": 6, "temperature": 0, "logprobs": 3, "stream": True})
    parts = [c["choices"][0]["logprobs"] for c in map(json.loads, events(raw)[:-1])]
    assert {key: [x for part in parts for x in part[key]] for key in legacy} == legacy


def test_echo_with_logprobs_gives_each_prompt_tokens_logprob_as_lm_eval_reads_it(stack, frontend, hf_log_softmax, tokenizer):
    """What lm-evaluation-harness sends for loglikelihoods (a batch of token-id prompts, echo,
    logprobs 1, max_tokens 1, greedy): each choice lists its prompt's tokens and then the
    generated one; the first prompt token has no logprob, every other one transformers'
    log_softmax given the tokens before it (teacher forcing); the text echoes the prompt; the
    native API's prompt_logprobs agree; the stream carries the same."""
    prompts = [[785, 6722, 315, 9625, 374], [9707, 11, 1879]]
    body = {"prompt": prompts, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    status, _, raw = call(frontend, "POST", "/v1/completions", body)
    assert status == 200, raw
    choices = json.loads(raw)["choices"]
    for ids, choice in zip(prompts, choices, strict=True):
        native = reference(stack, input_ids=ids, max_tokens=1, temperature=0.0, logprobs=True, prompt_logprobs=1)
        teacher = hf_log_softmax(ids[:1], ids[1:])  # row j: the distribution after ids[: j + 1]
        expected = teacher[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        lp = choice["logprobs"]
        assert lp["tokens"] == [tokenizer.decode([t]) for t in ids + native.token_ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        torch.testing.assert_close(torch.tensor(lp["token_logprobs"][1 : len(ids)]), expected, rtol=0, atol=1e-4)
        # Batched differently (float noise): measured at most 9.5e-7, one fp32 ulp at these magnitudes,
        # against transformers and across batchings (40 rounds: idle, under load, and with up to 11 other
        # prompts in the same prefill batch): 1e-4 is ~100x that, so a miss here is a real difference.
        assert lp["token_logprobs"][-1] == pytest.approx(native.logprobs[0], abs=1e-4)
        assert choice["text"] == tokenizer.decode(ids) + native.text
        assert [e.token_id for e in native.prompt_logprobs] == ids and native.prompt_logprobs[0].logprob is None
        assert [e.top_logprobs[0].token_id for e in native.prompt_logprobs[1:]] == teacher.argmax(dim=-1).tolist()
    status, _, raw = call(frontend, "POST", "/v1/completions", body | {"stream": True})
    pieces = [ch for c in map(json.loads, events(raw)[:-1]) for ch in c["choices"]]
    for i, choice in enumerate(choices):
        mine = [p for p in pieces if p["index"] == i]
        assert "".join(p["text"] for p in mine) == choice["text"]
        streamed = [x for p in mine for x in p["logprobs"]["token_logprobs"]]
        assert streamed[0] is None and streamed[1:] == pytest.approx(choice["logprobs"]["token_logprobs"][1:], abs=1e-4)
    plain = json.loads(call(frontend, "POST", "/v1/completions", {"prompt": "The capital", "max_tokens": 2, "temperature": 0, "echo": True})[2])
    assert plain["choices"][0]["text"] == "The capital" + reference(stack, prompt="The capital", max_tokens=2, temperature=0.0).text
    assert plain["choices"][0]["logprobs"] is None
    with pytest.raises(GenerateError, match="prompt_logprobs must be an integer in \\[0, 20\\], got 21"):
        reference(stack, input_ids=prompts[0], max_tokens=1, prompt_logprobs=21)


def test_echo_with_max_tokens_0_scores_the_prompt_alone(frontend, tokenizer):
    """Older lm-evaluation-harness and HELM score a text with echo and max_tokens 0, which vLLM
    serves: the answer is the prompt and its logprobs, nothing generated (the max_tokens 1 answer
    without its token; usage counts that token, as vLLM's does), unary and streamed. Without
    echo, max_tokens 0 is still a 400."""
    ids = [785, 6722, 315, 9625, 374]
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 2, "echo": True}
    one = json.loads(call(frontend, "POST", "/v1/completions", body)[2])["choices"][0]
    status, _, raw = call(frontend, "POST", "/v1/completions", body | {"max_tokens": 0})
    assert status == 200, raw
    answer = json.loads(raw)
    zero = answer["choices"][0]
    assert (zero["text"], zero["finish_reason"], answer["usage"]["completion_tokens"]) == (tokenizer.decode(ids), "length", 1)
    assert zero["logprobs"]["tokens"] == one["logprobs"]["tokens"][:-1] == [tokenizer.decode([t]) for t in ids]
    assert zero["logprobs"]["text_offset"] == one["logprobs"]["text_offset"][:-1]
    assert zero["logprobs"]["token_logprobs"][1:] == pytest.approx(one["logprobs"]["token_logprobs"][1:-1], abs=1e-4)
    status, _, raw = call(frontend, "POST", "/v1/completions", body | {"max_tokens": 0, "stream": True})
    pieces = [ch for c in map(json.loads, events(raw)[:-1]) for ch in c["choices"]]
    assert "".join(p["text"] for p in pieces) == zero["text"] and [p["finish_reason"] for p in pieces][-1] == "length"
    assert [t for p in pieces for t in p["logprobs"]["tokens"]] == zero["logprobs"]["tokens"]
    plain = json.loads(call(frontend, "POST", "/v1/completions", {"prompt": "The capital", "max_tokens": 0, "echo": True})[2])["choices"][0]
    assert (plain["text"], plain["logprobs"]) == ("The capital", None)
    status, _, raw = call(frontend, "POST", "/v1/completions", {"prompt": "The capital", "max_tokens": 0})
    assert status == 400 and "max_tokens must be in [1, " in json.loads(raw)["error"]["message"]


def test_echo_logprobs_of_a_long_prompt_come_back_though_they_exceed_nats_default_max_payload(stack, frontend):
    """lm-evaluation-harness asks for the logprobs of long prompts: 900 prompt tokens with 20
    alternatives each is a reply of about 2 MB between gateway and frontend, over nats-server's
    own default max_payload (1 MiB) but within the 8 MiB `moebus up` configures by default."""
    ids = list(range(10, 910))
    native = reference(stack, input_ids=ids, max_tokens=1, temperature=0.0, prompt_logprobs=20)
    assert len(msgspec.json.encode(native)) > 1 << 20  # the size of that reply on the bus (JSON)
    status, _, raw = call(frontend, "POST", "/v1/completions", {"prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 20, "echo": True})
    assert status == 200, raw[:500]
    lp = json.loads(raw)["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 901 and lp["top_logprobs"][0] is None and all(lp["top_logprobs"][1:])
    assert all(len(e.top_logprobs) == 20 for e in native.prompt_logprobs[1:])  # the legacy dicts merge tokens that decode alike


def test_chat_logprobs_unary_and_streamed(frontend):
    """Chat's ``logprobs`` + ``top_logprobs: 2``: one entry per completion token, OpenAI's
    fields, greedy tokens first in their lists, the tokens' bytes spell the text; streamed
    chunks carry the same entries, in order, for the tokens they took."""
    body = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    status, _, raw = call(frontend, "POST", "/v1/chat/completions", body)
    assert status == 200, raw
    unary = json.loads(raw)
    choice = unary["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == unary["usage"]["completion_tokens"]
    for entry in content:
        top = entry["top_logprobs"]
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"} and len(top) == 2 and top[0]["logprob"] >= top[1]["logprob"]
        assert {k: entry[k] for k in ("token", "logprob", "bytes")} == top[0]
    if choice["finish_reason"] == "length":  # no EOS token among them
        assert bytes(b for entry in content for b in entry["bytes"]).decode() == choice["message"]["content"]

    status, _, raw = call(frontend, "POST", "/v1/chat/completions", body | {"stream": True})
    chunks = [json.loads(p) for p in events(raw)[:-1]]
    streamed = [e for c in chunks for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
    assert streamed == content
    assert all(ch["logprobs"] is None for c in chunks for ch in c["choices"] if "role" in ch["delta"])


def test_return_tokens_as_token_ids_names_every_logprobs_token_by_its_id(stack, frontend):
    """vLLM's return_tokens_as_token_ids (a 400 before): the same greedy answers, every token of the logprobs,
    chosen and alternative, named "token_id:<id>" on both endpoints, the chosen ones the native answer's token
    ids; completions' text_offset counts those names, chat's bytes stay the tokens' own."""
    prompt = "The capital of France is"
    ref = reference(stack, prompt=prompt, max_tokens=6, temperature=0.0)
    names = [f"token_id:{t}" for t in ref.token_ids]
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 2}
    plain, by_id = (json.loads(call(frontend, "POST", "/v1/completions", body | extra)[2])["choices"][0]
                    for extra in ({}, {"return_tokens_as_token_ids": True}))
    assert by_id["text"] == plain["text"] and by_id["logprobs"]["tokens"] == names
    assert by_id["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    assert all(len(top) >= 2 and all(re.fullmatch(r"token_id:\d+", k) for k in top) for top in by_id["logprobs"]["top_logprobs"])
    assert by_id["logprobs"]["text_offset"] == [sum(map(len, names[:i])) for i in range(len(names))]
    chat = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    plain, by_id = (json.loads(call(frontend, "POST", "/v1/chat/completions", chat | extra)[2])["choices"][0]["logprobs"]["content"]
                    for extra in ({}, {"return_tokens_as_token_ids": True}))
    assert [e["bytes"] for e in by_id] == [e["bytes"] for e in plain]
    assert all(re.fullmatch(r"token_id:\d+", t["token"]) for e in by_id for t in (e, *e["top_logprobs"]))
    assert [e["token"] for e in by_id] != [e["token"] for e in plain]


def test_truncate_prompt_tokens_answers_as_the_prompts_last_tokens_and_echoes_them(stack, frontend, tokenizer):
    """vLLM's truncate_prompt_tokens over HTTP: the answer is the native one for the prompt's last 3 tokens,
    usage counts those, echo spells them (what the model saw)."""
    prompt = "Mixture-of-experts models route each token to a few experts"
    ids = tokenizer.encode(prompt)
    ref = reference(stack, input_ids=ids[-3:], max_tokens=5, temperature=0.0)
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "truncate_prompt_tokens": 3}
    status, _, raw = call(frontend, "POST", "/v1/completions", body)
    assert status == 200, raw
    answer = json.loads(raw)
    assert answer["choices"][0]["text"] == ref.text and answer["usage"]["prompt_tokens"] == 3
    echoed = json.loads(call(frontend, "POST", "/v1/completions", body | {"echo": True})[2])["choices"][0]["text"]
    assert echoed == tokenizer.decode(ids[-3:]) + ref.text
    status, _, raw = call(frontend, "POST", "/v1/completions", body | {"truncate_prompt_tokens": 0})
    assert status == 400 and "truncate_prompt_tokens" in json.loads(raw)["error"]["message"]


def test_n_choices_with_a_seed_are_reproducible(stack, frontend):
    """``n: 3`` at temperature 1 with a seed: choices 0..2 are the requests with seeds
    seed, seed+1, seed+2 (so the same body gives the same choices, and choice 0 is the n=1
    answer); usage counts the prompt once and every choice's tokens."""
    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 1.0, "seed": 1234, "n": 3}
    first, second = (json.loads(call(frontend, "POST", "/v1/completions", body)[2]) for _ in range(2))
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    assert first["choices"] == second["choices"]
    natives = [reference(stack, prompt=body["prompt"], max_tokens=6, temperature=1.0, seed=1234 + i) for i in range(3)]
    assert [c["text"] for c in first["choices"]] == [r.text for r in natives]
    assert len({r.text for r in natives}) > 1  # the seeds differ
    assert first["usage"]["prompt_tokens"] == natives[0].usage.prompt_tokens
    assert first["usage"]["completion_tokens"] == sum(r.usage.completion_tokens for r in natives)


def test_n_choices_streamed_interleave_every_index(frontend):
    """A streamed chat of ``n: 3``: each choice opens with its role, its chunks name its index,
    it finishes once, its text is the unary choice's; the usage chunk sums the choices."""
    body = {"messages": [{"role": "user", "content": "Tell a story"}], "max_tokens": 6, "temperature": 1.0, "seed": 99, "n": 3}
    unary = json.loads(call(frontend, "POST", "/v1/chat/completions", body)[2])
    status, _, raw = call(frontend, "POST", "/v1/chat/completions", body | {"stream": True, "stream_options": {"include_usage": True}})
    assert status == 200
    chunks = [json.loads(p) for p in events(raw)[:-1]]
    pieces = [ch for c in chunks for ch in c["choices"]]
    assert [p["index"] for p in pieces if p["delta"].get("role")] == [0, 1, 2]
    for i, want in enumerate(unary["choices"]):
        mine = [p for p in pieces if p["index"] == i]
        assert "".join(p["delta"].get("content", "") for p in mine) == want["message"]["content"]
        assert [p["finish_reason"] for p in mine if p["finish_reason"]] == [want["finish_reason"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == unary["usage"]


def test_batched_completion_prompts_give_n_choices_each_in_prompt_order(stack, frontend):
    """``prompt`` as a list (texts, or token-id lists) with ``n: 2``: choice ``p * 2 + i`` is the
    ``i``-th of prompt ``p``, each equal to the native request with seed ``seed + i``; usage
    counts every prompt once; the stream carries every index and the same usage."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    body = {"prompt": prompts, "max_tokens": 5, "temperature": 1.0, "seed": 7, "n": 2}
    status, _, raw = call(frontend, "POST", "/v1/completions", body)
    assert status == 200, raw
    got = json.loads(raw)
    natives = [reference(stack, prompt=p, max_tokens=5, temperature=1.0, seed=7 + i) for p in prompts for i in range(2)]
    assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in got["choices"]] == [r.text for r in natives]
    assert got["usage"]["prompt_tokens"] == natives[0].usage.prompt_tokens + natives[2].usage.prompt_tokens
    assert got["usage"]["completion_tokens"] == sum(r.usage.completion_tokens for r in natives)
    ids = [[785, 6722, 315], [9625, 374]]
    by_ids = json.loads(call(frontend, "POST", "/v1/completions", {"prompt": ids, "max_tokens": 4, "temperature": 0})[2])
    assert [c["text"] for c in by_ids["choices"]] == [reference(stack, input_ids=i, max_tokens=4, temperature=0.0).text for i in ids]
    status, _, raw = call(frontend, "POST", "/v1/completions", body | {"stream": True, "stream_options": {"include_usage": True}})
    chunks = [json.loads(p) for p in events(raw)[:-1]]
    pieces = [ch for c in chunks for ch in c["choices"]]
    for i, want in enumerate(got["choices"]):
        assert "".join(p["text"] for p in pieces if p["index"] == i) == want["text"]
    assert chunks[-1]["usage"] == got["usage"]
    for bad in ([], [1, "a"], [["x"]], [[]], ["a"] * 65):
        status, _, raw = call(frontend, "POST", "/v1/completions", {"prompt": bad, "max_tokens": 2})
        assert status == 400 and "prompt" in json.loads(raw)["error"]["message"], (bad, raw)


def test_moebus_request_shows_top_logprobs(stack):
    proc = subprocess.run([sys.executable, "-m", "services.cli", "request", "--url", stack.url, "--input-ids", "785,6722,315",
                           "--max-tokens", "3", "--temperature", "0", "--top-logprobs", "2"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 4 and lines[-1].startswith("[finish=")  # one line per token, then the summary
    assert all(" | " in line for line in lines[:3]), lines  # the token and its logprob | its two alternatives


def test_client_hanging_up_cancels_every_choice(stack, frontend):
    """An ``n: 2`` stream whose client hangs up: the frontend cancels both choices (the gateway
    fails each with the frontend's reason, not through its own dead-client probe)."""
    with long_stream(frontend, temperature=1.0, n=2):
        pass  # streaming has begun: the client hangs up
    deadline = time.monotonic() + 20
    while True:
        gone = [e["request_id"] for e in log_events(stack, "openai_client_gone")]
        choice_ids = {f"{gone[-1]}-0", f"{gone[-1]}-1"} if gone else set()
        failed = {e["request_id"]: e for e in log_events(stack, "request_failed") if e.get("request_id") in choice_ids}
        if len(failed) == 2:
            break
        assert time.monotonic() < deadline, f"the gateway did not fail both choices: {gone}, {failed}"
        time.sleep(0.5)
    assert all(e["code"] == "cancelled" and "the HTTP client closed its connection" in e["reason"] for e in failed.values()), failed


@pytest.mark.parametrize("streamed", [False, True])
def test_a_failing_choice_fails_the_answer_and_cancels_the_others(stack, streamed):
    """`Choices` against the stack: one choice refused (max_tokens out of range) while the other
    runs long; the refusal is raised and the running choice is cancelled at the gateway."""
    from services.client import GenerateError
    from services.openai.choices import Choices

    tag = "s" if streamed else "u"
    running = GenerateRequest(prompt="Count slowly:", max_tokens=3000, temperature=1.0, request_id=f"fanout-{tag}-0")
    refused = GenerateRequest(prompt="Count slowly:", max_tokens=10**6, request_id=f"fanout-{tag}-1")

    async def go() -> GenerateError:
        async with session(stack.url) as (client, _):
            choices = Choices(client, [running, refused])
            with pytest.raises(GenerateError) as e:
                if streamed:
                    async for _ in choices.chunks():
                        pass
                else:
                    await choices.responses()
            return e.value

    error = run(go())
    assert error.code == "invalid_request" and "max_tokens" in error.message
    deadline = time.monotonic() + 20
    while not (failed := [e for e in log_events(stack, "request_failed") if e.get("request_id") == running.request_id]):
        assert time.monotonic() < deadline, "the running choice was never cancelled"
        time.sleep(0.5)
    assert failed[0]["code"] == "cancelled" and "another choice of the same request failed" in failed[0]["reason"]


# ---------------------------------------------------------------- tools and reasoning (vLLM's Qwen3 flags)
# The tiny random model never writes a tool call itself: here the tools must reach the prompt,
# tool conversations must be accepted, the server's switches must hold, and a parsing frontend's
# answers must be the native text split as the qwen3 reasoning parser says (no </think> in an
# answer: all of it is reasoning). Parsing itself: tests/services/test_tool_calling.py.

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                                           "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear", "temperature": 21}'},
]


@pytest.fixture(scope="module")
def tool_prompt_tokens(tiny_model) -> int:
    """transformers' prompt of TOOL_CHAT with TOOLS (call arguments as objects, as vLLM hands them over)."""
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(tiny_model))
    messages = json.loads(json.dumps(TOOL_CHAT))
    messages[1]["content"] = ""
    messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    text = hf_tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<tools>" in text and "<tool_response>" in text
    return len(hf_tok(text, add_special_tokens=False)["input_ids"])


def native_tool_chat(stack, max_tokens: int):  # type: ignore[no-untyped-def]
    from schemas.api import Tool, ToolCall, ToolCallFunction, ToolFunction

    messages = [ChatMessage("user", "Weather in Paris?"),
                ChatMessage("assistant", "", tool_calls=[ToolCall(id="call_1", function=ToolCallFunction("get_weather", {"city": "Paris"}))]),
                ChatMessage("tool", '{"sky": "clear", "temperature": 21}', tool_call_id="call_1")]
    tool = TOOLS[0]["function"]
    tools = [Tool(function=ToolFunction(tool["name"], tool["description"], tool["parameters"]))]
    return reference(stack, messages=messages, tools=tools, max_tokens=max_tokens, temperature=0.0)


def test_tools_need_tool_parsing_unless_tool_choice_is_none(stack, frontend, tool_prompt_tokens):
    """The compose file's frontend runs without tool parsing: tools are a 400 naming the flags,
    except with tool_choice "none" (as in vLLM), where they still reach the prompt."""
    body = {"messages": TOOL_CHAT, "tools": TOOLS, "max_tokens": 6, "temperature": 0}
    status, _, raw = call(frontend, "POST", "/v1/chat/completions", body)
    assert status == 400 and "--enable-auto-tool-choice --tool-call-parser hermes" in json.loads(raw)["error"]["message"], raw
    status, _, raw = call(frontend, "POST", "/v1/chat/completions", body | {"tool_choice": "none"})
    assert status == 200, raw
    answer = json.loads(raw)
    ref = native_tool_chat(stack, 6)
    assert answer["usage"]["prompt_tokens"] == ref.usage.prompt_tokens == tool_prompt_tokens
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": ref.text}  # no parser: the text as generated


@pytest.fixture(scope="module")
def tools_frontend(stack):  # type: ignore[no-untyped-def]
    """A second frontend on the stack with vLLM's Qwen3 switches on (an OS port of its choosing)."""
    with openai_frontend(stack.url, ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]) as addr:
        yield addr


def test_a_parsing_frontend_serves_tool_conversations_with_reasoning(stack, tools_frontend, tool_prompt_tokens):
    """Tools with tool_choice "auto": the prompt is transformers' rendering with the tools; the
    answer is the native text as reasoning (it has no </think>), unary, streamed and with n = 2,
    with usage and logprobs as without parsing."""
    ref = native_tool_chat(stack, 8)
    assert not any(tag in ref.text for tag in ("<think>", "</think>", "<tool_call>"))  # the expectation below holds for tag-free text
    body = {"messages": TOOL_CHAT, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 8, "temperature": 0}
    status, _, raw = call(tools_frontend, "POST", "/v1/chat/completions", body)
    assert status == 200, raw
    answer = json.loads(raw)
    assert answer["usage"]["prompt_tokens"] == tool_prompt_tokens
    assert answer["usage"]["completion_tokens"] == ref.usage.completion_tokens
    (choice,) = answer["choices"]
    assert choice["message"] == {"role": "assistant", "content": None, "reasoning_content": ref.text.strip() or None}
    assert choice["finish_reason"] == ref.finish_reason

    stream = body | {"stream": True, "stream_options": {"include_usage": True}, "logprobs": True}
    status, _, raw = call(tools_frontend, "POST", "/v1/chat/completions", stream)
    assert status == 200, raw
    chunks = [json.loads(p) for p in events(raw)[:-1]]
    pieces = [c["choices"][0] for c in chunks if c["choices"]]
    assert pieces[0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(p["delta"].get("reasoning_content", "") for p in pieces) == ref.text.strip()
    assert not any(p["delta"].get("content") or p["delta"].get("tool_calls") for p in pieces)
    assert [p["finish_reason"] for p in pieces if p["finish_reason"]] == [ref.finish_reason]
    assert len([e for p in pieces if p["logprobs"] for e in p["logprobs"]["content"]]) == ref.usage.completion_tokens
    assert chunks[-1]["usage"]["prompt_tokens"] == tool_prompt_tokens

    status, _, raw = call(tools_frontend, "POST", "/v1/chat/completions", body | {"n": 2, "temperature": 1.0, "seed": 7})
    assert status == 200, raw
    two = json.loads(raw)
    assert [c["index"] for c in two["choices"]] == [0, 1] and two["usage"]["prompt_tokens"] == tool_prompt_tokens
    assert all(c["message"]["content"] is None and c["message"]["reasoning_content"] for c in two["choices"])

    status, _, raw = call(tools_frontend, "POST", "/v1/chat/completions", body | {"tool_choice": "required"})
    assert status == 400 and '"required" is not supported' in json.loads(raw)["error"]["message"], raw

    # thinking off (vLLM's chat_template_kwargs): the empty think block is in the prompt, the answer is content
    no_think = body | {"chat_template_kwargs": {"enable_thinking": False}}
    status, _, raw = call(tools_frontend, "POST", "/v1/chat/completions", no_think)
    assert status == 200, raw
    answer = json.loads(raw)
    assert answer["usage"]["prompt_tokens"] > tool_prompt_tokens  # "<think>\n\n</think>\n\n" added to the prompt
    assert answer["choices"][0]["message"].get("reasoning_content") is None and answer["choices"][0]["message"]["content"]

    # vLLM's include_reasoning: false: the reasoning is split off and dropped, unary and streamed
    status, _, raw = call(tools_frontend, "POST", "/v1/chat/completions", body | {"include_reasoning": False})
    assert status == 200, raw
    (choice,) = json.loads(raw)["choices"]
    assert choice["message"] == {"role": "assistant", "content": None, "reasoning_content": None}
    status, _, raw = call(tools_frontend, "POST", "/v1/chat/completions", stream | {"include_reasoning": False})
    assert status == 200, raw
    pieces = [c["choices"][0] for c in map(json.loads, events(raw)[:-1]) if c["choices"]]
    assert not any(p["delta"].get("reasoning_content") or p["delta"].get("content") for p in pieces)
    assert len([e for p in pieces if p["logprobs"] for e in p["logprobs"]["content"]]) == ref.usage.completion_tokens  # its tokens' logprobs still come

    # an answer begun by the caller (vLLM's continue_final_message): its continuation is content, not reasoning
    begun = [ChatMessage("user", "Name a colour."), ChatMessage("assistant", "My favourite colour is")]
    ref = reference(stack, messages=begun, continue_final_message=True, add_generation_prompt=False, max_tokens=8, temperature=0.0)
    status, _, raw = call(tools_frontend, "POST", "/v1/chat/completions",
                          {"messages": [{"role": m.role, "content": m.content} for m in begun], "continue_final_message": True,
                           "add_generation_prompt": False, "max_tokens": 8, "temperature": 0})
    assert status == 200, raw
    answer = json.loads(raw)
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": ref.text}  # nothing to parse: the text as generated
    assert answer["usage"]["prompt_tokens"] == ref.usage.prompt_tokens
