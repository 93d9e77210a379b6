"""`bench.timing.gpu_time` on a GPU: the GPU's own time for a step, whatever the host does meanwhile.

* A step whose host work (a 20 ms wait) dwarfs its kernels is host-bound: `time_step` counts the wait,
  `gpu_time` only the kernels, which a plain event pair around them times alike when they are issued
  back to back.
* A step that reads a result on the host (a sync inside it) has no GPU-only figure: None.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import pytest
import torch

from bench.timing import event_time_us, gpu_time, sync, time_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HOST_WAIT_S = 0.02


def _kernels(a: torch.Tensor) -> torch.Tensor:
    for _ in range(20):
        a = torch.tanh(a @ a)
    return a


def _events_time(fn: Callable[[], object], device: torch.device, iters: int = 5) -> float:
    """Median seconds between events around ``fn`` (after one warm-up call), issued with nothing else in the way."""
    fn()
    times = []
    for _ in range(iters):
        sync(device)
        times.append(event_time_us(fn) / 1e6)
    return statistics.median(times)


def test_a_host_bound_step_counts_only_its_kernels() -> None:
    device = torch.device("cuda")
    a = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16) / 64

    def host_bound_step() -> None:
        time.sleep(HOST_WAIT_S / 2)
        _kernels(a)
        time.sleep(HOST_WAIT_S / 2)

    kernels_s = _events_time(lambda: _kernels(a), device)
    assert kernels_s < HOST_WAIT_S / 4, "the kernels must be short against the host wait for this test to mean anything"
    wall_s = time_step(host_bound_step, device, 5)
    gpu_s = gpu_time(host_bound_step, device, 5)
    assert wall_s > HOST_WAIT_S
    assert gpu_s is not None
    assert gpu_s == pytest.approx(kernels_s, rel=0.25, abs=5e-5)


def test_a_step_that_syncs_with_the_host_has_no_gpu_only_time() -> None:
    device = torch.device("cuda")
    a = torch.randn(1024, 1024, device=device) / 32

    def syncing_step() -> float:
        return _kernels(a).sum().item()

    assert gpu_time(syncing_step, device, 3) is None
