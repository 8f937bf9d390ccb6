"""`benchmarks/bench_decode.py` runs end to end on the tiny preset (eager and the static step, no
compile) and prints both floors of its long-context ratio: keys read from cache and streamed."""

from __future__ import annotations

from tests.helpers import run_benchmark


def test_bench_decode_runs_and_prints_both_floors() -> None:
    out = run_benchmark("bench_decode.py", "--model", "preset:tiny", "--contexts", "256", "512", "--tokens", "2",
                        "--modes", "eager", "static")
    assert "static: latency ratio vs first context" in out
    floor = next(line for line in out.splitlines() if line.startswith("indexer keys read per token at 512"))
    assert "from cache" in floor and "streamed from memory" in floor and "x streamed" in floor
