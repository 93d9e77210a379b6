"""kernels.moe.grouped_moe on the CPU (every step's torch reference) against an independent loop.

The loop below computes each token's weighted expert sum in float64 from the same
weights: ``sum_j w_j * down_e(silu(gate_e x) * up_e x)``. grouped_moe rounds the
SwiGLU output and the down output to bf16 (as the kernels write them) and the final
sum once, so it must agree to a few bf16 roundings: relative Frobenius error below
2^-7 and every element within ``2^-6 |ref| + 2^-7 rms(ref)``. FP8 adds activation
quantization; the loop then quantizes exactly where the kernels do (rows before
gate/up, the bf16 SwiGLU output before down), so the same bound holds up to the
rare E4M3 rounding flips a one-ulp bf16 difference causes (relative Frobenius
error below 2^-5). MXFP8 weights multiply bf16 rows (no activation quantization),
except decode-sized masked groups, which quantize as FP8 does: the loop runs on the
dequantized weights, and the bf16 bounds hold for either.
"""

from __future__ import annotations

import pytest
import torch

from kernels import ops
from kernels.act_quant import quantize_act_reference
from kernels.grouped_gemm import interleave_gate_up
from kernels.grouped_gemm_mxfp8 import dequantize_mxfp8, interleave_gate_up_mxfp8, quantize_mxfp8
from kernels.moe import expert_ffn, grouped_moe, grouped_moe_unsupported
from shared.model.quant_formats import quantize_block_fp8

E_GLOBAL, H, I, TOPK = 8, 256, 128, 3


def _routing(t: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(E_GLOBAL, generator=gen)[:TOPK] for _ in range(t)])
    w = torch.softmax(torch.randn(t, TOPK, generator=gen), dim=-1).bfloat16()
    return ids, w


def _expert_row(xt: torch.Tensor, w13e: torch.Tensor, w2e: torch.Tensor, fp8_rows: bool) -> torch.Tensor:
    """float64 ``down(silu(gate x) * up x)`` of one row ``xt [1, H]`` rounded to bf16 as the kernels write it; with
    ``fp8_rows`` the row and the SwiGLU output are E4M3-quantized as the kernels do."""
    if fp8_rows:
        q, s = quantize_act_reference(xt)
        xt = q.double() * s.double().repeat_interleave(128, -1)[:, :H]
    gu = xt.double() @ w13e.double().T
    h = (torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]).bfloat16()  # the kernel writes bf16
    if fp8_rows:
        q, s = quantize_act_reference(h)
        h = q.double() * s.double().repeat_interleave(128, -1)[:, :I]
    return (h.double() @ w2e.double().T).bfloat16()[0]


def _loop_reference(x, w13, w2, ids, w, expert_start, fp8_rows: bool) -> torch.Tensor:
    """float64 weighted sum over local experts (`_expert_row` of each routed token)."""
    e_local = w13.shape[0]
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(TOPK):
            e = int(ids[t, j]) - expert_start
            if 0 <= e < e_local:
                out[t] += float(w[t, j]) * _expert_row(x[t : t + 1], w13[e], w2[e], fp8_rows).double()
    return out


def _assert_close(out: torch.Tensor, ref: torch.Tensor, rel_fro: float) -> None:
    out, ref = out.double(), ref.double()
    rel = float((out - ref).norm() / ref.norm())
    rms = float(ref.pow(2).mean().sqrt())
    worst = float(((out - ref).abs() / (ref.abs() * 2.0**-6 + rms * 2.0**-7)).max())
    print(f"rel_fro={rel:.3e} worst/bound={worst:.2f}")
    assert rel < rel_fro, f"relative Frobenius error {rel:.3e}"
    if rel_fro <= 2.0**-7:
        assert worst <= 1.0, f"worst element error / bound = {worst:.2f}"


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp8"])
@pytest.mark.parametrize("expert_start,e_local", [(0, E_GLOBAL), (4, 4)], ids=["all_experts", "ep_half"])
def test_grouped_moe_cpu_matches_loop(fmt, expert_start, e_local):
    fp8 = fmt == "fp8"
    gen = torch.Generator().manual_seed(11 + ["bf16", "fp8", "mxfp8"].index(fmt) * 2 + expert_start)
    t = 23
    x = torch.randn(t, H, generator=gen).bfloat16()
    ids, w = _routing(t, gen)
    if expert_start:  # a token routed only to other ranks' experts gets exactly zero here
        ids[0] = torch.tensor([0, 1, 2])
    w13 = torch.randn(e_local, 2 * I, H, generator=gen) / H**0.5
    w2 = torch.randn(e_local, H, I, generator=gen) / I**0.5
    if fp8:
        q13, q2 = quantize_block_fp8(w13), quantize_block_fp8(w2)
        wi, si = interleave_gate_up(q13.weight, q13.scale_inv)
        out = grouped_moe(x, wi, q2.weight, ids, w, expert_start, w13_scale=si, w2_scale=q2.scale_inv)
        w13_eff, w2_eff = q13.dequantize(), q2.dequantize()
    elif fmt == "mxfp8":
        (q13, e13), (q2, e2) = quantize_mxfp8(w13), quantize_mxfp8(w2)
        wi, ei = interleave_gate_up_mxfp8(q13, e13)
        out = grouped_moe(x, wi, q2, ids, w, expert_start, w13_mx_scale=ei, w2_mx_scale=e2)
        w13_eff, w2_eff = dequantize_mxfp8(q13, e13), dequantize_mxfp8(q2, e2)
    else:
        w13b, w2b = w13.bfloat16(), w2.bfloat16()
        wi, _ = interleave_gate_up(w13b)
        out = grouped_moe(x, wi, w2b, ids, w, expert_start)
        w13_eff, w2_eff = w13b, w2b
    assert out.dtype == torch.bfloat16 and out.shape == (t, H)
    ref = _loop_reference(x, w13_eff, w2_eff, ids, w, expert_start, fp8_rows=fp8)
    _assert_close(out, ref, 2.0**-5 if fp8 else 2.0**-7)
    if expert_start:
        assert torch.all(out[0] == 0)


