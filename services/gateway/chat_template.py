"""The gateway's `chat_template` setting, vLLM's ``--chat-template``: the text of the template that
replaces the checkpoint's own, from a file path or given inline.

Told apart as vLLM's ``load_chat_template`` tells them: a value that opens as a file is a path; one
that does not but holds a character no path needs (``{``, ``}``, a newline) is the template itself;
any other is a path that failed to open, an error (a mistyped path must not become a template that
renders its own name as every prompt). Unlike vLLM's older versions, an inline template is taken as
written (no ``\\n`` unescaping, as vLLM does now): a Jinja string literal's escapes still apply.
"""

from __future__ import annotations

from pathlib import Path

from shared.model.tokenizer import ChatTemplateError, Tokenizer
from shared.settings import GatewaySettings, SettingsError

# Characters no file path needs and every template has: a value holding one is a template.
_TEMPLATE_CHARS = ("{", "}", "\n")


def chat_template_text(value: str) -> str | None:
    """The template `GatewaySettings.chat_template` names: None for "" (the checkpoint's own),
    else the file's text or the inline template; `SettingsError` for a path that cannot be read."""
    if not value:
        return None
    try:
        return Path(value).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:  # a file, but not a template's text
        raise SettingsError(f"gateway settings: chat_template={value!r}: the file is not UTF-8 text: {exc}") from exc
    except (OSError, ValueError) as exc:  # ValueError: a NUL character, which no path holds (a TOML value may)
        if any(c in value for c in _TEMPLATE_CHARS):
            return value
        why = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise SettingsError(f"gateway settings: chat_template={value!r} is neither a readable file ({why}) "
                            "nor a template (an inline one holds '{', '}' or a newline)") from exc


def gateway_tokenizer(settings: GatewaySettings) -> Tokenizer:
    """The checkpoint's tokenizer, with the `chat_template` setting's template in place of its own,
    compiled once here: `SettingsError` for one that cannot be read or does not compile (naming
    its line), so that the gateway stops at start rather than failing every chat."""
    template = chat_template_text(settings.chat_template)
    try:
        return Tokenizer.from_dir(settings.model, chat_template=template)
    except ChatTemplateError as exc:  # only a given template is compiled at load
        raise SettingsError(f"gateway settings: chat_template={settings.chat_template!r}: {exc}") from exc
