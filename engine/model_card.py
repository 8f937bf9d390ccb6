"""A checkpoint's own description, read in one place beside the model-reference resolver.

A checkpoint directory may ship, next to its weights, what it says about itself:
- `generation_config.json`: the sampling defaults (`do_sample: false` means greedy; `temperature`,
  `max_new_tokens`), as transformers writes it;
- `prompting.json`: the task templates it was trained on (`tasks`) and one line on what it can and
  cannot answer (`notice`);
- `training.json`: how it was trained; its `answer_style` says how its answers restate a fact
  (`key`: "key: value"; `span`: the document's words from the key through the value).

`card_of(model)` reads the first two, `answer_style_of(model)` the third, for a checkpoint directory,
`builtin:NAME` or `preset:...` (random weights: temperature 1.0, any prompt, no notice, style "key").
Missing files mean those defaults; a file that is too large, not JSON or holds wrong fields is a
`CheckpointError` naming it (a checkpoint may come from anyone). `card_files(...)` writes the first two.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from engine.errors import CheckpointError
from engine.io.files import parse_json, read_limited
from engine.model_ref import ModelRef, parse_model_ref

# the task templates a card may name (`workbench.task_templates` builds them)
CARD_TASKS = ("free-form", "find-fact", "picture")
# how a trained model restates a fact (`workbench.retrieval_text.answer_parts`)
ANSWER_STYLES = ("key", "span")
# the card files are a few hundred bytes; anything far larger is not one
_CARD_FILE_LIMIT = 64 << 10
_TRAINING_FILE_LIMIT = 1 << 20
NOTICE_LIMIT = 400
DEFAULT_MAX_NEW_TOKENS = 128


@dataclass(frozen=True)
class ModelCard:
    """What a checkpoint says about prompting it."""

    model: str
    temperature: float        # default sampling temperature (0.0 = greedy)
    max_new_tokens: int
    tasks: tuple[str, ...]    # task templates it was trained on; () = any prompt
    notice: str               # one line: what it can and cannot answer ("" when none)


def card_of(model: "str | Path | ModelRef") -> ModelCard:
    """The prompting card of a model reference (see the module docstring)."""
    ref = parse_model_ref(model)
    card = ModelCard(ref.text, 1.0, DEFAULT_MAX_NEW_TOKENS, (), "")
    root = ref.directory
    if root is None:
        return card
    gen = _card_json(root / "generation_config.json", "a generation_config.json", _CARD_FILE_LIMIT)
    prompting = _card_json(root / "prompting.json", "a prompting.json", _CARD_FILE_LIMIT)
    temperature, max_new = card.temperature, card.max_new_tokens
    if gen is not None:
        source = root / "generation_config.json"
        if gen.get("do_sample") is False:
            temperature = 0.0
        elif "temperature" in gen:
            temperature = _number(gen["temperature"], source, "temperature", 0.0, 100.0)
        if "max_new_tokens" in gen:
            max_new = int(_number(gen["max_new_tokens"], source, "max_new_tokens", 1, 1 << 20, integer=True))
    tasks: tuple[str, ...] = ()
    notice = ""
    if prompting is not None:
        source = root / "prompting.json"
        raw_tasks = prompting.get("tasks", [])
        if not isinstance(raw_tasks, list) or any(t not in CARD_TASKS for t in raw_tasks):
            raise CheckpointError(f"{source}: tasks must be a list of {', '.join(CARD_TASKS)}; got "
                                  f"{str(raw_tasks)[:120]}")
        tasks = tuple(raw_tasks)
        notice = prompting.get("notice", "")
        if not isinstance(notice, str) or "\n" in notice or len(notice) > NOTICE_LIMIT:
            raise CheckpointError(f"{source}: notice must be one line of at most {NOTICE_LIMIT} characters")
    return ModelCard(ref.text, temperature, max_new, tasks, notice)


def answer_style_of(model: "str | Path | ModelRef") -> str:
    """The answer style a checkpoint was trained to (its `training.json`'s `answer_style`; "key" when it
    has no such file or field, as every checkpoint before the style existed). A training.json that is
    not a JSON object or names an unknown style is a CheckpointError naming the file."""
    root = parse_model_ref(model).directory
    if root is None:
        return "key"
    info = root / "training.json"
    data = _card_json(info, "a training.json", _TRAINING_FILE_LIMIT, must_be_object=False)
    if data is None:
        return "key"
    style = data.get("answer_style", "key") if isinstance(data, dict) else None
    if style not in ANSWER_STYLES:
        raise CheckpointError(f"{info}: answer_style must be one of {ANSWER_STYLES}, got {style!r:.40}")
    return style


def card_files(tasks: Sequence[str], notice: str, *, temperature: float = 0.0,
               max_new_tokens: int = 48) -> dict[str, dict]:
    """The two card files (file name -> JSON object) a trained checkpoint ships, so that `card_of` reads
    back `temperature`, `max_new_tokens`, `tasks` and `notice`."""
    return {"generation_config.json": {"do_sample": temperature > 0, "temperature": temperature,
                                       "max_new_tokens": max_new_tokens},
            "prompting.json": {"tasks": list(tasks), "notice": notice}}


def _card_json(path: Path, what: str, limit: int, *, must_be_object: bool = True) -> Any:
    if not path.exists() and not path.is_symlink():
        return None
    data = parse_json(read_limited(path, what, CheckpointError, limit), str(path), CheckpointError)
    if must_be_object and not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _number(value: Any, source: Path, field: str, lo: float, hi: float, integer: bool = False) -> float:
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not lo <= value <= hi:
        kind = "an integer" if integer else "a number"
        raise CheckpointError(f"{source}: {field} must be {kind} in [{lo:g}, {hi:g}], got {value!r:.40}")
    return value


__all__ = ["ANSWER_STYLES", "CARD_TASKS", "ModelCard", "answer_style_of", "card_files", "card_of"]
