"""The compose file of a stack, as `moebus up` (`services.launch`) and the tests and benchmarks that
start stacks read it.

The compose file is the single description of a stack (DESIGN §7): the same file `docker compose up`
runs on GPU nodes is read here into one `ServiceSpec` per moebus service, from its `command`
(`moebus <role> ...`), `environment`, `deploy.replicas` (or a `--scale NAME=N` override) and `restart`
policy. Container-only parts (image, volumes, device reservations, networks, ports) are ignored, and
so is the service named `nats` (`moebus up` runs a local nats-server in its place). Variables
(`${VAR}`, `${VAR:-default}`, `${VAR:?message}`, ...) are interpolated from the environment as docker
compose does (`services.compose_interpolation`). A file
that is no compose file of moebus services, or a value it cannot use, is a `StackError` naming the
file, the service and the part; so is a `MOEBUS_*` setting of the caller's environment that the
file would override (`check_shadowed_settings`), and a role the file runs left without a replica
(`check_every_role_runs`).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from services.compose_interpolation import InterpolationError, interpolate, sole_variable

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_STACK = REPO_ROOT / "compose" / "single-node.yml"
ROLES = ("gateway", "scheduler", "prefill", "decode")  # services that heartbeat
FRONTENDS = ("openai", "metrics")  # HTTP faces of the stack: NATS clients, no heartbeat
# The frontends' address settings, which the compose files pass on to them, for a stack started by a
# test, a benchmark or `moebus up --port 0`: this host, any free port.
EPHEMERAL_FRONTENDS = {"MOEBUS_HTTP_HOST": "127.0.0.1", "MOEBUS_OPENAI_PORT": "0", "MOEBUS_METRICS_PORT": "0"}
BUS_SERVICE = "nats"


class StackError(RuntimeError):
    """The compose file or the stack is unusable; the message says which part."""


@dataclass
class ServiceSpec:
    """One moebus service of a compose file, interpolated: `moebus up` starts ``replicas`` processes of it."""

    name: str
    role: str
    args: list[str]  # after `moebus <role>`
    env: dict[str, str]
    replicas: int
    restart: str = "no"  # compose's restart policy, which `moebus up` applies as docker compose does (`services.launch.restarts`)
    # The variable each `environment` value is interpolated from, where the value is one `${VAR}` /
    # `${VAR:-default}` ... (e.g. MOEBUS_DECODE_MAX_BATCH -> DECODE_MAX_BATCH): the knob the file offers.
    env_knobs: dict[str, str] = field(default_factory=dict)


RESTART_POLICIES = ("no", "on-failure", "always", "unless-stopped")


def load_compose(path: str | Path, env: dict[str, str] | None = None, scale: dict[str, int] | None = None) -> list[ServiceSpec]:
    """The moebus services of a compose file (the `nats` service excluded)."""
    env = dict(os.environ) if env is None else env
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise StackError(f"{path}: {e}") from e
    services = doc.get("services") if isinstance(doc, dict) else None
    if not isinstance(services, dict) or not services:
        raise StackError(f"{path}: no `services` mapping (not a docker compose file?)")
    specs = []
    for name, svc in services.items():
        if name == BUS_SERVICE:
            continue
        if not isinstance(svc, dict):
            raise StackError(f"{path}: service {name!r} must be a mapping, got {svc!r}")
        command = svc.get("command")
        if isinstance(command, str):
            command = shlex.split(command)
        if not isinstance(command, list) or len(command) < 2 or command[0] != "moebus" or command[1] not in ROLES + FRONTENDS:
            raise StackError(f"{path}: service {name!r}: command must be `moebus <{'|'.join(ROLES + FRONTENDS)}> ...`, got {command!r}")
        raw_env = _environment(_unless_absent(svc.get("environment"), {}), f"{path}: service {name!r}")
        deploy = _unless_absent(svc.get("deploy"), {})
        count = _unless_absent(deploy.get("replicas"), 1) if isinstance(deploy, dict) else None
        where = f"{path}: service {name!r}"
        interpolated = _interpolator(env, where)
        replicas = str((scale or {}).get(name, interpolated(str(count))))
        if not isinstance(deploy, dict) or not replicas.isdigit():
            raise StackError(f"{path}: service {name!r}: deploy.replicas must be a count, got {svc.get('deploy')!r}")
        # PyYAML reads YAML 1.1, where an unquoted `no` is false; docker compose's reader takes it as "no".
        restart = "no" if svc.get("restart") is False else interpolated(str(svc.get("restart", "no")))
        if restart not in RESTART_POLICIES:
            raise StackError(f"{path}: service {name!r}: restart must be one of {', '.join(RESTART_POLICIES)}, got {restart!r}")
        specs.append(
            ServiceSpec(
                name=name,
                role=command[1],
                args=[interpolated(str(a)) for a in command[2:]],
                env={str(k): interpolated(str(v)) for k, v in raw_env.items()},
                replicas=int(replicas),
                restart=restart,
                env_knobs={str(k): knob for k, v in raw_env.items() if (knob := sole_variable(str(v)))},
            )
        )
    unknown = set(scale or {}) - {s.name for s in specs}
    if unknown:
        raise StackError(f"--scale: {path} has no service {', '.join(sorted(unknown))}")
    return specs


def _interpolator(env: dict[str, str], where: str) -> Callable[[str], str]:
    """Interpolates one value of a service from ``env``; a missing required variable is a `StackError`."""
    def interpolated(text: str) -> str:
        try:
            return interpolate(text, env)
        except InterpolationError as e:
            raise StackError(f"{where}: {e}") from None
    return interpolated


def _unless_absent(value: Any, default: Any) -> Any:
    """A compose key's value, or ``default`` where the key is absent or empty (YAML null), as docker compose
    reads it. Not ``value or default``: a literal ``replicas: 0`` must stay 0 (it became 1, a stack
    `check_every_role_runs` let through), and ``deploy: 0`` or ``environment: 0`` stay values it refuses."""
    return default if value is None else value


def _environment(raw: Any, where: str) -> dict[Any, Any]:
    """A service's ``environment``: a mapping, or compose's list of ``NAME=VALUE`` entries. A bare
    ``NAME`` entry, or a ``NAME:`` without a value in the mapping (compose: pass the caller's value on;
    it was the string "None", which replaced the caller's value), is left out: every process of `moebus up`
    inherits the caller's environment already."""
    if isinstance(raw, list) and all(isinstance(item, str) for item in raw):
        return dict(item.split("=", 1) for item in raw if "=" in item)
    if not isinstance(raw, dict):
        raise StackError(f"{where}: environment must be a mapping or a list of NAME=VALUE, got {raw!r}")
    return {name: value for name, value in raw.items() if value is not None}


# Variables `moebus up` sets for every process itself (README: it overrides them).
_SET_BY_UP = ("MOEBUS_NATS_URL", "MOEBUS_MODEL", "MOEBUS_INSTANCE")


def check_shadowed_settings(specs: list[ServiceSpec], environ: dict[str, str], path: str | Path) -> None:
    """Refuse a `MOEBUS_*` setting of the caller's environment that a service's `environment` in the
    compose file sets to another value: that service would never see it (the file's value wins, as
    under docker compose, where the caller's environment reaches a container only through the
    file's `${VAR}`s). The error names the file's knob for it, or says to edit the file."""
    problems = []
    for spec in specs:
        for key, value in spec.env.items():
            mine = environ.get(key)
            if not key.startswith("MOEBUS_") or key in _SET_BY_UP or mine is None or mine == value:
                continue
            knob = spec.env_knobs.get(key)
            fix = f"set {knob}={mine} instead" if knob else f"edit {path} to change it"
            problems.append(f"{key}={mine} is in your environment, but {path} sets {key}={value} for {spec.name}, "
                            f"which wins; {fix}")
    if problems:
        raise StackError("; ".join(problems))


def check_every_role_runs(specs: list[ServiceSpec], path: str | Path, scale: dict[str, int]) -> None:
    """Refuse a stack whose file runs a role of `ROLES` with no replica of it in all (`--scale gateway=0`, a
    count of 0 in the file): a request needs one of each, so such a stack never answers one, and `moebus up`
    waited out its ready timeout for it (without a gateway `llm.models` never answers)."""
    problems = []
    for role in ROLES:
        services = [s for s in specs if s.role == role]
        if services and not sum(s.replicas for s in services):
            counts = ", ".join(f"--scale {s.name}=0" if s.name in scale else f"{s.name}: replicas 0 in {path}" for s in services)
            problems.append(f"no {role} would run ({counts})")
    if problems:
        raise StackError(f"{'; '.join(problems)}: a request needs a gateway, a scheduler, a prefill and a decode instance; give each role a replica")
