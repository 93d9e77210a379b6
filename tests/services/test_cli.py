"""`moebus up --demo` and `moebus request` as a user runs them (what `make demo` does), with the
NATS server's max_payload raised and the served model name set through the environment."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgspec
import pytest

from schemas import subjects
from schemas.internal import Heartbeat
from services.compose import DEFAULT_STACK, EPHEMERAL_FRONTENDS, REPO_ROOT, ROLES, check_every_role_runs, check_shadowed_settings, load_compose
from services.http import CANNOT_LISTEN
from services.launch import LocalStack, parse_up_arguments
from services.ranks import free_port
from shared.bus import connect, pack
from shared.settings import SettingsError

pytestmark = pytest.mark.slow


async def announced_max_payload(url: str) -> int:
    async with connect(url, "test-cli") as bus:
        return bus.nc.max_payload


def test_up_demo_creates_the_tiny_model_serves_and_stops_cleanly(tmp_path: Path):
    # No frontend address settings: with --port 0 the frontends take free ports too, and the URLs printed are
    # theirs. They took the compose files' 8000 and 9464 unless MOEBUS_OPENAI_PORT / MOEBUS_METRICS_PORT were 0,
    # so a second `moebus up --port 0` on a box (a demo already running) lost its frontends.
    env = {**{k: v for k, v in os.environ.items() if k not in EPHEMERAL_FRONTENDS}, "MOEBUS_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONUNBUFFERED": "1", "MOEBUS_NATS_MAX_PAYLOAD": str(16 << 20),
           "MOEBUS_MODEL_NAME": "Qwen/Qwen3-30B-A3B"}  # a served name of vLLM's --served-model-name kind
    up = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--port", "0", "--demo", "--log-dir", str(tmp_path / "logs")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        assert up.stdout is not None
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "serving; Ctrl-C stops the stack" in line:
                break
        output = "".join(lines)
        assert "finish=length completion_tokens=24" in output, output
        assert "(model Qwen/Qwen3-30B-A3B, max_payload" in output, output  # the id requests name, not the directory's
        url = next(line.split("NATS at ")[1].split()[0] for line in lines if "NATS at " in line)
        # The hints name a `moebus` this shell can run: on PATH, else the venv's script by path (after
        # `make demo` the venv is not activated and a bare `moebus` is not found).
        for hint in [line.split("try: ")[1] for line in lines if "try: " in line] + [line[2:] for line in lines if line.startswith("$ ")]:
            command = hint.split()[0]
            assert shutil.which(command, path=env.get("PATH")) or Path(command).is_file(), hint
        assert (tmp_path / "cache" / "tiny-qwen3-moe" / "config.json").exists()
        # The NATS server took its max_payload from the environment, through the config file in the log directory.
        assert f"max_payload {16 << 20} bytes" in output and (tmp_path / "logs" / "nats-server.conf").read_text() == f"max_payload: {16 << 20}\n"
        assert asyncio.run(announced_max_payload(url)) == 16 << 20
        frontends = dict(re.findall(r"^  (openai-0|metrics-0): (http://127\.0\.0\.1:(?!8000/|9464/)\d+/\S*)$", output, re.M))
        assert frontends.keys() == {"openai-0", "metrics-0"}, output
        with urllib.request.urlopen(frontends["openai-0"] + "/models", timeout=30) as models:
            assert json.load(models)["data"][0]["id"] == "Qwen/Qwen3-30B-A3B"
        with urllib.request.urlopen(frontends["metrics-0"], timeout=30) as metrics:
            assert b"moebus_up{" in metrics.read()

        reply = subprocess.run(
            [sys.executable, "-m", "services.cli", "request", "--url", url, "--prompt", "hi", "--max-tokens", "3", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert reply.returncode == 0, reply.stderr
        body = json.loads(reply.stdout)
        assert body["type"] == "response" and len(body["token_ids"]) == 3

        bad = subprocess.run(
            [sys.executable, "-m", "services.cli", "request", "--url", url, "--prompt", "hi", "--max-tokens", "0"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert bad.returncode == 1 and "invalid_request" in bad.stderr
    finally:
        up.send_signal(signal.SIGINT)
        rest, _ = up.communicate(timeout=60)
    assert up.returncode == 0, rest
    assert "stopping" in rest
    for log in (tmp_path / "logs").glob("*-0.log"):
        assert "stopped" in log.read_text(), log  # every service drained and said so


def test_services_refuse_bad_settings_and_checkpoints_at_start_naming_them(tmp_path: Path, tiny_model: Path):
    """Each of these used to start: a traceback from deep inside a rank (ConfigError, ShardingError) or the
    gateway (TokenizerFilesError), or
    MOEBUS_DECODE_ATTENTION=sdpa, a switch README documents, refused as a typo. Now a usage error (exit 2)
    naming the setting, before any rank starts or NATS is dialled."""
    llama, no_weights = tmp_path / "llama", tmp_path / "no-weights"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({**json.loads((tiny_model / "config.json").read_text()), "architectures": ["LlamaForCausalLM"]}))
    no_weights.mkdir()
    shutil.copy(tiny_model / "config.json", no_weights)
    no_tokenizer, bad_tokenizer = tmp_path / "no-tokenizer", tmp_path / "bad-tokenizer"
    for d in (no_tokenizer, bad_tokenizer):
        d.mkdir()
        shutil.copy(tiny_model / "config.json", d)
    (bad_tokenizer / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    unreachable = {"MOEBUS_NATS_URL": "nats://127.0.0.1:1", "MOEBUS_CONNECT_TIMEOUT_S": "0.5"}
    cases = [
        (["prefill", "--model", str(tiny_model)], {"MOEBUS_PREFILL_TP": "3"}, 2, "tp=3: num_attention_heads=4 is not divisible by TP=3"),
        (["decode", "--model", str(tiny_model)], {"MOEBUS_DECODE_DP": "3"}, 2, "dp=3: num_experts=8 is not divisible by EP=3"),
        (["decode", "--model", str(tmp_path / "nothing")], {}, 2, "is not a checkpoint moebus serves: .*nothing: no such directory"),
        # vLLM downloads a Hugging Face id; moebus says it does not (it said ".../config.json: file not found").
        (["gateway", "--model", "Qwen/Qwen3-30B-A3B"], {}, 2, r"Qwen/Qwen3-30B-A3B: no such directory; moebus reads a local checkpoint "
         r"directory and downloads nothing \(vLLM fetches a Hugging Face id such as Qwen/Qwen3-30B-A3B: download it first, e.g. "
         r"`huggingface-cli download Qwen/Qwen3-30B-A3B --local-dir DIR`, and pass DIR\)"),
        (["gateway", "--model", str(llama)], {}, 2, r"architectures=\['LlamaForCausalLM'\] is not supported"),
        # The gateway tokenizes: a checkpoint without a readable tokenizer.json was a traceback after NATS was dialled.
        (["gateway", "--model", str(no_tokenizer)], {}, 2, r"cannot be served: .*no-tokenizer/tokenizer.json is missing"),
        (["gateway", "--model", str(bad_tokenizer)], {}, 2, r"cannot be served: .*bad-tokenizer/tokenizer.json is not a valid tokenizer file"),
        (["prefill", "--model", str(no_weights)], {}, 2, r"not a checkpoint moebus serves: expected model.safetensors.index.json or exactly one \*.safetensors file, found 0"),
        (["decode", "--model", str(tiny_model)], {"MOEBUS_DECODE_PAGE_SIZE": "0"}, 2, "Expected `int` >= 1 - at `\\$.page_size`"),
        # vLLM's --gpu-memory-utilization: a share of a GPU, so a CPU rank (whose pages kv_pages sets) is told so
        (["decode", "--model", str(tiny_model)], {"MOEBUS_DECODE_GPU_MEMORY_UTILIZATION": "0.9", "MOEBUS_DECODE_DEVICE": "cpu"}, 2,
         r"gpu_memory_utilization=0.9 sizes the KV cache of a GPU rank, but this instance runs on the CPU: set kv_pages instead"),
        (["prefill", "--model", str(tiny_model)], {"MOEBUS_PREFILL_GPU_MEMORY_UTILIZATION": "1.5"}, 2,
         r"Expected `float` <= 1.0 - at `\$.gpu_memory_utilization`"),
        # A check across fields named the values but not where they came from.
        (["gateway", "--model", str(tiny_model)], {"MOEBUS_GATEWAY_STAGE_EXPIRY_S": "0.1"}, 2,
         r"gateway settings: MOEBUS_GATEWAY_STAGE_EXPIRY_S='0.1': stage_expiry_s=0.1 must be at least 3 x heartbeat_interval_s=0.5"),
        (["prefill", "--model", str(tiny_model)], {"MOEBUS_PREFILL_GPUS": "[0, 1]"}, 2,
         r"prefill settings: MOEBUS_PREFILL_GPUS='\[0, 1\]': gpus \[0, 1\] lists 2 GPU\(s\) for tp=1 ranks"),
        (["scheduler"], {"MOEBUS_HEARTBEAT_INTERVAL": "2"}, 2, "MOEBUS_HEARTBEAT_INTERVAL: no service has a field"),
        (["openai", "--port", "0"], {"MOEBUS_LOG_LEVEL": "verbose"}, 2, r"openai settings: MOEBUS_LOG_LEVEL='verbose': Expected `str` matching .* at `\$\.log_level`"),
        (["openai", "--timeout-keep-alive", "0"], {}, 2, r"timeout_keep_alive_s=0.0 on the command line: Expected `float` > 0.0"),
        (["metrics", "--keep-alive-requests", "0"], {}, 2, r"keep_alive_requests=0 on the command line: Expected `int` >= 1"),
        (["openai", "--send-timeout", "0"], {}, 2, r"send_timeout_s=0.0 on the command line: Expected `float` > 0.0"),
        # A runtime switch passes the settings: this one gets as far as dialling NATS.
        (["decode", "--model", str(tiny_model)], {"MOEBUS_DECODE_ATTENTION": "sdpa", "MOEBUS_DECODE_WARMUP": "false"}, 1, "no NATS server answered"),
        # ... and a typo in one stops a model instance at start on any device (it was read only on CUDA).
        (["decode", "--model", str(tiny_model)], {"MOEBUS_DECODE_ATTENTION": "spda"}, 2, "MOEBUS_DECODE_ATTENTION='spda' is not one of kernel, sdpa"),
        (["prefill", "--model", str(tiny_model)], {"MOEBUS_KERNELS": "ref"}, 2, "MOEBUS_KERNELS='ref' is not one of auto, reference"),
        (["scheduler"], {}, 1, "moebus scheduler: no NATS server answered at nats://127.0.0.1:1 within 0.5s"),  # exit 1, no traceback either
    ]
    procs = [subprocess.Popen([sys.executable, "-m", "services.cli", *argv], env={**os.environ, **unreachable, **env},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for argv, env, _, _ in cases]
    for proc, (argv, env, code, message) in zip(procs, cases):
        output, _ = proc.communicate(timeout=120)
        assert proc.returncode == code and re.search(message, output) and "Traceback" not in output, (argv, env, output)


def test_up_reports_why_a_service_stopped_at_start_and_leaves_nothing_running(tmp_path: Path, tiny_model: Path):
    log_dir = tmp_path / "logs"
    up = subprocess.run([sys.executable, "-m", "services.cli", "up", "--port", "0", "--model", str(tiny_model), "--log-dir", str(log_dir)],
                        env={**os.environ, "PREFILL_TP": "3"}, capture_output=True, text=True, timeout=180)
    assert up.returncode == 1, up.stdout + up.stderr
    # Not only "exited with 2; see <log>": the reason, from the log's last line (what only the service can
    # tell: its settings are read before anything starts, test_up_refuses_bad_settings_before_starting_anything).
    assert re.search(r"prefill-0 exited with 2: moebus prefill: error: model .* cannot be split over this instance's ranks: tp=3: "
                     r"num_attention_heads=4 is not divisible by TP=3", up.stderr), up.stderr
    assert subprocess.run(["pgrep", "-f", str(log_dir)], capture_output=True).returncode == 1  # nats-server (its -c path) is gone


def up_refused(log_dir: Path, model: Path, env: dict[str, str], *flags: str) -> str:
    """`moebus up ...flags` with ``env`` added to this environment, refused before it started anything (exit 2,
    no log directory made): its stderr."""
    up = subprocess.run([sys.executable, "-m", "services.cli", "up", "--port", "0", "--model", str(model), "--log-dir", str(log_dir), *flags],
                        env={**os.environ, **env}, capture_output=True, text=True, timeout=180)
    assert up.returncode == 2, up.stdout + up.stderr
    assert not log_dir.exists()  # nothing was started
    return up.stderr


def test_up_refuses_bad_settings_before_starting_anything(tmp_path: Path, tiny_model: Path):
    """A bad MOEBUS_* value was found only by a service: `moebus up` started nats-server and every replica,
    reported the one that exited 2, stopped the others and exited 1 (a --config file was checked at once,
    exit 2). The settings of each service are now read first, from the environment its replicas get."""
    refused = up_refused(tmp_path / "logs", tiny_model, {"MOEBUS_DECODE_KV_PAGES": "0"})
    assert "moebus up: decode settings: MOEBUS_DECODE_KV_PAGES='0': Expected `int` >= 1 - at `$.kv_pages`" in refused, refused


def test_up_refuses_gpu_memory_shares_that_overfill_a_gpu(tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch):
    """vLLM's --gpu-memory-utilization is per instance: one MOEBUS_GPU_MEMORY_UTILIZATION=0.9 for the whole stack gives
    prefill and decode, whose rank 0 both take GPU 0 under `moebus up`, 0.9 each. The second to size its KV cache
    would find the GPU full (or both, sizing at once, run out of memory later): refused before anything starts."""
    refused = up_refused(tmp_path / "logs", tiny_model, {"MOEBUS_GPU_MEMORY_UTILIZATION": "0.9"})
    assert ("moebus up: GPU 0 would hold ranks of prefill (0.9), decode (0.9): their gpu_memory_utilization add up to 1.8, "
            "more than the GPU; give each a smaller share, or its own GPUs (gpus)") in refused, refused
    # Shares that fit, or the services on GPUs of their own, pass; two decode ranks each take their own GPU.
    for env in ({"MOEBUS_GPU_MEMORY_UTILIZATION": "0.45"},
                {"MOEBUS_GPU_MEMORY_UTILIZATION": "0.9", "DECODE_DP": "2", "MOEBUS_DECODE_GPUS": "[1, 2]"}):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        LocalStack(load_compose(DEFAULT_STACK, dict(os.environ)), tiny_model, tmp_path / "logs").check_settings()
    monkeypatch.setenv("MOEBUS_DECODE_GPUS", "[0, 1]")  # decode rank 0 back on prefill's GPU
    with pytest.raises(SettingsError, match=r"GPU 0 would hold ranks of prefill \(0.9\), decode \(0.9\)"):
        LocalStack(load_compose(DEFAULT_STACK, dict(os.environ)), tiny_model, tmp_path / "logs").check_settings()


def test_up_takes_a_queue_wait_past_the_gateways_submit_timeout(tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch):
    """`moebus up` refused a scheduler.queue_wait_ms that did not end before gateway.submit_timeout_s: the gateway
    read only the scheduler's first answer, the final one. A request that waits is now answered `queued_by` at once
    and the gateway waits for the final answer until the request's deadline: any wait goes (DESIGN §2, sched.submit)."""
    monkeypatch.setenv("MOEBUS_SCHEDULER_QUEUE_WAIT_MS", "20000")
    LocalStack(load_compose(DEFAULT_STACK, dict(os.environ)), tiny_model, tmp_path / "logs").check_settings()


