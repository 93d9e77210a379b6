"""Fast tests of the services' pure parts: settings, compose parsing, admission, completion assembly, placement."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import msgspec
import pytest
import torch
import yaml

from schemas.api import ChatMessage, GenerateRequest
from schemas.internal import Heartbeat, TokenBatch
from services.gateway.admission import Admission, ModelInfo, Rejected
from services.gateway.completion import Completion, TokensLost
from services import launch
from services.compose import REPO_ROOT, StackError, load_compose
from services.compose_interpolation import interpolate
from services.model_rank import resolve_dtype, sampling_params
from services.openai import protocol, request_ids
from shared.bus import decode_public, encode_public
from services.scheduler.registry import Registry
from services_helpers import CHAT_NO_OP_FIELDS, CHAT_USED_FIELDS, NO_OP_FIELDS, USED_FIELDS
from shared.model.tokenizer import Tokenizer
from shared.settings import (DecodeSettings, GatewaySettings, MetricsSettings, NatsServerSettings, OpenAISettings, PrefillSettings,
                             SchedulerSettings, SettingsError, load_settings, nats_server_settings)


def test_completion_spells_special_tokens_without_skip_special_tokens_but_not_the_eos_that_ended_it(tiny_model: Path):
    """vLLM's skip_special_tokens false: the text spells special tokens (<|im_start|> here), with the real Qwen3
    tokenizer; the EOS that ended the completion is still left out unless include_stop keeps it. With skipping
    (the default) the special token is not in the text."""
    tok = Tokenizer.from_dir(tiny_model)
    eos = frozenset(ModelInfo.load(GatewaySettings(model=str(tiny_model), model_name="tiny")).generation.eos_token_ids)
    (im_start,) = tok.encode("<|im_start|>")
    words = tok.encode("Hello there")
    ids = [*words, im_start, *tok.encode("user"), min(eos)]

    def text(skip: bool, include_stop: bool = False) -> str:
        c = Completion(tok.detokenizer(skip_special_tokens=skip), stop=[], max_tokens=100, include_stop=include_stop,
                       eos_token_ids=eos)
        c.add(TokenBatch(request_id="r", start=0, token_ids=ids, finish_reason="stop"))
        assert c.finished and c.token_ids == ids and c.stop_reason is None
        return c.final_text

    eos_text = tok.decode([min(eos)])
    assert eos_text and "<|im_start|>" not in eos_text  # the EOS is a special token with text of its own
    assert text(skip=False) == "Hello there<|im_start|>user"
    assert text(skip=False, include_stop=True) == "Hello there<|im_start|>user" + eos_text
    assert text(skip=True) == text(skip=True, include_stop=True) == "Hello thereuser"


# ---------------------------------------------------------------- admission


def test_ignore_eos_reaches_the_ranks_sampling_params_and_drops_the_eos_stop_ids(tiny_model: Path):
    settings = GatewaySettings(model=str(tiny_model), model_name="tiny")
    model = ModelInfo.load(settings)
    admission = Admission(settings, model, Tokenizer.from_dir(tiny_model))
    assert model.generation.eos_token_ids  # the checkpoint has EOS ids to ignore
    plain = admission.admit(GenerateRequest(input_ids=[5, 6, 7], max_tokens=4), "gw").job
    ignoring = admission.admit(GenerateRequest(input_ids=[5, 6, 7], max_tokens=4, ignore_eos=True), "gw").job
    assert plain.stop_token_ids == list(model.generation.eos_token_ids) and not sampling_params(plain).ignore_eos
    assert ignoring.stop_token_ids == [] and sampling_params(ignoring).ignore_eos


def test_request_stop_token_ids_join_the_eos_ids_even_with_ignore_eos(tiny_model: Path):
    settings = GatewaySettings(model=str(tiny_model), model_name="tiny")
    model = ModelInfo.load(settings)
    admission = Admission(settings, model, Tokenizer.from_dir(tiny_model))
    eos = list(model.generation.eos_token_ids)
    admitted = admission.admit(GenerateRequest(input_ids=[5, 6], max_tokens=4, stop_token_ids=[11, eos[0]], include_stop_str_in_output=True), "gw")
    assert sampling_params(admitted.job).stop_token_ids == (*eos, 11)
    assert admitted.stop_token_ids == {11, eos[0]} and admitted.include_stop
    ignoring = admission.admit(GenerateRequest(input_ids=[5, 6], max_tokens=4, stop_token_ids=[11], ignore_eos=True), "gw")
    assert ignoring.job.stop_token_ids == [11] and not ignoring.include_stop
    with pytest.raises(Rejected, match=r"stop_token_ids: \[-1\] outside the vocabulary") as e:
        admission.admit(GenerateRequest(input_ids=[5, 6], max_tokens=4, stop_token_ids=[-1]), "gw")
    assert e.value.code == "invalid_request"
    with pytest.raises(Rejected, match=r"stop_token_ids: at most 300 tokens, got 301"):  # each step looks tokens up in them
        admission.admit(GenerateRequest(input_ids=[5, 6], max_tokens=4, stop_token_ids=list(range(301))), "gw")
    assert admission.admit(GenerateRequest(input_ids=[5, 6], max_tokens=4, stop_token_ids=list(range(300))), "gw")
    body = b'{"prompt": "hi", "stop_token_ids": [7, 9], "include_stop_str_in_output": true}'
    req = protocol.completion_requests(protocol.decode(body, protocol.CompletionRequest), "r1", 4)[0]
    assert (req.stop_token_ids, req.include_stop_str_in_output) == ([7, 9], True)


def test_admission_carries_logit_bias_min_p_min_tokens_to_the_ranks_and_refuses_bad_ones(tiny_model: Path):
    settings = GatewaySettings(model=str(tiny_model), model_name="tiny")
    model = ModelInfo.load(settings)
    admission = Admission(settings, model, Tokenizer.from_dir(tiny_model))
    job = admission.admit(GenerateRequest(input_ids=[5, 6], max_tokens=4, logit_bias={9: -100, 4: 2.5}, min_p=0.1, min_tokens=2), "gw").job
    params = sampling_params(job)
    assert (params.logit_bias, params.min_p, params.min_tokens) == (((4, 2.5), (9, -100.0)), 0.1, 2)
    for bad, match in [({"logit_bias": {model.vocab_size: 1.0}}, "outside the vocabulary"), ({"logit_bias": {3: 101}}, r"\[-100, 100\]"),
                       ({"min_tokens": 5}, "min_tokens"), ({"min_p": 2.0}, "min_p")]:
        with pytest.raises(Rejected, match=match) as e:
            admission.admit(GenerateRequest(input_ids=[5, 6], max_tokens=4, **bad), "gw")
        assert e.value.code == "invalid_request"


def test_max_tokens_left_unset_takes_what_the_context_leaves_up_to_the_limit(tiny_model: Path):
    """vLLM's rule for a request without max_tokens (OpenAI clients often send none): the room the
    context leaves after the prompt, at most max_tokens_limit; never refused for its prompt's
    length unless the prompt fills the context. An explicit max_tokens is checked as before."""
    settings = GatewaySettings(model=str(tiny_model), model_name="tiny", max_context=100, max_tokens_limit=40)
    admission = Admission(settings, ModelInfo.load(settings), Tokenizer.from_dir(tiny_model))

    def admitted(prompt_tokens: int, max_tokens: int | None) -> int:
        job = admission.admit(GenerateRequest(input_ids=[5] * prompt_tokens, max_tokens=max_tokens), "gw").job
        assert sampling_params(job).max_tokens == job.max_tokens
        return job.max_tokens

    assert [admitted(n, None) for n in (3, 60, 70, 99)] == [40, 40, 30, 1]
    assert admitted(70, 30) == 30
    with pytest.raises(Rejected, match=r"^This model's maximum context length is 100 tokens\. However, you requested 101 tokens \(70 in the prompt, 31 for max_tokens\)"):
        admitted(70, 31)
    with pytest.raises(Rejected, match=r"^This model's maximum context length is 100 tokens\. However, the prompt has 100 tokens, which leaves no room"):
        admitted(100, None)
    with pytest.raises(Rejected, match=r"max_tokens must be in \[1, 40\] \(gateway.max_tokens_limit: a decode rank reserves KV"):
        admitted(3, 41)  # the setting's bound, named: vLLM's clients know no such limit
    wide = GatewaySettings(model=str(tiny_model), model_name="tiny", max_context=100, max_tokens_limit=400)
    bound_by_context = Admission(wide, ModelInfo.load(wide), Tokenizer.from_dir(tiny_model))
    # Past the context (a bound the setting does not reach) it is a request too long for the context,
    # in the words LiteLLM matches, as vLLM says it; it was "max_tokens must be in [1, 99], got 100".
    with pytest.raises(Rejected, match=r"^This model's maximum context length is 100 tokens\. However, you requested 101 tokens \(1 in the prompt, 100 for max_tokens\)"):
        bound_by_context.admit(GenerateRequest(input_ids=[5], max_tokens=100), "gw")
    with pytest.raises(Rejected, match=r"^max_tokens must be in \[1, 99\], got 0$"):
        bound_by_context.admit(GenerateRequest(input_ids=[5], max_tokens=0), "gw")
    openai = protocol.decode(b'{"messages": [{"role": "user", "content": "hi"}]}', protocol.ChatCompletionRequest)
    assert protocol.chat_request(openai, "r3").max_tokens is None


def test_openai_completions_default_to_16_tokens_and_null_means_what_the_context_leaves():
    """OpenAI's and vLLM's /v1/completions default is 16 tokens (chat has none): a body without
    max_tokens must not generate up to the gateway's limit; an explicit null still asks for it."""
    def max_tokens(body: bytes) -> int | None:
        return protocol.completion_requests(protocol.decode(body, protocol.CompletionRequest), "r1", 4)[0].max_tokens

    assert max_tokens(b'{"prompt": "hi"}') == 16
    assert max_tokens(b'{"prompt": "hi", "max_tokens": null}') is None
    assert max_tokens(b'{"prompt": "hi", "max_tokens": 200}') == 200


