"""The effects view on a trace the real demo wrote, and drive mode's "what if" reruns on the tiny preset
(no browser: widgets set, outputs asserted)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from apps.dashboard.app import DashboardConfig, create_app
from apps.dashboard.follower import DashboardState
from apps.dashboard.session_runner import SessionRunner
from apps.dashboard.what_if import BAN_EXPERTS, HIDE_DSA, RANGE, SUPPRESS_KDA, WhatIfPanel, what_if_traces
from engine import load_model
from engine.session import Session
from engine.tokenizer import Tokenizer
from tests.helpers import hold_at_start
from workbench.causal.reruns import RerunBase, plan_rerun, recorded_spans, span_label
from workbench.trace.effects_table import EFFECTS_FILE, effect_row, read_effects, write_effects

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demo_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trace `workbench demo --headless` wrote with the trained model (short context: its causal check
    writes effects.parquet)."""
    trace = tmp_path_factory.mktemp("demo") / "demo"
    done = subprocess.run([sys.executable, "-m", "workbench", "demo", "--headless", "--tokens", "1024",
                           "--trace", str(trace)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return trace


def test_effects_view_shows_the_demos_causal_check(demo_trace: Path) -> None:
    table = read_effects(demo_trace)
    assert table is not None and len(table)
    page = create_app(DashboardConfig(trace=demo_trace, root=demo_trace.parent), session_args={})
    dash = page.dashboard
    try:
        data = dash.state.sync().view("effects")
        assert {g.check for g in data.grids} == set(table["check_name"])
        needle = next(g for g in data.grids if g.check == "needle")
        assert needle.columns[-1] == "all" and needle.rows == ("dsa.hide · needle",)
        cell = needle.cells[0][-1]
        row = table[(table["check_name"] == "needle") & (table["layer"] == "all")].iloc[0]
        assert cell.effect == pytest.approx(row["effect"]) and cell.control_mean == pytest.approx(row["control_mean"])
        assert row["controls"] == 8 and cell.controls == 8
        assert cell.within_control == (cell.verdict != "depends") and cell.sentence.startswith("hiding needle ")
        assert cell.verdict == "depends" or "not distinguishable" in cell.sentence
        view = dash.view("effects")
        assert view in dash.views() and "k3-has-data" in view.drawn_marker.object
        assert "control mean" in view.table.object and "all layers" in view.table.object
    finally:
        dash.close()


def test_effects_view_marks_chance_and_survives_a_bad_table(demo_trace: Path, tmp_path: Path) -> None:
    trace = shutil.copytree(demo_trace, tmp_path / "copy")
    write_effects(trace, [effect_row("sweep", "4-7-1-9", "dsa.hide", effect=-0.05, controls=[-0.1, 0.02], plain=-0.2,
                                     segment="other", span=(0, 16), layer=2)])
    page = create_app(DashboardConfig(trace=trace, root=trace.parent), session_args={})
    dash = page.dashboard
    try:
        sweep = next(g for g in dash.state.sync().view("effects").grids if g.check == "sweep")
        assert sweep.cells[0][0].within_control and sweep.cells[0][0].verdict == "no verdict"  # two controls
        assert "k3-within-control" in dash.view("effects").table.object
        (trace / EFFECTS_FILE).write_bytes(b"not parquet")
        data = dash.state.sync().view("effects")
        assert not data.grids and "not a readable Parquet effects table" in data.note
        assert "not a readable Parquet" in dash.view("effects").summary.object
    finally:
        dash.close()


def _wait(runner: SessionRunner, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while (runner.running or runner.what_if.running) and time.monotonic() < deadline:
        runner.poll()
        time.sleep(0.05)
    assert not runner.running and not runner.what_if.running, "did not finish in time"


def _hide_dsa(panel: WhatIfPanel, segment: int = 0, layer: str = "all") -> None:
    """Choose hiding the `segment`-th offered segment from DSA in `layer`."""
    panel.action, panel.segment, panel.layer = HIDE_DSA, panel.param.segment.objects[segment], layer


def _rerun(runner: SessionRunner) -> None:
    """Click Rerun and wait for the rerun to finish."""
    assert runner.what_if.rerun(), runner.what_if.message
    _wait(runner)


@pytest.fixture(scope="module")
def driven(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("drive")
    runner = SessionRunner(state=DashboardState(None), runs_dir=str(tmp / "runs"), max_new_tokens=4, temperature=0.0,
                           prefill_chunk=64)
    runner.dropper.value = {"notes.txt": "The vault code is 4-7-1-9. " * 6, "other.txt": "Rain fell all day. " * 6}
    runner.prompt = "What is the vault code?"
    trace = runner.generate()
    _wait(runner)
    assert not runner.message.startswith("error:"), runner.message
    yield runner, trace
    runner.state.close()


def test_what_if_reruns_the_last_answer(driven) -> None:
    runner, trace = driven
    panel = runner.what_if
    base, _ = runner._rerun_base
    assert base is not None and base.answer and panel.param.segment.objects[0].startswith("notes.txt [")
    assert panel.param.segment.objects[-1] == RANGE
    assert panel.param.layer.objects == ["all", "2", "5"]  # tiny: DSA layers 2 and 5
    _hide_dsa(panel)
    _rerun(runner)
    result = panel.last
    assert result is not None and not panel.message.startswith("error:"), panel.message
    assert result.fork_at == len(base.end.tokens)  # the kept prefix: no re-prefill of the documents
    assert len(result.plain) == len(result.intervened) == len(base.answer)
    assert "answer, intervened" in panel.answers.object and "difference" in panel.tokens.object
    rows = read_effects(trace)
    assert rows is not None and "what if: notes.txt hidden from DSA every layer" in set(rows["check_name"])
    row = rows[rows["check_name"] == "what if: notes.txt hidden from DSA every layer"].iloc[0]
    assert row["effect"] == pytest.approx(result.change) and row["controls"] == len(result.control_changes)
    assert result.verdict is not None and "verdict: hiding notes.txt" in panel.answers.object
    for control in result.rerun.controls:          # disjoint from the span hidden and from each other
        start, end = control[0]["positions"]
        assert end <= result.rerun.span[0] or start >= result.rerun.span[1]
    _branch_reads_differ_where_hidden(panel, trace, result.rerun.span)

    # a range picked on the maps: the selected token sets either end
    runner.state.position = None
    assert not panel.pick(start=True) and "click a token" in panel.message
    runner.state.position = 5
    assert panel.pick(start=True) and panel.positions == "5:6" and panel.segment == RANGE
    runner.state.position = 11
    assert panel.pick(start=False) and panel.positions == "5:12"
    runner.state.position = None
    # any range typed as START:END; a bad one is an error before anything runs
    panel.segment = RANGE
    panel.positions = "oops"
    assert not panel.rerun() and panel.message.startswith("error: positions")
    panel.positions = "3:9"
    _rerun(runner)
    assert panel.last.rerun.span == (3, 9) and len(panel.last.control_changes) == 8
    assert "what if: positions [3, 9) hidden from DSA every layer" in set(read_effects(trace)["check_name"])
    panel.segment = panel.param.segment.objects[0]

    # KDA: writes suppressed from the segment's start on (the fork kept there); experts banned in one layer
    panel.action = SUPPRESS_KDA
    assert panel.param.layer.objects[0] == "all" and "2" not in panel.param.layer.objects
    panel.layer = panel.param.layer.objects[1]
    _rerun(runner)
    assert not panel.message.startswith("error:"), panel.message
    assert panel.last.rerun.op == "kda.suppress_writes" and panel.last.fork_at == base.segments[0].start
    panel.action = BAN_EXPERTS
    panel.experts = "not experts"
    assert not panel.rerun() and panel.message.startswith("error: experts")
    panel.experts = "0, 1"
    _rerun(runner)
    assert not panel.message.startswith("error:"), panel.message
    assert panel.last.rerun.experts == [0, 1]
    assert len(set(read_effects(trace)["check_name"])) == 4

    _hide_dsa(panel, segment=1, layer="2")
    _rerun(runner)
    assert panel.last.rerun.spec[0]["layers"] == [2]


def test_stop_ends_a_rerun_before_its_next_control(driven, monkeypatch) -> None:
    """Stop, clicked while a rerun runs: its two branches finish, no control runs, the panel says so and the
    effects table is byte for byte as before; the lock is free for the next rerun."""
    from apps.dashboard import what_if

    runner, trace = driven
    panel = runner.what_if
    effects = trace / EFFECTS_FILE
    # run alone, no earlier test of this module has written the table yet: then it must still not exist
    before = effects.read_bytes() if effects.exists() else None
    last = panel.last
    # the real rerun, held at its start until Stop was clicked (so the click lands while it runs)
    gate = hold_at_start(monkeypatch, what_if, "run_rerun")
    _hide_dsa(panel)
    assert panel.stop_button.disabled and not panel.stop()  # nothing to stop
    assert panel.rerun(), panel.message
    assert not panel.stop_button.disabled and panel.button.disabled
    panel.stop_button.clicks += 1
    assert panel.stop_button.disabled and panel.message.startswith("stopping the rerun"), panel.message
    gate.set()
    _wait(runner)
    runner.poll()
    # the two branches ran; the controls did not (how many fit beside the segment is the plan's)
    assert re.fullmatch(r"stopped: what-if rerun cancelled after 2 of \d+ runs: nothing was written to the "
                        r"effects table", panel.message), panel.message
    assert panel.alert.alert_type == "info" and not panel.button.disabled and panel.stop_button.disabled
    assert (effects.read_bytes() if effects.exists() else None) == before and panel.last is last
    assert runner.model_lock.acquire(blocking=False)
    runner.model_lock.release()


def _branch_reads_differ_where_hidden(panel, trace: Path, span: tuple[int, int]) -> None:
    """The rerun recorded both branches' DSA reads beside the trace; the panel's difference view shows
    queries that read the hidden span in the plain branch and could not in the intervened one."""
    from workbench.trace import open_trace

    tables = [open_trace(path).table("dsa_topk", columns=["layer", "position", "selected"]).to_pandas()
              for path in what_if_traces(trace)]
    assert all(len(t) for t in tables)

    def in_span(selected) -> bool:
        return any(span[0] <= int(k) < span[1] for k in selected)

    plain, intervened = ({(int(r.layer), int(r.position)): in_span(r.selected) for r in t.itertuples()}
                         for t in tables)
    read_then_hidden = [key for key, hit in plain.items() if hit and key in intervened and not intervened[key]]
    assert read_then_hidden and not any(intervened.values())
    diff = panel.last_diff
    assert diff is not None and diff.queries and diff.heat is not None
    changed = {int(r["layer"]) for r in diff.layers if r["changed_share"] > 0}
    assert {layer for layer, _ in read_then_hidden} <= changed
    assert "k3-dsa-diff" in panel.diff_table.object and "intervened branch" in panel.diff_summary.object


def _rerun_base(trace: Path, spans: dict[str, tuple[int, int]], segments: tuple = ()) -> RerunBase:
    """A rerun base to plan on: a 1000-token context, no forks kept."""
    return RerunBase(trace=trace, end=SimpleNamespace(tokens=[0] * 1000), segments=segments, spans=spans)


def test_segment_forks_stay_within_their_memory_budget(monkeypatch, tmp_path) -> None:
    """Each kept fork copies the whole state: past the budget no more segment-start forks are kept
    (the fork before the answer always is), and a KDA rerun past them says why."""
    from workbench.causal import reruns as what_if

    session = Session(load_model("preset:tiny"), Tokenizer.byte_level())
    for i in range(4):
        session.append(f"document {i}: " + "words " * 40, role="user")
    monkeypatch.setattr(what_if, "FORK_BUDGET_BYTES", 1)
    base = what_if.keep_branch_points(session, tmp_path / "t")
    assert base.end is not None and base.starts == {len(session.tokens): base.end}
    with pytest.raises(ValueError, match="fit in"):
        base.base_for(0)


def test_a_rerun_shows_in_the_effects_view_without_a_reload(driven) -> None:
    """The follower sleeps on a finished trace; a rerun's effects table wakes it (no page reload)."""
    from apps.dashboard.views import view_reducers

    runner, trace = driven
    state = runner.state
    state.reducers = view_reducers()  # the page's views, the effects view among them
    (trace / EFFECTS_FILE).unlink(missing_ok=True)
    state.follow(trace)
    state.start()
    assert not state.sync().view("effects").grids
    calls = []
    follower = state.follower
    assert follower is not None
    original = follower.wake
    follower.wake = lambda: (calls.append(1), original())[1]
    try:
        _hide_dsa(runner.what_if)
        _rerun(runner)
        assert calls, "the follower was not woken after the rerun wrote its effects"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            state.poll()
            data = state.frame.view("effects")
            if data is not None and data.grids:
                break
            time.sleep(0.05)
        assert data is not None and any(g.check.startswith("what if:") for g in data.grids)
        assert state.frame.session.status == "complete"  # the finished trace's follower had been asleep
    finally:
        follower.wake = original


def test_a_recorded_fact_is_offered_and_its_controls_avoid_the_evidence() -> None:
    from engine.session.segments import Segment

    seg = Segment(id=0, kind="document", name="notes.txt", start=0, end=900)
    base = _rerun_base(Path("unused"), {"the fact": (400, 412), "restatement 1": (880, 892)}, (seg,))
    rerun = plan_rerun(base, None, HIDE_DSA, span_label("the fact", (400, 412)), "all", "")
    assert rerun.span == (400, 412) and rerun.what == "the fact" and len(rerun.controls) == 8 and not rerun.note
    spans = sorted(tuple(c[0]["positions"]) for c in rerun.controls)
    for i, (start, end) in enumerate(spans):
        assert end - start == 12 and (i == 0 or start >= spans[i - 1][1])
        assert all(end <= a or start >= b for a, b in base.spans.values())
    # the whole document leaves no room: the rerun still runs, and says why it can give no verdict
    whole = plan_rerun(base, None, HIDE_DSA, "notes.txt", "all", "")
    assert whole.controls == [] and "no random span of 900 tokens fit" in whole.note


def test_recorded_spans_from_a_trace_are_checked(tmp_path) -> None:
    import json as _json

    import workbench

    trace = tmp_path / "t"
    with workbench.record(Session(load_model("preset:tiny"), Tokenizer.byte_level()), trace=trace):
        pass
    session = _json.loads((trace / "session.json").read_text())
    session["task"] = {"spans": {"the fact": [10, 20], "bad": [5, 2], "flag": [True, 3], "text": ["a", 1],
                                 "far": [900, 5000]}}
    (trace / "session.json").write_text(_json.dumps(session))
    spans = recorded_spans(trace)
    assert spans == {"the fact": (10, 20), "far": (900, 5000)}
    base = _rerun_base(trace, spans)
    with pytest.raises(ValueError, match="past the context's 1000 tokens"):
        plan_rerun(base, None, HIDE_DSA, "far", "all", "")
