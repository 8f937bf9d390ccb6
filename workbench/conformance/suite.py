"""The prompts a conformance run sends: a user's file, or the suite built to trigger known failure classes.

`--prompts FILE`: a JSON list whose items are strings or OpenAI message lists (checked here).

`long_context_suite(tokenizer)`: the failure classes of hybrid linear-attention deployments, each an item:
- `single`: prompts whose lengths cross the prefill chunk boundaries (and the KDA chunk size) at odd
  offsets, up to a long context;
- `follow-up`: a second turn built from a first request's reply, so the server restores its cached
  prefix at an odd length (the first prompt plus its reply, all but the last token in the state);
- `repeat`: a prompt sent again, which must give identical ids and log-probabilities (run to run);
- `concurrent`: prompts sent all at once, each of which must give exactly its serial reply.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from engine.errors import InputError

MAX_PROMPTS = 1000
KINDS = ("single", "repeat", "follow-up", "concurrent")


@dataclass(frozen=True)
class SuiteItem:
    """One request of a run: its prompt, its kind, and the item it repeats or follows (`of`)."""

    prompt: Any
    kind: str = "single"
    of: int | None = None


def as_items(prompts: Sequence[Any]) -> list[SuiteItem]:
    """Plain prompts become `single` items; the references between items are checked."""
    items = [p if isinstance(p, SuiteItem) else SuiteItem(p) for p in prompts]
    for i, item in enumerate(items):
        if item.kind not in KINDS:
            raise InputError(f"prompt {i}: unknown kind {item.kind!r}; kinds are {', '.join(KINDS)}")
        if item.kind != "single" and (item.of is None or not 0 <= item.of < i):
            raise InputError(f"prompt {i} ({item.kind}) must name an earlier prompt it repeats or follows")
    return items


def messages_of(prompt: Any) -> list[dict]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def read_prompts(path: str | Path) -> list[Any]:
    """`--prompts FILE`: a JSON list whose items are strings or OpenAI message lists (checked)."""
    from engine.io.files import parse_json, read_limited

    raw = parse_json(read_limited(Path(path), "a prompts file", InputError, 64 << 20), str(path), InputError)
    if not isinstance(raw, list) or not raw or len(raw) > MAX_PROMPTS:
        raise InputError(f"{path}: expected a JSON list of 1 to {MAX_PROMPTS} prompts (strings or message lists)")
    for i, item in enumerate(raw):
        if not (isinstance(item, str) and item) and not (isinstance(item, list) and item):
            raise InputError(f"{path}: prompt {i} must be a non-empty string or a list of messages")
    return raw


def _text(words: int) -> str:
    vocab = "the quick brown fox jumps over the lazy dog while a needle waits in the hay ".split()
    return " ".join(vocab[i % len(vocab)] for i in range(words))


def long_context_suite(tokenizer: Any = None, *, lengths: Sequence[int] = (100, 509, 1031, 2053),
                       concurrent: int = 2) -> list[SuiteItem]:
    """The suite (see the module docstring). `lengths` are in words (about a token each here): the
    defaults cross the 64-token KDA chunks and the 2,048-token prefill chunk at odd offsets."""
    items = [SuiteItem(f"{_text(n)}\nWhat waits in the hay?") for n in lengths]
    items.append(SuiteItem("Where does it wait?", "follow-up", 0))   # restores prompt 0 + its reply
    items.append(SuiteItem(items[min(1, len(lengths) - 1)].prompt, "repeat", min(1, len(lengths) - 1)))
    for i in range(min(concurrent, len(lengths))):
        items.append(SuiteItem(items[i].prompt, "concurrent", i))
    return items


__all__ = ["KINDS", "MAX_PROMPTS", "SuiteItem", "as_items", "long_context_suite", "messages_of", "read_prompts"]
