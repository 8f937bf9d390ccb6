"""`workbench demo --headless` end to end on a tiny checkpoint: recorded chat session, needle report, export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from apps.cli import main
from apps.cli.demo_cmd import NEEDLE, build_documents


def test_documents_hold_the_needle_once() -> None:
    docs, needle_doc, at = build_documents(4096, len)
    assert len(docs) == 4 and sum(len(t) for _, t in docs) >= 4096
    assert docs[needle_doc][1][at:].startswith(NEEDLE)
    assert sum(t.count(NEEDLE) for _, t in docs) == 1


def test_headless_demo_records_and_exports(checkpoint_dir, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ckpt = checkpoint_dir("tiny")
    trace = tmp_path / "traces" / "demo"
    code = main(["demo", "--headless", "--checkpoint", str(ckpt), "--tokens", "512", "--new-tokens", "4",
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
    assert "export (Parquet)" in out and "needle" in out.lower()


def test_demo_refuses_tiny_contexts_and_foreign_directories(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["demo", "--headless", "--tokens", "10", "--trace", str(tmp_path / "t")]) == 2
    (tmp_path / "not-a-trace").mkdir()
    (tmp_path / "not-a-trace" / "keep.txt").write_text("mine")
    assert main(["demo", "--headless", "--trace", str(tmp_path / "not-a-trace")]) == 2
    assert (tmp_path / "not-a-trace" / "keep.txt").exists()
    assert "not a trace" in capsys.readouterr().err