def test_openai_bodies_take_vllms_top_k_minus_one_and_negative_seeds():
    """vLLM's clients send top_k -1 (vLLM's "disabled"), any int64 seed and an empty model name; a
    400 / 404 for them broke requests that vLLM serves. -1 is moebus' 0; a negative seed is a fixed
    seed of its own; "" is the served model."""
    def gen(**fields) -> GenerateRequest:
        return protocol.completion_requests(protocol.decode(json.dumps({"prompt": "hi"} | fields).encode(), protocol.CompletionRequest), "r", 4)[0]

    assert gen(top_k=-1).top_k == 0 and gen(top_k=5).top_k == 5
    assert gen(model="").model is None and gen(model="m").model == "m"  # vLLM serves "" as its model
    assert gen(seed=-1).seed == 2**64 - 1 and gen(seed=-(2**63)).seed == 2**63 and gen(seed=7).seed == 7
    assert gen(top_k=-2).top_k == -2  # the gateway refuses it, naming top_k
    with pytest.raises(protocol.InvalidRequest, match=r"seed must be an integer in \[-2\*\*63, 2\*\*64\)"):
        gen(seed=-(2**63) - 1)


def test_openai_fields_sent_as_null_take_their_defaults():
    """OpenAI's spec marks these nullable and SDK wrappers send them so; null is the default, as in
    OpenAI and vLLM, not a 400."""
    nulls = {"n": None, "stream": None, "presence_penalty": None, "frequency_penalty": None, "stream_options": None}
    completion = protocol.decode(json.dumps({"prompt": "hi", "echo": None} | nulls).encode(), protocol.CompletionRequest)
    assert (protocol.check_n(completion, 4), completion.echo) == (1, False)
    gen = protocol.completion_requests(completion, "r1", 4)[0]
    assert (gen.stream, gen.presence_penalty, gen.frequency_penalty) == (False, 0.0, 0.0)
    chat = protocol.decode(json.dumps({"messages": [{"role": "user", "content": "hi"}], "logprobs": None} | nulls).encode(),
                           protocol.ChatCompletionRequest)
    gen = protocol.chat_request(chat, "r2")
    assert (protocol.check_n(chat, 4), gen.logprobs, gen.stream, gen.presence_penalty) == (1, False, False, 0.0)
    options = protocol.decode(b'{"prompt": "hi", "stream": true, "stream_options": {"include_usage": null}}', protocol.CompletionRequest)
    assert options.stream_options is not None and not options.stream_options.include_usage


def test_chat_text_parts_are_joined_by_newlines_and_other_parts_refused_by_type():
    """A message's text parts are one text, a line each, as vLLM joins them for Qwen3's template (they
    were joined with nothing: ["a", "b"] was "ab" where vLLM's prompt has "a\nb"); an image part is
    refused naming its type (it was "unknown field `image_url`")."""
    def gen(content: list[dict]) -> GenerateRequest:
        body = {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": content}]}
        return protocol.chat_request(protocol.decode(json.dumps(body).encode(), protocol.ChatCompletionRequest), "r")

    parts = [{"type": "text", "text": "Describe"}, {"type": "text", "text": "briefly."}]
    assert [m.content for m in gen(parts).messages] == ["sys", "Describe\nbriefly."]
    with pytest.raises(protocol.InvalidRequest, match=r"messages\[1\].content: only text parts are supported, got 'image_url'$"):
        gen([*parts, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}])
    with pytest.raises(protocol.InvalidRequest, match="unknown field `cache_control`"):  # a text part's fields are checked still
        gen([{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}])


def test_vllms_continuous_usage_stats_is_taken():
    """vLLM's stream_options.continuous_usage_stats, false, null or true (usage in every chunk, which
    guidellm asks for on every streamed request; it was refused), is taken (`test_openai` checks the
    chunks)."""
    def gen(options: dict) -> GenerateRequest:
        body = {"prompt": "hi", "stream": True, "stream_options": options}
        return protocol.completion_requests(protocol.decode(json.dumps(body).encode(), protocol.CompletionRequest), "r", 4)[0]

    assert gen({"include_usage": True, "continuous_usage_stats": False}).stream
    assert gen({"continuous_usage_stats": None}).stream
    assert gen({"include_usage": True, "continuous_usage_stats": True}).stream


def test_openai_logit_bias_keys_are_token_id_strings_and_vllms_min_fields_pass_through():
    body = b'{"prompt": "hi", "logit_bias": {"50256": -100, "7": 3}, "min_p": 0.05, "min_tokens": 3}'
    req = protocol.completion_requests(protocol.decode(body, protocol.CompletionRequest), "r1", 4)[0]
    assert (req.logit_bias, req.min_p, req.min_tokens) == ({50256: -100.0, 7: 3.0}, 0.05, 3)
    with pytest.raises(protocol.InvalidRequest, match=r"Expected `int`.*key.*\$\.logit_bias"):
        protocol.decode(b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"hello": 1}}', protocol.ChatCompletionRequest)


def test_openai_and_vllm_fields_are_taken_at_their_no_op_values_and_refused_by_name_otherwise():
    """Clients send OpenAI's store, metadata, service_tier, modalities, reasoning_effort and
    prediction, and vLLM's extensions at their defaults; each was "unknown field" (a 400). At a
    no-op value (null too) each is taken and changes nothing in the request; any other value is
    refused naming the field; a field neither defines, or one of OpenAI's chat fields sent to
    completions (OpenAI's legacy completions have none of them), is still unknown."""
    def completion(fields: dict) -> GenerateRequest:
        return protocol.completion_requests(protocol.decode(json.dumps({"prompt": "hi"} | fields).encode(), protocol.CompletionRequest), "r", 4)[0]

    def chat(fields: dict) -> GenerateRequest:
        body = {"messages": [{"role": "user", "content": "hi"}]} | fields
        return protocol.chat_request(protocol.decode(json.dumps(body).encode(), protocol.ChatCompletionRequest), "r")

    nulls = {name: None for name in CHAT_NO_OP_FIELDS}
    assert completion(NO_OP_FIELDS) == completion({}) == completion({name: None for name in NO_OP_FIELDS})
    assert chat(CHAT_NO_OP_FIELDS) == chat({}) == chat(nulls) == chat({"service_tier": "default"})
    for gen, used in ((completion, USED_FIELDS), (chat, CHAT_USED_FIELDS)):
        for name, value in used.items():
            with pytest.raises(protocol.InvalidRequest, match=rf"^not supported by moebus: {name} \(accepted only as null"):
                gen({name: value})
    with pytest.raises(protocol.InvalidRequest, match=r"reasoning_effort \(accepted only as null\)$"):
        chat({"reasoning_effort": "high"})
    with pytest.raises(protocol.InvalidRequest, match=r"^not supported by moebus: use_beam_search \(accepted only as null or false\); "
                                                      r"length_penalty \(accepted only as null or 1.0\)$"):
        completion({"use_beam_search": True, "length_penalty": 0.5})
    # vLLM's spaces_between_special_tokens changes nothing in the Qwen3 tokenizer's text (tests/model/test_tokenizer.py)
    for gen in (completion, chat):
        assert gen({"spaces_between_special_tokens": False}) == gen({"spaces_between_special_tokens": True}) == gen({})
    for gen, unknown in ((completion, "guided_jsn"), (completion, "store"), (completion, "reasoning_effort"), (chat, "stored")):
        with pytest.raises(protocol.InvalidRequest, match=f"unknown field `{unknown}`"):
            gen({unknown: None})


def test_vllms_skip_special_tokens_reaches_the_request_on_both_endpoints(tiny_model: Path):
    """skip_special_tokens was taken only at true (a 400 otherwise); false now reaches the native request and
    the gateway's admission, null is the default (true)."""
    completion = lambda fields: protocol.completion_requests(  # noqa: E731
        protocol.decode(json.dumps({"prompt": "hi"} | fields).encode(), protocol.CompletionRequest), "r", 4)[0]
    chat = lambda fields: protocol.chat_request(  # noqa: E731
        protocol.decode(json.dumps({"messages": [{"role": "user", "content": "hi"}]} | fields).encode(),
                        protocol.ChatCompletionRequest), "r")
    for gen in (completion, chat):
        assert gen({"skip_special_tokens": False}).skip_special_tokens is False
        assert gen({"skip_special_tokens": None}).skip_special_tokens is gen({}).skip_special_tokens is True
    settings = GatewaySettings(model=str(tiny_model), model_name="tiny")
    model = ModelInfo.load(settings)
    admission = Admission(settings, model, Tokenizer.from_dir(tiny_model))
    spelled = admission.admit(GenerateRequest(input_ids=[5, 6], max_tokens=4, skip_special_tokens=False), "gw")
    assert not spelled.skip_special_tokens and spelled.eos_token_ids == frozenset(model.generation.eos_token_ids)
    ignoring = admission.admit(GenerateRequest(input_ids=[5, 6], max_tokens=4, ignore_eos=True), "gw")
    assert ignoring.skip_special_tokens and ignoring.eos_token_ids == frozenset()


