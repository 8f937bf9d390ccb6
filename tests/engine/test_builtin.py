"""`builtin:NAME` resolution: the shipped directory, or errors that name the problem."""

from __future__ import annotations

import pytest

from engine.builtin import ROOT, is_builtin, resolve_builtin
from engine.errors import CheckpointError, ConfigError


def test_builtin_paths() -> None:
    assert is_builtin("builtin:demo") and not is_builtin("preset:demo")
    with pytest.raises(ConfigError, match="unknown builtin model 'nope'"):
        resolve_builtin("builtin:nope")
    with pytest.raises(ConfigError, match="not a builtin"):
        resolve_builtin("checkpoints/demo")
    if (ROOT / "demo" / "config.json").exists():
        assert resolve_builtin("builtin:demo") == ROOT / "demo"
    else:
        with pytest.raises(CheckpointError, match="not installed"):
            resolve_builtin("builtin:demo")
