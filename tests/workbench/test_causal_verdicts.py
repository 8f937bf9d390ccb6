"""Verdicts that hold (issue 39): control spans never overlap what they must not, a context without room
for them gives no verdict (saying why), the verdict sentence, task templates recording where the fact
is, and the real path on builtin:demo with a find-fact task."""

from __future__ import annotations

import json

import pytest

import workbench
from engine import load_model
from engine.errors import InputError
from engine.session import Session
from engine.tokenizer import Tokenizer
from tests.helpers import random_ids
from workbench.analysis.causal import (CHANCE, DEPENDS, NO_VERDICT, SMALL, control_spans, verdict,
                                      verdict_of_summary)
from workbench.causal_effects import ScoringWarning
from workbench.questions import needle_readers
from workbench.task_templates import append_task, fact_task


def overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_controls_are_disjoint_from_the_span_the_evidence_and_each_other() -> None:
    avoid = [(400, 450), (900, 950), (120, 160)]
    draw = control_spans(50, (0, 2000), avoid, 8, seed=3)
    assert draw.enough and len(draw.spans) == 8 and draw.note == ""
    for i, c in enumerate(draw.spans):
        assert c[1] - c[0] == 50 and 0 <= c[0] and c[1] <= 2000
        assert not any(overlaps(c, a) for a in avoid)
        assert not any(overlaps(c, d) for d in draw.spans[i + 1:])
    assert control_spans(50, (0, 2000), avoid, 8, seed=3) == draw          # seeded
    # a region that holds exactly eight: the draw never strands itself short of room that exists
    tight = control_spans(100, (0, 850), [(0, 50)], 8, seed=0)
    assert tight.enough and tight.spans == tuple((50 + 100 * i, 150 + 100 * i) for i in range(8))
    with pytest.raises(InputError, match="positive number of positions"):
        control_spans(0, (0, 10))


def test_a_document_filling_the_context_gets_no_verdict_and_says_why() -> None:
    # the case: the hidden document is 8,516 of 8,734 tokens
    draw = control_spans(8516, (0, 8734), [(100, 8616)], 8)
    assert draw.spans == () and not draw.enough
    assert "no random span of 8,516 tokens fit" in draw.note and "218 free tokens of 8,734" in draw.note
    found = verdict(-12.34, [], "notes.txt", note=draw.note)
    assert found.label == NO_VERDICT and not found.decided and found.p_value is None
    assert found.sentence.startswith("hiding notes.txt lowered the answer's log-probability by 12.3 nats; no verdict: "
                                     "no random span of 8,516 tokens fit")


def test_the_verdict_in_plain_words_with_rank_and_p_value() -> None:
    controls = [-0.1, 0.2, 0.0, 0.05, 0.1, -0.05, 0.02, 0.0]
    found = verdict(-12.34, controls, "the fact")
    assert found.label == DEPENDS and found.rank == 1 and found.p_value == pytest.approx(1 / 9)
    assert found.odds == "rank 1 of 9, p = 0.11" and verdict_of_summary(-12.34, -0.1, 0.2, 8, "x").odds == found.odds
    assert found.sentence == ("hiding the fact lowered the answer's log-probability by 12.3 nats; 8 random spans of "
                              "the same size changed it by -0.10 to +0.20: the answer depends on the fact")
    # inside the controls' range, or below them by a hair: chance
    inside = verdict(-19.0, [-19.8, -19.5, -18.0, -18.9, -19.1, -20.2, -18.5, -19.9], "notes.txt")
    assert inside.label == CHANCE and inside.rank == 6 and "not distinguishable from a random span" in inside.sentence
    tiny = verdict(-0.0002, [0.0] * 8, "the needle")      # notebook 09's case: below every control, by a hair
    assert tiny.label == SMALL and "too small to say the answer depends on the needle" in tiny.sentence
    experts = verdict(-0.04, [0.001 * i for i in range(8)], "experts [6, 0] of layer 5", unit="set of experts",
                      action="banning")
    assert experts.sentence.startswith("banning experts [6, 0] of layer 5 lowered") and "8 random sets of experts" \
        in experts.sentence
    # too few controls decide nothing, whatever the effect
    assert verdict(-12.0, [0.0, 0.1], "x").label == NO_VERDICT
    assert verdict_of_summary(-12.34, -0.1, 0.2, 8, "the fact").sentence == found.sentence