def test_a_generate_request_leaves_its_defaults_off_the_wire():
    """`moebus openai` and the native client send GenerateRequest to the gateway, which refuses unknown fields:
    every field a release added (priority, cache_salt, skip_special_tokens, ...) went out at its default in every
    request, so a frontend updated before its gateway failed them all. Fields at their defaults are left out now:
    a gateway whose request type predates them reads such a request; one that uses a newer field is refused
    naming it; the current type reads either back as sent."""
    class OlderRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
        prompt: str | None = None
        max_tokens: int | None = 64
        temperature: float | None = None

    plain = encode_public(GenerateRequest(prompt="hi", max_tokens=8, skip_special_tokens=True, priority=0))
    assert json.loads(plain) == {"prompt": "hi", "max_tokens": 8}
    assert msgspec.json.decode(plain, type=OlderRequest) == OlderRequest(prompt="hi", max_tokens=8)
    newer = encode_public(GenerateRequest(prompt="hi", max_tokens=None, skip_special_tokens=False))
    assert json.loads(newer) == {"prompt": "hi", "max_tokens": None, "skip_special_tokens": False}
    with pytest.raises(msgspec.ValidationError, match="skip_special_tokens"):
        msgspec.json.decode(newer, type=OlderRequest)
    for raw in (plain, newer):
        assert encode_public(decode_public(raw, GenerateRequest)) == raw


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(tiny_model: Path):
    """vLLM's truncate_prompt_tokens (a 400 before): the job's prompt is the last k tokens, of the chat
    template's output for messages; -1 is the model's context; 0, -2 or past the context are refused by name."""
    settings = GatewaySettings(model=str(tiny_model), model_name="tiny")
    model = ModelInfo.load(settings)
    admission = Admission(settings, model, Tokenizer.from_dir(tiny_model))
    ids = list(range(5, 25))
    assert admission.admit(GenerateRequest(input_ids=ids, max_tokens=4, truncate_prompt_tokens=7), "gw").job.input_ids == ids[-7:]
    assert admission.admit(GenerateRequest(input_ids=ids, max_tokens=4, truncate_prompt_tokens=-1), "gw").job.input_ids == ids
    assert admission.admit(GenerateRequest(input_ids=ids, max_tokens=4, truncate_prompt_tokens=50), "gw").job.input_ids == ids
    chat = GenerateRequest(messages=[ChatMessage(role="user", content="Tell me about France")], max_tokens=4)
    templated = admission.admit(chat, "gw").job.input_ids
    chat.truncate_prompt_tokens = 5
    assert admission.admit(chat, "gw").job.input_ids == templated[-5:]
    for bad in (0, -2, model.max_context + 1):
        with pytest.raises(Rejected, match=rf"truncate_prompt_tokens must be -1 .* got {bad}$"):
            admission.admit(GenerateRequest(input_ids=ids, max_tokens=4, truncate_prompt_tokens=bad), "gw")
    completion = protocol.completion_requests(protocol.decode(json.dumps({"prompt": "hi", "truncate_prompt_tokens": 3}).encode(),
                                                              protocol.CompletionRequest), "r", 4)[0]
    assert completion.truncate_prompt_tokens == 3


def test_vllms_cache_salt_request_id_add_special_tokens_and_openais_prompt_cache_key_are_taken():
    """Fields OpenAI and vLLM clients send that were each an "unknown field" 400: cache_salt reaches
    the native request on both endpoints; request_id decodes (the frontend makes it the id:
    `request_ids.of_request`); prompt_cache_key (any string) and add_special_tokens (either value:
    Qwen3's tokenizer adds none, tests/model/test_tokenizer.py) change nothing in the request;
    include_reasoning is chat's (vLLM's completions have none). A wrong type is refused naming the field."""
    def completion(fields: dict) -> GenerateRequest:
        return protocol.completion_requests(protocol.decode(json.dumps({"prompt": "hi"} | fields).encode(), protocol.CompletionRequest), "r", 4)[0]

    def chat(fields: dict) -> GenerateRequest:
        body = {"messages": [{"role": "user", "content": "hi"}]} | fields
        return protocol.chat_request(protocol.decode(json.dumps(body).encode(), protocol.ChatCompletionRequest), "r")

    for gen in (completion, chat):
        assert gen({"cache_salt": "tenant-a"}).cache_salt == "tenant-a" and gen({}).cache_salt is None
        assert gen({"prompt_cache_key": "conversation-42"}) == gen({}) == gen({"prompt_cache_key": None})
        assert gen({"add_special_tokens": True}) == gen({"add_special_tokens": False}) == gen({})
        assert gen({"request_id": "body-id"}) == gen({})  # the id is the frontend's to give ("r" here)
        with pytest.raises(protocol.InvalidRequest, match=r"Expected `str \| null`, got `int` - at `\$\.cache_salt`"):
            gen({"cache_salt": 5})
        with pytest.raises(protocol.InvalidRequest, match=r"Expected `bool`, got `str` - at `\$\.add_special_tokens`"):
            gen({"add_special_tokens": "yes"})
    assert protocol.decode(b'{"prompt": "hi", "request_id": "body-id"}', protocol.CompletionRequest).request_id == "body-id"
    chat_body = protocol.decode(b'{"messages": [], "include_reasoning": false}', protocol.ChatCompletionRequest)
    assert chat_body.include_reasoning is False  # type: ignore[union-attr]
    assert protocol.decode(b'{"messages": []}', protocol.ChatCompletionRequest).include_reasoning is True  # type: ignore[union-attr]
    with pytest.raises(protocol.InvalidRequest, match="unknown field `include_reasoning`"):
        completion({"include_reasoning": False})


def test_openai_priority_reaches_the_native_request_on_both_endpoints():
    """vLLM's priority was a no-op field, refused unless 0: it reaches the request now (null: 0), for the
    scheduler to order its queue by or, under its default "fcfs" policy, refuse."""
    def completion(fields: dict) -> list[GenerateRequest]:
        return protocol.completion_requests(protocol.decode(json.dumps({"prompt": ["hi", "yo"]} | fields).encode(), protocol.CompletionRequest), "r", 4)

    def chat(fields: dict) -> list[GenerateRequest]:
        body = {"messages": [{"role": "user", "content": "hi"}]} | fields
        return [protocol.chat_request(protocol.decode(json.dumps(body).encode(), protocol.ChatCompletionRequest), "r")]

    for gen in (completion, chat):
        assert [r.priority for r in gen({"priority": -3})] == [-3] * len(gen({}))  # each prompt of a batch
        assert [r.priority for r in gen({"priority": None})] == [r.priority for r in gen({})] == [0] * len(gen({}))
        with pytest.raises(protocol.InvalidRequest, match=r"Expected `int \| null`, got `float` - at `\$\.priority`"):
            gen({"priority": 1.5})


def test_admission_carries_the_priority_to_the_job_within_int64(tiny_model: Path):
    settings = GatewaySettings(model=str(tiny_model), model_name="tiny")
    admission = Admission(settings, ModelInfo.load(settings), Tokenizer.from_dir(tiny_model))
    for priority in (0, 7, -(2**63), 2**63 - 1):
        assert admission.admit(GenerateRequest(input_ids=[5, 6], max_tokens=2, priority=priority), "gw").job.priority == priority
    for priority in (-(2**63) - 1, 2**63):  # the job's msgpack could not carry it (or not as a signed int)
        with pytest.raises(Rejected, match=rf"^priority must be an integer in \[-2\*\*63, 2\*\*63 - 1\], got {priority}$") as e:
            admission.admit(GenerateRequest(input_ids=[5, 6], max_tokens=2, priority=priority), "gw")
        assert e.value.code == "invalid_request"


def test_admission_carries_a_cache_salt_to_the_job_and_refuses_an_empty_or_huge_one(tiny_model: Path):
    settings = GatewaySettings(model=str(tiny_model), model_name="tiny")
    admission = Admission(settings, ModelInfo.load(settings), Tokenizer.from_dir(tiny_model))
    assert admission.admit(GenerateRequest(input_ids=[5, 6], max_tokens=2, cache_salt="s" * 1024), "gw").job.cache_salt == "s" * 1024
    assert admission.admit(GenerateRequest(input_ids=[5, 6], max_tokens=2), "gw").job.cache_salt is None
    for salt in ("", "s" * 1025):  # vLLM refuses an empty salt too
        with pytest.raises(Rejected, match=rf"^cache_salt: a non-empty string of at most 1024 characters, got {len(salt)} characters$") as e:
            admission.admit(GenerateRequest(input_ids=[5, 6], max_tokens=2, cache_salt=salt), "gw")
        assert e.value.code == "invalid_request"


