"""vLLM's ``/tokenize`` and ``/detokenize`` on `moebus openai`, and the bus subjects behind them
(``llm.tokenize``, ``llm.detokenize``, answered by the gateway), against a real stack
(compose/single-node.yml, tiny model with the real Qwen3 tokenizer, real nats-server): the ids are
transformers' for the same text, a chat's are those a chat completion of it is fed (its usage's
prompt_tokens), detokenizing gives the text back, bad requests get typed errors, and `moebus request
--tokenize` prints the ids."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from schemas import subjects
from schemas.api import ChatMessage, DetokenizeRequest, ErrorReply, TokenizeReply, TokenizeRequest, Tool
from services.client import Client, GenerateError
from shared.bus import CONTENT_TYPE, MSGPACK, connect, decode_public
from services_helpers import frontend_address, post_json, run, session, stack_fixture

pytestmark = pytest.mark.slow

stack = stack_fixture("single-node.yml")

PROMPT = "The capital of France is Paris. 東京は日本の首都です。"
CHAT = [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Capital of France?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def frontend(stack) -> tuple[str, int]:
    return frontend_address(stack)


@pytest.fixture(scope="module")
def hf_tok(tiny_model: Path):  # type: ignore[no-untyped-def]
    """transformers' tokenizer of the checkpoint: the reference."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


def over_bus(stack, call, content_type: str | None = None):  # type: ignore[no-untyped-def]
    """``call(client)``'s result (or the GenerateError it raised) with a `Client` on the stack's bus."""
    async def go():  # type: ignore[no-untyped-def]
        async with session(stack.url) as (client, _):
            if content_type is not None:
                client = Client(client.bus, content_type)
            try:
                return await call(client)
            except GenerateError as e:
                return e

    return run(go())


def served_context(stack) -> int:
    models = over_bus(stack, lambda c: c.models())
    return models.models[0].max_context


def test_a_prompts_ids_are_the_tokenizers(stack, frontend, hf_tok):
    """Over HTTP (vLLM's shape, token_strs null unless asked) and over the bus in JSON and msgpack."""
    want = hf_tok(PROMPT)["input_ids"]
    context = served_context(stack)
    status, body = post_json(frontend, "/tokenize", {"prompt": PROMPT})
    assert status == 200 and body == {"count": len(want), "max_model_len": context, "tokens": want, "token_strs": None}, body
    status, body = post_json(frontend, "/tokenize", {"model": "", "prompt": PROMPT, "add_special_tokens": False, "return_token_strs": True})
    assert status == 200 and body["tokens"] == want and body["token_strs"] == hf_tok.convert_ids_to_tokens(want), body
    for content_type in (None, MSGPACK):
        r = over_bus(stack, lambda c: c.tokenize(TokenizeRequest(prompt=PROMPT, return_token_strs=True)), content_type)
        assert (r.tokens, r.count, r.max_model_len) == (want, len(want), context), r
        assert r.token_strs == hf_tok.convert_ids_to_tokens(want)


@pytest.mark.parametrize("fields", [
    {},
    {"chat_template_kwargs": {"enable_thinking": False}, "tools": TOOLS},
    {"add_generation_prompt": False, "continue_final_message": True,
     "messages": [*CHAT, {"role": "assistant", "content": "The capital is"}]},
], ids=["chat", "kwargs-and-tools", "continued"])
def test_a_chats_ids_are_what_a_chat_completion_of_it_is_fed(stack, frontend, hf_tok, fields):
    """The ids are transformers' rendering of the chat template, and as many as the prompt_tokens of
    a real /v1/chat/completions call with the same messages and template settings."""
    body = {"messages": CHAT, **fields}
    status, tokenized = post_json(frontend, "/tokenize", body)
    assert status == 200, tokenized
    continued = fields.get("continue_final_message", False)
    text = hf_tok.apply_chat_template(body["messages"], tools=body.get("tools"), tokenize=False, add_generation_prompt=not continued,
                                      continue_final_message=continued, **body.get("chat_template_kwargs", {}))
    assert tokenized["tokens"] == hf_tok(text, add_special_tokens=False)["input_ids"]
    extra = {"tool_choice": "none"} if "tools" in body else {}  # this frontend parses no tool calls
    status, completion = post_json(frontend, "/v1/chat/completions", body | extra | {"max_tokens": 1, "temperature": 0})
    assert status == 200, completion
    assert tokenized["count"] == completion["usage"]["prompt_tokens"] == len(tokenized["tokens"])
    native = TokenizeRequest(messages=msgspec.convert(body["messages"], list[ChatMessage]), tools=msgspec.convert(body.get("tools"), list[Tool] | None),
                             add_generation_prompt=not continued, continue_final_message=continued, chat_template_kwargs=body.get("chat_template_kwargs"))
    assert over_bus(stack, lambda c: c.tokenize(native)).tokens == tokenized["tokens"]  # the same chat over the bus


