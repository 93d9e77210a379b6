"""README's "Coming from vLLM" names only what the code has, so the guide cannot go stale silently.

Every code span of the section (inline, and each command of its fenced block) is read as a shell line:
- ``NAME=value`` with ``NAME`` a ``MOEBUS_*`` variable: the span's variables must pass what `moebus up` checks
  before it starts (not shadowed by compose/single-node.yml, every service's settings load with them);
  any other upper-case ``NAME``: a variable the compose files interpolate (a knob such as ``DECODE_DP``);
- a bare ``MOEBUS_*`` name: a variable some service reads (`shared.settings`' rule, unknown ones refused);
- ``moebus CMD --flag [value]``: ``CMD`` one of `services.cli.COMMANDS`, each flag one of its module's
  ``arguments()`` parser, a value one of the flag's choices when it has some;
- ``service.field``: a field of that service's settings struct (`shared.settings.SERVICES`);
- ``moebus_*`` identifiers: series of `services.metrics` (a histogram's ``_bucket`` ... included).
The endpoints table's rows say where each path is served: "served by `moebus openai`" rows name only
`services.openai.server.ROUTES` (method and path), and every route is named; "served by `moebus metrics`"
the metrics path; "not served" rows no route. Links into README (``#anchor``) must name a heading.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
from pathlib import Path

import pytest

from services import metrics
from services.cli import COMMANDS
from services.compose import DEFAULT_STACK, FRONTENDS, REPO_ROOT, StackError, check_shadowed_settings, load_compose
from services.launch import LocalStack
from services.openai.server import ROUTES
from shared.settings import SERVICES, SettingsError, load_settings
from shared.settings import _check_variables as check_variables  # the rule every service applies to MOEBUS_* names

README = REPO_ROOT / "README.md"
HEADING = "## Coming from vLLM"
ASSIGNMENT = re.compile(r"([A-Z][A-Z0-9_]*)=(.*)", re.S)
SETTING = re.compile(r"(gateway|scheduler|prefill|decode|openai|metrics)\.([a-z0-9_]+)")
SERIES = re.compile(r"\bmoebus_[a-z0-9_]+")
ENDPOINT = re.compile(r"(?:(GET|POST|HEAD|PUT|DELETE) )?(/\S*)")
# Variables the compose files interpolate: the knobs a `moebus up` / `docker compose` user sets.
KNOBS = {m for path in REPO_ROOT.glob("compose/*.yml") for m in re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", path.read_text())}


def section(readme: str) -> str:
    start = readme.index(HEADING)
    end = readme.find("\n## ", start + len(HEADING))
    return readme[start : end if end >= 0 else len(readme)]


def code_spans(text: str) -> list[str]:
    """The commands of the fenced blocks (continued lines joined, comments dropped), then the inline spans."""
    spans, prose = [], []
    for i, part in enumerate(text.split("```")):
        if i % 2:  # a fenced block: its first line names the language
            body = part.split("\n", 1)[1] if "\n" in part else ""
            spans += [line for line in body.replace("\\\n", " ").splitlines() if line.strip() and not line.lstrip().startswith("#")]
        else:
            prose.append(part)
    return spans + re.findall(r"`([^`\n]+)`", "\n".join(prose))


def rows(text: str) -> list[list[str]]:
    """Every table row of ``text`` (header rows included, separators not), as its cells."""
    found = []
    for line in text.splitlines():
        if line.startswith("|") and not re.fullmatch(r"\|[-| ]+\|", line):
            found.append([cell.strip() for cell in line.strip("|").split("|")])
    return found


def _parser_options(command: str) -> dict[str, tuple[str, ...] | None] | None:
    """Each option string of ``moebus command`` -> its choices (None: any value); None when its module has no
    ``arguments()`` parser to read them from."""
    arguments = getattr(importlib.import_module(COMMANDS[command][0]), "arguments", None)
    if arguments is None:
        return None
    return {opt: (tuple(a.choices) if a.choices else None) for a in arguments()._actions for opt in a.option_strings}


def _command_problems(span: str, tokens: list[str]) -> list[str]:
    problems = []
    for at, token in enumerate(tokens):
        if token != "moebus" or at + 1 >= len(tokens):
            continue
        command = tokens[at + 1]
        if command not in COMMANDS:
            problems.append(f"{span!r}: no command `moebus {command}`")
            continue
        rest = tokens[at + 2 :]
        rest = rest[: rest.index("moebus")] if "moebus" in rest else rest
        if not any(t.startswith("--") for t in rest):
            continue
        options = _parser_options(command)
        if options is None:
            problems.append(f"{span!r}: {COMMANDS[command][0]} has no arguments() parser to check flags against")
            continue
        for i, flag in enumerate(rest):
            if not flag.startswith("--"):
                continue
            if flag not in options:
                problems.append(f"{span!r}: `moebus {command}` has no flag {flag}")
            elif options[flag] and i + 1 < len(rest) and rest[i + 1] not in options[flag]:
                problems.append(f"{span!r}: {flag} takes one of {', '.join(options[flag])}, not {rest[i + 1]!r}")
    return problems


def _variables_problems(span: str, variables: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """What `moebus up` (services.launch.main, in that order) says of ``variables`` (settings and compose knobs)
    in its environment before it starts anything."""
    with monkeypatch.context() as m:
        for name in [n for n in os.environ if n.startswith("MOEBUS_")]:
            m.delenv(name)
        for name, value in variables.items():
            m.setenv(name, value)
        environ = dict(os.environ)
        try:
            specs = load_compose(DEFAULT_STACK, {"MOEBUS_HTTP_HOST": "127.0.0.1", **environ})
            check_shadowed_settings(specs, environ, DEFAULT_STACK)
            stack = LocalStack(specs, Path("/models/Qwen3-30B-A3B"), tmp_path)
            stack.check_settings()
            for spec in (s for s in specs if s.role in FRONTENDS):
                load_settings(SERVICES[spec.role], spec.role, env=stack.replica_env(spec, f"{spec.name}-0"))
        except (StackError, SettingsError) as e:
            return [f"{span!r}: {e}"]
    return []


def problems(text: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """Every name of the guide ``text`` that the code lacks, each with the span that names it."""
    found: list[str] = []
    for span in code_spans(text):
        for name in SERIES.findall(span):
            if name not in metrics.FAMILY_OF and name not in metrics.FAMILY_OF.values():  # a series, or a histogram's family
                found.append(f"{span!r}: no metric series {name}")
        if whole := SETTING.fullmatch(span):
            service, field = whole.groups()
            if field not in SERVICES[service].__struct_fields__:
                found.append(f"{span!r}: {SERVICES[service].__name__} has no field {field!r}")
        try:
            tokens = shlex.split(span, comments=True)
        except ValueError as e:
            found.append(f"{span!r}: not a shell line ({e})")
            continue
        variables = {}
        for token in tokens:
            if assigned := ASSIGNMENT.fullmatch(token):
                name, value = assigned.groups()
                variables[name] = value
                if not name.startswith("MOEBUS_") and name not in KNOBS:
                    found.append(f"{span!r}: {name} is no variable of the compose files")
            elif re.fullmatch(r"MOEBUS_[A-Z0-9_]+", token):
                try:
                    check_variables({token: ""})
                except SettingsError as e:
                    found.append(f"{span!r}: {e}")
        found += _command_problems(span, tokens)
        if any(name.startswith("MOEBUS_") for name in variables):
            found += _variables_problems(span, variables, monkeypatch, tmp_path)
    return found + _endpoint_problems(text) + _anchor_problems(text)


def _endpoint_problems(text: str) -> list[str]:
    found, named = [], set()
    for cells in rows(text):
        endpoints = [ENDPOINT.fullmatch(span) for span in re.findall(r"`([^`]+)`", cells[0])]
        if not endpoints or not all(endpoints) or len(cells) < 2:
            continue
        where = cells[1]
        for e in endpoints:
            method, path = e.groups()
            if where.startswith("served by `moebus openai`"):
                if path not in ROUTES or (method and method not in ROUTES[path]):
                    found.append(f"{cells[0]!r}: {method or ''} {path} is no route of moebus openai (ROUTES)")
                named.add((method, path))
            elif where.startswith("served by `moebus metrics`"):
                if path != metrics.PATH:
                    found.append(f"{cells[0]!r}: moebus metrics serves {metrics.PATH}, not {path}")
            elif where.startswith("not served"):
                if path in ROUTES or path == metrics.PATH:
                    found.append(f"{cells[0]!r}: {path} is served (ROUTES / metrics.PATH), the guide says not")
            else:
                found.append(f"{cells[0]!r}: say 'served by `moebus openai`', 'served by `moebus metrics`' or 'not served'")
    missing = [f"{m} {p}" for p, methods in ROUTES.items() for m in methods if (m, p) not in named]
    if missing:
        found.append(f"routes of moebus openai the guide does not list as served: {', '.join(missing)}")
    return found


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' dropped, spaces as '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchor_problems(text: str) -> list[str]:
    anchors = {_anchor(line.lstrip("#")) for line in README.read_text().splitlines() if line.startswith("#")}
    return [f"link #{a}: no README heading has that anchor" for a in re.findall(r"\]\(#([^)]+)\)", text) if a not in anchors]


def test_guide_names_only_what_the_code_has(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    guide = section(README.read_text())
    assert len(rows(guide)) > 60 and len(code_spans(guide)) > 100  # the section was found and read
    assert problems(guide, monkeypatch, tmp_path) == []


@pytest.mark.parametrize(("real", "wrong", "named"), [
    ("MOEBUS_GATEWAY_MAX_CONTEXT=32768", "MOEBUS_GATEWAY_MAX_CONTEXTS=32768", "max_contexts"),  # no such setting
    ("MOEBUS_OPENAI_TOOL_CALL_PARSER=hermes", "MOEBUS_OPENAI_TOOL_CALL_PARSER=mistral", "tool_call_parser"),  # a value refused
    ("DECODE_MAX_BATCH=64", "MOEBUS_DECODE_MAX_BATCH=64", "DECODE_MAX_BATCH=64 instead"),  # the compose file's value wins
    ("DECODE_MAX_BATCH=64", "DECODE_BATCH=64", "DECODE_BATCH is no variable"),
    ("moebus openai --api-key", "moebus openai --key", "has no flag --key"),
    ("--format fp8-block", "--format fp8", "takes one of"),
    ("moebus_gateway_e2e_request_latency_seconds", "moebus_gateway_e2e_latency_seconds", "no metric series"),
    ("`gateway.max_tokens_limit`", "`gateway.max_token_limit`", "no field 'max_token_limit'"),
    ("`/v1/embeddings`", "`/v1/models`", "is served"),
    ("`POST /tokenize`, ", "", "POST /tokenize"),  # a route left out of the served rows
    ("(#prefix-caching)", "(#prefix-cache)", "#prefix-cache"),
])
def test_a_wrong_name_is_named(real: str, wrong: str, named: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The check is not vacuous: the guide with one name made wrong fails, naming it."""
    guide = section(README.read_text())
    assert real in guide
    found = problems(guide.replace(real, wrong, 1), monkeypatch, tmp_path)
    assert found and any(named in p for p in found), found
