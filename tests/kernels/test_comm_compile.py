"""CPU checks of the communication kernels (runs in CI, no GPU).

* Every CuTeDSL communication kernel compiles for sm_90a, for several world sizes,
  ranks, dtypes and payloads, and its PTX carries the system-scope release/acquire
  signalling and no NVLink multicast instruction.
* The torch reference implementations (the definitions the GPU kernels are tested
  against) match simple brute-force definitions, in real multi-process gloo groups
  where they communicate.
"""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest
import torch
import torch.distributed as dist
from cutlass import Int32, Int64

import cutlass.cute as cute
from kernels import allreduce as ar
from kernels import allreduce_sm90 as ar_k
from kernels import dispatch_combine as dc
from kernels import ep_prefill as ep
from kernels._cute_runtime import dummy_stream
from kernels._local_group import run_local_group

# --------------------------------------------------------------------------- compilation


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("world,rank", [(2, 0), (2, 1), (3, 2), (8, 5)])
def test_all_reduce_kernels_compile(dtype, world, rank):
    assert ar_k.compile_lamport(dtype, world, rank, two_shot=False) is not None
    assert ar_k.compile_lamport(dtype, world, rank, two_shot=True) is not None
    assert ar_k.compile_one_shot(dtype, world, rank) is not None
    assert ar_k.compile_two_shot(dtype, world, rank) is not None


def test_lamport_kernels_compile_for_fp16():
    assert ar_k.compile_lamport(torch.float16, 4, 3, two_shot=False) is not None
    assert ar_k.compile_lamport(torch.float16, 4, 3, two_shot=True) is not None


@pytest.mark.parametrize("rank", [0, 2])
def test_lamport_two_shot_compiles_at_4_ranks(rank):
    assert ar_k.compile_lamport(torch.bfloat16, 4, rank, two_shot=True) is not None


@pytest.mark.parametrize("dtype,topk", [(torch.bfloat16, 8), (torch.float32, 2)])
@pytest.mark.parametrize("ids_dtype,weights_dtype", [(torch.int64, torch.bfloat16), (torch.int32, torch.float32)])
def test_ep_prefill_kernels_compile(dtype, topk, ids_dtype, weights_dtype):
    """Routing ids and weights are read at their own width (no conversion kernel before): ids 8 bytes apart and
    16-bit weight loads in the PTX where the router's int64 / bf16 tensors are given."""
    assert ep.compile_select(topk, ids_dtype) is not None
    assert ep.compile_combine(dtype, topk, weights_dtype) is not None
    z, i, cd = Int64(0), Int32(0), ep._CUTE_DTYPES[dtype]
    select_ptx = _ptx(ep._launch_select, z, z, i, i, i, i, i, z, z, z, z, z, z, z, i, Int32(1), dummy_stream(), topk,
                      ep._ID_BYTES[ids_dtype])
    combine_ptx = _ptx(ep._launch_combine, z, z, z, i, i, z, Int32(1), dummy_stream(), cd, topk,
                       ep._CUTE_DTYPES[weights_dtype])
    count_kernel = next(body for body in select_ptx.split(".entry")[1:] if "count_kernel" in body.split("(")[0])
    # the count kernel's only wide multiplies: id index * id width, local expert * 4
    assert (re.search(r"mul\.wide\.s32\s+%rd\d+, %r\d+, 8;", count_kernel) is not None) == (ids_dtype == torch.int64)
    assert ("ld.global.b16" in combine_ptx) == (weights_dtype == torch.bfloat16)
    # rows and scale rows move as 16-byte words, never through fp32
    scatter_kernel = next(body for body in select_ptx.split(".entry")[1:] if "scatter_kernel" in body.split("(")[0])
    assert "ld.global.v4.b32" in scatter_kernel and "st.global.v4.b32" in scatter_kernel
    assert re.search(r"cvt\.[a-z0-9.]*f(16|32)", scatter_kernel) is None


@pytest.mark.parametrize(
    "world,rank,experts,hidden,topk,payload",
    [(2, 0, 128, 4096, 8, "bf16"), (2, 1, 128, 4096, 8, "fp8"), (16, 9, 32, 384, 3, "fp8")],
)
def test_dispatch_combine_kernels_compile(world, rank, experts, hidden, topk, payload):
    kernels = dc.compile_kernels(world, rank, experts, hidden, topk, payload)
    assert len(kernels) == 4 and all(k is not None for k in kernels)


