"""What every service process shares: command line -> settings, signals, its heap once serving, heartbeats, stage names and cancels.

The control-plane processes (gateway, scheduler, the HTTP frontends) import this module and never
torch: nothing here may import the model runtime (weights, kernels, parallel), which the model
ranks reach through services/model_rank.py (tests/services/test_control_plane_imports.py)."""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import signal
import time
from collections.abc import Callable, Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypeVar

from schemas import subjects
from schemas.internal import Cancel, Heartbeat, Role
from shared.bus import Bus, BusError, connect, pack
from shared.logging import configure_logging, get_logger
from shared.model.config import ModelConfig
from shared.model.errors import CheckpointError, ConfigError, ShardingError
from shared.settings import SERVICES, ProcessSettings, ServiceSettings, SettingsError, load_settings
from shared.tasks import cancel_and_wait

log = get_logger(__name__)


@functools.cache  # the installed distribution's metadata, read once per process
def moebus_version() -> str:
    try:
        return version("moebus")
    except PackageNotFoundError:
        return "0+unknown"


def decode_stage(instance: str, rank: int) -> str:
    """The ``stage`` a decode rank names in its ``StageError``s."""
    return f"decode:{instance}/{rank}"


def prefill_stage(instance: str) -> str:
    """The ``stage`` a prefill instance names in its ``StageError``s."""
    return f"prefill:{instance}"


def cancel_applies(cancel: Cancel, stage: str | None) -> bool:
    """Whether a ``ctl.cancel`` concerns this process: every stage acts on an untargeted one; a
    targeted one (``Cancel.stage``) only the stage it names (``stage``; None for the gateway and
    the scheduler, which no cancel targets: the request goes on elsewhere)."""
    return not cancel.stage or cancel.stage == stage


async def release_reservation(bus: Bus, request_id: str, decode_instance: str, decode_rank: int, reason: str, *, kv_sent: bool = False) -> None:
    """Free the request's KV reservation on the decode rank it was placed on, and only there: a
    ``ctl.cancel`` targeted at that rank. Every other stage ignores it (`cancel_applies`): the
    gateway, which ends the request on its tokens or a ``StageError``, not on this cancel; prefill;
    and any other decode rank holding the same request id (one the request went to after this
    rank's answer came late, where it goes on). With NATS away the rank's lease frees the pages.
    ``kv_sent``: every sender of the request's KV finished (`Cancel.kv_sent`)."""
    cancel = Cancel(request_id, reason, stage=decode_stage(decode_instance, decode_rank), kv_sent=kv_sent)
    try:
        await bus.publish(subjects.CTL_CANCEL, pack(cancel))
    except BusError as e:
        log.warning("release_not_sent", request_id=request_id, decode=cancel.stage, error=str(e))


def check_model_config(settings: ServiceSettings) -> None:
    """Read the checkpoint's config.json: `ConfigError` for no such directory, not a checkpoint, or
    an architecture moebus does not run (what the gateway checks; `parse_settings`' default)."""
    ModelConfig.from_dir(settings.model)


S = TypeVar("S", bound=ProcessSettings)


def load_or_exit(parser: argparse.ArgumentParser, cls: type[S], service: str, config_file: str | None, overrides: Mapping[str, object]) -> S:
    """`service`'s settings (`load_settings`: the TOML file, the environment, then ``overrides`` from
    the command line); a bad one is a usage error (exit 2) naming it and its source."""
    try:
        return load_settings(cls, service, config_file, overrides)
    except SettingsError as e:
        parser.error(str(e))


def parse_settings(service: str, argv: list[str], needs_model: str = "",
                   check_model: Callable[[ServiceSettings], None] = check_model_config) -> ServiceSettings:
    """`moebus <service> [--config FILE] [--nats-url URL] [--model DIR] [--instance ID] [--set FIELD=VALUE ...]`.

    `needs_model`: why the service needs a checkpoint; when given, a missing --model
    (or MOEBUS_MODEL) is a usage error saying so, and so is a checkpoint `check_model` refuses
    (`ConfigError`, `CheckpointError`, `ShardingError`). The model ranks pass
    `services.model_rank.check_rank_checkpoint`, which also reads their weight files: it
    lives with the code that imports torch, which the other services never import.
    """
    parser = argparse.ArgumentParser(prog=f"moebus {service}", description=f"run a {service}")
    parser.add_argument("--config", help="TOML settings file (see shared/settings.py)")
    parser.add_argument("--nats-url")
    parser.add_argument("--model", help="checkpoint directory")
    parser.add_argument("--instance", help="instance id used in subjects and heartbeats")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="any other settings field")
    args = parser.parse_args(argv)
    overrides: dict[str, object] = {"nats_url": args.nats_url, "model": args.model, "instance": args.instance}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set expects FIELD=VALUE, got {item!r}")
        overrides[key.replace("-", "_")] = value
    cls = SERVICES[service]
    assert issubclass(cls, ServiceSettings), f"{service} is an HTTP frontend: its settings come from services.http.parse_frontend"
    settings = load_or_exit(parser, cls, service, args.config, overrides)
    if needs_model and not settings.model:
        parser.error(f"--model DIR (or MOEBUS_MODEL) is required: {needs_model}")
    if needs_model:
        try:
            check_model(settings)
        except ShardingError as e:
            parser.error(f"model {settings.model!r} cannot be split over this instance's ranks: {e}")
        except (ConfigError, CheckpointError) as e:
            parser.error(f"model {settings.model!r} is not a checkpoint moebus serves: {e}")
        except SettingsError as e:  # a runtime switch of the ranks (services.model_rank.check_rank_checkpoint)
            parser.error(str(e))
    configure_logging(service, settings.log_level, settings.log_json, instance=settings.instance)
    return settings


