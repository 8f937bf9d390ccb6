"""Filler documents for long-context experiments: `haystack()` text and `plant()` a needle in it.

Notebooks, benchmarks and tests need long documents that read like prose, never repeat exactly and
come out the same for the same seed. Token counts are measured with the caller's tokenizer (anything
with `.encode(str) -> list[int]`, or that function itself), so the length holds for any vocabulary.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

_WHO = ["The inspector", "A technician", "The night shift", "Our survey team", "The archivist"]
_DID = ["recorded", "measured", "noted", "replaced", "catalogued"]
_WHAT = ["the pressure in valve {n}", "{n} crates of spare parts", "the drift of sensor {n}", "shelf {n}"]


def _encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    encode = getattr(tokenizer, "encode", tokenizer)
    if not callable(encode):
        raise TypeError(f"need a tokenizer with .encode(text) or an encode function, got {type(tokenizer).__name__}")
    return encode


def haystack(n_tokens: int, tokenizer: Any, seed: int = 0, topic: str = "harbour") -> str:
    """Plausible filler text of at least `n_tokens` tokens (varied sentences, nothing repeats exactly).

    Args:
        n_tokens (int): tokens wanted (the text stops at the first sentence that reaches them).
        tokenizer: an object with `.encode(text) -> list[int]`, or such a function.
        seed (int): the same seed gives the same text.
        topic (str): the word the sentences are about ("The inspector of the harbour noted ...").
    """
    encode = _encoder(tokenizer)
    rng = random.Random(seed)
    parts, size = [], 0
    while size < n_tokens:
        s = f"{rng.choice(_WHO)} of the {topic} {rng.choice(_DID)} {rng.choice(_WHAT).format(n=rng.randint(2, 999))}. "
        parts.append(s)
        size += len(encode(s))
    return "".join(parts)


def filler_ids(n_tokens: int, tokenizer: Any, seed: int = 0, topic: str = "harbour") -> list[int]:
    """Exactly `n_tokens` token ids of `haystack` text (for benchmarks that feed ids directly)."""
    ids = list(_encoder(tokenizer)(haystack(n_tokens, tokenizer, seed=seed, topic=topic)))
    return ids[:n_tokens]


@dataclass(frozen=True)
class PlantedDocument:
    """A haystack with a needle inside: `text` = before + needle + " " + after.

    `needle_tokens` is the needle's token range [start, end) counted from the document's first token,
    assuming the tokenizer encodes the pieces as it encodes the whole (true for byte-level tokenizers;
    check with `len(encode(text))` for others).
    """

    text: str
    before: str
    needle: str
    after: str
    needle_tokens: tuple[int, int]


def plant(needle: str, n_tokens: int, tokenizer: Any, depth: float = 0.5, seed: int = 0,
          topic: str = "harbour") -> PlantedDocument:
    """A document of about `n_tokens` tokens with `needle` at `depth` (0 = start, 1 = end).

    The text before the needle is `haystack(..., seed=seed)`, the text after it `haystack(..., seed=seed + 1)`.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    encode = _encoder(tokenizer)
    before = haystack(int(n_tokens * depth), encode, seed=seed, topic=topic)
    after = haystack(int(n_tokens * (1 - depth)), encode, seed=seed + 1, topic=topic)
    start = len(encode(before))
    return PlantedDocument(before + needle + " " + after, before, needle, after,
                           (start, start + len(encode(needle))))
