"""The in-process UCX worker of the transfer tests that need no second process."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from shared.transfer import TransferWorker


@contextlib.asynccontextmanager
async def local_worker(**options: Any) -> AsyncIterator[TransferWorker]:
    """A `TransferWorker` of this process (``options`` as for `TransferWorker.create`), closed on exit,
    a failed check included: closing aborts its endpoints and stops ucxx's notifier thread, which would
    otherwise outlive the test."""
    worker = await TransferWorker.create(**options)
    try:
        yield worker
    finally:
        worker.close()
