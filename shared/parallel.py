"""Rank topology and the collectives the model needs (DESIGN §6).

Two layouts exist, one per service kind:

* **prefill**: one TP group of ``world_size`` ranks. Attention is split by head
  (all-reduce after ``o_proj``); experts are split over the same ranks (EP inside
  the TP group) while every rank sees *all* tokens (inputs replicated): each rank
  computes its local experts for every token, weights them, and one all-reduce
  sums the partial outputs.
* **decode**: ``world_size`` data-parallel ranks, each with its own sequences and
  its own full copy of attention (no communication there); experts are split
  over all ranks, and tokens travel to the ranks owning their top-k experts in an
  all-to-all *dispatch*, with the weighted results coming back in a *combine*. A
  rank with no tokens still takes part in both.

`Collectives` is the interface the model calls; `TorchCollectives` implements it
with ``torch.distributed`` (gloo on CPU, NCCL on GPU) and `LocalCollectives` is
the single-process identity. `shared.parallel_cuda.CudaCollectives` runs the
peer-memory kernels on GPUs: the all-reduce, and for the decode layout a whole
MoE layer (`Collectives.decode_moe`: dispatch, masked grouped GEMMs, combine).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

from kernels.ops import use_kernels

Layout = Literal["single", "prefill", "decode"]


@dataclass(frozen=True)
class ShardSpec:
    """The slice of the model one rank holds: attention/dense-MLP TP split and expert range."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1


@dataclass(frozen=True)
class Topology:
    """Where a rank sits: its layout, rank and world size, and the group sizes they imply."""

    layout: Layout
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of size {self.world_size}")
        if self.layout == "single" and self.world_size != 1:
            raise ValueError("the single layout has exactly one rank")

    @classmethod
    def single(cls) -> Topology:
        return cls("single")

    @classmethod
    def prefill(cls, world_size: int, rank: int) -> Topology:
        return cls("prefill", rank, world_size)

    @classmethod
    def decode(cls, world_size: int, rank: int) -> Topology:
        return cls("decode", rank, world_size)

    @property
    def tp_size(self) -> int:
        return self.world_size if self.layout == "prefill" else 1

    @property
    def ep_size(self) -> int:
        return self.world_size

    @property
    def inputs_replicated(self) -> bool:
        """True when every rank of the expert group sees the same tokens (prefill layout)."""
        return self.layout != "decode"

    def shard(self) -> ShardSpec:
        tp_rank = self.rank if self.layout == "prefill" else 0
        return ShardSpec(tp_rank=tp_rank, tp_size=self.tp_size, ep_rank=self.rank, ep_size=self.ep_size)


@dataclass
class EpDispatch:
    """Tokens received by this rank for its local experts, and how to send results back.

    ``topk_ids``/``topk_weights`` are the sender's full routing rows (global expert
    ids); the receiver uses only the entries that fall in its own expert range.
    """

    x: torch.Tensor  # [R, H]
    topk_ids: torch.Tensor  # [R, k]
    topk_weights: torch.Tensor  # [R, k]
    send_index: torch.Tensor  # [S] source token of each row sent, in send order
    send_counts: list[int]  # rows sent to each rank
    recv_counts: list[int]  # rows received from each rank
    num_tokens: int  # T on the sending side


class Collectives(Protocol):
    """Communication the model performs; one implementation per transport."""

    # Whether `all_reduce` can be captured in a CUDA graph and replayed (stream-ordered, no host sync, its
    # buffers and flags on the device): the prefill graphs of a TP group need it (`shared.model.prefill_graphs`).
    all_reduce_in_graphs: bool

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the TP group (in place allowed); returns the sum."""
        ...

    def all_agree(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank of the group (collective; waits for the host): lets the ranks
        take the same path after a step that may fail on one of them."""
        ...

    def ep_dispatch(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts_per_rank: int
    ) -> EpDispatch:
        """Send each token once to every rank owning one of its top-k experts."""
        ...

    def ep_combine(self, expert_out: torch.Tensor, dispatch: EpDispatch) -> torch.Tensor:
        """Return ``expert_out`` rows to their senders and sum them per token: ``[T, H]``."""
        ...

    def decode_moe(self, num_experts: int, hidden: int, top_k: int, moe_intermediate: int, max_tokens: int, fp8: bool) -> DecodeMoE | None:
        """A decode-layout MoE layer that does its own communication, with buffers for
        ``max_tokens`` tokens per rank (collective: all ranks call it together), or None
        when this transport has none (the model then uses `ep_dispatch`/`ep_combine`)."""
        ...


