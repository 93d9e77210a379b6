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


def env_mode(variable: str, modes: tuple[str, ...]) -> str:
    """The mode the environment variable ``variable`` names, ``modes[0]`` when it is unset or empty;
    ValueError naming the variable and ``modes`` for any other value (a typo must not pick a path)."""
    mode = os.environ.get(variable, modes[0]).strip().lower() or modes[0]
    if mode not in modes:
        raise ValueError(f"{variable}={os.environ[variable]!r} is not one of {', '.join(modes)}")
    return mode


def kernel_mode() -> str:
    """The mode ``MOEBUS_KERNELS`` names (``auto`` when unset)."""
    return env_mode(MODE_ENV, MODES)


def use_kernels(device: torch.device | str) -> bool:
    """Whether a model on ``device`` runs the kernels (see the module doc)."""
    return torch.device(device).type == "cuda" and kernel_mode() == "auto"