def test_openai_bodies_pass_vllms_ignore_eos_through():
    completion = protocol.decode(b'{"prompt": "hi", "ignore_eos": true}', protocol.CompletionRequest)
    chat = protocol.decode(b'{"messages": [{"role": "user", "content": "hi"}]}', protocol.ChatCompletionRequest)
    assert protocol.completion_requests(completion, "r1", 4)[0].ignore_eos
    assert not protocol.chat_request(chat, "r2").ignore_eos


# ---------------------------------------------------------------- settings


def test_every_http_refusal_code_is_an_openai_error_code_of_that_status():
    """An HttpError's body names a code whose status (ERRORS) is the one it is answered with."""
    assert all(protocol.ERRORS[code][0] == status for status, code in protocol.HTTP_CODES.items()), protocol.HTTP_CODES
    assert protocol.http_error_body(404, "no route") == {"error": {"message": "no route", "type": "invalid_request_error", "param": None,
                                                                   "code": "unknown_url"}}


def test_a_request_id_made_from_any_x_request_id_is_a_valid_id_and_echoed_only_as_it_came():
    """The cases the stack test does not send: no header, a value just past the length limit, bytes
    past ASCII (the head is read as Latin-1 and written as UTF-8: not echoed, the id is)."""
    fresh = request_ids.from_header(None)
    assert re.fullmatch(r"[0-9a-f]{32}", fresh.id) and fresh.header == fresh.id and fresh.client is None
    assert request_ids.from_header("x" * 100).id == "x" * 100
    longer = request_ids.from_header("x" * 101)
    assert len(longer.id) == 100 and longer.id.startswith("x" * 87 + "-") and longer.header == "x" * 101
    accented = request_ids.from_header("caf\xc3\xa9/1")  # UTF-8 "café/1" as the parser reads it
    assert re.fullmatch(r"caf___1-[0-9a-f]{12}", accented.id) and accented.header == accented.id and accented.client == "caf\xc3\xa9/1"


def test_a_bodys_request_id_is_taken_as_the_same_header_would_be_and_the_header_wins():
    """vLLM's precedence: X-Request-Id, else the body's request_id, else a fresh id. A body's value
    past Latin-1 (the header parser's reading) gives an id as its UTF-8 bytes in the header would
    (it raised UnicodeEncodeError: a 500)."""
    assert request_ids.of_request("from-header", "from-body") == request_ids.from_header("from-header")
    assert request_ids.of_request(None, "from-body") == request_ids.RequestId("from-body", "from-body", "from-body")
    assert request_ids.of_request("", "from-body").id == "from-body"
    fresh = request_ids.of_request(None, None)
    assert re.fullmatch(r"[0-9a-f]{32}", fresh.id) and fresh.client is None
    assert request_ids.of_request(None, "").client is None  # empty: none given, as an empty header
    tokyo = request_ids.of_request(None, "東京/1")
    assert tokyo == request_ids.from_header("東京/1".encode().decode("latin-1")) and re.fullmatch(r"_+1-[0-9a-f]{12}", tokyo.id)
    assert tokyo.header == tokyo.id  # not ASCII: the id is echoed


def test_settings_sources_in_order(tmp_path: Path):
    config = tmp_path / "moebus.toml"
    config.write_text('nats_url = "nats://from-file:1"\nmax_batch = 7\n[decode]\nmax_batch = 8\nkv_pages = 100\n')
    env = {"MOEBUS_NATS_URL": "nats://from-env:2", "MOEBUS_DECODE_KV_PAGES": "200", "MOEBUS_MODEL": "/m/qwen"}
    s = load_settings(DecodeSettings, "decode", config, overrides={"page_size": 32}, env=env)
    assert (s.nats_url, s.max_batch, s.kv_pages, s.page_size) == ("nats://from-env:2", 8, 200, 32)
    assert s.model_name == "qwen" and s.instance  # defaults filled in


def test_settings_turn_the_model_ranks_warm_up_off():
    assert load_settings(PrefillSettings, "prefill", env={}).warmup and load_settings(DecodeSettings, "decode", env={}).warmup
    assert not load_settings(PrefillSettings, "prefill", env={"MOEBUS_PREFILL_WARMUP": "false"}).warmup
    assert not load_settings(DecodeSettings, "decode", env={"MOEBUS_DECODE_WARMUP": "0"}).warmup
    with pytest.raises(SettingsError, match="warmup"):
        load_settings(DecodeSettings, "decode", env={"MOEBUS_DECODE_WARMUP": "sometimes"})


def test_settings_reject_typos_and_bad_values(tmp_path: Path):
    with pytest.raises(SettingsError, match="MOEBUS_DECODE_MAX_BACH"):
        load_settings(DecodeSettings, "decode", env={"MOEBUS_DECODE_MAX_BACH": "4"})
    with pytest.raises(SettingsError, match="max_batch"):
        load_settings(DecodeSettings, "decode", env={"MOEBUS_DECODE_MAX_BATCH": "many"})
    bad = tmp_path / "bad.toml"
    bad.write_text("[gateway]\nmax_tokens_limt = 3\n")
    with pytest.raises(SettingsError, match="max_tokens_limt"):
        load_settings(GatewaySettings, "gateway", bad, env={})
    with pytest.raises(SettingsError, match="instance"):
        load_settings(GatewaySettings, "gateway", env={"MOEBUS_INSTANCE": "has.dot"})


def test_settings_refuse_impossible_values_naming_the_field():
    # Each one used to pass and fail later, deep in a rank (page_size 0: ZeroDivisionError; kv_pages -5: torch's
    # "Dimension size must be non-negative"; log_level verbose: KeyError), or not at all (dp 0: exit 0 with no rank).
    for cls, service, var, value in [
        (DecodeSettings, "decode", "MOEBUS_DECODE_PAGE_SIZE", "0"), (DecodeSettings, "decode", "MOEBUS_DECODE_KV_PAGES", "-5"),
        (DecodeSettings, "decode", "MOEBUS_DECODE_DP", "0"), (DecodeSettings, "decode", "MOEBUS_DECODE_MAX_BATCH", "0"),
        (DecodeSettings, "decode", "MOEBUS_DECODE_DTYPE", "float64"), (DecodeSettings, "decode", "MOEBUS_DECODE_DEVICE", "gpu"),
        (PrefillSettings, "prefill", "MOEBUS_PREFILL_TP", "0"), (PrefillSettings, "prefill", "MOEBUS_PREFILL_DIST_PORT", "70000"),
        (GatewaySettings, "gateway", "MOEBUS_GATEWAY_MAX_IN_FLIGHT", "0"), (SchedulerSettings, "scheduler", "MOEBUS_SCHEDULER_LEASE_S", "-1"),
        (SchedulerSettings, "scheduler", "MOEBUS_LOG_LEVEL", "verbose"), (SchedulerSettings, "scheduler", "MOEBUS_HEARTBEAT_INTERVAL_S", "0"),
    ]:
        field = var.removeprefix(f"MOEBUS_{service.upper()}_").removeprefix("MOEBUS_").lower()
        with pytest.raises(SettingsError, match=rf"^{service} settings: .* at `\$\.{field}`$"):
            load_settings(cls, service, env={var: value})
    assert load_settings(SchedulerSettings, "scheduler", env={"MOEBUS_LOG_LEVEL": "DEBUG", "MOEBUS_SCHEDULER_MAX_QUEUED": "0"}).max_queued == 0
    # A request without timeout_ms got the default even above the most a request may ask for.
    with pytest.raises(SettingsError, match="default_timeout_ms=600000 must be at most max_timeout_ms=60000"):
        load_settings(GatewaySettings, "gateway", env={"MOEBUS_GATEWAY_MAX_TIMEOUT_MS": "60000"})


def test_settings_report_unknown_variables_and_file_keys_but_take_the_runtime_switches(tmp_path: Path):
    # A misspelled shared variable or top-level key was skipped by every service: the default silently won.
    with pytest.raises(SettingsError, match="MOEBUS_HEARTBEAT_INTERVAL: no service has a field 'heartbeat_interval'"):
        load_settings(SchedulerSettings, "scheduler", env={"MOEBUS_HEARTBEAT_INTERVAL": "2"})
    with pytest.raises(SettingsError, match="MOEBUS_DECODE_MAX_BACH: DecodeSettings has no field"):  # every service of the stack says so
        load_settings(GatewaySettings, "gateway", env={"MOEBUS_DECODE_MAX_BACH": "4"})
    # The switches read by the model runtime and the tools are no typos: MOEBUS_DECODE_ATTENTION=sdpa (README) stopped `moebus decode`.
    switches = {"MOEBUS_DECODE_ATTENTION": "sdpa", "MOEBUS_KERNELS": "reference", "MOEBUS_KV_CUDA_IPC": "0", "MOEBUS_CONFIG": "",
                "MOEBUS_NATS_MAX_PAYLOAD": "8388608", "MOEBUS_CACHE_DIR": "/tmp", "MOEBUS_OPENAI_PORT": "8001", "MOEBUS_MAX_BATCH": "7"}
    assert load_settings(DecodeSettings, "decode", env=switches).max_batch == 7
    assert load_settings(SchedulerSettings, "scheduler", env=switches).queue_wait_ms == SchedulerSettings().queue_wait_ms
    for text, error in [("heartbeat_intervl_s = 1.0\n", "unknown top-level key 'heartbeat_intervl_s'"),
                        ("[decoder]\nmax_batch = 3\n", "unknown top-level key 'decoder'"), ("decode = 3\n", r"\[decode\] must be a table")]:
        config = tmp_path / "moebus.toml"
        config.write_text(text)
        with pytest.raises(SettingsError, match=error):
            load_settings(SchedulerSettings, "scheduler", config, env={})
    config.write_text("max_batch = 3\nqueue_wait_ms = 5\n[decode]\nkv_pages = 64\n")  # another service's keys are no typos
    assert load_settings(SchedulerSettings, "scheduler", config, env={}).queue_wait_ms == 5


