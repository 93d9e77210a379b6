"""Tiny checkpoints for the model runtime tests, written once per session by make-tiny."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from runtime_helpers import CONFIGS, VOCAB

from shared.model.tiny import make_tiny


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
