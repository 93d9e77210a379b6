"""Variable interpolation in compose files, as docker compose does it (compose specification,
"Interpolation"), so that a file `docker compose up` runs on GPU nodes means the same under
`moebus up`:

* ``$VAR`` and ``${VAR}``: the variable's value, empty when unset;
* ``${VAR:-default}``: ``default`` when VAR is unset or empty; ``${VAR-default}``: only when unset;
* ``${VAR:?message}`` / ``${VAR?message}``: an error (``message``) when VAR is unset or empty / unset;
* ``${VAR:+other}`` / ``${VAR+other}``: ``other`` when VAR is set and not empty / set, else empty;
* ``$$``: a literal ``$``.

The default, message or other text may itself hold variables (``${A:-${B}}``), as in docker compose.
"""

from __future__ import annotations

import re

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_OPERATORS = (":-", "-", ":?", "?", ":+", "+")


class InterpolationError(ValueError):
    """A ``${VAR?message}`` whose variable is missing, or text that is no valid interpolation."""


def interpolate(text: str, env: dict[str, str]) -> str:
    """``text`` with every variable reference replaced from ``env``."""
    out, i = [], 0
    while i < len(text):
        dollar = text.find("$", i)
        if dollar < 0:
            out.append(text[i:])
            break
        out.append(text[i:dollar])
        value, i = _reference(text, dollar, env)
        out.append(value)
    return "".join(out)


def sole_variable(text: str) -> str | None:
    """The variable ``text`` is, when it is one ``$VAR`` / ``${VAR}`` / ``${VAR<operator>...}`` and nothing
    else (the knob a compose file offers for a value)."""
    text = text.strip()
    name = _NAME.match(text, 2 if text.startswith("${") else 1) if text.startswith("$") else None
    if name is None:
        return None
    try:
        _, end = _reference(text, 0, {name.group(): "set"})  # set: a ${VAR?...} names its knob too
    except InterpolationError:
        return None
    return name.group() if end == len(text) else None


def _reference(text: str, dollar: int, env: dict[str, str]) -> tuple[str, int]:
    """The value of the reference starting at ``text[dollar] == "$"`` and the index just past it."""
    nxt = text[dollar + 1: dollar + 2]
    if nxt == "$":
        return "$", dollar + 2
    if nxt != "{":
        name = _NAME.match(text, dollar + 1)
        if name is None:  # a lone "$" (e.g. "price: 5$"): docker compose keeps it too
            return "$", dollar + 1
        return env.get(name.group(), ""), name.end()
    name = _NAME.match(text, dollar + 2)
    if name is None:
        raise InterpolationError(f"invalid interpolation format in {text!r}: '${{' must be followed by a variable name")
    var, i = name.group(), name.end()
    if text[i: i + 1] == "}":
        return env.get(var, ""), i + 1
    operator = next((op for op in _OPERATORS if text.startswith(op, i)), None)
    if operator is None:
        what = "a '${' without its '}'" if i == len(text) else f"${{{var} must be followed by '}}' or one of {' '.join(_OPERATORS)}"
        raise InterpolationError(f"invalid interpolation format in {text!r}: {what}")
    argument, end = _argument(text, i + len(operator), env)
    value = env.get(var)
    present = value is not None and (value != "" or ":" not in operator)
    if operator.endswith("-"):
        return (value if present else argument), end  # type: ignore[return-value]
    if operator.endswith("+"):
        return (argument if present else ""), end
    if not present:
        unset = "unset" if value is None else "empty"
        raise InterpolationError(f"the compose file needs {var} ({unset}): {argument or 'required variable'}")
    return value, end  # type: ignore[return-value]


def _argument(text: str, start: int, env: dict[str, str]) -> tuple[str, int]:
    """The interpolated text of an operator's argument, up to its closing brace, and the index past it."""
    out, i = [], start
    while i < len(text):
        char = text[i]
        if char == "}":
            return "".join(out), i + 1
        if char == "$":
            value, i = _reference(text, i, env)
            out.append(value)
            continue
        out.append(char)
        i += 1
    raise InterpolationError(f"invalid interpolation format in {text!r}: a '${{' without its '}}'")
