"""Drive mode: uploads, bad input, and a real recorded session on the tiny preset (no browser)."""

from __future__ import annotations

import time
from pathlib import Path

from apps.dashboard.session_runner import SessionRunner, find_models
from apps.dashboard.follower import DashboardState


def _runner(tmp_path: Path, **params) -> SessionRunner:
    return SessionRunner(state=DashboardState(None), runs_dir=str(tmp_path / "runs"), **params)


def _wait(runner: SessionRunner, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while runner.running and time.monotonic() < deadline:
        runner.poll()
        runner.state.poll()
        time.sleep(0.1)
    assert not runner.running, "the session did not finish in time"


def test_uploads_are_checked(tmp_path: Path) -> None:
    runner = _runner(tmp_path, max_upload_bytes=1000)
    runner.dropper.value = {"notes.txt": "hello " * 10}
    assert runner.documents == [["notes.txt", "hello " * 10]] and "added" in runner.message
    runner.dropper.value = {"big.txt": "x" * 1001}
    assert runner.message.startswith("error:") and "upload limit" in runner.message
    assert runner.alert.visible and runner.alert.alert_type == "danger"
    runner.dropper.value = {"bin.txt": b"\xff\xfe\x00"}
    assert "not UTF-8" in runner.message
    assert len(runner.documents) == 1
    runner.clear_documents()
    assert runner.documents == []


def test_generate_needs_input(tmp_path: Path) -> None:
    runner = _runner(tmp_path)
    runner.prompt = "   "
    assert runner.generate() is None and "prompt" in runner.message and not runner.running


def test_model_that_fails_to_load(tmp_path: Path) -> None:
    runner = _runner(tmp_path)
    runner.param.model.objects = [str(tmp_path / "missing-ckpt")]
    runner.model = str(tmp_path / "missing-ckpt")
    assert runner.generate() is not None and runner.running
    _wait(runner, 60)
    assert runner.message.startswith("error:") and runner.alert.visible


def test_find_models(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text("{}")
    from workbench.sessions import builtin_models

    assert find_models(["x"], [tmp_path]) == ["x", *builtin_models(), str(tmp_path / "a"), "preset:tiny", "preset:demo"]
    assert builtin_models() == ["builtin:demo"]     # shipped in engine/builtin/demo: the dashboard's default


def test_recorded_session_on_tiny_preset(tmp_path: Path) -> None:
    runner = _runner(tmp_path, max_new_tokens=6, temperature=0.0, prefill_chunk=64)
    runner.dropper.value = {"doc <b>1</b>.txt": "The vault code is 4-7-1-9. " * 8}
    runner.prompt = "What is the vault code?"
    trace = runner.generate()
    assert trace is not None and runner.running and runner.generate() is None  # one session at a time
    _wait(runner)
    assert not runner.message.startswith("error:"), runner.message
    snap = runner.state.sync()
    assert snap.session.status == "complete" and snap.error is None
    assert [s["name"] for s in snap.session.segments][:2] == ["doc <b>1</b>.txt", "prompt"]
    assert 1 <= len(snap.session.generated) <= 6
    assert snap.dsa.heat is not None and len(snap.dsa.heat.rows) == 2  # tiny: DSA on layers 2 and 5
    runner.state.position = snap.session.generated[0][0]  # the last token is sampled but never run, so has no reads
    snap = runner.state.sync()
    assert snap.dsa.reads["rows"] and snap.experts.routes
    runner.state.close()


def test_two_pages_pressing_generate_at_once(tmp_path: Path, monkeypatch) -> None:
    # the first page's session holds the server's one run slot; the second page gets a message, not
    # "nested record()", and can run once the first has finished
    import threading

    from apps.dashboard import session_runner

    release = threading.Event()
    real_run = SessionRunner._run

    def slow_run(self, *args):
        release.wait(30)
        return real_run(self, *args)

    monkeypatch.setattr(SessionRunner, "_run", slow_run)
    first, second = _runner(tmp_path / "a"), _runner(tmp_path / "b")
    for r in (first, second):
        r.param.model.objects = [str(tmp_path / "missing-ckpt")]
        r.model = str(tmp_path / "missing-ckpt")
    assert first.generate() is not None
    assert second.generate() is None and "another session is running" in second.message and not second.running
    release.set()
    _wait(first, 60)
    assert session_runner._RUN_LOCK.acquire(blocking=False)
    session_runner._RUN_LOCK.release()
    assert second.generate() is not None
    _wait(second, 60)
    assert second.message.startswith("error:") and "another session" not in second.message
