"""Recording benchmark results: one JSON line per measurement (DESIGN §7).

Every benchmark prints a table and calls `record` for each row, which appends
``{"bench", "case", "device", "commit", "date", "command", "metrics", "peers"}`` to
``bench/results/<bench>.jsonl``. Metric names carry their unit (``latency_us``,
``tflops``, ``gbps``, ``tokens_per_s``).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def git_commit() -> str:
    """The checkout's commit, with ``+dirty`` when the tree has uncommitted changes (the result
    files themselves excluded: a benchmark's own first line must not mark its later ones)."""
    if os.environ.get("MOEBUS_COMMIT"):
        return os.environ["MOEBUS_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)bench/results"],
                               cwd=root, capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name() -> str:
    """``"<n>x <GPU name>"`` when CUDA is visible, else the CPU model."""
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    cpu = platform.processor() or platform.machine()
    return f"cpu {cpu} ({os.cpu_count()} cores)"


def record(bench: str, case: dict[str, Any], metrics: dict[str, float], peers: dict[str, dict[str, float]] | None = None, results_dir: Path | None = None) -> dict[str, Any]:
    """Append one measurement to ``<results_dir>/<bench>.jsonl`` and return it."""
    line = {
        "bench": bench,
        "case": case,
        "device": device_name(),
        "commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "metrics": metrics,
        "peers": peers or {},
    }
    out_dir = Path(os.environ.get("MOEBUS_RESULTS_DIR", results_dir or RESULTS_DIR))
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / f"{bench}.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    return line


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    """Print rows as an aligned text table (columns in the given order)."""
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.0f}"
    return str(v)
