"""`Collectives` on CUDA with the peer-memory kernels of `kernels/` (DESIGN §6).

* ``all_reduce`` runs our NVLink all-reduce (`kernels.allreduce.CudaAllReduce`:
  one-shot / two-shot, fp32 accumulation in rank order, identical bits on every
  rank, CUDA-graph safe). Strided or misaligned views are reduced through an
  aligned copy; dtypes other than bf16/fp16/fp32 go to NCCL.
* ``ep_dispatch`` / ``ep_combine`` keep the NCCL path of `TorchCollectives`: their
  contract (token-granular rows, receive sizes known on the host) does not fit the
  peer-memory kernels, which use fixed-size buffers and a per-expert masked
  layout so that nothing synchronises with the host. The decode MoE uses those
  kernels through `dispatch_combine()` (see `kernels.dispatch_combine`).

Construction is collective (it maps peer memory on every rank) and loads the
kernels, so it must happen before any CUDA-graph capture.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kernels.allreduce import SUPPORTED_DTYPES, CudaAllReduce
from kernels.dispatch_combine import DispatchCombine
from shared.parallel import TorchCollectives, Topology


class CudaCollectives(TorchCollectives):
    """`TorchCollectives` with the all-reduce replaced by the peer-memory kernels."""

    def __init__(self, topology: Topology) -> None:
        super().__init__(topology)
        self._all_reduce = CudaAllReduce(dist.group.WORLD) if topology.tp_size > 1 else None
        if self._all_reduce is not None:
            self._all_reduce.warmup()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the TP group in place; returns ``x``."""
        if self._all_reduce is None:
            return x
        if x.dtype not in SUPPORTED_DTYPES or not x.is_cuda:
            return super().all_reduce(x)
        if x.is_contiguous() and x.data_ptr() % 16 == 0:
            return self._all_reduce(x, out=x)
        # Strided or misaligned views go through a fresh (aligned, contiguous) copy.
        staged = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        staged.copy_(x)
        self._all_reduce(staged, out=staged)
        return x.copy_(staged)

    def dispatch_combine(self, num_experts: int, max_tokens: int, hidden: int, topk: int, payload: str = "bf16") -> DispatchCombine:
        """Peer-memory DP-EP dispatch/combine buffers for the decode layout (collective)."""
        return DispatchCombine(dist.group.WORLD, num_experts, max_tokens, hidden, topk, payload)
