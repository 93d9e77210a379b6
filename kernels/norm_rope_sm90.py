"""CuTeDSL kernels of :mod:`kernels.norm_rope` (CUDA tensors only).

Both kernels give one warp to one row and keep the row's sum of squares in a warp
shuffle reduction, so no shared memory and no block barrier:

* add + RMSNorm: a row of ``hidden`` bf16 values, 16-byte vectors of 8 per lane,
  held in registers (``hidden / 64`` registers a lane as bf16): every load of the row,
  its residual and the weight is issued before the first store, then the sum is
  rounded to bf16, stored, its squares summed, and normalized from the registers.
  Loads and stores interleaved per vector (the compiler cannot move a load above a
  store through these raw pointers, which may alias) cost one memory latency per
  vector: 6.5 us for 64 rows of 2048 in a profiled decode step. Any ``hidden`` that
  is a multiple of 8.
* per-head RMSNorm + RoPE: a row is one head of ``head_dim`` 64 or 128, each lane
  holding ``head_dim / 32`` consecutive values, so lanes 0-15 hold the first half
  and lanes 16-31 the second: ``rotate_half`` is a butterfly shuffle across 16 lanes;
* the same for an attention layer's fused q/k/v projection output, a warp per head
  of every token: q heads into a fresh tensor, k heads (normed and rotated) and v
  heads (copied) straight into the token's slot of the layer's paged KV pool.

Roundings follow the torch references of :mod:`kernels.norm_rope` step by step
(fp32 math, a bf16 rounding wherever the reference's bf16 ops round). Launches take
raw device pointers on torch's current stream and never synchronise with the host,
so they are CUDA-graph capturable; one compilation per row length serves every
token count.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import cuda.bindings.driver as cuda_driver
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Int64

from kernels._cute_comm import (gptr, load_i64, load_vec, load_vec_f32, row_launch, store_vec_f32,
                                wait_for_previous_kernel, warp_row)
from kernels._cute_runtime import dummy_stream, launcher

if TYPE_CHECKING:
    from cutlass.base_dsl.jit_executor import JitCompiledFunction

VEC = 8  # bf16 values per 16-byte vector


@cute.jit
def _round_bf16(frag):
    """``frag`` (fp32) rounded to bf16 and back, in place: where the reference's bf16 op rounds."""
    frag.store(frag.load().to(BFloat16).to(Float32))


@cute.jit
def _load_bf16_vec(addr: Int64, valid: Int32, full: cutlass.Constexpr):
    """``VEC`` bf16 at ``addr`` (zeros where the row has ended); ``full``: every lane's vector is inside the row."""
    if cutlass.const_expr(full):
        frag = cute.make_rmem_tensor((VEC,), BFloat16)
        frag.store(cute.make_tensor(gptr(BFloat16, addr), cute.make_layout(VEC)).load())
    else:
        frag = load_vec(addr, BFloat16, VEC, valid)
    return frag


