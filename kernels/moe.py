"""The MoE expert block on the grouped GEMM (DESIGN §6): one function for the whole op.

``grouped_moe`` computes, for every token, the routing-weighted sum of this
rank's experts ``[expert_start, expert_start + E_local)``:

1. `kernels.ep_prefill.ep_select` gathers the token rows of each local expert into
   the grouped GEMM's contiguous layout (rows routed to other ranks' experts are
   skipped; nothing waits for the host);
2. `expert_ffn` runs the experts on those rows: the gate/up GEMM with
   ``silu(gate) * up`` fused into its epilogue (weights interleaved once at load),
   then the down GEMM.  Three weight formats:

   * bf16 — `kernels.grouped_gemm` on bf16 rows;
   * FP8 block-scaled (128x128 fp32 scales) — `kernels.act_quant.quantize_act`
     quantizes the tokens before step 1 (each once; step 1 gathers their E4M3 rows
     with their scales), and again the SwiGLU output, per token per 128 channels
     (W8A8; weights and scales from `interleave_gate_up`);
   * MXFP8 (E4M3 + one E8M0 exponent per 32 values along K) —
     `kernels.grouped_gemm_mxfp8`, which dequantizes the weights inside the kernel
     and multiplies bf16 rows (W8A16; weights and exponents from
     `interleave_gate_up_mxfp8`), except decode-sized groups
     (`kernels.grouped_gemm_mxfp8.fp8_math_pays`), whose rows and SwiGLU output are
     quantized as for FP8 block-scaled weights and multiplied in FP8 (W8A8);
3. `kernels.ep_prefill.ep_combine` sums each token's rows times its routing weights
   in fp32 and rounds once.  The weights are applied here rather than as GEMM row
   weights: the combine takes them anyway, and this rounds like the reference
   (``bf16(y) * w`` accumulated in fp32).

`expert_ffn` also takes the masked layout ``[E_local, max_tokens, H]``, which the
decode layout's peer-memory MoE (`shared.parallel_cuda.PeerDecodeMoE`) fills.

Every step is a public kernel op that runs CuTeDSL on CUDA tensors and its torch
reference on CPU tensors, so the same code runs (slowly, in fp32 references) on
the CPU; the reference GEMMs return fp32 and are rounded to bf16 where the
kernels write bf16.
"""

from __future__ import annotations

import importlib.util
import math

import torch

from kernels import grouped_gemm as gg
from kernels import grouped_gemm_mxfp8 as mx
from kernels.act_quant import QUANT_BLOCK, quantize_act

FP8_WEIGHT_BLOCK = (QUANT_BLOCK, QUANT_BLOCK)  # the block scales the FP8 kernel consumes