def test_up_refuses_a_role_without_a_replica(tmp_path: Path, tiny_model: Path):
    """`moebus up --scale gateway=0` started the rest and waited out --ready-timeout (llm.models never answers
    without a gateway); a stack without a decode (or prefill, scheduler) instance cannot answer a request either.
    Refused at once, whether the 0 comes from --scale or from the compose file (split-nodes.yml's
    PREFILL_REPLICAS). A frontend is no role a request needs: `--scale openai=0` passes the check."""
    log_dir = tmp_path / "logs"
    # --ready-timeout 30: without the check, the gateway=0 stack fails (exit 1) after 30 s instead of 300.
    refused = up_refused(log_dir, tiny_model, {}, "--scale", "gateway=0", "--scale", "decode=0", "--ready-timeout", "30")
    assert ("moebus up: no gateway would run (--scale gateway=0); no decode would run (--scale decode=0): a request needs a gateway, a scheduler,"
            " a prefill and a decode instance; give each role a replica") in refused, refused
    split = REPO_ROOT / "compose" / "split-nodes.yml"
    refused = up_refused(log_dir, tiny_model, {"PREFILL_REPLICAS": "0"}, "--stack", str(split), "--ready-timeout", "30")
    assert f"moebus up: no prefill would run (prefill: replicas 0 in {split})" in refused, refused
    # A literal 0 in the file, not interpolated: it was read as 1 (`or 1`), and the stack started without the check.
    literal = tmp_path / "literal-zero.yml"
    literal.write_text(DEFAULT_STACK.read_text().replace("replicas: 1", "replicas: 0"))
    assert {s.name: s.replicas for s in load_compose(literal, {}) if s.role in ROLES} == dict.fromkeys(ROLES, 0)
    refused = up_refused(log_dir, tiny_model, {}, "--stack", str(literal), "--ready-timeout", "30")
    assert f"moebus up: no gateway would run (gateway: replicas 0 in {literal}); no scheduler would run" in refused, refused
    check_every_role_runs(load_compose(DEFAULT_STACK, {}, {"openai": 0, "metrics": 0}), DEFAULT_STACK, {"openai": 0, "metrics": 0})


