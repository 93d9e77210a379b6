"""GPU DP-EP dispatch/combine on every visible GPU (2..8) against the torch ``all_to_all_single`` reference.

Cases: random routing with different token counts per rank, every token's first
choice on one expert, zero tokens on a rank, the maximum token count, inputs with
fewer rows than ``max_tokens`` (as the model passes them), a grid of 8 tokens per
CTA (the default grid has one per CTA at this size; larger EP sizes walk several),
and an FP8 payload; each run eagerly and then inside a CUDA graph replayed with
fresh inputs.
Received rows are compared bit for bit after sorting by origin (our row order
inside an expert comes from atomics), counts exactly, the combined output to bf16
tolerance (the kernel may fuse multiply and add where the reference does not, which
can move a per-rank partial by one bf16 step before the final sum), and rows past
``num_tokens`` must be zero.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from kernels import dispatch_combine as dc
from kernels._local_group import run_local_group

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

WORLD = min(torch.cuda.device_count(), 8)  # 2 on the 2xH200 machine; 4 / 8 where lent (32 experts split evenly)
CFG = dict(num_experts=32, max_tokens=64, hidden=1024, topk=4)


def _inputs(rank: int, case: str, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed * 10 + rank)
    m, k, e, h = CFG["max_tokens"], CFG["topk"], CFG["num_experts"], CFG["hidden"]
    x = torch.randn(m, h, generator=g, device="cuda").bfloat16()
    scores = torch.rand(m, e, generator=g, device="cuda")
    if case == "one_expert":
        scores[:, 7] += 2.0
    ids = scores.topk(k, dim=1).indices.int().contiguous()
    # Token counts differ by rank; "% 48" keeps at least 8 tokens on every rank of a larger group
    # (ranks 0 and 1 keep the counts of the 2-GPU runs).
    n = {"random": m - 5 - (7 * rank) % 48, "one_expert": m - rank, "empty_rank": 0 if rank == 1 else m, "max_tokens": m,
         "short_rows": m - 9 - (20 * rank) % 48, "few_ctas": m - 2 - (11 * rank) % 48, "fp8": m - 3 * rank}[case]
    w = torch.rand(m, k, generator=g, device="cuda")
    if case == "short_rows":  # only the valid rows exist
        x, ids, w = x[:n].contiguous(), ids[:n].contiguous(), w[:n].contiguous()
    return x, ids, torch.tensor([n], dtype=torch.int32, device="cuda"), w


def _expert_op(recv_x: torch.Tensor, recv_scales: torch.Tensor | None, rank: int, num_local: int) -> torch.Tensor:
    x = recv_x.float()
    if recv_scales is not None:
        x = (x.view(*x.shape[:-1], -1, dc.FP8_GROUP) * recv_scales[..., None]).view(x.shape)
    factor = (torch.arange(num_local, device=x.device) + rank * num_local + 1).float() / 8
    return (x * factor[:, None, None]).bfloat16()


def _compare(ours, ref, out, ref_out, n: int, what: str) -> None:
    recv_x, recv_scales, counts, src = ours
    r_x, r_scales, r_counts, r_src = ref
    assert torch.equal(counts, r_counts), f"{what}: expert counts {counts.tolist()} != {r_counts.tolist()}"
    for le, c in enumerate(counts.tolist()):
        order = torch.argsort(src[le, :c])
        assert torch.equal(src[le, :c][order], r_src[le, :c]), f"{what}: expert {le} got other tokens"
        got, want = recv_x[le, :c][order].view(torch.uint8), r_x[le, :c].view(torch.uint8)
        assert torch.equal(got, want), f"{what}: expert {le} payload: {(got != want).sum().item()} of {want.numel()} bytes differ"
        if recv_scales is not None:
            assert torch.equal(recv_scales[le, :c][order], r_scales[le, :c]), f"{what}: expert {le} scales"
    assert not out.isnan().any(), f"{what}: unwritten output"
    torch.testing.assert_close(out[:n], ref_out[:n], rtol=1e-2, atol=1e-2, msg=lambda m: f"{what}: {m}")
    assert not out[n:].any(), f"{what}: rows past num_tokens are not zero"


def _run_case(rank: int, world: int, case: str) -> int:
    payload = "fp8" if case == "fp8" else "bf16"
    ours = dc.DispatchCombine(dist.group.WORLD, payload=payload, cpp=CFG["max_tokens"] // 8 if case == "few_ctas" else None, **CFG)
    ref = dc.DispatchCombineReference(dist.group.WORLD, payload=payload, **CFG)
    out = torch.empty(CFG["max_tokens"], CFG["hidden"], dtype=torch.bfloat16, device="cuda")
    y = torch.empty(ours.num_local, ours.capacity, CFG["hidden"], dtype=torch.bfloat16, device="cuda")

    def step(x, ids, n, w):
        ours.dispatch_send(x, ids, w, n)
        recv = ours.dispatch_recv()
        y.copy_(_expert_op(recv[0], recv[1], rank, ours.num_local))
        ours.combine_send(y)
        ours.combine_recv(ids, n, out)
        return recv

    def check(x, ids, n, w, what):
        # Copy our outputs before the reference runs (our next round rewrites them).
        snapshot = tuple(t.clone() if t is not None else None for t in (ours.recv_x, ours.recv_scales, ours.expert_counts, ours.recv_src))
        result = out.clone()
        torch.cuda.synchronize()
        r = ref.dispatch(x, ids, w, n)
        r_out = ref.combine(_expert_op(r[0], r[1], rank, ref.num_local), r[2], r[3], ids, n)
        _compare(snapshot, r, result, r_out, int(n), what)
        dist.barrier()

    for round_ in range(3):  # several eager rounds: buffers and flags are reused
        x, ids, n, w = _inputs(rank, case, seed=round_)
        out.fill_(float("nan"))
        step(x, ids, n, w)
        check(x, ids, n, w, f"{case} eager round {round_}")

    static = _inputs(rank, case, seed=99)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        step(*static)
    torch.cuda.current_stream().wait_stream(stream)
    for replay in range(3):
        for dst, src in zip(static, _inputs(rank, case, seed=200 + replay)):
            dst.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        check(*static, f"{case} graph replay {replay}")
    return 6


CASES = ["random", "one_expert", "empty_rank", "max_tokens", "short_rows", "few_ctas", "fp8"]


def _run_cases(rank: int, world: int) -> int:
    # One process group for all cases (each case maps its own peer memory): spawning
    # and initialising NCCL costs more than the checks themselves.
    return sum(_run_case(rank, world, case) for case in CASES)


def test_dispatch_combine_matches_all_to_all_reference():
    assert run_local_group(_run_cases, WORLD, "nccl", timeout=300) == [6 * len(CASES)] * WORLD
