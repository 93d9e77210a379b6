"""GPU correctness of the Hopper grouped GEMM and the activation quantizer against fp32 torch references.

Every case draws fresh random inputs, poisons the output with NaN first (so an
unwritten element or a stray write shows), and covers empty experts, very
uneven counts, counts above ``max_tokens`` (masked), and K / N that are not
multiples of the tile.  Error bound for bf16 outputs of fp32 accumulation:
``|out - ref| <= 2^-7 |ref| + 2^-7 rms(ref)`` per element (bf16 rounding is
2^-9 relative) and ``||out - ref|| / ||ref|| < 4e-3``.  FP8 cases compare
with the reference on the same quantized operands, so the same bound holds.
"""

from __future__ import annotations

import pytest
import torch

from kernels import grouped_gemm as gg
from kernels.act_quant import FP8_MAX, quantize_act, quantize_act_reference, scale_row_stride

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FP8 = torch.float8_e4m3fn
DEV = "cuda"


def _assert_close(out: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    assert torch.isfinite(out).all(), f"{what}: non-finite values in written rows"
    out, ref = out.float(), ref.float()
    rms = ref.pow(2).mean().sqrt().item() if ref.numel() else 0.0
    bound = ref.abs() * 2.0**-7 + rms * 2.0**-7 + 1e-6
    worst = ((out - ref).abs() / bound).max().item() if ref.numel() else 0.0
    rel = ((out - ref).norm() / ref.norm().clamp(min=1e-30)).item() if ref.numel() else 0.0
    print(f"{what}: rel_fro={rel:.2e} worst/bound={worst:.2f}")
    assert worst <= 1.0 and rel < 4e-3, f"{what}: rel_fro={rel:.3e}, worst error / bound = {worst:.2f}"
    return rel


def _owned_rows_contiguous(offsets: torch.Tensor, T: int) -> torch.Tensor:
    owned = torch.zeros(T, dtype=torch.bool)
    o = offsets.tolist()
    for e in range(len(o) - 1):
        owned[o[e]:o[e + 1]] = True
    return owned


def _random_weights(E: int, N: int, K: int, fp8: bool, gen: torch.Generator):
    w = torch.randn(E, N, K, generator=gen, device=DEV) / K**0.5
    if not fp8:
        return w.bfloat16(), None
    # Per-128x128-block scales of different magnitudes (Qwen: dequant = w * scale).
    nb, kb = -(-N // 128), -(-K // 128)
    scale = torch.rand(E, nb, kb, generator=gen, device=DEV) * 3e-3 + 1e-4
    full = scale.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :N, :K]
    wq = (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return wq, scale


def _activations(shape, fp8: bool, gen: torch.Generator):
    x = torch.randn(*shape, generator=gen, device=DEV).bfloat16()
    if not fp8:
        return x, None
    return quantize_act(x)


CONTIGUOUS_COUNTS = {
    "uneven_decode": [0, 1, 7, 0, 64, 3, 0, 2],  # avg <= 64: 64-row tiles
    # avg in (64, 512]: 128-row tiles (bf16 128x192); FP8 stores by TMA the tiles of experts of >= 128 rows (the
    # last one moved back to end at the expert's last row: 300, 129, 700) and by the store warps the others (64, 2, 1)
    "uneven_prefill": [0, 300, 1, 129, 0, 700, 64, 2],
    # avg > 512: bf16 128x256 tiles
    "uneven_large": [0, 3000, 1, 2600, 128, 2900, 129, 700],
}


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("counts_name", list(CONTIGUOUS_COUNTS))
@pytest.mark.parametrize("row_weights", [False, True], ids=["plain", "rowweighted"])
def test_contiguous(fp8, counts_name, row_weights):
    gen = torch.Generator(device=DEV).manual_seed(hash((fp8, counts_name, row_weights)) % 2**31)
    counts = torch.tensor(CONTIGUOUS_COUNTS[counts_name])
    E, N, K = len(counts), 200, 272  # N, K not multiples of any tile
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    T = int(offsets[-1]) + 5  # trailing rows no expert owns
    x, xs = _activations((T, K), fp8, gen)
    w, ws = _random_weights(E, N, K, fp8, gen)
    rw = torch.rand(T, generator=gen, device=DEV) if row_weights else None
    out = torch.full((T, N), float("nan"), dtype=torch.bfloat16, device=DEV)
    gg.grouped_gemm(x, w, offsets.to(DEV), x_scale=xs, w_scale=ws, row_weights=rw, out=out)
    ref = gg.grouped_gemm_reference(x.cpu(), w.cpu(), offsets, masked=False, x_scale=None if xs is None else xs.cpu(),
                                    w_scale=None if ws is None else ws.cpu(), row_weights=None if rw is None else rw.cpu())
    owned = _owned_rows_contiguous(offsets, T)
    _assert_close(out.cpu()[owned], ref[owned], f"contiguous {counts_name} fp8={fp8} rw={row_weights}")
    assert torch.isnan(out.cpu()[~owned].float()).all(), "rows owned by no expert were written"


TILE_SHAPES = [(True, m, n) for m in (64, 128) for n in (128, 192)] + [(False, 128, n) for n in (128, 192, 256)]


@pytest.mark.parametrize("fp8, tile_m, tile_n", TILE_SHAPES, ids=[f"{'fp8' if f else 'bf16'}-{m}x{n}" for f, m, n in TILE_SHAPES])
def test_tile_widths(fp8, tile_m, tile_n):
    """Tiles forced to each shape the buckets use (contiguous layout). N = 712 ends mid-tile, K = 400
    mid-stage; an FP8 192-wide tile straddles two 128-row weight-scale blocks, split after 128
    columns (even tiles) or 64 (odd tiles)."""
    from kernels.grouped_gemm_launch import launch

    gen = torch.Generator(device=DEV).manual_seed(19 + tile_m + tile_n + 4 * (not fp8))
    counts = torch.tensor([0, 131, 5, 64, 0, 257])
    E, N, K = len(counts), 712, 400
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    T = int(offsets[-1])
    x, xs = _activations((T, K), fp8, gen)
    w, ws = _random_weights(E, N, K, fp8, gen)
    out = torch.full((T, N), float("nan"), dtype=torch.bfloat16, device=DEV)
    launch(x, w, offsets.to(DEV), masked=False, x_scale=xs, w_scale=ws, row_weights=None, swiglu=False, out=out,
           tile_m=tile_m, tile_n=tile_n)
    ref = gg.grouped_gemm_reference(x.cpu(), w.cpu(), offsets, masked=False, x_scale=None if xs is None else xs.cpu(),
                                    w_scale=None if ws is None else ws.cpu())
    _assert_close(out.cpu(), ref, f"{'fp8' if fp8 else 'bf16'} tile {tile_m}x{tile_n}")


@pytest.mark.parametrize("row_weights", [False, True], ids=["plain", "rowweighted"])
def test_fp8_last_row_tile_ends_at_its_expert_and_matches_bit_for_bit(row_weights):
    """FP8 prefill (``tma_store``): an expert of 375 rows runs row tiles at 0, 128 and 247, the last overlapping the
    one before by 9 rows, which two CTAs compute and write.  The same rows and weights split as experts of 256 and
    119 rows (tiles at 0 and 128, and a partial tile at 256 that the store warps write) give the same bits, and
    every row matches the fp32 reference; the rows after the expert stay unwritten."""
    from kernels.grouped_gemm_launch import choose_config

    assert choose_config(num_experts=2, n=2048, k=768, masked=False, fp8=True, swiglu=False, row_weights=row_weights,
                         tokens_per_expert=187.5, num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
                         ).tma_store
    gen = torch.Generator(device=DEV).manual_seed(29 + row_weights)
    N, K, T = 2048, 768, 375
    x, xs = _activations((T + 3, K), True, gen)
    w, ws = _random_weights(1, N, K, True, gen)
    w2, ws2 = w.expand(2, N, K).contiguous(), ws.expand(2, *ws.shape[1:]).contiguous()  # two experts, one weight
    rw = torch.rand(T + 3, generator=gen, device=DEV) if row_weights else None
    outs = []
    for counts in ([T, 0], [256, T - 256]):
        offsets = torch.tensor([0, counts[0], T], dtype=torch.int32, device=DEV)
        out = torch.full((T + 3, N), float("nan"), dtype=torch.bfloat16, device=DEV)
        gg.grouped_gemm(x, w2, offsets, x_scale=xs, w_scale=ws2, row_weights=rw, out=out)
        outs.append(out.cpu())
    whole, split = outs
    assert torch.isnan(whole[T:].float()).all() and torch.isnan(split[T:].float()).all(), "rows past the expert written"
    assert torch.equal(whole[:T], split[:T]), "the overlapping last tile changed the bits of some rows"
    ref = gg.grouped_gemm_reference(x.cpu(), w2.cpu(), torch.tensor([0, T, T], dtype=torch.int32), masked=False,
                                    x_scale=xs.cpu(), w_scale=ws2.cpu(), row_weights=None if rw is None else rw.cpu())
    _assert_close(whole[:T], ref[:T], f"fp8 375-row expert, shifted last tile, rw={row_weights}")


@pytest.mark.parametrize("tile_n,k,row_weights", [(192, 1088, False), (256, 1088, False), (192, 1088, True),
                                                   (192, 64, True), (256, 128, False)],
                         ids=["192-17stages", "256-17stages", "192-17stages-rowweighted", "192-1stage-rowweighted",
                              "256-2stages"])
def test_bf16_output_in_halves_across_tiles(tile_n, k, row_weights):
    """bf16 128x192 / 128x256 tiles of contiguous prefill (here ~250 tokens per expert, ``split_output``) hand their
    output to the store warps in two column halves through a half-size buffer, the second half kept in registers
    and written in the middle of the CTA's next tile (after its last tile, at the end).  21 M tiles x 16 / 12 N
    tiles: 2-3 / 1-2 tiles per CTA on 132 SMs; N = 2968 ends inside a half; K = 1088 is 17 stages (the held half
    written after the ninth is issued), K = 64 and 128 are 1 and 2 (written after the first / second); the held
    half of a row-weighted tile is already weighted; trailing rows owned by no expert stay unwritten."""
    from kernels.grouped_gemm_launch import launch

    gen = torch.Generator(device=DEV).manual_seed(29 + tile_n + k + row_weights)
    counts = torch.tensor([300, 280, 0, 513, 300, 1, 300, 299])
    E, N = len(counts), 2968
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    T = int(offsets[-1]) + 5
    x, _ = _activations((T, k), False, gen)
    w, _ = _random_weights(E, N, k, False, gen)
    rw = torch.rand(T, generator=gen, device=DEV) if row_weights else None
    out = torch.full((T, N), float("nan"), dtype=torch.bfloat16, device=DEV)
    launch(x, w, offsets.to(DEV), masked=False, x_scale=None, w_scale=None, row_weights=rw, swiglu=False, out=out,
           tile_m=128, tile_n=tile_n)
    ref = gg.grouped_gemm_reference(x.cpu(), w.cpu(), offsets, masked=False,
                                    row_weights=None if rw is None else rw.cpu())
    owned = _owned_rows_contiguous(offsets, T)
    _assert_close(out.cpu()[owned], ref[owned], f"bf16 128x{tile_n} K={k} rw={row_weights} output in halves")
    assert torch.isnan(out.cpu()[~owned].float()).all(), "rows owned by no expert were written"


@pytest.mark.parametrize("k", [768, 1664, 2048], ids=["6blocks", "13blocks", "16blocks"])
def test_fp8_192_wide_tiles_stage_scales_in_chunks(k):
    """FP8 128x192 tiles read their scales from shared memory, staged by warp 1's cp.async copies a chunk of K
    blocks at a time (``ScaleStaging``): 6 blocks one chunk of 8 ending in 2 padding blocks, read 2 at a time
    (Qwen3-30B down), 13 blocks two chunks of 8 (the second ends in 3 padding blocks), read one at a time, 16
    blocks two chunks of 8, read 4 at a time; the last expert's last tile runs past the tensor (its rows there
    have no scales and are not copied), and the weight-scale copies stop at the last K block.  21 M tiles x 16 N
    tiles: 2-3 tiles per CTA on 132 SMs, so the two scale stages wrap and the turns of the two consumer
    warpgroups run on across tiles.  Contiguous activation scales (as the torch reference makes them) are copied
    to the padded rows by the launcher, and NaN in the padding is never read: the same result bit for bit (16
    blocks have no padding)."""
    from kernels.grouped_gemm_launch import launch

    gen = torch.Generator(device=DEV).manual_seed(23 + k)
    counts = torch.tensor([300, 280, 0, 513, 300, 1, 300, 299])
    E, N = len(counts), 2968
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    x, xs = _activations((int(offsets[-1]), k), True, gen)
    w, ws = _random_weights(E, N, k, True, gen)
    out = torch.full((int(offsets[-1]), N), float("nan"), dtype=torch.bfloat16, device=DEV)
    launch(x, w, offsets.to(DEV), masked=False, x_scale=xs, w_scale=ws, row_weights=None, swiglu=False, out=out,
           tile_m=128, tile_n=192)
    ref = gg.grouped_gemm_reference(x.cpu(), w.cpu(), offsets, masked=False, x_scale=xs.cpu(), w_scale=ws.cpu())
    _assert_close(out.cpu(), ref, f"fp8 128x192 K={k}")
    kb = xs.shape[-1]
    nan_padded = torch.full((xs.shape[0], scale_row_stride(kb)), float("nan"), device=DEV)[:, :kb].copy_(xs)
    for scales, what in ((xs.contiguous(), "contiguous activation scales (copied by the launcher)"),
                         (nan_padded, "NaN in the padding of the activation-scale rows (read as they are)")):
        again = torch.full_like(out, float("nan"))
        launch(x, w, offsets.to(DEV), masked=False, x_scale=scales, w_scale=ws, row_weights=None, swiglu=False,
               out=again, tile_m=128, tile_n=192)
        assert torch.equal(again.view(torch.int16), out.view(torch.int16)), f"{what} changed the result"


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("max_tokens", [40, 136], ids=["decode_tile64", "tile128"])
def test_masked(fp8, max_tokens):
    gen = torch.Generator(device=DEV).manual_seed(7 + max_tokens + fp8)
    E, N, K = 6, 328, 144
    counts = torch.tensor([0, max_tokens, 1, max_tokens + 50, 17, 0], dtype=torch.int32)  # one above max_tokens
    x, xs = _activations((E, max_tokens, K), fp8, gen)
    w, ws = _random_weights(E, N, K, fp8, gen)
    out = torch.full((E, max_tokens, N), float("nan"), dtype=torch.bfloat16, device=DEV)
    gg.grouped_gemm(x, w, counts.to(DEV), masked=True, x_scale=xs, w_scale=ws, out=out)
    ref = gg.grouped_gemm_reference(x.cpu(), w.cpu(), counts, masked=True, x_scale=None if xs is None else xs.cpu(),
                                    w_scale=None if ws is None else ws.cpu())
    for e in range(E):
        c = min(int(counts[e]), max_tokens)
        if c:
            _assert_close(out[e, :c].cpu(), ref[e, :c], f"masked e={e} count={c} fp8={fp8}")
        assert torch.isnan(out[e, c:].cpu().float()).all(), f"expert {e}: rows past its count were written"


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
def test_swiglu_fused(fp8, masked):
    gen = torch.Generator(device=DEV).manual_seed(11 + 2 * fp8 + masked)
    E, I, K = 5, 192, 400  # 2I = 384: three 128-wide tiles; K not a multiple of 64/128
    w13, ws = _random_weights(E, 2 * I, K, fp8, gen)
    wi, si = gg.interleave_gate_up(w13, ws)
    if masked:
        M = 24
        groups = torch.tensor([3, 0, 24, 9, 30], dtype=torch.int32)
        x, xs = _activations((E, M, K), fp8, gen)
        rw = torch.rand(E, M, generator=gen, device=DEV)
        out = torch.full((E, M, I), float("nan"), dtype=torch.bfloat16, device=DEV)
    else:
        counts = torch.tensor([5, 0, 131, 1, 40])
        groups = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
        T = int(groups[-1])
        x, xs = _activations((T, K), fp8, gen)
        rw = torch.rand(T, generator=gen, device=DEV)
        out = torch.full((T, I), float("nan"), dtype=torch.bfloat16, device=DEV)
    gg.grouped_gemm_swiglu(x, wi, groups.to(DEV), masked=masked, x_scale=xs, w_scale_interleaved=si, row_weights=rw,
                           out=out)
    # Reference from the original (non-interleaved) weights: GEMM, then SwiGLU, then the row weight.
    h = gg.grouped_gemm_reference(x.cpu(), w13.cpu(), groups, masked=masked, x_scale=None if xs is None else xs.cpu(),
                                  w_scale=None if ws is None else ws.cpu())
    ref = gg.swiglu_reference(h) * rw.cpu()[..., None]
    if masked:
        for e in range(E):
            c = min(int(groups[e]), x.shape[1])
            if c:
                _assert_close(out[e, :c].cpu(), ref[e, :c], f"swiglu masked e={e} fp8={fp8}")
            assert torch.isnan(out[e, c:].cpu().float()).all()
    else:
        _assert_close(out.cpu(), ref, f"swiglu contiguous fp8={fp8}")


def test_quantize_act_matches_reference():
    gen = torch.Generator(device=DEV).manual_seed(3)
    x = (torch.randn(300, 1040, generator=gen, device=DEV) * 4).bfloat16()  # K = 8 blocks + 16
    x[5, :128] = 0
    q, s = quantize_act(x)
    q_ref, s_ref = quantize_act_reference(x.cpu())
    torch.testing.assert_close(s.cpu(), s_ref, rtol=1e-6, atol=0)
    diff = q.cpu().float() != q_ref.float()
    # Division rounding may flip a value at an exact E4M3 rounding midpoint: allow rare one-step differences.
    assert diff.float().mean() < 1e-3
    deq = q.cpu().float() * s.cpu().repeat_interleave(128, 1)[:, :1040]
    assert ((deq - x.cpu().float()).abs() <= x.cpu().float().abs() * 2.0**-4 + s.cpu().max() * 2.0**-9).all()


def test_empty_batch_and_all_empty_experts():
    E, N, K = 4, 64, 64
    w = torch.randn(E, N, K, device=DEV).bfloat16()
    x = torch.empty(0, K, device=DEV, dtype=torch.bfloat16)
    assert gg.grouped_gemm(x, w, torch.zeros(E + 1, dtype=torch.int32, device=DEV)).shape == (0, N)
    xm = torch.randn(E, 8, K, device=DEV).bfloat16()
    out = torch.full((E, 8, N), float("nan"), dtype=torch.bfloat16, device=DEV)
    gg.grouped_gemm(xm, w, torch.zeros(E, dtype=torch.int32, device=DEV), masked=True, out=out)
    torch.cuda.synchronize()
    assert torch.isnan(out.float()).all()


def test_cuda_graph_replay_follows_new_counts():
    """Counts live on the GPU: a captured launch must pick up changed counts on replay."""
    gen = torch.Generator(device=DEV).manual_seed(5)
    E, M, N, K = 8, 16, 256, 256
    x = torch.randn(E, M, K, generator=gen, device=DEV).bfloat16()
    w = torch.randn(E, N, K, generator=gen, device=DEV).bfloat16()
    counts = torch.full((E,), M, dtype=torch.int32, device=DEV)
    out = torch.zeros(E, M, N, dtype=torch.bfloat16, device=DEV)
    gg.grouped_gemm(x, w, counts, masked=True, out=out)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gg.grouped_gemm(x, w, counts, masked=True, out=out)
    counts.copy_(torch.tensor([0, 3, 16, 1, 0, 9, 2, 16], dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = gg.grouped_gemm_reference(x.cpu(), w.cpu(), counts.cpu(), masked=True)
    for e, c in enumerate(counts.tolist()):
        if c:
            _assert_close(out[e, :c].cpu(), ref[e, :c], f"graph replay e={e}")
        assert torch.isnan(out[e, c:].cpu().float()).all()


@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
@pytest.mark.parametrize("graph", [False, True], ids=["stream", "graph"])
def test_back_to_back_launches_wait_for_the_previous_kernel(masked, graph):
    """The kernel is launched with programmatic dependent launch: a launch may start while the one before it
    runs.  A chain whose every GEMM reads the previous one's output and overwrites what that one read (two
    buffers in turn) must equal the same chain with the device synchronized between launches, bit for bit.
    Fewer tiles than SMs: most CTAs of each launch exit at once, so the next launch's CTAs start early."""
    gen = torch.Generator(device=DEV).manual_seed(11)
    E, M, D, layers = 8, 48, 512, 6
    counts = [48, 17, 0, 33, 48, 5, 29, 40]
    ws = [(torch.randn(E, D, D, generator=gen, device=DEV) / D**0.5).bfloat16() for _ in range(layers)]
    shape = (E, M, D) if masked else (sum(counts), D)
    groups = (torch.tensor(counts, dtype=torch.int32, device=DEV) if masked else
              torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device=DEV))
    x = torch.randn(*shape, generator=gen, device=DEV).bfloat16()
    bufs = [torch.empty(*shape, dtype=torch.bfloat16, device=DEV) for _ in range(2)]

    def chain(sync: bool) -> None:
        for i, w in enumerate(ws):
            gg.grouped_gemm(bufs[i % 2], w, groups, masked=masked, out=bufs[(i + 1) % 2])
            if sync:
                torch.cuda.synchronize()

    def reset() -> None:
        bufs[0].copy_(x)
        bufs[1].fill_(float("nan"))

    reset()
    chain(sync=True)
    expected = bufs[layers % 2].clone()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            chain(sync=False)
    for _ in range(5):
        reset()
        g.replay() if graph else chain(sync=False)
        torch.cuda.synchronize()
        got = bufs[layers % 2]
        if masked:  # rows past each expert's count are never written (NaN from reset or earlier layers)
            for e, c in enumerate(counts):
                assert torch.equal(got[e, :c], expected[e, :c]), f"expert {e}"
        else:
            assert torch.equal(got, expected)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("kind", ["contiguous", "masked", "swiglu"])
def test_many_tiles_per_cta_with_k_tiles_not_a_multiple_of_stages(fp8, kind):
    """Each CTA runs several tiles and the pipeline wraps mid-tile (K = 1088: 17 bf16 / 9 FP8 K-steps).

    A pipeline state that is not carried from one tile to the next deadlocks or
    reads the wrong stage here; the small cases above fit one tile per CTA.
    """
    gen = torch.Generator(device=DEV).manual_seed(13 + fp8)
    K, N = 1088, 2304
    masked = kind != "contiguous"
    if masked:
        E, M = 16, 48
        groups = torch.tensor([48, 0, 17, 48, 5, 48, 48, 1, 48, 30, 48, 0, 48, 48, 2, 48], dtype=torch.int32)
        x, xs = _activations((E, M, K), fp8, gen)
    else:
        E = 8
        counts = torch.tensor([300, 280, 0, 513, 300, 1, 300, 299])
        groups = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
        x, xs = _activations((int(groups[-1]), K), fp8, gen)
    w, ws = _random_weights(E, N, K, fp8, gen)
    ref = gg.grouped_gemm_reference(x.cpu(), w.cpu(), groups, masked=masked, x_scale=None if xs is None else xs.cpu(),
                                    w_scale=None if ws is None else ws.cpu())
    if kind == "swiglu":
        wi, si = gg.interleave_gate_up(w, ws)
        out = gg.grouped_gemm_swiglu(x, wi, groups.to(DEV), masked=True, x_scale=xs, w_scale_interleaved=si)
        ref = gg.swiglu_reference(ref)
    else:
        out = gg.grouped_gemm(x, w, groups.to(DEV), masked=masked, x_scale=xs, w_scale=ws)
    torch.cuda.synchronize()
    if masked:
        for e in range(E):
            c = int(groups[e])
            if c:
                _assert_close(out[e, :c].cpu(), ref[e, :c], f"many tiles {kind} e={e} fp8={fp8}")
    else:
        _assert_close(out.cpu(), ref, f"many tiles {kind} fp8={fp8}")


def _mx_weights(E: int, N: int, K: int, gen: torch.Generator):
    """MXFP8 weights whose rows span 2^-12 .. 2^12, so E8M0 scales fall on both sides of 127 (2^0)."""
    from kernels.grouped_gemm_mxfp8 import quantize_mxfp8

    row_scale = torch.logspace(-12, 12, N, base=2.0, device=DEV)[torch.randperm(N, generator=gen, device=DEV)]
    w = torch.randn(E, N, K, generator=gen, device=DEV) / K**0.5 * row_scale[None, :, None]
    w[0, :, :32] = 0  # an all-zero block (smallest scale)
    return quantize_mxfp8(w)


# K sets the scale rows the kernel's TMA reads (kernels.grouped_gemm_mxfp8.kernel_scale_layout): 272 and 1088
# (9- and 34-byte rows) are copied into 16-byte padded rows; 1520 (48-byte rows, a K tail in the last stage) is
# taken as is; 752 (24 bytes, K tail) is copied when "masked_k752" passes a view one byte into its storage, and
# taken as is when "contiguous_rowweighted_k752" passes the padded layout itself.
@pytest.mark.parametrize("kind", ["contiguous", "contiguous_rowweighted", "masked", "swiglu", "many_tiles",
                                  "contiguous_k1520", "masked_k752", "contiguous_rowweighted_k752", "large",
                                  "large_rowweighted_k752"])
def test_mxfp8_weights_dequantized_in_kernel(kind):
    """bf16 x MXFP8 (dequantized in shared memory inside the kernel) against the fp32 reference on the same weights."""
    from kernels import grouped_gemm_mxfp8 as mx

    gen = torch.Generator(device=DEV).manual_seed(17 + len(kind))
    kind, _, k_override = kind.partition("_k")
    masked = kind in ("masked", "swiglu")
    E, N, K = (8, 2304, 1088) if kind == "many_tiles" else (6, 384 if kind == "swiglu" else 200, int(k_override or 272))
    if masked:
        M = 40
        groups = torch.tensor([0, 40, 1, 90, 17, 0], dtype=torch.int32)  # one count above max_tokens
        x = torch.randn(E, M, K, generator=gen, device=DEV).bfloat16()
    else:
        counts = torch.tensor({"contiguous": [0, 300, 1, 129, 0, 700],  # 128-row tiles (two warpgroups)
                               "contiguous_rowweighted": [0, 37, 1, 130, 0, 64],  # 64-row tiles
                               # above the mid bound (avg 555): 192-row tiles, experts ending inside a tile
                               "large": [0, 1300, 1, 700, 0, 1333],
                               "large_rowweighted": [193, 1100, 1, 191, 0, 1845],
                               "many_tiles": [300, 280, 0, 513, 300, 1, 300, 299]}[kind])
        groups = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
        x = torch.randn(int(groups[-1]), K, generator=gen, device=DEV).bfloat16()
    q, s = _mx_weights(E, N, K, gen)
    if k_override and masked:  # a view one byte into its storage: the launcher copies it into aligned rows
        s = torch.empty(s.numel() + 1, dtype=s.dtype, device=DEV)[1:].view(s.shape).copy_(s)
    elif k_override and kind.endswith("rowweighted"):
        s = mx.kernel_scale_layout(s)
        assert not s.is_contiguous()  # 32-byte rows holding 24 scales
    rw = torch.rand(x.shape[:-1], generator=gen, device=DEV) if kind.endswith("rowweighted") else None
    if kind == "swiglu":
        qi, si = mx.interleave_gate_up_mxfp8(q, s)
        out = torch.full((E, M, N // 2), float("nan"), dtype=torch.bfloat16, device=DEV)
        mx.grouped_gemm_mxfp8_swiglu(x, qi, si, groups.to(DEV), masked=True, out=out)
        ref = mx.grouped_gemm_mxfp8_swiglu(x.cpu(), qi.cpu(), si.cpu(), groups, masked=True)
    else:
        out = torch.full((*x.shape[:-1], N), float("nan"), dtype=torch.bfloat16, device=DEV)
        mx.grouped_gemm_mxfp8(x, q, s, groups.to(DEV), masked=masked, row_weights=rw, out=out)
        ref = mx.grouped_gemm_mxfp8(x.cpu(), q.cpu(), s.cpu(), groups, masked=masked,
                                    row_weights=None if rw is None else rw.cpu())
    torch.cuda.synchronize()
    if masked:
        for e in range(E):
            c = min(int(groups[e]), M)
            if c:
                _assert_close(out[e, :c].cpu(), ref[e, :c], f"mxfp8 {kind} e={e}")
            assert torch.isnan(out[e, c:].cpu().float()).all(), f"mxfp8 expert {e}: rows past its count were written"
    else:
        _assert_close(out.cpu(), ref, f"mxfp8 {kind}")


# (tile_m tokens, tile_n weight rows, kind, activations) of the swapped MXFP8 decode tiles: every token tile with 128
# weight rows per tile, the 256-row tiles (four consumer warpgroups) at both ends (FP8 activations: up to 32 tokens,
# see choose_config), for bf16 activations (weights converted in registers) and FP8 ones (FP8 math).
SWAPPED_CASES = [(m, 128, kind, act) for m in (8, 16, 32, 64) for kind in ("masked", "contiguous_rowweighted", "swiglu")
                 for act in ("bf16", "fp8")]
SWAPPED_CASES += [(m, 256, kind, "bf16") for m in (8, 64) for kind in ("masked", "swiglu")]
SWAPPED_CASES += [(m, 256, kind, "fp8") for m in (8, 32) for kind in ("masked", "swiglu")]


@pytest.mark.parametrize("tile_m,tile_n,kind,act", SWAPPED_CASES, ids=[f"{m}x{n}-{k}-{a}" for m, n, k, a in SWAPPED_CASES])
def test_mxfp8_swapped_decode_tiles(tile_m, tile_n, kind, act):
    """MXFP8 weights with the operands swapped (tokens as the MMA's N side; bf16 activations: weights converted in
    registers; FP8 activations: FP8 math, each 32-wide K block promoted with its scales): experts of several token
    tiles, of none, past ``max_tokens`` (masked), starting anywhere (contiguous); K = 272 ends mid-stage after an
    odd number of stages (FP8: 128-wide stages, the last one 16 wide); one expert's weights scaled by 2^20, so its
    E8M0 exponents pass 134 (the bf16 conversion's second multiply); rows past a count stay unwritten.  FP8 cases
    compare with the reference on the same quantized activations."""
    from kernels import grouped_gemm_mxfp8 as mx
    from kernels.grouped_gemm_launch import launch

    gen = torch.Generator(device=DEV).manual_seed(23 + tile_m + tile_n + len(kind))
    masked = kind != "contiguous_rowweighted"
    E, K = 6, 272
    N = 512 if kind == "swiglu" else 200
    q, s = _mx_weights(E, N, K, gen)
    q[3], s[3] = mx.quantize_mxfp8(mx.dequantize_mxfp8(q[3], s[3]) * 2.0**20)
    assert int(s[3].max()) > 134
    if masked:
        M = 40
        counts = [0, 40, 1, 90, 17, 9]
        x = torch.randn(E, M, K, generator=gen, device=DEV).bfloat16()
        groups = torch.tensor(counts, dtype=torch.int32)
    else:
        counts = [0, 37, 1, 20, 0, 9]
        groups = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)
        x = torch.randn(int(groups[-1]), K, generator=gen, device=DEV).bfloat16()
    rw = torch.rand(x.shape[:-1], generator=gen, device=DEV) if kind.endswith("rowweighted") else None
    xs = None
    if act == "fp8":
        x, xs = quantize_act(x)
    x_ref, xs_ref = x.cpu(), None if xs is None else xs.cpu()
    if kind == "swiglu":
        q, s = mx.interleave_gate_up_mxfp8(q, s)
        ref = mx.grouped_gemm_mxfp8_swiglu(x_ref, q.cpu(), s.cpu(), groups, masked=True, x_scale=xs_ref)
    else:
        ref = mx.grouped_gemm_mxfp8(x_ref, q.cpu(), s.cpu(), groups, masked=masked, x_scale=xs_ref,
                                    row_weights=None if rw is None else rw.cpu())
    out = torch.full(ref.shape, float("nan"), dtype=torch.bfloat16, device=DEV)
    launch(x, q, groups.to(DEV), masked=masked, x_scale=xs, w_scale=None, row_weights=rw, swiglu=kind == "swiglu",
           out=out, tile_m=tile_m, tile_n=tile_n, w_scale_e8m0=s, swap_ab=True)
    torch.cuda.synchronize()
    out = out.cpu()
    start = 0
    for e, c in enumerate(counts):
        rows = slice(0, min(c, M)) if masked else slice(start, start + c)
        got, want = (out[e], ref[e]) if masked else (out, ref)
        if c:
            _assert_close(got[rows], want[rows], f"swapped {tile_m}x{tile_n} {kind} e={e}")
        if masked:
            assert torch.isnan(got[rows.stop:].float()).all(), f"expert {e}: rows past its count were written"
        start += c
    if not masked:
        assert not torch.isnan(out.float()).any(), "a row of the contiguous layout was not written"