def test_detokenize_gives_the_text_back_special_tokens_included(stack, frontend, hf_tok):
    status, tokenized = post_json(frontend, "/tokenize", {"prompt": PROMPT})
    status, body = post_json(frontend, "/detokenize", {"tokens": tokenized["tokens"]})
    assert status == 200 and body == {"prompt": PROMPT}, body
    status, chat = post_json(frontend, "/tokenize", {"messages": CHAT})
    status, body = post_json(frontend, "/detokenize", {"model": "", "tokens": chat["tokens"]})
    assert status == 200 and body["prompt"] == hf_tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True), body
    assert "<|im_start|>" in body["prompt"]
    r = over_bus(stack, lambda c: c.detokenize(DetokenizeRequest(tokens=chat["tokens"])))
    assert r.prompt == body["prompt"]


def test_ids_outside_the_vocabulary_are_refused_by_name(stack, frontend, hf_tok):
    vocab = len(hf_tok)
    tokens = [9707, -1, vocab, 10**12]
    status, body = post_json(frontend, "/detokenize", {"tokens": tokens})
    assert status == 400 and body["error"]["code"] == "invalid_request", body
    assert f"[-1, {vocab}, {10**12}] outside the tokenizer's vocabulary [0, {vocab})" in body["error"]["message"], body
    e = over_bus(stack, lambda c: c.detokenize(DetokenizeRequest(tokens=tokens)))
    assert isinstance(e, GenerateError) and e.code == "invalid_request" and f"{vocab}" in e.message, e


@pytest.mark.parametrize(("body", "says"), [
    ({"prompt": PROMPT, "messages": CHAT}, "give exactly one of prompt, messages (got ['prompt', 'messages'])"),
    ({}, "give exactly one of prompt, messages (got none)"),
    ({"messages": CHAT, "add_generation_prompt": True, "continue_final_message": True}, "Cannot set both"),
    ({"prompt": PROMPT, "tools": TOOLS}, "tools: only with messages"),
    ({"messages": CHAT, "chat_template": "{{ messages }}"}, "chat_template (accepted only as null)"),
    ({"prompt": PROMPT, "max_tokens": 4}, 'unknown field `max_tokens`'),
])
def test_bad_tokenize_requests_are_refused(frontend, body, says):
    status, answer = post_json(frontend, "/tokenize", body)
    assert status == 400 and answer["error"]["code"] == "invalid_request" and says in answer["error"]["message"], answer


