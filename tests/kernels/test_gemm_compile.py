"""CPU checks for the MoE grouped GEMM: every kernel compiles for sm_90a, the torch references are right.

No GPU is needed: CuTeDSL compiles for ``CUTE_DSL_ARCH=sm_90a`` on the host.
The references are checked against computations written independently of them
(dense products masked by expert, explicit block loops), on fresh random inputs.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import re

import pytest
import torch

from cubin_info import kernel_attributes

from kernels import grouped_gemm as gg
from kernels import grouped_gemm_sm90 as sm90
from kernels.act_quant import FP8_MAX, QUANT_BLOCK, quantize_act, quantize_act_reference
from kernels.act_quant_sm90 import compiled_quantizer

FP8 = torch.float8_e4m3fn


# --------------------------------------------------------------- compilation
COMPILE_CASES = [
    # (masked, fp8, tile_m, tile_n, swiglu, row_weights, k); FP8 K blocks: 272 -> 3, 400 -> 4
    (False, False, 128, 256, False, False, 272),
    (False, False, 128, 192, False, True, 272),  # bf16 prefill up to MID_TILE_MAX_TOKENS_PER_EXPERT
    (False, False, 64, 128, False, True, 272),
    (True, False, 64, 128, False, False, 272),
    (True, False, 128, 256, False, True, 272),
    (False, True, 128, 128, False, False, 272),
    (False, True, 128, 128, False, False, 400),
    (False, True, 128, 192, False, True, 400),  # 192-wide FP8 tiles straddle two weight-scale blocks
    (True, True, 64, 192, False, False, 272),
    (True, True, 64, 128, False, True, 400),
    (False, False, 128, 128, True, True, 272),
    (True, True, 64, 128, True, False, 272),
]
MXFP8_CASES = [  # (masked, tile_m, swiglu, row_weights): bf16 x MXFP8 weights dequantized in the kernel
    (False, 128, False, False),
    (False, 192, False, True),  # prefill above the mid bound: three consumer warpgroups, two converting
    (True, 64, True, True),
]


def _before_global_access(ptx: str, instruction: str) -> bool:
    """Whether ``instruction`` occurs in ``ptx`` before its first global load, store or TMA copy."""
    at = ptx.find(instruction)
    first = min((i for i in (ptx.find(op) for op in ("ld.global", "st.global", "cp.async.bulk")) if i >= 0),
                default=len(ptx))
    return 0 <= at < first


@pytest.mark.parametrize("masked,fp8,tile_m,tile_n,swiglu,row_weights,k", COMPILE_CASES)
def test_grouped_gemm_compiles_for_sm90a(masked, fp8, tile_m, tile_n, swiglu, row_weights, k, tmp_path):
    from kernels.grouped_gemm_launch import compile_kernel

    # K and N not multiples of the tile; SwiGLU needs N a multiple of 128.
    n = 384 if swiglu else 200
    split = tile_m == 128 and tile_n > 128 and not fp8 and not masked  # choose_config's rule for bf16 prefill up to 512 tokens/expert
    pdl = tile_m == 64  # choose_config: decode-sized groups launch with programmatic dependent launch
    cfg = sm90.GroupedGemmConfig(num_experts=6, n=n, k=k, masked=masked, fp8=fp8, tile_m=tile_m, tile_n=tile_n,
                                 swiglu=swiglu, row_weights=row_weights, split_output=split, pdl=pdl)
    compiled = compile_kernel(cfg, options=f"--keep-ptx --dump-dir={tmp_path}")
    ptx = compiled.artifacts.PTX
    mma = "e4m3.e4m3" if fp8 else "bf16.bf16"
    fills = 2 if split else 1  # buffer fills per output tile
    found = {
        "wgmma": f"wgmma.mma_async.sync.aligned.m64n{tile_n}k" in ptx and mma in ptx,
        "tma": "cp.async.bulk.tensor" in ptx,
        "setmaxnreg": "setmaxnreg" in ptx,
        "no local memory": ".local" not in ptx,
        "16-byte output stores": "st.global.v4" in ptx,
        # launched with programmatic dependent launch: no global access before the previous kernel is waited for
        "pdl wait before global memory": _before_global_access(ptx, "griddepcontrol.wait;") if pdl
                                          else "griddepcontrol" not in ptx,
        "pdl trigger": ("griddepcontrol.launch_dependents;" in ptx) == pdl,
        # each consumer warpgroup hands its rows to the two store warps through its own barriers
        # (64 + 128 threads): the store warps free warpgroup w's rows on barrier 4 + 4w
        "store-warp handoff": all(f"bar.arrive {4 + 4 * w}, 192" in ptx for w in range(tile_m // 64)),
        # split bf16 128x192 / 128x256 tiles go over in two halves: the store warps free the buffer once per half
        "one handoff per buffer fill": ptx.count("bar.arrive 4, 192") == fills,
        # and the consumers (barrier ids by warpgroup: a register) fill it at the end of a tile and, split, also with
        # the held half in the middle of the next tile and after the last one: one wait and one arrive per site
        "consumer fill sites": len(re.findall(r"bar\.sync\s+%r\d+, 192;", ptx)) == 2 * fills - 1
                               and len(re.findall(r"bar\.arrive\s+%r\d+, 192;", ptx)) == 2 * fills - 1,
    }
    if fp8 and tile_n == 192:
        # warp 1 stages the scales in shared memory by cp.async, completing each stage on its mbarrier: a row's 4 K
        # blocks in one 16-byte copy (weight scales: when K has a multiple of 4 blocks, else one block a copy;
        # activation-scale rows are padded to 16 bytes by act_quant and always go 4 blocks a copy)
        width = 4 * sm90.scale_vector(cfg)
        found["staged scales"] = ("cp.async.ca.shared.global [%r" in ptx and f", {width}, {width};" in ptx
                                  and "cp.async.mbarrier.arrive.noinc.shared.b64" in ptx)
        found["no vector scale loads from global memory"] = "ld.global.v4.b32" not in ptx
    assert all(found.values()), found


@pytest.mark.parametrize("masked,tile_m,swiglu,row_weights", MXFP8_CASES)
def test_grouped_gemm_mxfp8_compiles_for_sm90a(masked, tile_m, swiglu, row_weights, tmp_path):
    from kernels.grouped_gemm_launch import compile_kernel

    cfg = sm90.GroupedGemmConfig(num_experts=6, n=384 if swiglu else 200, k=272, masked=masked, fp8=False,
                                 tile_m=tile_m, tile_n=128, swiglu=swiglu, row_weights=row_weights, mxfp8=True)
    ptx = compile_kernel(cfg, options=f"--keep-ptx --dump-dir={tmp_path}").artifacts.PTX
    found = {
        "bf16 wgmma": "wgmma.mma_async.sync.aligned.m64n128k16" in ptx and "bf16.bf16" in ptx,
        "fp8 weight tiles by tma": "cp.async.bulk.tensor" in ptx,
        # the E8M0 bytes: a third TMA box per stage (A, B, scales), read from shared memory as one 16-bit word
        "scales by tma with the stage": ptx.count("cp.async.bulk.tensor") == 3 and "ld.shared.b16" in ptx,
        "no byte loads from global memory": re.search(r"ld\.global[\w.]*\.[bsu]8", ptx) is None,
        "e4m3 -> bf16 by byte permute and exact bf16x2 scaling": "prmt.b32" in ptx and "mul.rn.bf16x2" in ptx,
        "proxy fence before the mma reads": "fence.proxy.async.shared::cta" in ptx,
        "no local memory": ".local" not in ptx,
        # every consumer warpgroup hands its rows to the store warps on its own barriers (4 + 4w)
        "store-warp handoff": all(f"bar.arrive {4 + 4 * w}, 192" in ptx for w in range(tile_m // 64)),
    }
    assert all(found.values()), found


def _swapped_config(masked: bool, tile_m: int, tile_n: int, swiglu: bool, row_weights: bool, *,
                    fp8: bool) -> sm90.GroupedGemmConfig:
    """A small MXFP8 decode config with the operands swapped (K and, without SwiGLU, N not multiples of a tile)."""
    return sm90.GroupedGemmConfig(num_experts=6, n=512 if swiglu else 200, k=272, masked=masked, fp8=fp8,
                                  tile_m=tile_m, tile_n=tile_n, swiglu=swiglu, row_weights=row_weights, mxfp8=True,
                                  swap_ab=True)


SWAPPED_COMPILE_CASES = [  # (masked, tile_m, tile_n, swiglu, row_weights): bf16 x MXFP8 decode, operands swapped
    (True, 8, 128, True, False),
    (False, 64, 128, False, True),
    (True, 16, 256, False, False),  # four consumer warpgroups
]


@pytest.mark.parametrize("masked,tile_m,tile_n,swiglu,row_weights", SWAPPED_COMPILE_CASES)
def test_swapped_mxfp8_decode_compiles_for_sm90a(masked, tile_m, tile_n, swiglu, row_weights, tmp_path):
    from kernels.grouped_gemm_launch import compile_kernel

    cfg = _swapped_config(masked, tile_m, tile_n, swiglu, row_weights, fp8=False)
    ptx = compile_kernel(cfg, options=f"--keep-ptx --dump-dir={tmp_path}").artifacts.PTX
    # the weights' A operand from registers: four 32-bit registers in braces where a descriptor would be
    register_a = re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{tile_m}k16\.f32\.bf16\.bf16 \{{[^}}]*\}}, "
                           r"\{%r\d+, %r\d+, %r\d+, %r\d+\}, %rd\d+", ptx)
    found = {
        "register-A bf16 wgmma, tokens as N": register_a is not None,
        "weight values by 16-bit shared loads": "ld.shared.s16" in ptx or "ld.shared.b16" in ptx,
        "e4m3 -> bf16 by byte permute and exact bf16x2 scaling": "prmt.b32" in ptx and "mul.rn.bf16x2" in ptx,
        # no bf16 weight tile in shared memory for the tensor cores, so no proxy fence and no store warps' handoff
        "no proxy fence": "fence.proxy.async" not in ptx,
        "no store-warp handoff": "bar.arrive" not in ptx,
        "no local memory": ".local" not in ptx,
        "setmaxnreg within the CTA's registers": f"setmaxnreg.inc.sync.aligned.u32 \t{232 if tile_n == 128 else 104};" in ptx,
    }
    assert all(found.values()), found


SWAPPED_FP8_COMPILE_CASES = [  # (masked, tile_m, tile_n, swiglu, row_weights): FP8 x MXFP8 decode, FP8 math
    (True, 8, 256, True, False),
    (False, 32, 256, False, True),
    (True, 64, 128, False, False),
]


@pytest.mark.parametrize("masked,tile_m,tile_n,swiglu,row_weights", SWAPPED_FP8_COMPILE_CASES)
def test_swapped_fp8_x_mxfp8_decode_compiles_for_sm90a(masked, tile_m, tile_n, swiglu, row_weights, tmp_path):
    from kernels.grouped_gemm_launch import compile_kernel

    cfg = _swapped_config(masked, tile_m, tile_n, swiglu, row_weights, fp8=True)
    ptx = compile_kernel(cfg, options=f"--keep-ptx --keep-cubin --dump-dir={tmp_path}").artifacts.PTX
    (cubin,) = tmp_path.glob("*.cubin")
    # both operands by descriptor: the weights' A from their TMA stage, the tokens' B
    smem_ab = re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{tile_m}k32\.f32\.e4m3\.e4m3 \{{[^}}]*\}}, "
                        r"%rd\d+, %rd\d+", ptx)
    found = {
        "fp8 wgmma from shared memory, tokens as N": smem_ab is not None,
        "scale words of the stage's box": "ld.shared.u32" in ptx or "ld.shared.b32" in ptx,
        "e8m0 -> fp32 by shift": "shl.b32" in ptx and "selp.b32" in ptx,
        "no conversion of the weights": "prmt.b32" not in ptx and "mul.rn.bf16x2" not in ptx,
        "no proxy fence": "fence.proxy.async" not in ptx,
        "no store-warp handoff": "bar.arrive" not in ptx,
        "no local memory": ".local" not in ptx,
        "setmaxnreg within the CTA's registers": f"setmaxnreg.inc.sync.aligned.u32 \t{232 if tile_n == 128 else 104};" in ptx,
        # partials in flight: three with two warpgroups' registers, two with four's
        "partials in flight": f"wgmma.wait_group.sync.aligned \t{2 if tile_n == 128 else 1};" in ptx,
        # the accumulator, two partials and the token scales fit: ptxas spilled 240 bytes a thread for 64 x 256
        "no spills": kernel_attributes(cubin)["frame_size"] == 0,
    }
    assert all(found.values()), found


def test_split_output_halves_the_buffer_only_where_that_frees_a_pipeline_stage():
    """A split bf16 tile (its output to the store warps in two halves) gets the freed shared memory as one more
    pipeline stage (Qwen3-30B down, 128 experts: 128x192 5 stages of 40 KB beside a 24 KB buffer instead of 4 beside
    48 KB, 128x256 4 of 48 KB beside 32 KB instead of 3); where half a buffer frees no whole stage (64-row, SwiGLU
    tiles) or the split is not asked for, the buffer holds the whole tile.  FP8 tiles reject the split."""
    def kernel(**kw) -> sm90.GroupedGemmSm90:
        return sm90.GroupedGemmSm90(sm90.GroupedGemmConfig(num_experts=128, n=2048, k=768, masked=False, **kw))

    def smem(k: sm90.GroupedGemmSm90) -> int:  # the pipeline stages and the output buffer
        return k.stages * (k.cfg.tile_m + k.cfg.tile_n) * k.tile_k * 2 + k.buffer_chunks * k.cfg.tile_m * sm90.EPI_N * 2

    for tile_n, stages in ((192, 5), (256, 4)):
        split = kernel(fp8=False, tile_m=128, tile_n=tile_n, split_output=True)
        whole = kernel(fp8=False, tile_m=128, tile_n=tile_n)
        assert (split.out_halves, 2 * split.buffer_chunks, split.stages) == (True, split.out_chunks, stages)
        assert (whole.out_halves, whole.buffer_chunks, whole.stages) == (False, whole.out_chunks, stages - 1)
        assert smem(split) <= sm90.SMEM_CAPACITY and smem(whole) <= sm90.SMEM_CAPACITY
    for kw in ({"tile_m": 64, "tile_n": 128}, {"tile_m": 128, "tile_n": 128, "swiglu": True}):
        k = kernel(fp8=False, split_output=True, **kw)
        assert not k.out_halves and k.buffer_chunks == k.out_chunks, kw
    with pytest.raises(ValueError, match="split_output"):
        kernel(fp8=True, tile_m=128, tile_n=192, split_output=True)


def test_act_quant_compiles_for_sm90a():
    assert compiled_quantizer(4096) is not None
    assert compiled_quantizer(272) is not None


def test_config_rejects_unsupported_shapes():
    with pytest.raises(ValueError, match="16-byte aligned"):
        sm90.GroupedGemmConfig(num_experts=2, n=128, k=100, masked=False, fp8=False, tile_m=128, tile_n=128).validate()
    with pytest.raises(ValueError, match="SwiGLU"):
        sm90.GroupedGemmConfig(num_experts=2, n=192, k=128, masked=False, fp8=False, tile_m=128, tile_n=128,
                               swiglu=True).validate()
    with pytest.raises(ValueError, match="tile_n"):
        sm90.GroupedGemmConfig(num_experts=2, n=128, k=128, masked=False, fp8=True, tile_m=128, tile_n=256).validate()
    with pytest.raises(ValueError, match="only the swapped decode tiles"):
        sm90.GroupedGemmConfig(num_experts=2, n=128, k=128, masked=False, fp8=True, tile_m=128, tile_n=128,
                               mxfp8=True).validate()
    for fp8, mxfp8, swiglu in ((False, False, False), (True, False, False), (False, True, True)):
        with pytest.raises(ValueError, match="192 only for bf16 x MXFP8"):
            sm90.GroupedGemmConfig(num_experts=2, n=256, k=128, masked=False, fp8=fp8, tile_m=192, tile_n=128,
                                   mxfp8=mxfp8, swiglu=swiglu).validate()
    with pytest.raises(ValueError, match="16 for MXFP8"):
        sm90.GroupedGemmConfig(num_experts=2, n=128, k=104, masked=False, fp8=False, tile_m=128, tile_n=128,
                               mxfp8=True).validate()


@pytest.mark.parametrize("tma_store", [True, False])
def test_fp8_prefill_tiles_store_full_tiles_by_tma(tma_store, tmp_path):
    """With ``tma_store`` one store thread writes full tiles by TMA (bulk groups, waited for before the buffer is
    reused; the consumers fence their shared-memory writes for the async proxy), partial ones keep the store warps'
    16-byte stores."""
    from kernels.grouped_gemm_launch import compile_kernel

    cfg = sm90.GroupedGemmConfig(num_experts=6, n=712, k=400, masked=False, fp8=True, tile_m=128, tile_n=192,
                                 row_weights=True, tma_store=tma_store)
    ptx = compile_kernel(cfg, options=f"--keep-ptx --dump-dir={tmp_path}").artifacts.PTX
    tma = {"tma store": "cp.async.bulk.tensor.2d.global.shared::cta" in ptx,
           "read wait": re.search(r"cp\.async\.bulk\.wait_group\.read\s+0;", ptx) is not None,
           "proxy fence": "fence.proxy.async.shared::cta" in ptx}
    assert tma == dict.fromkeys(tma, tma_store), tma
    assert "st.global.v4" in ptx  # tiles that end inside their expert's rows


def test_tile_bucket_rule_by_tokens_per_expert_and_expert_size():
    from kernels.grouped_gemm_launch import choose_config

    small, mid, big = gg.SMALL_TILE_MAX_TOKENS_PER_EXPERT, gg.MID_TILE_MAX_TOKENS_PER_EXPERT, gg.MID_TILE_MAX_WEIGHT_ELEMENTS

    def tile(tokens: float, *, n: int = 2048, k: int = 768, masked: bool = False, fp8: bool = False,
             swiglu: bool = False, mxfp8: bool = False) -> tuple[int, int]:
        cfg = choose_config(num_experts=8, n=n, k=k, masked=masked, fp8=fp8, swiglu=swiglu, row_weights=False,
                            tokens_per_expert=tokens, num_sms=132, mxfp8=mxfp8)
        cfg.validate()
        return cfg.tile_m, cfg.tile_n

    assert gg.TILE_BUCKET_BOUNDS == (small, mid) and small < mid
    # bf16 prefill (contiguous) of small experts (Qwen3-30B down: 2048 x 768): three buckets, each bound inclusive
    assert [tile(t) for t in (1, small, small + 1, mid, mid + 0.5, 8 * mid)] == [
        (64, 128), (64, 128), (128, 192), (128, 192), (128, 256), (128, 256)]
    assert tile(mid, n=big // 1024, k=1024) == (128, 192) and tile(mid, n=big // 1024 + 8, k=1024) == (128, 256)
    # large experts (Qwen3-235B down: 4096 x 1536) and the masked (decode) layout: the widest bf16 tile
    assert [tile(t, n=4096, k=1536) for t in (small, small + 1, mid)] == [(64, 128), (128, 256), (128, 256)]
    assert [tile(t, masked=True) for t in (small, small + 1, mid, mid + 1)] == [(64, 128)] + [(128, 256)] * 3
    # FP8: one 128-row tile width at every size; SwiGLU and MXFP8 weights fix N at 128
    assert [tile(t, fp8=True) for t in (small, small + 1, mid + 1)] == [(64, 128), (128, 192), (128, 192)]
    for kind in ({"swiglu": True}, {"swiglu": True, "fp8": True}):
        assert {tile(t, **kind) for t in (small, small + 1, mid + 1)} == {(64, 128), (128, 128)}
    for kind in ({"mxfp8": True, "masked": True}, {"swiglu": True, "mxfp8": True}):
        assert {tile(t, **kind) for t in (small + 1, mid + 1)} == {(128, 128)}
    # MXFP8 prefill above the mid bound: 192-row tiles (a third warpgroup of WGMMA work per converted stage)
    assert [tile(t, mxfp8=True) for t in (small + 1, mid, mid + 0.5)] == [(128, 128), (128, 128), (192, 128)]

    def swapped(tokens: float, **kind) -> tuple[int, int] | None:
        cfg = choose_config(num_experts=8, n=kind.pop("n", 2048), k=768, row_weights=False, mxfp8=True,
                            tokens_per_expert=tokens, num_sms=132,
                            **{"masked": True, "swiglu": False, "fp8": False, **kind})
        cfg.validate()
        return (cfg.tile_m, cfg.tile_n) if cfg.swap_ab else None

    # MXFP8 decode: operands swapped, the fewest tokens per tile that hold the group, 256 weight rows (SwiGLU: 128
    # where 2I is no multiple of 256); both layouts; not past the small bound
    assert [swapped(t) for t in (1, 8, 8.5, 16, 17, 32, 33, small, small + 1)] == [
        (8, 256), (8, 256), (16, 256), (16, 256), (32, 256), (32, 256), (64, 256), (64, 256), None]
    assert swapped(3, masked=False) == (8, 256) and swapped(3, swiglu=True, n=640) == (8, 128)
    assert swapped(3, swiglu=True, n=1536) == (8, 256)
    # FP8 activations: the same token tiles, 128 weight rows for 64 tokens (two partials beside the accumulator)
    assert [swapped(t, fp8=True) for t in (1, 16, 32, small)] == [(8, 256), (16, 256), (32, 256), (64, 128)]

    # Every change of kernel comes at a bound that the services' warm-up passes (kernels.grouped_gemm.tile_bucket_bounds)
    for fp8, mxfp8 in ((False, False), (True, False), (False, True)):
        for masked in (False, True):
            for swiglu in (False, True):
                configs = [choose_config(num_experts=8, n=2048, k=768, masked=masked, fp8=fp8, swiglu=swiglu,
                                         row_weights=False, tokens_per_expert=t, num_sms=132, mxfp8=mxfp8)
                           for t in range(1, 2 * mid)]
                changes = {t for t in range(1, 2 * mid - 1) if configs[t - 1] != configs[t]}
                assert changes <= set(gg.tile_bucket_bounds(mxfp8)), (fp8, mxfp8, masked, swiglu, changes)
    assert gg.tile_bucket_bounds(True) == (*gg.SWAPPED_TOKEN_TILES[:-1], *gg.TILE_BUCKET_BOUNDS)

    def split(tokens: float, *, masked: bool = False, fp8: bool = False, swiglu: bool = False, n: int = 2048,
              k: int = 768) -> bool:
        return choose_config(num_experts=8, n=n, k=k, masked=masked, fp8=fp8, swiglu=swiglu, row_weights=False,
                             tokens_per_expert=tokens, num_sms=132).split_output

    # bf16 128-row prefill tiles up to the mid bound hand their output over in halves (small and large experts)
    assert [split(t) for t in (small, small + 1, mid, mid + 0.5)] == [False, True, True, False]
    assert split(mid, n=4096, k=1536) and not split(mid + 1, n=4096, k=1536)
    # not the masked (decode) layout, not FP8, not the 128-wide SwiGLU tiles (no stage to gain beside 8 experts)
    assert not split(mid, masked=True) and not split(mid, fp8=True) and not split(mid, swiglu=True)

    def pdl(tokens: float, **kind) -> bool:
        return choose_config(num_experts=8, n=2048, k=768, row_weights=False, tokens_per_expert=tokens, num_sms=132,
                             **{"masked": False, "fp8": False, "swiglu": False, **kind}).pdl

    # decode-sized groups (every layout and dtype) launch with programmatic dependent launch, prefill-sized do not
    for kind in ({}, {"masked": True}, {"fp8": True}, {"mxfp8": True, "masked": True}, {"swiglu": True}):
        assert [pdl(t, **kind) for t in (1, small, small + 1, mid)] == [True, True, False, False], kind

    def tma(tokens: float, *, fp8: bool = True, masked: bool = False, swiglu: bool = False, n: int = 2048) -> bool:
        return choose_config(num_experts=8, n=n, k=768, masked=masked, fp8=fp8, swiglu=swiglu, row_weights=False,
                             tokens_per_expert=tokens, num_sms=132).tma_store

    # FP8 prefill (128-row tiles) stores its full tiles by TMA; not decode-sized groups, bf16, the masked layout,
    # SwiGLU or N % 8
    assert [tma(t) for t in (1, small, small + 1, mid, 8 * mid)] == [False, False, True, True, True]
    assert not any([tma(4 * mid, fp8=False), tma(4 * mid, masked=True), tma(4 * mid, swiglu=True), tma(4 * mid, n=2044)])


# ----------------------------------------------------------- torch references
def _uneven_offsets(E: int, gen: torch.Generator) -> torch.Tensor:
    counts = torch.randint(0, 40, (E,), generator=gen)
    counts[0] = 0  # an empty expert
    counts[E // 2] = 97  # a heavy one
    return torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)


def _dense_by_expert(x: torch.Tensor, w: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
    """Every row against every expert, then keep the row's own expert (-1 -> zero row)."""
    all_out = torch.einsum("tk,enk->ten", x.double(), w.double())
    keep = torch.nn.functional.one_hot(expert_of_row.clamp(min=0), w.shape[0]).double()
    keep[expert_of_row < 0] = 0
    return torch.einsum("ten,te->tn", all_out, keep)


