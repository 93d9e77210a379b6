"""The MoE expert block on the grouped GEMM (DESIGN §6): one function for the whole op.

``grouped_moe`` computes, for every token, the routing-weighted sum of this
rank's experts ``[expert_start, expert_start + E_local)``:

1. `kernels.ep_prefill.ep_select` gathers the token rows of each local expert into
   the grouped GEMM's contiguous layout (rows routed to other ranks' experts are
   skipped; nothing waits for the host);
2. FP8 weights: `kernels.act_quant.quantize_act` quantizes those rows per token per
   128 channels;
3. `kernels.grouped_gemm.grouped_gemm_swiglu` runs gate/up with ``silu(gate) * up``
   fused into the epilogue (weights from `interleave_gate_up`, done once at load);
4. the down projection, `kernels.grouped_gemm.grouped_gemm` (FP8: its input is
   quantized again);
5. `kernels.ep_prefill.ep_combine` sums each token's rows times its routing weights
   in fp32 and rounds once.  The weights are applied here rather than as GEMM row
   weights: the combine takes them anyway, and this rounds like the reference
   (``bf16(y) * w`` accumulated in fp32).

Every step is a public kernel op that runs CuTeDSL on CUDA tensors and its torch
reference on CPU tensors, so the same code runs (slowly, in fp32 references) on
the CPU; the reference GEMMs return fp32 and are rounded to the activation dtype
where the kernels write bf16.
"""

from __future__ import annotations

import importlib.util

import torch

from kernels import grouped_gemm as gg
from kernels.act_quant import QUANT_BLOCK, quantize_act

FP8_WEIGHT_BLOCK = (QUANT_BLOCK, QUANT_BLOCK)  # the block scales the FP8 kernel consumes


def grouped_moe_unsupported(act_dtype: torch.dtype, w13_shape: tuple[int, ...], weight_dtype: torch.dtype,
                            fp8_block: tuple[int, int] | None = None, mx_block: int | None = None) -> str | None:
    """Why `grouped_moe` cannot run these experts here, or None when it can.

    ``w13_shape`` is the plain ``[E, 2I, H]``; ``weight_dtype`` bf16, or E4M3 with
    ``fp8_block`` the block of its scales, or E4M3 with ``mx_block`` for MXFP8.
    """
    _, two_i, hidden = w13_shape
    if mx_block is not None:
        # kernels.grouped_gemm_mxfp8 has both GEMMs (plain and fused SwiGLU, weights dequantized
        # inside the kernel), but this op does not route MXFP8 weights to them yet.
        return (f"MXFP8 expert weights (one E8M0 scale per {mx_block} values): grouped_moe takes bf16 or "
                "FP8-block weights; the MXFP8 kernels (kernels.grouped_gemm_mxfp8) are not wired into it")
    if importlib.util.find_spec("cutlass") is None:
        return "CuTeDSL (nvidia-cutlass-dsl) is not importable"
    if act_dtype != torch.bfloat16:
        return f"activations are {act_dtype}; the grouped GEMM takes bfloat16"
    if weight_dtype == torch.float8_e4m3fn:
        if tuple(fp8_block or ()) != FP8_WEIGHT_BLOCK:
            return f"FP8 weight blocks {fp8_block}; the FP8 grouped GEMM takes {FP8_WEIGHT_BLOCK}"
    elif weight_dtype != torch.bfloat16:
        return f"expert weights are {weight_dtype}; the grouped GEMM takes bfloat16 or float8_e4m3fn"
    if (two_i // 2) % gg.SWIGLU_BLOCK:
        return f"moe_intermediate_size {two_i // 2} is not a multiple of {gg.SWIGLU_BLOCK} (fused SwiGLU tiles)"
    if hidden % 16:
        return f"hidden_size {hidden} is not a multiple of 16 (16-byte rows for TMA and the FP8 quantizer)"
    return None


def grouped_moe(x: torch.Tensor, w13_interleaved: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, expert_start: int, *, w13_scale: torch.Tensor | None = None,
                w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] = sum_j w[t, j] * expert_{ids[t, j]}(x[t])`` over the local experts: ``[T, H]`` in x's dtype.

    ``x`` bf16 ``[T, H]``; ``w13_interleaved`` ``[E_local, 2I, H]`` and ``w2``
    ``[E_local, H, I]``, both bf16, or both E4M3 with ``w13_scale`` from
    `interleave_gate_up` ``[E_local, 2I/64, H/128]`` and ``w2_scale``
    ``[E_local, H/128, I/128]``.  Routing entries naming another rank's expert
    contribute nothing (their owner adds them).
    """
    from kernels.ep_prefill import ep_combine, ep_select  # imports CuTeDSL: only when the op runs

    fp8 = w13_scale is not None
    sel = ep_select(x.contiguous(), topk_ids, expert_start, w13_interleaved.shape[0])
    rows, rows_scale = quantize_act(sel.rows) if fp8 else (sel.rows, None)
    h = gg.grouped_gemm_swiglu(rows, w13_interleaved, sel.offsets, x_scale=rows_scale, w_scale_interleaved=w13_scale)
    h = h.to(x.dtype)  # the CPU reference returns fp32, the kernel bf16 already
    h, h_scale = quantize_act(h) if fp8 else (h, None)
    y = gg.grouped_gemm(h, w2, sel.offsets, x_scale=h_scale, w_scale=w2_scale).to(x.dtype)
    return ep_combine(y, sel.row_of, topk_weights)
