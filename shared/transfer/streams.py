"""CUDA side streams and host-side waits for the transfer's pack and scatter work.

Pack (prefill) and scatter (decode) run on their own high-priority stream: their few
short, memory-bound kernels are scheduled ahead of queued prefill GEMMs / decode steps
instead of waiting behind them, and they never delay the compute stream's own order.
On CPU there is no stream (``None``) and the work runs inline or in a thread.
"""

from __future__ import annotations

import asyncio

import torch

# Lower numbers are higher priorities in CUDA; -1 is the highest torch exposes on Hopper.
HIGH_PRIORITY = -1


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A high-priority stream on ``device`` for transfer kernels, or None on CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device, priority=HIGH_PRIORITY)


async def event_done(event: torch.cuda.Event) -> None:
    """Wait for ``event`` without blocking the event loop (a thread only if it is still pending)."""
    if not event.query():
        await asyncio.to_thread(event.synchronize)
