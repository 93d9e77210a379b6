"""Typed errors of the model runtime.

Every error names what is wrong and where (file, tensor, config field), so a user
pointing moebus at the wrong directory learns what to fix from the message alone.
"""

from __future__ import annotations


class ModelError(Exception):
    """Base class of model runtime errors."""


class ConfigError(ModelError):
    """``config.json`` / ``generation_config.json`` is missing, unreadable or inconsistent."""


class UnsupportedModel(ConfigError):
    """An architecture or option moebus does not implement (named in the message)."""


class CheckpointError(ModelError):
    """A safetensors checkpoint that cannot be read as the config describes.

    ``file`` and ``tensor`` name the culprit when known.
    """

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None) -> None:
        where = ", ".join(p for p in (f"file {file}" if file else "", f"tensor {tensor}" if tensor else "") if p)
        super().__init__(f"{message} ({where})" if where else message)
        self.file = file
        self.tensor = tensor


class MissingTensor(CheckpointError):
    """A tensor the config requires is not in the checkpoint."""


class ShapeMismatch(CheckpointError):
    """A tensor's shape disagrees with what the config fields imply."""


class ShardingError(ModelError):
    """The model cannot be split the way the rank topology asks (heads, experts, FP8 blocks)."""