def _ptx(launcher, *args) -> str:
    return cute.compile(launcher, *args, options="--keep-ptx").__ptx__


def test_ptx_signals_at_system_scope_and_never_uses_multicast(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --keep-ptx writes its file into the working directory
    z, s = Int64(0), dummy_stream()
    two_shot = _ptx(ar_k._launch_two_shot, z, z, Int32(0), Int32(0), z, z, z, z, z, z, Int32(1), s, ar_k.CUTE_DTYPES[torch.bfloat16], 4, 1)
    i = Int32(1)
    lamport = _ptx(ar_k._launch_lamport, z, z, Int32(0), *[z] * 4, i, i, s, ar_k.CUTE_DTYPES[torch.bfloat16], 3, 1, False)
    lamport_two_shot = _ptx(ar_k._launch_lamport, z, z, Int32(0), *[z] * 4, i, i, s, ar_k.CUTE_DTYPES[torch.bfloat16], 4, 2, True)
    dispatch = _ptx(dc._launch_dispatch_send, *[z] * 12, i, i, s, 2, 0, 64, 4096, 8, True)
    combine_recv = _ptx(dc._launch_combine_recv, *[z] * 7, i, i, s, 2, 0, 64, 4096, 8)
    for ptx in (two_shot, lamport, lamport_two_shot, dispatch, combine_recv):
        assert "multimem" not in ptx
    # The data-as-flag kernels poll past L1 and need no fence or flag.
    for ptx in (lamport, lamport_two_shot):
        assert "ld.volatile.global.v4.b32" in ptx
        assert "fence" not in ptx and ".release" not in ptx and ".acquire" not in ptx
    assert "st.release.sys.global.b32" in two_shot and "ld.acquire.sys.global.b32" in two_shot
    assert "fence.acq_rel.sys" in two_shot
    assert "red.release.sys.global.add" in dispatch  # each CTA counts itself into the receiver's flag
    assert "cvt.rn.satfinite.e4m3x2.f32" in dispatch and "div.rn.f32" in dispatch
    assert "ld.acquire.sys.global.b32" in combine_recv


# --------------------------------------------------------------------------- all-reduce choice


def _default_choice(world: int, nbytes: int) -> str:
    """`CudaAllReduce.choose` with the thresholds its constructor sets by default (no GPU needed)."""
    one_shot_max = ar.default_one_shot_max_bytes(world)
    thresholds = SimpleNamespace(lamport_max_bytes=min(ar.default_lamport_slot_bytes(world), one_shot_max),
                                 lamport_two_shot_max_bytes=ar.default_lamport_two_shot_max_bytes(world), one_shot_max_bytes=one_shot_max)
    return ar.CudaAllReduce.choose(thresholds, nbytes)


def test_default_choice_by_size_and_world():
    MiB = 1 << 20
    # 2 ranks (measured): the Lamport one-shot to 4 MiB, the data-as-flag two-shot to 16 MiB, then the barrier two-shot.
    assert [_default_choice(2, b) for b in (8 << 10, 4 * MiB, 4 * MiB + 16, 16 * MiB, 16 * MiB + 16)] == [
        "lamport", "lamport", "lamport_two_shot", "lamport_two_shot", "two_shot"]
    # 4 ranks: the Lamport one-shot only to 512 KiB (it moves (world - 1) x the message); above, the barrier two-shot
    # (the data-as-flag two-shot has not run at more than 2 ranks, so it is no default there).
    assert [_default_choice(4, b) for b in (512 << 10, MiB, 8 * MiB, 64 * MiB)] == ["lamport", "two_shot", "two_shot", "two_shot"]
    assert _default_choice(8, 256 << 10) == "two_shot" and _default_choice(8, 128 << 10) == "lamport"
    assert {_default_choice(w, 16 * MiB) for w in range(3, 9)} == {"two_shot"}


# --------------------------------------------------------------------------- all-reduce reference


def _rank_input(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return (torch.randn(numel, generator=g) * (rank + 1)).to(dtype)


def _all_reduce_rank(rank: int, world: int, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
    x = _rank_input(rank, numel, dtype)
    out_of_place = ar.all_reduce(x)
    in_place = x.clone()
    ar.all_reduce(in_place, out=in_place)
    return [out_of_place, in_place, ar.all_reduce_reference(x)]


@pytest.mark.parametrize("world", [3])
def test_all_reduce_reference_is_rank_ordered_fp32_sum(world):
    numel, dtype = 1031, torch.bfloat16
    results = run_local_group(_all_reduce_rank, world, "gloo", numel, dtype, timeout=120)
    acc = _rank_input(0, numel, dtype).float()
    for r in range(1, world):
        acc = acc + _rank_input(r, numel, dtype).float()
    expected = acc.to(dtype)
    for per_rank in results:
        for got in per_rank:
            assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


def _cancelling_input(rank: int, numel: int) -> torch.Tensor:
    """Ranks 0 and 2 cancel (x and -x, large); 1 and 3 are small: partial sums are ~64x the result."""
    big = torch.randn(numel, generator=torch.Generator().manual_seed(7)) * 64
    small = torch.randn(numel, generator=torch.Generator().manual_seed(100 + rank))
    return {0: big, 2: -big}.get(rank, small).bfloat16()


def _order_rank(rank: int, world: int, numel: int) -> list[torch.Tensor]:
    x = _cancelling_input(rank, numel)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    ring = parts[-1]
    for p in reversed(parts[:-1]):  # another order, rounding to bf16 after every step (as NCCL's ring does)
        ring = (ring.float() + p.float()).bfloat16()
    return [ar.all_reduce_reference(x), ring, ar.summation_order_bound(x)]


def test_summation_order_bound_covers_another_order_with_rounding_at_every_step():
    reference, ring, bound = run_local_group(_order_rank, 4, "gloo", 4096, timeout=120)[0]
    diff = (reference.float() - ring.float()).abs()
    assert (diff <= bound).all()
    # Not vacuous: the orders differ by more than a bound relative to the result would allow.
    assert (diff > torch.finfo(torch.bfloat16).eps * reference.float().abs()).any()
    assert float((diff / bound).max()) > 0.01


# --------------------------------------------------------------------------- prefill EP reference


def _routing(tokens: int, experts: int, topk: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)]).int()


@pytest.mark.parametrize("align", [1, 4])
def test_ep_select_and_combine_reference_match_brute_force(align):
    tokens, hidden, experts, topk, start, num_local = 37, 16, 12, 3, 4, 5
    x = torch.randn(tokens, hidden).bfloat16()
    ids = _routing(tokens, experts, topk, seed=3)
    ids[:5] = torch.tensor([4, 0, 1]).int()  # skew: several tokens on the first local expert
    sel = ep.ep_select(x, ids, start, num_local, align)
    counts = [sum(int((ids[t] == start + e).sum()) for t in range(tokens)) for e in range(num_local)]
    assert sel.counts.tolist() == counts
    padded = [-(-c // align) * align for c in counts]
    assert sel.offsets.tolist() == [sum(padded[:e]) for e in range(num_local + 1)]
    for t in range(tokens):
        for j in range(topk):
            e = int(ids[t, j]) - start
            row = int(sel.row_of[t, j])
            if 0 <= e < num_local:
                assert sel.offsets[e] <= row < sel.offsets[e] + counts[e]
                assert torch.equal(sel.rows[row], x[t])
            else:
                assert row == -1
    y = (sel.rows.float() * 1.5).bfloat16()
    w = torch.rand(tokens, topk)
    out = ep.ep_combine(y, sel.row_of, w)
    for t in range(tokens):
        acc = torch.zeros(hidden)
        for j in range(topk):
            if sel.row_of[t, j] >= 0:
                acc = acc + w[t, j] * y[sel.row_of[t, j]].float()
        assert torch.equal(out[t], acc.bfloat16())


# --------------------------------------------------------------------------- dispatch/combine reference

DC = dict(num_experts=12, max_tokens=6, hidden=256, topk=3)


def _dc_inputs(rank: int, case: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + rank)
    m, k, e = DC["max_tokens"], DC["topk"], DC["num_experts"]
    x = torch.randn(m, DC["hidden"], generator=g).bfloat16()
    if case == "random":
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)]).int()
        n = m - rank
    else:  # every token's first choice is expert 7, and rank 1 has no tokens at all
        others = [i for i in range(e) if i != 7]
        ids = torch.stack([torch.tensor([7] + [others[i] for i in torch.randperm(e - 1, generator=g)[: k - 1]]) for _ in range(m)]).int()
        n = 0 if rank == 1 else m
    w = torch.rand(m, k, generator=g)
    return x, ids, torch.tensor([n], dtype=torch.int32), w


