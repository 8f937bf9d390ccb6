"""`benchmarks/bench_decode.py` runs end to end on the tiny preset (eager and the static step, no
compile) and prints both floors of its long-context ratio: keys read from cache and streamed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_decode_runs_and_prints_both_floors() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_decode.py"), "--model", "preset:tiny",
                          "--contexts", "256", "512", "--tokens", "2", "--modes", "eager", "static"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "static: latency ratio vs first context" in out.stdout
    floor = next(line for line in out.stdout.splitlines() if line.startswith("indexer keys read per token at 512"))
    assert "from cache" in floor and "streamed from memory" in floor and "x streamed" in floor
