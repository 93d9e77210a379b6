"""Reasoning and tool calls out of a Qwen3 chat answer, the same whether it arrives whole or in pieces.

vLLM serves Qwen3 with ``--reasoning-parser qwen3`` and ``--tool-call-parser hermes``; this
is moebus' equivalent for the OpenAI frontend. The gateway detokenizes with
``skip_special_tokens``, and Qwen3's ``<think>``, ``</think>``, ``<tool_call>`` and
``</tool_call>`` are added tokens that are *not* special, so the tags arrive in the text.

* Reasoning (``qwen3``): the answer starts in reasoning. A leading ``<think>`` is dropped
  (Qwen3 writes it; Qwen3-Thinking-2507's template puts it in the prompt instead), text up to
  the first ``</think>`` is ``reasoning_content``, the rest is the answer. An answer without
  ``</think>`` (cut off while thinking) is all reasoning, as vLLM streams it.
* Tool calls (``hermes``): each ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  block of the answer becomes a call, its arguments re-serialised as JSON text (OpenAI sends
  them as a string). A block that is not such JSON stays in the content verbatim, tags and
  all; so does an unclosed block at the end unless its text is a complete call (the model
  stopped before ``</tool_call>``).
* While a parser is on, the reasoning and the content each lose their leading and trailing
  whitespace (Qwen3 puts newlines around its tags); without one the text passes untouched.

`ChatOutputParser` is one state machine for both paths: a stream feeds each chunk's text
and holds back only what may still become a tag (a suffix that is a prefix of one), the
whitespace it may drop, and an open ``<tool_call>`` block until it closes; a unary answer is
the same parser fed everything at once (`parse_answer`). Streamed deltas therefore add up to
the unary message wherever the text is split.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, get_args

from shared.settings import ReasoningParser, ToolCallParser

THINK_START, THINK_END = "<think>", "</think>"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"

REASONING_PARSERS: tuple[str, ...] = get_args(ReasoningParser)
TOOL_CALL_PARSERS: tuple[str, ...] = get_args(ToolCallParser)


def reasoning_on(chat_template_kwargs: dict[str, Any] | None) -> bool:
    """Whether a ``qwen3`` answer may open with reasoning: not when ``chat_template_kwargs``
    turns Qwen3's thinking off (the template then puts the empty think block in the prompt, so
    the answer is all content; the parser would otherwise take it all as reasoning)."""
    return (chat_template_kwargs or {}).get("enable_thinking", True) is not False


@dataclass(frozen=True)
class ToolCall:
    id: str  # "call_" and 24 hex digits, new for every parsed call
    name: str
    arguments: str  # a JSON object's text

    def openai(self) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Delta:
    """What a piece of generated text adds to a choice's message."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def extend(self, other: Delta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls


class _Trimmed:
    """One message field (reasoning or content) piece by piece, without its leading and trailing
    whitespace: a run of whitespace is held back until text follows it, and dropped at the end."""

    def __init__(self) -> None:
        self.started = False  # text was emitted
        self.held = ""  # whitespace after the last emitted text

    def add(self, text: str) -> str:
        body = text.rstrip()
        if not body:  # whitespace only: it may yet be trailing
            if self.started:
                self.held += text
            return ""
        tail = text[len(body) :]
        out = self.held + body if self.started else body.lstrip()
        self.started, self.held = True, tail
        return out


def _tag_prefix_len(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``tag`` (it may become the tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def tool_call(block: str) -> ToolCall | None:
    """The call a ``<tool_call>`` block's text holds: a JSON object with a string ``name`` and an
    object ``arguments`` (Qwen3's hermes format); None for anything else. The text is the model's,
    so anything may be in it: JSON nested past Python's recursion limit, or a number past a
    float's range (``1e999`` reads as inf, which no JSON can write back) is no call either."""
    try:
        call = json.loads(block, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments"), dict)):
        return None
    try:
        arguments = json.dumps(call["arguments"], ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", call["name"], arguments)


class ChatOutputParser:
    """One choice's answer, fed in pieces (`feed`, then `finish`): each piece's `Delta`."""

    def __init__(self, reasoning: bool, tools: bool) -> None:
        self._tools = tools
        self._state = "reasoning" if reasoning else "content"  # then "content", and "call" inside a block
        self._leading_think = reasoning  # a <think> may still open the answer
        self._pending = ""  # text not yet given out
        self._reasoning = _Trimmed()
        self._content = _Trimmed()
        self.tool_calls = 0  # calls given out so far

    def feed(self, text: str) -> Delta:
        self._pending += text
        return self._advance(final=False)

    def finish(self) -> Delta:
        """What the end of the answer releases (held text; an unclosed block)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> Delta:
        """Give out what the pending text settles, state after state, until it must wait."""
        delta = Delta()
        step = {"reasoning": self._in_reasoning, "content": self._in_content, "call": self._in_call}
        while step[self._state](delta, final):
            pass
        return delta

    # Each state's step adds to ``delta`` and answers whether the state changed (step again).

    def _in_reasoning(self, delta: Delta, final: bool) -> bool:
        if self._leading_think:
            start = self._pending.lstrip()
            if start.startswith(THINK_START):
                self._pending, self._leading_think = start[len(THINK_START) :], False
            elif THINK_START.startswith(start) and not final:
                return False  # only whitespace or a piece of <think> so far
            else:
                self._leading_think = False
        text, found = self._take_until(THINK_END, final)
        delta.reasoning += self._reasoning.add(text)
        if found:
            self._state = "content"
        return found

    def _in_content(self, delta: Delta, final: bool) -> bool:
        if not self._tools:
            delta.content += self._content.add(self._release(None, final))
            return False
        text, found = self._take_until(CALL_START, final)
        delta.content += self._content.add(text)
        if found:
            self._state = "call"
        return found

    def _in_call(self, delta: Delta, final: bool) -> bool:
        end = self._pending.find(CALL_END)
        if end < 0 and not final:
            return False  # the block is still open
        closed = end >= 0
        block = self._pending[:end] if closed else self._pending
        self._pending, self._state = self._pending[end + len(CALL_END) :] if closed else "", "content"
        call = tool_call(block)
        if call is not None:
            delta.tool_calls.append(call)
            self.tool_calls += 1
        else:
            delta.content += self._content.add(CALL_START + block + (CALL_END if closed else ""))
        return True

    def _take_until(self, tag: str, final: bool) -> tuple[str, bool]:
        """The pending text before ``tag`` and True, the tag consumed; while it has not come,
        what can be released now (`_release`) and False."""
        at = self._pending.find(tag)
        if at < 0:
            return self._release(tag, final), False
        text, self._pending = self._pending[:at], self._pending[at + len(tag) :]
        return text, True

    def _release(self, tag: str | None, final: bool) -> str:
        """The pending text except an end that may still become ``tag`` (all of it at the end, or without a tag to watch for)."""
        keep = 0 if final or tag is None else _tag_prefix_len(self._pending, tag)
        out, self._pending = self._pending[: len(self._pending) - keep], self._pending[len(self._pending) - keep :]
        return out


def parse_answer(text: str, reasoning: bool, tools: bool) -> Delta:
    """A whole answer's reasoning, content and tool calls."""
    parser = ChatOutputParser(reasoning, tools)
    delta = parser.feed(text)
    delta.extend(parser.finish())
    return delta
