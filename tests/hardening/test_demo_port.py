"""`workbench demo` on a port that is taken: one `error:` line, exit 2, before any recording."""

from __future__ import annotations

import socket
import subprocess
import sys


def test_demo_on_a_busy_port_fails_in_one_line_before_recording(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        trace = tmp_path / "trace"
        done = subprocess.run([sys.executable, "-m", "workbench", "demo", "--port", str(port), "--no-browser",
                               "--trace", str(trace)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines == [f"error: port {port} is already in use; choose another with --port"], done.stderr
    assert not trace.exists()  # nothing recorded, nothing overwritten
