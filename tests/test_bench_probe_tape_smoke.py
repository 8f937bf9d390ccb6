"""`benchmarks/bench_probe_tape.py` runs end to end and prints a row per model size with the three
ways of handing payloads on (per-point emission, per-point backlog, the tape)."""

from __future__ import annotations

from tests.helpers import run_benchmark


def test_bench_probe_tape_runs_and_prints_each_size() -> None:
    lines = run_benchmark("bench_probe_tape.py", "--steps", "64", timeout=300).splitlines()
    assert "tape us/step" in lines[0] and "backlog / tape" in lines[0]
    rows = [line for line in lines[1:] if line.strip()]
    assert len(rows) == 2 and rows[0].startswith("demo preset") and rows[1].startswith("K3.1 Pro")
    assert all(row.rstrip().endswith("x") for row in rows)
