"""Checkpoints shipped inside the package: `builtin:NAME` model paths.

`builtin:demo` is the trained demo model (the K3.1 architecture at demo size, trained by
`python -m training.demo_model`; see `engine/builtin/demo/MODEL_CARD.md`). It is a real checkpoint
directory (config.json, safetensors with MXFP4 experts, tokenizer files), so everything that takes
a checkpoint directory takes it. Every model path of the engine accepts the name itself:
`load_model("builtin:demo")`, `parse_model_path`, `Tokenizer.for_model` (through `model_dir`).
"""

from __future__ import annotations

from pathlib import Path

from engine.errors import CheckpointError, ConfigError

PREFIX = "builtin:"
ROOT = Path(__file__).parent
NAMES = ("demo",)


def is_builtin(path: str | Path) -> bool:
    return str(path).startswith(PREFIX)


def resolve_builtin(path: str | Path) -> Path:
    """`builtin:demo` -> the shipped checkpoint directory; a clear error for unknown or missing ones."""
    text = str(path)
    if not text.startswith(PREFIX):
        raise ConfigError(f"{text!r} is not a builtin model path (expected {PREFIX}NAME)")
    name = text[len(PREFIX):]
    if name not in NAMES:
        raise ConfigError(f"unknown builtin model {name!r}; available: {', '.join(NAMES)}")
    d = ROOT / name
    if not (d / "config.json").exists():
        raise CheckpointError(f"builtin model {name!r} is not installed at {d} (train it with "
                              f"`python -m training.demo_model --out {d}`)")
    return d


def model_dir(path: str | Path) -> str | Path:
    """`builtin:NAME` -> its directory; any other model path unchanged (`preset:...`, a directory)."""
    return resolve_builtin(path) if is_builtin(path) else path
