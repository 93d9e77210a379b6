"""Host-side glue between torch and compiled CuTeDSL kernels: streams and the target arch."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from cuda.bindings.driver import CUstream


def ensure_target_arch() -> None:
    """Compile for Hopper (sm_90a) unless the caller chose another target.

    Without a GPU the DSL cannot detect the architecture; CI compiles for sm_90a.
    """
    if "CUTE_DSL_ARCH" not in os.environ and not torch.cuda.is_available():
        os.environ["CUTE_DSL_ARCH"] = "sm_90a"


def dummy_stream() -> CUstream:
    """A stream placeholder for `cute.compile` (only its type matters)."""
    import cuda.bindings.driver as cuda_driver

    return cuda_driver.CUstream(0)


@contextlib.contextmanager
def launch_stream(device: torch.device) -> Iterator[CUstream]:
    """Launch context for kernels on tensors of ``device``, from any thread: makes ``device``
    current for the block and yields torch's current stream of ``device`` as the driver handle.

    The compiled functions load their module into, and launch in, the current context,
    and a thread's current device is its own (a new thread starts on GPU 0): launched
    for a cuda:1 tensor from such a thread, a kernel ran in GPU 0's context on GPU 0's
    stream and failed with cudaErrorIllegalAddress (seen on 2x H200). Compile and
    launch inside the block::

        with launch_stream(x.device) as stream:
            compiled(..., stream)
    """
    import cuda.bindings.driver as cuda_driver

    with torch.cuda.device(device):
        yield cuda_driver.CUstream(torch.cuda.current_stream(device).cuda_stream)
