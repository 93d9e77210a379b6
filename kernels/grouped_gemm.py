"""MoE expert GEMMs: ``out[e] = x_e @ W[e]^T`` for every local expert ``e``.

Public ops (each runs the CuTeDSL Hopper kernel on CUDA tensors and the fp32
torch reference on CPU tensors):

* :func:`grouped_gemm` — bf16 or FP8 block-scaled, contiguous or masked layout;
* :func:`grouped_gemm_swiglu` — the gate_up GEMM with ``silu(gate) * up``
  fused into its epilogue (weights prepared by :func:`interleave_gate_up`);
* :func:`interleave_gate_up` — one-time weight preparation for the fused op.

Layouts (DESIGN §6):

* contiguous (prefill): ``x`` is ``[T, K]`` with the rows of expert ``e`` at
  ``offsets[e]:offsets[e+1]`` (``offsets`` int32 ``[E+1]``, on the device);
* masked (decode): ``x`` is ``[E, max_tokens, K]`` and expert ``e`` uses its
  first ``counts[e]`` rows (``counts`` int32 ``[E]``, on the device).  Output
  rows past ``counts[e]`` are left untouched.

Weights are ``[E, N, K]`` (the model's ``w13[E, 2I, H]`` and ``w2[E, H, I]``).
FP8 follows Qwen's checkpoints: E4M3 operands, ``w_scale`` fp32
``[E, ceil(N/128), ceil(K/128)]`` with ``dequant = w * scale``
(``weight_scale_inv``), and per-token activation scales ``x_scale`` fp32
``[..., ceil(K/128)]`` from :func:`kernels.act_quant.quantize_act` (on CUDA a
view of rows padded to 16 bytes, the layout the kernels read; scales in any
other layout are copied into it by the launcher).
Accumulation is fp32, outputs are bf16 (fp32 on the CPU reference path).
"""

from __future__ import annotations

import math

import torch

from kernels.act_quant import QUANT_BLOCK

SWIGLU_BLOCK = 64  # gate/up rows are interleaved in blocks of this many rows (the Hopper kernel's SwiGLU tiles too)
FP8_DTYPE = torch.float8_e4m3fn
# Tile buckets by tokens per expert, each a separately compiled kernel (see
# grouped_gemm_launch.choose_config; a service warm-up runs a batch past every bound, see
# services.warmup): up to SMALL_TILE_MAX_TOKENS_PER_EXPERT (decode-sized groups) 64-row
# tiles, above it 128-row tiles.  bf16 prefill (contiguous layout) of experts with at most
# MID_TILE_MAX_WEIGHT_ELEMENTS weights each (N * K: Qwen3-30B's, not Qwen3-235B's) takes
# 128x192 tiles up to MID_TILE_MAX_TOKENS_PER_EXPERT, 128x256 above; FP8 prefill above it
# stores its full output tiles by TMA, and bf16 x MXFP8 prefill above it takes 192x128 tiles.
# bf16 x MXFP8 decode-sized groups swap the operands with the fewest SWAPPED_TOKEN_TILES tokens
# per tile that hold them: a bucket per token tile (``tile_bucket_bounds``).
SMALL_TILE_MAX_TOKENS_PER_EXPERT = 64
MID_TILE_MAX_TOKENS_PER_EXPERT = 512
MID_TILE_MAX_WEIGHT_ELEMENTS = 1 << 22
TILE_BUCKET_BOUNDS = (SMALL_TILE_MAX_TOKENS_PER_EXPERT, MID_TILE_MAX_TOKENS_PER_EXPERT)
SWAPPED_TOKEN_TILES = (8, 16, 32, SMALL_TILE_MAX_TOKENS_PER_EXPERT)


def tile_bucket_bounds(mxfp8: bool) -> tuple[int, ...]:
    """Tokens per expert where the grouped GEMM changes kernel: TILE_BUCKET_BOUNDS, and for MXFP8
    weights also the swapped decode tiles' token counts below SMALL_TILE_MAX_TOKENS_PER_EXPERT."""
    return (*SWAPPED_TOKEN_TILES[:-1], *TILE_BUCKET_BOUNDS) if mxfp8 else TILE_BUCKET_BOUNDS


