"""CUDA timing pieces the GPU benchmarks share: CUDA events around a call, graphs of many calls.

Multi-rank benchmarks put every rank in step (barrier + synchronize) before each
sample, so that one rank's time does not include waiting for a late peer.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def event_time_us(fn: Callable[[], object]) -> float:
    """Microseconds of one call of ``fn`` between two CUDA events on the current stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def ranks_time_us(fn: Callable[[], object], reps: int = 10) -> float:
    """Median microseconds of ``fn`` over ``reps`` eager calls after one warm-up call, ranks in step."""
    fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        times.append(event_time_us(fn))
    return statistics.median(times)


def capture_graph(fn: Callable[[], object], repeat: int, warmup: bool = False) -> torch.cuda.CUDAGraph:
    """``repeat`` calls of ``fn`` captured in one CUDA graph on a side stream.

    ``warmup``: call ``fn`` once on that stream first (first-use setup, compilation),
    outside the graph.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    if warmup:
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(repeat):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    return graph


def kernel_profile(step: Callable[[], object], device: torch.device, steps: int, rows: int = 25) -> str:
    """The GPU kernels of ``steps`` calls of ``step`` (e.g. a graph replay) under the torch
    profiler, as its table sorted by total CUDA time (``rows`` kernels): where a step's time
    goes. Every rank of a multi-rank step must call it alike (their kernels wait for each other)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        sync(device)
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=100)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(step: Callable[[], object], device: torch.device, iters: int) -> float:
    """Median wall seconds of ``step`` after two warm-up calls (which also compile kernels,
    or capture a CUDA graph), the device synchronized around each call."""
    times = []
    for it in range(iters + 2):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        if it >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def issue_time(step: Callable[[], object], device: torch.device, iters: int) -> float:
    """Median wall seconds the host takes to issue ``step`` (one warm-up call first), the
    device idle at the start and not waited for at the end: where this is close to
    `time_step`'s figure, the GPU waits for the host (the step is host-bound). On a CPU
    device the issue is the work itself."""
    step()
    times = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    sync(device)
    return statistics.median(times)


def gpu_time(step: Callable[[], object], device: torch.device, iters: int) -> float | None:
    """Median seconds the GPU alone spends on ``step``: a spin kernel (`torch.cuda._sleep`) holds
    the stream while the host issues the whole step behind it, and CUDA events after the spin and
    after the step time the GPU's part. Against `time_step`'s figure the difference is what the
    GPU waits for the host. A sample whose spin ended before the host finished issuing is taken
    again with a spin twice as long (the clock may run faster than when the spin rate was
    timed); None on a CPU device, or where even a spin over 48x the issue time ended first: the step
    waits for the GPU (a host sync inside it), so its figure would count host time."""
    if device.type != "cuda":
        return None
    issue_s = issue_time(step, device, 1)  # also the warm-up
    spin_s, cycles_per_s = 3 * issue_s + 2e-3, _spin_cycles_per_s(device)
    times = []
    for _ in range(iters):
        for _attempt in range(5):
            seconds = _gpu_sample(step, device, int(spin_s * cycles_per_s))
            if seconds is not None:
                times.append(seconds)
                break
            spin_s *= 2
        else:
            return None
    return statistics.median(times)


def _gpu_sample(step: Callable[[], object], device: torch.device, spin_cycles: int) -> float | None:
    """One sample of `gpu_time`, None when the GPU was already past the spin once the step was issued."""
    sync(device)
    spun, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(spin_cycles)
    spun.record()
    step()
    done.record()
    issued_in_time = not spun.query()
    done.synchronize()
    return spun.elapsed_time(done) / 1e3 if issued_in_time else None


def _spin_cycles_per_s(device: torch.device) -> float:
    """Clock cycles `torch.cuda._sleep` spins per second on ``device``, timed once."""
    cycles = 10_000_000
    sync(device)
    return cycles / (event_time_us(lambda: torch.cuda._sleep(cycles)) / 1e6)
