"""Typed settings, one msgspec struct per service and HTTP frontend, from a TOML file and the environment.

Sources, later ones win:
1. TOML file (`--config FILE` or `MOEBUS_CONFIG`): top-level keys apply to every
   service that has such a field, the table `[<service>]` to that service only;
2. `MOEBUS_<FIELD>` environment variables (shared by all services, e.g. `MOEBUS_NATS_URL`);
3. `MOEBUS_<SERVICE>_<FIELD>` environment variables (e.g. `MOEBUS_DECODE_MAX_BATCH=64`);
4. explicit overrides (command-line flags).

Unknown keys and variables are errors (a typo must not silently fall back to a default):
a top-level key or table of the file that no service has, a key in a `[<service>]` table that
service lacks, and a `MOEBUS_*` variable that is no service's field, no `MOEBUS_<SERVICE>_<FIELD>`
of that service, nor one of the `OTHER_VARIABLES` read elsewhere. Values from the environment are
strings and are converted to the field's type; lists are written as JSON. Sizes, counts and
durations are bounded (`Meta`), so a zero or negative one stops the service at start naming the field
and where its value came from (the value of a secret, `SECRET_FIELDS`, is not shown).

The HTTP frontends (`moebus openai`, `moebus metrics`) are services here too: `[openai]`,
`MOEBUS_METRICS_PORT`, and the shared keys they have (`nats_url`, `log_level`, `http_host`, ...).
"""

from __future__ import annotations

import json
import os
import re
import socket
import tomllib
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from shared.logging import LEVELS

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


