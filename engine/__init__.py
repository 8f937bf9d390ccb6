"""K3 Workbench engine: runs Kimi K3.1 / K3 / Kimi-Linear from their real checkpoint format.

Public entry points:
- `load_model(path, *, device, dtype, seed)`: a checkpoint directory or `preset:NAME[:VARIANT]`.
- `ModelConfig`, `load_config`, `parse_config`, `config_to_hf`, `get_preset`: the configuration.
- `Session`: a growing context with chunked prefill, streaming decode and snapshots.
- error types: `EngineError` and its `ConfigError`, `CheckpointError`, `InputError`.

Names are imported lazily, so `import engine.errors` (e.g. by trace readers) does not pull in torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CheckpointError": "engine.errors", "ConfigError": "engine.errors", "EngineError": "engine.errors",
    "InputError": "engine.errors",
    "DSAConfig": "engine.config", "ModelConfig": "engine.config", "VisionConfig": "engine.config",
    "config_to_hf": "engine.config_io", "load_config": "engine.config_io", "parse_config": "engine.config_io",
    "get_preset": "engine.presets",
    "load_model": "engine.weights.load",
    "Session": "engine.session",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