def _expert_fn(recv_x: torch.Tensor, recv_scales: torch.Tensor | None, rank: int, num_local: int) -> torch.Tensor:
    """A stand-in for the expert GEMMs: scale each expert's rows by (global expert id + 1) / 8."""
    x = recv_x.float()
    if recv_scales is not None:
        x = (x.view(*x.shape[:-1], -1, dc.FP8_GROUP) * recv_scales[..., None]).view(x.shape)
    factor = (torch.arange(num_local) + rank * num_local + 1).float() / 8
    return (x * factor[:, None, None]).bfloat16()


def _dc_rank(rank: int, world: int, case: str, payload: str) -> dict:
    ref = dc.make_dispatch_combine(dist.group.WORLD, payload=payload, device=torch.device("cpu"), **DC)
    x, ids, n, w = _dc_inputs(rank, case)
    recv_x, recv_scales, counts, recv_src = ref.dispatch(x, ids, w, n)
    y = _expert_fn(recv_x, recv_scales, rank, ref.num_local)
    out = ref.combine(y, counts, recv_src, ids, n)
    return {"recv_x": recv_x.view(torch.uint8) if payload == "fp8" else recv_x, "scales": recv_scales, "counts": counts, "src": recv_src, "out": out}


@pytest.mark.parametrize("world,case,payload", [(2, "random", "bf16"), (3, "one_expert_empty_rank", "fp8")])
def test_dispatch_combine_reference_matches_brute_force(world, case, payload):
    results = run_local_group(_dc_rank, world, "gloo", case, payload, timeout=120)
    num_local = DC["num_experts"] // world
    inputs = [_dc_inputs(r, case) for r in range(world)]
    for rank, res in enumerate(results):
        for le in range(num_local):
            expert = rank * num_local + le
            expected = [(src, t, j) for src, (x, ids, n, w) in enumerate(inputs) for t in range(int(n)) for j in range(DC["topk"]) if ids[t, j] == expert]
            assert int(res["counts"][le]) == len(expected)
            for i, (src, t, j) in enumerate(expected):
                assert int(res["src"][le, i]) == (src << dc.SRC_RANK_SHIFT) | (t * DC["topk"] + j)
                if payload == "fp8":
                    q, s = dc.quantize_per_token_group(inputs[src][0][t])
                    assert torch.equal(res["recv_x"][le, i], q.view(torch.uint8))
                    assert torch.equal(res["scales"][le, i], s)
                else:
                    assert torch.equal(res["recv_x"][le, i], inputs[src][0][t])
        x, ids, n, w = inputs[rank]
        for t in range(DC["max_tokens"]):
            # Per rank q holding some of t's experts: the fp32 sum over t's slots on q, in slot
            # order, rounded to bf16; then the fp32 sum of those partials in rank order.
            acc = torch.zeros(DC["hidden"])
            for q in range(world):
                partial = torch.zeros(DC["hidden"])
                used = False
                for j in range(DC["topk"]) if t < int(n) else ():
                    e = int(ids[t, j])
                    if e // num_local != q:
                        continue
                    used = True
                    row = x[t].float()
                    if payload == "fp8":
                        qx, s = dc.quantize_per_token_group(x[t])
                        row = (qx.float().view(-1, dc.FP8_GROUP) * s[:, None]).view(-1)
                    partial = partial + w[t, j] * (row * (e + 1) / 8).bfloat16().float()
                if used:
                    acc = acc + partial.bfloat16().float()
            assert torch.equal(res["out"][t], acc.bfloat16()), f"rank {rank} token {t}"


def test_dispatch_combine_rejects_bad_config():
    with pytest.raises(dc.DispatchCombineError):
        dc._check_config(2, 7, 4, 256, 2, "bf16")  # experts not divisible by ranks
    with pytest.raises(dc.DispatchCombineError):
        dc._check_config(2, 8, 4, 200, 2, "bf16")  # hidden not a multiple of 128
    with pytest.raises(dc.DispatchCombineError):
        dc._check_config(17, 34, 4, 256, 2, "bf16")  # more ranks than peer slots