def test_bad_requests_over_the_bus_get_typed_errors(stack):
    both = over_bus(stack, lambda c: c.tokenize(TokenizeRequest(prompt=PROMPT, messages=[ChatMessage("user", "hi")])))
    neither = over_bus(stack, lambda c: c.tokenize(TokenizeRequest()))
    assert isinstance(both, GenerateError) and both.code == "invalid_request" and "exactly one of prompt, messages" in both.message, both
    assert isinstance(neither, GenerateError) and neither.code == "invalid_request" and "(got none)" in neither.message, neither

    async def raw(payload: bytes, subject: str = subjects.TOKENIZE, headers: dict[str, str] | None = None) -> ErrorReply:
        async with connect(stack.url, "tests") as bus:
            msg = await bus.nats_request(subject, payload, 30, headers)
            return decode_public(msg.data, TokenizeReply, (headers or {}).get(CONTENT_TYPE, "application/json"))

    malformed = run(raw(b'{"prompt": '))
    unknown_field = run(raw(b'{"prompt": "hi", "max_tokens": 4}'))
    bad_msgpack = run(raw(b"\xc1", subjects.DETOKENIZE, {CONTENT_TYPE: MSGPACK}))
    assert isinstance(malformed, ErrorReply) and malformed.error.code == "invalid_request" and "malformed json" in malformed.error.message
    assert isinstance(unknown_field, ErrorReply) and "max_tokens" in unknown_field.error.message, unknown_field
    assert isinstance(bad_msgpack, ErrorReply) and "malformed msgpack" in bad_msgpack.error.message, bad_msgpack


def test_an_unknown_model_is_refused(stack, frontend):
    for path, body in [("/tokenize", {"model": "gpt-4", "prompt": PROMPT}), ("/detokenize", {"model": "gpt-4", "tokens": [9707]})]:
        status, answer = post_json(frontend, path, body)
        assert status == 404 and answer["error"]["code"] == "unknown_model" and "'gpt-4' is not served here" in answer["error"]["message"], answer
    e = over_bus(stack, lambda c: c.tokenize(TokenizeRequest(model="gpt-4", prompt=PROMPT)))
    assert isinstance(e, GenerateError) and e.code == "unknown_model", e
    e = over_bus(stack, lambda c: c.detokenize(DetokenizeRequest(model="gpt-4", tokens=[9707])))
    assert isinstance(e, GenerateError) and e.code == "unknown_model", e


def test_oversize_requests_and_answers_get_typed_errors(stack, frontend):
    """A request over the NATS server's max_payload (8 MiB here) never leaves the client (HTTP: 413);
    an answer over it (ids and their strings take more bytes than the text: 1.8 MB of CJK text gives
    some 12 MB) is refused naming the limit, not left unanswered."""
    huge = "a" * (9 << 20)
    e = over_bus(stack, lambda c: c.tokenize(TokenizeRequest(prompt=huge)))
    assert isinstance(e, GenerateError) and e.code == "invalid_request" and "max_payload" in e.message, e
    status, answer = post_json(frontend, "/tokenize", {"prompt": huge})
    assert status == 413 and answer["error"]["code"] == "request_too_large", answer
    cjk = "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(600_000))
    e = over_bus(stack, lambda c: c.tokenize(TokenizeRequest(prompt=cjk, return_token_strs=True)))
    assert isinstance(e, GenerateError) and e.code == "invalid_request" and "the reply is too large for the bus" in e.message, e
    r = over_bus(stack, lambda c: c.tokenize(TokenizeRequest(prompt=cjk[:1000])))
    assert r.count > 0  # the gateway serves on


def test_moebus_request_tokenize_prints_the_ids_or_the_text(stack, hf_tok):
    def request(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "services.cli", "request", "--url", stack.url, "--tokenize", *args],
                              capture_output=True, text=True, timeout=60)

    ids = hf_tok(PROMPT)["input_ids"]
    proc = request("--prompt", PROMPT)
    assert proc.returncode == 0 and proc.stdout == ",".join(map(str, ids)) + "\n" and f"[count={len(ids)} max_model_len=" in proc.stderr, proc
    chat = hf_tok(hf_tok.apply_chat_template([CHAT[1]], tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    proc = request("--chat", CHAT[1]["content"], "--msgpack")
    assert proc.returncode == 0 and proc.stdout == ",".join(map(str, chat)) + "\n", proc
    proc = request("--input-ids", ",".join(map(str, ids)))
    assert proc.returncode == 0 and proc.stdout == PROMPT + "\n", proc
    proc = request("--input-ids", "9707,999999999")
    assert proc.returncode == 1 and "error invalid_request: tokens: [999999999] outside the tokenizer's vocabulary" in proc.stderr, proc
