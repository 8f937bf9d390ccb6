"""Drive mode's task templates (`apps/dashboard/task_form.py`), driven without a browser: the model's card
sets the task and the sampling defaults, a fact found in the user's own prose document is asked in the
trained wording and answered right by `builtin:demo`, a sample picture's colour is answered right, and
free-form chat on a model with a notice shows it once, with the template one click away."""

from __future__ import annotations

import html
import random
import time
from pathlib import Path

from apps.dashboard.follower import DashboardState
from apps.dashboard.session_runner import SessionRunner
from apps.dashboard.task_form import FIND_FACT, FREE_FORM, PICTURE, TYPED

# plain prose, nothing from the trained world: the fact is the only sentence with a code in it
SENTENCES = ["We left the village early, before the fog had lifted from the fields.",
             "My aunt keeps bees behind the old barn and sells the honey at the Saturday market.",
             "The path to the river is muddy after rain, so everyone wears boots.",
             "In the evenings we read aloud from a book of sea stories that my grandfather loved.",
             "The neighbours planted tomatoes along the fence this spring.",
             "A heron stood in the shallow water and did not move for an hour.",
             "The kitchen window looks out over the orchard, where the apples are nearly ripe.",
             "Last winter the pipes froze twice, and the plumber came on a bicycle.",
             "Somebody left a blue umbrella on the bench by the station.",
             "The children built a raft from planks and empty barrels."]
FACT = "Remember: the alarm code for the greenhouse is 3-8-2-5."


