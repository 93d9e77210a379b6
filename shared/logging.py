"""structlog setup: JSON lines when stderr is not a terminal, colored console otherwise.

Context bound with `bind_request(request_id=...)` (structlog contextvars) is merged
into every event logged inside it, so each line of a request's life carries its id.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog
from structlog.contextvars import bound_contextvars

bind_request = bound_contextvars

LEVELS = ("debug", "info", "warning", "error", "critical")  # the log levels a setting may name (any case)


def configure_logging(service: str, level: str = "info", json: bool | None = None, **context: Any) -> None:
    """Configure structlog for this process. `context` (e.g. instance, rank) is on every event."""
    if json is None:
        json = not sys.stderr.isatty()
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    # The console renderer formats tracebacks itself; JSON needs them as a string field.
    processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()] if json else [structlog.dev.ConsoleRenderer()]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        # One write() per event (print() writes the newline separately): the ranks of an
        # instance share one log file, and two writes each let their lines interleave.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service, **context)


def configure_tool_logging(tool: str) -> None:
    """Logging of a command-line tool (`moebus status`, `moebus request`, `moebus up`'s own connections):
    errors only, on stderr. Such a tool says in its own words what went wrong ("no NATS server answered
    at <url>"); the warnings logged on the way (`nats_error` for each refused connect, which a service's
    log keeps) came before that message, and on stdout, structlog's default, in the middle of the tool's
    output."""
    configure_logging(tool, level="error")


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)
