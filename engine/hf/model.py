"""`K3ForCausalLM`: the engine's model behind transformers' `PreTrainedModel` + `GenerationMixin`.

The module tree is the engine's own (`model.*`, `lm_head`, `vision`): the engine's `KimiForCausalLM`
is built or loaded by the engine (`engine.weights.load.load_model`: MXFP4 experts, stacked expert
names, `builtin:` references), and its children are registered here, so parameter names equal the
checkpoint's and every hook point is `model.get_submodule("model.layers.3.hook_resid_post")`.

`forward` runs the prompt `config.prefill_chunk` tokens at a time through an engine `ModelState`
(bounded memory at any length; the logits of the session's chunked prefill) and returns the state
as a `K3Cache`, so `generate` feeds one token per step and never prefills again. Decoding is the
engine's eager forward, which is what a `Session` runs on the CPU (`--compile auto`).

One unpadded sequence per call: a batch of more than one row, a padded attention mask, a mask or
position ids that disagree with the cache, and `inputs_embeds` are refused in words.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from engine.builtin import model_dir
from engine.cache import KDAState, ModelState
from engine.errors import CheckpointError, InputError
from engine.hf.cache import K3Cache
from engine.hf.config import K3CheckpointConfig, K3Config
from engine.io.files import parse_json, read_limited
from engine.model import KimiForCausalLM
from engine.tokenizer import Tokenizer
from engine.weights.load import fill, load_model
from engine.weights.meta import on_meta
from engine.weights.random_init import RandomSource

_MAX_CONFIG_BYTES = 16 << 20
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64, "auto": torch.float32}


def _dtype_of(value: Any) -> torch.dtype:
    if value is None:
        return torch.float32
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.removeprefix("torch.")]
    raise InputError(f"dtype {value!r:.40} is not one of {', '.join(sorted(_DTYPES))} or a torch.dtype")


def _checkpoint_json(directory: Path) -> dict[str, Any]:
    file = directory / "config.json"
    raw = parse_json(read_limited(file, "a config.json", CheckpointError, _MAX_CONFIG_BYTES), str(file), CheckpointError)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file}: expected a JSON object at the top level")
    return raw


def resolve_directory(path: str | os.PathLike[str]) -> Path:
    """A local checkpoint directory (or `builtin:NAME`) holding config.json; InputError otherwise."""
    if not isinstance(path, (str, os.PathLike)):
        raise InputError(f"a checkpoint must be named by a path or builtin:NAME, got {type(path).__name__}")
    directory = Path(model_dir(os.fspath(path)))
    if directory.is_file() and directory.name == "config.json":
        directory = directory.parent
    if not (directory / "config.json").is_file():
        raise InputError(f"{os.fspath(path)!r:.200}: not a checkpoint directory (no config.json there); "
                         "K3ForCausalLM loads local directories and builtin:NAME, never from a hub")
    return directory


class K3ForCausalLM(PreTrainedModel, GenerationMixin):
    """A K3 / K3.1 / Kimi-Linear checkpoint as a transformers causal LM (module names = the engine's).

    Attributes:
        engine_model (KimiForCausalLM): the engine's model whose children this module holds.
    """

    config_class = K3Config
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["DecoderLayer"]
    supports_gradient_checkpointing = False

    def __init__(self, config: K3Config, engine_model: KimiForCausalLM | None = None) -> None:
        super().__init__(config)
        if engine_model is None:
            # no checkpoint: the engine's seeded random weights (what `preset:` references run), never
            # transformers' initialisers, which know nothing of the AttnRes or KDA parameters
            engine_config = config.engine_config()
            with on_meta():
                engine_model = KimiForCausalLM(engine_config)
            engine_model.to_empty(device="cpu")
            fill(engine_model, RandomSource(engine_config, 0), torch.float32, progress=False)
            engine_model.eval().requires_grad_(False)
        # the engine's children become ours (one copy of every parameter, the checkpoint's names); the
        # engine object is kept off the module tree and runs the forward over those same modules
        object.__setattr__(self, "engine_model", engine_model)
        for name, child in engine_model.named_children():
            self.add_module(name, child)
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Weights come from a checkpoint or the engine's random source; transformers initialises nothing."""

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike[str], *model_args: Any,
                        config: K3Config | None = None, **kwargs: Any) -> "K3ForCausalLM":
        """Load a local checkpoint directory or `builtin:NAME` through the engine's loader.

        Args:
            pretrained_model_name_or_path: the directory (K3.1 `kimi_k3`, K3, or flat `kimi_linear`).
            config (K3Config, Optional): what `AutoModelForCausalLM` passes; default read from the directory.
            dtype / torch_dtype: the compute dtype (default float32; `auto` is float32).
            device_map: a single device (`"cpu"`, `"cuda:0"`); dict maps are refused.
            prefill_chunk: tokens per engine forward inside one call (default 2048).
        """
        directory = resolve_directory(pretrained_model_name_or_path)
        dtype = _dtype_of(kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None))
        device = kwargs.pop("device_map", None) or kwargs.pop("device", None) or "cpu"
        if isinstance(device, dict):
            raise InputError("device_map must name one device: K3ForCausalLM does not split a model over devices "
                             "(the engine's tensor parallelism does, engine.parallel)")
        prefill_chunk = kwargs.pop("prefill_chunk", None)
        if config is None:
            config = K3Config(checkpoint_config=_checkpoint_json(directory))
        elif not isinstance(config, K3Config):
            raise InputError(f"config must be a K3Config, got {type(config).__name__}")
        if prefill_chunk is not None:
            config.prefill_chunk = K3Config(prefill_chunk=prefill_chunk).prefill_chunk
        config._name_or_path = str(directory)
        engine_model = load_model(directory, dtype=dtype, device=device)
        model = cls(config, engine_model=engine_model)
        model.generation_config = _generation_config(config, directory)
        return model

    def save_pretrained(self, save_directory: str | os.PathLike[str], *args: Any, **kwargs: Any) -> None:
        """Refused: a checkpoint is the engine's directory format (MXFP4 experts, the K3.1 config.json), which
        transformers' writer does not produce; copy the checkpoint directory the model was loaded from."""
        raise InputError("K3ForCausalLM does not write checkpoints: copy the directory it was loaded from "
                         f"({self.config._name_or_path or 'none: random weights'}), or write one with "
                         "`workbench checkpoint` (engine.weights.write)")

    def new_cache(self) -> K3Cache:
        """An empty cache for one sequence, on the model's device and in its dtype."""
        param = next(self.parameters())
        return K3Cache(self.engine_model.empty_state(1, dtype=param.dtype, device=param.device))

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                cache: K3Cache | None = None, use_cache: bool | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.LongTensor | None = None,
                position_ids: torch.LongTensor | None = None, output_hidden_states: bool | None = None,
                logits_to_keep: int = 0, return_dict: bool | None = None,
                **kwargs: Any) -> CausalLMOutputWithPast:
        """input_ids `[1, T]` after `cache`'s tokens -> logits `[1, T, vocab]` (or the last `logits_to_keep`).

        `hidden_states` (with `output_hidden_states`): the embeddings, then each layer's output P (the
        prefix sum; with AttnRes the head reads a mix of P and the blocks, docs/hooks.md).
        `labels`: the usual shifted cross-entropy (-100 ignored) as `loss`.
        """
        if inputs_embeds is not None:
            raise InputError("K3ForCausalLM takes input_ids, not inputs_embeds (use the engine's "
                             "KimiForCausalLM(inputs_embeds=...) for embeddings)")
        if input_ids is None:
            raise InputError("input_ids are required: [1, tokens] token ids")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise InputError(f"input_ids must be a [batch, tokens] tensor, got "
                             f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__}")
        if input_ids.shape[0] != 1:
            raise InputError(f"K3ForCausalLM runs one sequence per call, got a batch of {input_ids.shape[0]}: loop "
                             "over the sequences (or use engine.session.batch.BatchSession for padded batches)")
        if cache is not None and not isinstance(cache, K3Cache):
            if cache.get_seq_length() != 0:
                raise InputError(f"cache must be a K3Cache (model.new_cache()), got a filled {type(cache).__name__}")
            cache = None  # an empty cache of another kind (made by a caller for any model): ours replaces it
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if cache is None:
            cache = self.new_cache()
        past = cache.get_seq_length()
        n = input_ids.shape[1]
        _check_mask(attention_mask, past, n)
        if position_ids is not None:
            expected = torch.arange(past, past + n, device=position_ids.device)
            if position_ids.numel() != n or not torch.equal(position_ids.reshape(-1), expected):
                raise InputError(f"position_ids must be {past}..{past + n - 1} (the cache holds {past} tokens); "
                                 "K3ForCausalLM places tokens after its cache and has no other positions")
        input_ids = input_ids.to(next(self.parameters()).device)
        keep = int(logits_to_keep) if isinstance(logits_to_keep, int) else 0
        logits, hidden = self._run(input_ids, cache.state, last_only=keep == 1,
                                   with_hidden=bool(output_hidden_states))
        if keep > 1:
            logits = logits[:, -keep:]
        loss = None
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise InputError(f"labels have shape {tuple(labels.shape)}, input_ids {tuple(input_ids.shape)}")
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1).to(logits.device), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache if use_cache else None,
                                      hidden_states=hidden)

    def _run(self, input_ids: torch.Tensor, state: ModelState, *, last_only: bool,
             with_hidden: bool) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """The engine's forward over `input_ids` in chunks of `prefill_chunk`, advancing `state` after each
        chunk (as `Session._forward` does); on an error every KDA state and the length are put back."""
        chunk = self.config.prefill_chunk
        kda = [s for s in state.layers if isinstance(s, KDAState)]
        saved = [(s.recurrent, s.conv) for s in kda]  # layers rebind, never mutate: cheap rollback
        length = state.length
        pieces: list[torch.Tensor] = []
        layer_pieces: list[list[torch.Tensor]] = []
        n = input_ids.shape[1]
        try:
            for s in range(0, n, chunk):
                ids = input_ids[:, s:s + chunk]
                outputs: list[torch.Tensor] | None = [] if with_hidden else None
                skipped = last_only and s + chunk < n  # only the last chunk's last row is wanted
                logits = self.engine_model(ids, state, last_only=last_only, layer_outputs=outputs)
                state.length += ids.shape[1]
                if not skipped:
                    pieces.append(logits)
                if outputs is not None:
                    layer_pieces.append(outputs)
        except BaseException:
            for s_, (rec, conv) in zip(kda, saved):
                s_.recurrent, s_.conv = rec, conv
            state.length = length
            raise
        logits = pieces[-1] if last_only else torch.cat(pieces, dim=1)
        hidden = None
        if with_hidden:
            embeds = self.model.embed_tokens(input_ids)
            per_layer = [torch.cat([p[i] for p in layer_pieces], dim=1) for i in range(len(layer_pieces[0]))]
            hidden = (embeds, *per_layer)
        return logits, hidden

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, next_sequence_length: int | None = None,
                                      cache: K3Cache | None = None, attention_mask: torch.Tensor | None = None,
                                      inputs_embeds: torch.Tensor | None = None, **kwargs: Any) -> dict[str, Any]:
        """The tokens the cache has not consumed (all of them on the first step, then the newest one)."""
        if inputs_embeds is not None:
            raise InputError("K3ForCausalLM generates from input_ids, not inputs_embeds")
        done = 0 if cache is None else cache.get_seq_length()
        if input_ids.shape[1] <= done:
            raise InputError(f"the cache already holds {done} tokens but only {input_ids.shape[1]} input ids were "
                             "given: pass the whole sequence (the cache's tokens and the new ones)")
        inputs = {k: v for k, v in kwargs.items()
                  if k not in ("labels", "next_sequence_length", "position_ids", "is_first_iteration")}
        inputs.update(input_ids=input_ids[:, done:], cache=cache, attention_mask=attention_mask)
        return inputs

    def _prepare_cache_for_generation(self, generation_config: GenerationConfig, model_kwargs: dict[str, Any],
                                      *args: Any, **kwargs: Any) -> None:
        """generate's cache is always a `K3Cache` (a caller's filled one continues that sequence)."""
        cache = model_kwargs.get("cache")
        if generation_config.num_beams != 1 or generation_config.num_return_sequences != 1:
            raise InputError("K3ForCausalLM generates one sequence: num_beams and num_return_sequences must be 1")
        if cache is not None and not isinstance(cache, K3Cache):
            raise InputError(f"cache must be a K3Cache (model.new_cache()), got {type(cache).__name__}")
        if cache is None and generation_config.use_cache is not False:
            model_kwargs["cache"] = self.new_cache()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False


