"""MXFP8 checkpoints written by `moebus quantize --format mxfp8`: config, sharded loading, accuracy.

The checkpoints are made by the real converter from a tiny fp32 checkpoint; what
the loader returns is checked against `dequantize_mxfp8` applied to the file's own
tensors, and the model's logits against the unquantized model's (FP8 block next to
it for comparison).
"""

from __future__ import annotations

import json

import pytest
import torch
from runtime_helpers import agreement, median_token_rel_err, random_prompts
from safetensors import safe_open

from kernels import grouped_gemm_mxfp8
from kernels.grouped_gemm_mxfp8 import kernel_scale_layout
from shared.kvcache import KVLayout, PagedKVCache
from shared.model import config as model_config
from shared.model.config import ModelConfig, Mxfp8Quantization
from shared.model.errors import ShardingError, UnsupportedModel
from shared.model.model import ForwardBatch, Qwen3Model, SequenceChunk
from shared.model.quant_formats import Mxfp8Weight, dequantize_mxfp8
from shared.model.quantize import quantize_checkpoint
from shared.model.weights import FusedGateUp, load_weights, prepare_for_kernels
from shared.parallel import ShardSpec

# Layer 0 MoE, layer 1 dense. TP=2 splits q/o by 2 heads of 32 (o_proj's K and the
# dense down_proj's K at 64: on 32-blocks); EP=2 gives each rank 2 experts.
MX_TINY = dict(hidden=128, heads=4, kv_heads=2, head_dim=32, experts=4, top_k=2, moe_intermediate=128,
               intermediate=128, mlp_only_layers=[1])
ATTN, MOE, DENSE = "model.layers.0.self_attn.", "model.layers.0.mlp.", "model.layers.1.mlp."


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint, tmp_path_factory):
    """(fp32 source, MXFP8 copy, FP8-block copy, MXFP8 conversion report)."""
    src = tiny_checkpoint("mxfp8_src", **MX_TINY)
    out = tmp_path_factory.mktemp("mxfp8")
    mx_report = quantize_checkpoint(src, out / "mxfp8", "mxfp8")
    quantize_checkpoint(src, out / "fp8", "fp8-block")
    return src, out / "mxfp8", out / "fp8", mx_report


def file_dequantized(path, name: str) -> torch.Tensor:
    """``dequantize_mxfp8`` of ``name`` (a ``...weight``) and its ``..._scale_e8m0`` as stored in the file."""
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return dequantize_mxfp8(f.get_tensor(name), f.get_tensor(name + "_scale_e8m0"))


# ---------------------------------------------------------------- config


def test_mxfp8_config_is_read(checkpoints):
    _, mx, _, _ = checkpoints
    q = ModelConfig.from_dir(mx).quantization
    assert isinstance(q, Mxfp8Quantization) and q.block_size == 32 and "lm_head" in q.modules_to_not_convert


def test_the_config_reader_and_the_kernels_agree_on_the_mxfp8_block():
    # The config states the block itself (it is read by processes that do not import the kernels);
    # a checkpoint `moebus quantize` writes with the kernels' block must read back.
    assert model_config.MX_BLOCK == grouped_gemm_mxfp8.MX_BLOCK


@pytest.mark.parametrize("block_size", [16, 64, None])
def test_mxfp8_block_size_other_than_32_is_rejected(checkpoints, tmp_path, block_size):
    _, mx, _, _ = checkpoints
    raw = json.loads((mx / "config.json").read_text())
    raw["quantization_config"]["block_size"] = block_size
    with pytest.raises(UnsupportedModel, match=rf"quantization_config\.block_size={block_size}.*MXFP8 needs 32"):
        ModelConfig.from_dict(raw)


# ---------------------------------------------------------------- loading


