"""`moebus openai` and `moebus metrics` configured without a single flag, as the services are: by a
TOML file (`MOEBUS_CONFIG`, its top-level keys and its `[openai]` / `[metrics]` table) and
`MOEBUS_*` variables, against a real nats-server; a bad value stops them at start (exit 2) naming
it and where it came from."""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.ranks import free_port

pytestmark = pytest.mark.slow


def frontend_env(**settings: str) -> dict[str, str]:
    """This process' environment without any `MOEBUS_*` variable of the caller, plus ``settings``."""
    return {k: v for k, v in os.environ.items() if not k.startswith("MOEBUS_")} | settings


@contextlib.contextmanager
def started(command: str, env: dict[str, str]) -> Iterator[tuple[str, int]]:
    """Run ``moebus <command>`` with no flags: the line it printed at start and the port in it; stopped by SIGTERM (exit 0)."""
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", command], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        match = re.search(r"http://([\d.]+):(\d+)/", line)
        assert match, f"no address printed: {line!r} (exit {proc.poll()}: {proc.stderr.read() if proc.poll() is not None else ''})"  # type: ignore[union-attr]
        yield line, int(match.group(2))
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
    assert rc == 0


def get(port: int, path: str) -> tuple[int, dict[str, str], str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read().decode()
    finally:
        conn.close()


def test_frontends_take_their_settings_from_the_toml_file_and_the_environment(tmp_path: Path, nats_server: tuple[int, list[Any]]):
    """Before, both ignored the file and these variables: `moebus openai` listened on 8000 and `moebus metrics` on
    9464 of 127.0.0.1, on the stack at the default nats://127.0.0.1:4222."""
    url = f"nats://127.0.0.1:{nats_server[0]}"
    openai_port, metrics_port = free_port(), free_port()
    config = tmp_path / "moebus.toml"
    config.write_text(f'nats_url = "{url}"\n'  # top-level: every process of the stack
                      f'[openai]\nport = {openai_port}\nhealth_expiry_s = 7.5\n'
                      '[metrics]\nexpiry_s = 6.0\n')
    env = frontend_env(MOEBUS_CONFIG=str(config), MOEBUS_HTTP_HOST="127.0.0.1", MOEBUS_METRICS_PORT=str(metrics_port),
                       MOEBUS_OPENAI_KEEP_ALIVE_REQUESTS="1", MOEBUS_LOG_JSON="true")

    with started("openai", env) as (line, port):
        assert port == openai_port and f"for the stack on {url}" in line, line
        assert get(port, "/version")[0] == 200
        # /health: the [openai] table's expiry, and no stack on that bus yet; keep_alive_requests=1: every answer closes its connection.
        status, headers, body = get(port, "/health")
        assert (status, body) == (503, "unavailable: no gateway, scheduler, prefill, decode heard in the last 7.5 s that takes new work\n")
        assert headers["connection"] == "close"
    with started("metrics", env) as (line, port):
        assert port == metrics_port and f"for the stack on {url}" in line, line
        status, headers, body = get(port, "/metrics")
        assert status == 200 and body == "\n" and headers.get("connection") != "close"  # nothing heard yet; metrics keeps the default


EMPTY_KEY = "api_key is empty: give a key, or leave api_key unset (no --api-key) to serve without authentication"


@pytest.mark.parametrize(("command", "flags", "file", "variables", "message"), [
    ("openai", [], "", {"MOEBUS_OPENAI_PORT": "abc"}, "openai settings: MOEBUS_OPENAI_PORT='abc': Expected `int`, got `str` - at `$.port`"),
    ("openai", [], "[openai]\nmax_n = 0\n", {}, "openai settings: max_n = 0 in [openai] of config file {config}: Expected `int` >= 1 - at `$.max_n`"),
    ("metrics", [], "", {"MOEBUS_METRICS_EXPIRY": "5"}, "environment variable MOEBUS_METRICS_EXPIRY: MetricsSettings has no field 'expiry'"),
    # An empty key is refused, not taken for "no authentication"; a key's value is never shown.
    ("openai", ["--api-key", ""], "", {}, f"openai settings: api_key=<hidden> on the command line: {EMPTY_KEY}"),
    ("openai", [], "", {"MOEBUS_OPENAI_API_KEY": ""}, f"openai settings: MOEBUS_OPENAI_API_KEY=<hidden>: {EMPTY_KEY}"),
    ("openai", [], "[openai]\napi_key = 12345\n", {}, "openai settings: api_key = <hidden> in [openai] of config file {config}: "
                                                       "Expected `str | array | null`, got `int` - at `$.api_key`"),
])
def test_frontends_refuse_a_bad_setting_at_start_naming_it(tmp_path: Path, command: str, flags: list[str], file: str, variables: dict[str, str],
                                                           message: str):
    """Exit 2 (a usage error, as for the services' bad settings) before dialling NATS (none listens at
    the URL given), naming the value and its source."""
    config = tmp_path / "moebus.toml"
    config.write_text(file)
    env = frontend_env(MOEBUS_CONFIG=str(config), MOEBUS_NATS_URL="nats://127.0.0.1:1", MOEBUS_CONNECT_TIMEOUT_S="0.5", **variables)
    done = subprocess.run([sys.executable, "-m", "services.cli", command, *flags], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.splitlines()[-1] == f"moebus {command}: error: {message.format(config=config)}", done.stderr
