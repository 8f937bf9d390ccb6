"""Issue 42 items 3 and 4: `workbench serve` stops cleanly, and refuses a bad `--policy` at start.

Item 3, the attack: Ctrl-C a few seconds into a long prefill. The client got a 500, the process
died with exit -6 ("terminate called without an active exception") and the trace stayed
`recording`. Now SIGINT and SIGTERM alike end the running request (a 503, or an error event that
ends the stream), close every conversation's trace, and exit 0. A real server process on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from apps.cli import main

ROOT = Path(__file__).resolve().parents[2]
MODEL = "preset:tiny"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(trace_root: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "workbench", "serve", "--model", MODEL, "--port", str(port), "--trace-root",
           str(trace_root), "--prefill-chunk", "128", "--threads", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + 120
    while True:
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else "timeout"
        try:
            if "endpoint:" in lines.get(timeout=0.5):
                return proc, f"http://127.0.0.1:{port}/v1"
        except queue.Empty:
            continue


def _statuses(trace_root: Path) -> list[str]:
    return [json.loads((d / "session.json").read_text())["status"] for d in sorted(trace_root.iterdir())
            if (d / "session.json").exists()]


@pytest.mark.parametrize("signals, stream", [
    ((signal.SIGINT,), False), ((signal.SIGTERM,), True), ((signal.SIGINT, signal.SIGINT), False),
], ids=["sigint", "sigterm", "sigint-twice"])
def test_a_stop_signal_mid_prefill_ends_the_request_closes_the_traces_and_exits_0(tmp_path: Path, signals: tuple,
                                                                                  stream: bool) -> None:
    trace_root = tmp_path / "traces"
    proc, url = _start(trace_root)
    answer: dict = {}
    queued: dict = {}
    try:
        # a finished conversation first (its trace stays open for reuse), then a long prefill
        done = httpx.post(f"{url}/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 2}, timeout=120)
        if done.status_code != 200:
            proc.kill()
            pytest.fail(f"the first request failed: {done.text[:300]} {proc.stderr.read()[-2000:]}")
        assert _statuses(trace_root) == ["recording"]
        # 10K prompt tokens in chunks of 128, then up to 4,000 generated: still running when the signal comes
        body = {"messages": [{"role": "user", "content": "long " * 2000}], "max_tokens": 4000, "stream": stream}

        def ask() -> None:
            with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=120) as r:
                answer["status"], answer["text"] = r.status_code, r.read().decode()

        def wait_behind() -> None:
            r = httpx.post(f"{url}/chat/completions", json={"messages": [{"role": "user", "content": "next"}]},
                           timeout=120)
            queued["status"], queued["text"] = r.status_code, r.text

        client = threading.Thread(target=ask)
        client.start()
        deadline = time.monotonic() + 60
        while len(_statuses(trace_root)) < 2:  # the long request's conversation has begun recording
            assert time.monotonic() < deadline and client.is_alive(), answer
            time.sleep(0.05)
        behind = threading.Thread(target=wait_behind)
        behind.start()
        time.sleep(0.5)
        for sig in signals:  # a second signal changes nothing: the stop is as clean
            proc.send_signal(sig)
            time.sleep(0.1)
        client.join(60)
        behind.join(60)
        code = proc.wait(90)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.stderr.read()
    assert code == 0, stderr[-2000:]
    assert "terminate called" not in stderr and "Traceback" not in stderr, stderr[-2000:]
    assert _statuses(trace_root) == ["complete", "complete"]
    assert queued["status"] == 503 and "stopped before it ran" in queued["text"], queued
    if stream:  # the stream ends with an error event naming the shutdown
        assert answer["status"] == 200 and "shutting down" in answer["text"].splitlines()[-2], answer["text"][-500:]
    else:
        assert answer["status"] == 503, answer
        message = json.loads(answer["text"])["error"]["message"]
        assert "shutting down" in message and "\n" not in message


def test_an_idle_server_stops_on_sigterm_with_exit_0(tmp_path: Path) -> None:
    proc, url = _start(tmp_path / "traces")
    try:
        assert httpx.get(f"{url}/models", timeout=30).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_an_unknown_policy_is_refused_at_start(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                                               tmp_path: Path) -> None:
    from apps.serve.server import Server

    def started(self) -> None:
        raise AssertionError("the server started with an unknown policy")

    monkeypatch.setattr(Server, "run", started)
    for policy in ("bogus", str(tmp_path / "missing.json")):
        assert main(["serve", "--model", MODEL, "--policy", policy, "--trace-root", str(tmp_path / "t")]) == 2
        err = capsys.readouterr().err.strip()
        assert "unknown policy" in err and len(err.splitlines()) == 1, err
    bad = tmp_path / "bad.json"
    bad.write_text('{"no_such_field": 1}')
    assert main(["serve", "--model", MODEL, "--policy", str(bad), "--no-record"]) == 2
    assert "unknown policy fields" in capsys.readouterr().err