def prose(chars: int, seed: int = 0) -> str:
    """About `chars` characters of prose (the demo's byte-level tokenizer: about as many tokens) with FACT
    in the middle."""
    rng = random.Random(seed)
    parts: list[str] = []
    while sum(len(p) + 1 for p in parts) < chars:
        parts.append(rng.choice(SENTENCES))
    parts.insert(len(parts) // 2, FACT)
    return " ".join(parts)


def shown(pane) -> str:
    """A text pane's text as the page shows it (the pane holds it escaped)."""
    return html.unescape(pane.object)


def _runner(tmp_path: Path, model: str = "builtin:demo") -> SessionRunner:
    runner = SessionRunner(state=DashboardState(None), runs_dir=str(tmp_path / "runs"), prefill_chunk=1024)
    runner.param.model.objects = ["builtin:demo", "preset:tiny"]
    runner.model = model
    return runner


def _wait(runner: SessionRunner, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while runner.running and time.monotonic() < deadline:
        runner.poll()
        time.sleep(0.1)
    assert not runner.running, "the session did not finish in time"
    runner.poll()


def test_model_change_takes_the_cards_defaults_and_free_form_shows_the_notice(tmp_path: Path) -> None:
    runner = _runner(tmp_path, "preset:tiny")
    assert runner.tasks.task == FREE_FORM and not runner.tasks.notice.visible      # a preset's card: no notice
    runner.model = "builtin:demo"
    assert (runner.temperature, runner.max_new_tokens, runner.tasks.task) == (0.0, 48, FIND_FACT)
    assert not runner.tasks.notice.visible and not runner.free_form_inputs.visible
    runner.tasks.task = FREE_FORM
    assert runner.tasks.notice.visible and runner.tasks.notice.alert_type == "info"
    assert "trained only" in shown(runner.tasks.notice) and runner.free_form_inputs.visible
    assert runner.tasks.use_template.visible and runner.tasks.use_template.name == "Use the find-a-fact template"
    runner.tasks.use_template.clicks += 1
    assert runner.tasks.task == FIND_FACT and not runner.tasks.notice.visible
    runner.model = "preset:tiny"
    assert (runner.temperature, runner.tasks.task) == (1.0, FREE_FORM) and not runner.tasks.notice.visible


def test_bad_fact_fields_are_a_message_and_nothing_runs(tmp_path: Path) -> None:
    runner = _runner(tmp_path)
    assert "Type the fact's key" in shown(runner.tasks.preview)
    runner.tasks.key, runner.tasks.value = "garage door", "blue"
    assert "holds no digit" in shown(runner.tasks.preview)
    assert runner.generate() is None and "holds no digit" in runner.message and not runner.running
    runner.tasks.value = "7142"
    assert "one-line document" in shown(runner.tasks.preview)        # no upload: said plainly
    runner.tasks.task = PICTURE
    assert runner.generate() is None and "needs a picture" in runner.message and not runner.running


def test_find_a_fact_in_my_own_prose_document(tmp_path: Path) -> None:
    runner = _runner(tmp_path)
    runner.dropper.value = {"notes.txt": prose(2000)}
    picked = "greenhouse alarm: 3-8-2-5 (notes.txt)"
    assert runner.tasks.param.fact.objects == [TYPED, picked]
    runner.tasks.fact = picked
    assert (runner.tasks.key, runner.tasks.value) == ("greenhouse alarm", "3-8-2-5")
    preview = shown(runner.tasks.preview)
    assert "What is the code that opens the greenhouse alarm?" in preview and "greenhouse alarm: " in preview
    trace = runner.generate()
    assert trace is not None
    _wait(runner)
    assert runner.message.endswith("answer: greenhouse alarm: 3-8-2-5 (right: the value in your document)"), \
        runner.message
    snap = runner.state.sync()
    assert snap.session.status == "complete" and snap.error is None
    assert [s["name"] for s in snap.session.segments][:4] == ["system", "notes.txt", "question", "answer prefix"]
    # the what-if panel's base: the assistant turn opened with the prefilled key, then the answer's ids
    base, _ = runner._rerun_base
    tokenizer = base.end.tokenizer
    assert tokenizer.decode(list(base.opening)).endswith("greenhouse alarm: ")
    assert tokenizer.decode(list(base.answer)).startswith("3-8-2-5")
    runner.state.close()


def test_ask_about_a_sample_picture(tmp_path: Path) -> None:
    runner = _runner(tmp_path)
    runner.dropper.value = {"notes.txt": "A short note."}
    runner.tasks.task, runner.tasks.attribute = PICTURE, "colour"
    runner.add_sample_picture()
    name, payload = runner.documents[-1]
    assert name.startswith("sample picture 1") and payload[:8] == b"\x89PNG\r\n\x1a\n"
    assert "64 x 64" in shown(runner.tasks.picture_hint)
    assert runner.generate() is not None
    _wait(runner)
    colour = runner._samples[name][0]["colour"]
    assert runner.message.endswith(f"answer: colour: {colour} (right: the sample picture's colour; a guess is right "
                                   "1 time in 6)"), runner.message
    snap = runner.state.sync()
    assert [s["name"] for s in snap.session.segments][:2] == ["system", name]      # the note is not sent
    runner.state.close()


def test_status_line_says_right_wrong_or_unfinished() -> None:
    from types import SimpleNamespace

    from apps.dashboard.session_runner import answer_status

    task = SimpleNamespace(expected="3-8-2-5")
    right = SimpleNamespace(text="greenhouse alarm: 3-8-2-5", correct=True, closed=True)
    assert answer_status(task, right, "the value you typed", 48) == \
        "answer: greenhouse alarm: 3-8-2-5 (right: the value you typed)"
    wrong = SimpleNamespace(text="greenhouse alarm: 3-8-2-2-2", correct=False, closed=False)
    assert answer_status(task, wrong, "the value you typed", 8) == ("answer: greenhouse alarm: 3-8-2-2-2 (wrong: the "
                                                                   "value you typed is 3-8-2-5; the response did not "
                                                                   "end within 8 new tokens)")
    unknown = SimpleNamespace(expected=None)
    assert answer_status(unknown, SimpleNamespace(text="colour: red", correct=None, closed=True), "", 48) == \
        "answer: colour: red"


def test_the_same_fact_twice_is_two_choices_and_a_typed_value_is_judged_as_typed(tmp_path: Path) -> None:
    runner = _runner(tmp_path)
    runner.dropper.value = {"a.txt": f"{FACT} Some words. {FACT}"}
    labels = runner.tasks.param.fact.objects[1:]
    assert labels == ["greenhouse alarm: 3-8-2-5 (a.txt)", "greenhouse alarm: 3-8-2-5 (a.txt) #2"]
    runner.tasks.fact = labels[1]
    assert runner.tasks.picked.start > runner.tasks._found[labels[0]].start
    assert runner.tasks.verdict_source() == "the value in your document"
    runner.tasks.value = "1-1-1-1"
    assert runner.tasks.verdict_source() == "the value you typed"
    assert runner.tasks.task_prompt().documents[0][1].endswith("The code that opens the greenhouse alarm is 1-1-1-1.")
