"""K3 Workbench engine: runs Kimi K3.1 / K3 / Kimi-Linear from their real checkpoint format.

Public entry points:
- `load_model(path, *, device, dtype, seed)`: a checkpoint directory or `preset:NAME[:VARIANT]`.
- `ModelConfig`, `load_config`, `parse_config`, `config_to_hf`, `get_preset`: the configuration.
- `Session`: a growing context with chunked prefill, streaming decode and snapshots.
- error types: `EngineError` and its `ConfigError`, `CheckpointError`, `InputError`.

Names are imported lazily, so `import engine.errors` (e.g. by trace readers) does not pull in torch.
"""

from __future__ import annotations

from engine.lazy import lazy_attributes

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


__getattr__ = lazy_attributes(__name__, _EXPORTS, globals())