@cute.kernel
def _add_rms_norm_kernel(h: Int64, delta: Int64, weight: Int64, out_h: Int64, out: Int64, rows: Int32, eps: Float32,
                         hidden: cutlass.Constexpr, residual: cutlass.Constexpr):
    wait_for_previous_kernel()
    row, lane = warp_row()
    if row < rows:
        base = Int64(row) * hidden
        chunks = -(-hidden // (32 * VEC))  # a vector per lane each; only the last may pass the row's end
        xs, ds, ws = [], [], []
        for i in cutlass.range_constexpr(chunks):
            c = i * 32 * VEC + lane * VEC
            full = (i + 1) * 32 * VEC <= hidden
            xs.append(_load_bf16_vec(h + (base + c) * 2, hidden - c, full))
            if cutlass.const_expr(residual):
                ds.append(_load_bf16_vec(delta + (base + c) * 2, hidden - c, full))
            ws.append(_load_bf16_vec(weight + c * 2, hidden - c, full))
        ss = Float32(0.0)
        for i in cutlass.range_constexpr(chunks):
            c = i * 32 * VEC + lane * VEC
            v = cute.make_rmem_tensor((VEC,), Float32)
            v.store(xs[i].load().to(Float32))
            if cutlass.const_expr(residual):
                v.store(v.load() + ds[i].load().to(Float32))
                _round_bf16(v)  # the residual stream is bf16: h + delta rounds
                store_vec_f32(out_h + (base + c) * 2, v, BFloat16, VEC, hidden - c)
                xs[i].store(v.load().to(BFloat16))  # exact: v is a bf16 value
            for e in cutlass.range_constexpr(VEC):
                ss += v[e] * v[e]
        ss = cute.arch.warp_reduction_sum(ss)
        inv = cute.math.rsqrt(ss / Float32(hidden) + eps)
        for i in cutlass.range_constexpr(chunks):
            c = i * 32 * VEC + lane * VEC
            v = cute.make_rmem_tensor((VEC,), Float32)
            v.store(xs[i].load().to(Float32) * inv)
            _round_bf16(v)  # normalized in fp32, cast back to bf16 ...
            v.store(v.load() * ws[i].load().to(Float32))  # ... then scaled by the bf16 weight (rounded by the store)
            store_vec_f32(out + (base + c) * 2, v, BFloat16, VEC, hidden - c)


@cute.jit
def _norm_rope_head(src: Int64, weight: Int64, cos: Int64, sin: Int64, dst: Int64, token: Int32, lane: Int32, eps: Float32,
                    head_dim: cutlass.Constexpr):
    """One warp: the head of ``head_dim`` bf16 values at ``src`` normed, scaled by ``weight``,
    rotated by row ``token`` of ``cos``/``sin``, stored at ``dst``."""
    per_lane = head_dim // 32
    c = lane * per_lane
    v = load_vec_f32(src + c * 2, BFloat16, per_lane, per_lane, align=per_lane * 2)
    ss = Float32(0.0)
    for e in cutlass.range_constexpr(per_lane):
        ss += v[e] * v[e]
    ss = cute.arch.warp_reduction_sum(ss)
    inv = cute.math.rsqrt(ss / Float32(head_dim) + eps)
    w = load_vec_f32(weight + c * 2, BFloat16, per_lane, per_lane, align=per_lane * 2)
    v.store(v.load() * inv)
    _round_bf16(v)
    v.store(v.load() * w.load())
    _round_bf16(v)  # the normed head is a bf16 tensor before RoPE
    cs = load_vec_f32(cos + (Int64(token) * head_dim + c) * 2, BFloat16, per_lane, per_lane, align=per_lane * 2)
    sn = load_vec_f32(sin + (Int64(token) * head_dim + c) * 2, BFloat16, per_lane, per_lane, align=per_lane * 2)
    # rotate_half: the first half takes minus the second half's values, the second half the first's.
    sign = Float32(1.0)
    if lane < 16:
        sign = Float32(-1.0)
    r = cute.make_rmem_tensor((per_lane,), Float32)
    for e in cutlass.range_constexpr(per_lane):
        rotated = cute.arch.shuffle_sync_bfly(v[e], offset=16) * sign
        a = (v[e] * cs[e]).to(BFloat16).to(Float32)
        b = (rotated * sn[e]).to(BFloat16).to(Float32)
        r[e] = a + b  # rounded by the store
    store_vec_f32(dst + c * 2, r, BFloat16, per_lane, per_lane, align=per_lane * 2)


@cute.kernel
def _qk_norm_rope_kernel(x: Int64, weight: Int64, cos: Int64, sin: Int64, out: Int64, rows: Int32, heads: Int32,
                         eps: Float32, head_dim: cutlass.Constexpr):
    wait_for_previous_kernel()
    row, lane = warp_row()
    if row < rows:
        offset = Int64(row) * head_dim * 2
        _norm_rope_head(x + offset, weight, cos, sin, out + offset, row // heads, lane, eps, head_dim)


@cute.kernel
def _qkv_norm_rope_store_kernel(qkv: Int64, q_weight: Int64, k_weight: Int64, cos: Int64, sin: Int64, q_out: Int64,
                                pool: Int64, pages: Int64, offsets: Int64, tokens: Int32, eps: Float32,
                                head_dim: cutlass.Constexpr, q_heads: cutlass.Constexpr, kv_heads: cutlass.Constexpr,
                                page_size: cutlass.Constexpr):
    """A warp per (token, head) of ``qkv [T, q_heads + 2 * kv_heads, head_dim]``: q heads are
    normed and rotated into ``q_out [T, q_heads, head_dim]``, k heads normed and rotated, v heads
    copied, both into the token's slot of the paged pool ``[pages, 2, kv_heads, page_size, head_dim]``."""
    wait_for_previous_kernel()
    row, lane = warp_row()
    heads = q_heads + 2 * kv_heads
    if row < tokens * heads:
        token = row // heads
        head = row - token * heads
        src = qkv + Int64(row) * head_dim * 2
        if head < q_heads:
            _norm_rope_head(src, q_weight, cos, sin, q_out + (Int64(token) * q_heads + head) * head_dim * 2, token, lane, eps, head_dim)
        else:
            page = load_i64(pages + Int64(token) * 8)
            slot = load_i64(offsets + Int64(token) * 8)
            kv = (head - q_heads) // kv_heads  # 0: K, 1: V
            kv_head = head - q_heads - kv * kv_heads
            dst = pool + (((page * 2 + kv) * kv_heads + kv_head) * page_size + slot) * head_dim * 2
            if kv == 0:
                _norm_rope_head(src, k_weight, cos, sin, dst, token, lane, eps, head_dim)
            else:
                per_lane = head_dim // 32
                v = load_vec_f32(src + lane * per_lane * 2, BFloat16, per_lane, per_lane, align=per_lane * 2)
                store_vec_f32(dst + lane * per_lane * 2, v, BFloat16, per_lane, per_lane, align=per_lane * 2)


@cute.jit
def _launch_add_rms_norm(h: Int64, delta: Int64, weight: Int64, out_h: Int64, out: Int64, rows: Int32, eps: Float32,
                         stream: cuda_driver.CUstream, hidden: cutlass.Constexpr, residual: cutlass.Constexpr):
    _add_rms_norm_kernel(h, delta, weight, out_h, out, rows, eps, hidden, residual).launch(**row_launch(rows), stream=stream)


@cute.jit
def _launch_qk_norm_rope(x: Int64, weight: Int64, cos: Int64, sin: Int64, out: Int64, rows: Int32, heads: Int32,
                         eps: Float32, stream: cuda_driver.CUstream, head_dim: cutlass.Constexpr):
    _qk_norm_rope_kernel(x, weight, cos, sin, out, rows, heads, eps, head_dim).launch(**row_launch(rows), stream=stream)


@cute.jit
def _launch_qkv_norm_rope_store(qkv: Int64, q_weight: Int64, k_weight: Int64, cos: Int64, sin: Int64, q_out: Int64, pool: Int64,
                                pages: Int64, offsets: Int64, tokens: Int32, eps: Float32, stream: cuda_driver.CUstream,
                                head_dim: cutlass.Constexpr, q_heads: cutlass.Constexpr, kv_heads: cutlass.Constexpr,
                                page_size: cutlass.Constexpr):
    _qkv_norm_rope_store_kernel(qkv, q_weight, k_weight, cos, sin, q_out, pool, pages, offsets, tokens, eps, head_dim, q_heads,
                                kv_heads, page_size).launch(**row_launch(tokens * (q_heads + 2 * kv_heads)), stream=stream)


def compile_add_rms_norm(hidden: int, residual: bool, options: str = "") -> JitCompiledFunction:
    """Compile add + RMSNorm for rows of ``hidden`` now (no GPU needed under CUTE_DSL_ARCH); ``options`` go to
    ``cute.compile``."""
    z = Int64(0)
    return cute.compile(_launch_add_rms_norm, z, z, z, z, z, Int32(1), Float32(1e-6), dummy_stream(), hidden, residual,
                        options=options)


@functools.cache
def compiled_add_rms_norm(hidden: int, residual: bool) -> JitCompiledFunction:
    """Compiled add + RMSNorm for rows of ``hidden`` (cached)."""
    return compile_add_rms_norm(hidden, residual)


@functools.cache
def compiled_qk_norm_rope(head_dim: int) -> JitCompiledFunction:
    """Compiled per-head RMSNorm + RoPE for heads of ``head_dim`` (64 or 128)."""
    z = Int64(0)
    return cute.compile(_launch_qk_norm_rope, z, z, z, z, z, Int32(1), Int32(1), Float32(1e-6), dummy_stream(), head_dim)


@functools.cache
def compiled_qkv_norm_rope_store(head_dim: int, q_heads: int, kv_heads: int, page_size: int) -> JitCompiledFunction:
    """Compiled fused q/k norm + RoPE + K/V store for one attention layout."""
    z = Int64(0)
    return cute.compile(_launch_qkv_norm_rope_store, z, z, z, z, z, z, z, z, z, Int32(1), Float32(1e-6), dummy_stream(),
                        head_dim, q_heads, kv_heads, page_size)


def add_rms_norm_cuda(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous bf16 CUDA tensors (checked by :func:`kernels.norm_rope.add_rms_norm`)."""
    hidden = h.shape[-1]
    rows = h.numel() // hidden
    out = torch.empty_like(h)
    out_h = h if delta is None else torch.empty_like(h)
    if rows == 0:
        return out_h, out
    launcher(compiled_add_rms_norm(hidden, delta is not None), h.device)(
        h.data_ptr(), 0 if delta is None else delta.data_ptr(), weight.data_ptr(), out_h.data_ptr(), out.data_ptr(), rows, eps)
    return out_h, out


def qk_norm_rope_cuda(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """Contiguous bf16 CUDA tensors (checked by :func:`kernels.norm_rope.qk_norm_rope`)."""
    t, heads, head_dim = x.shape
    out = torch.empty_like(x)
    if t * heads == 0:
        return out
    launcher(compiled_qk_norm_rope(head_dim), x.device)(x.data_ptr(), weight.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                                        out.data_ptr(), t * heads, heads, eps)
    return out


def qkv_norm_rope_store_cuda(qkv: torch.Tensor, q_heads: int, kv_heads: int, q_weight: torch.Tensor, k_weight: torch.Tensor,
                             cos: torch.Tensor, sin: torch.Tensor, eps: float, pool: torch.Tensor, pages: torch.Tensor,
                             offsets: torch.Tensor, q_out: torch.Tensor | None = None) -> torch.Tensor:
    """Contiguous bf16 CUDA tensors, int64 ``pages``/``offsets`` (checked by :func:`kernels.norm_rope.qkv_norm_rope_store`)."""
    t = qkv.shape[0]
    head_dim, page_size = pool.shape[-1], pool.shape[-2]
    q = torch.empty(t, q_heads, head_dim, dtype=qkv.dtype, device=qkv.device) if q_out is None else q_out
    if t == 0:
        return q
    launcher(compiled_qkv_norm_rope_store(head_dim, q_heads, kv_heads, page_size), qkv.device)(
        qkv.data_ptr(), q_weight.data_ptr(), k_weight.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(),
        pool.data_ptr(), pages.data_ptr(), offsets.data_ptr(), t, eps)
    return q