def test_mxfp8_loads_e4m3_and_exponents_that_dequantize_like_the_file(checkpoints):
    _, mx, _, _ = checkpoints
    w = load_weights(mx, ModelConfig.from_dir(mx))
    attn, moe, dense = w.layers[0].attn, w.layers[0].mlp, w.layers[1].mlp
    for loaded in (attn.q_proj, attn.o_proj, moe.w13, moe.w2, dense.w13, dense.w2):
        assert isinstance(loaded, Mxfp8Weight)
        assert loaded.weight.dtype == torch.float8_e4m3fn and loaded.scale_e8m0.dtype == torch.uint8
    assert torch.equal(attn.q_proj.dequantize(), file_dequantized(mx, ATTN + "q_proj.weight"))
    assert torch.equal(attn.o_proj.dequantize(), file_dequantized(mx, ATTN + "o_proj.weight"))
    # experts fused as w13 [E, 2I, H] (gate rows then up rows) and w2 [E, H, I]
    assert moe.w13.shape == (4, 256, 128) and moe.w13.scale_e8m0.shape == (4, 256, 4)
    for e in range(4):
        p = f"{MOE}experts.{e}."
        gate_up = torch.cat([file_dequantized(mx, p + "gate_proj.weight"), file_dequantized(mx, p + "up_proj.weight")])
        assert torch.equal(moe.w13.dequantize()[e], gate_up)
        assert torch.equal(moe.w2.dequantize()[e], file_dequantized(mx, p + "down_proj.weight"))
    assert torch.equal(dense.w2.dequantize(), file_dequantized(mx, DENSE + "down_proj.weight"))
    # the router, norms and embeddings stay plain
    assert isinstance(moe.router, torch.Tensor) and moe.router.dtype == torch.float32


def test_mxfp8_tp2_slices_weights_and_scales_together(checkpoints):
    """Rows (q/k/v, dense gate/up) split with their scale rows; K (o_proj, dense down) on 32-blocks."""
    _, mx, _, _ = checkpoints
    cfg = ModelConfig.from_dir(mx)
    full = load_weights(mx, cfg)
    fa, fd = full.layers[0].attn, full.layers[1].mlp
    for r in range(2):
        part = load_weights(mx, cfg, ShardSpec(tp_rank=r, tp_size=2))
        pa, pd = part.layers[0].attn, part.layers[1].mlp
        rows = slice(r * 64, (r + 1) * 64)  # 2 of 4 q heads of 32; 64 of 128 dense rows
        kv_rows = slice(r * 32, (r + 1) * 32)  # 1 of 2 KV heads
        for got, want, sl in ((pa.q_proj, fa.q_proj, rows), (pa.k_proj, fa.k_proj, kv_rows), (pa.v_proj, fa.v_proj, kv_rows)):
            assert torch.equal(got.weight.view(torch.uint8), want.weight[sl].view(torch.uint8))
            assert torch.equal(got.scale_e8m0, want.scale_e8m0[sl])
        blocks = slice(r * 2, (r + 1) * 2)  # K columns [64r, 64r + 64) are scale blocks 2r, 2r + 1
        for got, want in ((pa.o_proj, fa.o_proj), (pd.w2, fd.w2)):
            assert torch.equal(got.weight.view(torch.uint8), want.weight[:, rows].view(torch.uint8))
            assert torch.equal(got.scale_e8m0, want.scale_e8m0[:, blocks])
        gate_up_rows = torch.cat([torch.arange(64 * r, 64 * r + 64), torch.arange(128 + 64 * r, 128 + 64 * r + 64)])
        assert torch.equal(pd.w13.dequantize(), fd.w13.dequantize()[gate_up_rows])
        # experts are not split by TP
        assert torch.equal(part.layers[0].mlp.w13.scale_e8m0, full.layers[0].mlp.w13.scale_e8m0)


def test_mxfp8_ep2_takes_a_contiguous_expert_range(checkpoints):
    _, mx, _, _ = checkpoints
    cfg = ModelConfig.from_dir(mx)
    full = load_weights(mx, cfg).layers[0].mlp
    for r in range(2):
        part = load_weights(mx, cfg, ShardSpec(ep_rank=r, ep_size=2)).layers[0].mlp
        experts = slice(2 * r, 2 * r + 2)
        assert part.expert_start == 2 * r and part.num_local_experts == 2
        for got, want in ((part.w13, full.w13), (part.w2, full.w2)):
            assert torch.equal(got.weight.view(torch.uint8), want.weight[experts].view(torch.uint8))
            assert torch.equal(got.scale_e8m0, want.scale_e8m0[experts])


