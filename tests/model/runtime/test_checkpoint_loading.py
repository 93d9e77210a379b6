"""Config parsing, sharded loading and the errors bad checkpoints produce."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from runtime_helpers import random_prompts, rel_err
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from shared.kvcache import KVLayout, PagedKVCache
from shared.model.config import GenerationConfig, ModelConfig
from shared.model.errors import CheckpointError, ConfigError, MissingTensor, ShapeMismatch, ShardingError, UnsupportedModel
from shared.model.model import ForwardBatch, Qwen3Model, SequenceChunk
from shared.model.quant_formats import BlockFp8Weight, dequantize_block_fp8
from shared.model.quantize import quantize_checkpoint
from shared.model.weights import load_weights, prepare_for_kernels
from shared.parallel import ShardSpec

# config.json of Qwen/Qwen3-30B-A3B as published (the spelling differs from what
# transformers 5 writes: num_experts, top-level rope_theta, rope_scaling null).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}


def test_published_and_transformers_spellings_give_the_same_config():
    published = ModelConfig.from_dict(QWEN3_30B_A3B)
    respelled = dict(QWEN3_30B_A3B)
    respelled["num_local_experts"] = respelled.pop("num_experts")
    respelled["rope_parameters"] = {"rope_type": "default", "rope_theta": respelled.pop("rope_theta")}
    assert ModelConfig.from_dict(respelled) == published
    assert (published.num_experts, published.top_k, published.head_dim, published.rope_theta) == (128, 8, 128, 1e6)
    assert all(published.moe_layers) and published.quantization is None


def test_sparse_step_and_mlp_only_layers_place_dense_layers():
    cfg = ModelConfig.from_dict({**QWEN3_30B_A3B, "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert cfg.moe_layers == (False, True, False, False, False, True)


def test_fp8_quantization_config_is_read():
    qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    assert ModelConfig.from_dict({**QWEN3_30B_A3B, "quantization_config": qc}).quantization.block == (128, 128)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"architectures": ["LlamaForCausalLM"]}, "LlamaForCausalLM"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"attention_bias": True}, "attention_bias"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"quantization_config": {"quant_method": "awq"}}, "quant_method"),
        ({"quantization_config": {"quant_method": "fp8"}}, "weight_block_size"),
    ],
)
def test_unsupported_options_are_named(change, named):
    with pytest.raises(UnsupportedModel, match=named):
        ModelConfig.from_dict({**QWEN3_30B_A3B, **change})


def test_missing_required_field_is_named():
    broken = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts_per_tok"}
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        ModelConfig.from_dict(broken)


@pytest.mark.parametrize(("eos", "expected"), [(151645, (151645,)), ([151645, 151643], (151645, 151643))])
def test_generation_config_eos_int_or_list(tmp_path, eos, expected):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "temperature": 0.6, "top_k": 20}))
    gen = GenerationConfig.from_dir(tmp_path)
    assert gen.eos_token_ids == expected and gen.temperature == 0.6 and gen.top_k == 20 and gen.top_p == 1.0


# ---------------------------------------------------------------- bad checkpoints


@pytest.fixture
def single_file_copy(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("gqa4_top8_norm")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def test_corrupt_header_names_the_file(single_file_copy):
    path = single_file_copy / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:40] = b"{not json at all" + b"!" * 16
    path.write_bytes(bytes(data))
    cfg = ModelConfig.from_dir(single_file_copy)
    with pytest.raises(CheckpointError, match="model.safetensors") as info:
        load_weights(single_file_copy, cfg)
    assert info.value.file.endswith("model.safetensors")


def test_missing_tensor_is_named(single_file_copy):
    path = single_file_copy / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(MissingTensor, match=r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        load_weights(single_file_copy, ModelConfig.from_dir(single_file_copy))


def test_shape_mismatch_names_tensor_and_file(single_file_copy):
    cfg_path = single_file_copy / "config.json"
    raw = json.loads(cfg_path.read_text())
    raw["moe_intermediate_size"] *= 2
    cfg_path.write_text(json.dumps(raw))
    with pytest.raises(ShapeMismatch, match=r"experts\.0\.gate_proj\.weight.*model\.safetensors|model\.safetensors.*experts\.0\.gate_proj"):
        load_weights(single_file_copy, ModelConfig.from_dir(single_file_copy))


def test_unknown_architecture_in_a_directory(single_file_copy):
    cfg_path = single_file_copy / "config.json"
    raw = json.loads(cfg_path.read_text())
    raw["architectures"] = ["MixtralForCausalLM"]
    cfg_path.write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModel, match="MixtralForCausalLM"):
        Qwen3Model.load(single_file_copy)


# ---------------------------------------------------------------- sharded loading


def test_tp_slices_heads_and_replicates_kv_heads(tiny_checkpoint):
    """TP=4 over 8 q heads and 2 KV heads: rank r holds q heads 2r, 2r+1 and KV head r // 2."""
    path = tiny_checkpoint("gqa4_top8_norm")
    cfg = ModelConfig.from_dir(path)
    d = cfg.head_dim
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        q, k = f.get_tensor("model.layers.0.self_attn.q_proj.weight"), f.get_tensor("model.layers.0.self_attn.k_proj.weight")
        o = f.get_tensor("model.layers.0.self_attn.o_proj.weight")
    for r in range(4):
        attn = load_weights(path, cfg, ShardSpec(tp_rank=r, tp_size=4)).layers[0].attn
        assert torch.equal(attn.q_proj, q[2 * r * d : (2 * r + 2) * d])
        assert torch.equal(attn.o_proj, o[:, 2 * r * d : (2 * r + 2) * d])
        kv_head = r * cfg.num_kv_heads // 4
        assert torch.equal(attn.k_proj, k[kv_head * d : (kv_head + 1) * d])