class GroupedGemmError(ValueError):
    """Bad arguments to a grouped GEMM (shape, dtype, device or alignment)."""


# --------------------------------------------------------------------- checks
def check_layout(x: torch.Tensor, w: torch.Tensor, groups: torch.Tensor, masked: bool,
                 row_weights: torch.Tensor | None, *others: torch.Tensor | None) -> None:
    """Shapes of ``x`` / ``w[E, N, K]`` / ``groups`` / ``row_weights`` for the layout, and one device for all."""
    if w.dim() != 3:
        raise GroupedGemmError(f"w must be [E, N, K], got shape {tuple(w.shape)}")
    E, N, K = w.shape
    if masked:
        if not (x.dim() == 3 and x.shape[0] == E and x.shape[2] == K):
            raise GroupedGemmError(f"masked x must be [E={E}, max_tokens, K={K}], got {tuple(x.shape)}")
        if groups.shape != (E,):
            raise GroupedGemmError(f"counts must be [E={E}], got {tuple(groups.shape)}")
    else:
        if not (x.dim() == 2 and x.shape[1] == K):
            raise GroupedGemmError(f"contiguous x must be [T, K={K}], got {tuple(x.shape)}")
        if groups.shape != (E + 1,):
            raise GroupedGemmError(f"offsets must be [E+1={E + 1}], got {tuple(groups.shape)}")
    if groups.dtype != torch.int32:
        raise GroupedGemmError(f"offsets/counts must be int32, got {groups.dtype}")
    if row_weights is not None:
        if not (tuple(row_weights.shape) == tuple(x.shape[:-1]) and row_weights.dtype == torch.float32):
            raise GroupedGemmError(f"row_weights must be float32 {tuple(x.shape[:-1])}, got {row_weights.dtype} {tuple(row_weights.shape)}")
    devices = {t.device for t in (x, w, groups, row_weights, *others) if t is not None}
    if len(devices) != 1:
        raise GroupedGemmError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def _check_operands(x: torch.Tensor, w: torch.Tensor, groups: torch.Tensor, masked: bool,
                    x_scale: torch.Tensor | None, w_scale: torch.Tensor | None,
                    row_weights: torch.Tensor | None, w_scale_block_rows: int = QUANT_BLOCK) -> None:
    check_layout(x, w, groups, masked, row_weights, x_scale, w_scale)
    E, N, K = w.shape
    fp8 = x.dtype == FP8_DTYPE
    if w.dtype != x.dtype:
        raise GroupedGemmError(f"x ({x.dtype}) and w ({w.dtype}) must have the same dtype")
    if not (fp8 or x.dtype == torch.bfloat16):
        raise GroupedGemmError(f"x must be bfloat16 or float8_e4m3fn, got {x.dtype}")
    kb = math.ceil(K / QUANT_BLOCK)
    if fp8:
        if not (x_scale is not None and w_scale is not None):
            raise GroupedGemmError("FP8 inputs need x_scale and w_scale")
        if not (tuple(x_scale.shape) == (*x.shape[:-1], kb) and x_scale.dtype == torch.float32):
            raise GroupedGemmError(f"x_scale must be float32 {(*x.shape[:-1], kb)}, got {x_scale.dtype} {tuple(x_scale.shape)}")
        nb = math.ceil(N / w_scale_block_rows)
        if not (tuple(w_scale.shape) == (E, nb, kb) and w_scale.dtype == torch.float32):
            raise GroupedGemmError(f"w_scale must be float32 [E={E}, N/{w_scale_block_rows}={nb}, K/128={kb}], got {w_scale.dtype} {tuple(w_scale.shape)}")
    else:
        if not (x_scale is None and w_scale is None):
            raise GroupedGemmError("scales are only meaningful with float8_e4m3fn inputs")


# ------------------------------------------------------------ torch reference
def _dequant(t: torch.Tensor, scale: torch.Tensor | None, block_rows: int | None) -> torch.Tensor:
    """fp32 copy of ``t``; FP8 tensors are multiplied by their block scales."""
    if scale is None:
        return t.float()
    K = t.shape[-1]
    s = scale.repeat_interleave(QUANT_BLOCK, dim=-1)[..., :K]
    if block_rows is not None:  # weights: one scale per block_rows x 128 (activations: per row)
        s = s.repeat_interleave(block_rows, dim=-2)[..., : t.shape[-2], :]
    return t.float() * s


