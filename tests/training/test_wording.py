"""training.wording: varied fact phrasings that stay inside the training world's vocabulary."""

from __future__ import annotations

import random
import re

import torch

from engine.tokenizer import Tokenizer
from training.tasks import HELD_OUT, batch, build
from training.wording import varied_world

from tests.training.test_tasks import _STOP, _words

TOK = Tokenizer.byte_level()


def test_varied_wording_never_uses_held_out_words() -> None:
    held_out = _words(HELD_OUT)
    rng = random.Random(0)
    seen = set()
    for _ in range(300):
        w = varied_world(rng)
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
