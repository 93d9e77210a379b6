"""The decode roofline and memory check of bench/decode_budget.py against hand calculations.

The expected numbers are written out from the published Qwen3 configs (hidden 4096, 94 layers,
128 experts top-8, moe_intermediate 1536, 64 q / 4 KV heads of 128, vocab 151936 for
Qwen3-235B-A22B), not taken from the module's helpers.
"""

from __future__ import annotations

import pytest

from bench.decode_budget import MEMORY_HEADROOM_BYTES, MODELS, DoesNotFit, check_fits, expert_nbytes, rank_memory_bytes, step_bytes
from shared.model.config import ModelConfig

QWEN3_235B = ModelConfig.from_dict(MODELS["qwen3-235b-a22b"])
QWEN3_30B = ModelConfig.from_dict(MODELS["qwen3-30b-a3b"])
H200_BYTES = 141e9  # what NVIDIA quotes for one H200

# Qwen3-235B-A22B by hand, bf16 (2 bytes) for everything but the FP8 experts.
H, I, E, K, L, D, V = 4096, 1536, 128, 8, 94, 128, 151936
Q_PARAMS = 64 * D * H  # q_proj, and o_proj likewise
KV_PARAMS = 4 * D * H  # k_proj, and v_proj likewise
REPLICATED_LAYER_BYTES = 2 * (2 * Q_PARAMS + 2 * KV_PARAMS + 2 * D + 2 * H + E * H)  # + q/k norms, 2 RMSNorms, router
FP8_EXPERT_BYTES = (2 * I * H + H * I) + 4 * ((2 * I // 128) * (H // 128) + (H // 128) * (I // 128))
LM_HEAD_BYTES = V * H * 2


def test_235b_fp8_step_bytes_per_gpu_at_ep8():
    batch, context, ep = 32, 512, 8
    hit = (E // ep) * (1 - (1 - K / E) ** (batch * ep))  # all 256 tokens of the step are dispatched
    kv_read = batch * (context + 1) * 2 * 4 * D * 2
    expected = L * (REPLICATED_LAYER_BYTES + hit * FP8_EXPERT_BYTES + kv_read) + LM_HEAD_BYTES + batch * H * 2
    nbytes, experts_hit = step_bytes(QWEN3_235B, batch, context, 2, "fp8", ep)
    assert experts_hit == pytest.approx(hit, rel=1e-12)
    assert nbytes == pytest.approx(expected, rel=1e-12)
    # Sanity of the hand numbers themselves: ~28 GB of experts per GPU, all of them hit at 256 tokens.
    assert 15.99 < hit <= 16 and 46e9 < nbytes < 47e9


def test_single_gpu_bf16_step_bytes_keep_the_original_formula():
    # Qwen3-30B-A3B, one GPU, bf16: the formula of the rows recorded before the EP roofline existed.
    h, i, e, k, layers, d, v, batch, context = 2048, 768, 128, 8, 48, 128, 151936, 16, 512
    attn = (2 * 32 * d * h + 2 * 4 * d * h + 2 * d + 2 * h) * 2
    hit = e * (1 - (1 - k / e) ** batch)
    moe = (e * h + hit * 3 * i * h) * 2
    kv_read = batch * (context + 1) * 2 * 4 * d * 2
    expected = layers * (attn + moe + kv_read) + v * h * 2 + batch * h * 2
    nbytes, experts_hit = step_bytes(QWEN3_30B, batch, context, 2)
    assert experts_hit == pytest.approx(hit) and nbytes == pytest.approx(expected, rel=1e-12)


def test_235b_fp8_fits_eight_h200s():
    need = check_fits("qwen3-235b-a22b", QWEN3_235B, 8, 128, 512, 16, "fp8", int(H200_BYTES))
    assert need.experts == L * (E // 8) * FP8_EXPERT_BYTES
    assert need.replicated == L * REPLICATED_LAYER_BYTES + 2 * LM_HEAD_BYTES + H * 2  # untied embedding + final norm
    pages = 128 * 33  # 513 tokens per sequence in pages of 16
    assert need.kv_cache == L * pages * 2 * 4 * 16 * D * 2
    assert need.total == need.experts + need.replicated + need.kv_cache + MEMORY_HEADROOM_BYTES
    assert need.total < 70e9


@pytest.mark.parametrize("ep, batch", [(1, 32), (2, 128), (2, 32)])
def test_235b_fp8_on_too_few_gpus_is_refused_with_the_numbers(ep, batch):
    with pytest.raises(DoesNotFit) as info:
        check_fits("qwen3-235b-a22b", QWEN3_235B, ep, batch, 512, 16, "fp8", int(H200_BYTES))
    message = str(info.value)
    assert f"EP={ep}" in message and "experts" in message and "141.0 GB" in message
    experts_gb = L * (E // ep) * FP8_EXPERT_BYTES / 1e9
    assert f"experts {experts_gb:.1f}" in message


def test_bf16_experts_take_twice_the_fp8_bytes_and_unknown_formats_are_rejected():
    assert expert_nbytes(QWEN3_235B, "bf16") == 3 * H * I * 2
    assert expert_nbytes(QWEN3_235B, "fp8") == FP8_EXPERT_BYTES
    with pytest.raises(ValueError, match="fp4"):
        expert_nbytes(QWEN3_235B, "fp4")
    # bf16 experts over 8 GPUs: twice the expert bytes of FP8, less the scales.
    bf16 = rank_memory_bytes(QWEN3_235B, 8, 32, 512, 16, "bf16")
    assert bf16.experts == L * 16 * 3 * H * I * 2