def test_reference_contiguous_matches_dense_per_expert():
    gen = torch.Generator().manual_seed(1)
    E, N, K = 5, 72, 200
    offsets = _uneven_offsets(E, gen)
    T = int(offsets[-1]) + 3  # trailing rows that no expert owns
    x = torch.randn(T, K, generator=gen).bfloat16()
    w = torch.randn(E, N, K, generator=gen).bfloat16()
    owner = torch.full((T,), -1)
    for e in range(E):
        owner[offsets[e]:offsets[e + 1]] = e
    out = gg.grouped_gemm(x, w, offsets)
    assert out.dtype == torch.float32 and out.shape == (T, N)
    torch.testing.assert_close(out.double(), _dense_by_expert(x.float(), w.float(), owner), rtol=1e-5, atol=1e-4)
    into = torch.empty(T, N, dtype=torch.bfloat16)
    assert gg.grouped_gemm(x, w, offsets, out=into) is into
    torch.testing.assert_close(into.float(), out, rtol=2**-8, atol=1e-3)


def test_reference_masked_ignores_rows_past_count_and_applies_row_weights():
    gen = torch.Generator().manual_seed(2)
    E, M, N, K = 4, 9, 40, 64
    counts = torch.tensor([0, 9, 3, 20], dtype=torch.int32)  # empty, full, partial, over max_tokens
    x = torch.randn(E, M, K, generator=gen).bfloat16()
    w = torch.randn(E, N, K, generator=gen).bfloat16()
    rw = torch.rand(E, M, generator=gen)
    out = gg.grouped_gemm(x, w, counts, masked=True, row_weights=rw)
    for e in range(E):
        c = min(int(counts[e]), M)
        expect = (x[e, :c].double() @ w[e].double().T) * rw[e, :c, None].double()
        torch.testing.assert_close(out[e, :c].double(), expect, rtol=1e-5, atol=1e-4)
        assert torch.all(out[e, c:] == 0)


