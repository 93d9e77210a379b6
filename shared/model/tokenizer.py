"""Tokenizer of a Hugging Face checkpoint: `tokenizer.json` through the `tokenizers`
library, the chat template from `tokenizer_config.json` (or `chat_template.jinja`, or one
given in their place, vLLM's ``--chat-template``) rendered with Jinja the way `transformers`
renders it, and incremental detokenization for streaming.

Rendering follows `transformers.utils.chat_template_utils` (v5): an
``ImmutableSandboxedEnvironment`` with ``trim_blocks``/``lstrip_blocks`` and the
``loopcontrols`` extension; ``raise_exception``, ``strftime_now``, a ``tojson`` that
does not HTML-escape, a restricted ``dict`` and ``namespace``; the named special
tokens (``bos_token``, ``eos_token``, ...) passed as template variables; messages
with their ``None`` fields dropped and reasoning aliased under ``reasoning_content``
and ``thinking``. The tests compare the output with ``transformers`` itself.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HfTokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# How deep a request's data (chat_template_kwargs, tools, tool call arguments) may nest on its way into
# the template: JSON Schemas of real tools nest a few levels; a thousand exhaust Python's recursion limit.
MAX_TEMPLATE_DEPTH = 64
# Arguments apply_chat_template passes to the template itself (and jinja's render takes "self"):
# extra template variables may not use them.
RESERVED_TEMPLATE_VARIABLES = frozenset({"self", "messages", "tools", "documents", "add_generation_prompt"})

# The named special tokens transformers hands to a chat template (SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Names a message's reasoning may arrive under; templates read the first.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# transformers' marker for continue_final_message: put after the final message's text, it shows
# where that text ends once rendered (a template may add to a message or trim its spacing).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class TokenizerError(Exception):
    """Base class of tokenizer errors."""


class TokenizerFilesError(TokenizerError):
    """A tokenizer file is missing, unreadable or malformed; the message names it."""


class InvalidPromptError(TokenizerError, ValueError):
    """The caller's prompt or messages cannot be tokenized (maps to `invalid_request`)."""


class EmptyPromptError(InvalidPromptError):
    """An empty prompt text or an empty list of messages."""


class ChatTemplateError(InvalidPromptError):
    """The chat template is absent, fails to compile, or rejects the messages."""


@dataclass(frozen=True)
class SpecialToken:
    text: str
    id: int


def _continued(rendered: str, final: str) -> str:
    """``rendered`` cut where the final message's text ends (at transformers' marker; before any
    spacing the template trimmed from it), so that the model continues that text."""
    if final.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
        raise ChatTemplateError("continue_final_message: the chat template does not render the final message's text as given, "
                                "so it cannot be continued")
    at = rendered.rindex(_CONTINUE_TAG.strip())
    return rendered[:at] if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else rendered[:at].rstrip()


