"""`CudaCollectives` (shared/parallel_cuda.py) on 2 GPUs: the model-facing all-reduce.

Our kernel path must equal the rank-ordered fp32 reference bit for bit, also for a
strided view (reduced through an aligned copy), and an int64 tensor goes to NCCL.
"""

from __future__ import annotations

import pytest
import torch

from kernels._local_group import run_local_group

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]


def _rank(rank: int, world: int) -> bool:
    from kernels.allreduce import all_reduce_reference
    from shared.parallel import Topology
    from shared.parallel_cuda import CudaCollectives

    comm = CudaCollectives(Topology.prefill(world, rank))
    g = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randn(6000, 4096, generator=g, device="cuda").bfloat16()
    expected = all_reduce_reference(x)
    assert comm.all_reduce(x) is x
    assert torch.equal(x, expected)
    y = torch.randn(64, 256, generator=g, device="cuda")
    strided, outside = y[:, ::2], y[:, 1::2].clone()
    expected = all_reduce_reference(strided.contiguous())
    comm.all_reduce(strided)
    assert torch.equal(strided, expected)
    assert torch.equal(y[:, 1::2], outside), "the columns outside the view changed"
    counts = torch.full((5,), rank + 1, dtype=torch.int64, device="cuda")
    assert torch.equal(comm.all_reduce(counts), torch.full_like(counts, world * (world + 1) // 2))
    return True


def test_cuda_collectives_all_reduce():
    assert run_local_group(_rank, 2, "nccl", timeout=180) == [True, True]
