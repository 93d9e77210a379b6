"""GPU all-reduce on every visible GPU (2..8): the CuTeDSL kernels against NCCL and the reference.

For sizes from 1 element to 256 MiB (odd sizes included), bf16 and fp32, the Lamport
one-shot, the Lamport two-shot, the barrier one-shot, the two-shot and the automatic
choice, out of place and in place:
* bit-equal to `all_reduce_reference` (fp32 sum in rank order) — the definition;
* close to NCCL's result (NCCL sums in its own order, so not bit-equal in bf16);
* bit-equal on every rank;
* every output element written (outputs are poisoned with NaN first).
A communicator with tiny slots, a tiny two-shot step, 3 CTAs and 96-thread one-shot and
Lamport two-shot CTAs runs the same checks on sizes that need many one-shot and Lamport
two-shot launches, many two-shot pipeline steps and many grid-stride rounds per thread,
with odd tails.
Inputs full of NaNs with every payload, the Lamport "unwritten" pattern (all-ones)
included, infinities and signed zeros must still give the reference's bits, and a
burst of back-to-back calls alternating the algorithms (no host sync between them)
must too: the Lamport slots are re-armed correctly from call to call.
Then the same under CUDA-graph capture and replay, with fresh inputs per replay.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from kernels._local_group import run_local_group

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

MIB = 1 << 20
WORLD = min(torch.cuda.device_count(), 8)  # 2 on the 2xH200 machine; 4 / 8 where lent
SIZES_BYTES = [2, 14, 16, 18, 4094, 8 * 1024, 65536 + 6, MIB + 2, 7 * MIB + 10, 64 * MIB + 22, 256 * MIB]


def _numel(nbytes: int, dtype: torch.dtype) -> int:
    return max(1, nbytes // torch.empty((), dtype=dtype).element_size())


def _fresh(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(numel, generator=g, device="cuda", dtype=torch.float32).to(dtype)


def _same_on_all_ranks(t: torch.Tensor) -> bool:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return all(torch.equal(p.view(torch.uint8), parts[0].view(torch.uint8)) for p in parts)


def _check(out: torch.Tensor, x: torch.Tensor, what: str) -> None:
    from kernels.allreduce import all_reduce_reference

    ref = all_reduce_reference(x)
    nccl = x.clone()
    dist.all_reduce(nccl)
    assert not out.isnan().any(), f"{what}: unwritten (NaN) elements"
    assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8)), f"{what}: differs from the rank-ordered fp32 reference"
    _assert_near_nccl(out, nccl, x, what)
    assert _same_on_all_ranks(out), f"{what}: ranks disagree"


def _assert_near_nccl(out: torch.Tensor, nccl: torch.Tensor, x: torch.Tensor, what: str) -> None:
    """NCCL sums in its own order and rounds after each step (bf16 too): ``out`` must lie within
    the rounding bound of two summation orders (`summation_order_bound`), element by element."""
    from kernels.allreduce import summation_order_bound

    excess = (out.float() - nccl.float()).abs() - summation_order_bound(x)
    assert not (excess > 0).any(), f"{what} vs NCCL: {int((excess > 0).sum())} elements beyond the rounding bound, worst by {float(excess.max()):.3g}"


def _run_sizes(comm, sizes: list[int], rank: int, what: str) -> int:
    checked = 0
    for dtype in (torch.bfloat16, torch.float32):
        for i, nbytes in enumerate(sizes):
            n = _numel(nbytes, dtype)
            algos = ["lamport", "lamport_two_shot", "one_shot", "two_shot", None] if nbytes <= 8 * MIB else ["two_shot", None]
            for algo in algos:
                x = _fresh(n, dtype, seed=7919 * rank + 31 * i + len(algos))
                out = torch.full_like(x, float("nan"))
                comm(x, out=out, algorithm=algo)
                _check(out, x, f"{what}: {dtype} {nbytes} B {algo or 'auto'} out-of-place")
                inplace = x.clone()
                comm(inplace, out=inplace, algorithm=algo)
                _check(inplace, x, f"{what}: {dtype} {nbytes} B {algo or 'auto'} in-place")
                checked += 2
            torch.cuda.synchronize()
    return checked


def _eager_cases(rank: int, world: int) -> int:
    from kernels.allreduce import CudaAllReduce

    comm = CudaAllReduce(dist.group.WORLD)
    comm.warmup()
    checked = _run_sizes(comm, SIZES_BYTES, rank, "default")
    tiny = CudaAllReduce(dist.group.WORLD, slot_bytes=64 << 10, two_shot_chunk_bytes=48 << 10, lamport_slot_bytes=32 << 10,
                         lamport_two_shot_slot_bytes=8 << 10)
    tiny.max_blocks = 3
    tiny.one_shot_threads = 96
    tiny.lamport_two_shot_threads = 96
    tiny.warmup()
    steps = -(-(MIB + 2) // 2 // tiny.two_shot_chunk_elems(2))
    assert steps > 8, f"the tiny communicator should take many pipeline steps, takes {steps}"
    checked += _run_sizes(tiny, [4094, MIB + 2, 3 * MIB + 10], rank, "tiny slots")
    checked += _special_values(comm, rank)
    checked += _back_to_back(comm, rank)
    return checked


def _special_values(comm, rank: int) -> int:
    """NaNs of every payload (all-ones included), infinities, signed zeros, on some ranks only."""
    checked = 0
    for dtype, bits in ((torch.bfloat16, torch.int16), (torch.float16, torch.int16), (torch.float32, torch.int32)):
        n = 70_001
        x = _fresh(n, dtype, seed=77 + rank)
        raw = x.view(bits)
        g = torch.Generator(device="cuda").manual_seed(5 + rank)
        pos = torch.randint(0, n, (4, 500), generator=g, device="cuda")
        raw[pos[0]] = -1  # all-ones: the Lamport "unwritten" pattern
        raw[pos[1]] = torch.randint(-(2**15) if bits == torch.int16 else -(2**31), -1, (500,), generator=g, device="cuda").to(bits) | (
            0x7F80 if dtype == torch.bfloat16 else 0x7C00 if dtype == torch.float16 else 0x7F800001)  # other NaN payloads
        x[pos[2]] = float("inf") if rank % 2 else float("-inf")
        x[pos[3]] = -0.0
        if rank == 0:
            raw[:64] = -1  # every element of the first vectors, on one rank only
        for algo in ("lamport", "lamport_two_shot", "one_shot", "two_shot"):
            out = torch.empty_like(x)
            comm(x, out=out, algorithm=algo)
            _check_bits(out, x, f"special values: {dtype} {algo}")
            checked += 1
    return checked


def _check_bits(out: torch.Tensor, x: torch.Tensor, what: str) -> None:
    from kernels.allreduce import all_reduce_reference

    ref = all_reduce_reference(x)
    assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8)), f"{what}: differs from the rank-ordered fp32 reference"
    assert _same_on_all_ranks(out), f"{what}: ranks disagree"


def _back_to_back(comm, rank: int) -> int:
    """20 calls in a row on one stream, algorithms and sizes alternating, checked after the last."""
    plan = [("lamport", 4096), ("lamport_two_shot", 300_001), ("one_shot", 5000), ("lamport", 17), ("two_shot", 200_000),
            ("lamport_two_shot", 17), ("lamport", 300_001), ("lamport_two_shot", 1 << 20), ("lamport_two_shot", 1 << 20),
            (None, 1 << 20)] * 2
    inputs = [_fresh(n, torch.bfloat16, seed=900 + 17 * i + rank) for i, (_, n) in enumerate(plan)]
    outs = [comm(x, algorithm=algo) for (algo, _), x in zip(plan, inputs)]
    for i, ((algo, n), x, out) in enumerate(zip(plan, inputs, outs)):
        _check_bits(out, x, f"back-to-back call {i}: {algo} {n}")
    return len(plan)


def _graph_cases(rank: int, world: int) -> int:
    from kernels.allreduce import CudaAllReduce

    comm = CudaAllReduce(dist.group.WORLD)
    comm.warmup()
    shapes = [(torch.bfloat16, 4099, "one_shot"), (torch.float32, 3 * MIB + 1, "two_shot"), (torch.bfloat16, 33 * MIB + 3, None),
              (torch.bfloat16, 300_001, "lamport"), (torch.float32, 5000, None), (torch.bfloat16, 500_003, "lamport_two_shot")]
    inputs = [torch.zeros(n, dtype=dt, device="cuda") for dt, n, _ in shapes]
    outputs = [torch.empty_like(x) for x in inputs]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            for (_, _, algo), x, out in zip(shapes, inputs, outputs):
                comm(x, out=out, algorithm=algo)
                comm(out, out=out, algorithm=algo)  # a second, in-place reduction of the first result
    torch.cuda.current_stream().wait_stream(stream)
    for replay in range(4):
        for i, x in enumerate(inputs):
            x.copy_(_fresh(x.numel(), x.dtype, seed=1000 * replay + 10 * i + rank))
            outputs[i].fill_(float("nan"))
        dist.barrier()
        graph.replay()
        torch.cuda.synchronize()
        from kernels.allreduce import all_reduce_reference

        for (dt, n, algo), x, out in zip(shapes, inputs, outputs):
            once = all_reduce_reference(x)
            twice = all_reduce_reference(once)
            assert torch.equal(out.view(torch.uint8), twice.view(torch.uint8)), f"graph replay {replay}: {dt} {n} {algo}"
            assert _same_on_all_ranks(out)
    return len(shapes) * 4


def test_all_reduce_matches_nccl_and_reference_eager():
    checked = run_local_group(_eager_cases, WORLD, "nccl", timeout=400)
    assert checked[0] > 0


def test_all_reduce_under_cuda_graph_replay():
    checked = run_local_group(_graph_cases, WORLD, "nccl", timeout=300)
    assert checked[0] == 24