class Tokenizer:
    """Encode/decode and chat templating for one checkpoint directory."""

    def __init__(
        self,
        backend: HfTokenizer,
        chat_template: str | dict[str, str] | None,
        special_tokens: dict[str, SpecialToken],
        source: str = "<memory>",
        template_source: str | None = None,
    ) -> None:
        self._backend = backend
        self._chat_template = chat_template
        # what chat template errors name: the checkpoint's template, unless one replaced it
        self.template_source = template_source or f"the chat template of {source}"
        self._compiled: dict[str, jinja2.Template] = {}
        self.special_tokens = special_tokens
        self.source = source
        self._pieces: dict[int, tuple[str, bytes]] = {}  # token_piece's answers, at most one per vocabulary entry
        self._added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
        self._byte_level = type(backend.decoder).__name__ == "ByteLevel"

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_dir(cls, directory: str | Path, chat_template: str | None = None) -> Tokenizer:
        """The tokenizer of checkpoint ``directory``. ``chat_template``: a template that replaces the
        checkpoint's own (vLLM's ``--chat-template``), for every chat rendered; it is compiled here, so
        that a broken one fails the load (`ChatTemplateError` naming its line), not the first request."""
        root = Path(directory)
        if not root.is_dir():
            raise TokenizerFilesError(f"tokenizer directory {root} does not exist")
        tok_path = root / TOKENIZER_FILE
        if not tok_path.is_file():
            raise TokenizerFilesError(f"{tok_path} is missing (moebus reads the fast-tokenizer file)")
        try:
            backend = HfTokenizer.from_file(str(tok_path))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
            raise TokenizerFilesError(f"{tok_path} is not a valid tokenizer file: {exc}") from exc

        config = _read_json(root / TOKENIZER_CONFIG_FILE) if (root / TOKENIZER_CONFIG_FILE).is_file() else {}
        template_path = root / CHAT_TEMPLATE_FILE
        template: str | dict[str, str] | None
        if chat_template is not None:
            template = chat_template
        elif template_path.is_file():  # transformers gives a standalone chat_template.jinja priority over the config entry
            template = template_path.read_text(encoding="utf-8")
        else:
            template = _template_from_config(config.get("chat_template"), root / TOKENIZER_CONFIG_FILE)

        special: dict[str, SpecialToken] = {}
        for name in SPECIAL_TOKEN_NAMES:
            text = _token_content(config.get(name))
            if text is None:
                continue
            token_id = backend.token_to_id(text)
            if token_id is None:
                raise TokenizerFilesError(
                    f"{root / TOKENIZER_CONFIG_FILE}: {name} {text!r} is not in the vocabulary of {tok_path}"
                )
            special[name] = SpecialToken(text, token_id)
        given = chat_template is not None
        tokenizer = cls(backend, template, special, source=str(root), template_source=f"the chat template given in place of {root}'s" if given else None)
        if given:
            tokenizer._template(None)  # compiled (and kept) now: a broken one fails here, not at the first chat
        return tokenizer

    # ------------------------------------------------------------------ vocabulary

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return token.id if token else None

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt; an empty prompt is an `EmptyPromptError`.

        ``add_special_tokens`` applies the tokenizer's post-processor (BOS etc.), as
        ``tokenizer(text)`` does in transformers; text rendered by a chat template
        already carries its special tokens, so encode it with ``False``.
        """
        if not isinstance(text, str):
            raise InvalidPromptError(f"prompt must be a string, got {type(text).__name__}")
        if not text:
            raise EmptyPromptError("prompt is empty")
        # encode_batch, not encode: it lets go of the GIL while it tokenizes (tokenizers' binding holds
        # it through `encode`), so the gateway's event loop keeps relaying every other request's tokens
        # and its heartbeats while a worker thread tokenizes a long prompt (an 8 MB one took 4-5 s on
        # the 2-core CPU host, all of it with the loop stopped: streams stalled, and the frontend failed
        # requests as `unavailable` for want of the gateway's keepalives).
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Each id's vocabulary entry as stored (byte-level: ``Ġ`` for a space), as transformers'
        ``convert_ids_to_tokens`` gives it, for ids the tokenizer knows (below `vocab_size`)."""
        return [self._backend.id_to_token(i) for i in ids]

    def token_piece(self, token_id: int) -> tuple[str, bytes]:
        """One token on its own: (its text decoded alone, its raw bytes), as OpenAI's logprobs
        report tokens. A byte-level token holding part of a UTF-8 character decodes to U+FFFD
        (as vLLM reports it) while its bytes are the real ones, so the bytes of consecutive
        tokens concatenate to the text. Special tokens read as their text; an id the tokenizer
        does not know (the model's padded vocabulary) is ("", b"").
        """
        piece = self._pieces.get(token_id)
        if piece is None:
            text = self._backend.decode([token_id], skip_special_tokens=False)
            raw = self._backend.id_to_token(token_id)
            if raw is not None and token_id not in self._added and self._byte_level:
                raw_bytes = bytes(_BYTE_OF_CHAR[c] for c in raw)
            else:  # added tokens are stored as text; other decoders: the text's bytes
                raw_bytes = text.encode("utf-8")
            piece = self._pieces[token_id] = (text, raw_bytes)
        return piece

    def detokenizer(self, skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat template

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        /,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` to the prompt text the model expects.

        ``enable_thinking=None`` leaves the variable undefined, so the template's
        default applies; extra keyword arguments become template variables, as in
        transformers. ``continue_final_message`` (needs ``add_generation_prompt=False``):
        the text ends where the last message's content does, for the model to go on with
        it (e.g. an assistant answer begun by the caller), as transformers cuts it.
        """
        if not messages:
            raise EmptyPromptError("messages is empty")
        if continue_final_message and add_generation_prompt:  # vLLM's words for what transformers refuses too
            raise ChatTemplateError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        clash = sorted(RESERVED_TEMPLATE_VARIABLES.intersection(template_kwargs))
        if clash:
            raise ChatTemplateError(f"template variables {', '.join(clash)} are set by apply_chat_template itself")
        template = self._template(tools)
        chat = []
        for index, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise ChatTemplateError(f"messages[{index}] must be an object, got {type(message).__name__}")
            plain = {key: _plain(value, f"messages[{index}].{key}") for key, value in message.items()}
            chat.append(_alias_reasoning({key: value for key, value in plain.items() if value is not None}))
        variables = {name: token.text for name, token in self.special_tokens.items()}
        variables.update({key: _plain(value, key) for key, value in template_kwargs.items()})
        if enable_thinking is not None:
            variables["enable_thinking"] = enable_thinking
        final = chat[-1].get("content")
        if continue_final_message:
            if not isinstance(final, str):
                raise ChatTemplateError("continue_final_message: the final message has no text content to continue")
            chat[-1]["content"] = final + _CONTINUE_TAG
        try:
            rendered = template.render(
                messages=chat,
                tools=_plain(list(tools), "tools") if tools is not None else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except (jinja2.TemplateError, TypeError) as exc:  # TypeError: e.g. a variable shadowing a template function
            raise ChatTemplateError(f"{self.template_source} rejected the messages: {exc}") from exc
        return _continued(rendered, final) if continue_final_message else rendered

    def _template(self, tools: Sequence[Mapping[str, Any]] | None) -> jinja2.Template:
        source = self._chat_template
        if isinstance(source, dict):
            # transformers' choice among named templates
            name = "tool_use" if tools is not None and "tool_use" in source else "default"
            if name not in source:
                raise ChatTemplateError(
                    f"{self.source} has several chat templates ({sorted(source)}) and none named 'default'"
                )
            source = source[name]
        if source is None:
            raise ChatTemplateError(f"{self.source} has no chat template")
        if source not in self._compiled:
            try:
                self._compiled[source] = _jinja_env().from_string(source)
            except jinja2.TemplateSyntaxError as exc:
                raise ChatTemplateError(f"{self.template_source} does not compile: line {exc.lineno}: {exc.message}") from exc
        return self._compiled[source]


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces that never split a character.

    Byte-level tokens can end inside a UTF-8 sequence (an emoji spans up to four
    tokens). Decoding the ids since the last emitted boundary and holding back
    the trailing ids while the result ends in U+FFFD keeps every emitted piece
    whole; once a piece ends on a character boundary it is final, so the
    concatenation of ``add`` results followed by ``flush`` equals
    ``decode(all ids)``. The window starts at
    the previous boundary (``prefix_offset``) rather than at the new ids, so
    decoders that treat the first token specially (leading-space stripping) see
    the same context as a full decode.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = 0  # ids before this are emitted
        self._emitted: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._emitted)

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Append ids; returns the text they complete (possibly empty)."""
        if isinstance(token_ids, int):
            self.token_ids.append(token_ids)
        else:
            self.token_ids.extend(token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Emit whatever is held back (U+FFFD included): the stream has ended."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        decode, ids = self._tokenizer.decode, self.token_ids
        end = len(ids)
        window = decode(ids[self._prefix_offset : end], self._skip_special)
        # Back off over ids that end inside a UTF-8 sequence until the text is
        # whole (several ids can arrive at once, e.g. from speculative decoding).
        while not final and end > self._read_offset and window.endswith("\ufffd"):
            end -= 1
            window = decode(ids[self._prefix_offset : end], self._skip_special)
        if end == self._read_offset:
            return ""
        prefix = decode(ids[self._prefix_offset : self._read_offset], self._skip_special)
        piece = window[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, end
        self._emitted.append(piece)
        return piece


# ---------------------------------------------------------------------- helpers


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed (the byte each vocabulary character stands for):
    printable Latin-1 bytes stand for themselves, the others for 256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    char_of = {b: b for b in printable}
    for b in range(256):
        if b not in char_of:
            char_of[b] = 256 + len(char_of) - len(printable)
    return {chr(c): b for b, c in char_of.items()}


_BYTE_OF_CHAR = _byte_level_alphabet()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerFilesError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerFilesError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _template_from_config(entry: Any, path: Path) -> str | dict[str, str] | None:
    """``chat_template`` of tokenizer_config.json: a string, or a list of named templates."""
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, list) and all(isinstance(t, dict) and {"name", "template"} <= t.keys() for t in entry):
        return {t["name"]: t["template"] for t in entry}
    raise TokenizerFilesError(f"{path}: chat_template must be a string or a list of {{name, template}} objects")


def _token_content(entry: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken object."""
    if isinstance(entry, dict):
        return entry.get("content")
    return entry if isinstance(entry, str) else None


def _plain(value: Any, where: str, depth: int = 0, top: str | None = None) -> Any:
    """JSON-like data only: the template sees nothing with methods it could abuse. Nested at most
    ``MAX_TEMPLATE_DEPTH`` levels below ``top`` (the value the caller named, ``where`` at depth 0):
    deeper data (a request's ``chat_template_kwargs`` or tool schema) would exhaust the interpreter's
    recursion limit, here or in the template's ``tojson``."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    top = where if top is None else top
    if isinstance(value, (Mapping, list, tuple)) and depth >= MAX_TEMPLATE_DEPTH:
        raise ChatTemplateError(f"{top}: nested deeper than {MAX_TEMPLATE_DEPTH} levels")
    if isinstance(value, Mapping):
        return {str(key): _plain(item, f"{where}.{key}", depth + 1, top) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item, f"{where}[{i}]", depth + 1, top) for i, item in enumerate(value)]
    # subclasses (enums, numpy scalars...) carry extra methods: back to the base type
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    raise ChatTemplateError(f"{where}: {type(value).__name__} is not JSON data")


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes (<, >, &, '), which would change the prompt
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` for templates without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore attributes (a path to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training
    masks in transformers; for inference it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _jinja_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env
