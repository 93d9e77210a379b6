"""`init_distributed` on every visible GPU (2..8): the CUDA branch and the model-facing all-reduce it returns.

Each rank is a spawned process that calls ``init_distributed(Topology.prefill(world, rank),
cuda:rank)`` itself, the way a prefill rank starts. It must get `CudaCollectives`,
whose ``all_reduce`` (in place, returns its argument) must equal the rank-ordered fp32
reference bit for bit and NCCL within rounding, for bf16 / fp16 / fp32 at sizes that
take the one-shot kernels, the Lamport two-shot (at 3..8 ranks) and the two-shot kernel,
a strided view (reduced through an aligned copy; the columns outside the view stay
untouched) and a misaligned view; int64 goes to NCCL. Then the same reductions captured in one CUDA graph, replayed with fresh inputs.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from kernels._local_group import spawn_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

WORLD = min(torch.cuda.device_count(), 8)  # 2 on the 2xH200 machine; 4 / 8 where lent
MIB = 1 << 20


def _fresh(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=g, device="cuda").to(dtype)


def _cases(rank: int, seed: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, tensor to reduce in place, the whole allocation it views) for one round."""
    s = 100 * seed + rank
    one_shot = _fresh((64, 4096), torch.bfloat16, s)  # 512 KiB
    one_mib = _fresh((128, 4096), torch.bfloat16, s + 6)  # 1 MiB: the Lamport two-shot at 3..8 ranks
    two_shot = _fresh((2048, 5120), torch.bfloat16, s + 1)  # 20 MiB, above the one-shot limit
    fp32 = _fresh((3, 1000, 333), torch.float32, s + 2)  # odd size
    fp16 = _fresh((4099,), torch.float16, s + 3)
    wide = _fresh((64, 256), torch.float32, s + 4)
    flat = _fresh((4097,), torch.bfloat16, s + 5)
    return [
        ("bf16 one-shot", one_shot, one_shot),
        ("bf16 1 MiB", one_mib, one_mib),
        ("bf16 two-shot", two_shot, two_shot),
        ("fp32 odd", fp32, fp32),
        ("fp16", fp16, fp16),
        ("fp32 strided view", wide[:, ::2], wide),
        ("bf16 misaligned view", flat[1:], flat),
    ]


def _check_round(comm, cases, what: str) -> None:
    """``cases`` hold the inputs before and the tensors after ``comm.all_reduce``."""
    from kernels.allreduce import all_reduce_reference, summation_order_bound

    for (name, before, whole_before), (_, after, whole_after) in cases:
        expected = all_reduce_reference(before.contiguous())
        nccl = before.contiguous().clone()
        dist.all_reduce(nccl)
        assert torch.equal(after.contiguous().view(torch.uint8), expected.view(torch.uint8)), f"{what} {name}: not the reference"
        # NCCL sums in its own order, rounding after each step: within that rounding's bound.
        excess = (after.contiguous().float() - nccl.float()).abs() - summation_order_bound(before.contiguous())
        assert not (excess > 0).any(), f"{what} {name} vs NCCL: {int((excess > 0).sum())} elements beyond the rounding bound"
        outside = torch.ones_like(whole_before, dtype=torch.bool)
        outside.view(-1)[_view_positions(before, whole_before)] = False
        assert torch.equal(whole_after[outside], whole_before[outside]), f"{what} {name}: elements outside the view changed"


def _view_positions(view: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """Flat indices into ``whole`` of the elements ``view`` covers."""
    index = torch.arange(whole.numel(), device=whole.device).view(whole.shape)
    return index.as_strided(view.shape, view.stride(), view.storage_offset() - whole.storage_offset()).reshape(-1)


def _snapshot(cases):
    return [(name, whole.clone().as_strided(x.shape, x.stride(), x.storage_offset() - whole.storage_offset()), whole.clone())
            for name, x, whole in cases]


def _rank_checks(rank: int, world: int, port: int) -> int:
    from shared.parallel import Topology, init_distributed
    from shared.parallel_cuda import CudaCollectives

    device = torch.device("cuda", rank)
    comm = init_distributed(Topology.prefill(WORLD, rank), device, master_port=port)
    try:
        assert type(comm) is CudaCollectives, f"init_distributed returned {type(comm).__name__}"
        assert torch.cuda.current_device() == rank, "init_distributed left another device current"
        assert os.environ["NCCL_NVLS_ENABLE"] == "0" and os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"

        # eager
        cases = _cases(rank, seed=0)
        before = _snapshot(cases)
        for _, x, _ in cases:
            assert comm.all_reduce(x) is x
        torch.cuda.synchronize()
        _check_round(comm, list(zip(before, cases)), "eager")
        counts = torch.full((5,), rank + 1, dtype=torch.int64, device=device)
        assert torch.equal(comm.all_reduce(counts), torch.full_like(counts, WORLD * (WORLD + 1) // 2))

        # CUDA graph: the same calls captured once, replayed on fresh inputs
        cases = _cases(rank, seed=1)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            for _, x, _ in cases:
                comm.all_reduce(x)
        torch.cuda.current_stream().wait_stream(stream)
        for replay in range(3):
            for (_, _, whole), (_, _, fresh) in zip(cases, _cases(rank, seed=2 + replay)):
                whole.copy_(fresh)
            before = _snapshot(cases)
            dist.barrier()
            graph.replay()
            torch.cuda.synchronize()
            _check_round(comm, list(zip(before, cases)), f"graph replay {replay}")
        return len(cases)
    finally:
        dist.destroy_process_group()


def test_init_distributed_on_cuda_returns_kernel_collectives_matching_nccl(monkeypatch):
    monkeypatch.delenv("MOEBUS_KERNELS", raising=False)  # the default (auto) picks the kernels on CUDA
    assert spawn_ranks(_rank_checks, WORLD, timeout=240) == [7] * WORLD