@pytest.fixture(scope="module")
def model():
    return load_model("preset:tiny:k3.1", seed=1)


def test_check_span_on_a_context_without_room_gives_no_verdict(model) -> None:
    s = Session(model, Tokenizer.byte_level(), prefill_chunk=32)
    s.append(ids=random_ids(4, 1), name="system")
    s.append(ids=random_ids(90, 2), name="document")
    check = workbench.check_span(s, (4, 94), continuation=random_ids(5, 3), target=random_ids(3, 4), what="document")
    assert check.controls == () and check.verdict.label == NO_VERDICT
    assert "no verdict: no random span of 90 tokens fit" in check.verdict.sentence
    roomy = workbench.check_span(s, (40, 44), continuation=random_ids(5, 3), target=random_ids(3, 4),
                                 evidence=[(60, 64)], controls=8)
    assert len(roomy.controls) == 8 and roomy.verdict.decided
    assert not any(overlaps(c, a) for c in roomy.controls for a in [(40, 44), (60, 64)])


def test_check_span_refuses_bad_spans_and_seeds_before_running(model) -> None:
    s = Session(model, Tokenizer.byte_level(), prefill_chunk=32)
    s.append(ids=random_ids(94, 2), name="document")
    ask = dict(continuation=random_ids(5, 3), target=random_ids(3, 4))
    for span, words in [((40, 95), r"the span to hide must be two token positions with 0 <= START < END <= 94 "
                                   r"\(the context\), got \(40, 95\)"),
                        ((True, 5), "the span to hide"), ((5, 5), "START < END"), (("1", 5), "got")]:
        with pytest.raises(InputError, match=words):
            workbench.check_span(s, span, **ask)
    with pytest.raises(InputError, match="an evidence span must be two token positions"):
        workbench.check_span(s, (4, 8), evidence=[(90, 99)], **ask)
    with pytest.raises(InputError, match="the controls' region must be"):
        workbench.check_span(s, (4, 8), region=(0, 200), **ask)
    with pytest.raises(InputError, match=r"seed must be an integer in \[0, 2\*\*63\), got -1"):
        workbench.check_span(s, (4, 8), seed=-1, **ask)
    assert s.length == 0  # refused before the context was prefilled


def test_attribution_rows_carry_controls_rank_and_verdict(model) -> None:
    s = Session(model, Tokenizer.byte_level(), prefill_chunk=32)
    s.append(ids=random_ids(6, 1), name="intro")
    s.append(ids=random_ids(120, 2), name="document")
    frame = workbench.attribution(s, ["document", ("fact", 60, 66)], continuation=random_ids(5, 3),
                                  target=random_ids(3, 4), moe=False, evidence=[(100, 106)])
    whole = frame[(frame["segment"] == "document") & (frame["layer"] == "all")].iloc[0]
    assert whole["controls"] == 0 and "no verdict: no random span of 120 tokens fit" in whole["verdict"]
    fact = frame[(frame["segment"] == "fact") & (frame["layer"] == "all")].iloc[0]
    assert fact["controls"] == 8 and 1 <= fact["rank"] <= 9 and fact["verdict"].startswith("hiding fact ")


