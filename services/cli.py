"""The `moebus` console script: one subcommand per tool or service.

Each subcommand lives in its own module and exposes `main(argv: list[str]) -> int`
with its own argparse; this file only maps names to modules, imported lazily so
that `moebus request` does not pay for importing torch.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys

from shared.bus import Unreachable

COMMANDS: dict[str, tuple[str, str]] = {
    "make-tiny": ("shared.model.tiny", "write a small random Qwen3-MoE checkpoint"),
    "generate": ("shared.model.offline", "generate offline from a checkpoint (no services)"),
    "quantize": ("shared.model.quantize", "convert a bf16 checkpoint to FP8 block-scaled or MXFP8"),
    "up": ("services.launch", "start nats-server and a compose stack as local processes"),
    "request": ("services.client", "send one request to a running stack"),
    "status": ("services.status", "show the processes of a running stack, their load and totals"),
    "metrics": ("services.metrics", "serve a running stack's heartbeats as Prometheus metrics (GET /metrics)"),
    "openai": ("services.openai.server", "serve an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)"),
    "gateway": ("services.gateway.__main__", "run a gateway"),
    "scheduler": ("services.scheduler.__main__", "run a scheduler"),
    "prefill": ("services.prefill.__main__", "run a prefill instance"),
    "decode": ("services.decode.__main__", "run a decode instance"),
}


def usage() -> str:
    lines = ["usage: moebus <command> [options]", "", "commands:"]
    lines += [f"  {name:<11} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:  # a usage error, as argparse makes a missing required argument: `moebus $UNSET` fails in a script
        print(usage(), file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"moebus: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    try:
        code = int(module.main(rest) or 0)
        sys.stdout.flush()  # a reader gone shows here (below), not as "Exception ignored" at exit
        return code
    except Unreachable as e:  # no NATS server within connect_timeout_s: the message says all, a traceback nothing more
        print(f"moebus {name}: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `moebus status | head`: the reader has what it wanted
        # Python flushes stdout again at exit, into the same closed pipe: point it at /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE  # what a command killed by SIGPIPE exits with, as `yes | head` does


if __name__ == "__main__":
    sys.exit(main())
