"""`workbench demo --headless` end to end on a tiny checkpoint: recorded chat session, needle report, export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from apps.cli import main
from workbench.causal.demo_check import CausalCheck, CheckRow, check_lines, effects_rows, top_reader
from apps.cli.demo_cmd import PASSCODE, answer_queries, build_documents, report_lines, wording


@pytest.mark.parametrize("name", ["train", "held-out"])
def test_documents_hold_the_needle_once(name: str) -> None:
    words = wording(name)
    docs, needle_doc, at = build_documents(4096, len, words=words)
    assert len(docs) == 4 and 0.9 * 4096 <= sum(len(t) for _, t in docs) <= 4096 + len(words.needle)
    needle = words.needle
    assert PASSCODE in needle and docs[needle_doc][1][at:].startswith(needle)
    assert sum(t.count(needle) for _, t in docs) == 1
    # the trained model's own templates: the needle and question of one task family in that world
    assert words.system in words.world.systems
    assert any(needle == t.format(k=words.key, v=PASSCODE) for t in words.world.needles)
    assert any(words.question == q.format(k=words.key) for q in words.world.needle_questions)


def test_report_prints_answer_verdict_and_chance() -> None:
    import pandas as pd

    readers = pd.DataFrame([{"layer": 3, "queries": 7, "read_share": 1.0, "chance": 0.12, "ratio": 1 / 0.12},
                            {"layer": 6, "queries": 7, "read_share": 0.0, "chance": 0.12, "ratio": 0.0}])
    lines = report_lines({"answer": "4-7-1-9", "scaffold_ok": True, "correct": True, "expected": PASSCODE,
                          "readers": readers})
    assert lines[0] == "answer: 4-7-1-9 - right"
    assert "layer 3: 100% of 7 answer tokens read the needle, chance 12%, 8.3x" in lines[2]
    wrong = report_lines({"answer": "<|close|>x", "scaffold_ok": False, "correct": False, "expected": PASSCODE,
                          "readers": readers})
    assert "wrong (the passcode is 4-7-1-9)" in wrong[0] and "no response section" in wrong[0]


def test_headless_demo_records_and_exports(checkpoint_dir, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ckpt = checkpoint_dir("tiny")
    trace = tmp_path / "traces" / "demo"
    code = main(["demo", "--headless", "--model", str(ckpt), "--tokens", "512", "--new-tokens", "4",
                 "--trace", str(trace), "--prefill-chunk", "256"])
    out = capsys.readouterr().out
    assert code == 0, out
    session = json.loads((trace / "session.json").read_text())
    assert session["status"] == "complete"
    start, end = session["demo"]["needle"]
    assert 0 < start < end <= session["tokens"]
    kinds = [s["kind"] for s in session["segments"]]
    assert kinds[0] == "turn" and kinds.count("document") == 2 and kinds[-1] == "generated"
    image = next(s for s in session["segments"] if s["kind"] == "image")  # the demo shows the image overlay
    assert (trace / image["thumbnail"]).is_file() and image["image"]["grid_rows"] > 0
    assert (tmp_path / "traces" / "demo-export" / "tokens.parquet").is_file()
    assert "export (Parquet)" in out and "answer:" in out and "chance" in out
    # the causal check after the answers: the needle's and the picture's, each beside 8 disjoint controls
    checks = out.split("causal check: ")[1:]
    assert [c.split(" ", 2)[1] for c in checks] == ["needle", "picture"]
    needle_check = checks[0].splitlines()
    assert f"[{start}, {end}) hidden" in needle_check[0] and "nothing hidden" in needle_check[2]
    assert "8 random" in needle_check[1] and "none overlapping it or each other" in needle_check[1]
    assert any("hidden from every DSA layer" in line for line in needle_check)
    verdicts = [line.strip() for line in needle_check if line.strip().startswith("hiding the needle")]
    # a 512-token context may hold fewer than 8 disjoint 50-token controls: then no verdict, saying why
    assert verdicts and all("random span" in v and "of the same size changed it by" in v for v in verdicts)
    assert all(("the answer depends on the needle" in v or "from a random span of the same size" in v
                or "no verdict: only " in v) for v in verdicts), verdicts
    # ... and its rows in the trace's effects table, for `workbench questions`
    from workbench.trace.effects_table import read_effects

    effects = read_effects(trace)
    assert set(effects["check_name"]) == {"needle", "picture"} and (effects["controls"] >= 1).all()
    assert (effects["controls"] <= 8).all()


def test_demo_refuses_tiny_contexts_and_foreign_directories(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["demo", "--headless", "--tokens", "10", "--trace", str(tmp_path / "t")]) == 2
    (tmp_path / "not-a-trace").mkdir()
    (tmp_path / "not-a-trace" / "keep.txt").write_text("mine")
    assert main(["demo", "--headless", "--trace", str(tmp_path / "not-a-trace")]) == 2
    assert (tmp_path / "not-a-trace" / "keep.txt").exists()
    assert "holds no trace" in capsys.readouterr().err


def test_answer_queries_are_the_passcode_tokens() -> None:
    pieces = ["<|close|>", "think", "<|sep|>", "<|open|>", "response", "<|sep|>"] + list("4-7-1-9") + ["<|close|>"]
    # generated token i at position 100 + i; the passcode is tokens 6..12, produced by queries 105..111
    assert answer_queries(pieces, 100, "4-7-1-9") == (105, 111)
    wrong = pieces[:6] + list("77") + ["<|close|>"]
    assert answer_queries(wrong, 100, "4-7-1-9") == (105, 106)
    assert answer_queries(list("noise"), 100, "4-7-1-9") is None
    # a prompt that prefilled the response (`hidden cellar: `): the generated text is the value on
    prefilled = list("4-7-1-9") + ["<|close|>"]
    assert answer_queries(prefilled, 100, "4-7-1-9", prefilled=True) == (99, 105)


def test_causal_check_lines_show_each_branch_beside_the_plain_rerun_and_the_control() -> None:
    import pandas as pd

    readers = pd.DataFrame([{"layer": 2, "read_share": 0.0, "ratio": 0.0},
                            {"layer": 5, "read_share": 1.0, "ratio": 10.8}])
    assert top_reader(readers) == 5
    assert top_reader(readers.assign(read_share=0.0)) is None   # no layer read it: no "top reader" row
    controls = tuple(-0.01 * i for i in range(8))
    rows = [CheckRow("nothing hidden", None, "", "key: 4-7-1-9", "4-7-1-9", -0.05),
            CheckRow("hidden from every DSA layer", (400, 450), "all", "key: 99", "99", -14.9, controls,
                     "hiding the needle lowered the answer's log-probability by 14.8 nats; 8 random spans of the same "
                     "size changed it by -0.07 to +0.00: the answer depends on the needle", "rank 1 of 9, p = 0.11")]
    spans = tuple((100 + 60 * i, 150 + 60 * i) for i in range(8))
    check = CausalCheck("needle", PASSCODE, (400, 450), 2000, rows, spans)
    lines = check_lines(check)
    assert "the needle [400, 450) hidden" in lines[0] and "2,000-token prefix" in lines[0]
    assert "8 random 50-token spans" in lines[1]
    assert lines[2].endswith("right, log p -0.05")
    assert "wrong, log p -14.90 (-14.85)" in lines[3]
    assert lines[4].strip().endswith("the answer depends on the needle (rank 1 of 9, p = 0.11)")
    (row,) = effects_rows(check)
    assert row["controls"] == 8 and row["control_min"] == pytest.approx(-0.07)
    assert row["effect"] == pytest.approx(-14.85)
