"""Model and generation configuration read from a Hugging Face checkpoint directory.

`ModelConfig.from_dir` accepts what the published Qwen3 checkpoints and
transformers' own ``save_pretrained`` write: ``num_experts`` or
``num_local_experts``, ``rope_theta`` at the top level or inside
``rope_parameters``, MoE placement through ``decoder_sparse_step`` /
``mlp_only_layers``, the FP8 block ``quantization_config`` Qwen publishes, and
the MXFP8 one ``moebus quantize --format mxfp8`` writes.
Anything the runtime does not implement is rejected with `UnsupportedModel`
naming the option, rather than silently computing something else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.model.errors import ConfigError, UnsupportedModel

# This module is what the control plane (gateway, scheduler, frontends) knows of a model, and
# those processes never import torch: it imports nothing of the runtime (quant_formats, kernels).
# Hence the OCP MX spec's block size stated here, not imported: `kernels.grouped_gemm_mxfp8.MX_BLOCK`
# is the same number, the one the kernels (reference and Hopper GEMM) and the MXFP8 checkpoint
# writer import (tests/model/runtime/test_mxfp8_loading.py checks that the two agree).
MX_BLOCK = 32

MOE_ARCH = "Qwen3MoeForCausalLM"
DENSE_ARCH = "Qwen3ForCausalLM"
SUPPORTED_ARCHITECTURES = (MOE_ARCH, DENSE_ARCH)


@dataclass(frozen=True)
class Fp8Quantization:
    """Block-scaled E4M3 weights (``quant_method: fp8``) with one scale per ``block``."""

    block: tuple[int, int]
    # Module name fragments left unquantized (as in ``modules_to_not_convert``).
    modules_to_not_convert: tuple[str, ...] = ()


@dataclass(frozen=True)
class Mxfp8Quantization:
    """OCP MXFP8 weights (``quant_method: mxfp8``): E4M3 with one E8M0 scale per ``block_size`` values of K."""

    block_size: int
    modules_to_not_convert: tuple[str, ...] = ()


Quantization = Fp8Quantization | Mxfp8Quantization


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP layers (all layers of a dense model, mlp_only_layers of a MoE)
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    moe_layers: tuple[bool, ...]  # per layer: sparse MoE block (True) or dense MLP (False)
    quantization: Quantization | None = None

    @property
    def is_moe(self) -> bool:
        return any(self.moe_layers)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        if not Path(model_dir).is_dir():  # vLLM users pass a Hub id here, which vLLM downloads
            raise ConfigError(f"{model_dir}: no such directory; moebus reads a local checkpoint directory and downloads nothing (vLLM "
                              "fetches a Hugging Face id such as Qwen/Qwen3-30B-A3B: download it first, e.g. `huggingface-cli download "
                              "Qwen/Qwen3-30B-A3B --local-dir DIR`, and pass DIR)")
        path = Path(model_dir) / "config.json"
        return cls.from_dict(_read_json(path), source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = raw.get("architectures") or []
        if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(
                f"{source}: architectures={archs!r} is not supported; expected one of {list(SUPPORTED_ARCHITECTURES)}"
            )
        arch = archs[0]
        f = _Fields(raw, source)
        _reject_unsupported_options(raw, source)

        hidden, num_heads = f.int("hidden_size"), f.int("num_attention_heads")
        num_layers = f.int("num_hidden_layers")
        num_kv_heads = f.int("num_key_value_heads", default=num_heads)
        head_dim = f.int("head_dim", default=hidden // num_heads)
        if num_heads % num_kv_heads:
            raise ConfigError(f"{source}: num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")

        if arch == MOE_ARCH:
            num_experts = f.int("num_experts", "num_local_experts")
            top_k = f.int("num_experts_per_tok")
            if not 0 < top_k <= num_experts:
                raise ConfigError(f"{source}: num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
            step = f.int("decoder_sparse_step", default=1)
            mlp_only = set(raw.get("mlp_only_layers") or [])
            moe_layers = tuple(i not in mlp_only and step > 0 and (i + 1) % step == 0 for i in range(num_layers))
            moe_intermediate = f.int("moe_intermediate_size")
            norm_topk = bool(raw.get("norm_topk_prob", False))
        else:
            num_experts = top_k = moe_intermediate = 0
            moe_layers = (False,) * num_layers
            norm_topk = False
        intermediate = f.int("intermediate_size", default=0 if all(moe_layers) else None)

        return cls(
            architecture=arch,
            vocab_size=f.int("vocab_size"),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=intermediate,
            moe_intermediate_size=moe_intermediate,
            num_experts=num_experts,
            top_k=top_k,
            norm_topk_prob=norm_topk,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(raw, source),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=f.int("max_position_embeddings", default=32768),
            moe_layers=moe_layers,
            quantization=_quantization(raw.get("quantization_config"), source),
        )


@dataclass(frozen=True)
class GenerationConfig:
    """Defaults from ``generation_config.json``; a missing file gives plain defaults."""

    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0

    @classmethod
    def from_dir(cls, model_dir: str | Path, model_config_eos: Any = None) -> GenerationConfig:
        path = Path(model_dir) / "generation_config.json"
        raw = _read_json(path) if path.exists() else {}
        eos = raw.get("eos_token_id", model_config_eos)
        if eos is None:
            eos_ids: tuple[int, ...] = ()
        elif isinstance(eos, int):
            eos_ids = (eos,)
        elif isinstance(eos, list) and all(isinstance(e, int) for e in eos):
            eos_ids = tuple(eos)
        else:
            raise ConfigError(f"{path}: eos_token_id must be an int or a list of ints, got {eos!r}")
        return cls(
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            do_sample=bool(raw.get("do_sample", False)),
            temperature=float(raw.get("temperature", 1.0)),
            top_k=int(raw.get("top_k", 0) or 0),
            top_p=float(raw.get("top_p", 1.0)),
            repetition_penalty=float(raw.get("repetition_penalty", 1.0)),
            min_p=float(raw.get("min_p", 0.0) or 0.0),
        )


class _Fields:
    """Typed access to required/optional integer fields, with errors naming the field."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw, self.source = raw, source

    def int(self, *names: str, default: int | None = None) -> int:
        for name in names:
            value = self.raw.get(name)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{self.source}: field {name}={value!r} must be a non-negative integer")
            return value
        if default is None:
            raise ConfigError(f"{self.source}: required field {' / '.join(names)} is missing")
        return default


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot parse JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data


