"""`benchmarks/bench_decode_probes.py` runs end to end (tiny preset, eager) and prints one row per listener set."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_decode_probes_prints_each_family() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_decode_probes.py"), "--preset", "tiny",
                          "--context", "64", "--steps", "12", "--rounds", "1", "--compile", "off"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines()[2:] if line.strip()]
    labels = [" ".join(r[:-2]) for r in rows]
    assert labels == ["none", "dsa.topk", "dsa.dense_mass/64", "kda.state", "moe.route", "all four", "none again"]
    assert all(float(r[-2]) > 0 and r[-1].endswith("%") for r in rows) and rows[0][-1] == "+0.0%"
