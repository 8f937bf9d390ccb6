"""Issue 42 items 17 and 18: what a first-time user read that was wrong or missing.

17. `workbench questions`: no "nearest -1 tokens back" for a layer that never read the needle, no
    sink ALARM on a short session (too few tokens for a dip to mean anything), and Q5's busiest-rank
    line only when there are several expert-parallel ranks.
18. `workbench run --task picture` on a picture unlike the trained ones prints the dashboard's note.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import workbench
from apps.cli import main
from apps.dashboard.picture_note import PICTURE_HINT, picture_note
from engine import load_model
from engine.builtin import ROOT as BUILTIN_ROOT
from engine.session import Session
from engine.tokenizer import Tokenizer
from workbench.questions import ask_all, needle_readers, sink_alarm_context
from workbench.recorders.policy import ALL


@pytest.fixture(scope="module")
def short_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 212-token tiny-preset session on one process (the issue's sink ALARM was on a 212-token session)."""
    model = load_model("preset:tiny", seed=3, dtype=torch.float32)
    session = Session(model, Tokenizer.byte_level(), prefill_chunk=32)
    path = tmp_path_factory.mktemp("q") / "t"
    ids = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    with workbench.record(session, trace=path, policy=dataclasses.replace(ALL, kda_rank_every=64)):
        session.append(ids=ids, name="context")
        list(session.generate(12, temperature=0, stop_ids=()))
    return path


def test_no_sink_alarm_and_no_rank_ratio_on_a_short_one_process_session(short_trace: Path) -> None:
    trace = workbench.open_trace(short_trace)
    answers = ask_all(trace)
    sink = answers["sink"].line
    assert "ALARM" not in sink and "too short to tell (211 tokens" in sink, sink
    assert f"{sink_alarm_context(16):,}" in sink and "chance" in sink  # the rates are still shown beside chance
    experts = answers["experts"].line
    assert "busiest rank" not in experts and "one expert-parallel rank" in experts, experts


def test_a_layer_that_never_read_the_needle_has_no_distance(short_trace: Path) -> None:
    trace = workbench.open_trace(short_trace)
    # a one-token needle early in the context: at least one layer's answer queries never pick it
    for start in range(8, 190):
        answer = needle_readers(trace, (start, start + 1), queries=(200, 211))
        if (answer.frame["queries_reading"] == 0).any():
            break
    else:
        pytest.skip("every one-token span was read by every layer")
    assert "-1 tokens back" not in answer.line and "never read it" in answer.line, answer.line
    assert "nearest" not in answer.line.split("never read it")[0].rsplit(";", 1)[-1]


def test_the_picture_note_says_when_the_size_is_not_the_trained_one() -> None:
    assert picture_note("tri.png", (256, 160)).startswith("note: tri.png is 256 x 160, unlike the pictures")
    assert PICTURE_HINT in picture_note("tri.png", (256, 160))
    assert PICTURE_HINT in picture_note("sq.png", (64, 64)) and "64 x 64, unlike" not in picture_note("sq.png", (64, 64))


@pytest.mark.skipif(not (BUILTIN_ROOT / "demo" / "prompting.json").is_file(), reason="builtin:demo not installed")
def test_the_cli_prints_the_picture_note_for_an_unfamiliar_picture(tmp_path: Path, capsys) -> None:
    from PIL import Image, ImageDraw

    path = tmp_path / "tri.png"
    image = Image.new("RGB", (256, 160), "white")
    ImageDraw.Draw(image).polygon([(128, 40), (88, 120), (168, 120)], fill="red")
    image.save(path)
    assert main(["run", "--model", "builtin:demo", "--compile", "off", "--task", "picture", "--image", str(path),
                 "--ask", "shape"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("shape: ")  # answered, in the trained format
    assert err.count("note: tri.png is 256 x 160, unlike the pictures this model was trained on") == 1, err
    assert PICTURE_HINT in err


# --- item 15: long silent waits


def test_a_few_thousand_token_prefill_shows_its_progress(monkeypatch, capsys) -> None:
    """The bar started at 8K tokens: a 5.7K-token quick start waited 19 s in silence. Now a prefill of 2K
    tokens or more shows it once it has run PROGRESS_DELAY_S (0 here); a short one still prints nothing."""
    from engine.session import prefill as prefill_module

    monkeypatch.setattr(prefill_module, "PROGRESS_DELAY_S", 0.0)
    model = load_model("preset:tiny", seed=3, dtype=torch.float32)
    for tokens, shown in ((2100, True), (600, False)):
        session = Session(model, Tokenizer.byte_level(), prefill_chunk=1024)
        session.append(ids=[65 + i % 26 for i in range(tokens)], name="doc")
        session.prefill()
        err = capsys.readouterr().err
        assert ("prefill" in err and f"{tokens}/{tokens}" in err) == shown, (tokens, err[-300:])


def test_the_slow_prefill_bar_waits_before_it_shows() -> None:
    from engine.session import prefill as prefill_module

    assert prefill_module.PROGRESS_MIN_TOKENS <= 4096 and 0 < prefill_module.PROGRESS_DELAY_S <= 5


NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def test_notebook_09_says_what_it_is_doing_and_how_long_it_takes() -> None:
    import json

    cells = ["".join(c["source"]) for c in json.loads((NOTEBOOKS / "09_which_memory.ipynb").read_text())["cells"]
             if c["cell_type"] == "code"]
    assert "def note(" in cells[0] and "sys.__stderr__" in cells[0] and "about 7 minutes" in cells[0]
    # every cell that runs the model for long says so first
    slow = [c for c in cells if any(call in c for call in ("prefill()", "workbench.effects(", "workbench.attribution(",
                                                           "load_with_tokenizer(MODEL)"))]
    assert slow and all("note(" in c for c in slow), [c[:80] for c in slow if "note(" not in c]


def test_every_notebook_environment_variable_is_documented() -> None:
    import re

    used = set()
    for path in NOTEBOOKS.glob("*.ipynb"):
        used |= set(re.findall(r"K3WB_NOTEBOOK_[A-Z_]+", path.read_text()))
    docs = (NOTEBOOKS.parent / "docs" / "notebooks.md").read_text()
    assert used and all(name in docs for name in used), sorted(name for name in used if name not in docs)


def test_an_early_noisy_dip_does_not_hide_a_later_sink_stop() -> None:
    """Only the first dip per layer is an alarm candidate: one at 100 tokens (too short to tell) must not
    hide the same layer stopping at 2,000+."""
    import pandas as pd

    from workbench.questions import sink_readers

    rows = []
    for step, position in enumerate(range(50, 4000, 50)):
        reading = not (position == 100 or position >= 2000)
        rows.append({"layer": 2, "step": step, "rank": 0, "position": position, "queries": 10,
                     "sink_hits": 10 if reading else 0})
    sink = pd.DataFrame(rows)
    sink.attrs["k3wb.recorded"] = {"topk": 16, "sink_tokens": 4}

    class Recorded:
        settings = {"topk": 16, "sink_tokens": 4}

        def df(self, name: str) -> pd.DataFrame:
            assert name == "dsa_sink"
            return sink

    line = sink_readers(Recorded()).line
    assert "ALARM layers 2 stopped at positions 2000" in line, line