@pytest.mark.parametrize("expected,fp8_rows", [(None, True), (8.0, True), (65.0, False)],
                         ids=["capacity", "decode_sized", "larger"])
def test_masked_mxfp8_experts_take_fp8_rows_for_decode_sized_groups(expected, fp8_rows):
    """MXFP8 experts in the decode layout quantize their rows (and SwiGLU output) to E4M3 when a step brings each
    expert at most SMALL_TILE_MAX_TOKENS_PER_EXPERT rows (``expected_rows_per_expert``, else the buffer's rows per
    expert: 12 here), and multiply bf16 rows beyond that; every filled row matches the loop quantizing exactly
    there, and the bf16 result differs (the quantization is not a no-op on these inputs)."""
    gen = torch.Generator().manual_seed(5)
    e_local, capacity = 4, 12
    counts = torch.tensor([3, 0, 12, 7], dtype=torch.int32)
    rows = torch.randn(e_local, capacity, H, generator=gen).bfloat16()
    w13 = torch.randn(e_local, 2 * I, H, generator=gen) / H**0.5
    w2 = torch.randn(e_local, H, I, generator=gen) / I**0.5
    (q13, e13), (q2, e2) = quantize_mxfp8(w13), quantize_mxfp8(w2)
    wi, ei = interleave_gate_up_mxfp8(q13, e13)
    out = expert_ffn(rows, counts, wi, q2, masked=True, w13_mx_scale=ei, w2_mx_scale=e2,
                     expected_rows_per_expert=expected)
    w13_eff, w2_eff = dequantize_mxfp8(q13, e13), dequantize_mxfp8(q2, e2)
    filled = [(e, t) for e in range(e_local) for t in range(int(counts[e]))]
    got = torch.stack([out[e, t] for e, t in filled])
    ref = torch.stack([_expert_row(rows[e, t : t + 1], w13_eff[e], w2_eff[e], fp8_rows) for e, t in filled])
    other = torch.stack([_expert_row(rows[e, t : t + 1], w13_eff[e], w2_eff[e], not fp8_rows) for e, t in filled])
    _assert_close(got, ref, 2.0**-7)
    assert float((got.double() - other.double()).norm() / other.double().norm()) > 2.0**-6


def _gathered_then_quantized(x, ids, w, expert_start, weights):
    """FP8 experts the other way round: every token's top_k bf16 copies gathered, then each copy quantized."""
    from kernels.ep_prefill import ep_combine, ep_select

    sel = ep_select(x, ids, expert_start, weights["w13_interleaved"].shape[0])
    return ep_combine(expert_ffn(sel.rows, sel.offsets, **weights), sel.row_of, w)


def test_fp8_experts_quantize_each_token_once_with_the_same_bits():
    """grouped_moe quantizes a token before the gather and moves its E4M3 row with its scales: the result equals
    quantizing each gathered copy, bit for bit (per-row quantization), on a rank holding half the experts."""
    gen = torch.Generator().manual_seed(11)
    t, e_local, expert_start = 37, E_GLOBAL // 2, E_GLOBAL // 2
    x = torch.randn(t, H, generator=gen).bfloat16() * 3
    ids, w = _routing(t, gen)
    q13, q2 = (quantize_block_fp8(torch.randn(e_local, *shape, generator=gen) / shape[1] ** 0.5)
               for shape in ((2 * I, H), (H, I)))
    wi, si = interleave_gate_up(q13.weight, q13.scale_inv)
    weights = dict(w13_interleaved=wi, w2=q2.weight, w13_scale=si, w2_scale=q2.scale_inv)
    out = grouped_moe(x, topk_ids=ids, topk_weights=w, expert_start=expert_start, **weights)
    assert torch.equal(out, _gathered_then_quantized(x, ids, w, expert_start, weights))
    assert out.abs().sum() > 0


