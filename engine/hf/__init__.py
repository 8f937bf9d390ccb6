"""transformers, nnsight and ContextCite on the engine's model (the `hf` extra).

`import engine.hf` registers the K3 model with transformers' own auto classes:

- `AutoConfig` / `AutoModelForCausalLM` know model_type `k3_workbench` (`K3Config`, `K3ForCausalLM`)
  and, while transformers has no `kimi_k3` of its own, a K3.1 checkpoint's top-level `kimi_k3`, so
  `AutoModelForCausalLM.from_pretrained(dir)` loads a K3.1 directory (or `builtin:demo`'s) as written.
- A flat Kimi-Linear directory (`kimi_linear`) stays transformers' own `KimiLinearForCausalLM` under
  the auto classes; `K3ForCausalLM.from_pretrained(dir)` loads it through the engine.

`K3Tokenizer.from_pretrained(dir)` wraps `engine.tokenizer.Tokenizer` as a transformers tokenizer (the
K3 chat template, the model's eos, char offsets). It is not registered with `AutoTokenizer`: a
checkpoint's tokenizer_config.json names its own `tokenizer_class` (TikTokenTokenizer), from which
transformers builds a converted tokenizer with the same text ids but no chat template and `[EOS]` as eos.
`engine.hf.context_cite` runs ContextCite with a sentence splitter of our own. The engine
never needs this package: nothing outside it imports transformers' model classes.
"""

from __future__ import annotations

from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from engine.hf.cache import K3Cache
from engine.hf.config import CHECKPOINT_MODEL_TYPE, MODEL_TYPE, K3CheckpointConfig, K3Config
from engine.hf.model import K3CheckpointForCausalLM, K3ForCausalLM
from engine.hf.tokenizer import K3Tokenizer


def _register() -> None:
    """Register once per process (a second `import engine.hf` after a reload must not raise)."""
    if MODEL_TYPE not in CONFIG_MAPPING:
        AutoConfig.register(MODEL_TYPE, K3Config)
        AutoModelForCausalLM.register(K3Config, K3ForCausalLM)
    if CHECKPOINT_MODEL_TYPE not in CONFIG_MAPPING:  # never shadow a kimi_k3 transformers ships itself
        AutoConfig.register(CHECKPOINT_MODEL_TYPE, K3CheckpointConfig)
        AutoModelForCausalLM.register(K3CheckpointConfig, K3CheckpointForCausalLM)


_register()

__all__ = ["K3Cache", "K3Config", "K3CheckpointConfig", "K3CheckpointForCausalLM", "K3ForCausalLM", "K3Tokenizer"]
