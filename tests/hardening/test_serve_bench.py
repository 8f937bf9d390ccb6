"""Issue 42 item 19: `benchmarks/bench_serve.py` fails loudly rather than print `nan`.

On the landed tree its turn 1 asked builtin:demo for 8 tokens, all chat scaffold: no text, so a `nan`
TTFT and "0 cached" (the empty reply was replaced by "ok", which no cached state ends in). Now turn 1
is the find-fact template's question, which the demo answers with text, and a figure that could not
be measured stops the run with one line and exit 1.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_serve  # noqa: E402

DEMO = "builtin:demo"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, None])
def test_a_figure_that_was_not_measured_stops_the_run(value) -> None:
    with pytest.raises(bench_serve.BenchFailure, match="was not measured"):
        bench_serve.measured(value, "the TTFT of turn 1")
    assert bench_serve.measured(0.25, "x") == 0.25


@pytest.fixture(scope="module")
def demo():
    from engine.builtin import ROOT
    from workbench.sessions import load_with_tokenizer

    if not (ROOT / "demo" / "config.json").exists():
        pytest.skip("builtin:demo not installed (train it: training/README.md)")
    return load_with_tokenizer(DEMO)


def test_turn_one_is_a_question_the_demo_answers_with_text(demo) -> None:
    model, tokenizer = demo
    server, client = bench_serve.start_server(model, tokenizer, DEMO, 512, 1 << 30)
    try:
        turn1 = bench_serve.fact_conversation(tokenizer, 256)
        first = bench_serve.streamed(client, DEMO, turn1, bench_serve.REPLY_TOKENS)
        assert first["text"] and math.isfinite(first["ttft_s"]) and first["ttft_s"] > 0
        turn2 = turn1 + [{"role": "assistant", "content": first["text"]}] + turn1[-1:]
        assert bench_serve.streamed(client, DEMO, turn2, bench_serve.REPLY_TOKENS)["cached"] > first["prompt"]
        # a reply of scaffold only (one token) has no text: a failure, not a nan
        with pytest.raises(bench_serve.BenchFailure, match="no text"):
            bench_serve.streamed(client, DEMO, turn1, 1)
    finally:
        server.stop()


def test_the_benchmark_prints_measured_figures_or_fails_in_one_line(demo, monkeypatch, capsys) -> None:
    argv = ["--tokens", "256", "--decode", "48", "--repeats", "1", "--threads", "1"]
    assert bench_serve.main(argv) == 0
    out = capsys.readouterr().out
    assert "nan" not in out, out
    assert int(re.search(r"prefix reused .* (\d+) cached", out).group(1)) > 0, out
    ttfts = [float(x) for x in re.findall(r"TTFT\s+([0-9.]+) s", out)]
    assert len(ttfts) == 3 and all(t > 0 for t in ttfts), out
    monkeypatch.setattr(bench_serve, "REPLY_TOKENS", 1)
    assert bench_serve.main(argv) == 1
    captured = capsys.readouterr()
    assert "nan" not in captured.out
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("bench_serve: FAILED:") and "no text" in line
