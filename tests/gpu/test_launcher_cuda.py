"""Kernel launches through `kernels._cute_runtime.Launcher` on a GPU.

* A launch runs on the current stream of its tensors' device (captured into a CUDA graph on the
  capture stream, and replayed from it).
* It does not depend on the calling thread's current CUDA device: on 2x H200 a decode rank on cuda:1
  launched its first CuTeDSL kernel from a worker thread whose current device was 0 and hit
  cudaErrorIllegalAddress. A kernel launched for tensors on the last GPU from a fresh thread (current
  device 0) must give the CPU reference's bits and leave the thread's device as it was.
* Threads launching the same kernel at once each pass their own arguments (cells are per thread).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

from kernels._cute_runtime import LaunchError, launcher
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


def _rows(seed: int, rows: int = 64, k: int = 512) -> torch.Tensor:
    return (torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * 3).to(torch.bfloat16)


def _assert_quantized(got: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> None:
    ref_q, ref_scale = quantize_act_reference(x)
    assert torch.equal(got[0].cpu().view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(got[1].cpu(), ref_scale)


def test_a_launch_runs_on_the_current_stream_and_is_captured_in_a_graph():
    x = _rows(0).cuda()
    quantize_act(x)  # compiled and loaded outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a side stream is current: a launch anywhere else fails the capture
        q, scale = quantize_act(x)
    q.zero_()
    scale.zero_()
    graph.replay()
    torch.cuda.synchronize()
    _assert_quantized((q, scale), x.cpu())


def test_threads_launching_the_same_kernel_at_once_pass_their_own_arguments():
    inputs = [_rows(seed).cuda() for seed in range(8)]
    results: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    start = threading.Barrier(len(inputs))

    def worker(i: int) -> None:
        torch.cuda.set_device(inputs[i].device)
        start.wait()
        results[i] = [quantize_act(inputs[i]) for _ in range(50)]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    for i, x in enumerate(inputs):
        assert len(results[i]) == 50
        for got in results[i]:
            _assert_quantized(got, x.cpu())


def test_a_launch_with_the_wrong_number_of_arguments_is_refused():
    from kernels.act_quant_sm90 import compiled_quantizer

    launch = launcher(compiled_quantizer(512), torch.device("cuda", 0))
    with pytest.raises(LaunchError, match="takes 6 arguments besides the stream, got 2"):
        launch(0, 0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: a tensor off the thread's current device")
def test_a_kernel_launched_from_a_thread_on_another_gpu_is_right_and_leaves_the_threads_device():
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    x = _rows(1)

    def run() -> tuple[int, tuple[torch.Tensor, torch.Tensor], int]:
        before = torch.cuda.current_device()
        got = quantize_act(x.to(device))
        return before, tuple(t.cpu() for t in got), torch.cuda.current_device()

    before, got, after = _in_fresh_thread(run)
    assert before == after == 0
    _assert_quantized(got, x)
