"""`benchmarks/bench_decode_probes.py` runs end to end (tiny preset, eager) and prints one row per listener set."""

from __future__ import annotations

from tests.helpers import run_benchmark


def test_bench_decode_probes_prints_each_family() -> None:
    out = run_benchmark("bench_decode_probes.py", "--preset", "tiny", "--context", "64", "--steps", "12", "--rounds",
                        "1", "--compile", "off", timeout=300)
    rows = [line.split() for line in out.splitlines()[2:] if line.strip()]
    labels = [" ".join(r[:-2]) for r in rows]
    assert labels == ["none", "dsa.topk", "dsa.dense_mass/64", "kda.state", "moe.route", "all four", "none again"]
    assert all(float(r[-2]) > 0 and r[-1].endswith("%") for r in rows) and rows[0][-1] == "+0.0%"
