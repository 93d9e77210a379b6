"""RMSNorm (with the residual add before it) and per-head RMSNorm + RoPE, fused.

Between its GEMMs a Qwen3 decoder layer runs four RMSNorms (input, post-attention,
q and k per head), two residual adds and RoPE on q and k. As torch ops that is
some 45 small kernels per layer, each a launch of a few microseconds on tensors of
a few hundred KiB; in a decode step they cost as much as the expert GEMMs of a
small model. On CUDA these two functions are one launch each:

* :func:`add_rms_norm` ``(h, delta, weight)`` -> ``(h + delta, rms_norm(h + delta))``
  (``delta=None``: plain RMSNorm of ``h``);
* :func:`qk_norm_rope` ``(x [T, heads, D], weight [D], cos, sin)`` ->
  ``apply_rope(rms_norm(x))``, per head;
* :func:`qkv_norm_rope_store`: the same for the q and k heads of a fused q/k/v
  projection's output, which also stores k and v into their slots of the layer's
  paged KV pool (replacing two norm/RoPE launches, the column copies of a split
  and the pool's two index writes).

Both reproduce the torch reference (transformers' Qwen3 code) rounding for
rounding: the residual sum is rounded to the activation dtype before it is
normalized; the norm is computed in fp32, rounded, then multiplied by the weight
and rounded again; RoPE rounds ``x * cos``, ``rotate_half(x) * sin`` and their
sum. They can differ from it only where fp32 sums of squares, added in another
order, round differently (a unit in the last place of bf16, rarely).

The references here are the model's own ops (`shared.model.layers` uses them).
This module imports only torch; the CuTeDSL kernels live in
:mod:`kernels.norm_rope_sm90` and are imported on the CUDA path only. The kernels
take bf16 rows whose length is a multiple of 8 (16-byte vectors) and head_dim 64
or 128 (a warp per head, ``rotate_half`` a lane shuffle); other inputs take the
references.
"""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; computed in fp32, cast back, then scaled (as HF does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, D]`` by the per-token angles ``cos``/``sin [T, D]`` (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _kernel_takes(x: torch.Tensor, row: int) -> bool:
    return x.is_cuda and x.dtype == torch.bfloat16 and row % 8 == 0


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
                 use_kernel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, rms_norm(s))`` with ``s = h + delta`` (``s = h`` when ``delta`` is None); rows of ``[T, H]``.

    ``use_kernel=False`` runs the references whatever the device (a model on the reference path).
    """
    if delta is not None and delta.shape != h.shape:
        raise ValueError(f"add_rms_norm: delta {tuple(delta.shape)} does not match h {tuple(h.shape)}")
    if weight.shape != h.shape[-1:]:
        raise ValueError(f"add_rms_norm: weight {tuple(weight.shape)} does not match rows of {h.shape[-1]}")
    if not (use_kernel and _kernel_takes(h, h.shape[-1]) and weight.dtype == h.dtype and (delta is None or delta.dtype == h.dtype)):
        s = h if delta is None else h + delta
        return s, rms_norm_reference(s, weight, eps)
    from kernels import norm_rope_sm90  # CuTeDSL is imported only on the GPU path

    return norm_rope_sm90.add_rms_norm_cuda(h.contiguous(), None if delta is None else delta.contiguous(), weight.contiguous(), eps)


def qk_norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float, *,
                 use_kernel: bool = True) -> torch.Tensor:
    """``apply_rope(rms_norm(x, weight), cos, sin)`` for ``x [T, heads, D]``, ``cos``/``sin [T, D]``."""
    t, _, d = x.shape
    if weight.shape != (d,) or cos.shape != (t, d) or sin.shape != (t, d):
        raise ValueError(f"qk_norm_rope: x {tuple(x.shape)} needs weight ({d},) and cos/sin ({t}, {d}), "
                         f"got {tuple(weight.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}")
    if not (use_kernel and _kernel_takes(x, d) and d in (64, 128) and weight.dtype == cos.dtype == sin.dtype == x.dtype):
        return apply_rope_reference(rms_norm_reference(x, weight, eps), cos, sin)
    from kernels import norm_rope_sm90

    return norm_rope_sm90.qk_norm_rope_cuda(x.contiguous(), weight.contiguous(), cos.contiguous(), sin.contiguous(), eps)


def qkv_norm_rope_store(qkv: torch.Tensor, q_heads: int, kv_heads: int, q_weight: torch.Tensor, k_weight: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor, eps: float, pool: torch.Tensor, pages: torch.Tensor,
                        offsets: torch.Tensor, *, use_kernel: bool = True, q_out: torch.Tensor | None = None) -> torch.Tensor:
    """q of an attention layer from its fused projection ``qkv [T, (q_heads + 2 kv_heads) * D]``.

    Returns ``qk_norm_rope`` of the q heads ``[T, q_heads, D]`` (written into ``q_out`` when given: contiguous,
    in qkv's dtype, on its device; a CUDA-graph piece's queries go to a buffer outside the graphs); stores ``qk_norm_rope`` of the
    k heads and the v heads as they are into ``pool [pages, 2, kv_heads, page_size, D]`` at
    token ``i``'s slot ``(pages[i], offsets[i])``, K at index 0 and V at 1 of the pool's
    second dim (the layout of `shared.kvcache.PagedKVCache`), converted to the pool's dtype.
    """
    t, d = qkv.shape[0], pool.shape[-1]
    if qkv.dim() != 2 or qkv.shape[1] != (q_heads + 2 * kv_heads) * d or pool.dim() != 5 or tuple(pool.shape[1:3]) != (2, kv_heads):
        raise ValueError(f"qkv_norm_rope_store: qkv {tuple(qkv.shape)} and pool {tuple(pool.shape)} do not hold "
                         f"{q_heads} q and {kv_heads} kv heads of {d}")
    if pages.shape != (t,) or offsets.shape != (t,):
        raise ValueError(f"qkv_norm_rope_store: {t} tokens need pages and offsets of ({t},), got {tuple(pages.shape)}, {tuple(offsets.shape)}")
    if q_out is not None and (q_out.shape != (t, q_heads, d) or q_out.dtype != qkv.dtype or q_out.device != qkv.device or not q_out.is_contiguous()):
        raise ValueError(f"qkv_norm_rope_store: q_out must be contiguous {qkv.dtype} ({t}, {q_heads}, {d}) on {qkv.device}, got "
                         f"{q_out.dtype} {tuple(q_out.shape)} on {q_out.device}")
    if not (use_kernel and _kernel_takes(qkv, d) and d in (64, 128) and pool.dtype == qkv.dtype == q_weight.dtype == k_weight.dtype == cos.dtype == sin.dtype
            and pool.is_contiguous() and pages.dtype == offsets.dtype == torch.int64):
        heads = qkv.view(t, q_heads + 2 * kv_heads, d)
        q = qk_norm_rope(heads[:, :q_heads], q_weight, cos, sin, eps, use_kernel=use_kernel)
        k = qk_norm_rope(heads[:, q_heads:q_heads + kv_heads], k_weight, cos, sin, eps, use_kernel=use_kernel)
        pool[pages, 0, :, offsets, :] = k.to(pool.dtype)
        pool[pages, 1, :, offsets, :] = heads[:, q_heads + kv_heads:].to(pool.dtype)
        return q if q_out is None else q_out.copy_(q)
    from kernels import norm_rope_sm90

    return norm_rope_sm90.qkv_norm_rope_store_cuda(qkv.contiguous(), q_heads, kv_heads, q_weight.contiguous(), k_weight.contiguous(),
                                                   cos.contiguous(), sin.contiguous(), eps, pool, pages.contiguous(), offsets.contiguous(),
                                                   q_out)
