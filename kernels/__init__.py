"""CuTeDSL kernels with their torch references (DESIGN §6).

CuTeDSL fixes its compilation target when it is first imported, so the default
target is set here, before any submodule can import it: on a machine without a
GPU (CI) every kernel compiles for Hopper, sm_90a.
"""

from kernels._cute_runtime import ensure_target_arch

ensure_target_arch()
