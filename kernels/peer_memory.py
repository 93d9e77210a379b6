"""Peer memory for a process group: one buffer per rank, mapped into every rank.

Choice: torch symmetric memory (``torch.distributed._symmetric_memory``) with
multicast disabled, rather than our own cuMem/cuda-python handle exchange. It does
exactly the part we would otherwise write by hand (cuMemCreate with a shareable
handle, exchange through the process group's store, cuMemMap + access rights on
every peer) and hands back each peer's virtual address, which is all our kernels
need: they take raw addresses and do their own signalling. It also lets the
benchmarks compare against torch's own one-/two-shot all-reduce on the same
allocation machinery. Multicast (NVLS) must never be touched, so we refuse to
start unless ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` is set: with it torch never
creates a multicast object.

Lifetime: a `PeerMemory` owns its allocation; peers keep mappings of it, so it must
outlive every kernel that can touch it on any rank. Call `close()` only after a
group barrier (or let the object live as long as the process group).

Layout: callers carve named regions out of the buffer with `RegionLayout` (256-byte
aligned), identical on every rank, so a region's offset is valid in every peer's
mapping. The first region of every buffer is the flag area, zeroed before the
group first synchronises, so epoch-valued flags start from a known state.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kernels._cute_comm import CTRL_WORDS

_ALIGN = 256


class PeerMemoryError(RuntimeError):
    """Peer memory could not be set up (wrong environment, device or group)."""


@dataclass
class RegionLayout:
    """Byte offsets of named regions inside one peer buffer."""

    offsets: dict[str, int] = field(default_factory=dict)
    nbytes: int = 0

    def add(self, name: str, nbytes: int) -> int:
        if name in self.offsets:
            raise ValueError(f"region {name!r} defined twice")
        self.nbytes = -(-self.nbytes // _ALIGN) * _ALIGN
        self.offsets[name] = self.nbytes
        self.nbytes += max(int(nbytes), 0)
        return self.offsets[name]

    def __getitem__(self, name: str) -> int:
        return self.offsets[name]


def require_no_multicast() -> None:
    """Refuse to map peer memory unless NVLink multicast is switched off."""
    if os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST") != "1":
        raise PeerMemoryError(
            "TORCH_SYMM_MEM_DISABLE_MULTICAST=1 must be set before using peer memory "
            "(NVLink multicast is forbidden on this hardware)"
        )
    if os.environ.get("NCCL_NVLS_ENABLE", "0") != "0":
        raise PeerMemoryError("NCCL_NVLS_ENABLE must be 0 (NVLink multicast is forbidden)")


class PeerMemory:
    """A symmetric buffer of ``layout.nbytes`` bytes on every rank of ``group``.

    Attributes: ``rank``/``world_size`` within the group, ``peer_ptrs`` (each rank's
    buffer address as mapped here), ``peer_table`` (the same as an int64 tensor on
    the device, which kernels index), ``control`` (rank-local int32 words for epochs
    and launch counters, never visible to peers).
    """

    def __init__(self, group: dist.ProcessGroup, layout: RegionLayout, device: torch.device | None = None) -> None:
        require_no_multicast()
        import torch.distributed._symmetric_memory as symm_mem

        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type != "cuda":
            raise PeerMemoryError(f"peer memory needs a CUDA device, got {device}")
        self.group = group
        self.layout = layout
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = device
        self.local = symm_mem.empty(max(layout.nbytes, _ALIGN), dtype=torch.uint8, device=device)
        self.local.zero_()
        self._handle = symm_mem.rendezvous(self.local, group)
        self.peer_ptrs = [int(p) for p in self._handle.buffer_ptrs]
        if len(self.peer_ptrs) != self.world_size:
            raise PeerMemoryError(f"rendezvous returned {len(self.peer_ptrs)} peers for a group of {self.world_size}")
        self.peer_table = torch.tensor(self.peer_ptrs, dtype=torch.int64, device=device)
        self.control = torch.zeros(CTRL_WORDS, dtype=torch.int32, device=device)
        # Nobody may signal into a peer's flag area before that peer has zeroed it.
        torch.cuda.synchronize(device)
        dist.barrier(group=group)

    @property
    def base(self) -> int:
        return self.peer_ptrs[self.rank]

    def view(self, region: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """This rank's part of ``region`` as a tensor (a view into the buffer)."""
        off = self.layout[region]
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return self.local[off : off + nbytes].view(dtype).view(shape)

    def close(self) -> None:
        """Drop this rank's references. Call after a group barrier (peers map this buffer)."""
        self._handle = None
        self.local = None  # type: ignore[assignment]
