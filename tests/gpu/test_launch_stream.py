"""Kernel launches do not depend on the calling thread's current CUDA device
(`kernels._cute_runtime.launch_stream`).

On 2x H200 a decode rank on cuda:1 launched its first CuTeDSL kernel from a worker
thread whose current device was 0 and hit cudaErrorIllegalAddress. Here a kernel is
launched for tensors on the last GPU from a fresh thread (current device 0) and must
give the CPU reference's bits; the launch context must pick the tensors' device and
that device's current stream, and restore the thread's device afterwards.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

from kernels._cute_runtime import launch_stream
from kernels.act_quant import quantize_act, quantize_act_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

T = TypeVar("T")


def _in_fresh_thread(fn: Callable[[], T]) -> T:
    """Run `fn` in a new thread (which starts on GPU 0, whatever this thread's device is)."""
    result: list[T] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # re-raised in the test's thread
            errors.append(e)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


def test_launch_stream_yields_the_devices_current_stream_and_restores_the_thread_device():
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    side = torch.cuda.Stream(device)

    def probe() -> tuple[int, int, int, int]:
        with torch.cuda.device(device):
            torch.cuda.set_stream(side)  # the device's current stream in this thread, not its default
        before = torch.cuda.current_device()
        with launch_stream(device) as stream:
            inside = torch.cuda.current_device()
            handle = int(stream)
        return before, inside, handle, torch.cuda.current_device()

    before, inside, handle, after = _in_fresh_thread(probe)
    assert (before, inside, after) == (0, device.index, 0)
    assert handle == side.cuda_stream != 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: a tensor off the thread's current device")
def test_a_kernel_launched_from_a_thread_on_another_gpu_is_right():
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    x = (torch.randn(64, 512, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    q, scale = _in_fresh_thread(lambda: tuple(t.cpu() for t in quantize_act(x.to(device))))
    ref_q, ref_scale = quantize_act_reference(x)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(scale, ref_scale)
