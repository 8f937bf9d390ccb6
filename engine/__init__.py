"""K3 Workbench engine: runs Kimi K3.1 / K3 / Kimi-Linear from their real checkpoint format.

Public entry points:
- `load_model(path, *, device, dtype, seed)`: a checkpoint directory or `preset:NAME[:VARIANT]`.
- `ModelConfig`, `load_config`, `parse_config`, `get_preset`: the configuration.
"""

from engine.config import DSAConfig, ModelConfig, VisionConfig
from engine.config_io import config_to_hf, load_config, parse_config
from engine.errors import CheckpointError, ConfigError, EngineError, InputError
from engine.presets import get_preset
from engine.weights.load import load_model

__all__ = [
    "CheckpointError", "ConfigError", "DSAConfig", "EngineError", "InputError", "ModelConfig",
    "VisionConfig", "config_to_hf", "get_preset", "load_config", "load_model", "parse_config",
]
