"""training.natural_text: natural filler and chat scaffolds that keep the held-out world held out."""

from __future__ import annotations

import random
import re

from engine.tokenizer import Tokenizer
from training.natural_text import CHAT_NEEDLES, CHAT_QUESTIONS, mixed_world, natural_sentences, natural_world
from training.tasks import HELD_OUT, build

from tests.training.test_tasks import _STOP, _words

TOK = Tokenizer.byte_level()


def _content(text: str) -> set[str]:
    text = re.sub(r"\{[^}]*\}", " ", text)
    return {w for w in re.findall(r"[a-z]+", text.lower()) if w not in _STOP and len(w) > 1}


def test_natural_text_and_chat_scaffolds_share_no_content_word_with_the_held_out_world() -> None:
    held_out = {w for w in _words(HELD_OUT) if len(w) > 1}
    sentences = natural_sentences()
    assert len(sentences) > 2000 and sum(map(len, sentences)) > 200_000   # enough not to repeat within a document
    assert not _content(" ".join(sentences)) & held_out
    assert not _content(" ".join(CHAT_NEEDLES + CHAT_QUESTIONS)) & held_out
    assert not any("=" in s or re.search(r"\d{3}", s) for s in sentences)


def test_natural_rows_plant_facts_in_natural_text_and_answer_them() -> None:
    rng = random.Random(3)
    world = natural_world(rng, gaps=True, chat_share=1.0)
    assert set(world.needles) <= set(CHAT_NEEDLES)
    s = build(TOK, world, random.Random(4), 1024, kinds=["needle"], questions=1)
    text = TOK.decode(s.ids)
    fact = s.facts[0]
    assert TOK.decode(s.ids[fact.start:fact.end]) == fact.text and s.answer in fact.text
    assert s.response == f"{fact.key}: {s.answer}" and text.endswith("<|end_of_msg|>")
    filler = TOK.decode(s.ids[:fact.start])
    assert sum(sentence in filler for sentence in natural_sentences()[:20000]) >= 2   # the filler is the bundled prose
    # mixed rows: some natural, the others as before (deterministic in the generator's state)
    draw = mixed_world(0.7, 0.5)
    names = [draw(random.Random(i)).name for i in range(40)]
    assert 5 < names.count("train-natural") < 35 and [draw(random.Random(i)).name for i in range(40)] == names
