"""The attribution view without a browser: drive mode's Attribute on a real `builtin:demo` find-fact answer
(~1.9K tokens, 16 + 8 masks, 2 spans checked beside 8 controls: about 10 s) writes `attribution.json` into
the trace; the reducer, on a fresh follower of that trace (a reload), puts the fact's sentence first with
its verdict, the LDS beside a random ranking's spread, every span shaded within [-1, 1]; the component
draws it and a clicked span sets the What-if range. A 128K-token attribution (synthetic, 10,000 spans)
sends only windows around its top spans; a bad file is a message naming it."""

from __future__ import annotations

import html
import json
import random
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from apps.dashboard.components.attribution import AttributionView, piece_rows, pick_in_what_if, top_table
from apps.dashboard.follower import DashboardState
from apps.dashboard.session_runner import SessionRunner
from apps.dashboard.views import view_options, view_reducers
from engine.builtin import ROOT as BUILTIN_ROOT
from tests.helpers import hold_at_start
from workbench.analysis.views.attribution_view import (MAX_SHOWN_SPANS, AttributionReducer, attribution_data,
                                                       lds_words)
from workbench.analysis.views.base import ViewOptions
from workbench.causal.reruns import RANGE
from workbench.trace.attribution_file import ATTRIBUTION_FILE, FORMAT, read_attribution

needs_demo = pytest.mark.skipif(not (BUILTIN_ROOT / "demo" / "prompting.json").is_file(),
                                reason="builtin:demo (with its prompting card) not installed")
SENTENCES = ["We left the village early, before the fog had lifted from the fields.",
             "The path to the river is muddy after rain, so everyone wears boots.",
             "A heron stood in the shallow water and did not move for an hour.",
             "Somebody left a blue umbrella on the bench by the station.",
             "The children built a raft from planks and empty barrels."]
FACT = "Remember: the alarm code for the greenhouse is 3-8-2-5."