def require_bus(service: str, settings: ServiceSettings) -> None:
    """`Unreachable` (`moebus` prints it and exits 1) unless a NATS server answers at `nats_url` within
    `connect_timeout_s`: checked before a model instance loads and warms up its checkpoint (minutes for
    a large one), which it otherwise did before finding a wrong URL. The ranks connect again once loaded."""

    async def probe() -> None:
        async with connect(settings.nats_url, f"{service}-{settings.instance}-probe", connect_timeout=settings.connect_timeout_s):
            pass

    asyncio.run(probe())


def stop_event() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (drain and exit instead of dying mid-request)."""
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, event.set)
    return event


def freeze_startup_heap() -> None:
    """Take what the process holds when it starts serving (its imports, settings, tokenizer, model)
    out of the garbage collector's sight (`gc.freeze`). Called before the service connects.
    A full collection walks every tracked object and runs on the event loop, stalling every
    request in flight. With torch imported (a model rank; the control plane too before it stopped
    importing it) that is ~192k objects: 40-90 ms per collection in a scheduler on the 2-core CPU
    host of bench/control_plane.py, its placements' p99 at concurrency 64. A torch-free scheduler
    still holds ~32k objects at start, 5-6 ms per full collection on that host, about its median
    placement at concurrency 64, against 0.16 ms for this call once (bench/control_plane_start.py).
    Startup objects live as long as the process; frozen, they are no longer walked (nor ever
    freed, which they would not be)."""
    # The young generations' garbage is freed first; not the old one's: a full collection here cost
    # 0.1-1.7 s of a scheduler's start on that host (measured from its spawn to its subscription),
    # for 30 objects freed.
    gc.collect(1)
    gc.freeze()


class StepWatch:
    """When the step a group of ranks is in began (every rank takes part: one hung rank blocks the
    others in it); a step running past ``stall_s`` is a stall, which a `Heartbeater`'s ``withhold``
    reads so that watchers count the process gone. ``on_stall`` runs once per stalled step (its log)."""

    def __init__(self, stall_s: float, on_stall: Callable[[], None]) -> None:
        self.stall_s = stall_s
        self.on_stall = on_stall
        self.started: float | None = None  # monotonic; None between steps
        self.reported = False

    def begin(self) -> None:
        self.started, self.reported = time.monotonic(), False

    def end(self) -> None:
        self.started = None

    def stalled(self) -> bool:
        if self.started is None or time.monotonic() - self.started < self.stall_s:
            return False
        if not self.reported:
            self.reported = True
            self.on_stall()
        return True


class Heartbeater:
    """Publishes this process's heartbeat on ctl.heartbeat.<role>.<instance>.<rank> every `heartbeat_interval_s`.

    Who is beating (role, instance, rank, model, version, start time) is fixed here;
    `status()` returns the rest of the `Heartbeat` fields, the role's current state
    (draining, KV pages, queue lengths, ...), as keyword arguments.
    """

    def __init__(self, bus: Bus, settings: ServiceSettings, role: Role, status: Callable[[], dict[str, Any]], rank: int = 0,
                 withhold: Callable[[], bool] | None = None) -> None:
        """`withhold`: while it returns True no beat goes out (the process runs but cannot serve)."""
        self.bus = bus
        self.withhold = withhold
        self.interval = settings.heartbeat_interval_s
        self.status = status
        self.role: Role = role
        self.instance = settings.instance
        self.rank = rank
        self.model = settings.model_name
        self.version = moebus_version()
        self.started_at = time.time()
        self._task: asyncio.Task[None] | None = None

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(
            role=self.role,
            instance=self.instance,
            rank=self.rank,
            model=self.model,
            version=self.version,
            started_at=self.started_at,
            **self.status(),
        )

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def beat(self) -> None:
        await self.bus.publish(subjects.heartbeat(self.role, self.instance, self.rank), pack(self.heartbeat()))

    async def announce(self) -> None:
        """One beat now, between the regular ones (the state changed: draining, final counts); a
        failure is logged, not raised, so that the caller's drain goes on."""
        try:
            await self.beat()
        except Exception:
            log.exception("heartbeat_failed", role=self.role)

    async def _loop(self) -> None:
        # A beat more than two intervals after the last one went out late: watchers may soon
        # count this process as gone. The CPU times over the gap say why: loop_cpu_s close to
        # gap_s, the event loop itself was busy (work that belongs off the loop); a small
        # process_cpu_s, the process did not get the CPU (an overloaded host).
        last, last_cpu, last_loop_cpu = time.monotonic(), time.process_time(), time.thread_time()
        while True:
            now, cpu, loop_cpu = time.monotonic(), time.process_time(), time.thread_time()
            if now - last > 2 * self.interval:
                log.warning("heartbeat_late", role=self.role, gap_s=round(now - last, 3),
                            loop_cpu_s=round(loop_cpu - last_loop_cpu, 3), process_cpu_s=round(cpu - last_cpu, 3))
            last, last_cpu, last_loop_cpu = now, cpu, loop_cpu
            try:
                if self.withhold is None or not self.withhold():
                    await self.beat()
            except Exception:
                log.exception("heartbeat_failed", role=self.role)
            await asyncio.sleep(self.interval)

    async def stop(self) -> None:
        """Stop beating; a final heartbeat with draining=True was the caller's job."""
        if self._task is not None:
            await cancel_and_wait(self._task)
