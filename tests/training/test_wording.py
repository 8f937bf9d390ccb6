"""training.wording: varied fact phrasings that stay inside the training world's vocabulary."""

from __future__ import annotations

import random
import re

import pytest
import torch

from engine.tokenizer import Tokenizer
from training.tasks import HELD_OUT, batch, build
from training.tasks import W_ANSWER
from training.wording import gap_link, varied_world

from tests.training.test_tasks import _STOP, _words

TOK = Tokenizer.byte_level()


@pytest.mark.parametrize("gaps", [False, True])
def test_varied_wording_never_uses_held_out_words(gaps: bool) -> None:
    held_out = _words(HELD_OUT)
    rng = random.Random(0)
    seen = set()
    for _ in range(300):
        w = varied_world(rng, gaps=gaps)
        pools = (w.needles, w.needle_questions, w.kv_facts, w.kv_questions, w.subjects, w.verbs, w.objects, w.tails,
                 w.shapes)
        text = re.sub(r"\{[^}]*\}", " ", " ".join(" ".join(p) for p in pools))
        words = {x for x in re.findall(r"[a-z]+", text.lower()) if x not in _STOP}
        assert not words & held_out, sorted(words & held_out)
        assert not set(w.needles) & set(HELD_OUT.needles)
        seen.update(w.needles)
    assert len(seen) > 200   # really varied: hundreds of distinct needle sentences


def test_varied_samples_keep_their_fact_spans_and_answers() -> None:
    rng = random.Random(1)
    for _ in range(20):
        s = build(TOK, varied_world(rng), rng, 1024, kinds=["needle", "kv"])
        assert len(s.ids) == 1024
        for f in s.facts:
            assert TOK.decode(s.ids[f.start:f.end]) == f.text
            assert f.answer in f.text


def test_batch_with_a_world_is_deterministic_and_differs_from_the_train_world() -> None:
    a = batch(TOK, 0, 3, 2, 512, world=varied_world, drill_share=0.5)
    b = batch(TOK, 0, 3, 2, 512, world=varied_world, drill_share=0.5)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    default = batch(TOK, 0, 3, 2, 512)
    assert not torch.equal(a[0], default[0])


def test_gap_links_put_varied_text_between_key_and_value_and_never_an_equals_sign() -> None:
    """`gaps` wording: the value is the first number after its key, whatever stands between them; "="
    (the held-out world's link, "{k} access = {v}") is never generated."""
    rng = random.Random(2)
    links = [gap_link(rng) for _ in range(500)]
    assert len(set(links)) > 300 and not any("=" in x and "=>" not in x for x in links)
    assert not any(ch.isdigit() for x in links for ch in x)
    between = set()
    for _ in range(200):
        for needle in varied_world(rng, gaps=True).needles:
            assert "=" not in needle.replace("=>", "")
            text = needle.format(k="KEY", v="4321")
            between.add(text[text.index("KEY") + 3: text.index("4321")] if text.index("KEY") < text.index("4321") else "")
    assert len(between) > 300


def test_first_weight_weighs_only_each_answers_first_value_token() -> None:
    plain = build(TOK, HELD_OUT, random.Random(5), 512, kinds=["needle"], questions=1)
    heavy = build(TOK, HELD_OUT, random.Random(5), 512, kinds=["needle"], questions=1, first_weight=3.0)
    assert plain.ids == heavy.ids
    changed = [i for i, (a, b) in enumerate(zip(plain.weights, heavy.weights)) if a != b]
    assert len(changed) == 1 and plain.weights[changed[0]] == W_ANSWER and heavy.weights[changed[0]] == 3.0
    assert TOK.decode([heavy.ids[changed[0]]]) == heavy.answer[0]


def test_close_weight_weighs_only_the_close_after_each_answer() -> None:
    plain = build(TOK, HELD_OUT, random.Random(6), 512, kinds=["needle"], questions=1)
    heavy = build(TOK, HELD_OUT, random.Random(6), 512, kinds=["needle"], questions=1, close_weight=2.0)
    changed = [i for i, (a, b) in enumerate(zip(plain.weights, heavy.weights)) if a != b]
    assert plain.ids == heavy.ids and len(changed) == 1 and heavy.weights[changed[0]] == 2.0
    assert heavy.ids[changed[0]] == TOK.close_id and TOK.decode(heavy.ids[changed[0] - len(heavy.answer):changed[0]]) == heavy.answer