# Bounds of the numeric fields: a page size of 0 or a negative KV pool would only fail deep in a
# rank (ZeroDivisionError, "Dimension size must be non-negative"), and tp=0 or dp=-1 start no rank at all.
Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(gt=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Share = Annotated[float, msgspec.Meta(ge=0, le=1)]
LogLevel = Annotated[str, msgspec.Meta(pattern=rf"(?i)^({'|'.join(LEVELS)})$")]
Device = Annotated[str, msgspec.Meta(pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$")]
# "auto": bfloat16 on a GPU (the kernels' dtype and Qwen3 checkpoints'), float32 on the CPU (the reference ops')
Dtype = Literal["auto", "float32", "bfloat16", "float16"]

# MOEBUS_* variables that are not settings fields, read elsewhere: a service must not take them for typos.
OTHER_VARIABLES = frozenset({
    "MOEBUS_CONFIG",  # the TOML file (this module)
    "MOEBUS_NATS_MAX_PAYLOAD",  # the local nats-server's config (NatsServerSettings)
    "MOEBUS_CACHE_DIR",  # moebus up: the tiny model and the logs
    "MOEBUS_IMAGE",  # compose-file interpolation
    "MOEBUS_KERNELS", "MOEBUS_DECODE_ATTENTION", "MOEBUS_KV_CUDA_IPC",  # kernels.ops, shared.model.layers, shared.transfer.cuda_ipc
    "MOEBUS_RESULTS_DIR", "MOEBUS_COMMIT", "MOEBUS_TINY_DIR",  # bench/ and test tooling
})


# Fields whose values no error message shows (`load_settings` names their source only).
SECRET_FIELDS = frozenset({"api_key"})


class SettingsError(ValueError):
    """Invalid configuration; the message names the source (file, variable, field)."""


# A member counts as gone only after this many heartbeat intervals of silence: one beat
# late under CPU load plus one more must not take a working process out of service.
MIN_EXPIRY_INTERVALS = 3


def _check_expiry(expiry_s: float, interval_s: float, field: str) -> None:
    if expiry_s < MIN_EXPIRY_INTERVALS * interval_s:
        raise ValueError(
            f"{field}={expiry_s:g} must be at least {MIN_EXPIRY_INTERVALS} x heartbeat_interval_s={interval_s:g}"
            f" (set heartbeat_interval_s alike for every service)"
        )


def default_instance_id() -> str:
    """hostname-pid-random, restricted to characters valid in a NATS subject token."""
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:24]
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


class ProcessSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields of every process on the stack's bus: the services and the HTTP frontends."""

    nats_url: str = "nats://127.0.0.1:4222"
    log_level: LogLevel = "info"
    log_json: bool | None = None  # None: JSON when stderr is not a terminal
    # Every service beats this often: set it alike for all. The expiries below (the frontends' too,
    # which only listen to the beats) are judged against it.
    heartbeat_interval_s: Seconds = 0.5
    connect_timeout_s: Seconds = 30.0  # at start, how long to wait for the NATS server before exiting with an error
    # SIGTERM: how long in-flight work may take to finish (a frontend's requests in flight; what still
    # runs then is cut, logged as `drain_timed_out`). Below the compose files' stop_grace_period (30 s).
    drain_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 10.0


class ServiceSettings(ProcessSettings, kw_only=True):
    """Fields every service of the request path (gateway, scheduler, prefill, decode) has."""

    model: str = ""  # checkpoint directory (config.json, tokenizer, weights)
    model_name: str = ""  # name served on llm.models; default: the directory's name
    instance: str = ""  # id in subjects and heartbeats; default: hostname-pid-random


class GatewaySettings(ServiceSettings, kw_only=True):
    max_tokens_limit: Positive = 4096  # largest max_tokens accepted (also capped by the context)
    max_context: NonNegative = 0  # prompt + completion; 0: the model's max_position_embeddings
    # Deadline of requests that set none: long enough for max_tokens_limit tokens of a long
    # reasoning answer at a loaded decode rank's per-sequence rate (4096 at ~10 tok/s).
    default_timeout_ms: Positive = 600_000
    max_timeout_ms: Positive = 3_600_000
    max_in_flight: Positive = 4096  # requests beyond this get `overloaded` at once
    stage_expiry_s: Seconds = 2.0  # a prefill/decode rank silent this long (while the gateway listens) fails its requests
    # a scheduler's first answer (placed, refused, or queued) comes within this; silence beyond it = gone
    submit_timeout_s: Seconds = 10.0
    # vLLM's --chat-template: a Jinja file's path, or the template itself (services.gateway.chat_template
    # tells them apart), used for every chat in place of the checkpoint's; "": the checkpoint's own
    chat_template: str = ""

    def __post_init__(self) -> None:
        _check_expiry(self.stage_expiry_s, self.heartbeat_interval_s, "stage_expiry_s")
        if self.default_timeout_ms > self.max_timeout_ms:  # requests that set no deadline would get more than any may ask for
            raise ValueError(f"default_timeout_ms={self.default_timeout_ms} must be at most max_timeout_ms={self.max_timeout_ms}")


class SchedulerSettings(ServiceSettings, kw_only=True):
    heartbeat_expiry_s: Seconds = 1.5  # registry drops members silent for this long
    queue_wait_ms: NonNegative = 0  # how long a request may wait for capacity before `overloaded`; 0: until its deadline (vLLM's queue)
    max_queued: NonNegative = 4096  # requests waiting for capacity (the gateway's max_in_flight); beyond -> `overloaded` at once
    # vLLM's --scheduling-policy: "fcfs" serves the waiting requests in arrival order and refuses a request's
    # priority other than 0; "priority" serves them by (priority, arrival), lower first. Nothing running is preempted.
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    reserve_timeout_ms: Positive = 500  # a decode rank must answer a reservation within this
    # A decode rank that did not is skipped until it answers a probe: the first goes out
    # reserve_timeout_ms after the miss, each missed one doubles the wait up to this.
    suspect_probe_max_s: Seconds = 5.0
    lease_s: Seconds = 30.0  # reserved KV pages are freed if prefill has not started decode by then
    # A prompt goes to the prefill instance its first KV page hashes to (whose prefix cache may hold
    # it) unless that one has this many more queued tokens than the least loaded; 0: always the least loaded.
    prefix_affinity_tokens: NonNegative = 4096

    def __post_init__(self) -> None:
        _check_expiry(self.heartbeat_expiry_s, self.heartbeat_interval_s, "heartbeat_expiry_s")


def _check_gpus(gpus: list[int], ranks: int, field: str) -> None:
    if gpus and len(gpus) != ranks:
        raise ValueError(f"gpus {gpus} lists {len(gpus)} GPU(s) for {field}={ranks} ranks")
    if len(set(gpus)) != len(gpus) or any(g < 0 for g in gpus):
        raise ValueError(f"gpus {gpus} must be distinct GPU indices >= 0")


class PrefillSettings(ServiceSettings, kw_only=True):
    tp: Positive = 1  # tensor-parallel ranks (processes) of this instance
    device: Device = "auto"  # "auto": cuda when available, else cpu; "cuda": rank r on GPU r; "cuda:N"
    gpus: list[int] = []  # with device auto/cuda: rank r on GPU gpus[r] (e.g. [2, 3]); empty: GPU r
    dtype: Dtype = "auto"  # compute and KV dtype; must match the decode instances (Dtype)
    page_size: Positive = 16
    kv_pages: Positive = 512  # KV pages of the prefill-side cache (per rank)
    # vLLM's --gpu-memory-utilization: the share of its GPU's memory a rank may use for weights, activations and
    # KV cache; the KV pages are what is left (shared.model.kv_budget) and kv_pages is not used. 0: kv_pages. GPU only.
    gpu_memory_utilization: Share = 0.0
    max_batch_tokens: Positive = 8192  # prompts run together in one forward pass, up to this many tokens
    # ... and up to this many prompt tokens, reused ones included: prefill attention gathers every
    # prompt's whole context at once, so a shared cached prefix counts once per prompt
    max_batch_context_tokens: Positive = 65536
    dist_port: Port = 0  # torch.distributed rendezvous port; 0: pick a free one
    transfer_timeout_s: Seconds = 30.0
    warmup: bool = True  # run dummy prompts through every rank (compiling its kernels) before it reports ready
    gateway_expiry_s: Seconds = 5.0  # a gateway silent this long (while the leader listens) has its queued tasks dropped
    # A batch (its broadcast, forward and collectives) running longer than this means a rank is hung:
    # the leader withholds its heartbeats until the batch ends, so that watchers count the instance gone.
    stall_s: Seconds = 60.0
    prefix_caching: bool = True  # reuse the KV pages of prompt prefixes this instance computed before (shared.prefix_cache)
    # On CUDA (kernel path): forwards of up to this many tokens (and max_batch_tokens) as piecewise CUDA-graph
    # replays per token bucket, attention eager between the pieces (shared.model.prefill_graphs); ignored on CPU
    cuda_graphs: bool = True
    cuda_graph_max_tokens: Positive = 2048

    def __post_init__(self) -> None:
        _check_gpus(self.gpus, self.tp, "tp")
        _check_expiry(self.gateway_expiry_s, self.heartbeat_interval_s, "gateway_expiry_s")
        if not 0 < self.max_batch_tokens <= self.max_batch_context_tokens:
            raise ValueError(f"max_batch_tokens {self.max_batch_tokens} must be > 0 and at most max_batch_context_tokens {self.max_batch_context_tokens}")


class DecodeSettings(ServiceSettings, kw_only=True):
    dp: Positive = 1  # data-parallel ranks (processes); experts are sharded over all of them (EP = dp)
    device: Device = "auto"  # "auto": cuda when available, else cpu; "cuda": rank r on GPU r; "cuda:N"
    gpus: list[int] = []  # with device auto/cuda: rank r on GPU gpus[r] (e.g. [2, 3]); empty: GPU r
    dtype: Dtype = "auto"  # compute and KV dtype; must match the prefill instances (Dtype)
    page_size: Positive = 16
    kv_pages: Positive = 512  # KV pages per rank
    # vLLM's --gpu-memory-utilization: the share of its GPU's memory a rank may use for weights, activations and
    # KV cache; the KV pages are what is left (shared.model.kv_budget) and kv_pages is not used. 0: kv_pages. GPU only.
    gpu_memory_utilization: Share = 0.0
    max_batch: Positive = 32  # running + reserved requests per rank
    dist_port: Port = 0
    idle_poll_ms: Annotated[float, msgspec.Meta(gt=0)] = 20.0  # dp > 1: longest lockstep poll interval while every rank is idle
    warmup: bool = True  # run dummy decode steps through every rank (compiling its kernels) before it reports ready
    cuda_graphs: bool = True  # on CUDA (kernel path): decode steps as CUDA-graph replays per batch x page bucket; ignored on CPU
    cuda_graphs_max: Positive = 64  # graphs captured at most per rank; a step needing another bucket runs eagerly
    gateway_expiry_s: Seconds = 5.0  # a gateway silent this long (while the rank listens) has its requests dropped here
    # A lockstep step running longer than this means a rank of the instance is hung: this rank
    # withholds its heartbeats until the step ends, so that watchers count it gone.
    stall_s: Seconds = 60.0

    def __post_init__(self) -> None:
        _check_gpus(self.gpus, self.dp, "dp")
        _check_expiry(self.gateway_expiry_s, self.heartbeat_interval_s, "gateway_expiry_s")


def instance_gpus(settings: PrefillSettings | DecodeSettings) -> list[int]:
    """The GPU index each rank of an instance takes (`services.model_rank.resolve_device`, for as many GPUs as
    ranks); none on the CPU."""
    ranks = settings.tp if isinstance(settings, PrefillSettings) else settings.dp
    if settings.device == "cpu":
        return []
    if settings.device.startswith("cuda:"):
        return [int(settings.device.removeprefix("cuda:"))] * ranks
    return list(settings.gpus) or list(range(ranks))


def check_gpu_shares(instances: list[tuple[str, int, PrefillSettings | DecodeSettings]]) -> None:
    """Services started on one host (`moebus up`, no container per service) share its GPUs: the
    gpu_memory_utilization of the ranks on each GPU must add up to at most the whole GPU. ``instances``:
    (name, replicas, settings); a rank on its own share's GPU alone is checked by itself at start."""
    shares: dict[int, list[tuple[str, float]]] = {}
    for name, replicas, settings in instances:
        if settings.gpu_memory_utilization:
            for gpu in instance_gpus(settings):
                shares.setdefault(gpu, []).extend([(name, settings.gpu_memory_utilization)] * replicas)
    for gpu, on_gpu in sorted(shares.items()):
        total = sum(share for _, share in on_gpu)
        if total > 1 + 1e-9:
            holders = ", ".join(f"{name} ({share:g})" for name, share in on_gpu)
            raise SettingsError(f"GPU {gpu} would hold ranks of {holders}: their gpu_memory_utilization add up to {total:g}, "
                                "more than the GPU; give each a smaller share, or its own GPUs (gpus)")


class FrontendSettings(ProcessSettings, kw_only=True):
    """Fields of the HTTP frontends (`moebus openai`, `moebus metrics`): NATS clients of the stack,
    with no model, no instance id and no heartbeat of their own."""

    http_host: str = "127.0.0.1"  # address to listen on; 0.0.0.0: every interface (the compose files' containers)
    port: Port  # TCP port; 0: any free one (printed at start). Each frontend has its own default.
    # A kept connection idle this long is closed: uvicorn's --timeout-keep-alive and default, which
    # vLLM serves with (VLLM_HTTP_TIMEOUT_KEEP_ALIVE); a new connection's first request gets longer.
    timeout_keep_alive_s: Seconds = 5.0
    # A connection is closed after this many requests (its last answer says so): nginx's
    # keepalive_requests, so that clients reconnect and spread again over the replicas behind a
    # TCP load balancer. 1: no keep-alive.
    keep_alive_requests: Positive = 1000
    # A client that takes no byte of its answer this long (it stopped reading without closing: a hung
    # process, a laptop asleep behind a NAT) has its connection reset and its request cancelled:
    # nginx's send_timeout and default. Counted between two bytes taken, so a slow reader is not cut.
    send_timeout_s: Seconds = 60.0


# A browser's Origin as it sends it: scheme://host[:port], with no path nor trailing slash.
_ORIGIN = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/\s]+")
ToolCallParser = Literal["hermes"]  # Qwen3's <tool_call> JSON blocks (vLLM's name)
ReasoningParser = Literal["qwen3"]  # Qwen3's text up to </think> (vLLM's name)


class OpenAISettings(FrontendSettings, kw_only=True):
    """`moebus openai`; the tool and reasoning parsers take vLLM's names, so a vLLM command line for Qwen3 carries over."""

    port: Port = 8000
    max_n: Annotated[int, msgspec.Meta(ge=1, le=128)] = 16  # choices (n) one request may ask for, each a request to the stack; OpenAI's bound
    max_prompts: Positive = 64  # prompts one /v1/completions request may batch
    # choices (n x prompts) one request may ask for, each a request to the stack: a small part of the scheduler's
    # max_queued (4096 by default), else one request could fill its queue and push every other client into 503s
    max_choices: Positive = 256
    # /health fails once no scheduler, prefill instance or decode rank taking work was heard this
    # long: the gateway's stage_expiry_s, after which it fails their requests.
    health_expiry_s: Seconds = 2.0
    enable_auto_tool_choice: bool = False  # parse chat answers for tool calls, so requests may give tools (tool_choice "auto")
    tool_call_parser: ToolCallParser | None = None  # the model's tool-call format; goes with enable_auto_tool_choice
    reasoning_parser: ReasoningParser | None = None  # give the model's reasoning as reasoning_content; None: off
    # vLLM's --api-key: every /v1/ request must say `Authorization: Bearer <key>`, the key or one of a list of
    # them (vLLM's several keys, for rotation: `api_keys`); None: no authentication. From the environment a
    # string is one key, a JSON list several. A secret (`SECRET_FIELDS`): never shown in an error, never logged.
    api_key: str | list[str] | None = None
    # vLLM's CORS flags (`services.openai.access.Cors`). The origins whose pages may call this server from a
    # browser: none by default, where vLLM allows "*": on a server that listens on 127.0.0.1 with no key,
    # "*" would let any web page its user visits drive the stack and read the answers.
    allowed_origins: list[str] = []
    allow_credentials: bool = False
    allowed_methods: list[str] = msgspec.field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = msgspec.field(default_factory=lambda: ["*"])

    def __post_init__(self) -> None:
        _check_expiry(self.health_expiry_s, self.heartbeat_interval_s, "health_expiry_s")
        keys = self.api_keys()
        if self.api_key is not None and not any(keys):  # "" would be sent by no client: refused rather than read as "no authentication"
            raise ValueError("api_key is empty: give a key, or leave api_key unset (no --api-key) to serve without authentication")
        if "" in keys:
            raise ValueError(f"api_key: key {keys.index('') + 1} of {len(keys)} is empty (no client sends it): leave it out")
        for origin in self.allowed_origins:  # one with a path or a trailing slash would match no request, silently
            if origin != "*" and not _ORIGIN.fullmatch(origin):
                raise ValueError(f"allowed_origins: {origin!r} is not an origin: scheme://host[:port] with no path nor trailing slash"
                                 ' (e.g. "https://app.example"), or "*"')
        if self.enable_auto_tool_choice != (self.tool_call_parser is not None):  # vLLM's pair of flags: one alone is a half-written command line
            raise ValueError(f"enable_auto_tool_choice={self.enable_auto_tool_choice} and tool_call_parser={self.tool_call_parser!r} go together"
                             " (e.g. --enable-auto-tool-choice --tool-call-parser hermes)")


    def api_keys(self) -> list[str]:
        """The keys a ``/v1`` request may carry (``api_key`` as a list); none: no authentication."""
        if self.api_key is None:
            return []
        return [self.api_key] if isinstance(self.api_key, str) else self.api_key


class MetricsSettings(FrontendSettings, kw_only=True):
    """`moebus metrics`."""

    port: Port = 9464
    expiry_s: Seconds = 5.0  # a process this long after its last heartbeat leaves the page

    def __post_init__(self) -> None:
        _check_expiry(self.expiry_s, self.heartbeat_interval_s, "expiry_s")


# nats-server refuses a max_payload above its max_pending (64 MiB); below its own default (1 MiB)
# a stack would only refuse more replies.
NATS_MAX_PAYLOAD_RANGE = (1 << 20, 64 << 20)
NATS_MAX_PAYLOAD_ENV = "MOEBUS_NATS_MAX_PAYLOAD"


class NatsServerSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The nats-server a local stack starts (`moebus up`, through its config file); the compose
    files give theirs the same value from the same variable (``MOEBUS_NATS_MAX_PAYLOAD``)."""

    # Largest message, bytes. A reply above it (say prompt_logprobs of a long prompt) fails with
    # `invalid_request` naming the limit: nats-server's own default, 1 MiB, is small for those.
    max_payload: int = 8 << 20

    def __post_init__(self) -> None:
        low, high = NATS_MAX_PAYLOAD_RANGE
        if not low <= self.max_payload <= high:
            raise ValueError(f"max_payload must be in [{low}, {high}] bytes (1 MiB to nats-server's cap of 64 MiB), got {self.max_payload}")


def nats_server_settings(max_payload: int | str | None = None, env: Mapping[str, str] | None = None) -> NatsServerSettings:
    """The local nats-server's settings: ``max_payload`` (a command-line flag) when given, else
    ``MOEBUS_NATS_MAX_PAYLOAD`` (bytes), else the default."""
    env = os.environ if env is None else env
    value = max_payload if max_payload is not None else env.get(NATS_MAX_PAYLOAD_ENV)
    try:
        return msgspec.convert({} if value is None else {"max_payload": value}, NatsServerSettings, strict=False)
    except msgspec.ValidationError as e:
        source = "--nats-max-payload" if max_payload is not None else NATS_MAX_PAYLOAD_ENV
        raise SettingsError(f"nats-server settings ({source}): {e}") from e


def nats_url_from_env(env: Mapping[str, str] | None = None) -> str:
    """The NATS URL of a command run without `--url` (`moebus status`, `moebus request`): `MOEBUS_NATS_URL`,
    the one every service and frontend reads, so that these commands look at the same stack; else the default."""
    env = os.environ if env is None else env
    return env.get("MOEBUS_NATS_URL") or ProcessSettings().nats_url


SERVICES: dict[str, type[ProcessSettings]] = {
    "gateway": GatewaySettings,
    "scheduler": SchedulerSettings,
    "prefill": PrefillSettings,
    "decode": DecodeSettings,
    "openai": OpenAISettings,
    "metrics": MetricsSettings,
}

S = TypeVar("S", bound=ProcessSettings)


def load_settings(
    cls: type[S],
    service: str,
    config_file: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> S:
    env = os.environ if env is None else env
    fields = _fields(cls)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}  # field -> where its value came from, for the error naming it

    def take(name: str, value: Any, source: str) -> None:
        values[name] = value
        sources[name] = source

    path = config_file or env.get("MOEBUS_CONFIG")
    if path:
        try:
            doc = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise SettingsError(f"config file {path}: {e}") from e
        _check_file_keys(doc, path)
        for name, value in doc.items():
            if name in fields:
                take(name, value, f"{name} = {_shown(name, value)} in config file {path}")
        section = doc.get(service, {})
        unknown = sorted(set(section) - fields)
        if unknown:
            raise SettingsError(f"config file {path}: unknown key(s) in [{service}]: {', '.join(unknown)}")
        for name, value in section.items():
            take(name, value, f"{name} = {_shown(name, value)} in [{service}] of config file {path}")

    _check_variables(env)
    prefix = f"MOEBUS_{service.upper()}_"
    for name in fields:
        if (raw := env.get(var := f"MOEBUS_{name.upper()}")) is not None:
            take(name, _from_env(raw), f"{var}={_shown(name, raw)}")
    for var, raw in env.items():
        if var.startswith(prefix) and var not in OTHER_VARIABLES:
            name = var[len(prefix) :].lower()
            take(name, _from_env(raw), f"{var}={_shown(name, raw)}")

    for name, value in (overrides or {}).items():
        if value is not None:
            take(name, value, f"{name}={_shown(name, value)} on the command line")
    try:
        settings = msgspec.convert(values, cls, strict=False)
    except msgspec.ValidationError as e:
        field = re.search(r"at `\$\.(\w+)", str(e))  # msgspec's path of the offending value: `$.port`, `$.gpus[0]`
        # Without a path the error is a check across fields (`__post_init__`), whose message names them.
        named = [field.group(1)] if field else [name for name in sources if re.search(rf"\b{name}\b", str(e))]
        where = "; ".join(sources[name] for name in named if name in sources)
        raise SettingsError(f"{service} settings: {where + ': ' if where else ''}{e}") from e
    return _fill_defaults(settings)


def _shown(name: str, value: Any) -> str:
    """How an error shows field ``name``'s ``value``: its repr, that of a `SECRET_FIELDS` hidden."""
    return "<hidden>" if name in SECRET_FIELDS else repr(value)


def _fields(cls: type[ProcessSettings]) -> set[str]:
    return {f.name for f in msgspec.structs.fields(cls)}


def _check_file_keys(doc: dict[str, Any], path: str | Path) -> None:
    """Every service reads the same file: a top-level key must be some service's field, a table one of `SERVICES`
    (each service checks its own table's keys), so that a typo fails every service instead of being skipped by all."""
    shared = set().union(*(_fields(c) for c in SERVICES.values()))
    for key, value in doc.items():
        if key in SERVICES:
            if not isinstance(value, dict):
                raise SettingsError(f"config file {path}: [{key}] must be a table of {key} settings, got {value!r}")
        elif key not in shared:
            raise SettingsError(f"config file {path}: unknown top-level key {key!r}: not a setting of any service"
                                f" nor a table [{'] ['.join(SERVICES)}]")


def _check_variables(env: Mapping[str, str]) -> None:
    """A `MOEBUS_*` variable must be read by something: `MOEBUS_<FIELD>` of some service, `MOEBUS_<SERVICE>_<FIELD>`
    of that service, or one of `OTHER_VARIABLES`. Every service checks them all, as every service of a stack gets one environment."""
    shared = set().union(*(_fields(c) for c in SERVICES.values()))
    for var in env:
        if not var.startswith("MOEBUS_") or var in OTHER_VARIABLES or var[len("MOEBUS_") :].lower() in shared:
            continue
        for service, cls in SERVICES.items():
            prefix = f"MOEBUS_{service.upper()}_"
            if var.startswith(prefix):
                if var[len(prefix) :].lower() not in _fields(cls):
                    raise SettingsError(f"environment variable {var}: {cls.__name__} has no field {var[len(prefix) :].lower()!r}")
                break
        else:
            raise SettingsError(f"environment variable {var}: no service has a field {var[len('MOEBUS_') :].lower()!r}"
                                f" (MOEBUS_<FIELD> or MOEBUS_<SERVICE>_<FIELD>, SERVICE one of {', '.join(s.upper() for s in SERVICES)})")


def _from_env(raw: str) -> Any:
    """Environment values are strings; JSON lists/objects are parsed, the rest converted by msgspec."""
    if raw[:1] in "[{":
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def _fill_defaults(settings: S) -> S:
    if not isinstance(settings, ServiceSettings):  # a frontend: no instance id, no model
        return settings
    if not settings.instance:
        settings.instance = default_instance_id()
    if not _NAME.match(settings.instance):
        raise SettingsError(f"instance {settings.instance!r}: use 1-64 letters, digits, '-' or '_'")
    if settings.model and not settings.model_name:
        settings.model_name = Path(settings.model).resolve().name
    return settings