def test_selected_fp8_rows_carry_their_scales():
    from kernels.act_quant import quantize_act
    from kernels.ep_prefill import EpExchangeError, ep_select

    gen = torch.Generator().manual_seed(12)
    x = torch.randn(9, H, generator=gen).bfloat16()
    ids, _ = _routing(9, gen)
    q, scale = quantize_act(x)
    sel = ep_select(q, ids, 2, 5, align=4, x_scale=scale)
    valid = sel.row_of >= 0
    token = torch.arange(9)[:, None].expand(-1, TOPK)[valid]
    rows = sel.row_of[valid].long()
    assert torch.equal(sel.rows[rows].view(torch.uint8), q[token].view(torch.uint8))
    assert torch.equal(sel.scales[rows], scale[token]) and sel.scales.shape == (sel.rows.shape[0], H // 128)
    with pytest.raises(EpExchangeError, match="x_scale goes with float8_e4m3fn rows"):
        ep_select(x, ids, 2, 5, x_scale=scale)
    with pytest.raises(EpExchangeError, match="x_scale goes with float8_e4m3fn rows"):
        ep_select(q, ids, 2, 5, x_scale=scale[:, :1])


def test_grouped_moe_empty_batch():
    w13 = torch.randn(4, 2 * I, H).bfloat16()
    out = grouped_moe(torch.zeros(0, H, dtype=torch.bfloat16), interleave_gate_up(w13)[0], torch.randn(4, H, I).bfloat16(),
                      torch.zeros(0, TOPK, dtype=torch.long), torch.zeros(0, TOPK, dtype=torch.bfloat16), 0)
    assert out.shape == (0, H)


def test_unsupported_experts_name_the_reason():
    shape = (8, 2 * I, H)
    assert grouped_moe_unsupported(torch.bfloat16, shape, torch.bfloat16) is None
    assert grouped_moe_unsupported(torch.bfloat16, shape, torch.float8_e4m3fn, (128, 128)) is None
    assert "float32" in grouped_moe_unsupported(torch.float32, shape, torch.bfloat16)
    assert "multiple of 64" in grouped_moe_unsupported(torch.bfloat16, (8, 2 * 96, H), torch.bfloat16)
    assert "blocks" in grouped_moe_unsupported(torch.bfloat16, shape, torch.float8_e4m3fn, (64, 64))
    assert "hidden_size" in grouped_moe_unsupported(torch.bfloat16, (8, 2 * I, 200), torch.bfloat16)
    assert grouped_moe_unsupported(torch.bfloat16, shape, torch.float8_e4m3fn, mx_block=32) is None
    assert "one per 32" in grouped_moe_unsupported(torch.bfloat16, shape, torch.float8_e4m3fn, mx_block=16)
    assert "multiple of 64" in grouped_moe_unsupported(torch.bfloat16, (8, 2 * 96, H), torch.float8_e4m3fn, mx_block=32)


def test_mixed_weight_formats_are_rejected():
    w13, w2 = torch.randn(4, 2 * I, H), torch.randn(4, H, I)
    (q13, e13), (q2, e2) = quantize_mxfp8(w13), quantize_mxfp8(w2)
    wi, ei = interleave_gate_up_mxfp8(q13, e13)
    x, ids, w = torch.randn(3, H).bfloat16(), torch.zeros(3, TOPK, dtype=torch.long), torch.ones(3, TOPK).bfloat16()
    for partial in (dict(w13_mx_scale=ei), dict(w2_mx_scale=e2), dict(w13_mx_scale=ei, w2_mx_scale=e2, w2_scale=e2)):
        with pytest.raises(ValueError, match="MXFP8 experts take both"):
            grouped_moe(x, wi, q2, ids, w, 0, **partial)


def test_kernel_switch(monkeypatch):
    monkeypatch.delenv(ops.MODE_ENV, raising=False)
    assert ops.use_kernels("cuda") and not ops.use_kernels("cpu")
    monkeypatch.setenv(ops.MODE_ENV, "reference")
    assert not ops.use_kernels("cuda")
    monkeypatch.setenv(ops.MODE_ENV, "fast")
    with pytest.raises(ValueError, match="MOEBUS_KERNELS"):
        ops.use_kernels("cuda")
