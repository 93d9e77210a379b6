"""The control-plane processes never import the model runtime: torch and what only the model ranks
use (safetensors, transformers, the CUDA bindings, CuTeDSL, this project's kernels).

Importing torch cost each of them 1-4 s of start-up and ~190k objects on its heap (which a full
garbage collection walked on the event loop). Each command below runs as `moebus <command>` does,
in a fresh interpreter, against a real nats-server: the services serve until SIGTERM, drain and
exit; what the interpreter had imported by then is checked at its exit.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

MODEL_ONLY = ("torch", "safetensors", "transformers", "cuda.bindings", "cutlass", "kernels")

# `moebus` (services.cli.main) with the interpreter's modules written to argv[1] at exit.
MOEBUS = """
import atexit, json, sys
atexit.register(lambda: open(sys.argv[1], "w").write(json.dumps(sorted(sys.modules))))
from services.cli import main
sys.exit(main(sys.argv[2:]))
"""

# command -> (arguments after the NATS URL option, the output line that says it serves; None: it ends by itself)
COMMANDS: dict[str, tuple[list[str], str | None]] = {
    "scheduler": (["--instance", "imports"], "scheduler_ready"),
    "gateway": (["--instance", "imports", "--model", "{model}"], "gateway_ready"),
    "openai": (["--port", "0"], "moebus openai: serving"),
    "metrics": (["--port", "0"], "moebus metrics: serving"),
    "status": (["--wait", "0.1"], None),
    "request": (["--prompt", "hi", "--timeout-ms", "500"], None),  # no gateway: it fails, torch-free all the same
    "up": (["--help"], None),  # the launcher's parent: what it imports to run a stack (its services are the above)
}


def url_option(command: str, url: str) -> list[str]:
    if command == "up":
        return []  # it starts its own nats-server
    return ["--nats-url", url] if command in ("scheduler", "gateway") else ["--url", url]


def model_only(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == name or m.startswith(name + ".") for name in MODEL_ONLY)]


def run_until_ready_then_stop(argv: list[str], ready: str | None, modules_file: Path, timeout_s: float = 60.0) -> str:
    """Run ``moebus argv``; once it prints ``ready``, SIGTERM it; its whole output once it has exited."""
    proc = subprocess.Popen([sys.executable, "-c", MOEBUS, str(modules_file), *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while ready is not None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if ready in line:
                proc.send_signal(signal.SIGTERM)
                break
        out, _ = proc.communicate(timeout=timeout_s)
        lines.append(out)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return "".join(lines)


@pytest.mark.parametrize("command", COMMANDS)
def test_control_plane_process_imports_no_model_runtime(command: str, nats_server: tuple[int, list[Any]], tiny_model: Path,
                                                        tmp_path: Path) -> None:
    args, ready = COMMANDS[command]
    argv = [command, *url_option(command, f"nats://127.0.0.1:{nats_server[0]}"), *(a.format(model=tiny_model) for a in args)]
    modules_file = tmp_path / "modules.json"
    output = run_until_ready_then_stop(argv, ready, modules_file)
    assert ready is None or ready in output, output
    assert modules_file.exists(), output
    assert model_only(json.loads(modules_file.read_text())) == [], f"`moebus {command}` imported the model runtime"


def test_up_creates_the_demo_model_without_importing_torch_itself(tmp_path: Path) -> None:
    # `moebus up` without --model, the first time: the launcher (the stack's parent for its whole
    # life) has the tiny checkpoint written by a child process, which imports torch in its place.
    code = ("import json, sys; from pathlib import Path; from services.launch import ensure_tiny_model; "
            "model = ensure_tiny_model(Path(sys.argv[1])); print(json.dumps([str(model), sorted(sys.modules)]))")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "cache")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    model, modules = json.loads(done.stdout.splitlines()[-1])
    assert (Path(model) / "config.json").exists() and (Path(model) / "model.safetensors").exists()
    assert model_only(modules) == []