def grouped_moe_unsupported(act_dtype: torch.dtype, w13_shape: tuple[int, ...], weight_dtype: torch.dtype,
                            fp8_block: tuple[int, int] | None = None, mx_block: int | None = None) -> str | None:
    """Why `grouped_moe` cannot run these experts here, or None when it can.

    ``w13_shape`` is the plain ``[E, 2I, H]``; ``weight_dtype`` bf16, or E4M3 with
    ``fp8_block`` the block of its scales, or E4M3 with ``mx_block`` the values per
    E8M0 scale for MXFP8.
    """
    _, two_i, hidden = w13_shape
    if importlib.util.find_spec("cutlass") is None:
        return "CuTeDSL (nvidia-cutlass-dsl) is not importable"
    if act_dtype != torch.bfloat16:
        return f"activations are {act_dtype}; the grouped GEMM takes bfloat16"
    if mx_block is not None:
        if weight_dtype != torch.float8_e4m3fn:
            return f"MXFP8 expert weights are {weight_dtype}; the MXFP8 grouped GEMM takes float8_e4m3fn"
        if mx_block != mx.MX_BLOCK:
            return f"MXFP8 scales per {mx_block} values; the MXFP8 grouped GEMM takes one per {mx.MX_BLOCK}"
    elif weight_dtype == torch.float8_e4m3fn:
        if tuple(fp8_block or ()) != FP8_WEIGHT_BLOCK:
            return f"FP8 weight blocks {fp8_block}; the FP8 grouped GEMM takes {FP8_WEIGHT_BLOCK}"
    elif weight_dtype != torch.bfloat16:
        return f"expert weights are {weight_dtype}; the grouped GEMM takes bfloat16 or float8_e4m3fn"
    if (two_i // 2) % gg.SWIGLU_BLOCK:
        return f"moe_intermediate_size {two_i // 2} is not a multiple of {gg.SWIGLU_BLOCK} (fused SwiGLU tiles)"
    if hidden % 16:
        return f"hidden_size {hidden} is not a multiple of 16 (16-byte rows for TMA and the FP8 quantizer)"
    return None


def expert_ffn(rows: torch.Tensor, groups: torch.Tensor, w13_interleaved: torch.Tensor, w2: torch.Tensor, *,
               masked: bool = False, rows_scale: torch.Tensor | None = None, w13_scale: torch.Tensor | None = None,
               w2_scale: torch.Tensor | None = None, w13_mx_scale: torch.Tensor | None = None,
               w2_mx_scale: torch.Tensor | None = None, h_out: torch.Tensor | None = None,
               y_out: torch.Tensor | None = None, expected_rows_per_expert: float | None = None) -> torch.Tensor:
    """``down_e(silu(gate_e x) * up_e x)`` for the rows of every local expert ``e``: bf16 ``[..., H]``.

    ``rows``/``groups`` in the grouped GEMM's contiguous (``offsets``) or masked
    (``counts``, ``masked=True``) layout; weights as in `grouped_moe`.  FP8 rows may
    arrive quantized already (``rows`` E4M3 with ``rows_scale``, as the decode
    dispatch sends them); bf16 rows are quantized here where the weights are FP8
    block-scaled, or MXFP8 with decode-sized groups (``expected_rows_per_expert``, else
    the masked buffer's rows per expert; see `kernels.grouped_gemm_mxfp8.fp8_math_pays`).  ``h_out`` / ``y_out``
    (bf16, CUDA) receive the SwiGLU and down outputs.  Masked rows past an
    expert's count are left as they were on CUDA.  ``expected_rows_per_expert`` picks the
    GEMMs' tile bucket (see `kernels.grouped_gemm.grouped_gemm`).
    """
    expect = expected_rows_per_expert
    mx_given = [s is not None for s in (w13_mx_scale, w2_mx_scale)]
    if any(mx_given) and (not all(mx_given) or w13_scale is not None or w2_scale is not None):
        raise gg.GroupedGemmError("MXFP8 experts take both w13_mx_scale and w2_mx_scale, and no FP8 block scales")
    if (w13_scale is None) != (w2_scale is None):
        raise gg.GroupedGemmError("FP8 block-scaled experts take both w13_scale and w2_scale")
    mxfp8 = w13_mx_scale is not None
    tokens = expect if expect is not None else (rows.shape[1] if masked else math.inf)
    fp8 = w13_scale is not None or rows_scale is not None or (mxfp8 and mx.fp8_math_pays(masked, tokens))
    filled = groups if masked else None  # masked: only the filled rows are quantized
    if fp8 and rows_scale is None:
        rows, rows_scale = quantize_act(rows, filled)
    if mxfp8:
        h = mx.grouped_gemm_mxfp8_swiglu(rows, w13_interleaved, w13_mx_scale, groups, masked=masked, x_scale=rows_scale,
                                         out=h_out, expected_rows_per_expert=expect)
    else:
        h = gg.grouped_gemm_swiglu(rows, w13_interleaved, groups, masked=masked, x_scale=rows_scale,
                                   w_scale_interleaved=w13_scale, out=h_out, expected_rows_per_expert=expect)
    h = h.to(torch.bfloat16)  # the CPU references return fp32, the kernels bf16 already
    h, h_scale = quantize_act(h, filled) if fp8 else (h, None)
    if mxfp8:
        y = mx.grouped_gemm_mxfp8(h, w2, w2_mx_scale, groups, masked=masked, x_scale=h_scale, out=y_out,
                                  expected_rows_per_expert=expect)
    else:
        y = gg.grouped_gemm(h, w2, groups, masked=masked, x_scale=h_scale, w_scale=w2_scale, out=y_out,
                            expected_rows_per_expert=expect)
    return y.to(torch.bfloat16)


def grouped_moe(x: torch.Tensor, w13_interleaved: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, expert_start: int, *, w13_scale: torch.Tensor | None = None,
                w2_scale: torch.Tensor | None = None, w13_mx_scale: torch.Tensor | None = None,
                w2_mx_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] = sum_j w[t, j] * expert_{ids[t, j]}(x[t])`` over the local experts: ``[T, H]`` in x's dtype.

    ``x`` bf16 ``[T, H]``; ``w13_interleaved`` ``[E_local, 2I, H]`` and ``w2``
    ``[E_local, H, I]``, either

    * both bf16;
    * both E4M3 with FP8 block scales: ``w13_scale`` from `interleave_gate_up`
      ``[E_local, 2I/64, H/128]`` and ``w2_scale`` ``[E_local, H/128, I/128]`` (fp32);
    * both E4M3 with MXFP8 exponents: ``w13_mx_scale`` from `interleave_gate_up_mxfp8`
      ``[E_local, 2I, H/32]`` and ``w2_mx_scale`` ``[E_local, H, I/32]`` (uint8 E8M0).

    Routing entries naming another rank's expert contribute nothing (their owner
    adds them).
    """
    from kernels.ep_prefill import ep_combine, ep_select  # imports CuTeDSL: only when the op runs

    x = x.contiguous()
    if w13_scale is not None:
        # FP8 experts: each token is quantized once and its E4M3 row and scales are gathered, rather than its
        # top_k bf16 copies gathered and quantized (the same bits, as quantization is per row): a k-th of the
        # quantizer's work and half the gather's bytes.  One H200, all 128 experts, top-8 (bench.moe_layer,
        # [95539f50f3df+s48-quantfirst]): the old order took 1.22-1.25x this op's time for Qwen3-30B at 4096 and
        # 16384 tokens, 1.12-1.13x for Qwen3-235B, 1.01-1.08x at 64 and 512.
        q, q_scale = quantize_act(x)
        sel = ep_select(q, topk_ids, expert_start, w13_interleaved.shape[0], x_scale=q_scale)
    else:
        sel = ep_select(x, topk_ids, expert_start, w13_interleaved.shape[0])
    y = expert_ffn(sel.rows, sel.offsets, w13_interleaved, w2, rows_scale=sel.scales, w13_scale=w13_scale,
                   w2_scale=w2_scale, w13_mx_scale=w13_mx_scale, w2_mx_scale=w2_mx_scale).to(x.dtype)
    return ep_combine(y, sel.row_of, topk_weights)