def _expert_rows(groups: torch.Tensor, masked: bool, rows: int) -> list[tuple[int, int]]:
    g = groups.tolist()
    if masked:
        return [(0, max(0, min(c, rows))) for c in g]
    return [(g[e], max(0, g[e + 1] - g[e])) for e in range(len(g) - 1)]


def grouped_gemm_reference(x: torch.Tensor, w: torch.Tensor, groups: torch.Tensor, *, masked: bool,
                           x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
                           row_weights: torch.Tensor | None = None, w_scale_block_rows: int = QUANT_BLOCK
                           ) -> torch.Tensor:
    """fp32 reference of :func:`grouped_gemm`; rows no expert owns are zero."""
    E, N, _ = w.shape
    xf = _dequant(x, x_scale, None)
    wf = _dequant(w, w_scale, w_scale_block_rows)
    out = torch.zeros(*x.shape[:-1], N, dtype=torch.float32, device=x.device)
    rows = x.shape[-2]
    for e, (start, count) in enumerate(_expert_rows(groups, masked, rows)):
        if count == 0:
            continue
        xe = xf[e, start:start + count] if masked else xf[start:start + count]
        ye = xe @ wf[e].T
        if row_weights is not None:
            rw = row_weights[e, start:start + count] if masked else row_weights[start:start + count]
            ye = ye * rw[:, None]
        if masked:
            out[e, start:start + count] = ye
        else:
            out[start:start + count] = ye
    return out


