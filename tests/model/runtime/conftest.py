"""Tiny checkpoints for the model runtime tests, written once per session by make-tiny."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from runtime_helpers import VOCAB

from shared.model.tiny import make_tiny


# name -> make_tiny options. Together: GQA ratios 1/2/4/8, top-k 1/2/8, norm_topk_prob
# on/off, tied/untied, sharded files, a dense layer inside a MoE model, a dense model.
CONFIGS: dict[str, dict] = {
    "gqa1_top1_norm_tied": dict(heads=4, kv_heads=4, experts=4, top_k=1, norm_topk_prob=True, tie=True),
    "gqa2_top2_nonorm_sharded": dict(heads=4, kv_heads=2, experts=8, top_k=2, norm_topk_prob=False, max_shard_size="150KB"),
    "gqa4_top8_norm": dict(heads=8, kv_heads=2, experts=8, top_k=8, norm_topk_prob=True),
    "gqa8_top2_mlp_only_tied": dict(layers=3, heads=8, kv_heads=1, experts=8, top_k=2, norm_topk_prob=False, tie=True, mlp_only_layers=[1]),
    "dense": dict(dense=True, heads=4, kv_heads=2),
}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``tiny_checkpoint(name)`` (or ``tiny_checkpoint(name, **options)``): path of a fp32 checkpoint.

    With ``MOEBUS_TINY_DIR`` set, checkpoints are kept there by name and reused (a GPU
    machine then loads the exact files written here, whatever its transformers version).
    """
    made: dict[str, Path] = {}
    keep = os.environ.get("MOEBUS_TINY_DIR")

    def get(name: str, **options) -> Path:
        if name not in made:
            opts = {"vocab": VOCAB, "tokenizer": False, "dtype": "float32", "seed": 1, **CONFIGS.get(name, {}), **options}
            out = Path(keep) / name if keep else tmp_path_factory.mktemp(name)
            made[name] = out if (out / "config.json").exists() else make_tiny(out, **opts)
        return made[name]

    return get
