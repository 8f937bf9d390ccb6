"""`workbench.haystack` / `workbench.plant`: deterministic filler documents with a findable needle."""

from __future__ import annotations

import pytest

import workbench
from engine.tokenizer import Tokenizer


def test_haystack_is_deterministic_long_enough_and_varied() -> None:
    tok = Tokenizer.byte_level()
    a = workbench.haystack(2000, tok, seed=4)
    assert a == workbench.haystack(2000, tok.encode, seed=4)  # a tokenizer or its encode function
    assert a != workbench.haystack(2000, tok, seed=5)
    assert 2000 <= len(tok.encode(a)) < 2200
    sentences = [s for s in a.split(". ") if s]
    assert len(set(sentences)) > 0.9 * len(sentences)
    assert "glacier" in workbench.haystack(100, tok, topic="glacier")


def test_plant_puts_the_needle_at_its_token_range() -> None:
    tok = Tokenizer.byte_level()
    doc = workbench.plant("The vault code is 4-7-1-9.", 3000, tok, depth=0.25, seed=1)
    ids = tok.encode(doc.text)
    start, end = doc.needle_tokens
    assert ids[start:end] == tok.encode("The vault code is 4-7-1-9.")
    assert 0.2 < start / len(ids) < 0.3
    assert doc.before == workbench.haystack(750, tok, seed=1) and doc.after == workbench.haystack(2250, tok, seed=2)
    with pytest.raises(ValueError, match="depth"):
        workbench.plant("x", 10, tok, depth=1.5)
