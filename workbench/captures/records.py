"""Saved vLLM / SGLang responses -> `Record`s: token ids and the captured arrays, checked against the model.

What each engine returns (field names, layouts, where they are documented) is in docs/captures.md;
this module is the one place that knows those names. A record is one response as the user saved it,
or `{"request": {...}, "response": {...}}` when the token ids of the prompt are only in the request.

Every captured array covers a run of positions that ends where its tokens end: the last token a
response holds was never fed forward (the engine stopped after sampling it), so the routes of a
response cover positions [end - rows, end) with end = tokens - 1; vLLM's prompt array ends at the
prompt's end. Starting offsets (`routed_experts_start_len`, `routed_experts_prompt_start`) simply
give fewer rows, so the row count says where an array starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from engine.config import ModelConfig
from engine.errors import InputError
from engine.io.files import read_limited
from workbench.captures.arrays import RowArray, flat_array, npy_array
from workbench.captures.json_cost import check_json_cost

ENGINES = ("vllm", "sglang")
MAX_RESPONSES_BYTES = 16 << 30  # the responses file is parsed in memory; past this, split it per conversation


@dataclass(frozen=True)
class LayerMap:
    """Which entry of a captured array's layer axis is which of our layers (0-based, as in config.json).

    Attributes:
        family: "moe" (routed experts) or "dsa" (indexer top-k).
        axis: what the capture's layer axis counts: "hidden_layers" (every layer, entries of the other
            layers unused) or "moe_layers" / "dsa_layers" (only those, in ascending layer order).
        entries: axis entries read, aligned with `layers`.
        layers: our layer of each entry read.
    """

    family: str
    axis: str
    entries: tuple[int, ...]
    layers: tuple[int, ...]

    def to_json(self) -> dict:
        return {"axis": self.axis, "entries": list(self.entries), "layers": list(self.layers)}


def family_layers(config: ModelConfig, family: str) -> tuple[int, ...]:
    """Our layers that have the family's signal: MoE layers, or DSA (indexer) layers."""
    test = config.is_moe_layer if family == "moe" else config.is_dsa_layer
    return tuple(i for i in range(config.num_hidden_layers) if test(i))


def layer_choices(config: ModelConfig, family: str) -> tuple[int, ...]:
    """Layer-axis lengths a capture may have: every hidden layer, or only the family's layers."""
    return tuple(dict.fromkeys((config.num_hidden_layers, len(family_layers(config, family)))))


def layer_map(config: ModelConfig, family: str, axis_length: int) -> LayerMap:
    """Map a capture's layer axis onto our layers, explicitly; a length that fits neither reading is an error."""
    ours = family_layers(config, family)
    if axis_length == config.num_hidden_layers:
        return LayerMap(family, "hidden_layers", ours, ours)
    if axis_length == len(ours):
        return LayerMap(family, f"{family}_layers", tuple(range(len(ours))), ours)
    raise InputError(f"the captured {family} arrays have {axis_length} layers; the model config has "
                     f"{config.num_hidden_layers} layers of which {len(ours)} are {family.upper()} layers")


@dataclass
class Record:
    """One response: its token ids and its captured arrays (each covering positions [end - rows, end))."""

    number: int  # 1-based, as messages name it
    request_id: str | None
    prompt: np.ndarray
    output: np.ndarray
    routes: list[tuple[RowArray, int]] = field(default_factory=list)  # (array, end position)
    selections: list[tuple[RowArray, int]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.prompt) + len(self.output)


