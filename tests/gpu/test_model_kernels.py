"""GPU: the model's MoE kernel op (kernels.moe.grouped_moe) against the same glue on the CPU references.

Both sides run `kernels.moe.grouped_moe` on identical inputs: on CUDA every step
is a CuTeDSL kernel (ep_select, FP8 quantizer, fused SwiGLU grouped GEMM, down
grouped GEMM, ep_combine), on the CPU each step's torch reference (fp32 GEMMs,
rounded to bf16 where the kernels write bf16). They differ only by accumulation
order, which can move a bf16 rounding of the SwiGLU or down output by one unit
(2^-8 relative): bf16 outputs must agree to a relative Frobenius error below
2^-7 and every element within ``2^-6 |ref| + 2^-7 rms(ref)``. FP8 requantizes the
SwiGLU output, where such a one-unit move can flip an E4M3 rounding (2^-4
relative) for a few elements: relative Frobenius error below 2^-5. MXFP8 weights
multiply bf16 rows on both sides (dequantized inside the kernel on CUDA, before
the fp32 GEMM on the CPU), so the bf16 bounds hold.

Cases: all experts local and half of them (expert-parallel rank 1 of 2, where a
token routed only to the other rank's experts must come out exactly zero), at
decode size (64-row tiles) and prefill size (128-row tiles). `kernels.moe.expert_ffn`
on the masked layout (what the decode layout's `PeerDecodeMoE` runs between its
dispatch and combine) is checked the same way; rows past each expert's count
must stay as they were.

The model-level comparisons (prefill logits, greedy decoding, SDPA attention,
the MOEBUS_KERNELS=reference switch) are in tests/model/runtime/test_kernel_path.py
(its cuda parameters).
"""

from __future__ import annotations

import pytest
import torch

from kernels.act_quant import quantize_act
from kernels.grouped_gemm import interleave_gate_up
from kernels.grouped_gemm_mxfp8 import interleave_gate_up_mxfp8, quantize_mxfp8
from kernels.moe import expert_ffn, grouped_moe
from shared.model.quant_formats import quantize_block_fp8

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

E_LOCAL, H, I, TOPK = 8, 512, 256, 4  # one set of compiled kernels (they are keyed by E, N, K) for all cases
FORMATS = ["bf16", "fp8", "mxfp8"]