def test_a_task_records_where_the_fact_is_and_questions_find_it(model, tmp_path) -> None:
    s = Session(model, Tokenizer.byte_level(), prefill_chunk=64)
    task = fact_task([("notes.txt", "Some text here. " * 20 + "More lines follow. " * 10)], "garage door", "7142")
    with workbench.record(s, trace=tmp_path / "t"):
        spans = append_task(s, task)
        s.prefill()
        list(s.generate(3, temperature=0))
    assert set(spans) == {"the fact", "restatement 1"}
    for start, end in spans.values():
        assert s.tokenizer.decode(s.tokens[start:end]) == "The code that opens the garage door is 7142."
    recorded = json.loads((tmp_path / "t" / "session.json").read_text())["task"]
    assert recorded["expected"] == "7142" and recorded["spans"]["the fact"] == list(spans["the fact"])
    trace = workbench.open_trace(tmp_path / "t")
    line = needle_readers(trace).line
    assert line.startswith(f"Q1 needle [{spans['the fact'][0]}, {spans['the fact'][1]})")
    # "the fact" names what to hide; its restatement is then evidence no control touches
    check = workbench.check_span(s, "the fact", continuation=random_ids(4, 3), target=random_ids(2, 4), controls=8)
    assert check.span == spans["the fact"] and check.what == "the fact" and len(check.controls) == 8
    assert not any(overlaps(c, spans["restatement 1"]) for c in check.controls)
    frame = workbench.attribution(s, ["the fact"], continuation=random_ids(4, 3), target=random_ids(2, 4), moe=False)
    assert set(frame["segment"]) == {"the fact"}
    bare = tmp_path / "bare"
    with workbench.record(Session(model, Tokenizer.byte_level()), trace=bare) as _:
        pass
    assert "--needle START:END" in needle_readers(workbench.open_trace(bare)).line


DOCUMENT = ("The harbour office opens at dawn, and the ferry leaves twice a day for the islands. " * 12 +
            "Visitors are asked to keep to the marked paths along the cliffs. " * 12)


def test_on_builtin_demo_the_answer_depends_on_the_fact_and_a_bare_string_target_warns(demo) -> None:
    model, tokenizer = demo
    session = Session(model, tokenizer)
    task = fact_task([("notes.txt", DOCUMENT)], "garage door", "7142", restate=False)
    spans = append_task(session, task, question=False)
    check = workbench.check_span(session, spans["the fact"], continuation=task, what="the fact")
    assert check.verdict.label == DEPENDS and check.effect < -2 and len(check.controls) == 8
    assert check.verdict.sentence.endswith("the answer depends on the fact")
    # the case: the document fills almost the whole context, so no disjoint control fits
    whole = workbench.check_span(session, "notes.txt", continuation=task)
    doc = next(s for s in session.segments if s.name == "notes.txt")
    assert (doc.end - doc.start) / len(session.tokens) > 0.9 and whole.controls == ()
    assert whole.verdict.label == NO_VERDICT and whole.effect < -2
    assert f"no verdict: no random span of {doc.end - doc.start:,} tokens fit" in whole.verdict.sentence
    with pytest.warns(ScoringWarning, match="starts with scaffolding"):
        bare = workbench.effects(session, {"op": "dsa.hide", "segment": "notes.txt", "layers": "all"},
                                 continuation=task.question, target="7142", max_new_tokens=4)
    assert bare.warnings and "warning: the model's answer starts with scaffolding" in bare.summary()
    with pytest.warns(ScoringWarning, match="starts with scaffolding"):
        string = workbench.check_span(session, "notes.txt", continuation=task.question, target="7142", controls=1)
    assert string.warnings and string.verdict.label == NO_VERDICT


def test_workbench_run_find_fact_then_questions_finds_the_fact_without_needle(tmp_path, capsys) -> None:
    from apps.cli import main

    doc = tmp_path / "notes.txt"
    doc.write_text(DOCUMENT)
    trace = tmp_path / "t"
    assert main(["run", "--model", "builtin:demo", "--task", "find-fact", "--prompt-file", str(doc), "--key",
                 "garage door", "--value", "7142", "--trace", str(trace)]) == 0
    capsys.readouterr()
    fact = json.loads((trace / "session.json").read_text())["task"]["spans"]["the fact"]
    assert main(["questions", str(trace), "--only", "needle"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"Q1 needle [{fact[0]}, {fact[1]}): layer ") and "chance" in line