def test_settings_place_the_ranks_of_an_instance_on_listed_gpus():
    from services.model_rank import resolve_device

    s = load_settings(DecodeSettings, "decode", env={"MOEBUS_DECODE_DP": "2", "MOEBUS_DECODE_GPUS": "[3, 2]", "MOEBUS_DECODE_DEVICE": "cuda"})
    assert s.gpus == [3, 2]
    assert [resolve_device(s.device, r, s.gpus) for r in range(s.dp)] == ["cuda:3", "cuda:2"]
    assert resolve_device("cuda:1", 0, s.gpus) == "cuda:1" and resolve_device("cpu", 1, s.gpus) == "cpu"
    with pytest.raises(SettingsError, match=r"gpus \[2\] lists 1 GPU\(s\) for dp=2"):
        load_settings(DecodeSettings, "decode", env={"MOEBUS_DECODE_DP": "2", "MOEBUS_DECODE_GPUS": "[2]"})
    with pytest.raises(SettingsError, match="distinct"):
        load_settings(PrefillSettings, "prefill", env={"MOEBUS_PREFILL_TP": "2", "MOEBUS_PREFILL_GPUS": "[1, 1]"})


def test_dtype_auto_is_bfloat16_on_a_gpu_and_float32_on_the_cpu():
    """vLLM's --dtype auto takes the checkpoint's dtype (bfloat16 for Qwen3); the default here was float32 on
    every device, so a checkpoint served on GPUs without MOEBUS_DTYPE ran the fp32 reference ops."""
    for cls, service in ((PrefillSettings, "prefill"), (DecodeSettings, "decode")):
        assert load_settings(cls, service, env={}).dtype == "auto"
    assert resolve_dtype("auto", "cuda:1") == torch.bfloat16 and resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("float16", "cuda:0") == torch.float16 and resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    with pytest.raises(SettingsError, match="dtype"):
        load_settings(DecodeSettings, "decode", env={"MOEBUS_DECODE_DTYPE": "float64"})


def test_http_frontends_read_their_settings_as_the_services_do(tmp_path: Path):
    """`moebus openai` and `moebus metrics` took flags only: their [openai] / [metrics] tables, MOEBUS_OPENAI_PORT
    and the shared nats_url / log_level / MOEBUS_HTTP_HOST were ignored."""
    config = tmp_path / "moebus.toml"
    config.write_text('nats_url = "nats://from-file:1"\nlog_level = "debug"\nmax_batch = 7\n'  # max_batch: decode's, no typo here
                      '[openai]\nport = 8100\nmax_n = 4\nenable_auto_tool_choice = true\ntool_call_parser = "hermes"\n'
                      '[metrics]\nexpiry_s = 9.0\n[decode]\nkv_pages = 64\n')
    env = {"MOEBUS_HTTP_HOST": "0.0.0.0", "MOEBUS_OPENAI_MAX_PROMPTS": "8", "MOEBUS_OPENAI_HEALTH_EXPIRY_S": "3", "MOEBUS_METRICS_PORT": "9500",
           "MOEBUS_MODEL": "/m/qwen", "MOEBUS_DECODE_MAX_BATCH": "9"}  # the stack's one environment: other services' fields pass
    openai = load_settings(OpenAISettings, "openai", config, overrides={"max_n": 2, "reasoning_parser": None}, env=env)
    assert (openai.nats_url, openai.log_level, openai.http_host, openai.port, openai.max_n, openai.max_prompts, openai.health_expiry_s,
            openai.enable_auto_tool_choice, openai.tool_call_parser, openai.reasoning_parser) == \
        ("nats://from-file:1", "debug", "0.0.0.0", 8100, 2, 8, 3.0, True, "hermes", None)
    metrics = load_settings(MetricsSettings, "metrics", config, env=env)
    assert (metrics.nats_url, metrics.http_host, metrics.port, metrics.expiry_s, metrics.keep_alive_requests) == \
        ("nats://from-file:1", "0.0.0.0", 9500, 9.0, 1000)
    # The other services read the same file and environment: the frontends' tables and variables are no typos for them.
    assert load_settings(DecodeSettings, "decode", config, env=env).kv_pages == 64
    defaults = (load_settings(OpenAISettings, "openai", env={}), load_settings(MetricsSettings, "metrics", env={}))
    assert [(s.http_host, s.port, s.timeout_keep_alive_s, s.send_timeout_s) for s in defaults] == \
        [("127.0.0.1", 8000, 5.0, 60.0), ("127.0.0.1", 9464, 5.0, 60.0)]  # send_timeout_s: nginx's send_timeout
    # Flags set fields by name; `None` (a flag not given) leaves the field to the other sources.
    assert load_settings(MetricsSettings, "metrics", overrides={"port": 0, "expiry_s": None}, env={"MOEBUS_METRICS_EXPIRY_S": "7"}).expiry_s == 7.0


def test_http_frontend_settings_refuse_bad_values_and_typos_naming_their_source(tmp_path: Path):
    for cls, service, env, error in [
        (OpenAISettings, "openai", {"MOEBUS_OPENAI_PORT": "abc"}, r"^openai settings: MOEBUS_OPENAI_PORT='abc': Expected `int`, got `str` - at `\$\.port`$"),
        (OpenAISettings, "openai", {"MOEBUS_OPENAI_MAX_N": "129"}, r"MOEBUS_OPENAI_MAX_N='129': Expected `int` <= 128 - at `\$\.max_n`"),
        (OpenAISettings, "openai", {"MOEBUS_OPENAI_TOOL_CALL_PARSER": "mistral"}, r"Invalid enum value 'mistral' - at `\$\.tool_call_parser`"),
        (OpenAISettings, "openai", {"MOEBUS_OPENAI_KEEP_ALIVE_REQUESTS": "0"}, r"Expected `int` >= 1 - at `\$\.keep_alive_requests`"),
        (OpenAISettings, "openai", {"MOEBUS_LOG_LEVEL": "verbose"}, r"MOEBUS_LOG_LEVEL='verbose': .* at `\$\.log_level`"),
        (MetricsSettings, "metrics", {"MOEBUS_METRICS_PORT": "65536"}, r"^metrics settings: MOEBUS_METRICS_PORT='65536': Expected `int` <= 65535"),
        (MetricsSettings, "metrics", {"MOEBUS_TIMEOUT_KEEP_ALIVE_S": "0"}, r"MOEBUS_TIMEOUT_KEEP_ALIVE_S='0': Expected `float` > 0.0"),
        (OpenAISettings, "openai", {"MOEBUS_OPENAI_SEND_TIMEOUT_S": "-1"}, r"MOEBUS_OPENAI_SEND_TIMEOUT_S='-1': Expected `float` > 0.0 - at `\$\.send_timeout_s`"),
        # The expiries are judged against the stack's heartbeat interval, as the gateway's and the scheduler's are.
        (OpenAISettings, "openai", {"MOEBUS_HEARTBEAT_INTERVAL_S": "1"}, "health_expiry_s=2 must be at least 3 x heartbeat_interval_s=1"),
        (MetricsSettings, "metrics", {"MOEBUS_METRICS_EXPIRY_S": "1"}, "expiry_s=1 must be at least 3 x heartbeat_interval_s=0.5"),
        (OpenAISettings, "openai", {"MOEBUS_OPENAI_ENABLE_AUTO_TOOL_CHOICE": "true"}, "enable_auto_tool_choice=True and tool_call_parser=None go together"),
        (OpenAISettings, "openai", {"MOEBUS_OPENAI_PROT": "1"}, "MOEBUS_OPENAI_PROT: OpenAISettings has no field 'prot'"),
        (GatewaySettings, "gateway", {"MOEBUS_METRICS_EXPIRY": "5"}, "MOEBUS_METRICS_EXPIRY: MetricsSettings has no field 'expiry'"),  # every service says so
        (MetricsSettings, "metrics", {"MOEBUS_HTTP_HOTS": "0.0.0.0"}, "MOEBUS_HTTP_HOTS: no service has a field 'http_hots'"),
        # The services' own fields are no settings of a frontend: each is refused by name, not ignored.
        (OpenAISettings, "openai", {"MOEBUS_OPENAI_INSTANCE": "a"}, "MOEBUS_OPENAI_INSTANCE: OpenAISettings has no field 'instance'"),
    ]:
        with pytest.raises(SettingsError, match=error):
            load_settings(cls, service, env=env)
    config = tmp_path / "moebus.toml"
    for text, cls, service, error in [
        ("[openai]\nmax_n = 0\n", OpenAISettings, "openai", rf"^openai settings: max_n = 0 in \[openai\] of config file {config}: Expected `int` >= 1"),
        ("http_host = 1\n", MetricsSettings, "metrics", rf"^metrics settings: http_host = 1 in config file {config}: Expected `str`, got `int`"),
        ("[metrics]\nexpiry = 5\n", MetricsSettings, "metrics", r"unknown key\(s\) in \[metrics\]: expiry"),
        ("[openapi]\nport = 1\n", SchedulerSettings, "scheduler", "unknown top-level key 'openapi'"),
    ]:
        config.write_text(text)
        with pytest.raises(SettingsError, match=error):
            load_settings(cls, service, config, env={})
    with pytest.raises(SettingsError, match=r"^openai settings: port=-1 on the command line: Expected `int` >= 0"):
        load_settings(OpenAISettings, "openai", overrides={"port": -1}, env={})


