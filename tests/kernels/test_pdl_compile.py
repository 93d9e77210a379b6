"""The short kernels launched with programmatic dependent launch wait for the previous kernel first.

Launched with ``use_pdl=True`` (`kernels._cute_comm.wait_for_previous_kernel`) a kernel may start while the
kernel before it is still running; reading or writing global memory before its ``griddepcontrol.wait``
would race with that kernel (its inputs not yet written, or its inputs overwritten).  Compiled without a GPU,
every entry of every such kernel must issue the wait before its first global memory instruction, and let the
next kernel launch.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cutlass")

ROOT = Path(__file__).resolve().parents[2]

# Every kernel launched with PDL, compiled through the functions the ops use.
COMPILE = """
import torch
from kernels import act_quant_sm90, ep_prefill, norm_rope_sm90, paged_attention_sm90, router_sm90
ep_prefill.compile_select(8, torch.int64)
ep_prefill.compile_combine(torch.bfloat16, 8, torch.bfloat16)
norm_rope_sm90.compiled_add_rms_norm(2048, True)
norm_rope_sm90.compiled_qk_norm_rope(128)
norm_rope_sm90.compiled_qkv_norm_rope_store(128, 32, 4, 16)
router_sm90.compiled_route(128, 8, True)
act_quant_sm90.compiled_quantizer(2048)
act_quant_sm90.compiled_quantizer(768, masked=True)
paged_attention_sm90.compiled_split(8, 128, 16, 4, 4)
paged_attention_sm90.compiled_combine(8, 128)
"""
KERNELS = ("count_kernel", "offsets_kernel", "scatter_kernel", "combine_kernel", "add_rms_norm_kernel",
           "qk_norm_rope_kernel", "qkv_norm_rope_store_kernel", "route_kernel", "ActQuantKernel", "split_kernel")


def _global_access(line: str) -> bool:
    return ".global" in line and not line.lstrip().startswith("cvta")


def test_every_pdl_kernel_waits_before_touching_global_memory(tmp_path):
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_KEEP": "ptx", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", COMPILE], cwd=tmp_path, env=env, check=True, timeout=600)
    entries = {}
    for ptx in tmp_path.glob("*.ptx"):
        for body in ptx.read_text().split(".entry")[1:]:
            entries[body.split("(")[0].strip()] = body
    names = " ".join(entries)
    assert all(kernel in names for kernel in KERNELS), sorted(entries)
    for name, body in entries.items():
        lines = body.splitlines()
        wait = next((i for i, line in enumerate(lines) if "griddepcontrol.wait" in line), None)
        first_access = next((i for i, line in enumerate(lines) if _global_access(line)), len(lines))
        assert wait is not None and wait < first_access, f"{name}: global access before griddepcontrol.wait"
        assert re.search(r"griddepcontrol\.launch_dependents", body), f"{name}: never lets the next kernel launch"
