"""Task templates (`workbench.task_templates`): facts found in a user's own text, the trained wording put
into it, the model card's prompting defaults, bad input as one clear error; and the proof of issue 33:
`builtin:demo` answers a fact in a user's own 8K-token prose document, asked the way drive mode asks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.errors import CheckpointError, InputError
from workbench.task_templates import (PICTURE_QUESTIONS, ask, card_files, card_of, fact_task, find_facts, key_of,
                                      picture_task)

DEMO = Path(__file__).resolve().parents[2] / "engine" / "builtin" / "demo"


def test_find_facts_links_a_noun_phrase_to_a_code() -> None:
    docs = [("a.txt", "We walked to the harbour. Remember: the alarm code for the greenhouse is 3-8-2-5. "
                      "The office is at 221 Baker street. Version: 3.11 was released."),
            ("b.txt", "Notes\nwifi password = 4471 9920\nThe trip took 12 hours."),
            ("c.txt", "Setup. The door code of release v2.1 is 5-5-1-0! Done.")]
    facts = find_facts(docs)
    assert [(f.document, f.key, f.value) for f in facts] == [
        (0, "greenhouse alarm", "3-8-2-5"), (1, "wifi", "4471 9920"), (2, "release v2 door", "5-5-1-0")]
    assert facts[2].sentence == "The door code of release v2.1 is 5-5-1-0!"   # "2.1" does not end the sentence
    first = facts[0]
    assert docs[0][1][first.start:first.end] == first.sentence == \
        "Remember: the alarm code for the greenhouse is 3-8-2-5."
    assert find_facts(docs, limit=1) == facts[:1]


@pytest.mark.parametrize("phrase, key", [("the alarm code for the greenhouse", "greenhouse alarm"),
                                         ("The passcode", "passcode"),
                                         ("the PIN of my bike lock", "bike lock"),
                                         ("Our storage locker number", "storage locker")])
def test_key_rule(phrase: str, key: str) -> None:
    assert key_of(phrase) == key


def test_typed_fact_goes_in_at_a_sentence_end_in_the_trained_wording() -> None:
    text = "First sentence here. Second one follows. Third closes it."
    fact = "The code that opens the garage door is 7142."
    plain = fact_task([("short.txt", "Tiny."), ("notes.txt", text)], "garage door", "7142", depth=0.5,
                      restate=False)
    name, sent = plain.documents[1]
    d, start, end = plain.fact
    assert (name, d, plain.restated) == ("notes.txt", 1, None) and plain.documents[0] == ("short.txt", "Tiny.")
    assert sent[start:end] == fact
    assert sent.replace(fact + " ", "") == text           # the user's text untouched around it
    task = fact_task([("short.txt", "Tiny."), ("notes.txt", text)], "garage door", "7142", depth=0.5)
    d, start, end = task.restated                          # restated at the end of its document, as trained
    assert task.documents[1][1] == sent + "\n" + fact + " " and task.documents[1][1][start:end] == fact
    assert task.question == "What is the code that opens the garage door? Answer with the digits only."
    assert (task.prefix, task.expected, task.task) == ("garage door: ", "7142", "find-fact")
    alone = fact_task([], "garage door", "7142")
    assert alone.documents == [("fact.txt", fact)] and alone.restated is None      # it ends its document already


def test_found_fact_is_rewritten_in_place() -> None:
    text = "Intro. Remember: the alarm code for the greenhouse is 3-8-2-5. Outro."
    task = fact_task([("d.txt", text)], "greenhouse alarm")
    assert task.documents[0][1] == ("Intro. The code that opens the greenhouse alarm is 3-8-2-5. Outro.\n"
                                    "The code that opens the greenhouse alarm is 3-8-2-5. ")
    assert task.expected == "3-8-2-5"
    edited = fact_task([("d.txt", text)], "glass house", found=find_facts([("d.txt", text)])[0])
    assert "opens the glass house is 3-8-2-5." in edited.documents[0][1] and edited.prefix == "glass house: "


@pytest.mark.parametrize("key, value, depth, message", [
    ("", "1234", 0.5, "key is empty"), ("a\nb", "1234", 0.5, "one line"), ("k" * 81, "1234", 0.5, "81 characters"),
    ("door", "blue", 0.5, "holds no digit"), ("door", "12\n34", 0.5, "one line"), ("door", "1234", 1.5, "depth"),
    ("door", "<|close|>1", 0.5, "control token"), ("boat hatch", None, 0.5, "no fact about 'boat hatch'")])
def test_bad_fact_input_is_one_clear_error(key, value, depth, message) -> None:
    with pytest.raises(InputError, match=message):
        fact_task([("d.txt", "Nothing to see here.")], key, value, depth=depth)


def test_picture_questions_are_the_trained_ones() -> None:
    task = picture_task("colour")
    assert (task.question, task.prefix, task.expected) == (PICTURE_QUESTIONS["shape"]["colour"][0], "colour: ", None)
    assert picture_task("digit").question in PICTURE_QUESTIONS["digit"]["digit"]
    with pytest.raises(InputError, match="one of colour"):
        picture_task("size")


def test_card_of_builtin_preset_and_bare_directory(tmp_path: Path) -> None:
    if (DEMO / "prompting.json").is_file():
        demo = card_of("builtin:demo")
        assert (demo.temperature, demo.max_new_tokens, demo.tasks) == (0.0, 48, ("find-fact", "picture"))
        assert demo.notice and "\n" not in demo.notice
    preset = card_of("preset:tiny")
    assert (preset.temperature, preset.tasks, preset.notice) == (1.0, (), "")
    assert card_of(tmp_path).tasks == ()
    for name, data in card_files(("find-fact",), "only facts", temperature=0.0, max_new_tokens=32).items():
        (tmp_path / name).write_text(json.dumps(data))
    card = card_of(tmp_path)
    assert (card.temperature, card.max_new_tokens, card.tasks, card.notice) == (0.0, 32, ("find-fact",), "only facts")


@pytest.mark.parametrize("name, text, message", [
    ("prompting.json", "[1, 2]", "expected a JSON object"), ("prompting.json", '{"tasks": ["poetry"]}', "tasks must"),
    ("prompting.json", '{"notice": "two\\nlines"}', "one line"), ("generation_config.json", "{", "not valid JSON"),
    ("generation_config.json", '{"temperature": -1}', "temperature must"),
    ("generation_config.json", " " * (65 << 10), "larger than")])
def test_bad_card_file_names_the_file(tmp_path: Path, name: str, text: str, message: str) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(CheckpointError, match=message) as err:
        card_of(tmp_path)
    assert name in str(err.value)


@pytest.mark.skipif(not (DEMO / "config.json").is_file(), reason="builtin:demo not installed")
def test_demo_finds_a_typed_fact_in_a_users_own_8k_prose_document() -> None:
    """Issue 33's proof: a newcomer's own document (8K tokens of natural prose: Python standard-library
    docstrings, not the training filler), a fact they typed (`garden gate` = `2-5-5-8`), built with
    `fact_task` and asked with `ask` exactly as drive mode and `workbench run --task find-fact` do:
    `builtin:demo` answers the value.

    Measured with `python benchmarks/bench_fact_template.py` (this template, the fact restated at the
    document's end, 8K tokens, 12 typed facts x 3 depths, greedy): 29/48 right at seeds 200-223 and
    400-423 (60%, 95% Wilson [46%, 73%]; chance ~0). Whether a fact is found depends mostly on its
    key; this one (the benchmark's prompt 6, chosen as the first key of its list that was right in
    every prompt it was asked in while measuring, written once: 6 of 6 in three sets of documents)
    is a case the model reliably gets. A failure here means the template or
    the model changed; the rate above, not this case, is what a newcomer should expect.
    """
    import torch

    from benchmarks.bench_fact_template import case
    from engine import Session
    from workbench.sessions import load_with_tokenizer

    torch.set_num_threads(1)
    key, value, depth, docs = case(6, 8192)
    assert (key, value) == ("garden gate", "2-5-5-8")
    task = fact_task(docs, key, value, depth=depth)
    model, tokenizer = load_with_tokenizer("builtin:demo")
    session = Session(model, tokenizer)
    answer = ask(session, task)
    assert 8000 <= answer.first_position <= 8500                        # an 8K-token context
    assert "The code that opens the garden gate is 2-5-5-8." in task.documents[0][1]
    assert (answer.text, answer.value, answer.correct) == ("garden gate: 2-5-5-8", "2-5-5-8", True)