def test_mxfp8_k_split_off_32_blocks_is_rejected(tiny_checkpoint, tmp_path):
    """4 heads of 16 over TP=4: rank 1's o_proj columns [16, 32) cut a 32-value scale block."""
    src = tiny_checkpoint("mxfp8_misaligned_src", hidden=64, heads=4, kv_heads=2, head_dim=16, experts=4)
    quantize_checkpoint(src, tmp_path / "ckpt", "mxfp8")
    cfg = ModelConfig.from_dir(tmp_path / "ckpt")
    with pytest.raises(ShardingError, match=r"o_proj.*\[16, 32\).*MXFP8 32-blocks"):
        load_weights(tmp_path / "ckpt", cfg, ShardSpec(tp_rank=1, tp_size=4))


def test_mxfp8_experts_are_prepared_for_the_grouped_gemm(checkpoints):
    """MXFP8 experts take the grouped MoE (gate/up interleaved with their exponents); the rest stays MXFP8.

    The kernel path's numbers are checked in tests/model/runtime/test_kernel_path.py.
    """
    _, mx, _, _ = checkpoints
    w = load_weights(mx, ModelConfig.from_dir(mx), dtype=torch.bfloat16)
    assert prepare_for_kernels(w) is None
    assert isinstance(w.layers[0].mlp.w13, FusedGateUp) and w.layers[0].mlp.w13.scale_e8m0 is not None
    assert isinstance(w.layers[0].mlp.w2, Mxfp8Weight) and isinstance(w.layers[0].attn.q_proj, Mxfp8Weight)
    # both expert scale tensors held in the layout the kernel's TMA reads (4 scales a row: padded to 16 bytes)
    for scale in (w.layers[0].mlp.w13.scale_e8m0, w.layers[0].mlp.w2.scale_e8m0):
        assert kernel_scale_layout(scale) is scale and scale.stride()[-2] == 16


# ---------------------------------------------------------------- accuracy


def teacher_forced_logits(model: Qwen3Model, prompts: list[list[int]]) -> torch.Tensor:
    """Logits at every position of ``prompts`` (one prefill, all tokens)."""
    c, page = model.config, 16
    pages = [-(-len(p) // page) for p in prompts]
    cache = PagedKVCache(KVLayout(c.num_layers, sum(pages), model.local_kv_heads, page, c.head_dim, torch.float32))
    starts = [sum(pages[:i]) for i in range(len(prompts))]
    chunks = [SequenceChunk(p, 0, list(range(s, s + n))) for p, s, n in zip(prompts, starts, pages)]
    return model.forward(ForwardBatch.build(chunks, page, torch.device("cpu")), cache, all_logits=True)


def test_mxfp8_model_tracks_the_full_precision_model(checkpoints):
    """Logits within a small multiple of the converter's measured weight error, as FP8 block does."""
    src, mx, fp8, mx_report = checkpoints
    prompts = random_prompts([64, 48], seed=11)
    ref, mx_logits, fp8_logits = (teacher_forced_logits(Qwen3Model.load(p), prompts) for p in (src, mx, fp8))
    weight_err = mx_report.overall().as_dict()["rel_fro"]
    mx_err, fp8_err = median_token_rel_err(mx_logits, ref), median_token_rel_err(fp8_logits, ref)
    mx_agree, fp8_agree = agreement(mx_logits, ref), agreement(fp8_logits, ref)
    print(f"weights rel_fro mxfp8 {weight_err:.4f}; logits median token rel err mxfp8 {mx_err:.4f} "
          f"fp8-block {fp8_err:.4f}; teacher-forced argmax agreement mxfp8 {mx_agree:.2%} fp8-block {fp8_agree:.2%}")
    assert 0 < mx_err < 3 * weight_err
    assert mx_agree >= 0.9
    # same league as FP8 block: neither format is several times worse than the other here
    assert mx_err < 3 * fp8_err and fp8_err < 3 * mx_err
