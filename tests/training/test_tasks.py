"""The demo model's task generator: exact lengths, known fact spans, deterministic batches, and a
held-out world that shares no content word with the training world."""

from __future__ import annotations

import random
import re

import pytest
import torch

from engine.tokenizer import Tokenizer
from training.tasks import HELD_OUT, TRAIN, answer_ids, batch, build, needle_prompt, parse_answer, response_value
from workbench.retrieval_text import World

TOK = Tokenizer.byte_level()
_STOP = {"the", "a", "of", "on", "in", "is", "to", "for", "and", "at", "it", "was", "with", "be", "that", "this",
         "what", "which", "number", "value", "by", "an", "after", "from", "no", "only", "are", "as"}


def _words(world: World) -> set[str]:
    pools = (world.subjects, world.verbs, world.objects, world.tails, world.shapes, world.key_adjectives,
             world.key_nouns, world.quote_words, world.needles, world.needle_questions, world.kv_facts,
             world.kv_questions, world.quote_facts, world.quote_questions)
    text = " ".join(" ".join(p) for p in pools)
    text = re.sub(r"\{[^}]*\}", " ", text)
    return {w for w in re.findall(r"[a-z]+", text.lower()) if w not in _STOP}


def test_held_out_world_is_disjoint() -> None:
    shared = _words(TRAIN) & _words(HELD_OUT)
    assert not shared, f"held-out prompts reuse training words: {sorted(shared)}"
    assert not set(TRAIN.variables) & set(HELD_OUT.variables)
    assert not set(TRAIN.needles) & set(HELD_OUT.needles)


def test_samples_have_exact_length_and_fact_spans() -> None:
    rng = random.Random(0)
    for length in (256, 512, 2048):
        for _ in range(10):
            s = build(TOK, TRAIN, rng, length)
            assert len(s.ids) == length
            assert len(s.weights) == length
            for f in s.facts:
                assert TOK.decode(s.ids[f.start:f.end]) == f.text
            # the first answer follows the generation prompt
            before, ans, _ = answer_ids(TOK, s.response)
            assert s.ids[s.prompt_len:s.prompt_len + len(before) + len(ans)] == before + ans


def test_needle_prompt_depth_and_answer_parse() -> None:
    rng = random.Random(1)
    for depth in (0.1, 0.5, 0.9):
        s = needle_prompt(TOK, HELD_OUT, rng, 4096, depth)
        assert abs(s.facts[0].start / 4096 - depth) < 0.08
        text = TOK.decode(s.ids[s.prompt_len:])
        assert parse_answer(text) == s.response
        assert response_value(parse_answer(text)) == s.answer


def test_batches_are_deterministic() -> None:
    a = batch(TOK, 0, 7, 2, 512)
    b = batch(TOK, 0, 7, 2, 512)
    c = batch(TOK, 0, 8, 2, 512)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    assert float(a[1][:, -1].abs().sum()) == 0.0


def test_span_answers_quote_the_document_from_the_key_through_the_value() -> None:
    from workbench.retrieval_text import answer_parts

    fact = "Write this down somewhere safe, the combination for the polar vault reads 8-1-5-9. "
    assert answer_parts("span", "polar vault", "8-1-5-9", fact) == ("polar vault reads 8-1-5-9", "polar vault")
    assert answer_parts("key", "polar vault", "8-1-5-9", fact) == ("polar vault: 8-1-5-9", "polar vault: ")
    # no key before the value in the fact (variable tracking): the key style
    assert answer_parts("span", "K7", "512", "Then K7 takes the value of A3. ") == ("K7: 512", "K7: ")
    with pytest.raises(ValueError, match="answer style"):
        answer_parts("quote", "k", "1")
    for response, style, value in (("polar vault reads 8-1-5-9", "span", "8-1-5-9"), ("polar vault: 4821", "key", "4821"),
                                   ("tomune dafogi -> kiva 0042", "span", "0042"),
                                   ("amber tower: red stone", "key", "red stone"), ("", "key", ""), ("", "span", "")):
        assert response_value(response, style) == value


def test_span_samples_weigh_the_quoted_rest_as_the_answer() -> None:
    rng = random.Random(3)
    for _ in range(20):
        s = build(TOK, TRAIN, rng, 768, kinds=["needle"], questions=1, layout="plain", style="span")
        assert s.response.startswith(s.prefill) and s.response.endswith(s.answer) and s.prefill == s.facts[0].key
        assert s.response in s.facts[0].text
        tail = TOK.decode(s.ids[len(s.ids) - 90:])
        assert s.response + "<|close|>" in tail


def test_answer_style_of_reads_training_json_and_names_a_bad_one(tmp_path) -> None:
    from workbench.retrieval_text import answer_style_of

    assert answer_style_of("preset:tiny") == "key" and answer_style_of(tmp_path) == "key"   # no training.json
    (tmp_path / "training.json").write_text('{"answer_style": "span"}')
    assert answer_style_of(tmp_path) == "span"
    for bad, match in (('{"answer_style": "quote"}', "answer_style"), ("{oops", "not valid JSON"), ("[1]", "answer_style")):
        (tmp_path / "training.json").write_text(bad)
        with pytest.raises(ValueError, match=match):
            answer_style_of(tmp_path)
