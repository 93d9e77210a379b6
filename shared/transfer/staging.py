"""Staging slots for packed KV chunks, carved from one arena allocated up front.

Both sides pack/receive a chunk into a staging slot before it moves on. The arena is
allocated once per pool (one cudaMalloc on GPU), so UCX sees the same memory every
time: its registration and CUDA-IPC handle caches hit after the first transfer, and
the peer opens the arena's IPC handle once instead of once per chunk. ``acquire``
waits while every slot is taken (back-pressure); the pool counts bytes and slots in
use so tests and heartbeats can see that nothing leaks.
"""

from __future__ import annotations

import asyncio

import torch


class StagingPool:
    """``num_slots`` staging buffers of up to ``slot_bytes`` each, on one device."""

    def __init__(self, slot_bytes: int, num_slots: int, device: torch.device | str = "cpu") -> None:
        if slot_bytes <= 0 or num_slots <= 0:
            raise ValueError(f"staging pool needs positive slot_bytes and num_slots, got {slot_bytes} x {num_slots}")
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.arena = torch.empty(slot_bytes * num_slots, dtype=torch.uint8, device=device)
        self._free = list(range(num_slots - 1, -1, -1))
        self._in_use: dict[int, int] = {}  # slot -> bytes handed out
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def device(self) -> torch.device:
        return self.arena.device

    @property
    def in_use_bytes(self) -> int:
        return sum(self._in_use.values())

    @property
    def in_use_buffers(self) -> int:
        return len(self._in_use)

    async def acquire(self, nbytes: int) -> torch.Tensor:
        """A ``uint8`` view of ``nbytes`` in a free slot; waits until one is free."""
        if not 0 < nbytes <= self.slot_bytes:
            raise ValueError(f"staging chunk of {nbytes} bytes does not fit the pool's {self.slot_bytes}-byte slots")
        while not self._free:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        slot = self._free.pop()
        self._in_use[slot] = nbytes
        return self.arena[slot * self.slot_bytes : slot * self.slot_bytes + nbytes]

    def release(self, buf: torch.Tensor) -> None:
        """Give a slot back (``buf`` is what ``acquire`` returned)."""
        slot = (buf.data_ptr() - self.arena.data_ptr()) // self.slot_bytes
        if self._in_use.pop(slot, None) is None:
            raise ValueError("releasing a staging buffer that is not in use")
        self._free.append(slot)
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
