"""`kernels._cute_runtime.Launcher` passes every compiled kernel's arguments as the DSL would (CPU, CI).

A launcher skips the DSL's per-call marshalling: it hands the compiled host function one pointer per
argument, to a ctypes cell holding the value. `check_marshalling` compares that with what the DSL's own
marshalling produces for each compiled function the ops launch; the GPU tests
(`tests/gpu/test_launcher_cuda.py`) run the launches.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest
import torch

pytest.importorskip("cutlass")

import cuda.bindings.driver as cuda_driver
import cutlass
import cutlass.cute as cute

from kernels import act_quant_sm90, ep_prefill, kv_copy_sm90, norm_rope_sm90, paged_attention_sm90, router_sm90
from kernels import allreduce_sm90 as ar_k
from kernels import dispatch_combine as dc
from kernels._cute_runtime import LaunchError, _cell_types, check_marshalling, dummy_stream
from kernels.grouped_gemm_launch import choose_config, compiled_kernel

GEMMS = {
    "bf16 prefill": dict(masked=False, fp8=False, swiglu=False, row_weights=False, tokens_per_expert=375),
    "fp8 prefill, row weights": dict(masked=False, fp8=True, swiglu=False, row_weights=True, tokens_per_expert=375),
    "fp8 decode masked": dict(masked=True, fp8=True, swiglu=False, row_weights=False, tokens_per_expert=16),
    "bf16 swiglu": dict(masked=False, fp8=False, swiglu=True, row_weights=False, tokens_per_expert=64),
    "mxfp8 decode": dict(masked=True, fp8=False, swiglu=False, row_weights=False, tokens_per_expert=8, mxfp8=True),
}

COMPILED = {
    "quantizer": lambda: act_quant_sm90.compiled_quantizer(768),
    "quantizer masked": lambda: act_quant_sm90.compiled_quantizer(768, masked=True),
    "ep_select": lambda: ep_prefill.compile_select(8, torch.int64),
    "ep_combine": lambda: ep_prefill.compile_combine(torch.bfloat16, 8, torch.float32),
    "add_rms_norm": lambda: norm_rope_sm90.compiled_add_rms_norm(2048, True),
    "qk_norm_rope": lambda: norm_rope_sm90.compiled_qk_norm_rope(128),
    "qkv_norm_rope_store": lambda: norm_rope_sm90.compiled_qkv_norm_rope_store(128, 32, 4, 16),
    "route": lambda: router_sm90.compiled_route(128, 8, True),
    "paged split": lambda: paged_attention_sm90.compiled_split(8, 128, 16, 4, 4),
    "paged combine": lambda: paged_attention_sm90.compiled_combine(8, 128),
    "kv_copy": lambda: kv_copy_sm90.compile_kv_copy(16),
    "all-reduce one-shot": lambda: ar_k.compile_one_shot(torch.bfloat16, 2, 0),
    "all-reduce lamport": lambda: ar_k.compile_lamport(torch.bfloat16, 2, 1, two_shot=True),
    "all-reduce two-shot": lambda: ar_k.compile_two_shot(torch.bfloat16, 2, 0),
    **{f"dispatch/combine {i}": (lambda i=i: dc.compile_kernels(2, 0, 16, 1024, 8, "fp8")[i]) for i in range(4)},
    **{f"grouped gemm {name}": (lambda kw=kw: compiled_kernel(choose_config(num_experts=8, n=512, k=1024, num_sms=132, **kw)))
       for name, kw in GEMMS.items()},
}


@pytest.mark.parametrize("name", list(COMPILED))
def test_launcher_marshals_like_the_dsl(name):
    fn = COMPILED[name]()
    check_marshalling(fn)  # raises LaunchError on any difference
    types = _cell_types(fn)
    assert types.count("stream") == 1 and len(types) >= 2


@cute.jit
def _takes_an_int16(x: cutlass.Int16, stream: cuda_driver.CUstream):
    pass


def test_an_argument_type_the_launcher_does_not_pass_is_refused():
    fn = cute.compile(_takes_an_int16, cutlass.Int16(1), dummy_stream())
    with pytest.raises(LaunchError, match="'x' is annotated"):
        check_marshalling(fn)
