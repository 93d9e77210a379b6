"""Logit bias, min_tokens and min_p end to end on a real stack (compose/single-node.yml, tiny
model, real nats-server): through the native API and the OpenAI frontend, on the prefill's
first token and the decode rank's steps alike."""

from __future__ import annotations

import http.client
import json

import pytest

from schemas.api import GenerateRequest
from services.client import GenerateError
from services_helpers import frontend_address, run, session, stack_fixture
from shared.model.config import GenerationConfig

pytestmark = pytest.mark.slow

stack = stack_fixture("single-node.yml")
PROMPT_IDS = [785, 6722, 315, 9625, 374]
FORCED = 1234  # a token the tiny random model does not pick greedily after PROMPT_IDS


def generate(stack, **fields):
    async def go():
        async with session(stack.url) as (client, _):
            return await client.generate(GenerateRequest(input_ids=PROMPT_IDS, **({"temperature": 0.0} | fields)))

    return run(go())


def test_logit_bias_forces_and_bans_tokens_at_every_step(stack):
    plain = generate(stack, max_tokens=8, ignore_eos=True)
    assert FORCED not in plain.token_ids
    forced = generate(stack, max_tokens=8, ignore_eos=True, logit_bias={FORCED: 100})
    assert forced.token_ids == [FORCED] * 8  # token 0 from prefill, the rest from decode
    banned = generate(stack, max_tokens=8, ignore_eos=True, logit_bias={plain.token_ids[0]: -100, plain.token_ids[3]: -100})
    assert banned.token_ids[0] != plain.token_ids[0] and plain.token_ids[3] not in banned.token_ids


def test_min_tokens_holds_off_eos(stack, tiny_model):
    eos = GenerationConfig.from_dir(tiny_model).eos_token_ids[0]
    at_once = generate(stack, max_tokens=8, logit_bias={eos: 100})
    assert at_once.token_ids == [eos] and at_once.finish_reason == "stop"
    held = generate(stack, max_tokens=8, logit_bias={eos: 100}, min_tokens=5)
    assert len(held.token_ids) == 6 and held.token_ids[-1] == eos and eos not in held.token_ids[:5] and held.finish_reason == "stop"


def test_bad_controls_are_typed_errors(stack):
    for fields, says in [({"logit_bias": {10**7: 1.0}}, "outside the vocabulary"), ({"min_tokens": 9}, "min_tokens"),
                         ({"min_p": -0.5}, "min_p")]:
        with pytest.raises(GenerateError) as e:
            generate(stack, max_tokens=8, **fields)
        assert e.value.code == "invalid_request" and says in e.value.message


def _openai_completion(stack, body: dict) -> dict:  # type: ignore[no-untyped-def]
    """POST ``body`` (prompt PROMPT_IDS unless it says otherwise) to the stack's /v1/completions; the 200 answer."""
    conn = http.client.HTTPConnection(*frontend_address(stack), timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": PROMPT_IDS} | body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        status, answer = resp.status, json.loads(resp.read())
    finally:
        conn.close()
    assert status == 200, answer
    return answer


def test_openai_logit_bias_and_vllms_min_fields_reach_the_ranks(stack, tiny_model):
    def complete(**fields) -> dict:
        return _openai_completion(stack, {"max_tokens": 6} | fields)

    forced = complete(temperature=0, ignore_eos=True, logit_bias={str(FORCED): 100})
    assert forced["choices"][0]["text"] == generate(stack, max_tokens=6, ignore_eos=True, logit_bias={FORCED: 100}).text
    assert forced["usage"]["completion_tokens"] == 6
    # min_p 1 keeps only the most likely token: a sampled request becomes greedy
    greedy = generate(stack, max_tokens=6, ignore_eos=True).text
    assert complete(temperature=1.0, seed=7, ignore_eos=True)["choices"][0]["text"] != greedy  # the draw itself is not greedy
    assert complete(temperature=1.0, seed=7, ignore_eos=True, min_p=1.0)["choices"][0]["text"] == greedy
    eos = GenerationConfig.from_dir(tiny_model).eos_token_ids[0]
    held = complete(temperature=0, logit_bias={str(eos): 100}, min_tokens=3)
    assert held["usage"]["completion_tokens"] == 4 and held["choices"][0]["finish_reason"] == "stop"


def test_stop_token_ids_end_generation_and_include_stop_str_in_output_keeps_them(stack):
    """vLLM's stop_token_ids and include_stop_str_in_output through the OpenAI frontend: the
    greedy answer stops at its 4th token when that token is a stop id (counted, its text left
    out unless asked for), and with ignore_eos too; a stop string is kept the same way; vLLM's
    stop_reason names the stop token or string."""
    def complete(**fields) -> dict:
        body = _openai_completion(stack, {"max_tokens": 8, "temperature": 0} | fields)
        return body["choices"][0] | {"completion_tokens": body["usage"]["completion_tokens"]}

    plain = generate(stack, max_tokens=8, ignore_eos=True)
    stop_id = plain.token_ids[3]
    assert stop_id not in plain.token_ids[:3]
    before, through = generate(stack, max_tokens=3).text, generate(stack, max_tokens=4).text
    cut = complete(stop_token_ids=[stop_id], ignore_eos=True)
    assert (cut["text"], cut["finish_reason"], cut["stop_reason"], cut["completion_tokens"]) == (before, "stop", stop_id, 4)
    kept = complete(stop_token_ids=[stop_id], include_stop_str_in_output=True)
    assert (kept["text"], kept["finish_reason"], kept["stop_reason"], kept["completion_tokens"]) == (through, "stop", stop_id, 4)
    stop = through[len(before):]  # the 4th token's text as a stop string
    assert stop and stop not in before
    assert (complete(stop=[stop])["text"], complete(stop=[stop])["stop_reason"]) == (before, stop)
    assert complete(stop=[stop], include_stop_str_in_output=True)["text"] == through
    assert (complete()["finish_reason"], complete()["stop_reason"]) == ("length", None)  # vLLM's null for EOS or the length limit