def swiglu_reference(h: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` over the last dim split in halves ``[gate | up]`` (fp32)."""
    gate, up = h.float().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# --------------------------------------------------------- gate/up interleave
def interleave_gate_up(w13: torch.Tensor, w_scale: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reorder ``w13[E, 2I, K]`` (gate rows then up rows) for the fused SwiGLU GEMM.

    Rows become ``[gate 0:64, up 0:64, gate 64:128, up 64:128, ...]`` so that
    every 128-wide output tile holds matching gate and up channels.  The FP8
    scales ``[E, 2I/128, K/128]`` become one scale per 64-row half-block,
    ``[E, 2I/64, K/128]``, in the same order.  Needs ``I % 64 == 0``.
    """
    if not (w13.dim() == 3 and w13.shape[1] % (2 * SWIGLU_BLOCK) == 0):
        raise GroupedGemmError(f"w13 must be [E, 2I, K] with I a multiple of {SWIGLU_BLOCK}, got {tuple(w13.shape)}")
    E, two_i, K = w13.shape
    blocks = two_i // 2 // SWIGLU_BLOCK
    w = w13.view(E, 2, blocks, SWIGLU_BLOCK, K).transpose(1, 2).reshape(E, two_i, K).contiguous()
    if w_scale is None:
        return w, None
    if not (w_scale.dim() == 3 and w_scale.shape[0] == E):
        raise GroupedGemmError(f"w_scale must be [E, 2I/128, K/128], got {tuple(w_scale.shape)}")
    half_rows = w_scale.repeat_interleave(QUANT_BLOCK // SWIGLU_BLOCK, dim=1)[:, : two_i // SWIGLU_BLOCK]
    s = half_rows.view(E, 2, blocks, -1).transpose(1, 2).reshape(E, 2 * blocks, -1).contiguous()
    return w, s


def deinterleave_gate_up(w: torch.Tensor, w_scale: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Inverse of :func:`interleave_gate_up` (scales stay per 64-row block: ``[E, 2I/64, K/128]``)."""
    E, two_i, K = w.shape
    blocks = two_i // 2 // SWIGLU_BLOCK
    w13 = w.view(E, blocks, 2, SWIGLU_BLOCK, K).transpose(1, 2).reshape(E, two_i, K)
    if w_scale is None:
        return w13, None
    s = w_scale.view(E, blocks, 2, -1).transpose(1, 2).reshape(E, 2 * blocks, -1)
    return w13, s


# ------------------------------------------------------------------ dispatch
def into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """CPU path: return the fp32 result, or copy it into the caller's ``out`` (any float dtype)."""
    if out is None:
        return result
    if tuple(out.shape) != tuple(result.shape):
        raise GroupedGemmError(f"out must have shape {tuple(result.shape)}, got {tuple(out.shape)}")
    return out.copy_(result)


def _launch(x, w, groups, masked, x_scale, w_scale, row_weights, swiglu, out, expected_rows_per_expert):
    from kernels import grouped_gemm_launch  # CuTeDSL is imported only on the GPU path

    return grouped_gemm_launch.launch(x, w, groups, masked=masked, x_scale=x_scale, w_scale=w_scale,
                                      row_weights=row_weights, swiglu=swiglu, out=out,
                                      expected_rows_per_expert=expected_rows_per_expert)


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, groups: torch.Tensor, *, masked: bool = False,
                 x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
                 row_weights: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 expected_rows_per_expert: float | None = None) -> torch.Tensor:
    """``out[rows of e] = x[rows of e] @ w[e]^T`` (times ``row_weights`` per row if given).

    ``groups`` is ``offsets[E+1]`` (contiguous, ``x[T, K]``) or ``counts[E]``
    (``masked=True``, ``x[E, max_tokens, K]``).  bf16 or FP8 (``x_scale``,
    ``w_scale`` required).  Returns bf16 on CUDA, fp32 on CPU; with ``out``
    (bf16 ``[..., N]`` on CUDA) the result lands there.  On CUDA, rows no
    expert owns are left untouched; the CPU reference writes zeros there.
    ``expected_rows_per_expert`` picks the tile bucket on CUDA (default: the average
    for the contiguous layout, ``max_tokens`` for the masked one, whose counts only
    the GPU knows); any value gives the same result.
    """
    _check_operands(x, w, groups, masked, x_scale, w_scale, row_weights)
    if x.is_cuda:
        return _launch(x, w, groups, masked, x_scale, w_scale, row_weights, False, out, expected_rows_per_expert)
    return into(out, grouped_gemm_reference(x, w, groups, masked=masked, x_scale=x_scale, w_scale=w_scale,
                                             row_weights=row_weights))


def grouped_gemm_swiglu(x: torch.Tensor, w13_interleaved: torch.Tensor, groups: torch.Tensor, *,
                        masked: bool = False, x_scale: torch.Tensor | None = None,
                        w_scale_interleaved: torch.Tensor | None = None,
                        row_weights: torch.Tensor | None = None, out: torch.Tensor | None = None,
                        expected_rows_per_expert: float | None = None) -> torch.Tensor:
    """Fused expert gate_up GEMM + SwiGLU: ``silu(x @ gate^T) * (x @ up^T)`` -> ``[..., I]``.

    Weights (and FP8 scales) come from :func:`interleave_gate_up`.  With
    ``row_weights`` the routing weight scales each row here, so the down GEMM
    output needs no extra pass.  ``expected_rows_per_expert`` as in :func:`grouped_gemm`.
    """
    if not (w13_interleaved.dim() == 3 and w13_interleaved.shape[1] % (2 * SWIGLU_BLOCK) == 0):
        raise GroupedGemmError(f"w13 must be [E, 2I, K] with 2I a multiple of {2 * SWIGLU_BLOCK}, got {tuple(w13_interleaved.shape)}")
    # Interleaved FP8 scales hold one row per 64-row half block (see interleave_gate_up).
    _check_operands(x, w13_interleaved, groups, masked, x_scale, w_scale_interleaved, row_weights,
                    w_scale_block_rows=SWIGLU_BLOCK)
    if x.is_cuda:
        return _launch(x, w13_interleaved, groups, masked, x_scale, w_scale_interleaved, row_weights, True, out,
                       expected_rows_per_expert)
    w13, s = deinterleave_gate_up(w13_interleaved, w_scale_interleaved)
    h = grouped_gemm_reference(x, w13, groups, masked=masked, x_scale=x_scale, w_scale=s,
                               w_scale_block_rows=SWIGLU_BLOCK)
    y = swiglu_reference(h)
    if row_weights is not None:
        y = y * row_weights[..., None]
    return into(out, y)

