"""Fixtures for every test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import structlog


@pytest.fixture(autouse=True)
def _logging_configuration_restored() -> Iterator[None]:
    """structlog's configuration and bound context as they were before the test: a CLI entry point
    called in-process (``launch.main``, which logs errors only, as a command-line tool) must not
    filter or redirect the log events of the tests after it."""
    config = structlog.get_config()
    context = structlog.contextvars.get_contextvars()
    yield
    structlog.configure(**config)
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(**context)