def _reject_unsupported_options(raw: dict[str, Any], source: str) -> None:
    if raw.get("attention_bias"):
        raise UnsupportedModel(f"{source}: attention_bias=true is not supported")
    if raw.get("use_sliding_window"):
        raise UnsupportedModel(f"{source}: use_sliding_window=true is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"{source}: hidden_act={raw['hidden_act']!r} is not supported (only silu)")
    scaling = raw.get("rope_scaling")
    if scaling:
        raise UnsupportedModel(f"{source}: rope_scaling={scaling!r} is not supported (only default RoPE)")
    rope_type = (raw.get("rope_parameters") or {}).get("rope_type", "default")
    if rope_type != "default":
        raise UnsupportedModel(f"{source}: rope_parameters.rope_type={rope_type!r} is not supported (only default)")


def _rope_theta(raw: dict[str, Any], source: str) -> float:
    params = raw.get("rope_parameters") or {}
    theta = params.get("rope_theta", raw.get("rope_theta"))
    if theta is None:
        raise ConfigError(f"{source}: neither rope_theta nor rope_parameters.rope_theta is set")
    return float(theta)


def _quantization(qc: dict[str, Any] | None, source: str) -> Quantization | None:
    if not qc:
        return None
    method = qc.get("quant_method")
    skip = tuple(qc.get("modules_to_not_convert") or ())
    if method == "mxfp8":
        block_size = qc.get("block_size")
        # The OCP MX spec fixes the block at 32 values; other sizes are not MXFP8.
        if block_size != MX_BLOCK:
            raise UnsupportedModel(
                f"{source}: quantization_config.block_size={block_size!r} is not supported (MXFP8 needs {MX_BLOCK})"
            )
        return Mxfp8Quantization(block_size=MX_BLOCK, modules_to_not_convert=skip)
    if method != "fp8":
        raise UnsupportedModel(
            f"{source}: quantization_config.quant_method={method!r} is not supported (only fp8 or mxfp8)"
        )
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise UnsupportedModel(
            f"{source}: quantization_config.weight_block_size={block!r} is not supported (block-scaled FP8 needs [N, K])"
        )
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise UnsupportedModel(f"{source}: quantization_config.activation_scheme={qc['activation_scheme']!r} (only dynamic)")
    return Fp8Quantization(block=(block[0], block[1]), modules_to_not_convert=skip)