def test_openai_access_settings_are_vllms_flags_with_no_origin_allowed_by_default(tmp_path: Path):
    """api_key and the CORS lists from each source, as any other field; vLLM's defaults but for allowed_origins
    (vLLM's ["*"] would let any web page call a stack on 127.0.0.1); a bad origin or an empty key stops the frontend,
    the key's value not shown."""
    default = load_settings(OpenAISettings, "openai", env={})
    assert (default.api_key, default.allowed_origins, default.allow_credentials, default.allowed_methods, default.allowed_headers) == \
        (None, [], False, ["*"], ["*"])
    env = {"MOEBUS_API_KEY": "sk-env", "MOEBUS_OPENAI_ALLOWED_ORIGINS": '["https://app.example", "http://localhost:3000"]',
           "MOEBUS_OPENAI_ALLOW_CREDENTIALS": "true"}
    got = load_settings(OpenAISettings, "openai", env=env)
    assert (got.api_key, got.allowed_origins, got.allow_credentials) == ("sk-env", ["https://app.example", "http://localhost:3000"], True)
    config = tmp_path / "moebus.toml"
    config.write_text('[openai]\napi_key = "sk-file"\nallowed_methods = ["GET", "POST"]\n')
    got = load_settings(OpenAISettings, "openai", config, env={})
    assert (got.api_key, got.allowed_methods) == ("sk-file", ["GET", "POST"])
    assert load_settings(OpenAISettings, "openai", config, overrides={"api_key": "sk-flag"}, env=env).api_key == "sk-flag"
    # Several keys (vLLM's, for rotation): a JSON list from the environment, a TOML list; a string stays one key.
    assert load_settings(OpenAISettings, "openai", env={"MOEBUS_OPENAI_API_KEY": '["sk-old", "sk-new"]'}).api_keys() == ["sk-old", "sk-new"]
    config.write_text('[openai]\napi_key = ["sk-old", "sk-new"]\n')
    assert load_settings(OpenAISettings, "openai", config, env={}).api_keys() == ["sk-old", "sk-new"]
    assert load_settings(OpenAISettings, "openai", env={"MOEBUS_API_KEY": "sk-env"}).api_keys() == ["sk-env"]
    assert default.api_keys() == []
    for env, error in [
        ({"MOEBUS_OPENAI_ALLOWED_ORIGINS": '["https://app.example/"]'}, "'https://app.example/' is not an origin"),  # would match no Origin
        ({"MOEBUS_OPENAI_ALLOWED_ORIGINS": '["app.example"]'}, "'app.example' is not an origin"),
        ({"MOEBUS_API_KEY": ""}, r"^openai settings: MOEBUS_API_KEY=<hidden>: api_key is empty"),
        ({"MOEBUS_API_KEY": "[]"}, r"^openai settings: MOEBUS_API_KEY=<hidden>: api_key is empty"),
        ({"MOEBUS_API_KEY": '["sk-old", ""]'}, r"^openai settings: MOEBUS_API_KEY=<hidden>: api_key: key 2 of 2 is empty"),
    ]:
        with pytest.raises(SettingsError, match=error):
            load_settings(OpenAISettings, "openai", env=env)