def read_responses(path: str | Path) -> list[tuple[int, Any]]:
    """(record number, parsed JSON) of a JSON file (one response or a list of them) or JSON Lines."""
    path = Path(path)
    data = read_limited(path, "a responses file", InputError, MAX_RESPONSES_BYTES)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text (byte {exc.start:,})") from None
    del data
    check_json_cost(text, str(path))  # what the parse would build, bounded before it builds it
    try:
        whole = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg != "Extra data":  # JSON Lines parse as one value followed by more
            raise InputError(f"{path}: not valid JSON or JSON Lines ({exc.msg} at line {exc.lineno})") from None
        whole = None
    except (RecursionError, ValueError) as exc:  # ValueError: a number Python will not parse
        raise InputError(f"{path}: not valid JSON ({str(exc)[:160]})") from None
    if whole is not None:
        items = whole if isinstance(whole, list) else [whole]
        return list(enumerate(items, 1))
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((len(out) + 1, json.loads(line)))
        except (json.JSONDecodeError, RecursionError, ValueError) as exc:
            raise InputError(f"{path}: line {lineno} is not valid JSON ({str(exc)[:160]})") from None
    if not out:
        raise InputError(f"{path}: no responses in the file")
    return out


def token_ids(value: Any, where: str, vocab_size: int, max_tokens: int | None = None) -> np.ndarray:
    """A JSON list of token ids -> int64 array; every id must be in the model's vocabulary, and the list
    no longer than `max_tokens` (the model's context: checked before the list is converted)."""
    if not isinstance(value, list):
        raise InputError(f"{where}: expected a list of token ids, got {type(value).__name__}")
    if max_tokens is not None and len(value) > max_tokens:
        raise InputError(f"{where}: {len(value):,} token ids, more than the model's context of {max_tokens:,}")
    bad = next((i for i, v in enumerate(value) if isinstance(v, bool) or not isinstance(v, int)), None)
    if bad is not None:
        raise InputError(f"{where}[{bad}]: token id {value[bad]!r:.80} is not an integer")
    ids = np.array([v if -1 <= v <= vocab_size else -1 for v in value], dtype=np.int64)
    out = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if len(out):
        raise InputError(f"{where}[{out[0]}]: token id {value[out[0]]} is outside the vocabulary [0, {vocab_size:,}) "
                         f"of the model config")
    return ids


def _ids(value: Any, where: str, config: ModelConfig) -> np.ndarray:
    """`token_ids` within the model's vocabulary and context."""
    return token_ids(value, where, config.vocab_size, config.max_position_embeddings)


