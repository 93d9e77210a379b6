"""The one switch between the kernels of this package and the torch reference ops.

``MOEBUS_KERNELS`` (read when a model is built):

* ``auto`` (default): models on a CUDA device run the kernels (grouped-GEMM MoE,
  fused attention); models on other devices run the torch references;
* ``reference``: the torch references everywhere, e.g. to compare against the
  kernels or to rule them out while debugging.

Each kernel's public function still picks its own implementation by the device of
its tensors (CuTeDSL on CUDA, the torch reference elsewhere); this switch decides
whether the model routes through them at all.
"""

from __future__ import annotations

import os

import torch

MODE_ENV = "MOEBUS_KERNELS"
MODES = ("auto", "reference")


def kernel_mode() -> str:
    """The mode ``MOEBUS_KERNELS`` names (``auto`` when unset)."""
    mode = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{MODE_ENV}={os.environ[MODE_ENV]!r} is not one of {', '.join(MODES)}")
    return mode


def use_kernels(device: torch.device | str) -> bool:
    """Whether a model on ``device`` runs the kernels (see the module doc)."""
    return torch.device(device).type == "cuda" and kernel_mode() == "auto"