def notes(chars: int) -> str:
    rng = random.Random(0)
    parts: list[str] = []
    while sum(len(p) + 1 for p in parts) < chars:
        parts.append(rng.choice(SENTENCES))
    parts.insert(len(parts) // 2, FACT)
    return " ".join(parts)


def _wait(runner: SessionRunner, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while (runner.running or runner.attribution.running) and time.monotonic() < deadline:
        runner.poll()
        time.sleep(0.05)
    assert not runner.running and not runner.attribution.running, "did not finish in time"
    runner.poll()


@pytest.fixture(scope="module")
def attributed(tmp_path_factory: pytest.TempPathFactory):
    runner = SessionRunner(state=DashboardState(None), runs_dir=str(tmp_path_factory.mktemp("drive") / "runs"),
                           prefill_chunk=1024)
    runner.param.model.objects = ["builtin:demo"]
    runner.model = "builtin:demo"
    runner.dropper.value = {"notes.txt": notes(1500)}
    runner.tasks.fact = "greenhouse alarm: 3-8-2-5 (notes.txt)"
    trace = runner.generate()
    _wait(runner)
    assert "(right: the value in your document)" in runner.message, runner.message
    panel = runner.attribution
    panel.masks, panel.holdout, panel.top, panel.controls = 16, 8, 2, 8
    runner.poll()
    assert panel.attribute(), panel.message
    assert "attributing the last answer" in panel.message and "Stop ends it" in panel.message
    _wait(runner)
    assert panel.message.startswith("attributed in"), panel.message
    yield runner, trace
    runner.state.close()


@needs_demo
def test_attribute_writes_the_trace_and_a_reload_shows_the_fact_first(attributed) -> None:
    runner, trace = attributed
    record = read_attribution(trace)
    assert record["format"] == FORMAT and record["check"] == "find-fact answer greenhouse alarm: 3-8-2-5"
    state = DashboardState(trace, reducers=view_reducers(), view_options=view_options())   # a fresh page
    try:
        data = state.sync().view("attribution")
    finally:
        state.close()
    assert data.note == "", data.note
    first = data.top[0]
    fact_spans = list(runner._rerun_base[0].spans.values())
    assert first.source == "checked" and "greenhouse alarm is 3-8-2-5" in first.text
    assert any(first.start < b and a < first.end for a, b in fact_spans)
    assert first.verdict.startswith("hiding tokens") and "8 random spans of the same size" in first.verdict
    assert first.controls == 8 and first.rank is not None and f"p = {first.p_value:.2f}" in first.tooltip
    assert "random same-size disjoint spans changed it by" in first.tooltip
    # 16 + 8 masks, each predicted by a fit without it: a random ranking's Spearman is 0 ± 1/sqrt(23)
    assert data.lds_line.startswith(f"LDS {record['lds']:.2f} on 24 masks, each predicted by a surrogate fitted "
                                    "without it (a random ranking scores 0 ± 0.21 on 24 masks)"), data.lds_line
    # a short context is shown whole, each span once, shaded in [-1, 1]; unread spans plain
    rows = [p.row for p in data.pieces if p.kind == "span"]
    assert data.shown == data.spans == len(rows) == len(record["spans"])
    assert sorted((r.start, r.end) for r in rows) == sorted((s["start"], s["end"]) for s in record["spans"])
    assert all(-1.0 <= r.shade <= 1.0 for r in rows) and all(r.shade == 0 for r in rows
                                                             if r.source not in ("checked", "estimated"))
    # full colour: the largest checked effect, but never a change too small to matter (< 0.1 nats)
    assert data.scale == max(0.1, max(abs(r.effect) for r in rows if r.source == "checked"))
    assert all(r.shade == max(-1.0, min(1.0, r.effect / data.scale)) for r in rows
               if r.source in ("checked", "estimated"))
    assert {(a, b) for a, b, _ in data.marks} == {(r.start, r.end) for r in rows if r.source == "checked"}


@needs_demo
def test_the_component_draws_it_and_a_click_sets_the_what_if_range(attributed) -> None:
    runner, trace = attributed
    picked: list[tuple[int, int]] = []
    state = DashboardState(trace, reducers=view_reducers(), view_options=view_options())
    try:
        state.sync()
        view = AttributionView(state=state, on_pick=lambda a, b: (picked.append((a, b)),
                                                                  pick_in_what_if(runner.what_if, a, b)))
        data = state.frame.view("attribution")
        assert view.text.pieces == piece_rows(data.pieces) and view.drawn_marker.object
        assert html.escape(data.top[0].verdict) in view.top.object and "LDS" in view.lds.object
        first = data.top[0]
        view.text.selected = [first.start, first.end]
        assert picked == [(first.start, first.end)]
        assert runner.what_if.positions == f"{first.start}:{first.end}" and runner.what_if.segment == RANGE
        assert (first.start, first.end, "selected") in zip(*(view.heat.marks.data[k] for k in ("x0", "x1", "label")))
    finally:
        state.close()


@needs_demo
def test_attribute_waits_for_the_model_lock(attributed) -> None:
    runner, _ = attributed
    lock = threading.Lock()
    from apps.dashboard.attribute_panel import AttributePanel

    panel = AttributePanel(lambda: (runner._rerun_base[0], runner._task), lock)
    with lock:
        assert not panel.attribute() and "a session or a rerun is running" in panel.message
    assert not AttributePanel(lambda: (None, None), lock).attribute()


def synthetic_record(spans: int = 10_000, tokens: int = 131_072, checked: tuple[int, ...] = (1200, 8000)) -> dict:
    width = tokens // spans
    rows = []
    for i in range(spans):
        effect = -0.9 if i in checked else (-0.05 if i % 97 == 0 else 0.0)
        rows.append({"start": i * width, "end": (i + 1) * width, "text": f"Sentence {i} <b>not bold</b>.",
                     "effect": effect, "estimate": effect, "control_min": -0.01 if i in checked else None,
                     "control_max": 0.02 if i in checked else None, "controls": 8 if i in checked else 0,
                     "verdict": "the answer depends on it" if i in checked else "", "label": f"doc{i // 2500}",
                     "kind": "sentence", "rank": 1 if i in checked else None,
                     "p_value": 1 / 9 if i in checked else None, "reads": 3,
                     "source": "checked" if i in checked else "unread" if i % 3 == 0 else
                     "unvaried" if i % 11 == 0 else "estimated"})
    rows.sort(key=lambda r: (r["source"] != "checked", r["effect"]))
    return {"format": FORMAT, "check": "synthetic", "answer": "7", "right": True, "target": "7", "target_logprob": -0.2,
            "lds": 0.8, "prefill_s": None, "attribution_s": 1.0, "masks": 64, "holdout": 16, "candidates": 384,
            "runs": 200, "kda": False, "context_tokens": tokens, "notes": [], "spans": rows}


def test_a_128k_attribution_sends_only_windows_around_its_top_spans() -> None:
    data = attribution_data(synthetic_record(), context=3)
    spans = [p for p in data["pieces"] if p.kind == "span"]
    more = [p for p in data["pieces"] if p.kind == "more"]
    assert data["spans"] == 10_000 and data["shown"] == len(spans) <= MAX_SHOWN_SPANS
    assert len(spans) + sum(p.hidden for p in more) == 10_000
    shown = {(p.start, p.end) for p in spans}
    assert all((r.start, r.end) in shown for r in data["top"])        # every top span has its window
    assert [r.source for r in data["top"][:2]] == ["checked", "checked"]
    assert len(json.dumps(piece_rows(data["pieces"]))) < 200_000      # what the page receives, not the context
    unvaried = [p.row for p in spans if p.row.source == "unvaried"]    # kept in every mask: no effect known
    assert unvaried and all(r.shade == 0 and "No effect known (unvaried)" in r.tooltip for r in unvaried)
    wider = attribution_data(synthetic_record(), context=50)
    assert data["shown"] < wider["shown"] <= MAX_SHOWN_SPANS


def test_lds_words_and_escaped_top_table() -> None:
    assert lds_words(0.85, 16)[1] and "trustworthy" in lds_words(0.85, 16)[0]
    assert not lds_words(0.7, 4)[1] and "too few held-out masks" in lds_words(0.7, 4)[0]
    assert not lds_words(0.2, 16)[1] and "weak" in lds_words(0.2, 16)[0]
    assert "not measured" in lds_words(None, 16)[0]
    table = top_table(attribution_data(synthetic_record())["top"])
    assert "<b>" not in table and "&lt;b&gt;" in table


def test_a_bad_attribution_file_is_a_message_naming_it(tmp_path: Path) -> None:
    (tmp_path / "session.json").write_text("{}")
    trace = SimpleNamespace(path=tmp_path)
    reducer = AttributionReducer()
    assert "no attribution in this trace yet" in reducer.reduce(trace, ViewOptions(), None).note
    record = synthetic_record(spans=10, tokens=100)
    record["spans"][0]["end"] = 10_000
    (tmp_path / ATTRIBUTION_FILE).write_text(json.dumps(record))
    note = reducer.reduce(trace, ViewOptions(), None).note
    assert ATTRIBUTION_FILE in note and "span 0: need 0 <= start < end <= 100" in note
    (tmp_path / ATTRIBUTION_FILE).write_bytes(b"\x80not json")
    time.sleep(0.01)
    assert "not a readable attribution" in AttributionReducer().reduce(trace, ViewOptions(), None).note


@needs_demo
def test_stop_ends_an_attribution_and_the_trace_keeps_the_one_it_had(attributed, monkeypatch) -> None:
    """Stop, clicked while the attribution runs: it ends before its next continuation, says after how many,
    writes nothing (attribution.json byte for byte as before) and frees the model lock."""
    from apps.dashboard import attribute_panel

    runner, _ = attributed
    panel = runner.attribution
    written = Path(runner._rerun_base[0].trace) / ATTRIBUTION_FILE
    before = written.read_bytes()
    # the real attribution, held at its start until Stop was clicked (so the click lands while it runs)
    gate = hold_at_start(monkeypatch, attribute_panel, "attribute_last_answer")
    assert panel.stop_button.disabled and not panel.stop()  # nothing to stop
    assert panel.attribute(), panel.message
    assert not panel.stop_button.disabled and panel.button.disabled
    panel.stop_button.clicks += 1
    assert panel.stop_button.disabled and panel.message.startswith("stopping the attribution"), panel.message
    gate.set()
    _wait(runner)
    assert panel.message.startswith("stopped: attribution cancelled after 0 of up to "), panel.message
    assert panel.message.endswith("nothing was written to the trace (attribution.json is as it was)")
    assert panel.alert.alert_type == "info" and not panel.button.disabled and panel.stop_button.disabled
    assert written.read_bytes() == before
    assert runner.model_lock.acquire(blocking=False)
    runner.model_lock.release()
