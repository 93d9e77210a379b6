"""Benchmark: MoE grouped GEMM (kernels.grouped_gemm) against torch's grouped GEMMs on one GPU.

Shapes are the expert GEMMs of Qwen3-235B-A22B (hidden 4096, moe_intermediate
1536) and Qwen3-30B-A3B (hidden 2048, moe_intermediate 768), 128 experts:
``gate_up`` (N = 2I, K = H) and ``down`` (N = H, K = I).

* decode, 1/4/16/64 tokens per expert, masked layout -> weight-streaming TB/s
  (weight bytes / time), all-bytes TB/s (weights, activations, scales and output,
  each moved once: ``hbm_tbps``, to set beside the copy ceiling) and latency;
* prefill, 375 and 2048 tokens per expert, contiguous layout -> TFLOP/s.

Our dtypes: bf16, FP8 with 128x128 block scales, bf16 activations x
MXFP8 weights (E4M3 + E8M0 per 32, dequantized inside the kernel), and (decode only)
FP8 activations x MXFP8 weights (``mxfp8_fp8``: FP8 math, each 32-wide K block promoted;
timed without the activations' quantization, which is timed with it as ``with_quant_latency_us``).
Peers, same process and inputs: ``torch._grouped_mm`` (bf16; for MXFP8 on the
dequantized weights) and ``torch._scaled_grouped_mm`` (FP8 rowwise scales, a
coarser scaling than our 128x128 blocks; recorded where it runs); and for prefill cuBLAS on one
dense GEMM of the same total shape (``dense_peers``: same FLOPs, one weight matrix, no grouping;
FP8 with our block scales where ``torch._scaled_mm`` takes them, and with per-tensor scales), the
printed ``dense_tflops`` being the one in our format.  Also measured: a device-to-device
copy, a dense bf16 GEMM and a dense FP8 GEMM (``torch._scaled_mm``) as ceilings, the fused gate_up+SwiGLU against the
plain gate_up GEMM, and the activation quantizer.  Each of our cases is
spot-checked against an fp32 matmul of two experts.

Timing (``--timing``, recorded in every line's ``case.timing``; ours and the
peers are always timed the same way in the same run), see :class:`Timer`:

* ``sustained`` (default): the median over 7 back-to-back replays of a CUDA
  graph holding ``--iters`` launches, after one warm-up replay;
* ``burst``: 3 warm-up launches then 10 timed ones after 50 ms idle, 5 times,
  the median (how KINDS.md measured this workplace's ceilings);
* ``both``: each measurement in both modes.

The SM clock and board power during each measurement are read from NVML
(bench.gpu_clocks, read only) and recorded beside it: a heavy kernel under
sustained load runs at a lower clock than in a burst (power limit).

    python -m bench.grouped_gemm [--quick] [--timing sustained|burst|both]
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import statistics
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch

from bench.gpu_clocks import ClockSampler
from bench.results import print_table, record
from bench.timing import event_time_us
from kernels import grouped_gemm as gg
from kernels.act_quant import quantize_act
from kernels.grouped_gemm_launch import launch
from kernels.grouped_gemm_mxfp8 import dequantize_mxfp8, grouped_gemm_mxfp8, kernel_scale_layout, quantize_mxfp8

BENCH = "grouped_gemm"
MODELS = {"qwen3-235b": (4096, 1536), "qwen3-30b": (2048, 768)}  # hidden, moe_intermediate
EXPERTS = 128
DECODE_TOKENS = (1, 4, 16, 64)
PREFILL_TOKENS = (375, 2048)
FP8 = torch.float8_e4m3fn


TIMINGS = ("sustained", "burst")
SUSTAINED_SAMPLES = 7
BURST_WARMUPS, BURST_LAUNCHES, BURST_SAMPLES, BURST_IDLE_S = 3, 10, 5, 0.05


def _graph(fn, launches: int) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    return graph


class Timer:
    """Per-launch microseconds of ``fn`` in one timing mode, with the SM clock and power it ran at.

    ``sustained``: a CUDA graph of ``iters`` launches, one warm-up replay, then 7
    timed replays back to back; the median replay over ``iters``.  The GPU stays
    loaded for all of them (``load_ms`` records how long: it grows with the
    kernel's time), and the clocks are NVML samples taken meanwhile.
    ``burst``: 5 times: 50 ms idle, 3 warm-up launches, 10 timed launches (each
    group one graph, so no host launch gap), the median over launches; the clocks
    are read right after each timed group.
    """

    def __init__(self, mode: str, iters: int, sampler: ClockSampler):
        if mode not in TIMINGS:
            raise ValueError(f"timing mode {mode!r} is not one of {TIMINGS}")
        self.mode, self.iters, self.sampler = mode, iters, sampler

    def __call__(self, fn) -> tuple[float, dict[str, float]]:
        fn()
        torch.cuda.synchronize()
        return self._sustained(fn) if self.mode == "sustained" else self._burst(fn)

    def _sustained(self, fn) -> tuple[float, dict[str, float]]:
        graph = _graph(fn, self.iters)
        graph.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        samples = [event_time_us(graph.replay) / self.iters for _ in range(SUSTAINED_SAMPLES)]
        t1 = time.perf_counter()
        del graph
        return statistics.median(samples), {**self.sampler.window(t0, t1), "load_ms": (t1 - t0) * 1e3}

    def _burst(self, fn) -> tuple[float, dict[str, float]]:
        warm, timed = _graph(fn, BURST_WARMUPS), _graph(fn, BURST_LAUNCHES)
        samples, readings = [], []
        for _ in range(BURST_SAMPLES):
            torch.cuda.synchronize()
            time.sleep(BURST_IDLE_S)
            warm.replay()
            samples.append(event_time_us(timed.replay) / BURST_LAUNCHES)
            reading = self.sampler.now()
            if reading is not None:
                readings.append(reading)
        del warm, timed
        us = statistics.median(samples)
        clocks = {"load_ms": (BURST_WARMUPS + BURST_LAUNCHES) * us / 1e3}
        if readings:
            clocks.update(sm_mhz_mean=statistics.fmean(r[0] for r in readings), sm_mhz_min=min(r[0] for r in readings),
                          power_w_mean=statistics.fmean(r[1] for r in readings),
                          power_w_max=max(r[1] for r in readings), clock_samples=len(readings))
        return us, clocks


def quantize_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [E, N, K] -> E4M3 with fp32 128x128 block scales (dequant = q * scale)."""
    E, N, K = w.shape
    nb, kb = -(-N // 128), -(-K // 128)
    wp = torch.nn.functional.pad(w.float(), (0, kb * 128 - K, 0, nb * 128 - N)).view(E, nb, 128, kb, 128)
    scale = wp.abs().amax(dim=(2, 4)).clamp(min=1e-10) / 448.0
    q = (wp / scale[:, :, None, :, None]).clamp(-448, 448).to(FP8)
    return q.view(E, nb * 128, kb * 128)[:, :N, :K].contiguous(), scale


def spot_check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rows: list[slice], experts: list[int],
               xs=None, ws=None, masked=False) -> float:
    """Largest relative Frobenius error over a few experts against an fp32 matmul."""
    worst = 0.0
    for e, r in zip(experts, rows):
        xe = x[e, r] if masked else x[r]
        xe = xe.float() if xs is None else xe.float() * (xs[e, r] if masked else xs[r]).repeat_interleave(128, -1)[:, : x.shape[-1]]
        we = w[e].float()
        if ws is not None:
            we = we * ws[e].repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[1], : w.shape[2]]
        ref = xe @ we.T
        got = (out[e, r] if masked else out[r]).float()
        worst = max(worst, ((got - ref).norm() / ref.norm()).item())
    return worst


