"""Staging buffers for packed KV chunks, under a byte budget.

Both sides pack/receive a chunk into a staging buffer before it moves on. The pool
bounds the bytes held at once (``acquire`` waits while the budget is spent) and
counts what is in use, so tests and heartbeats can see that nothing leaks. Buffers
come from torch's allocator (the CUDA caching allocator on GPU), which hands the
same segments back, so UCX's registration / IPC-handle caches keep hitting.
"""

from __future__ import annotations

import asyncio

import torch


class StagingPool:
    """Byte-budgeted ``uint8`` buffers on one device."""

    def __init__(self, capacity_bytes: int, device: torch.device | str = "cpu") -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"staging capacity must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.device = torch.device(device)
        self._in_use = 0
        self._buffers = 0
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def in_use_bytes(self) -> int:
        return self._in_use

    @property
    def in_use_buffers(self) -> int:
        return self._buffers

    async def acquire(self, nbytes: int) -> torch.Tensor:
        """A buffer of ``nbytes``; waits until the budget allows it."""
        if nbytes > self.capacity_bytes:
            raise ValueError(f"staging chunk of {nbytes} bytes exceeds the pool's capacity of {self.capacity_bytes}")
        while self._in_use + nbytes > self.capacity_bytes:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self._in_use += nbytes
        self._buffers += 1
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def release(self, buf: torch.Tensor) -> None:
        """Return a buffer's bytes to the budget (the tensor itself is dropped by the caller)."""
        self._in_use -= buf.numel()
        self._buffers -= 1
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
