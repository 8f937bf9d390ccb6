"""`benchmarks/bench_integrity_cost.py` runs end to end on builtin:demo (a few decode steps in a child
process) and prints each part of the integrity checks' cost and their share of the decode."""

from __future__ import annotations

import re

from tests.helpers import run_benchmark


def test_bench_integrity_cost_runs_and_prints_the_share() -> None:
    out = run_benchmark("bench_integrity_cost.py", "--tokens", "96", "--decode", "6", "--rounds", "1")
    assert "dsa_ties_per_step" in out and "health_parquet" in out
    row = out.strip().splitlines()[-1]
    assert re.search(r"[+-]\d+\.\d+% \(runs", row), row