def ceilings(timer: Timer) -> dict[str, float]:
    """This GPU's ceilings in ``timer``'s mode, each with the clocks it ran at (``<name>_sm_mhz_mean``, ...).

    The copy (1 GiB, bytes read + written) is timed twice: ``copy_kernel``, an
    SM copy kernel (``torch.neg`` into the destination: one read, one write per
    element), the HBM ceiling; and ``copy_memcpy``, ``Tensor.copy_``, which a
    CUDA graph records as a memcpy node, a slower path than the eager copy
    (pytorch/pytorch#191284), so under the sustained mode it is no ceiling.
    Dense GEMMs 8192^3: bf16 (``a @ b``) and FP8 (``torch._scaled_mm``, per-tensor
    scales, b column-major), the yardsticks of the prefill goals on this GPU.
    """
    src = torch.randn(256 * 1024**2, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    a = torch.randn(8192, 8192, device="cuda").bfloat16()
    b = torch.randn(8192, 8192, device="cuda").bfloat16()
    a8, b8 = a.to(FP8), b.to(FP8).t().contiguous().t()
    one = torch.ones((), device="cuda")
    copy_bytes, gemm_flops = 2 * src.numel() * 4, 2 * 8192**3
    runs = {
        "copy_kernel_tbps": (lambda: torch.neg(src, out=dst), copy_bytes),
        "copy_memcpy_tbps": (lambda: dst.copy_(src), copy_bytes),
        "dense_bf16_tflops": (lambda: a @ b, gemm_flops),
        "dense_fp8_tflops": (lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16), gemm_flops),
    }
    out: dict[str, float] = {}
    for name, (fn, work) in runs.items():
        us, clocks = timer(fn)
        out[name] = work / us / 1e6
        stem = name.rsplit("_", 1)[0]
        out.update({f"{stem}_{k}": v for k, v in clocks.items()})
    return out


