"""Host-side glue between torch and compiled CuTeDSL kernels: streams and the target arch."""

from __future__ import annotations

import os

import torch


def ensure_target_arch() -> None:
    """Compile for Hopper (sm_90a) unless the caller chose another target.

    Without a GPU the DSL cannot detect the architecture; CI compiles for sm_90a.
    """
    if "CUTE_DSL_ARCH" not in os.environ and not torch.cuda.is_available():
        os.environ["CUTE_DSL_ARCH"] = "sm_90a"


def dummy_stream():
    """A stream placeholder for `cute.compile` (only its type matters)."""
    import cuda.bindings.driver as cuda_driver

    return cuda_driver.CUstream(0)


def current_stream():
    """torch's current CUDA stream as the driver handle the compiled kernels take."""
    import cuda.bindings.driver as cuda_driver

    return cuda_driver.CUstream(torch.cuda.current_stream().cuda_stream)
