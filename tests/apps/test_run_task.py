"""`workbench run --task` on the trained demo model: a fact in the user's document and a picture question,
asked in the trained wording (greedy, key prefilled); a free-form prompt gets the card's notice once on
stderr and its answer as generated; template misuse is one clear error before the model loads."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from apps.cli import main
from engine.builtin import ROOT as BUILTIN_ROOT

pytestmark = pytest.mark.skipif(not (BUILTIN_ROOT / "demo" / "prompting.json").is_file(),
                                reason="builtin:demo (with its prompting card) not installed")
RUN = ["run", "--model", "builtin:demo", "--compile", "off"]
NOTES = ("Field notes from the allotment.\nThe weather was fine on Monday and we walked to the harbour. "
         "Remember: the alarm code for the greenhouse is 3-8-2-5. After lunch we fixed the fence and "
         "counted the bean poles.\n")


@pytest.fixture
def notes(tmp_path: Path) -> Path:
    path = tmp_path / "notes.txt"
    path.write_text(NOTES)
    return path


def test_free_form_prompt_shows_the_notice_once_and_the_answer_as_generated(capsys) -> None:
    assert main(RUN + ["--prompt", "What is the passcode?"]) == 0
    out, err = capsys.readouterr()
    assert err.count("note: builtin:demo") == 1 and "only on two tasks" in err
    assert "try: workbench run --model builtin:demo --task find-fact" in err
    assert err.index("note: builtin:demo") < err.index("generated tokens")   # before the answer
    assert out.endswith("\n")                                                # shown, whatever it is


def test_find_fact_picks_the_fact_from_the_document(notes: Path, capsys) -> None:
    assert main(RUN + ["--task", "find-fact", "--key", "greenhouse alarm", "--prompt-file", str(notes)]) == 0
    out, err = capsys.readouterr()
    assert out == "greenhouse alarm: 3-8-2-5\n" and "right" in err and "note:" not in err


def test_find_fact_with_a_typed_value_is_recorded(notes: Path, tmp_path: Path, capsys) -> None:
    import workbench

    trace = tmp_path / "trace"
    assert main(RUN + ["--task", "find-fact", "--key", "garage door", "--value", "7142", "--depth", "0",
                       "--prompt-file", str(notes), "--trace", str(trace)]) == 0
    out, _ = capsys.readouterr()
    assert out == "garage door: 7142\n"
    names = list(workbench.open_trace(trace).segments()["name"])
    assert names[:3] == ["system", "notes.txt", "question"]


def test_picture_question(tmp_path: Path, capsys) -> None:
    import workbench

    path = tmp_path / "square.png"
    workbench.draw_shape(random.Random(3), 64, shape="square", colour="blue", position="right").image.save(path)
    assert main(RUN + ["--task", "picture", "--image", str(path), "--ask", "colour"]) == 0
    assert capsys.readouterr().out == "colour: blue\n"


@pytest.mark.parametrize("extra, message", [
    (["--task", "find-fact", "--prompt", "x"], "needs --key"),
    (["--task", "find-fact", "--key", "boat hatch", "--prompt", "Nothing here."], "no fact about 'boat hatch'"),
    (["--task", "find-fact", "--key", "door", "--value", "blue", "--prompt", "x"], "holds no digit"),
    (["--task", "picture", "--ask", "colour"], "needs --image"),
    (["--prompt", "x", "--key", "door"], "--key belongs to a task template"),
    (["--task", "find-fact", "--key", "door", "--value", "12", "--prompt", "x", "--chat"], "drop --chat"),
])
def test_template_misuse_is_one_line(extra: list[str], message: str, capsys) -> None:
    assert main(["run", "--model", "builtin:demo"] + extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