def test_up_names_a_cache_or_log_directory_it_cannot_create(tmp_path: Path, tiny_model: Path):
    """A MOEBUS_CACHE_DIR or --log-dir that cannot be a directory (under a file here; a read-only home in a
    container alike) ended `moebus up` with a Python traceback."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    demo = subprocess.run([sys.executable, "-m", "services.cli", "up", "--port", "0"], env={**os.environ, "MOEBUS_CACHE_DIR": str(a_file / "cache")},
                          capture_output=True, text=True, timeout=60)
    assert demo.returncode == 2 and "Traceback" not in demo.stderr, demo.stderr
    assert f"moebus up: cannot write the demo model into the cache directory {a_file / 'cache'}: Not a directory" in demo.stderr, demo.stderr
    logs = subprocess.run([sys.executable, "-m", "services.cli", "up", "--port", "0", "--model", str(tiny_model), "--log-dir", str(a_file / "logs")],
                          capture_output=True, text=True, timeout=60)
    assert logs.returncode == 1 and "Traceback" not in logs.stderr, logs.stderr
    assert f"moebus up: cannot create the log directory {a_file / 'logs'}: Not a directory" in logs.stderr, logs.stderr


def _kill_if_running(up: subprocess.Popen) -> None:
    """Kill a `moebus up` that a failed check left running, and reap it."""
    if up.poll() is None:
        up.kill()
        up.wait()


def _up_with_a_scheduler_only(tmp_path: Path, tiny_model: Path, stderr: int, *flags: str) -> tuple[subprocess.Popen, Path]:
    """`moebus up` of a stack of one scheduler (no gateway: llm.models never answers, so it never gets
    ready), once the scheduler has started; (the `moebus up` process, its log directory)."""
    compose = tmp_path / "scheduler-only.yml"
    compose.write_text('services:\n  scheduler:\n    command: ["moebus", "scheduler"]\n')
    log_dir = tmp_path / "logs"
    up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--port", "0", "--stack", str(compose), "--model", str(tiny_model),
                           "--log-dir", str(log_dir), "--ready-timeout", "90", *flags], stdout=subprocess.PIPE, stderr=stderr, text=True)
    deadline = time.monotonic() + 60
    while "scheduler_ready" not in ((log_dir / "scheduler-0.log").read_text() if (log_dir / "scheduler-0.log").exists() else ""):
        if time.monotonic() > deadline or up.poll() is not None:
            _kill_if_running(up)
            raise AssertionError("the scheduler did not start")
        time.sleep(0.1)
    return up, log_dir


def _scheduler_pid(up: subprocess.Popen) -> int:
    """The process id of the one scheduler replica of the `moebus up` process ``up``."""
    scheduler = subprocess.run(["pgrep", "-P", str(up.pid), "-f", "services.cli scheduler"], capture_output=True, text=True).stdout.split()
    assert len(scheduler) == 1, scheduler
    return int(scheduler[0])


def test_up_logs_its_own_connections_as_the_other_tools_do(tmp_path: Path, tiny_model: Path):
    """`moebus up`'s own NATS connections (its readiness check, --demo's request) logged through an unconfigured
    structlog: with its nats-server gone, a `nats_error` warning per reconnect attempt went to stdout among its
    progress lines. They log as `moebus status` and `moebus request` do now: errors only, on stderr."""
    up, _ = _up_with_a_scheduler_only(tmp_path, tiny_model, subprocess.PIPE)
    try:
        nats = subprocess.run(["pgrep", "-P", str(up.pid), "-x", "nats-server"], capture_output=True, text=True).stdout.split()
        assert len(nats) == 1, nats
        os.kill(int(nats[0]), signal.SIGKILL)  # the readiness check, waiting for llm.models, reconnects
        time.sleep(3)  # a few reconnect attempts
        up.send_signal(signal.SIGTERM)
        out, err = up.communicate(timeout=120)
    finally:
        _kill_if_running(up)
    assert up.returncode == 0, out + err
    assert [line for line in out.splitlines() if not line.startswith("moebus up: ")] == [], out  # its progress lines only
    assert "stop requested before the stack was ready" in out and "nats_error" not in err, (out, err)


def _up_serving(compose: Path, model: Path, log_dir: Path) -> subprocess.Popen:
    """`moebus up` of the stack ``compose`` (stdout and stderr piped), once it serves."""
    up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--port", "0", "--stack", str(compose), "--model", str(model),
                           "--log-dir", str(log_dir), "--ready-timeout", "120"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while "serving; Ctrl-C" not in up.stdout.readline():  # type: ignore[union-attr]
        if time.monotonic() > deadline or up.poll() is not None:
            _kill_if_running(up)
            raise AssertionError("the stack did not get ready")
    return up


def test_up_restarts_a_killed_service_under_restart_on_failure(tmp_path: Path, tiny_model: Path):
    """compose's `restart: on-failure` (the repository's compose files set it): a replica killed while the
    stack serves is started again, as the same instance, after a backoff; without it (`restart: no`,
    test_up_names_the_signal_that_killed_a_service) it stays gone. `moebus up` restarted nothing before."""
    compose = tmp_path / "restarting.yml"
    compose.write_text('services:\n'
                       '  gateway:\n    command: ["moebus", "gateway"]\n    restart: on-failure\n'
                       '  scheduler:\n    command: ["moebus", "scheduler"]\n    restart: on-failure\n'
                       '  prefill:\n    command: ["moebus", "prefill"]\n'
                       '  decode:\n    command: ["moebus", "decode"]\n')
    log_dir = tmp_path / "serving"
    up = _up_serving(compose, tiny_model, log_dir)
    try:

        def kill_the_scheduler_until_it_is_back(times_ready: int) -> None:
            before = subprocess.run(["pgrep", "-P", str(up.pid), "-f", "services.cli scheduler"], capture_output=True, text=True).stdout.split()
            assert len(before) == 1, before
            os.kill(int(before[0]), signal.SIGKILL)
            deadline = time.monotonic() + 30
            while (log_dir / "scheduler-0.log").read_text().count("scheduler_ready") < times_ready:
                assert time.monotonic() < deadline and up.poll() is None, "the scheduler was not started again"
                time.sleep(0.1)
            after = subprocess.run(["pgrep", "-P", str(up.pid), "-f", "services.cli scheduler"], capture_output=True, text=True).stdout.split()
            assert len(after) == 1 and after != before, (before, after)

        kill_the_scheduler_until_it_is_back(2)  # after 1 s
        kill_the_scheduler_until_it_is_back(3)  # at once again: after 2 s
        time.sleep(10.5)  # a replica that ran 10 s is back to the first delay
        kill_the_scheduler_until_it_is_back(4)
        up.send_signal(signal.SIGTERM)
        _, err = up.communicate(timeout=60)
    finally:
        _kill_if_running(up)
    assert up.returncode == 0, err
    assert err.count("scheduler-0 was killed by SIGKILL") == 3, err
    delays = re.findall(r"restarting scheduler-0 in (\S+) \(restart: on-failure\)", err)
    assert delays == ["1s", "2s", "1s"], err


def test_up_hands_its_config_file_to_every_service_and_refuses_a_bad_one_at_once(tmp_path: Path, tiny_model: Path):
    """`moebus up --config FILE`: a file no service could start with is named before anything starts;
    a good one reaches the services (as MOEBUS_CONFIG). `moebus up` had no such flag."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[scheduler]\nmax_queud = 3\n")
    refused = subprocess.run([sys.executable, "-m", "services.cli", "up", "--port", "0", "--model", str(tiny_model), "--config", str(bad),
                              "--log-dir", str(tmp_path / "refused")], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "unknown key(s) in [scheduler]: max_queud" in refused.stderr, refused.stderr
    assert not (tmp_path / "refused").exists()  # nothing was started
    across = tmp_path / "across.toml"  # a check across fields names every source it read them from
    across.write_text("heartbeat_interval_s = 1\n[gateway]\nstage_expiry_s = 2.5\n")
    refused = subprocess.run([sys.executable, "-m", "services.cli", "up", "--port", "0", "--model", str(tiny_model), "--config", str(across),
                              "--log-dir", str(tmp_path / "refused")], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and (f"gateway settings: heartbeat_interval_s = 1 in config file {across}; stage_expiry_s = 2.5 in [gateway] of"
                                        f" config file {across}: stage_expiry_s=2.5 must be at least") in refused.stderr, refused.stderr
    assert not (tmp_path / "refused").exists()
    good = tmp_path / "good.toml"
    good.write_text("[scheduler]\nlog_json = false\n")  # its log, a file, would be JSON lines by default
    up, log_dir = _up_with_a_scheduler_only(tmp_path, tiny_model, subprocess.STDOUT, "--config", str(good))
    try:
        log = (log_dir / "scheduler-0.log").read_text()
        assert "scheduler_ready" in log and not log.startswith("{"), log
    finally:
        up.send_signal(signal.SIGTERM)
        up.communicate(timeout=60)


def _stop_timed(up: subprocess.Popen, sig: int) -> tuple[str, float]:
    """Send ``sig`` to the `moebus up` process ``up`` and wait until it exits (killed if it does not within
    120 s): the rest of its output, and the seconds it took."""
    try:
        up.send_signal(sig)
        asked = time.monotonic()
        output, _ = up.communicate(timeout=120)
        return output, time.monotonic() - asked
    finally:
        _kill_if_running(up)


def test_up_stops_when_asked_before_the_stack_is_ready(tmp_path: Path, tiny_model: Path):
    """SIGTERM (or Ctrl-C) while the stack starts (a large checkpoint loads for minutes) stops it then;
    it used to be noticed only once the stack was ready, or after --ready-timeout."""
    up, log_dir = _up_with_a_scheduler_only(tmp_path, tiny_model, subprocess.STDOUT)
    output, took = _stop_timed(up, signal.SIGTERM)
    assert up.returncode == 0 and "stop requested before the stack was ready" in output and "ready." not in output, output
    assert took < 20, f"moebus up stopped {took:.0f}s after SIGTERM"
    assert "scheduler_stopped" in (log_dir / "scheduler-0.log").read_text()  # drained, not killed
    assert subprocess.run(["pgrep", "-f", str(log_dir)], capture_output=True).returncode == 1  # nats-server is gone


def test_up_stopped_again_while_it_drains_kills_what_still_drains(tmp_path: Path, tiny_model: Path):
    """A second Ctrl-C while `moebus up` drained was ignored: a service that does not finish draining (stopped
    here, SIGSTOP; a long request in a real stack) held it for the whole 30 s drain timeout. The second stop
    request now kills what still drains at once, says so, and leaves nothing running."""
    up, log_dir = _up_with_a_scheduler_only(tmp_path, tiny_model, subprocess.STDOUT)
    scheduler = None
    try:
        scheduler = _scheduler_pid(up)
        os.kill(scheduler, signal.SIGSTOP)  # SIGTERM stays pending: it cannot drain
        up.send_signal(signal.SIGINT)
        assert up.stdout is not None
        lines = [up.stdout.readline()]
        while lines[-1] and "moebus up: stopping" not in lines[-1]:
            lines.append(up.stdout.readline())
        assert "Ctrl-C again kills what still drains" in lines[-1], lines
        output, took = _stop_timed(up, signal.SIGINT)
    finally:
        _kill_if_running(up)
        if scheduler is not None:  # after a failed check, not left stopped: it takes the SIGTERM its parent's death sent
            with contextlib.suppress(ProcessLookupError):
                os.kill(scheduler, signal.SIGCONT)
    assert up.returncode == 0 and "moebus up: killed scheduler-0 (stop asked again)" in output, output
    assert took < 10, f"moebus up stopped {took:.0f}s after the second SIGINT"
    assert not Path(f"/proc/{scheduler}").exists()  # killed and reaped
    assert subprocess.run(["pgrep", "-f", str(log_dir)], capture_output=True).returncode == 1  # nats-server is gone


@pytest.mark.parametrize("group", [True, False], ids=["ctrl-c-in-a-terminal", "sigterm"])
def test_up_stopped_while_it_writes_the_demo_model_leaves_nothing_behind(tmp_path: Path, group: bool):
    """The first `make demo` writes the demo checkpoint (seconds on a small box) before it starts anything.
    A Ctrl-C then (SIGINT to the terminal's process group) printed two KeyboardInterrupt tracebacks, the
    launcher's and `moebus make-tiny`'s, and left the half-written tiny-* directory in the cache; a SIGTERM
    killed the launcher at once and left make-tiny running on, orphaned, to leave its directory there too."""
    cache = tmp_path / "cache"
    up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--port", "0"], env={**os.environ, "MOEBUS_CACHE_DIR": str(cache)},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a shell starts a foreground job
    try:
        deadline = time.monotonic() + 30
        while subprocess.run(["pgrep", "-f", f"make-tiny --out {cache}"], capture_output=True).returncode != 0:
            assert time.monotonic() < deadline and up.poll() is None, "moebus up did not start writing the demo model"
            time.sleep(0.05)
        if group:
            os.killpg(up.pid, signal.SIGINT)
        else:
            up.send_signal(signal.SIGTERM)
        output, _ = up.communicate(timeout=30)
    finally:
        _kill_if_running(up)
    assert up.returncode == 0 and "Traceback" not in output and "stop requested before the stack was ready" in output, output
    deadline = time.monotonic() + 10  # an orphaned make-tiny would go on writing for seconds
    while subprocess.run(["pgrep", "-f", f"make-tiny --out {cache}"], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "make-tiny is still running"
        time.sleep(0.1)
    assert list(cache.iterdir()) == [], list(cache.iterdir())  # no half-written checkpoint


def test_up_names_the_signal_that_killed_a_service(tmp_path: Path, tiny_model: Path):
    """A replica killed by a signal (kill -9, the OOM killer) was reported as 'exited with -9: <its last
    log line>', a line that says nothing about why it ended (e.g. its decode_ready event)."""
    up, log_dir = _up_with_a_scheduler_only(tmp_path, tiny_model, subprocess.PIPE)
    try:
        os.kill(_scheduler_pid(up), signal.SIGKILL)
        _, err = up.communicate(timeout=60)
    finally:
        _kill_if_running(up)
    assert up.returncode == 1, err
    assert f"moebus up: scheduler-0 was killed by SIGKILL; see {log_dir / 'scheduler-0.log'}" in err, err


def test_up_refuses_a_nats_port_in_use_instead_of_joining_that_bus(tmp_path: Path, tiny_model: Path,
                                                                    nats_server: tuple[int, list[subprocess.Popen[bytes]]]):
    """A second `moebus up` on the port of a running stack's nats-server (both on the default 4222): its own
    nats-server exited (address in use), the readiness probe reached the other one, and the services joined
    that stack's bus under the same instance names."""
    port, _ = nats_server
    log_dir = tmp_path / "logs"
    up = subprocess.run([sys.executable, "-m", "services.cli", "up", "--port", str(port), "--model", str(tiny_model), "--log-dir", str(log_dir)],
                        capture_output=True, text=True, timeout=120)
    assert up.returncode == 1, up.stdout + up.stderr
    assert f"cannot start nats-server on 127.0.0.1:{port}: Address already in use (another `moebus up`? --port 0 picks a free port)" in up.stderr, up.stderr
    assert not log_dir.exists()  # no service was started, and no run directory (holding only nats-server.conf) was left


def listener(port: int = 0) -> socket.socket:
    """A plain socket listening on 127.0.0.1:``port`` (0: a free one), as another program would (vLLM on 8000)."""
    holder = socket.socket()
    try:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the frontends bind: still no second listener
        holder.bind(("127.0.0.1", port))
        holder.listen()
    except OSError:
        holder.close()
        raise
    return holder


def port_in_use(frontend: str, port: int) -> str:
    """The line a frontend writes when another process listens on its port."""
    return (f"moebus {frontend}: cannot listen on 127.0.0.1:{port}: Address already in use; another process listens there "
            f"(`ss -ltnp 'sport = :{port}'` names it): free the port, or set MOEBUS_{frontend.upper()}_PORT=N (0: any free port; "
            f"`moebus {frontend} --port N` when run alone); `moebus up --port 0` puts NATS and every frontend whose port is not set on free ports")


def test_a_frontend_on_a_taken_port_exits_with_one_line_saying_what_to_do(nats_server: tuple[int, list[subprocess.Popen[bytes]]]):
    """`moebus openai` / `moebus metrics` alone on a port another process listens on: one line naming the address and
    what to do, and the exit status `moebus up` tells from others (`CANNOT_LISTEN`: it was 1, as for NATS out of reach)."""
    url = f"nats://127.0.0.1:{nats_server[0]}"
    with listener() as holder:
        taken = holder.getsockname()[1]
        for frontend in ("openai", "metrics"):
            alone = subprocess.run([sys.executable, "-m", "services.cli", frontend, "--url", url, "--host", "127.0.0.1", "--port", str(taken)],
                                   capture_output=True, text=True, timeout=60)
            assert (alone.returncode, alone.stderr.splitlines()) == (CANNOT_LISTEN, [port_in_use(frontend, taken)]), (alone.returncode, alone.stderr)


def test_up_with_a_frontend_port_taken_is_not_ready_and_stops_what_it_started(tmp_path: Path, tiny_model: Path):
    """Something else on a frontend's port (vLLM on 8000, another stack's `moebus metrics` on 9464): `moebus up` said
    "ready" and restarted that frontend every 1, 2, 4 ... 30 s, its port answered by the other process. Now the start
    fails naming the replica, the address and what to do, and nothing of the stack is left running."""
    log_dir = tmp_path / "logs"
    with listener() as holder:
        taken = holder.getsockname()[1]
        up = subprocess.run([sys.executable, "-m", "services.cli", "up", "--port", "0", "--model", str(tiny_model), "--log-dir", str(log_dir)],
                            env={**os.environ, "MOEBUS_METRICS_PORT": str(taken)}, capture_output=True, text=True, timeout=120)
    assert up.returncode == 1 and "ready" not in up.stdout, up.stdout + up.stderr
    assert f"moebus up: metrics-0 exited with {CANNOT_LISTEN}: {port_in_use('metrics', taken)}; see {log_dir / 'metrics-0.log'}" in up.stderr, up.stderr
    assert "restarting" not in up.stderr, up.stderr
    assert subprocess.run(["pgrep", "-f", str(log_dir)], capture_output=True).returncode == 1  # nats-server (its -c path) is gone
    assert not [line for line in up.stderr.splitlines() if "Traceback" in line], up.stderr


def test_up_does_not_restart_a_frontend_whose_port_was_taken_while_it_was_down(tmp_path: Path, tiny_model: Path):
    """A frontend under `restart: on-failure` that ends while the stack serves (killed here) and finds its port taken
    when started again: restarting it every 30 s cannot help while the other process holds the port. It is reported
    once, not restarted, and the rest of the stack serves on."""
    port = free_port()
    compose = tmp_path / "metrics-on-a-port.yml"
    compose.write_text('services:\n' + ''.join(f'  {role}:\n    command: ["moebus", "{role}"]\n' for role in ROLES)
                       + f'  metrics:\n    command: ["moebus", "metrics"]\n    restart: on-failure\n'
                         f'    environment:\n      MOEBUS_METRICS_PORT: "{port}"\n')
    log_dir = tmp_path / "logs"
    up = _up_serving(compose, tiny_model, log_dir)
    try:
        metrics = subprocess.run(["pgrep", "-P", str(up.pid), "-f", "services.cli metrics"], capture_output=True, text=True).stdout.split()
        assert len(metrics) == 1, metrics
        os.kill(int(metrics[0]), signal.SIGKILL)
        deadline = time.monotonic() + 0.9  # `moebus up` starts it again 1 s after it notices
        while True:
            try:
                holder = listener(port)
                break
            except OSError:  # not closed yet: the killed process is still being torn down
                assert time.monotonic() < deadline, "the killed frontend's port stayed taken"
                time.sleep(0.01)
        with holder:
            deadline = time.monotonic() + 30
            while "cannot listen" not in (log_dir / "metrics-0.log").read_text():
                assert time.monotonic() < deadline, "metrics-0 was not started again"
                time.sleep(0.1)
            time.sleep(4)  # a restart would come 2 s after the failed one
            assert up.poll() is None, "the stack stopped"
            up.send_signal(signal.SIGTERM)
            _, err = up.communicate(timeout=60)
    finally:
        _kill_if_running(up)
    assert up.returncode == 0, err
    assert err.count("moebus up: restarting metrics-0") == 1 and "metrics-0 was killed by SIGKILL" in err, err  # the kill's restart only
    assert f"moebus up: metrics-0 exited with {CANNOT_LISTEN}: {port_in_use('metrics', port)}; see {log_dir / 'metrics-0.log'}" in err, err
    assert ("moebus up: not restarting metrics-0 (restart: on-failure): it cannot listen until its port is freed; the rest of the stack "
            "serves on (restart the stack to bring it back)") in err, err


def test_model_instances_find_a_wrong_nats_url_before_loading_the_model(tiny_model: Path):
    """A prefill or decode instance loaded and warmed up its checkpoint (minutes for a large one) before
    dialling NATS; with a wrong URL it only failed then, with a traceback."""
    env = {**os.environ, "MOEBUS_NATS_URL": "nats://127.0.0.1:1", "MOEBUS_CONNECT_TIMEOUT_S": "0.5", "MOEBUS_LOG_JSON": "true"}
    procs = [subprocess.Popen([sys.executable, "-m", "services.cli", role, "--model", str(tiny_model)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for role in ("prefill", "decode")]
    for role, proc in zip(("prefill", "decode"), procs):
        output, _ = proc.communicate(timeout=120)
        events = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
        assert proc.returncode == 1 and "Traceback" not in output, output
        assert output.splitlines()[-1] == f"moebus {role}: no NATS server answered at nats://127.0.0.1:1 within 0.5s", output
        assert not [e for e in events if e["event"] == "model_loaded"], output


def test_up_refuses_a_setting_the_compose_file_would_silently_override(tmp_path: Path, tiny_model: Path):
    """`MOEBUS_DECODE_MAX_BATCH=64 moebus up` (the README's example variable) ran decode at 32: the compose
    file's `MOEBUS_DECODE_MAX_BATCH: ${DECODE_MAX_BATCH:-32}` won over the caller's environment, silently."""
    log_dir = tmp_path / "logs"
    up = subprocess.run([sys.executable, "-m", "services.cli", "up", "--port", "0", "--model", str(tiny_model), "--log-dir", str(log_dir)],
                        env={**os.environ, "MOEBUS_DECODE_MAX_BATCH": "64", "MOEBUS_LOG_JSON": "false"},
                        capture_output=True, text=True, timeout=60)
    assert up.returncode == 2, up.stdout + up.stderr
    assert "MOEBUS_DECODE_MAX_BATCH=64 is in your environment" in up.stderr and "set DECODE_MAX_BATCH=64 instead" in up.stderr, up.stderr
    assert "MOEBUS_LOG_JSON=false" in up.stderr and "to change it" in up.stderr, up.stderr  # a literal of the file: no knob
    assert not log_dir.exists() or not list(log_dir.glob("*.log"))  # nothing was started


def test_up_takes_the_compose_knobs_and_moebus_model_from_the_environment(tiny_model: Path, monkeypatch: pytest.MonkeyPatch):
    env = {"DECODE_MAX_BATCH": "64", "MOEBUS_DECODE_MAX_BATCH": "64", "MOEBUS_SCHEDULER_QUEUE_WAIT_MS": "50"}
    specs = load_compose(DEFAULT_STACK, env)
    check_shadowed_settings(specs, env, DEFAULT_STACK)  # the same value through the file's knob: accepted
    assert next(s for s in specs if s.name == "decode").env["MOEBUS_DECODE_MAX_BATCH"] == "64"
    monkeypatch.setenv("MOEBUS_MODEL", str(tiny_model))  # `moebus up` served the embedded tiny model instead
    assert parse_up_arguments([]).model == str(tiny_model) and parse_up_arguments(["--model", "/x"]).model == "/x"


def test_status_and_request_look_at_the_stack_moebus_nats_url_names(nats_server: tuple[int, list[subprocess.Popen[bytes]]]):
    """With MOEBUS_NATS_URL exported (what every service and frontend of the stack reads), `moebus status` and
    `moebus request` without --url went to nats://127.0.0.1:4222 all the same: on a box where another stack
    serves there (a second `moebus up --port 0`), they reported on and sent to that other stack."""
    port, _ = nats_server
    env = {**os.environ, "MOEBUS_NATS_URL": f"nats://127.0.0.1:{port}"}
    scheduler = subprocess.Popen([sys.executable, "-m", "services.cli", "scheduler"], env={**env, "MOEBUS_INSTANCE": "scheduler-of-this-url"},
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            status = subprocess.run([sys.executable, "-m", "services.cli", "status"], env=env, capture_output=True, text=True, timeout=60)
            if "scheduler-of-this-url" in status.stdout:
                break
            assert time.monotonic() < deadline, status.stdout + status.stderr
        # A scheduler alone: listed, and the roles a request needs besides are named (test_status_names_a_role_without_a_serving_process).
        assert status.returncode == 1 and "no serving gateway, prefill, decode heard" in status.stderr, status.stderr
        # No gateway on this server: the request reached it, and nobody answers llm.generate there.
        request = subprocess.run([sys.executable, "-m", "services.cli", "request", "--prompt", "hi"], env=env, capture_output=True, text=True, timeout=60)
        assert request.returncode == 1 and "no responder on llm.generate" in request.stderr, request.stderr
    finally:
        scheduler.terminate()
        scheduler.wait(30)


def heartbeat(role: str, instance: str, draining: bool = False, model: str = "tiny") -> Heartbeat:
    """The heartbeat of rank 0 of ``instance``, as a process of ``role`` serving ``model`` that started now sends it."""
    return Heartbeat(role=role, instance=instance, rank=0, model=model, version="0.1", started_at=time.time(), draining=draining)


def beat_while_running(status: subprocess.Popen, url: str, heartbeats: list[Heartbeat], timeout: float = 60.0) -> None:
    """Publish ``heartbeats`` on ``url`` every 0.2 s, as the processes they describe would, until ``status``
    (a `moebus status` listening there) has exited."""
    async def beat() -> None:
        async with connect(url, "test-status") as bus:
            deadline = time.monotonic() + timeout
            while status.poll() is None:
                assert time.monotonic() < deadline, "moebus status did not exit"
                for hb in heartbeats:
                    await bus.publish(subjects.heartbeat(hb.role, hb.instance, hb.rank), pack(hb))
                await asyncio.sleep(0.2)

    asyncio.run(beat())


def status_while_beating(url: str, heartbeats: list[Heartbeat], *flags: str) -> tuple[int, str, str]:
    """`moebus status --url URL --wait 1 ...flags` while ``heartbeats`` are published there: its exit status, stdout, stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "status", "--url", url, "--wait", "1", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    beat_while_running(proc, url, heartbeats)
    out, err = proc.communicate(timeout=30)
    return proc.returncode, out, err


def test_status_into_a_reader_that_stops_early_exits_quietly(nats_server: tuple[int, list[subprocess.Popen[bytes]]]):
    """`moebus status | head -1`: printing into the closed pipe was a BrokenPipeError traceback."""
    port, _ = nats_server
    url = f"nats://127.0.0.1:{port}"
    status = subprocess.Popen([sys.executable, "-m", "services.cli", "status", "--url", url, "--wait", "1.5"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    status.stdout.close()  # the reader is gone before the first line
    # Processes for it to list, more than one pipe buffer's worth of lines.
    beat_while_running(status, url, [heartbeat("decode", f"decode-{i}") for i in range(200)])
    err = status.stderr.read()
    assert status.wait(timeout=30) == 128 + signal.SIGPIPE, err
    assert "Traceback" not in err and "Exception ignored" not in err, err


def test_status_names_a_role_without_a_serving_process(nats_server: tuple[int, list[subprocess.Popen[bytes]]]):
    """A stack without a decode instance, its prefill draining: `moebus status` listed what it heard and exited
    0, as of a stack that serves, though no request could be answered. It now names the roles missing on stderr
    below the listing and exits 1, as when nothing at all is heard; a stack with all four serving exits 0."""
    port, _ = nats_server
    url = f"nats://127.0.0.1:{port}"
    partial = [heartbeat("gateway", "gateway-0"), heartbeat("scheduler", "scheduler-0"), heartbeat("prefill", "prefill-0", draining=True)]
    warning = f"moebus status: no serving prefill (only draining ones), decode heard on {url} within 1.0s: the stack cannot answer requests\n"
    code, out, err = status_while_beating(url, partial)
    assert (code, err) == (1, warning) and [line.split()[1] for line in out.splitlines()] == ["gateway-0", "scheduler-0", "prefill-0"], (code, out, err)
    code, out, err = status_while_beating(url, partial, "--json")
    assert (code, err) == (1, warning) and [json.loads(line)["instance"] for line in out.splitlines()] == ["gateway-0", "scheduler-0", "prefill-0"], out
    code, out, err = status_while_beating(url, [*partial[:2], heartbeat("prefill", "prefill-0"), heartbeat("decode", "decode-0")])
    assert (code, err) == (0, "") and "decode-0" in out, (code, out, err)


def test_status_names_per_model_a_role_without_a_serving_process(nats_server: tuple[int, list[subprocess.Popen[bytes]]]):
    """A bus serving two models, decode for one of them only: `moebus status` checked the roles over the whole
    bus and exited 0, though every request for the other model fails. It now names, per model, the roles that
    no process of that model serves (a scheduler that names no model serves both), in text and --json alike."""
    port, _ = nats_server
    url = f"nats://127.0.0.1:{port}"
    two = [heartbeat("gateway", "gateway-a"), heartbeat("gateway", "gateway-b", model="tiny-b"), heartbeat("scheduler", "scheduler-0", model=""),
           heartbeat("prefill", "prefill-a"), heartbeat("prefill", "prefill-b", model="tiny-b"), heartbeat("decode", "decode-a")]
    no_decode_b = f"moebus status: no serving decode of model tiny-b heard on {url} within 1.0s: the stack cannot answer requests for tiny-b\n"
    code, out, err = status_while_beating(url, two)
    listed = [line.split()[1] for line in out.splitlines() if line.split()[0] in ROLES]
    assert (code, err) == (1, no_decode_b) and listed == ["gateway-a", "gateway-b", "scheduler-0", "prefill-a", "prefill-b", "decode-a"], (code, out, err)
    code, out, err = status_while_beating(url, two, "--json")
    assert (code, err) == (1, no_decode_b) and {json.loads(line)["model"] for line in out.splitlines()} == {"tiny", "tiny-b", ""}, (code, out, err)
    # Each model lacking a role gets its line, in the order of their names.
    draining = [heartbeat("gateway", "gateway-a", draining=True), *two[1:], heartbeat("decode", "decode-b", draining=True, model="tiny-b")]
    code, out, err = status_while_beating(url, draining)
    assert (code, err.splitlines()) == (1, [
        f"moebus status: no serving gateway (only draining ones) of model tiny heard on {url} within 1.0s: the stack cannot answer requests for tiny",
        f"moebus status: no serving decode (only draining ones) of model tiny-b heard on {url} within 1.0s: the stack cannot answer requests for tiny-b",
    ]), (code, out, err)
    code, out, err = status_while_beating(url, [*two, heartbeat("decode", "decode-b", model="tiny-b")])
    assert (code, err) == (0, ""), (code, out, err)


def test_status_counts_a_prefill_instance_by_its_leader_as_the_frontends_health_does():
    """A prefill instance takes tasks through its leader (rank 0): heard only from its other ranks, it serves
    nothing. `moebus status` counted any rank and called such a stack complete while the frontend's /health
    (the same `takes_new_work` now) said prefill was missing."""
    from services.openai.readiness import StackReadiness
    from services.status import missing_roles

    follower = msgspec.structs.replace(heartbeat("prefill", "prefill-0"), rank=1)
    stack = [heartbeat("gateway", "gateway-0"), heartbeat("scheduler", "scheduler-0"), follower, heartbeat("decode", "decode-0")]
    assert missing_roles(stack) == {"tiny": ["prefill (no rank 0, the leader, taking work)"]}
    readiness = StackReadiness(expiry_s=60.0)
    for hb in stack:
        readiness.on_heartbeat(hb, 0.0)
    assert readiness.missing(0.0) == ["prefill"]
    assert missing_roles([*stack, heartbeat("prefill", "prefill-0")]) == {}


def test_a_nats_url_list_connects_and_a_bad_url_is_named(nats_server: tuple[int, list[subprocess.Popen[bytes]]]):
    """A cluster's seeds as the nats CLI takes them ('nats://a:4222,nats://b:4222') and a URL nats-py cannot
    parse ('', 'nats://') each ended every command (status, request, the services) in a nats.errors.Error
    traceback. The list now connects to a server of it; a bad URL is a one-line error naming it."""
    port, _ = nats_server

    def status(url: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "services.cli", "status", "--url", url, "--wait", "0.5"], capture_output=True, text=True,
                              timeout=60)

    listed = status(f"nats://127.0.0.1:1, nats://127.0.0.1:{port}")  # the first server listens nowhere
    assert listed.returncode == 1 and "Traceback" not in listed.stderr, listed.stderr
    assert "no heartbeat on" in listed.stderr, listed.stderr  # connected: nothing serves on that bare server
    for bad in ("", "nats://"):
        refused = status(bad)
        assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
        assert refused.stderr.startswith(f"moebus status: cannot connect to {bad!r}: nats: invalid hostname in connect url"), refused.stderr


@pytest.mark.parametrize("args, says", [
    ([b"--prompt", b"hi", b"--temperature", b"nan"], "argument --temperature: expected a finite number, got 'nan'"),
    ([b"--prompt", b"hi", b"--logit-bias", b"5=inf"], "argument --logit-bias: expected ID=BIAS (e.g. 1234=-100), got '5=inf'"),
    ([b"--prompt", b"caf\xe9"], "argument --prompt: not UTF-8 text: 'caf\\udce9' (use a UTF-8 locale, or --input-ids)"),
    ([b"--chat", b"hi", b"--stop", b"\xff"], "argument --stop: not UTF-8 text"),
    ([b"--input-ids", b"1,2,x"], "argument --input-ids: expected comma-separated token ids (e.g. 9707,1879), got '1,2,x'"),
])
def test_request_refuses_arguments_no_request_can_carry(args: list[bytes], says: str):
    """`moebus request --temperature nan` sent temperature null over JSON (msgspec's nan) and ran at the
    default temperature; a Latin-1 byte in --prompt (from a shell in another encoding) was a
    UnicodeEncodeError traceback. Both are usage errors now, before any connection."""
    proc = subprocess.run([sys.executable.encode(), b"-m", b"services.cli", b"request", b"--url", b"nats://127.0.0.1:1", *args],
                          capture_output=True, timeout=60)
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 2 and "Traceback" not in err and says in err, err


@pytest.mark.parametrize("wait", ["nan", "inf", "0"])
def test_status_refuses_a_wait_that_is_no_positive_duration(nats_server: tuple[int, list[subprocess.Popen[bytes]]], wait: str):
    """`moebus status --wait nan` passed the check (nan <= 0 is false), listened for no time and said
    'no moebus process serves there' of a serving stack; --wait inf listened forever."""
    port, _ = nats_server
    proc = subprocess.run([sys.executable, "-m", "services.cli", "status", "--url", f"nats://127.0.0.1:{port}", "--wait", wait],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and f"--wait must be a positive number of seconds, got {float(wait)}" in proc.stderr, proc.stderr


@pytest.mark.parametrize("text, says", [
    ("root:x:0:0:root:/root:/bin/bash\n", "no `services` mapping (not a docker compose file?)"),  # --stack /etc/passwd: a YAML string
    ("- a\n- b\n", "no `services` mapping"),
    ("services:\n  gateway: 5\n", "service 'gateway' must be a mapping, got 5"),
    ("services:\n  gateway:\n    command: 5\n", "service 'gateway': command must be `moebus <"),
    ("services:\n  gateway:\n    command: [moebus, gateway]\n    environment: 5\n", "environment must be a mapping or a list of NAME=VALUE, got 5"),
    ("services:\n  gateway:\n    command: [moebus, gateway]\n    deploy: {replicas: abc}\n", "deploy.replicas must be a count"),
    ("services:\n  gateway:\n    command: [moebus, gateway]\n    deploy: 7\n", "deploy.replicas must be a count"),
    # Falsy values are values: they were taken for an absent key (no environment, one replica).
    ("services:\n  gateway:\n    command: [moebus, gateway]\n    deploy: 0\n", "deploy.replicas must be a count, got 0"),
    ("services:\n  gateway:\n    command: [moebus, gateway]\n    environment: 0\n", "environment must be a mapping or a list of NAME=VALUE, got 0"),
])
def test_up_names_what_is_wrong_with_a_compose_file(tmp_path: Path, text: str, says: str):
    """A --stack file that is YAML but not a compose file of moebus services (/etc/passwd; a service
    that is no mapping; a replicas count that is none) was an AttributeError or ValueError traceback."""
    stack = tmp_path / "stack.yml"
    stack.write_text(text)
    up = subprocess.run([sys.executable, "-m", "services.cli", "up", "--port", "0", "--stack", str(stack), "--log-dir", str(tmp_path / "logs")],
                        capture_output=True, text=True, timeout=60)
    assert up.returncode == 2 and "Traceback" not in up.stderr and f"moebus up: {stack}: " in up.stderr and says in up.stderr, up.stderr


def test_compose_environment_takes_name_only_entries_from_the_callers_environment(tmp_path: Path):
    """Compose's `- NAME` entry (pass the caller's value on) was a ValueError at `dict()`: every process
    of `moebus up` inherits the caller's environment, so it is left out of the service's own. So is the
    mapping's `NAME:` without a value, which meant the same and set HF_TOKEN=None over the caller's token."""
    stack = tmp_path / "stack.yml"
    stack.write_text("services:\n  gateway:\n    command: [moebus, gateway]\n    environment: [HF_TOKEN, MOEBUS_LOG_JSON=true]\n")
    assert load_compose(stack, {})[0].env == {"MOEBUS_LOG_JSON": "true"}
    stack.write_text("services:\n  gateway:\n    command: [moebus, gateway]\n    environment:\n      HF_TOKEN:\n      MOEBUS_LOG_JSON: 'true'\n")
    assert load_compose(stack, {"HF_TOKEN": "hf_x"})[0].env == {"MOEBUS_LOG_JSON": "true"}


def test_up_refuses_a_ready_timeout_that_is_no_positive_duration():
    up = subprocess.run([sys.executable, "-m", "services.cli", "up", "--port", "0", "--ready-timeout", "nan"], capture_output=True, text=True, timeout=60)
    assert up.returncode == 2 and "moebus up: --ready-timeout must be a positive number of seconds, got nan" in up.stderr, up.stderr


@pytest.mark.parametrize("moebus", [[str(Path(sys.executable).with_name("moebus"))], [sys.executable, "-m", "services.cli"]],
                         ids=["console-script", "python-m"])
def test_moebus_without_a_command_is_a_usage_error_and_help_is_not(moebus: list[str]):
    """`moebus` alone printed its usage and exited 0, so `moebus $COMMAND` with the variable unset
    passed in a script: now a usage error, as argparse makes a missing required argument (usage
    on stderr, exit 2). Asked for, the usage is no error: stdout, exit 0."""
    bare = subprocess.run(moebus, capture_output=True, text=True, timeout=60)
    assert (bare.returncode, bare.stdout) == (2, ""), (bare.returncode, bare.stdout, bare.stderr)
    assert bare.stderr.startswith("usage: moebus <command> [options]") and "\n  openai " in bare.stderr, bare.stderr
    for flag in ("--help", "-h"):
        asked = subprocess.run([*moebus, flag], capture_output=True, text=True, timeout=60)
        assert (asked.returncode, asked.stderr, asked.stdout) == (0, "", bare.stderr), (flag, asked)


def test_printed_hints_name_a_moebus_the_shell_can_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """`moebus_command`: plain `moebus` when the one on PATH is this environment's, else this
    environment's console script by path (after `make demo` the venv is not activated)."""
    from services.launch import moebus_command

    script = Path(sys.executable).parent / "moebus"
    assert script.is_file()
    monkeypatch.setenv("PATH", str(script.parent))
    assert moebus_command() == "moebus"
    monkeypatch.setenv("PATH", str(tmp_path))  # no moebus on PATH
    named = moebus_command()
    assert named != "moebus" and Path(named).resolve() == script.resolve(), named
    other = tmp_path / "moebus"  # another moebus on PATH (another install): not the one this environment runs
    other.write_text("#!/bin/sh\nexit 1\n")
    other.chmod(0o755)
    assert Path(moebus_command()).resolve() == script.resolve()