def dense_peers(x_bf16: torch.Tensor, w_bf16: torch.Tensor, fp8: tuple[torch.Tensor, torch.Tensor] | None,
                w_fp8: tuple[torch.Tensor, torch.Tensor] | None, timer: Timer) -> dict[str, dict[str, float]]:
    """cuBLAS on one dense GEMM of the grouped case's total shape (all T rows times expert 0's weights).

    Same FLOPs and output, but one weight matrix read instead of E and no grouping: how fast
    this GPU's own library runs the shape itself.  bf16: ``x @ w.T``.  FP8 (``fp8`` = our
    activations and their 1x128 scales, ``w_fp8`` = expert 0's E4M3 weights and 128x128
    scales): ``torch._scaled_mm`` with those block scales where this torch and cuBLAS take
    them (the scale layouts it may accept are tried in turn; the first that runs and is right,
    against an fp32 matmul of the first rows, is timed and its error recorded), and with
    per-tensor scales of 1 (timing only: the cheapest FP8 GEMM cuBLAS has, on the same bytes).
    """
    flops = 2.0 * x_bf16.shape[0] * w_bf16.shape[0] * w_bf16.shape[1]
    runs: dict[str, object] = {}
    errs: dict[str, float] = {}
    if fp8 is None:
        runs["dense_bf16_cublas"] = lambda: x_bf16 @ w_bf16.T
    else:
        (xq, xs), (wq, ws) = fp8, w_fp8
        xs_k = xs[:, : -(-xq.shape[1] // 128)]  # the quantizer pads its scale rows
        # Some layouts are taken but misread (a 9% error on K = 768 with the weight scales K-block-minor):
        # the first whose result is right within FP8's error is timed.
        ws_pad = torch.zeros(ws.shape[0], -(-ws.shape[1] // 4) * 4, device="cuda")  # K blocks to 16-byte rows
        ws_pad[:, : ws.shape[1]] = ws
        layouts = [(sa, sb) for sa in (xs_k.t().contiguous().t(), xs_k.contiguous(), xs_k)
                   for sb in (ws.t(), ws.t().contiguous(), ws_pad[:, : ws.shape[1]].t())]
        for sa, sb in layouts:
            fn = lambda sa=sa, sb=sb: torch._scaled_mm(xq, wq.T, sa, sb, out_dtype=torch.bfloat16)  # noqa: E731
            try:
                err = spot_check(fn(), xq, wq[None], [slice(0, 64)], [0], xs, ws[None])
            except Exception as exc:  # noqa: BLE001 - a scale layout this build refuses: try the next
                print(f"  dense block-scaled _scaled_mm refused scales strided {sa.stride()} / {sb.stride()}: "
                      f"{str(exc)[:160]}", file=sys.stderr)
                continue
            print(f"  dense block-scaled _scaled_mm, scales strided {sa.stride()} / {sb.stride()}: rel err {err:.1e}",
                  file=sys.stderr)
            if err < 1e-2:
                runs["dense_fp8_block128_cublas"] = fn
                errs["dense_fp8_block128_cublas"] = err
                break
        one = torch.ones((), device="cuda")
        runs["dense_fp8_tensorwise_cublas"] = lambda: torch._scaled_mm(xq, wq.T, one, one, out_dtype=torch.bfloat16)
    peers: dict[str, dict[str, float]] = {}
    for name, fn in runs.items():
        us, clocks = timer(fn)
        peers[name] = {"latency_us": us, "tflops": flops / us / 1e6, **clocks}
        if name in errs:
            peers[name]["rel_err"] = errs[name]
    return peers


def run_case(model: str, proj: str, phase: str, m: int, dtype: str, timer: Timer, weights: dict,
             tile_m: int | None = None, tile_n: int | None = None, with_peers: bool = True,
             swap_ab: bool | None = None) -> dict:
    """One GEMM case; ``dtype`` is "bf16", "fp8" (128x128 block scales), "mxfp8" (bf16 x MXFP8 weights) or
    "mxfp8_fp8" (FP8 activations x MXFP8 weights).

    ``with_peers=False`` leaves out the peers (a tile A/B whose other side timed them); ``swap_ab`` forces
    the MXFP8 operand order (see ``kernels.grouped_gemm_launch.choose_config``).
    """
    hidden, inter = MODELS[model]
    N, K = (2 * inter, hidden) if proj == "gate_up" else (hidden, inter)
    E = EXPERTS
    fp8, mxfp8 = dtype == "fp8", dtype.startswith("mxfp8")
    fp8_act = dtype in ("fp8", "mxfp8_fp8")
    w_bf16 = weights[(model, proj)]
    w, ws = weights[(model, proj, "mxfp8" if mxfp8 else dtype)] if dtype != "bf16" else (w_bf16, None)
    masked = phase == "decode"
    T = E * m
    x_bf16 = torch.randn(T, K, device="cuda").bfloat16()
    offsets = torch.arange(0, T + 1, m, dtype=torch.int32, device="cuda")
    if masked:
        x_ours = x_bf16.view(E, m, K)
        groups = torch.full((E,), m, dtype=torch.int32, device="cuda")
    else:
        x_ours, groups = x_bf16, offsets
    xq, xs = quantize_act(x_ours) if fp8_act else (x_ours, None)
    out = torch.empty(*x_ours.shape[:-1], N, dtype=torch.bfloat16, device="cuda")
    if tile_m is None and tile_n is None and swap_ab is None:
        if mxfp8:
            ours = lambda: grouped_gemm_mxfp8(xq, w, ws, groups, masked=masked, x_scale=xs, out=out)  # noqa: E731
        else:
            ours = lambda: gg.grouped_gemm(xq, w, groups, masked=masked, x_scale=xs, w_scale=ws, out=out)  # noqa: E731
    else:  # a forced tile bucket, through the launcher (inputs built above are valid by construction)
        ours = lambda: launch(xq, w, groups, masked=masked, x_scale=xs,  # noqa: E731
                              w_scale=None if mxfp8 else ws, row_weights=None, swiglu=False, out=out, tile_m=tile_m,
                              tile_n=tile_n, w_scale_e8m0=ws if mxfp8 else None, swap_ab=swap_ab)
    us, clocks = timer(ours)
    quant_us = timer(lambda: (quantize_act(x_ours), ours()))[0] if dtype == "mxfp8_fp8" else None
    experts = [0, E - 1]
    rows = [slice(0, m), slice(0, m)] if masked else [slice(0, m), slice(T - m, T)]
    if mxfp8:  # the reference sees the dequantized weights (exact in bf16)
        err = spot_check(out, xq, dequantize_mxfp8(w, ws, torch.bfloat16), rows, experts, xs, masked=masked)
    else:
        err = spot_check(out, xq, w, rows, experts, xs, ws, masked)

    flops = 2.0 * T * N * K
    wbytes = w.numel() * w.element_size() + (0 if ws is None else ws.numel() * ws.element_size())
    # Every byte the GEMM must move through HBM at least once (weights and their scales, activations and
    # theirs, the output): next to the copy ceiling this says how far a decode case is from its roofline.
    min_bytes = wbytes + sum(t.numel() * t.element_size() for t in (xq, xs, out) if t is not None)
    metrics = {"latency_us": us, "tflops": flops / us / 1e6, "weight_tbps": wbytes / us / 1e6,
               "hbm_tbps": min_bytes / us / 1e6, "spot_rel_err": err, **clocks}
    if quant_us is not None:
        metrics["with_quant_latency_us"] = quant_us
    peers: dict[str, dict[str, float]] = {}
    w_t = w_bf16.transpose(1, 2)  # [E, K, N] view of the same [E, N, K] storage
    if mxfp8:
        w_t = dequantize_mxfp8(w, ws, torch.bfloat16).transpose(1, 2)
    if with_peers and not fp8:  # bf16 and both MXFP8 kinds
        p_us, p_clocks = timer(lambda: torch._grouped_mm(x_bf16, w_t, offs=offsets[1:]))
        peers["torch._grouped_mm"] = {"latency_us": p_us, "tflops": flops / p_us / 1e6,
                                      "weight_tbps": wbytes / p_us / 1e6, **p_clocks}
    elif with_peers:
        try:
            wq_row = weights[(model, proj, "fp8_rowwise")]
            xr_scale = x_bf16.float().abs().amax(-1).clamp(min=1e-10) / 448.0
            xr = (x_bf16.float() / xr_scale[:, None]).to(FP8)
            p_us, p_clocks = timer(lambda: torch._scaled_grouped_mm(xr, wq_row[0].transpose(1, 2), xr_scale, wq_row[1],
                                                                    offs=offsets[1:], out_dtype=torch.bfloat16))
            peers["torch._scaled_grouped_mm_rowwise"] = {"latency_us": p_us, "tflops": flops / p_us / 1e6,
                                                         "weight_tbps": wbytes / p_us / 1e6, **p_clocks}
        except Exception as exc:  # recorded, not fatal: the peer may not exist on this build/GPU
            peers["torch._scaled_grouped_mm_rowwise"] = {"error": 1.0}
            print(f"  torch._scaled_grouped_mm failed: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
    if with_peers and not masked and not mxfp8:
        peers.update(dense_peers(x_bf16, w_bf16[0], (xq, xs) if fp8 else None, (w[0], ws[0]) if fp8 else None, timer))
    case = {"model": model, "proj": proj, "phase": phase, "tokens_per_expert": m, "experts": E, "n": N, "k": K,
            "dtype": {"bf16": "bf16", "fp8": "fp8_block128", "mxfp8": "bf16_x_mxfp8", "mxfp8_fp8": "fp8_x_mxfp8"}[dtype],
            "layout": "masked" if masked else "contiguous", "tile_m": tile_m or "auto", "tile_n": tile_n or "auto",
            "swap_ab": "auto" if swap_ab is None else swap_ab, "timing": timer.mode}
    record(BENCH, case, metrics, peers)
    peer = next(iter(peers.values()), {})
    dense = peers.get("dense_fp8_block128_cublas" if fp8 else "dense_bf16_cublas", {})
    return {**case, **metrics, "peer_latency_us": peer.get("latency_us", float("nan")),
            "speedup_vs_peer": peer.get("latency_us", float("nan")) / us,
            "dense_tflops": dense.get("tflops", float("nan"))}


def run_swiglu_case(model: str, phase: str, m: int, fp8: bool, timer: Timer, weights: dict) -> dict:
    """Fused gate_up + SwiGLU + routing weight vs the plain gate_up GEMM alone."""
    hidden, inter = MODELS[model]
    E, K = EXPERTS, hidden
    masked = phase == "decode"
    T = E * m
    x = torch.randn(T, K, device="cuda").bfloat16()
    groups = torch.full((E,), m, dtype=torch.int32, device="cuda") if masked else torch.arange(0, T + 1, m, dtype=torch.int32, device="cuda")
    x = x.view(E, m, K) if masked else x
    xq, xs = quantize_act(x) if fp8 else (x, None)
    key = (model, "gate_up", "fp8") if fp8 else (model, "gate_up")
    w, ws = weights[key] if fp8 else (weights[key], None)
    wi, si = gg.interleave_gate_up(w, ws)
    rw = torch.rand(*x.shape[:-1], device="cuda")
    out = torch.empty(*x.shape[:-1], inter, dtype=torch.bfloat16, device="cuda")
    fused_us, clocks = timer(lambda: gg.grouped_gemm_swiglu(xq, wi, groups, masked=masked, x_scale=xs,
                                                            w_scale_interleaved=si, row_weights=rw, out=out))
    h = torch.empty(*x.shape[:-1], 2 * inter, dtype=torch.bfloat16, device="cuda")

    def unfused():
        gg.grouped_gemm(xq, w, groups, masked=masked, x_scale=xs, w_scale=ws, out=h)
        g, u = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(g) * u * rw[..., None]

    unfused_us, unfused_clocks = timer(unfused)
    case = {"model": model, "proj": "gate_up_swiglu", "phase": phase, "tokens_per_expert": m, "experts": E,
            "n": 2 * inter, "k": K, "dtype": "fp8_block128" if fp8 else "bf16", "layout": "masked" if masked else "contiguous",
            "timing": timer.mode}
    metrics = {"latency_us": fused_us, "tflops": 2.0 * T * 2 * inter * K / fused_us / 1e6, **clocks}
    record(BENCH, case, metrics, {"gemm_then_torch_swiglu": {"latency_us": unfused_us, **unfused_clocks}})
    return {**case, **metrics, "peer_latency_us": unfused_us, "speedup_vs_peer": unfused_us / fused_us}


def make_weights(model: str) -> dict:
    hidden, inter = MODELS[model]
    weights: dict = {}
    for proj, (N, K) in {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}.items():
        w = (torch.randn(EXPERTS, N, K, device="cuda") / K**0.5).bfloat16()
        weights[(model, proj)] = w
        weights[(model, proj, "fp8")] = quantize_weights(w)
        q, s = quantize_mxfp8(w)
        weights[(model, proj, "mxfp8")] = (q, kernel_scale_layout(s))  # held as prepare_for_kernels holds them
        rscale = w.float().abs().amax(-1).clamp(min=1e-10) / 448.0
        weights[(model, proj, "fp8_rowwise")] = ((w.float() / rscale[..., None]).to(FP8), rscale)
    return weights


DTYPES = ("bf16", "fp8", "mxfp8", "mxfp8_fp8")
DECODE_ONLY = ("mxfp8_fp8",)  # FP8 activations x MXFP8 weights: the swapped decode tiles only


def case_list(quick: bool, prefill_tokens: tuple[int, ...] = PREFILL_TOKENS,
              decode_tokens: tuple[int, ...] = DECODE_TOKENS) -> list[tuple]:
    """(kind, model, proj, phase, tokens, dtype) in run order, the most wanted first."""
    models = ["qwen3-30b"] if quick else ["qwen3-235b", "qwen3-30b"]
    cases = []
    for model in models:
        for proj in ("gate_up", "down"):
            cases += [("gemm", model, proj, "prefill", m, dt) for m in prefill_tokens for dt in DTYPES
                      if dt not in DECODE_ONLY]
            cases += [("gemm", model, proj, "decode", m, dt) for m in decode_tokens for dt in DTYPES]
        cases += [("swiglu", model, "gate_up", phase, m, dt)
                  for phase, m in (("decode", 16), ("prefill", 375)) for dt in ("bf16", "fp8")]
    return cases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="one model")
    ap.add_argument("--skip", default="", help="comma list of kind:model:proj:phase:tokens:dtype to leave out")
    ap.add_argument("--tile-m", type=int, default=None,
                    help="force the tile rows (64/128) of every plain GEMM case run (pick them with --only / --dtypes)")
    ap.add_argument("--tile-n", type=int, default=None, help="force the tile width of every plain GEMM case run")
    ap.add_argument("--mx-order", choices=("auto", "swapped", "staged"), default="auto",
                    help="MXFP8 cases: force the swapped operands (weights converted in registers) or the staged "
                         "bf16 weight tiles (the tokens as the MMA's M side)")
    ap.add_argument("--only", default="", help="comma list of case-name prefixes to run (default: all)")
    ap.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma list of dtypes to run (of {','.join(DTYPES)})")
    ap.add_argument("--prefill-tokens", default=",".join(map(str, PREFILL_TOKENS)),
                    help="comma list of tokens per expert of the prefill cases")
    ap.add_argument("--decode-tokens", default=",".join(map(str, DECODE_TOKENS)),
                    help="comma list of tokens per expert of the decode cases")
    ap.add_argument("--no-peers", action="store_true",
                    help="plain GEMM cases without torch's grouped GEMMs (an A/B run whose other side times them)")
    ap.add_argument("--deadline-s", type=float, default=1e9, help="start no case after this many seconds")
    ap.add_argument("--case-timeout-s", type=float, default=60.0, help="dump stacks and exit if one case hangs")
    ap.add_argument("--timing", choices=(*TIMINGS, "both"), default="sustained",
                    help="sustained: back-to-back graph replays; burst: 10 launches after 3 warm-ups and an idle gap "
                         "(see Timer); both: every measurement both ways")
    args = ap.parse_args(argv)
    unknown = set(filter(None, args.dtypes.split(","))) - set(DTYPES)
    if unknown:
        ap.error(f"unknown --dtypes {', '.join(sorted(unknown))} (of {','.join(DTYPES)})")
    with ClockSampler(torch.cuda.current_device()) as sampler:
        if sampler.error:
            print(f"no clock readings: {sampler.error}", file=sys.stderr)
        modes = TIMINGS if args.timing == "both" else (args.timing,)
        return run(args, [Timer(mode, args.iters, sampler) for mode in modes])


def run(args: argparse.Namespace, timers: list[Timer]) -> int:
    t0 = time.perf_counter()
    # Which kernels ran: a scratch package put first on PYTHONPATH is shadowed by the checkout's under
    # `python3 -m` (the working directory goes first on sys.path) unless PYTHONSAFEPATH=1.
    print(f"kernels from {os.path.dirname(gg.__file__)}", flush=True)
    torch.manual_seed(0)
    x = torch.randn(EXPERTS * 375, 4096, device="cuda").bfloat16()
    q_bytes = x.numel() * 3 + x.numel() // 128 * 4
    for timer in timers:
        faulthandler.dump_traceback_later(args.case_timeout_s, exit=True)
        ceil = ceilings(timer)
        record(BENCH, {"what": "ceilings", "timing": timer.mode}, ceil)
        print(f"ceilings ({timer.mode}): copy {ceil['copy_kernel_tbps']:.2f} TB/s (memcpy path "
              f"{ceil['copy_memcpy_tbps']:.2f}), dense bf16 GEMM {ceil['dense_bf16_tflops']:.0f} TFLOP/s at "
              f"{ceil.get('dense_bf16_sm_mhz_mean', float('nan')):.0f} MHz, dense FP8 GEMM {ceil['dense_fp8_tflops']:.0f} "
              f"TFLOP/s at {ceil.get('dense_fp8_sm_mhz_mean', float('nan')):.0f} MHz", flush=True)
        q_us, clocks = timer(lambda: quantize_act(x))
        record(BENCH, {"what": "quantize_act", "rows": x.shape[0], "k": x.shape[1], "timing": timer.mode},
               {"latency_us": q_us, "gbps": q_bytes / q_us / 1e3, **clocks})
        print(f"quantize_act {tuple(x.shape)} ({timer.mode}): {q_us:.1f} us, {q_bytes / q_us / 1e3:.0f} GB/s", flush=True)
        faulthandler.cancel_dump_traceback_later()
    del x

    skip = set(filter(None, args.skip.split(",")))
    only = tuple(filter(None, args.only.split(",")))
    dtypes = set(filter(None, args.dtypes.split(",")))
    rows, weights, loaded = [], {}, None
    prefill_tokens = tuple(int(t) for t in args.prefill_tokens.split(",") if t)
    decode_tokens = tuple(int(t) for t in args.decode_tokens.split(",") if t)
    for kind, model, proj, phase, m, dtype in case_list(args.quick, prefill_tokens, decode_tokens):
        name = f"{kind}:{model}:{proj}:{phase}:{m}:{dtype}"
        if name in skip or (only and not name.startswith(only)) or dtype not in dtypes:
            continue
        if time.perf_counter() - t0 > args.deadline_s:
            print(f"deadline reached, not run: {name}", flush=True)
            continue
        if loaded != model:
            weights, loaded = {}, None
            torch.cuda.empty_cache()
            weights, loaded = make_weights(model), model
        tile_m, tile_n = args.tile_m, args.tile_n
        for timer in timers:
            faulthandler.dump_traceback_later(args.case_timeout_s, exit=True)
            if kind == "gemm":
                row = run_case(model, proj, phase, m, dtype, timer, weights, tile_m, tile_n, not args.no_peers,
                               {"auto": None, "swapped": True, "staged": False}[args.mx_order])
            else:
                row = run_swiglu_case(model, phase, m, dtype == "fp8", timer, weights)
            faulthandler.cancel_dump_traceback_later()
            rows.append(row)
            print(f"[{time.perf_counter() - t0:6.1f}s] {name} tile={tile_m or 'auto'}x{tile_n or 'auto'} {timer.mode}: "
                  f"{row['latency_us']:.1f} us {row['tflops']:.0f} TFLOP/s {row.get('weight_tbps', float('nan')):.2f} TB/s "
                  f"(all bytes {row.get('hbm_tbps', float('nan')):.2f}) "
                  f"NVML {row.get('sm_mhz_mean', float('nan')):.0f} MHz {row.get('power_w_mean', float('nan')):.0f} W; "
                  f"peer {row['peer_latency_us']:.1f} us dense {row.get('dense_tflops', float('nan')):.0f} TFLOP/s "
                  f"err {row.get('spot_rel_err', float('nan')):.1e}", flush=True)

    print_table(rows, ["model", "proj", "phase", "tokens_per_expert", "dtype", "timing", "latency_us", "tflops",
                       "weight_tbps", "hbm_tbps", "sm_mhz_mean", "peer_latency_us", "speedup_vs_peer", "dense_tflops"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
