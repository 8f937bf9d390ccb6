"""Model references: the one place that reads `preset:NAME[:VARIANT]`, `builtin:NAME` and a directory.

Every front door (CLI, dashboard, server, capture import, training) names a model by one string; this
module turns it into a `ModelRef` and answers what the doors ask of it: its config, its checkpoint
directory (None for a preset, whose weights are random), whether a checkpoint ships files beside it.
Loading the weights stays in `engine.weights.load.load_model`, which parses through here too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from engine.builtin import PREFIX as BUILTIN_PREFIX
from engine.builtin import resolve_builtin
from engine.config import ModelConfig
from engine.config_io import load_config
from engine.errors import InputError
from engine.presets import get_preset

PRESET_PREFIX = "preset:"
# the model every entry point runs when none is named: the trained demo model shipped in the package
DEFAULT_MODEL = "builtin:demo"

RefKind = Literal["preset", "builtin", "directory"]


@dataclass(frozen=True)
class ModelRef:
    """A parsed model reference.

    Attributes:
        text: the reference as given (`preset:tiny:k3`, `builtin:demo`, `/ckpt/k3.1-pro`).
        kind: `preset` (random weights from a named config), `builtin` (a checkpoint shipped in the
            package) or `directory` (a checkpoint directory, or its config.json).
        name: the preset or builtin name; the path for a directory.
        variant: a preset's variant (`k3`, `kimi-linear`), else None.
    """

    text: str
    kind: RefKind
    name: str
    variant: str | None = None

    @property
    def is_preset(self) -> bool:
        return self.kind == "preset"

    @property
    def directory(self) -> Path | None:
        """The checkpoint directory (a builtin's resolved one; a config.json's parent); None for a preset."""
        if self.kind == "preset":
            return None
        if self.kind == "builtin":
            return resolve_builtin(self.text)
        path = Path(self.name)
        return path.parent if path.is_file() else path

    def config(self) -> ModelConfig:
        """The model's config: the preset's, or the checkpoint's config.json (checked, ConfigError naming the field)."""
        if self.kind == "preset":
            return get_preset(self.name, self.variant)  # type: ignore[arg-type]
        return load_config(resolve_builtin(self.text) if self.kind == "builtin" else Path(self.name))

    def __str__(self) -> str:
        return self.text


def parse_model_ref(ref: "str | os.PathLike[str] | ModelRef") -> ModelRef:
    """`preset:NAME[:VARIANT]`, `builtin:NAME` or a path -> a `ModelRef` (InputError for anything else)."""
    if isinstance(ref, ModelRef):
        return ref
    if not isinstance(ref, (str, os.PathLike)):
        raise InputError(f"model path must be a str or path, got {type(ref).__name__}")
    text = os.fspath(ref)
    if not isinstance(text, str):
        raise InputError(f"model path must be text, got {type(text).__name__}")
    if not text.strip():
        raise InputError("model path is empty: give a checkpoint directory, builtin:NAME or preset:NAME")
    if text.startswith(PRESET_PREFIX):
        name, _, variant = text[len(PRESET_PREFIX):].partition(":")
        return ModelRef(text, "preset", name, variant or None)
    if text.startswith(BUILTIN_PREFIX):
        return ModelRef(text, "builtin", text[len(BUILTIN_PREFIX):])
    return ModelRef(text, "directory", text)