def test_openai_access_flags_take_vllms_json_lists(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    from services.openai.server import _parse

    for var in [v for v in os.environ if v.startswith("MOEBUS_")]:
        monkeypatch.delenv(var)
    got = _parse(["--api-key", "sk-flag", "--allowed-origins", '["https://app.example"]', "--allow-credentials",
                  "--allowed-methods", '["GET", "POST"]', "--allowed-headers", '["authorization"]'])
    assert (got.api_keys(), got.allowed_origins, got.allow_credentials, got.allowed_methods, got.allowed_headers) == \
        (["sk-flag"], ["https://app.example"], True, ["GET", "POST"], ["authorization"])
    assert _parse(["--api-key", "sk-old", "sk-new"]).api_keys() == ["sk-old", "sk-new"]  # vLLM's several keys
    with pytest.raises(SystemExit) as usage:
        _parse(["--allowed-origins", "https://app.example"])  # not JSON: a usage error, not a list of its characters
    assert usage.value.code == 2 and "argument --allowed-origins: expected a JSON list of strings" in capsys.readouterr().err


# ---------------------------------------------------------------- compose files


def test_compose_files_parse_into_local_services():
    specs = {s.name: s for s in load_compose(REPO_ROOT / "compose" / "split-nodes.yml", env={"DECODE_DP": "4"}, scale={"gateway": 3})}
    assert set(specs) == {"gateway", "scheduler", "prefill", "decode", "openai", "metrics"}  # the `nats` service is replaced locally
    assert specs["gateway"].replicas == 3 and specs["scheduler"].replicas == 2
    assert specs["decode"].env["MOEBUS_DECODE_DP"] == "4" and specs["prefill"].env["MOEBUS_PREFILL_TP"] == "2"
    single = {s.name: s for s in load_compose(REPO_ROOT / "compose" / "single-node.yml", env={"MOEBUS_OPENAI_PORT": "8123"})}
    roles = ("gateway", "scheduler", "prefill", "decode", "openai", "metrics")
    assert [single[n].role for n in roles] == list(roles)
    # The HTTP frontends' address comes from the environment, as docker compose reads it, and reaches them as their settings.
    for compose in ("single-node.yml", "split-nodes.yml"):
        specs = {s.name: s for s in load_compose(REPO_ROOT / "compose" / compose, env={"MOEBUS_OPENAI_PORT": "8123"})}
        openai = load_settings(OpenAISettings, "openai", env=specs["openai"].env)
        metrics = load_settings(MetricsSettings, "metrics", env=specs["metrics"].env)
        assert (openai.http_host, openai.port, metrics.http_host, metrics.port) == ("0.0.0.0", 8123, "0.0.0.0", 9464), compose
        assert specs["openai"].args == specs["metrics"].args == [], compose


def test_nats_max_payload_is_typed_and_bounded_by_nats_servers_cap(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert nats_server_settings(env={}).max_payload == 8 << 20
    assert nats_server_settings(env={"MOEBUS_NATS_MAX_PAYLOAD": str(16 << 20)}).max_payload == 16 << 20
    assert nats_server_settings(32 << 20, env={"MOEBUS_NATS_MAX_PAYLOAD": str(16 << 20)}).max_payload == 32 << 20  # the flag wins
    assert launch.nats_config(NatsServerSettings(max_payload=64 << 20)) == f"max_payload: {64 << 20}\n"
    with pytest.raises(SettingsError, match=r"MOEBUS_NATS_MAX_PAYLOAD.*Expected `int`"):
        nats_server_settings(env={"MOEBUS_NATS_MAX_PAYLOAD": "8MB"})
    with pytest.raises(SettingsError, match=r"--nats-max-payload.*max_payload must be in \[1048576, 67108864\].*got 67108865"):
        nats_server_settings((64 << 20) + 1)  # nats-server would refuse to start
    with pytest.raises(SettingsError, match=r"max_payload must be in \[1048576, 67108864\].*got 1000"):
        nats_server_settings(env={"MOEBUS_NATS_MAX_PAYLOAD": "1000"})
    # `moebus up` says so and starts nothing.
    assert launch.main(["--model", str(tmp_path), "--log-dir", str(tmp_path / "logs"), "--nats-max-payload", "1000"]) == 2
    assert "max_payload must be in [1048576, 67108864] bytes" in capsys.readouterr().err and not (tmp_path / "logs").exists()


@pytest.mark.parametrize("compose", ["single-node.yml", "split-nodes.yml"])
def test_compose_files_configure_nats_as_moebus_up_does(compose: str):
    """Under docker compose, the `nats` service reads the config file `moebus up` writes for its
    local server, from the same variable with the same default."""
    doc = yaml.safe_load((REPO_ROOT / "compose" / compose).read_text())
    nats = doc["services"]["nats"]
    (mount,) = nats["configs"]
    assert nats["command"][:2] == ["-c", mount["target"]]
    content = doc["configs"][mount["source"]]["content"]
    assert interpolate(content, {}) == launch.nats_config(NatsServerSettings())
    raised = {"MOEBUS_NATS_MAX_PAYLOAD": str(32 << 20)}
    assert interpolate(content, raised) == launch.nats_config(nats_server_settings(env=raised))


@pytest.mark.parametrize("compose", ["single-node.yml", "split-nodes.yml"])
def test_compose_files_pass_the_callers_api_key_and_origins_to_the_openai_service(compose: str):
    """Without a value docker compose passes the caller's variable on, or leaves it unset: no key stays no key
    (an empty one, as `${VAR:-}` would give, is refused at start). `moebus up` runs every process in the
    caller's environment, so the service's settings leave them out."""
    doc = yaml.safe_load((REPO_ROOT / "compose" / compose).read_text())
    env = doc["services"]["openai"]["environment"]
    assert env["MOEBUS_OPENAI_API_KEY"] is None and env["MOEBUS_OPENAI_ALLOWED_ORIGINS"] is None
    (spec,) = [s for s in load_compose(REPO_ROOT / "compose" / compose, env={}) if s.role == "openai"]
    assert "MOEBUS_OPENAI_API_KEY" not in spec.env and "MOEBUS_OPENAI_ALLOWED_ORIGINS" not in spec.env


def test_compose_errors_name_the_problem(tmp_path: Path):
    bad = tmp_path / "bad.yml"
    bad.write_text("services:\n  web:\n    command: [nginx]\n")
    with pytest.raises(StackError, match="web"):
        load_compose(bad, env={})
    with pytest.raises(StackError, match="nosuch"):
        load_compose(REPO_ROOT / "compose" / "single-node.yml", env={}, scale={"nosuch": 2})


@pytest.mark.parametrize(("text", "expected"), [
    # docker compose's interpolation, each form with VAR set, empty and unset (SET=x, EMPTY="", no UNSET)
    ("${SET}/$SET/${EMPTY}/${UNSET}/$UNSET", "x/x///"),
    ("${SET:-d} ${EMPTY:-d} ${UNSET:-d}", "x d d"),
    ("${SET-d} ${EMPTY-d} ${UNSET-d}", "x  d"),  # `-`: the default only when unset
    ("${SET:+r} ${EMPTY:+r} ${UNSET:+r}", "r  "),
    ("${SET+r} ${EMPTY+r} ${UNSET+r}", "r r "),
    ("${SET?m} ${EMPTY?m}", "x "),
    ("$$SET costs 5$ ${UNSET:-${SET}-${UNSET:-deep}}", "$SET costs 5$ x-deep"),  # $$ escapes; nested defaults
])
def test_compose_interpolation_follows_docker_compose(text: str, expected: str):
    assert interpolate(text, {"SET": "x", "EMPTY": ""}) == expected


def test_compose_required_variables_and_unquoted_restart_no(tmp_path: Path):
    stack = tmp_path / "stack.yml"
    stack.write_text("services:\n  decode:\n    command: moebus decode\n    restart: no\n"
                     "    environment:\n      MOEBUS_MODEL: ${MODEL_DIR:?set MODEL_DIR to the checkpoint}\n"
                     "      MOEBUS_DECODE_MAX_BATCH: ${DECODE_MAX_BATCH-64}\n")
    (spec,) = load_compose(stack, env={"MODEL_DIR": "/ckpt", "DECODE_MAX_BATCH": ""})
    # YAML 1.1 reads an unquoted `no` as false; docker compose takes it as the policy "no".
    assert spec.restart == "no"
    assert spec.env == {"MOEBUS_MODEL": "/ckpt", "MOEBUS_DECODE_MAX_BATCH": ""}
    assert spec.env_knobs == {"MOEBUS_MODEL": "MODEL_DIR", "MOEBUS_DECODE_MAX_BATCH": "DECODE_MAX_BATCH"}
    for env, why in (({}, "unset"), ({"MODEL_DIR": ""}, "empty")):
        with pytest.raises(StackError, match=rf"stack.yml: service 'decode': the compose file needs MODEL_DIR \({why}\): set MODEL_DIR to the checkpoint"):
            load_compose(stack, env=env)
    stack.write_text("services:\n  decode:\n    command: moebus decode --max-batch ${BATCH\n")
    with pytest.raises(StackError, match=r"service 'decode': invalid interpolation format .* without its '}'"):
        load_compose(stack, env={})


# ---------------------------------------------------------------- completion assembly


class CharTokens:
    """A detokenizer over single characters (token id = code point), to test assembly alone."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []

    def add(self, ids: list[int]) -> str:
        self.token_ids += ids
        return "".join(map(chr, ids))

    def flush(self) -> str:
        return ""


def batch(start: int, text: str, finish: str | None = None) -> TokenBatch:
    return TokenBatch(request_id="r", start=start, token_ids=[ord(c) for c in text], finish_reason=finish)  # type: ignore[arg-type]


def test_completion_holds_back_a_possible_stop_string_and_cuts_at_it():
    c = Completion(CharTokens(), stop=["END"], max_tokens=100)  # type: ignore[arg-type]
    assert c.add(batch(0, "abcE")).text == "abc"  # "E" may start "END"
    assert c.add(batch(4, "x")).text == "Ex"  # it did not
    assert c.add(batch(5, "yEN")).text == "y"
    assert c.add(batch(8, "Dzz")).text == ""
    assert c.finish_reason == "stop" and c.final_text == "abcExy"


def test_completion_ignores_stop_strings_ending_before_min_tokens():
    c = Completion(CharTokens(), stop=["END", "b"], max_tokens=100, min_tokens=5)  # type: ignore[arg-type]
    assert c.add(batch(0, "abE")).text == "ab"  # "b" is within the first 5 tokens; "E" may still start "END"
    # "END" ends with token 5: not a stop (vLLM checks from token 6 on); the "b" of token 7 is
    assert c.add(batch(3, "NDxb")).text == "ENDx"
    assert c.finish_reason == "stop" and c.final_text == "abENDx"
    straddling = Completion(CharTokens(), stop=["ab"], max_tokens=100, min_tokens=2)  # type: ignore[arg-type]
    assert straddling.add(batch(0, "xabc")).text == "x"  # "ab" ends with token 3, past the first 2: it stops


def test_completion_cuts_the_text_of_a_stop_token_and_keeps_stops_with_include_stop():
    """vLLM's rules: the text of the request's stop token that ended the completion is left out
    (the token is still counted), EOS and a stop string are too; include_stop (vLLM's
    include_stop_str_in_output) keeps the stop token's text and the stop string."""
    by_token = Completion(CharTokens(), stop=[], max_tokens=100, stop_token_ids=frozenset({ord("|")}))  # type: ignore[arg-type]
    assert by_token.add(batch(0, "ab")).text == "ab"
    assert by_token.add(batch(2, "c|", finish="stop")).text == "c"
    assert by_token.final_text == "abc" and by_token.token_ids == [ord(x) for x in "abc|"] and by_token.finish_reason == "stop"
    kept = Completion(CharTokens(), stop=[], max_tokens=100, stop_token_ids=frozenset({ord("|")}), include_stop=True)  # type: ignore[arg-type]
    assert kept.add(batch(0, "abc|", finish="stop")).text == "abc|"
    eos = Completion(CharTokens(), stop=[], max_tokens=100, stop_token_ids=frozenset({ord("|")}))  # type: ignore[arg-type]
    assert eos.add(batch(0, "ab$", finish="stop")).text == "ab$"  # an EOS id (not the request's) is the detokenizer's to skip
    with_string = Completion(CharTokens(), stop=["END"], max_tokens=100, include_stop=True)  # type: ignore[arg-type]
    assert with_string.add(batch(0, "abEN")).text == "ab"
    assert with_string.add(batch(4, "Dzz")).text == "END"
    assert with_string.finish_reason == "stop" and with_string.final_text == "abEND"
    # vLLM's stop_reason: the stop token or string that ended it, None for EOS or max_tokens
    assert (by_token.stop_reason, kept.stop_reason, eos.stop_reason, with_string.stop_reason) == (ord("|"), ord("|"), None, "END")
    long = Completion(CharTokens(), stop=["x"], max_tokens=2)  # type: ignore[arg-type]
    long.add(batch(0, "ab"))
    assert (long.finish_reason, long.stop_reason) == ("length", None)
    late = Completion(CharTokens(), stop=[], max_tokens=100, min_tokens=3, stop_token_ids=frozenset({ord("|")}))  # type: ignore[arg-type]
    assert late.add(batch(0, "abc|", finish="stop")).text == "abc" and late.final_text == "abc"


def test_completion_reorders_batches_and_enforces_max_tokens():
    c = Completion(CharTokens(), stop=[], max_tokens=4)  # type: ignore[arg-type]
    assert not c.add(batch(1, "bc"))
    assert c.add(batch(0, "a")).text == "abc"
    assert c.add(batch(3, "de")).text == "d"
    assert c.finish_reason == "length" and c.token_ids == [ord(x) for x in "abcd"]


def test_completion_fails_once_a_batch_after_token_0_is_missing():
    c = Completion(CharTokens(), stop=[], max_tokens=100)  # type: ignore[arg-type]
    assert not c.add(batch(1, "b"))  # the decode rank's batches may overtake the prefill's token 0
    assert not c.add(batch(3, "d"))  # ... so nothing is known lost yet
    with pytest.raises(TokensLost, match="tokens 2..2 of the completion never arrived"):
        c.add(batch(0, "a"))
    c = Completion(CharTokens(), stop=[], max_tokens=100)  # type: ignore[arg-type]
    c.add(batch(0, "a"))
    c.add(batch(1, "b"))
    with pytest.raises(TokensLost, match="tokens 2..3"):
        c.add(batch(4, "e"))


def test_completion_names_every_prompt_token_when_prompt_logprobs_are_asked_for():
    def piece(t: int) -> tuple[str, bytes]:
        return chr(t), chr(t).encode()

    c = Completion(CharTokens(), stop=[], max_tokens=5, token_piece=piece, prompt_ids=[ord("x"), ord("y")])  # type: ignore[arg-type]
    first = TokenBatch(request_id="r", start=0, token_ids=[ord("a")], prompt_logprobs=[-1.5])
    delta = c.add(first)
    assert [(e.token, e.logprob) for e in delta.prompt_logprobs or []] == [("x", None), ("y", -1.5)]
    one = Completion(CharTokens(), stop=[], max_tokens=5, token_piece=piece, prompt_ids=[ord("x")])  # type: ignore[arg-type]
    assert [(e.token, e.logprob) for e in one.add(TokenBatch(request_id="r", start=0, token_ids=[ord("a")])).prompt_logprobs or []] == [("x", None)]
    assert c.add(TokenBatch(request_id="r", start=1, token_ids=[ord("b")])).prompt_logprobs is None  # only with token 0


def test_completion_releases_everything_at_the_end():
    c = Completion(CharTokens(), stop=["STOP"], max_tokens=100)  # type: ignore[arg-type]
    assert c.add(batch(0, "xST")).text == "x"
    assert c.add(batch(3, "O", finish="stop")).text == "STO"  # EOS: the held-back tail is final text
    assert c.finish_reason == "stop"


# ---------------------------------------------------------------- placement


def hb(role: str, instance: str, rank: int = 0, **kw) -> Heartbeat:
    return Heartbeat(role=role, instance=instance, rank=rank, model="m", version="v", started_at=1.0, **kw)  # type: ignore[arg-type]


def test_decode_placement_prefers_free_kv_and_respects_caps():
    reg = Registry(expiry_s=10, model="m")
    reg.update(hb("decode", "a", kv_total_pages=100, kv_free_pages=50, page_size=16, batch_size=1, max_batch=4))
    reg.update(hb("decode", "b", kv_total_pages=100, kv_free_pages=90, page_size=16, batch_size=4, max_batch=4))  # full batch
    reg.update(hb("decode", "c", kv_total_pages=100, kv_free_pages=80, page_size=16, batch_size=0, max_batch=4))
    reg.update(hb("decode", "d", kv_free_pages=100, page_size=16, max_batch=4, draining=True))
    reg.update(Heartbeat(role="decode", instance="e", rank=0, model="other", version="v", started_at=1.0, kv_free_pages=100, page_size=16, max_batch=4))
    assert [m.hb.instance for m in reg.decode_candidates(16 * 60)] == ["c"]  # 60 pages: only c has them
    assert [m.hb.instance for m in reg.decode_candidates(16)] == ["c", "a"]
    assert reg.suspect(("decode", "c", 0)) is not None and reg.suspect(("decode", "c", 0)) is None  # once
    assert [m.hb.instance for m in reg.decode_candidates(16)] == ["a"]
    assert reg.suspect(("decode", "nobody", 0)) is None


def test_a_decode_rank_the_estimate_counts_full_is_asked_while_its_heartbeat_shows_room_until_it_refuses():
    """The scheduler's estimate only grows between heartbeats (it cannot see requests that finished):
    at the cap by the estimate but with room by its last heartbeat, a rank is still a candidate, after
    the ranks with room by the estimate, until it refuses; its next heartbeat makes it one again."""
    reg = Registry(expiry_s=10, model="m")
    reg.update(hb("decode", "a", kv_total_pages=100, kv_free_pages=90, page_size=16, batch_size=1, max_batch=4))
    reg.update(hb("decode", "b", kv_total_pages=100, kv_free_pages=90, page_size=16, batch_size=4, max_batch=4))  # full by its heartbeat
    a = reg.members[("decode", "a", 0)]
    a.pending_batch = 3  # placed since its heartbeat: 4 by the estimate
    assert [m.hb.instance for m in reg.decode_candidates(16)] == ["a"]
    reg.update(hb("decode", "c", kv_total_pages=100, kv_free_pages=50, page_size=16, batch_size=0, max_batch=4))
    assert [m.hb.instance for m in reg.decode_candidates(16)] == ["c"]  # room by the estimate comes first
    del reg.members[("decode", "c", 0)]
    a.pending_pages, a.refused = a.hb.kv_free_pages, True  # as `Scheduler._reserve` records a refusal
    assert reg.decode_candidates(16) == []
    reg.update(hb("decode", "a", kv_total_pages=100, kv_free_pages=90, page_size=16, batch_size=3, max_batch=4))
    assert [m.hb.instance for m in reg.decode_candidates(16)] == ["a"]


def test_a_suspect_decode_rank_stays_suspect_across_heartbeats_until_it_restarts():
    """The suspicion is kept by key: the heartbeat that replaces the Member (its reservations may
    stall while it beats on) does not clear it; a new process (another started_at) is not suspect."""
    reg = Registry(expiry_s=10, model="m")
    beat = hb("decode", "c", kv_total_pages=100, kv_free_pages=80, page_size=16, max_batch=4)
    reg.update(beat)
    reg.suspect(("decode", "c", 0))
    reg.update(beat)
    assert reg.decode_candidates(16) == []
    reg.update(msgspec.structs.replace(beat, started_at=2.0))
    assert [m.hb.instance for m in reg.decode_candidates(16)] == ["c"]


def test_prefill_placement_fewest_queued_tokens_and_expiry():
    reg = Registry(expiry_s=0.05)
    reg.update(hb("prefill", "p1", queued_tokens=500))
    reg.update(hb("prefill", "p2", queued_tokens=100))
    prompt = list(range(40))
    best = reg.prefill_for(prompt, 0)  # no affinity: the least loaded
    assert best is not None and best.hb.instance == "p2"
    best.pending_tokens += 1000  # what this scheduler sent since the heartbeat counts too
    assert reg.prefill_for(prompt, 0).hb.instance == "p1"  # type: ignore[union-attr]
    time.sleep(0.06)
    assert sorted(reg.expire()) == [("prefill", "p1", 0), ("prefill", "p2", 0)]
    assert reg.prefill_for(prompt, 0) is None


# ---------------------------------------------------------------- the wire contract


def test_every_schema_struct_forbids_unknown_fields_and_schemas_import_only_msgspec():
    import ast
    import inspect

    import msgspec

    import schemas.api
    import schemas.internal

    structs = [obj for mod in (schemas.api, schemas.internal) for obj in vars(mod).values() if inspect.isclass(obj) and issubclass(obj, msgspec.Struct) and obj.__module__ == mod.__name__]
    assert len(structs) > 15
    for struct in structs:
        assert struct.__struct_config__.forbid_unknown_fields, struct.__name__
    for path in (REPO_ROOT / "schemas").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert all(n.split(".")[0] in ("msgspec", "schemas", "__future__", "typing") for n in names), (path, names)


def test_no_asyncio_wait_for_nor_nats_request_outside_tests():
    """On Python 3.11 (supported), `asyncio.wait_for` returns a result that arrives in the same turn of
    the event loop as a cancel and drops the cancel: the task runs on (tests/services/test_stream_cancel.py
    shows what that did to a hung-up client's stream). `async with asyncio.timeout(...)` keeps it."""
    import ast

    found = []
    for package in ("services", "shared", "schemas", "kernels", "bench"):
        for path in (REPO_ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr == "wait_for" and isinstance(node.value, ast.Name) and node.value.id == "asyncio":
                    found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} asyncio.wait_for (use asyncio.timeout)")
                # nats-py's request() waits with wait_for inside: Bus.nats_request keeps the cancel
                if (isinstance(node, ast.Attribute) and node.attr == "request" and isinstance(node.value, ast.Attribute)
                        and node.value.attr == "nc" and path != REPO_ROOT / "shared" / "bus.py"):
                    found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} nc.request (use Bus.nats_request)")
    assert found == [], found


def test_no_suppressed_cancel_around_an_await_outside_shared_tasks():
    """``task.cancel(); with suppress(CancelledError): await task`` swallows a cancel of the task that
    waits too: that cancel reaches the awaited task and comes back as its CancelledError, and the
    waiting task runs on (tests/services/test_stop_cancel.py). `shared.tasks.cancel_and_wait` keeps it."""
    import ast

    found = []
    for package in ("services", "shared", "schemas", "kernels", "bench"):
        for path in (REPO_ROOT / package).rglob("*.py"):
            if path == REPO_ROOT / "shared" / "tasks.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, (ast.With, ast.AsyncWith)):
                    continue
                for item in node.items:
                    call = item.context_expr
                    if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "suppress"
                            and any(isinstance(a, ast.Attribute) and a.attr == "CancelledError" for a in call.args)
                            and any(isinstance(n, ast.Await) for stmt in node.body for n in ast.walk(stmt))):
                        found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} suppress(CancelledError) around an await (use cancel_and_wait)")
    assert found == [], found
