"""The follower thread outlives any exception (shown on the page, retried) and shows paths relative to --root."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from apps.dashboard.follower import DashboardState


def _broken_copy(small_trace: Path, target: Path, damage) -> Path:
    shutil.copytree(small_trace, target)
    session = json.loads((target / "session.json").read_text())
    damage(session)
    (target / "session.json").write_text(json.dumps(session))
    return target


def _drop_end(s):
    del s["segments"][0]["end"]


def _parts_list(s):
    s["parts"] = [1, 2]


def _segments_str(s):
    s["segments"] = "abc"


def _tokens_str(s):
    s["tokens"] = "many"


@pytest.mark.parametrize("damage", [_drop_end, _parts_list, _segments_str, _tokens_str])
def test_malformed_session_json_is_shown_and_the_follower_keeps_trying(tmp_path, small_trace, damage):
    root = tmp_path
    target = _broken_copy(small_trace, root / "run", damage)
    state = DashboardState(target, interval=0.05, root=root)
    state.start()
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (state.poll() and state.frame.error):
            time.sleep(0.05)
        assert state.frame.error and str(root.resolve()) not in state.frame.error, state.frame.error
        assert state.follower.alive
        shutil.copy(small_trace / "session.json", target / "session.json")  # repaired: the follower recovers
        state.follower.wake()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (state.poll() and state.frame.error is None
                                                   and state.frame.session.status == "complete"):
            time.sleep(0.05)
        assert state.frame.error is None and state.frame.session.status == "complete"
    finally:
        state.close()


def test_an_unexpected_reducer_exception_does_not_kill_the_follower(tmp_path, small_trace, monkeypatch):
    state = DashboardState(small_trace, interval=0.05)
    calls = {"n": 0}
    reducer = state.follower._session
    real = reducer.reduce

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] <= 2:
            raise KeyError("end")
        return real(*args, **kwargs)

    monkeypatch.setattr(reducer, "reduce", flaky)
    state.start()
    try:
        deadline = time.monotonic() + 20
        errors = []
        while time.monotonic() < deadline:
            if state.poll():
                errors.append(state.frame.error)
                if state.frame.error is None and state.frame.session.status == "complete":
                    break
            time.sleep(0.05)
        assert any(e and "KeyError" in e for e in errors), errors
        assert state.frame.error is None and state.follower.alive
    finally:
        state.close()


def test_paths_on_the_page_are_relative_to_the_root(tmp_path):
    state = DashboardState(tmp_path / "sub" / "missing", root=tmp_path)
    snap = state.sync()
    assert state.trace_path == "sub/missing"
    assert str(tmp_path) not in (snap.error or "") and "sub/missing" in snap.error
