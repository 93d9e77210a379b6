"""`moebus up --demo` and `moebus request` as a user runs them (what `make demo` does), with the
NATS server's max_payload raised and the served model name set through the environment."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.bus import connect

pytestmark = pytest.mark.slow


async def announced_max_payload(url: str) -> int:
    async with connect(url, "test-cli") as bus:
        return bus.nc.max_payload


def test_up_demo_creates_the_tiny_model_serves_and_stops_cleanly(tmp_path: Path):
    env = {**os.environ, "MOEBUS_CACHE_DIR": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1", "MOEBUS_NATS_MAX_PAYLOAD": str(16 << 20),
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
        assert (tmp_path / "cache" / "tiny-qwen3-moe" / "config.json").exists()
        # The NATS server took its max_payload from the environment, through the config file in the log directory.
        assert f"max_payload {16 << 20} bytes" in output and (tmp_path / "logs" / "nats-server.conf").read_text() == f"max_payload: {16 << 20}\n"
        assert asyncio.run(announced_max_payload(url)) == 16 << 20

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
