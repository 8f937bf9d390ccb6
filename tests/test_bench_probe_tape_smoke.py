"""`benchmarks/bench_probe_tape.py` runs end to end and prints a row per model size with the three
ways of handing payloads on (per-point emission, per-point backlog, the tape)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_probe_tape_runs_and_prints_each_size() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_probe_tape.py"), "--steps", "64"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert "tape us/step" in lines[0] and "backlog / tape" in lines[0]
    rows = [line for line in lines[1:] if line.strip()]
    assert len(rows) == 2 and rows[0].startswith("demo preset") and rows[1].startswith("K3.1 Pro")
    assert all(row.rstrip().endswith("x") for row in rows)
