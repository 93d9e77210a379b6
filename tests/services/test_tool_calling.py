"""Tool calling and reasoning for the OpenAI chat endpoint, without a stack: the hermes / qwen3
parsers on realistic Qwen3 answers (whole, streamed at every split, streamed token by token
through the gateway's detokenizer with the real Qwen3 tokenizer), the response shapes, the
request checks, and the prompt a chat with tools renders to, against transformers' own
``apply_chat_template`` on the real Qwen3 tokenizer files. End to end: tests/services/test_openai.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schemas.api import ChatMessage, GenerateChunk, GenerateRequest, GenerateResponse, Timing, Tool, ToolCall, ToolCallFunction, ToolFunction, Usage
from services.gateway.admission import Admission, ModelInfo, Rejected
from services.openai import protocol
from services.openai.tool_parsing import ChatOutputParser, Delta, parse_answer
from shared.model.tokenizer import Tokenizer
from shared.settings import GatewaySettings

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_call>'
BROKEN = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'

# (answer, reasoning parser, tool parser) -> (reasoning, content, [(name, arguments as objects)])
CASES = {
    "one call": ((WEATHER, False, True), ("", None, [("get_weather", {"city": "Paris", "unit": "celsius"})])),
    "two calls": ((WEATHER + "\n" + TIME, False, True),
                  ("", None, [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "Europe/Paris"})])),
    "text before a call": (("I'll check the weather in Paris for you.\n\n" + WEATHER, False, True),
                           ("", "I'll check the weather in Paris for you.", [("get_weather", {"city": "Paris", "unit": "celsius"})])),
    "malformed JSON stays content": ((BROKEN, False, True), ("", BROKEN, [])),
    "a malformed block beside a good one": ((BROKEN + "\n" + TIME, False, True), ("", BROKEN, [("get_time", {"timezone": "Europe/Paris"})])),
    "arguments not an object stay content": (('<tool_call>\n{"name": "f", "arguments": "x"}\n</tool_call>', False, True),
                                             ("", '<tool_call>\n{"name": "f", "arguments": "x"}\n</tool_call>', [])),
    "unicode arguments": (('<tool_call>\n{"name": "translate", "arguments": {"text": "Grüße aus Zürich 🌧", "to": "日本語"}}\n</tool_call>', False, True),
                          ("", None, [("translate", {"text": "Grüße aus Zürich 🌧", "to": "日本語"})])),
    "reasoning and a call": (("<think>\nThe user asks about Paris weather; I have get_weather.\n</think>\n\n" + WEATHER, True, True),
                             ("The user asks about Paris weather; I have get_weather.", None, [("get_weather", {"city": "Paris", "unit": "celsius"})])),
    "reasoning, text and a call": (("<think>\nNeed the tool.\n</think>\n\nOne moment.\n" + WEATHER, True, True),
                                   ("Need the tool.", "One moment.", [("get_weather", {"city": "Paris", "unit": "celsius"})])),
    "a call written inside reasoning is not made": (("<think>\nMaybe " + WEATHER + "?\n</think>\n\nIt is sunny.", True, True),
                                                   ("Maybe " + WEATHER + "?", "It is sunny.", [])),
    "reasoning whose <think> was in the prompt": (("Simple greeting.\n</think>\n\nHello! 👋", True, False), ("Simple greeting.", "Hello! 👋", [])),
    "empty thinking (/no_think)": (("<think>\n\n</think>\n\nHi there.", True, False), ("", "Hi there.", [])),
    "cut off while thinking": (("<think>\nFirst, consider", True, False), ("First, consider", None, [])),
    "tags without the tool parser stay text": (("<think>\nok\n</think>\n\n" + WEATHER, True, False), ("ok", WEATHER, [])),
    "an unclosed block holding a whole call": (('<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}', False, True),
                                              ("", None, [("get_time", {"timezone": "UTC"})])),
    "an unclosed block cut short": (('Sure.\n<tool_call>\n{"name": "get_time", "argu', False, True),
                                    ("", 'Sure.\n<tool_call>\n{"name": "get_time", "argu', [])),
    "a lone < in content": (("if a < b and b <tool then <tool_call", False, True), ("", "if a < b and b <tool then <tool_call", [])),
}


def summary(d: Delta) -> tuple[str, str | None, list[tuple[str, object]]]:
    return d.reasoning, d.content or None, [(c.name, json.loads(c.arguments)) for c in d.tool_calls]


def streamed(pieces: list[str], reasoning: bool, tools: bool) -> Delta:
    parser = ChatOutputParser(reasoning, tools)
    total = Delta()
    for piece in pieces:
        total.extend(parser.feed(piece))
    total.extend(parser.finish())
    return total


@pytest.mark.parametrize("name", CASES)
def test_parser_on_realistic_answers(name):
    (text, reasoning, tools), expected = CASES[name]
    parsed = parse_answer(text, reasoning, tools)
    assert summary(parsed) == expected
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in parsed.tool_calls)
    assert len({c.id for c in parsed.tool_calls}) == len(parsed.tool_calls)


@pytest.mark.parametrize("name", CASES)
def test_streaming_split_anywhere_gives_the_unary_answer(name):
    (text, reasoning, tools), expected = CASES[name]
    for i in range(len(text) + 1):
        for j in (i, min(i + 3, len(text))):
            assert summary(streamed([text[:i], text[i:j], text[j:]], reasoning, tools)) == expected, (i, j)
    assert summary(streamed(list(text), reasoning, tools)) == expected


@pytest.mark.parametrize("block", [
    '<tool_call>\n{"name": "f", "arguments": {"x": ' + "[" * 1100 + "]" * 1100 + '}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {"x": 1e999}}\n</tool_call>',
])
def test_a_block_no_json_can_carry_back_stays_content(block):
    """The model writes the block, so anything may be in it. JSON nested past Python's recursion
    limit raised RecursionError out of the parser (a 500, or a stream cut short); 1e999 became the
    call's arguments as '{"x": Infinity}', which is no JSON for the client's parser."""
    expected = ("", block, [])
    assert summary(parse_answer(block, False, True)) == expected
    assert summary(streamed([block[:7], block[7:40], block[40:]], False, True)) == expected


def test_unicode_arguments_stay_unescaped_json_text():
    call = parse_answer('<tool_call>\n{"name": "f", "arguments": {"city": "Zürich"}}\n</tool_call>', False, True).tool_calls[0]
    assert call.arguments == '{"city": "Zürich"}'  # as vLLM re-serialises them (ensure_ascii off)


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model)


def test_tags_survive_the_gateways_detokenizer_and_parse_token_by_token(tokenizer):
    """The gateway detokenizes with skip_special_tokens: Qwen3's think and tool-call tags are
    added tokens that are not special, so they reach the frontend; fed one token at a time the
    parser gives the unary answer."""
    text = "<think>\nThe user wants the weather.\n</think>\n\nLet me look.\n" + WEATHER + "\n" + TIME
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    for tag in ("<think>", "</think>", "<tool_call>", "</tool_call>"):
        assert tokenizer.token_to_id(tag) in ids  # one token each
    detok = tokenizer.detokenizer(skip_special_tokens=True)
    pieces = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == text  # the tags are kept, <|im_end|> dropped
    assert summary(streamed(pieces, True, True)) == (
        "The user wants the weather.", "Let me look.", [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "Europe/Paris"})])


# ---------------------------------------------------------------- response shapes


def response(text: str, finish: str = "stop") -> GenerateResponse:
    return GenerateResponse(request_id="r", model="m", text=text, token_ids=[], finish_reason=finish, usage=Usage(5, 7),
                            timing=Timing(0.0, 0.0, 0.0, 0.0))


def chunk(i: int, text: str, finish: str | None = None) -> GenerateChunk:
    return GenerateChunk(request_id="r", index=i, text=text, token_ids=[], finish_reason=finish, usage=Usage(5, 7) if finish else None)


def test_unary_message_carries_reasoning_tool_calls_and_finish_reason():
    text = "<think>\nUse the tool.\n</think>\n\n" + WEATHER
    body = protocol.Shapes(True, "x", "m", reasoning=True, tool_calls=True).response([response(text, "stop")])
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    call = message.pop("tool_calls")
    assert message == {"role": "assistant", "content": None, "reasoning_content": "Use the tool."}
    assert len(call) == 1 and call[0]["type"] == "function" and call[0]["id"].startswith("call_")
    assert call[0]["function"]["name"] == "get_weather" and json.loads(call[0]["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    plain = protocol.Shapes(True, "x", "m").response([response(text, "length")])["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": text} and plain["finish_reason"] == "length"  # no parser: untouched
    no_call = protocol.Shapes(True, "x", "m", tool_calls=True).response([response(" Hello\n", "length")])["choices"][0]
    assert no_call == {"index": 0, "message": {"role": "assistant", "content": "Hello"}, "logprobs": None, "finish_reason": "length",
                       "stop_reason": None}
    thinking = protocol.Shapes(True, "x", "m", reasoning=True).response([response("<think>\nHm", "length")])["choices"][0]
    assert thinking["message"] == {"role": "assistant", "content": None, "reasoning_content": "Hm"}  # cut off while thinking


def test_streamed_chunks_in_openais_shape_add_up_to_the_unary_message():
    text = "<think>\nTwo tools.\n</think>\n\nChecking.\n" + WEATHER + "\n" + TIME
    shapes = protocol.Shapes(True, "x", "m", n=2, reasoning=True, tool_calls=True)
    pieces = [text[i : i + 5] for i in range(0, len(text), 5)]
    deltas, finishes = {0: [], 1: []}, {0: [], 1: []}
    for k, piece in enumerate(pieces):
        for index in (0, 1):  # two choices interleaved, each with its own parser
            last = k == len(pieces) - 1
            event = shapes.chunk(chunk(k, piece, "stop" if last else None), index)
            if event is None:
                assert not last
                continue
            (c,) = event["choices"]
            assert c["index"] == index and event["object"] == "chat.completion.chunk"
            deltas[index].append(c["delta"])
            finishes[index].append(c["finish_reason"])
    for index in (0, 1):
        assert [f for f in finishes[index] if f] == ["tool_calls"] and finishes[index][-1] == "tool_calls"
        assert all(d for d in deltas[index])  # no empty deltas sent without logprobs
        assert "".join(d.get("reasoning_content", "") for d in deltas[index]) == "Two tools."
        assert "".join(d.get("content", "") for d in deltas[index]) == "Checking."
        calls = [c for d in deltas[index] for c in d.get("tool_calls", [])]
        assert [c["index"] for c in calls] == [0, 1]
        assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("function", "get_weather", {"city": "Paris", "unit": "celsius"}), ("function", "get_time", {"timezone": "Europe/Paris"})]


def test_include_reasoning_false_drops_the_reasoning_from_the_message_and_the_stream():
    """vLLM's include_reasoning: false (`drop_reasoning`): the reasoning is still split off the
    content, then left out: the unary message's reasoning_content null, no stream delta carrying it;
    content and tool calls as with it."""
    text = "<think>\nUse the tool.\n</think>\n\nOne moment.\n" + WEATHER
    kept = protocol.Shapes(True, "x", "m", reasoning=True, tool_calls=True).response([response(text)])["choices"][0]["message"]
    dropped = protocol.Shapes(True, "x", "m", reasoning=True, tool_calls=True, drop_reasoning=True).response([response(text)])["choices"][0]["message"]
    assert kept["reasoning_content"] == "Use the tool." and dropped["reasoning_content"] is None
    assert dropped["content"] == kept["content"] == "One moment." and len(dropped["tool_calls"]) == 1
    shapes = protocol.Shapes(True, "x", "m", reasoning=True, tool_calls=True, drop_reasoning=True)
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    events = [shapes.chunk(chunk(k, piece, "stop" if k == len(pieces) - 1 else None), 0) for k, piece in enumerate(pieces)]
    deltas = [e["choices"][0]["delta"] for e in events if e is not None]
    assert all(deltas) and not any("reasoning_content" in d for d in deltas)  # a reasoning-only piece sends no chunk
    assert "".join(d.get("content", "") for d in deltas) == "One moment." and sum(len(d.get("tool_calls", [])) for d in deltas) == 1


# ---------------------------------------------------------------- requests

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                                                      "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}}}},
]

# An agent loop as an OpenAI client sends it: the assistant's calls with arguments as JSON text,
# the tools' answers, then the next user turn.
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Weather and time in Paris? 天気"},
    {"role": "assistant", "content": None, "reasoning_content": "Two tools needed.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"timezone":"Europe/Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
]


def body(**fields) -> protocol.ChatCompletionRequest:
    return protocol.decode(json.dumps({"messages": CONVERSATION, "tools": TOOLS} | fields).encode(), protocol.ChatCompletionRequest)


@pytest.fixture(scope="module")
def admission(tiny_model: Path, tokenizer: Tokenizer) -> Admission:
    settings = GatewaySettings(model=str(tiny_model), model_name="tiny")
    return Admission(settings, ModelInfo.load(settings), tokenizer)


@pytest.fixture(scope="module")
def hf_tok(tiny_model: Path):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tiny_model))  # the real Qwen3 tokenizer files, copied by make-tiny


def hf_prompt(hf_tok, messages: list[dict], tools: list[dict] | None) -> list[int]:  # type: ignore[no-untyped-def]
    text = hf_tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return hf_tok(text, add_special_tokens=False)["input_ids"]


def test_openai_chat_with_tools_renders_as_transformers_does_for_vllm(admission, hf_tok):
    """OpenAI body -> frontend -> native request -> gateway admission: the prompt is transformers'
    rendering of the same chat with the call arguments parsed to objects (what vLLM hands the
    template) and the same tools."""
    gen = protocol.chat_request(body(), "rid", auto_tools=True)
    ids = admission.admit(gen, "gw").job.input_ids
    messages = json.loads(json.dumps(CONVERSATION))
    messages[2]["content"] = ""  # OpenAI's null content of a call-only message is empty text, as in vLLM
    for call in messages[2]["tool_calls"]:
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    assert ids == hf_prompt(hf_tok, messages, TOOLS)
    text = hf_tok.decode(ids)
    for part in ('<tools>\n{"type": "function", "function": {"name": "get_weather"', '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}',
                 "<tool_response>\n14:05\n</tool_response>", "<think>\nTwo tools needed.\n</think>"):
        assert part in text


def test_native_chat_with_tools_renders_as_transformers(admission, hf_tok):
    """The native API as transformers takes it: arguments as JSON text are rendered verbatim,
    as objects through tojson; tool messages, names and reasoning reach the template."""
    messages = [ChatMessage("user", "Time in Tokyo?"),
                ChatMessage("assistant", "", tool_calls=[ToolCall(id="c1", function=ToolCallFunction("get_time", '{"timezone":"Asia/Tokyo"}')),
                                                         ToolCall(function=ToolCallFunction("get_weather", {"city": "東京"}))]),
                ChatMessage("tool", "09:00", tool_call_id="c1", name="get_time"),
                ChatMessage("tool", "rain", name="get_weather")]
    tools = [Tool(function=ToolFunction("get_time", "Local time", {"type": "object", "properties": {"timezone": {"type": "string"}}})),
             Tool(function=ToolFunction("get_weather"))]
    ids = admission.admit(GenerateRequest(messages=messages, tools=tools, max_tokens=8), "gw").job.input_ids
    expected = hf_prompt(hf_tok, [
        {"role": "user", "content": "Time in Tokyo?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"timezone":"Asia/Tokyo"}'}},
                                                            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "東京"}}}]},
        {"role": "tool", "content": "09:00", "tool_call_id": "c1", "name": "get_time"},
        {"role": "tool", "content": "rain", "name": "get_weather"}],
        [{"type": "function", "function": {"name": "get_time", "description": "Local time", "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_weather"}}])
    assert ids == expected
    assert '{"timezone":"Asia/Tokyo"}' in hf_tok.decode(ids)
    plain = admission.admit(GenerateRequest(messages=[ChatMessage("user", "Time in Tokyo?")], max_tokens=8), "gw").job.input_ids
    assert plain == hf_prompt(hf_tok, [{"role": "user", "content": "Time in Tokyo?"}], None)  # old requests unchanged
    with pytest.raises(Rejected, match="tools: only with messages"):
        admission.admit(GenerateRequest(prompt="hi", tools=tools), "gw")


def test_old_native_requests_decode_unchanged():
    import msgspec

    req = msgspec.json.decode(b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}', type=GenerateRequest)
    assert req.messages == [ChatMessage("user", "hi")] and req.tools is None
    with pytest.raises(msgspec.ValidationError, match="tool_call"):
        msgspec.json.decode(b'{"messages": [{"role": "user", "content": "hi", "tool_call": 1}]}', type=GenerateRequest)


@pytest.mark.parametrize("fields, auto_tools, says", [
    ({}, False, "--enable-auto-tool-choice --tool-call-parser hermes"),
    ({"tool_choice": "auto"}, False, "--enable-auto-tool-choice"),
    ({"tool_choice": "required"}, True, 'tool_choice: "required" is not supported'),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, True, "named function ('get_time') is not supported"),
    ({"tool_choice": "sometimes"}, True, "tool_choice: \"none\" or \"auto\", got 'sometimes'"),
    ({"parallel_tool_calls": False}, True, "parallel_tool_calls: false is not supported"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]}, True, "strict function schemas (f)"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, True, "messages[0].tool_call_id: not allowed on a user message"),
    ({"messages": [{"role": "tool", "content": "x", "tool_calls": []}]}, True, "messages[0].tool_calls: not allowed on a tool message"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, True,
     "messages[0].tool_calls[0].function.arguments: not JSON"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]}, True,
     "must be a JSON object, got list"),
])
def test_refused_tool_requests_name_the_problem(fields, auto_tools, says):
    with pytest.raises(protocol.InvalidRequest) as e:
        protocol.chat_request(body(**fields), "rid", auto_tools=auto_tools)
    assert says in str(e.value)


def test_tool_choice_none_sends_the_tools_unparsed_and_auto_parses():
    none = body(tool_choice="none")
    gen = protocol.chat_request(none, "rid", auto_tools=False)  # allowed without tool parsing, as in vLLM
    assert [t.function.name for t in gen.tools] == ["get_weather", "get_time"] and not protocol.calls_tools(none)
    assert protocol.calls_tools(body()) and protocol.calls_tools(body(tool_choice="auto"))
    assert gen.messages[2].tool_calls[1].function.arguments == {"timezone": "Europe/Paris"}
    assert gen.messages[3] == ChatMessage("tool", '{"temperature": 21, "sky": "clear"}', tool_call_id="call_1")


def test_chat_template_kwargs_reach_the_template_as_transformers_takes_them(admission, hf_tok):
    """vLLM's ``chat_template_kwargs``: Qwen3's ``enable_thinking: false`` renders the empty think
    block transformers renders; variables moebus sets itself are refused."""
    chat = [{"role": "user", "content": "Answer briefly: 2 + 2?"}]
    req = protocol.decode(json.dumps({"messages": chat, "chat_template_kwargs": {"enable_thinking": False}}).encode(), protocol.ChatCompletionRequest)
    ids = admission.admit(protocol.chat_request(req, "rid"), "gw").job.input_ids
    want = hf_tok(hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, enable_thinking=False), add_special_tokens=False)["input_ids"]
    assert ids == want and ids != hf_prompt(hf_tok, chat, None)  # the switch changes the prompt
    for kwargs, says in [({"add_generation_prompt": False}, "add_generation_prompt are set by moebus"), ({"tools": []}, "tools are set by moebus")]:
        with pytest.raises(Rejected, match=says):
            admission.admit(GenerateRequest(messages=[ChatMessage("user", "hi")], chat_template_kwargs=kwargs), "gw")
    # a variable shadowing a function the template calls (Qwen3's uses namespace()) is a typed refusal, not a crash
    with pytest.raises(Rejected, match="chat template .* rejected the messages") as e:
        admission.admit(GenerateRequest(messages=[ChatMessage("user", "hi")], chat_template_kwargs={"namespace": "x"}), "gw")
    assert e.value.code == "invalid_request"
    with pytest.raises(Rejected, match="self are set by moebus"):
        admission.admit(GenerateRequest(messages=[ChatMessage("user", "hi")], chat_template_kwargs={"self": 1}), "gw")
    assert admission.admit(GenerateRequest(messages=[ChatMessage("user", "hi")], chat_template_kwargs={"messages_note": 2}), "gw").job.input_ids
    with pytest.raises(Rejected, match="chat_template_kwargs: only with messages"):
        admission.admit(GenerateRequest(prompt="hi", chat_template_kwargs={"enable_thinking": False}), "gw")


def test_an_answer_begun_by_the_caller_renders_as_transformers_continues_it(admission, hf_tok):
    """vLLM's continue_final_message (with add_generation_prompt false): the prompt ends inside the
    last (assistant) message, as transformers cuts it; add_generation_prompt false alone leaves the
    assistant header out; both true, or either with a text prompt, are refused."""
    chat = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite colour is "}]
    req = protocol.decode(json.dumps({"messages": chat, "continue_final_message": True, "add_generation_prompt": False}).encode(),
                          protocol.ChatCompletionRequest)
    ids = admission.admit(protocol.chat_request(req, "rid"), "gw").job.input_ids
    text = hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert ids == hf_tok(text, add_special_tokens=False)["input_ids"] and text.endswith("My favourite colour is ")
    plain = protocol.decode(json.dumps({"messages": chat[:1], "add_generation_prompt": False}).encode(), protocol.ChatCompletionRequest)
    text = hf_tok.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=False)
    assert admission.admit(protocol.chat_request(plain, "rid"), "gw").job.input_ids == hf_tok(text, add_special_tokens=False)["input_ids"]
    both = protocol.decode(json.dumps({"messages": chat, "continue_final_message": True}).encode(), protocol.ChatCompletionRequest)
    with pytest.raises(Rejected, match="Cannot set both `continue_final_message` and `add_generation_prompt` to True") as e:
        admission.admit(protocol.chat_request(both, "rid"), "gw")
    assert e.value.code == "invalid_request"
    with pytest.raises(Rejected, match="add_generation_prompt and continue_final_message: only with messages"):
        admission.admit(GenerateRequest(prompt="hi", continue_final_message=True, add_generation_prompt=False), "gw")
