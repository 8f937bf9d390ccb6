"""The transformers config of a K3 / K3.1 / Kimi-Linear checkpoint: its config.json, kept whole.

`K3Config` (model_type `k3_workbench`) carries the checkpoint's own `config.json` as
`checkpoint_config` and answers what transformers asks of any causal-LM config (vocabulary, width,
depth, special ids) from the engine's parse of it (`engine.config_io.parse_config`), so there is one
reading of the file. `K3CheckpointConfig` is the same class under the checkpoint's top-level
model_type `kimi_k3`, so `AutoConfig` / `AutoModelForCausalLM.from_pretrained(dir)` recognise a K3.1
directory as it is written; it is registered only while transformers has no `kimi_k3` of its own.
A flat Kimi-Linear directory (model_type `kimi_linear`) stays transformers' own model under the
auto classes; `engine.hf.K3ForCausalLM.from_pretrained(dir)` loads it through the engine.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedConfig

from engine.config import ModelConfig
from engine.config_io import parse_config
from engine.errors import ConfigError

MODEL_TYPE = "k3_workbench"
CHECKPOINT_MODEL_TYPE = "kimi_k3"
# one forward runs at most this many tokens at a time (the session's prefill chunk): memory stays
# bounded at any prompt length and the logits are those of a chunked prefill
DEFAULT_PREFILL_CHUNK = 2048


class K3Config(PreTrainedConfig):
    """Attributes:
        checkpoint_config (dict): the checkpoint's config.json as written (K3.1 nested or Kimi-Linear flat).
        prefill_chunk (int): tokens per engine forward inside one `K3ForCausalLM.forward` call.
    """

    model_type = MODEL_TYPE

    def __init__(self, checkpoint_config: dict[str, Any] | None = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, use_cache: bool = True, **kwargs: Any) -> None:
        if checkpoint_config is not None and not isinstance(checkpoint_config, dict):
            raise ConfigError(f"checkpoint_config must be a config.json object, got {type(checkpoint_config).__name__}")
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be an integer >= 1, got {prefill_chunk!r:.40}")
        self.checkpoint_config = dict(checkpoint_config or {})
        self.prefill_chunk = prefill_chunk
        if self.checkpoint_config:
            engine = self.engine_config()
            kwargs.setdefault("vocab_size", engine.vocab_size)
            kwargs.setdefault("hidden_size", engine.hidden_size)
            kwargs.setdefault("num_hidden_layers", engine.num_hidden_layers)
            kwargs.setdefault("max_position_embeddings", engine.max_position_embeddings)
            for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
                kwargs.setdefault(name, engine.special_token_id(name))
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
        self.use_cache = bool(use_cache)  # set after: transformers' base config no longer keeps it

    def engine_config(self) -> ModelConfig:
        """The engine's parse of `checkpoint_config` (ConfigError naming the field when it is wrong)."""
        if not self.checkpoint_config:
            raise ConfigError("this K3Config holds no checkpoint config.json (checkpoint_config is empty)")
        return parse_config(self.checkpoint_config)

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        """Our saved form (`checkpoint_config` inside) or a checkpoint's own config.json (wrapped whole).
        Built through `__init__`, which derives the causal-LM fields from the checkpoint's config."""
        config_dict = dict(config_dict)
        if "checkpoint_config" not in config_dict:
            config_dict = {"checkpoint_config": config_dict}
        config_dict.pop("model_type", None)
        return_unused = kwargs.pop("return_unused_kwargs", False)
        config = cls(**config_dict)
        unused = {}
        for key, value in kwargs.items():
            if hasattr(config, key):
                setattr(config, key, value)
            else:
                unused[key] = value
        return (config, unused) if return_unused else config


class K3CheckpointConfig(K3Config):
    """`K3Config` under a K3.1 checkpoint's own top-level model_type (`kimi_k3`)."""

    model_type = CHECKPOINT_MODEL_TYPE

    # transformers makes a config subclass without an __init__ of its own a dataclass with a generated
    # one; this keeps K3Config's
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
