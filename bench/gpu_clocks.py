"""Reading the GPU's SM clock and power while a benchmark times something (read only).

A GPU under sustained load can lower its SM clock to stay under its power
limit, so a throughput figure means little without the clock it ran at.
:class:`ClockSampler` polls NVML (through ``torch.cuda.clock_rate`` /
``power_draw``, which map ``CUDA_VISIBLE_DEVICES`` to NVML's numbering) from a
background thread; :meth:`ClockSampler.window` gives the readings taken
between two moments.  Nothing here changes a clock, a power limit or any
other setting of the card.  Without NVML (no ``pynvml``, no driver) the
sampler records nothing and every window is empty.

What the readings showed on 2x H200 (grouped_gemm.jsonl at a371ffeef6e4 and
d53287d0f526): under the bench's sustained timing a dense bf16 8192^3 GEMM read
1650-1700 MHz at the 700 W cap (nvidia-smi: "SW Power Cap" active, no thermal
slowdown, at most 73 C) and in bursts 1930-1980 MHz.  NVML's SM clock is the
clock set at the moment of the sample, not the clock averaged over a kernel:
ncu (``--clock-control none``) measured single grouped-GEMM launches at an
effective 1.54-1.61 GHz (cycles over duration) where NVML samples of similar
short runs read 1980, and clock stamps inside one launch (``clock64`` over
``%globaltimer``, a scratch probe, branch ``s29-probe``) put the FP8 grouped GEMM of
Qwen3-30B down at 1.56 GHz (375 tokens per expert) and 1.61 GHz (2048) in the bench's
bursts, whose lines say NVML's 1980.  Read the recorded clocks as an upper bound; NVML's
power figure is itself averaged over a past period and lags short windows.
"""

from __future__ import annotations

import statistics
import threading
import time

import torch


class ClockSampler:
    """Samples (wall time, SM MHz, board watts) of one CUDA device every ``period_s`` seconds."""

    def __init__(self, device: int = 0, period_s: float = 0.01):
        self.device = device
        self.period_s = period_s
        self.samples: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error = ""
        try:
            self._read()
        except Exception as exc:  # no NVML here: run without readings, say why once
            self.error = f"{type(exc).__name__}: {exc}"

    def _read(self) -> tuple[float, float, float]:
        return (time.perf_counter(), float(torch.cuda.clock_rate(self.device)),
                torch.cuda.power_draw(self.device) / 1e3)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.samples.append(self._read())

    def __enter__(self) -> ClockSampler:
        if not self.error:
            self._thread = threading.Thread(target=self._run, name="clock-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def now(self) -> tuple[float, float] | None:
        """(SM MHz, board watts) read at once; None without NVML."""
        return None if self.error else self._read()[1:]

    def window(self, t0: float, t1: float) -> dict[str, float]:
        """SM clock (mean, min) and power (mean, max) sampled between perf_counter times ``t0`` and ``t1``.

        Empty when nothing was sampled then (no NVML, or a window shorter than the period).
        NVML's power figure is itself averaged over a short past period, so it lags a short window.
        """
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if not inside:
            return {}
        mhz = [s[1] for s in inside]
        watts = [s[2] for s in inside]
        return {"sm_mhz_mean": statistics.fmean(mhz), "sm_mhz_min": min(mhz),
                "power_w_mean": statistics.fmean(watts), "power_w_max": max(watts), "clock_samples": len(inside)}