def test_ep_fuses_a_contiguous_expert_range(tiny_checkpoint):
    path = tiny_checkpoint("gqa2_top2_nonorm_sharded")  # sharded files + index
    cfg = ModelConfig.from_dir(path)
    mlp = load_weights(path, cfg, ShardSpec(ep_rank=1, ep_size=2)).layers[1].mlp
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]

    def tensor(name):
        with safe_open(str(path / index[name]), "pt") as f:
            return f.get_tensor(name)

    assert mlp.expert_start == 4 and mlp.w13.shape == (4, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
    p = "model.layers.1.mlp.experts.6."
    assert torch.equal(mlp.w13[2], torch.cat([tensor(p + "gate_proj.weight"), tensor(p + "up_proj.weight")]))
    assert torch.equal(mlp.w2[2], tensor(p + "down_proj.weight"))


def test_indivisible_tp_is_rejected(tiny_checkpoint):
    path = tiny_checkpoint("gqa4_top8_norm")
    with pytest.raises(ShardingError, match="num_attention_heads=8"):
        load_weights(path, ModelConfig.from_dir(path), ShardSpec(tp_rank=0, tp_size=3))


# ---------------------------------------------------------------- FP8 block-scaled

FP8_TINY = dict(hidden=128, heads=2, kv_heads=1, head_dim=128, experts=4, top_k=2, moe_intermediate=128, intermediate=256, mlp_only_layers=[1])


@pytest.fixture(scope="module")
def fp8_pair(tiny_checkpoint, tmp_path_factory):
    src = tiny_checkpoint("fp8_src", **FP8_TINY)
    dst = tmp_path_factory.mktemp("fp8") / "ckpt"
    quantize_checkpoint(src, dst, "fp8-block")
    return src, dst


def test_fp8_loads_as_e4m3_with_scales_and_dequantizes(fp8_pair):
    src, dst = fp8_pair
    cfg = ModelConfig.from_dir(dst)
    assert cfg.quantization is not None
    w = load_weights(dst, cfg)
    q = w.layers[0].attn.q_proj
    assert isinstance(q, BlockFp8Weight) and q.weight.dtype == torch.float8_e4m3fn
    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        ref = dequantize_block_fp8(f.get_tensor("model.layers.0.self_attn.q_proj.weight"), f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale_inv"))
    assert torch.equal(q.dequantize(), ref)
    assert isinstance(w.layers[0].mlp.w13, BlockFp8Weight) and w.layers[0].mlp.w13.scale_inv.shape == (4, 2, 1)
    assert not isinstance(w.layers[0].mlp.router, BlockFp8Weight)


def test_fp8_tp2_slices_weights_and_scales_together(fp8_pair):
    _, dst = fp8_pair
    cfg = ModelConfig.from_dir(dst)
    full = load_weights(dst, cfg)
    for r in range(2):
        part = load_weights(dst, cfg, ShardSpec(tp_rank=r, tp_size=2))
        assert torch.equal(part.layers[0].attn.q_proj.dequantize(), full.layers[0].attn.q_proj.dequantize()[r * 128 : (r + 1) * 128])
        assert torch.equal(part.layers[1].mlp.w2.dequantize(), full.layers[1].mlp.w2.dequantize()[:, r * 128 : (r + 1) * 128])


def test_fp8_split_off_block_boundaries_is_rejected(tiny_checkpoint, tmp_path):
    """4 heads of 64 over TP=4: each rank's 64 q_proj rows would cut a 128-row scale block."""
    src = tiny_checkpoint("fp8_misaligned_src", **{**FP8_TINY, "heads": 4, "head_dim": 64})
    quantize_checkpoint(src, tmp_path / "ckpt", "fp8-block")
    cfg = ModelConfig.from_dir(tmp_path / "ckpt")
    with pytest.raises(ShardingError, match=r"q_proj.*FP8 128-blocks"):
        load_weights(tmp_path / "ckpt", cfg, ShardSpec(tp_rank=1, tp_size=4))


def test_fp8_gate_up_ending_inside_a_row_block_loads_and_runs(tiny_checkpoint, tmp_path):
    """moe_intermediate_size 32 (the demo model's) and a dense intermediate_size of 96: gate and up each
    end inside their one 128-row scale block, so fusing them takes a finer row block. `moebus quantize
    --format fp8-block` of the demo model gave a checkpoint whose every rank failed to load ("cannot
    fuse FP8 weights whose size 32 is not a multiple of the 128-block"). The model must compute what
    the fp32 model of the checkpoint's dequantized weights computes."""
    src = tiny_checkpoint("fp8_short_rows_src", **{**FP8_TINY, "moe_intermediate": 32, "intermediate": 96})
    dst, plain = tmp_path / "ckpt", tmp_path / "dequantized"
    quantize_checkpoint(src, dst, "fp8-block")
    shutil.copytree(src, plain)
    tensors = load_file(plain / "model.safetensors")
    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        for name in tensors:
            if name + "_scale_inv" in f.keys():
                tensors[name] = dequantize_block_fp8(f.get_tensor(name), f.get_tensor(name + "_scale_inv")).contiguous()
    save_file(tensors, plain / "model.safetensors")
    w = load_weights(dst, ModelConfig.from_dir(dst))
    expert = w.layers[0].mlp.w13
    assert expert.block == (32, 128) and expert.scale_inv.shape == (FP8_TINY["experts"], 2, 1)
    assert isinstance(w.layers[1].mlp.w13, BlockFp8Weight) and w.layers[1].mlp.w13.block == (32, 128)
    # The grouped-GEMM kernels take one block for both expert weights: such experts run the reference ops.
    assert prepare_for_kernels(w) == "FP8 blocks of w13 (32, 128) and w2 (128, 128) differ"

    prompts = random_prompts([9, 4], seed=3)
    out = []
    for model in (Qwen3Model.load(plain), Qwen3Model.load(dst)):
        c = model.config
        cache = PagedKVCache(KVLayout(c.num_layers, 8, model.local_kv_heads, 4, c.head_dim, torch.float32))
        batch = ForwardBatch.build([SequenceChunk(prompts[0], 0, [0, 1, 2]), SequenceChunk(prompts[1], 0, [3])], 4, torch.device("cpu"))
        out.append(model.forward(batch, cache, all_logits=True))
    assert rel_err(out[1], out[0]) < 1e-5


def test_fp8_model_tracks_the_full_precision_model(fp8_pair):
    """Logits within the measured weight quantization error; greedy tokens mostly agree."""
    src, dst = fp8_pair
    ref_model, fp8_model = Qwen3Model.load(src), Qwen3Model.load(dst)
    prompts = random_prompts([12, 5], seed=5)
    out = []
    for model in (ref_model, fp8_model):
        c = model.config
        cache = PagedKVCache(KVLayout(c.num_layers, 16, model.local_kv_heads, 4, c.head_dim, torch.float32))
        batch = ForwardBatch.build([SequenceChunk(prompts[0], 0, [0, 1, 2]), SequenceChunk(prompts[1], 0, [3, 4])], 4, torch.device("cpu"))
        out.append(model.forward(batch, cache, all_logits=True))
    err = rel_err(out[1], out[0])
    agree = float((out[1].argmax(-1) == out[0].argmax(-1)).float().mean())
    print(f"fp8 vs fp32 logits rel err {err:.4f}, argmax agreement {agree:.2%}")
    assert 0 < err < 0.1
    assert agree >= 0.8