def _check_mask(mask: torch.Tensor | None, past: int, n: int) -> None:
    """A mask is accepted when it marks every token real: [1, n] (the new tokens) or [1, past + n]."""
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[0] != 1:
        raise InputError(f"attention_mask must be [1, tokens], got "
                         f"{tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__}")
    if mask.shape[1] not in (n, past + n):
        raise InputError(f"attention_mask covers {mask.shape[1]} tokens; the call has {n} new tokens after "
                         f"{past} cached ones")
    if not bool((mask != 0).all()):
        raise InputError("attention_mask has padding (zeros): K3ForCausalLM runs one unpadded sequence; strip "
                         "the padding (engine.session.batch.BatchSession runs left-padded batches)")


def _generation_config(config: K3Config, directory: Path) -> GenerationConfig:
    """Greedy by default with the checkpoint's special ids; the tokenizer's reserved placeholder ids are
    never generated, as a `Session` never samples them (so greedy ids equal `workbench run`'s)."""
    tokenizer = Tokenizer.for_model(directory, config.vocab_size)
    suppress = sorted(i for i in (tokenizer.reserved_ids if tokenizer else ()) if i < config.vocab_size)
    settings: dict[str, Any] = {}
    card = directory / "generation_config.json"
    if card.is_file():
        raw = parse_json(read_limited(card, "a generation_config.json", CheckpointError, _MAX_CONFIG_BYTES), str(card),
                         CheckpointError)
        if isinstance(raw, dict) and isinstance(raw.get("max_new_tokens"), int):
            settings["max_new_tokens"] = raw["max_new_tokens"]
    eos = config.eos_token_id
    return GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=eos,
                            pad_token_id=config.pad_token_id if config.pad_token_id is not None else eos,
                            do_sample=False, suppress_tokens=suppress or None, **settings)


class K3CheckpointForCausalLM(K3ForCausalLM):
    """`K3ForCausalLM` for a config read as a K3.1 checkpoint's own `kimi_k3` (transformers pairs each auto
    config class with one model class; this is the same model)."""

    config_class = K3CheckpointConfig
