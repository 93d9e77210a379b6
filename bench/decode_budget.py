"""What one GPU of a Qwen3-MoE decode layout must read per step, and what it must hold.

Pure arithmetic on a `ModelConfig` (no GPU, no weights), used by `bench.decode_step`:

* `step_bytes`: the HBM roofline of one decode step on one GPU of a DP x EP layout
  (``ep = 1``: one GPU holding everything). Per layer: the attention projections, norms
  and router, which every DP rank holds and reads; the rank's local experts that at
  least one token of the step picks; the K/V of the rank's own sequences. Once per
  step: ``lm_head`` and the batch's embedding rows. All ranks' ``batch * ep`` tokens
  are dispatched over the experts, so under uniform routing a local expert is hit
  with probability ``1 - (1 - k/E) ** (batch * ep)``.
* `rank_memory_bytes` / `check_fits`: the bytes a rank holds (its experts, the
  replicated rest, its paged KV pool) plus a fixed headroom, checked against the
  GPU's memory before any weights are drawn, so an impossible layout is refused
  with the numbers instead of running out of memory part-way.

Expert weights are bf16, or block FP8 (``"fp8"``: E4M3 values plus one fp32 scale
per 128x128 block, the layout of Qwen's FP8 checkpoints). Attention, router, norms,
embedding and ``lm_head`` stay in the activation dtype (``elem`` bytes): the model
dequantizes FP8 attention projections on every call, which a benchmark of the
experts' format should not pay.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.model.config import ModelConfig
from shared.model.quant_formats import WEIGHT_BLOCK

EXPERT_WEIGHTS = ("bf16", "fp8")
# What a rank holds beyond its weights and KV pool: CUDA context, NCCL and peer-memory
# buffers, compiled kernels, CUDA-graph pools, activations, one layer's w13 while
# `prepare_for_kernels` interleaves it.
MEMORY_HEADROOM_BYTES = 8 << 30

# Hugging Face config.json of each model (shapes only; the benchmark's weights are random).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 40960, "tie_word_embeddings": False,
}
QWEN3_235B_A22B = {
    "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 4096, "num_hidden_layers": 94,
    "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 12288,
    "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 40960, "tie_word_embeddings": False,
}
MODELS = {"qwen3-30b-a3b": QWEN3_30B_A3B, "qwen3-235b-a22b": QWEN3_235B_A22B}


def model_config(model: str, layers: int | None = None, experts: int | None = None, vocab: int | None = None) -> ModelConfig:
    """The `MODELS` entry ``model`` with the benchmarks' overrides (fewer layers to save time, fewer
    experts or a smaller vocabulary for quick CPU checks); None keeps the model's own."""
    raw = dict(MODELS[model])
    for key, value in (("num_hidden_layers", layers), ("num_experts", experts), ("vocab_size", vocab)):
        if value is not None:
            raw[key] = value
    return ModelConfig.from_dict(raw)


class DoesNotFit(ValueError):
    """A decode layout whose ranks cannot hold their share of the model."""


def _blocks(rows: int, cols: int) -> int:
    return -(-rows // WEIGHT_BLOCK[0]) * -(-cols // WEIGHT_BLOCK[1])


def expert_nbytes(c: ModelConfig, weights: str) -> int:
    """Bytes of one expert's gate, up and down projections in format ``weights``."""
    h, i = c.hidden_size, c.moe_intermediate_size
    if weights == "bf16":
        return 3 * h * i * 2
    if weights == "fp8":
        return 3 * h * i + 4 * (_blocks(2 * i, h) + _blocks(h, i))  # E4M3 values + fp32 block scales
    raise ValueError(f"expert weights must be one of {EXPERT_WEIGHTS}, got {weights!r}")


def _replicated_layer_nbytes(c: ModelConfig, elem: int) -> int:
    """Per layer, what every DP rank holds and reads: q/k/v/o, q/k norms, two RMSNorms, router."""
    h, d = c.hidden_size, c.head_dim
    return (2 * c.num_heads * d * h + 2 * c.num_kv_heads * d * h + 2 * d + 2 * h + c.num_experts * h) * elem


def experts_hit(c: ModelConfig, batch: int, ep: int = 1) -> float:
    """Expected local experts per layer that at least one of the step's ``batch * ep`` tokens picks."""
    return c.num_experts / ep * (1 - (1 - c.top_k / c.num_experts) ** (batch * ep))


def step_bytes(c: ModelConfig, batch: int, context: int, elem: int = 2, weights: str = "bf16", ep: int = 1) -> tuple[float, float]:
    """(bytes one GPU must read in a decode step at least, expected experts hit per layer on it).

    ``batch`` sequences on this GPU with ``context`` cached tokens each; ``ep`` GPUs in the layout.
    """
    hit = experts_hit(c, batch, ep)
    kv_read = batch * (context + 1) * 2 * c.num_kv_heads * c.head_dim * elem
    per_layer = _replicated_layer_nbytes(c, elem) + hit * expert_nbytes(c, weights) + kv_read
    return c.num_layers * per_layer + c.vocab_size * c.hidden_size * elem + batch * c.hidden_size * elem, hit


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds, by part."""

    experts: int
    replicated: int  # attention, norms, router, embedding, lm_head
    kv_cache: int
    headroom: int = MEMORY_HEADROOM_BYTES

    @property
    def total(self) -> int:
        return self.experts + self.replicated + self.kv_cache + self.headroom


def rank_memory_bytes(c: ModelConfig, ep: int, max_batch: int, context: int, page_size: int, weights: str, elem: int = 2) -> RankMemory:
    """What one rank of a DP ``ep`` x EP ``ep`` layout holds (``ep = 1``: one GPU with every expert).

    The KV pool is the benchmark's: ``max_batch`` sequences of ``context + 1`` tokens in pages of ``page_size``.
    """
    experts = c.num_layers * (c.num_experts // ep) * expert_nbytes(c, weights)
    embeddings = (1 if c.tie_word_embeddings else 2) * c.vocab_size * c.hidden_size * elem
    replicated = c.num_layers * _replicated_layer_nbytes(c, elem) + embeddings + c.hidden_size * elem
    pages = max_batch * -(-(context + 1) // page_size)
    kv_cache = c.num_layers * pages * 2 * c.num_kv_heads * page_size * c.head_dim * elem
    return RankMemory(experts, replicated, kv_cache)


def check_fits(model: str, c: ModelConfig, ep: int, max_batch: int, context: int, page_size: int, weights: str, device_bytes: int) -> RankMemory:
    """`rank_memory_bytes`, or `DoesNotFit` naming the parts when they exceed ``device_bytes``."""
    need = rank_memory_bytes(c, ep, max_batch, context, page_size, weights)
    if need.total > device_bytes:
        gb = 1e9
        raise DoesNotFit(
            f"{model} ({c.num_layers} layers, {weights} experts) over EP={ep} needs {need.total / gb:.1f} GB per GPU "
            f"(experts {need.experts / gb:.1f}, attention/router/embeddings {need.replicated / gb:.1f}, "
            f"KV for {max_batch} x {context} tokens {need.kv_cache / gb:.1f}, headroom {need.headroom / gb:.1f}); "
            f"the GPU has {device_bytes / gb:.1f} GB. Use more GPUs (--ep), fewer --layers, smaller --batches or --context."
        )
    return need