def _weights(fmt: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The expert weight arguments of `grouped_moe` / `expert_ffn` in format ``fmt`` (CPU tensors)."""
    w13 = torch.randn(E_LOCAL, 2 * I, H, generator=gen) / H**0.5
    w2 = torch.randn(E_LOCAL, H, I, generator=gen) / I**0.5
    if fmt == "fp8":
        q13, q2 = quantize_block_fp8(w13), quantize_block_fp8(w2)
        wi, si = interleave_gate_up(q13.weight, q13.scale_inv)
        return dict(w13_interleaved=wi, w2=q2.weight, w13_scale=si, w2_scale=q2.scale_inv)
    if fmt == "mxfp8":
        (q13, e13), (q2, e2) = quantize_mxfp8(w13), quantize_mxfp8(w2)
        wi, ei = interleave_gate_up_mxfp8(q13, e13)
        return dict(w13_interleaved=wi, w2=q2, w13_mx_scale=ei, w2_mx_scale=e2)
    return dict(w13_interleaved=interleave_gate_up(w13.bfloat16())[0], w2=w2.bfloat16())


def _assert_matches_cpu(out: torch.Tensor, ref: torch.Tensor, fmt: str, what: str, fp8_rows: bool | None = None) -> None:
    """``fp8_rows``: whether the activations were E4M3-quantized (default: FP8 block-scaled weights), where a
    one-ulp bf16 difference can flip an E4M3 rounding and the bound is looser."""
    out, ref = out.cpu().double(), ref.double()
    assert torch.isfinite(out).all()
    rel = float((out - ref).norm() / ref.norm())
    rms = float(ref.pow(2).mean().sqrt())
    worst = float(((out - ref).abs() / (ref.abs() * 2.0**-6 + rms * 2.0**-7)).max())
    print(f"{what} {fmt}: rel_fro={rel:.2e} worst/bound={worst:.2f}")
    fp8_rows = fmt == "fp8" if fp8_rows is None else fp8_rows
    if fp8_rows:
        assert rel < 2.0**-5
    else:
        assert rel < 2.0**-7 and worst <= 1.0


@pytest.mark.parametrize("tokens", [6, 900], ids=["decode", "prefill"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("e_global,expert_start", [(E_LOCAL, 0), (2 * E_LOCAL, E_LOCAL)], ids=["all_experts", "ep_rank1of2"])
def test_grouped_moe_cuda_matches_cpu_glue(tokens, fmt, e_global, expert_start):
    gen = torch.Generator().manual_seed(tokens + 2 * FORMATS.index(fmt) + expert_start)
    x = torch.randn(tokens, H, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(e_global, generator=gen)[:TOPK] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, TOPK, generator=gen), dim=-1).bfloat16()
    weights = _weights(fmt, gen)
    if expert_start:
        ids[0] = torch.arange(TOPK)  # experts 0..3 live on the other rank
    ref = grouped_moe(x, topk_ids=ids, topk_weights=w, expert_start=expert_start, **weights)
    dev = {k: v.cuda() for k, v in weights.items()}
    out = grouped_moe(x.cuda(), topk_ids=ids.cuda(), topk_weights=w.cuda(), expert_start=expert_start, **dev)
    torch.cuda.synchronize()
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, H)
    _assert_matches_cpu(out, ref, fmt, f"grouped_moe tokens={tokens} expert_start={expert_start}")
    if expert_start:
        assert torch.all(out.cpu()[0] == 0)


@pytest.mark.parametrize("tokens", [6, 900], ids=["decode", "prefill"])
def test_fp8_experts_quantize_each_token_once_with_the_same_bits(tokens):
    """On CUDA grouped_moe quantizes each token once and gathers its E4M3 row with its scales; quantizing every
    gathered bf16 copy instead gives the same bits (rows in a group may sit in another order: the combine walks
    (token, slot) pairs)."""
    from kernels.ep_prefill import ep_combine, ep_select

    gen = torch.Generator().manual_seed(70 + tokens)
    x = torch.randn(tokens, H, generator=gen).bfloat16().cuda()
    ids = torch.stack([torch.randperm(2 * E_LOCAL, generator=gen)[:TOPK] for _ in range(tokens)]).cuda()
    w = torch.softmax(torch.randn(tokens, TOPK, generator=gen), dim=-1).bfloat16().cuda()
    weights = {k: v.cuda() for k, v in _weights("fp8", gen).items()}
    out = grouped_moe(x, topk_ids=ids, topk_weights=w, expert_start=E_LOCAL, **weights)
    sel = ep_select(x, ids, E_LOCAL, E_LOCAL)
    other = ep_combine(expert_ffn(sel.rows, sel.offsets, **weights), sel.row_of, w)
    torch.cuda.synchronize()
    assert torch.equal(out, other) and out.abs().sum() > 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_masked_expert_ffn_cuda_matches_cpu(fmt):
    """The decode layout's expert step: ``[E, max_tokens, H]`` rows, per-expert counts (one empty, one full)."""
    gen = torch.Generator().manual_seed(40 + FORMATS.index(fmt))
    max_tokens = 16
    counts = torch.randint(1, max_tokens, (E_LOCAL,), generator=gen, dtype=torch.int32)
    counts[1], counts[2] = 0, max_tokens
    rows = torch.randn(E_LOCAL, max_tokens, H, generator=gen).bfloat16()
    weights = _weights(fmt, gen)
    rows_scale = None
    if fmt == "fp8":  # the dispatch sends FP8 rows already quantized
        rows, rows_scale = quantize_act(rows)
    ref = expert_ffn(rows, counts, masked=True, rows_scale=rows_scale, **weights)
    dev = {k: v.cuda() for k, v in weights.items()}
    h_out = torch.full((E_LOCAL, max_tokens, I), float("nan"), dtype=torch.bfloat16, device="cuda")
    y_out = torch.full((E_LOCAL, max_tokens, H), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = expert_ffn(rows.cuda(), counts.cuda(), masked=True,
                     rows_scale=None if rows_scale is None else rows_scale.cuda(), h_out=h_out, y_out=y_out, **dev)
    torch.cuda.synchronize()
    assert out.data_ptr() == y_out.data_ptr()
    owned = torch.arange(max_tokens)[None, :] < counts[:, None]  # [E, max_tokens]
    # MXFP8 weights quantize the rows of decode-sized masked groups too (kernels.grouped_gemm_mxfp8.fp8_math_pays)
    _assert_matches_cpu(out.cpu()[owned], ref[owned], fmt, "masked expert_ffn", fp8_rows=fmt != "bf16")
    assert torch.isnan(out.cpu()[~owned].float()).all(), "rows past an expert's count were written"