def _blockwise_dequant_loop(t: torch.Tensor, scale: torch.Tensor, rows_per_block: int) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=torch.float64)
    R, K = t.shape
    for rb in range(0, R, rows_per_block):
        for kb in range(0, K, QUANT_BLOCK):
            out[rb:rb + rows_per_block, kb:kb + QUANT_BLOCK] = (
                t[rb:rb + rows_per_block, kb:kb + QUANT_BLOCK].double() * float(scale[rb // rows_per_block, kb // QUANT_BLOCK])
            )
    return out


def test_reference_fp8_block_scales_match_explicit_loops():
    gen = torch.Generator().manual_seed(3)
    E, N, K = 3, 200, 272  # N and K not multiples of 128
    offsets = torch.tensor([0, 5, 5, 17], dtype=torch.int32)
    xq, xs = quantize_act_reference(torch.randn(17, K, generator=gen).bfloat16())
    wq = (torch.randn(E, N, K, generator=gen) * 100).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    ws = torch.rand(E, 2, 3, generator=gen) * 1e-2
    out = gg.grouped_gemm(xq, wq, offsets, x_scale=xs, w_scale=ws)
    xd = _blockwise_dequant_loop(xq, xs, 1)
    for e in range(E):
        s, t = int(offsets[e]), int(offsets[e + 1])
        expect = xd[s:t] @ _blockwise_dequant_loop(wq[e], ws[e], QUANT_BLOCK).T
        torch.testing.assert_close(out[s:t].double(), expect, rtol=1e-5, atol=1e-3)


def test_interleave_round_trip_and_fused_swiglu_reference():
    gen = torch.Generator().manual_seed(4)
    E, I, K = 3, 128, 256
    w13 = torch.randn(E, 2 * I, K, generator=gen).to(FP8)
    ws = torch.rand(E, 2 * I // 128, 2, generator=gen)
    wi, si = gg.interleave_gate_up(w13, ws)
    # row 64 of the interleaved matrix is up row 0; row 128 is gate row 64
    assert torch.equal(wi[:, 64].float(), w13[:, I].float()) and torch.equal(wi[:, 128].float(), w13[:, 64].float())
    back, _ = gg.deinterleave_gate_up(wi)
    assert torch.equal(back.float(), w13.float())
    offsets = torch.tensor([0, 4, 4, 11], dtype=torch.int32)
    xq, xs = quantize_act_reference(torch.randn(11, K, generator=gen).bfloat16())
    rw = torch.rand(11, generator=gen)
    fused = gg.grouped_gemm_swiglu(xq, wi, offsets, x_scale=xs, w_scale_interleaved=si, row_weights=rw)
    h = gg.grouped_gemm(xq, w13, offsets, x_scale=xs, w_scale=ws)
    gate, up = h[:, :I].double(), h[:, I:].double()
    expect = gate * torch.sigmoid(gate) * up * rw[:, None].double()
    torch.testing.assert_close(fused.double(), expect, rtol=1e-5, atol=1e-4)


def test_quantize_act_reference_bounds():
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(7, 272, generator=gen) * torch.logspace(-3, 3, 7)[:, None]).bfloat16()
    x[3, 128:256] = 0  # an all-zero block must not divide by zero
    q, s = quantize_act(x)
    assert q.dtype == FP8 and s.shape == (7, 3) and s.dtype == torch.float32
    blocks = torch.nn.functional.pad(x.float(), (0, 384 - 272)).view(7, 3, 128)
    torch.testing.assert_close(s, blocks.abs().amax(-1).clamp(min=1e-10) / FP8_MAX)
    deq = q.float() * s.repeat_interleave(128, dim=1)[:, :272]
    # E4M3 keeps 3 mantissa bits: round-to-nearest error <= 2^-4 relative (plus subnormals near 0)
    err = (deq - x.float()).abs()
    bound = x.float().abs() * 2.0**-4 + s.repeat_interleave(128, dim=1)[:, :272] * 2.0**-9
    assert torch.all(err <= bound)
    assert torch.all(q[3, 128:256].float() == 0)


def test_bad_inputs_raise_typed_errors():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    w = torch.zeros(2, 32, 64, dtype=torch.bfloat16)
    with pytest.raises(gg.GroupedGemmError, match="offsets must be"):
        gg.grouped_gemm(x, w, torch.tensor([0, 4], dtype=torch.int32))
    with pytest.raises(gg.GroupedGemmError, match="int32"):
        gg.grouped_gemm(x, w, torch.tensor([0, 2, 4]))
    with pytest.raises(gg.GroupedGemmError, match="x_scale and w_scale"):
        gg.grouped_gemm(x.to(FP8), w.to(FP8), torch.tensor([0, 2, 4], dtype=torch.int32))
    with pytest.raises(gg.GroupedGemmError, match="masked x"):
        gg.grouped_gemm(x, w, torch.tensor([1, 2], dtype=torch.int32), masked=True)
    with pytest.raises(TypeError, match="bfloat16"):
        quantize_act(x.float())