class DecodeMoE(Protocol):
    """A whole expert-parallel MoE layer of the decode layout (see `Collectives.decode_moe`)."""

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: Any) -> torch.Tensor:
        """``[T, H]``: each token's routing-weighted sum over its top-k experts, wherever they live.

        ``experts`` is this rank's `shared.model.weights.MoEWeights`, prepared for the kernels.
        """
        ...


class LocalCollectives:
    """One rank: all-reduce is the identity, dispatch keeps every token at home."""

    all_reduce_in_graphs = True

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_agree(self, ok: bool) -> bool:
        return ok

    def ep_dispatch(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts_per_rank: int
    ) -> EpDispatch:
        t = x.shape[0]
        index = torch.arange(t, device=x.device)
        return EpDispatch(x, topk_ids, topk_weights, index, [t], [t], t)

    def ep_combine(self, expert_out: torch.Tensor, dispatch: EpDispatch) -> torch.Tensor:
        return expert_out

    def decode_moe(self, num_experts: int, hidden: int, top_k: int, moe_intermediate: int, max_tokens: int, fp8: bool) -> None:
        return None


class TorchCollectives:
    """`Collectives` over the default torch.distributed process group (the whole instance)."""

    def __init__(self, topology: Topology) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; call init_process_group first")
        if dist.get_world_size() != topology.world_size or dist.get_rank() != topology.rank:
            raise ValueError(
                f"topology rank {topology.rank}/{topology.world_size} disagrees with the process group "
                f"{dist.get_rank()}/{dist.get_world_size()}"
            )
        self.topology = topology

    # NCCL's all-reduce could be captured, but this path is the reference (MOEBUS_KERNELS=reference, CPU): its
    # graphs were never tested, and its expert exchange sizes buffers on the host.
    all_reduce_in_graphs = False

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def all_agree(self, ok: bool) -> bool:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        flag = torch.tensor([int(ok)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def ep_dispatch(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts_per_rank: int
    ) -> EpDispatch:
        world = self.topology.world_size
        owner = topk_ids // experts_per_rank  # [T, k] rank owning each chosen expert
        # Token-granular: a token whose top-k hits two experts on one rank travels there once.
        per_rank = [torch.nonzero((owner == r).any(dim=-1)).flatten() for r in range(world)]
        send_index = torch.cat(per_rank) if per_rank else topk_ids.new_zeros(0)
        send_counts = [int(ix.numel()) for ix in per_rank]
        recv_counts = self._exchange_counts(send_counts, x.device)
        return EpDispatch(
            x=self._all_to_all(x[send_index], send_counts, recv_counts),
            topk_ids=self._all_to_all(topk_ids[send_index], send_counts, recv_counts),
            topk_weights=self._all_to_all(topk_weights[send_index], send_counts, recv_counts),
            send_index=send_index,
            send_counts=send_counts,
            recv_counts=recv_counts,
            num_tokens=x.shape[0],
        )

    def ep_combine(self, expert_out: torch.Tensor, dispatch: EpDispatch) -> torch.Tensor:
        back = self._all_to_all(expert_out, dispatch.recv_counts, dispatch.send_counts)
        out = expert_out.new_zeros((dispatch.num_tokens, expert_out.shape[-1]))
        return out.index_add_(0, dispatch.send_index, back)

    def decode_moe(self, num_experts: int, hidden: int, top_k: int, moe_intermediate: int, max_tokens: int, fp8: bool) -> DecodeMoE | None:
        return None  # the model composes ep_dispatch, its experts and ep_combine

    def _exchange_counts(self, send_counts: list[int], device: torch.device) -> list[int]:
        send = torch.tensor(send_counts, dtype=torch.int64, device=device)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        return recv.tolist()

    @staticmethod
    def _all_to_all(t: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        out = t.new_empty((sum(recv_counts), *t.shape[1:]))
        dist.all_to_all_single(out, t.contiguous(), output_split_sizes=recv_counts, input_split_sizes=send_counts)
        return out


def init_distributed(topology: Topology, device: torch.device, master_addr: str = "127.0.0.1", master_port: int = 29500) -> TorchCollectives:
    """Join the instance's process group (NCCL on CUDA, gloo on CPU) and return its collectives.

    On CUDA, unless ``MOEBUS_KERNELS=reference``, the TP all-reduce runs the
    peer-memory kernels (`shared.parallel_cuda.CudaCollectives`); torch.distributed
    stays the CPU path and the reference.
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        # DESIGN §6: NVLink multicast is never used.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        # The peer memory of the kernel collectives lands on the current device.
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=topology.rank,
        world_size=topology.world_size,
        device_id=device if device.type == "cuda" else None,
    )
    if use_kernels(device):
        from shared.parallel_cuda import CudaCollectives  # imports CuTeDSL: CUDA hosts only

        return CudaCollectives(topology)
    return TorchCollectives(topology)
