"""`Collectives` on CUDA with the peer-memory kernels of `kernels/` (DESIGN §6).

* ``all_reduce`` runs our NVLink all-reduce (`kernels.allreduce.CudaAllReduce`:
  one-shot / two-shot, fp32 accumulation in rank order, identical bits on every
  rank, CUDA-graph safe). Strided or misaligned views are reduced through an
  aligned copy; dtypes other than bf16/fp16/fp32 go to NCCL.
* ``decode_moe`` (decode layout) hands the model a `PeerDecodeMoE`: the whole
  expert-parallel MoE layer as peer-memory dispatch -> masked grouped GEMMs ->
  combine (`kernels.dispatch_combine`, `kernels.moe.expert_ffn`: bf16, FP8
  block-scaled or MXFP8 experts), fixed-size buffers and nothing that
  synchronises with the host.
* ``ep_dispatch`` / ``ep_combine`` keep the NCCL path of `TorchCollectives` (the
  reference, and the path of models that do not take `decode_moe`): their contract
  (token-granular rows, receive sizes known on the host) does not fit the
  peer-memory kernels.

Construction of the collectives and of a `PeerDecodeMoE` is collective (it maps
peer memory on every rank) and loads the kernels, so it must happen before any
CUDA-graph capture.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from kernels.allreduce import SUPPORTED_DTYPES, CudaAllReduce
from kernels.dispatch_combine import DispatchCombine, DispatchCombineError
from kernels.moe import expert_ffn
from shared.model.layers import grouped_expert_weights
from shared.parallel import TorchCollectives, Topology

if TYPE_CHECKING:
    from shared.model.weights import MoEWeights


class CudaCollectives(TorchCollectives):
    """`TorchCollectives` with the all-reduce replaced by the peer-memory kernels, and
    the decode layout's MoE layer offered as `PeerDecodeMoE` (`decode_moe`)."""

    all_reduce_in_graphs = True  # bf16 / fp16 / fp32 on the GPU (what the model reduces); others go to NCCL

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

    def decode_moe(self, num_experts: int, hidden: int, top_k: int, moe_intermediate: int, max_tokens: int, fp8: bool) -> PeerDecodeMoE | None:
        """The peer-memory MoE layer for the decode layout (collective); None for other layouts."""
        if self.topology.layout != "decode" or self.topology.world_size < 2:
            return None
        return PeerDecodeMoE(dist.group.WORLD, num_experts, hidden, top_k, moe_intermediate, max_tokens, fp8)


class PeerDecodeMoE:
    """One decode-layout MoE layer over peer memory: dispatch -> masked grouped GEMMs -> combine.

    Every rank sends its tokens to the ranks owning their top-k experts
    (`DispatchCombine.dispatch_send`/`dispatch_recv`, which leave the rows of each
    local expert packed in ``[E_local, capacity, H]`` with the counts on the GPU);
    the fused gate/up + SwiGLU and the down projection run as masked grouped GEMMs
    on that layout; `combine_send`/`combine_recv` weight, sum and bring the rows
    home. FP8 block-scaled experts get an FP8 payload (quantized once, in the
    dispatch) and the intermediate is quantized for the down GEMM, as in
    `kernels.moe.grouped_moe`; MXFP8 experts take the bf16 payload, so they need
    ``fp8=False`` (`expert_ffn` quantizes the rows of decode-sized groups after the
    dispatch: their kernels run FP8 math only up to 64 tokens per expert).

    One instance serves every MoE layer of a model (layers run one after another,
    each round completes before the next): its buffers are sized once for
    ``max_tokens`` per rank, and a call allocates only its output. Nothing waits for
    the host, so a decode step can be captured in a CUDA graph; all ranks must call
    it the same number of times (an idle rank with zero tokens).
    """

    def __init__(self, group: dist.ProcessGroup, num_experts: int, hidden: int, top_k: int, moe_intermediate: int, max_tokens: int, fp8: bool) -> None:
        self.exchange = DispatchCombine(group, num_experts, max_tokens, hidden, top_k, "fp8" if fp8 else "bf16")
        self.max_tokens, self.hidden, self.fp8 = max_tokens, hidden, fp8
        self.top_k, self.num_experts = top_k, num_experts
        dev = self.exchange.mem.device
        rows = (self.exchange.num_local, self.exchange.capacity)
        self._num_tokens = torch.zeros(1, dtype=torch.int32, device=dev)
        self._h = torch.empty(*rows, moe_intermediate, dtype=torch.bfloat16, device=dev)
        self._y = torch.empty(*rows, hidden, dtype=torch.bfloat16, device=dev)

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: MoEWeights) -> torch.Tensor:
        """``out[t] = sum_j w[t, j] * expert_{ids[t, j]}(x[t])`` over all ranks' experts: ``[T, H]`` bf16.

        ``experts`` is this rank's shard with ``w13`` prepared for the fused SwiGLU GEMM
        (a `FusedGateUp`) and ``w2`` a bf16 tensor, an FP8 block-scaled or an MXFP8
        weight (see `shared.model.layers.grouped_expert_weights`); FP8 block-scaled
        experts exactly when this layer was built with ``fp8``.
        """
        t = x.shape[0]
        if t > self.max_tokens:
            raise DispatchCombineError(f"{t} tokens on this rank exceed the decode MoE's max_tokens={self.max_tokens}")
        weights = grouped_expert_weights(experts.w13, experts.w2)
        if self.fp8 != (weights.get("w2_scale") is not None):
            raise DispatchCombineError(f"decode MoE built for {'an FP8' if self.fp8 else 'a bf16'} payload got "
                                       f"{type(experts.w2).__name__} experts")
        ex = self.exchange
        ids = topk_ids.to(torch.int32).contiguous()
        self._num_tokens.fill_(t)
        ex.dispatch_send(x.contiguous(), ids, topk_weights.float().contiguous(), self._num_tokens)
        recv_x, recv_scales, counts, _ = ex.dispatch_recv()
        # The GEMMs' tiles suit the rows a step brings each expert, not the buffers' capacity
        # (every token of every rank): uniform routing, every rank stepping this many tokens.
        expected = ex.world * t * self.top_k / self.num_experts
        y = expert_ffn(recv_x, counts, masked=True, rows_scale=recv_scales, h_out=self._h, y_out=self._y,
                       expected_rows_per_expert=expected, **weights)
        ex.combine_send(y)
        out = torch.empty(self.max_tokens, self.hidden, dtype=torch.bfloat16, device=x.device)
        return ex.combine_recv(ids, self._num_tokens, out)[:t]