def _object(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def _split(raw: Any, where: str) -> tuple[dict, dict]:
    """(request, response): a `{"request", "response"}` pair or a bare response."""
    raw = _object(raw, where)
    if isinstance(raw.get("response"), dict):
        return _object(raw.get("request") or {}, f"{where}.request"), raw["response"]
    return {}, raw


def _start(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InputError(f"{where}: expected a non-negative integer, got {value!r:.80}")
    return value


def parse_sglang(number: int, raw: Any, config: ModelConfig) -> Record:
    """An SGLang native `/generate` response (`output_ids`, `meta_info.routed_experts` / `indexer_topk`)."""
    where = f"record {number}"
    request, response = _split(raw, where)
    meta = response.get("meta_info")
    if not isinstance(meta, dict):
        raise InputError(f"{where}: no meta_info object: not an SGLang /generate response")
    output = _ids(response.get("output_ids"), f"{where}.output_ids", config)
    for source, key in ((response, "input_ids"), (response, "prompt_token_ids"), (request, "input_ids")):
        if key in source:
            prompt = _ids(source[key], f"{where}.{key}", config)
            break
    else:
        logprobs = meta.get("input_token_logprobs")
        if not isinstance(logprobs, list) or any(not isinstance(e, list) or len(e) < 2 for e in logprobs):
            raise InputError(f"{where}: no prompt token ids: save the request's input_ids beside the response "
                             f"(`input_ids`, or {{\"request\": ..., \"response\": ...}})")
        prompt = _ids([e[1] for e in logprobs], f"{where}.meta_info.input_token_logprobs", config)
    rec = Record(number, meta.get("id") if isinstance(meta.get("id"), str) else None, prompt, output)
    _check_length(rec, config, where)
    end = rec.total - 1
    if meta.get("routed_experts") is not None:
        start = _start(meta.get("routed_experts_start_len", request.get("routed_experts_start_len", 0)),
                       f"{where}.meta_info.routed_experts_start_len")
        if start > end:
            raise InputError(f"{where}: routed_experts_start_len {start} is past the {end} forwarded tokens")
        rec.routes.append((flat_array(meta["routed_experts"], meta.get("routed_experts_dtype"), end - start,
                                      layer_choices(config, "moe"), config.num_experts_per_token,
                                      config.num_experts - 1, "expert ids", f"{where}.meta_info.routed_experts"),
                           end))
    if meta.get("indexer_topk") is not None:
        _need_dsa(config, where)
        rec.selections.append((flat_array(meta["indexer_topk"], None, end, layer_choices(config, "dsa"),
                                          config.dsa.topk, max(end - 1, 0), "key positions",
                                          f"{where}.meta_info.indexer_topk"), end))
    return rec


def parse_vllm(number: int, raw: Any, config: ModelConfig) -> Record:
    """A vLLM chat or completion response (`prompt_token_ids`, `choices[0].token_ids`, `*routed_experts`)."""
    where = f"record {number}"
    request, response = _split(raw, where)
    choices = response.get("choices")
    if not isinstance(choices, list) or len(choices) != 1:
        n = len(choices) if isinstance(choices, list) else 0
        raise InputError(f"{where}: expected one choice (request n=1), got {n}: not a vLLM completion response, "
                         f"or several samples of one prompt (save one record per choice)")
    choice = _object(choices[0], f"{where}.choices[0]")
    for source, name in ((response, "prompt_token_ids"), (choice, "choices[0].prompt_token_ids"),
                         (request, "request.prompt_token_ids")):
        key = name.rsplit(".", 1)[-1]
        if source.get(key) is not None:
            prompt = _ids(source[key], f"{where}.{name}", config)
            break
    else:
        raise InputError(f"{where}: no prompt_token_ids: ask vLLM for them with \"return_token_ids\": true")
    if choice.get("token_ids") is None:
        raise InputError(f"{where}: no choices[0].token_ids: ask vLLM for them with \"return_token_ids\": true")
    output = _ids(choice["token_ids"], f"{where}.choices[0].token_ids", config)
    rec = Record(number, response.get("id") if isinstance(response.get("id"), str) else None, prompt, output)
    _check_length(rec, config, where)
    arrays: list[tuple[Any, int, str]] = [(response.get("prompt_routed_experts"), len(prompt), "prompt_routed_experts"),
                                          (choice.get("routed_experts"), rec.total - 1, "choices[0].routed_experts")]
    for text, end, name in arrays:
        if text is not None:
            array = npy_array(text, end, layer_choices(config, "moe"), config.num_experts_per_token,
                              config.num_experts - 1, "expert ids", f"{where}.{name}")
            rec.routes.append((array, end))
    return rec


def _check_length(rec: Record, config: ModelConfig, where: str) -> None:
    """A response's prompt and output fit the model's context (a server cannot have run more)."""
    if rec.total > config.max_position_embeddings:
        raise InputError(f"{where}: {len(rec.prompt):,} prompt and {len(rec.output):,} output tokens, more than "
                         f"the model's context of {config.max_position_embeddings:,} (wrong --model?)")


def _need_dsa(config: ModelConfig, where: str) -> None:
    if config.dsa is None:
        raise InputError(f"{where}: the capture holds indexer top-k but the model config has no DSA indexer layers "
                         f"(wrong --model?)")


PARSERS: dict[str, Callable[[int, Any, ModelConfig], Record]] = {"vllm": parse_vllm, "sglang": parse_sglang}


def parse_records(engine: str, path: str | Path, config: ModelConfig) -> list[Record]:
    """Every response of the file as a checked `Record` (shapes, dtypes, token ids; values are checked as read)."""
    if engine not in PARSERS:
        raise InputError(f"unknown capture engine {engine!r}; choose one of {', '.join(ENGINES)}")
    return [PARSERS[engine](number, raw, config) for number, raw in read_responses(path)]
