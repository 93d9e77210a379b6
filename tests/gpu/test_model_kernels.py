"""GPU: the model's MoE kernel op (kernels.moe.grouped_moe) against the same glue on the CPU references.

Both sides run `kernels.moe.grouped_moe` on identical inputs: on CUDA every step
is a CuTeDSL kernel (ep_select, FP8 quantizer, fused SwiGLU grouped GEMM, down
grouped GEMM, ep_combine), on the CPU each step's torch reference (fp32 GEMMs,
rounded to bf16 where the kernels write bf16). They differ only by accumulation
order, which can move a bf16 rounding of the SwiGLU or down output by one unit
(2^-8 relative): bf16 outputs must agree to a relative Frobenius error below
2^-7 and every element within ``2^-6 |ref| + 2^-7 rms(ref)``. FP8 requantizes the
SwiGLU output, where such a one-unit move can flip an E4M3 rounding (2^-4
relative) for a few elements: relative Frobenius error below 2^-5.

Cases: all experts local and half of them (expert-parallel rank 1 of 2, where a
token routed only to the other rank's experts must come out exactly zero), at
decode size (64-row tiles) and prefill size (128-row tiles).

The model-level comparisons (prefill logits, greedy decoding, SDPA attention,
the MOEBUS_KERNELS=reference switch) are in tests/model/runtime/test_kernel_path.py
(its cuda parameters).
"""

from __future__ import annotations

import pytest
import torch

from kernels.grouped_gemm import interleave_gate_up
from kernels.moe import grouped_moe
from shared.model.quant_formats import quantize_block_fp8

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

E_LOCAL, H, I, TOPK = 8, 512, 256, 4  # one set of compiled kernels (they are keyed by E, N, K) for all cases


def _case(t: int, e_global: int, fp8: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(e_global, generator=gen)[:TOPK] for _ in range(t)])
    w = torch.softmax(torch.randn(t, TOPK, generator=gen), dim=-1).bfloat16()
    w13 = torch.randn(E_LOCAL, 2 * I, H, generator=gen) / H**0.5
    w2 = torch.randn(E_LOCAL, H, I, generator=gen) / I**0.5
    if fp8:
        q13, q2 = quantize_block_fp8(w13), quantize_block_fp8(w2)
        wi, si = interleave_gate_up(q13.weight, q13.scale_inv)
        weights = dict(w13_interleaved=wi, w2=q2.weight, w13_scale=si, w2_scale=q2.scale_inv)
    else:
        weights = dict(w13_interleaved=interleave_gate_up(w13.bfloat16())[0], w2=w2.bfloat16())
    return x, ids, w, weights


@pytest.mark.parametrize("tokens", [6, 900], ids=["decode", "prefill"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("e_global,expert_start", [(E_LOCAL, 0), (2 * E_LOCAL, E_LOCAL)], ids=["all_experts", "ep_rank1of2"])
def test_grouped_moe_cuda_matches_cpu_glue(tokens, fp8, e_global, expert_start):
    x, ids, w, weights = _case(tokens, e_global, fp8, seed=tokens + 2 * fp8 + expert_start)
    if expert_start:
        ids[0] = torch.arange(TOPK)  # experts 0..3 live on the other rank
    ref = grouped_moe(x, weights["w13_interleaved"], weights["w2"], ids, w, expert_start,
                      w13_scale=weights.get("w13_scale"), w2_scale=weights.get("w2_scale"))
    dev = {k: v.cuda() for k, v in weights.items()}
    out = grouped_moe(x.cuda(), dev["w13_interleaved"], dev["w2"], ids.cuda(), w.cuda(), expert_start,
                      w13_scale=dev.get("w13_scale"), w2_scale=dev.get("w2_scale"))
    torch.cuda.synchronize()
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, H)
    out, ref = out.cpu().double(), ref.double()
    assert torch.isfinite(out).all()
    rel = float((out - ref).norm() / ref.norm())
    rms = float(ref.pow(2).mean().sqrt())
    worst = float(((out - ref).abs() / (ref.abs() * 2.0**-6 + rms * 2.0**-7)).max())
    print(f"tokens={tokens} fp8={fp8} expert_start={expert_start}: rel_fro={rel:.2e} worst/bound={worst:.2f}")
    if fp8:
        assert rel < 2.0**-5
    else:
        assert rel < 2.0**-7 and worst <= 1.0
    if expert_start:
        assert torch.all(out[0] == 0)
