"""Start-up of the control-plane processes: how long each takes to serve and what it holds then.

For each of `moebus scheduler`, `gateway`, `openai` and `metrics` (a real process against a real
nats-server; the gateway on the embedded tiny model):

* ``start_ms``: from spawning the process to the line saying it serves (``scheduler_ready``,
  ``gateway_ready``, ``moebus <frontend>: serving``), interpreter start-up included;
* ``rss_mib``: its resident memory at that moment (``VmRSS``);

and, in a fresh interpreter, for each command's module (the one-shot commands `status`,
`request` and `up`'s launcher too):

* ``import_ms``: the time to import the module `moebus <command>` runs;
* ``heap_objects``: the objects the garbage collector tracks right after that import (what a
  full collection walks), as `freeze_startup_heap` freezes them, and ``freeze_ms`` what that
  takes (``gc.collect(1)``, ``gc.freeze()``);
* ``full_gc_ms``: what one full collection (``gc.collect()``) then takes, the median of five,
  and ``frozen_full_gc_ms`` the same with the heap frozen: the stall a service's event loop
  sees per full collection without and with `freeze_startup_heap`.

``--baseline DIR`` measures another checkout's code (say main's, in a scratch worktree) as the
peer, interleaved with this checkout's round by round, so that both see the same load on the host.
Each metric is the median over ``--rounds``, with its min and max.

    python -m bench.control_plane_start [--rounds 5] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.results import print_table, record
from services.launch import default_cache_dir, ensure_tiny_model, start_nats_server
from services.ranks import free_port
from shared.settings import NatsServerSettings

ROOT = Path(__file__).resolve().parent.parent

# command -> (the module `moebus <command>` imports, arguments after the NATS URL, the line that says it serves)
SERVERS: dict[str, tuple[str, list[str], str]] = {
    "scheduler": ("services.scheduler.__main__", ["--set", "model_name=bench"], "scheduler_ready"),
    "gateway": ("services.gateway.__main__", ["--model", "{model}", "--set", "model_name=bench"], "gateway_ready"),
    "openai": ("services.openai.server", ["--port", "0"], "moebus openai: serving"),
    "metrics": ("services.metrics", ["--port", "0"], "moebus metrics: serving"),
}
ONE_SHOT: dict[str, str] = {"status": "services.status", "request": "services.client", "up": "services.launch"}

IMPORT = """
import gc, importlib, json, statistics, sys, time
t = time.perf_counter()
importlib.import_module(sys.argv[1])
import_ms = (time.perf_counter() - t) * 1e3

def full_gc_ms():
    times = []
    for _ in range(5):
        t = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)

t = time.perf_counter()
gc.collect(1)  # what freeze_startup_heap does
gc.freeze()
freeze_ms = (time.perf_counter() - t) * 1e3
heap_objects = gc.get_freeze_count()
frozen = full_gc_ms()
gc.unfreeze()
print(json.dumps({"import_ms": import_ms, "heap_objects": heap_objects, "freeze_ms": freeze_ms,
                  "full_gc_ms": full_gc_ms(), "frozen_full_gc_ms": frozen}))
"""


def checkout_commit(checkout: Path) -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=checkout, capture_output=True, text=True, check=True).stdout.strip()

    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)bench/results")
    return git("rev-parse", "--short=12", "HEAD") + ("+dirty" if dirty else "")


def env_for(checkout: Path) -> dict[str, str]:
    """The environment that makes an interpreter import ``checkout``'s packages (it runs there, too)."""
    return {**os.environ, "PYTHONPATH": str(checkout), "MOEBUS_LOG_LEVEL": "info"}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def measure_import(checkout: Path, module: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", IMPORT, module], cwd=checkout, env=env_for(checkout), capture_output=True,
                         text=True, check=True, timeout=120).stdout
    return json.loads(out.strip().splitlines()[-1])


def measure_start(checkout: Path, command: str, url: str, model: Path) -> dict[str, float]:
    """Spawn ``moebus command`` from ``checkout``; time to its ready line and its RSS then; stop it."""
    _, args, ready = SERVERS[command]
    url_option = ["--nats-url", url] if command in ("scheduler", "gateway") else ["--url", url]
    argv = [sys.executable, "-m", "services.cli", command, *url_option, *(a.format(model=model) for a in args)]
    started = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=checkout, env=env_for(checkout), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if ready in line:
                start_ms = (time.perf_counter() - started) * 1e3
                rss = rss_mib(proc.pid)
                break
        else:
            raise RuntimeError(f"`moebus {command}` exited before serving:\n{''.join(lines)}")
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return {"start_ms": start_ms, "rss_mib": rss}


def summary(samples: list[dict[str, float]]) -> dict[str, float]:
    """Median, min and max of each metric over the rounds."""
    out: dict[str, float] = {}
    for name in samples[0]:
        values = [s[name] for s in samples]
        unit_at = name.rfind("_")
        stem, unit = name[:unit_at], name[unit_at:]
        out[name] = round(statistics.median(values), 2)
        out[f"{stem}_min{unit}"] = round(min(values), 2)
        out[f"{stem}_max{unit}"] = round(max(values), 2)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--baseline", type=Path, help="another checkout, measured as the peer in the same rounds")
    ap.add_argument("--model", type=Path, help="the gateway's checkpoint (default: the embedded tiny model)")
    a = ap.parse_args(argv)

    checkouts = {"this": ROOT, **({"baseline": a.baseline.resolve()} if a.baseline else {})}
    model = a.model or ensure_tiny_model(default_cache_dir())
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    nats = start_nats_server(port, NatsServerSettings(), Path(tempfile.mkdtemp(prefix="bench-start-nats-")))
    commands = [*SERVERS, *ONE_SHOT]
    samples: dict[tuple[str, str], list[dict[str, float]]] = {(who, c): [] for who in checkouts for c in commands}
    try:
        for _ in range(a.rounds):
            for command in commands:
                for who, checkout in checkouts.items():  # the arms alternate within each round
                    module = SERVERS[command][0] if command in SERVERS else ONE_SHOT[command]
                    sample = measure_import(checkout, module)
                    if command in SERVERS:
                        sample |= measure_start(checkout, command, url, model)
                    samples[who, command].append(sample)
    finally:
        nats.terminate()
        nats.wait(10)

    os.environ["MOEBUS_COMMIT"] = checkout_commit(ROOT)  # `record`'s commit: this checkout's
    rows = []
    for command in commands:
        case = {"what": "control_plane_start", "command": command, "rounds": a.rounds, "host_load_1m": round(os.getloadavg()[0], 2)}
        metrics = summary(samples["this", command])
        peers = {f"baseline {checkout_commit(checkouts['baseline'])}": summary(samples["baseline", command])} if a.baseline else {}
        record("control_plane_start", case, metrics, peers)
        for who in checkouts:
            rows.append({"command": command, "checkout": who, **summary(samples[who, command])})
    print_table(rows, ["command", "checkout", "import_ms", "import_min_ms", "import_max_ms", "heap_objects", "freeze_ms", "full_gc_ms",
                       "frozen_full_gc_ms", "start_ms", "start_min_ms", "start_max_ms", "rss_mib", "rss_min_mib", "rss_max_mib"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
