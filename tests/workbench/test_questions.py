"""The six questions answered from one recorded tiny-preset trace: each answer's figures equal the
analysis functions run by hand on the same tables, and every read rate carries its chance value."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import workbench
from apps.cli import main
from engine import load_model
from engine.session import Session
from engine.tokenizer import Tokenizer
from workbench.analysis import layers_reading
from workbench.analysis.chance import chance_of_hit
from workbench.questions import ask_all, needle_readers
from workbench.recorders.policy import ALL


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    model = load_model("preset:tiny", seed=3, dtype=torch.float32)
    session = Session(model, Tokenizer.byte_level(), prefill_chunk=32)
    path = tmp_path_factory.mktemp("q") / "t"
    ids = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    with workbench.record(session, trace=path, policy=dataclasses.replace(ALL, kda_rank_every=64)):
        session.append(ids=ids, name="context")
        list(session.generate(5, temperature=0, stop_ids=()))
    return path


def test_all_six_answer_with_chance(trace_dir):
    trace = workbench.open_trace(trace_dir)
    answers = ask_all(trace)
    assert list(answers) == ["needle", "sink", "image", "kda", "experts", "dense_mass", "memory", "integrity"]
    assert answers["integrity"].line.startswith("Q8 integrity: no faults")  # recorded with the default checks on
    assert "no effects measured" in answers["memory"].line
    assert "chance" in answers["sink"].line and "chance" in answers["dense_mass"].line
    assert "no image" in answers["image"].line
    kda = answers["kda"].frame
    assert set(kda["kind"]) == {"saturates", "forgets"} and np.isfinite(kda["min_eff_rank"]).any()
    q1 = needle_readers(trace, (40, 60))
    answer = (150, 154)
    by_hand = layers_reading(trace.df("dsa_topk"), 40, 60, queries=answer)
    assert q1.frame["read_share"].tolist() == by_hand["read_share"].tolist()
    pos = np.unique(trace.df("dsa_topk")["position"])
    pos = pos[(pos >= 150) & (pos <= 154)]
    expected_chance = np.mean([chance_of_hit(p + 1, 20, 16) for p in pos])
    assert q1.frame["chance"].iloc[0] == pytest.approx(expected_chance)


def test_cli_questions_prints_six_lines(trace_dir, capsys):
    assert main(["questions", str(trace_dir), "--needle", "40:60"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 8 and lines[0].startswith("Q1 needle [40, 60)") and lines[6].startswith("Q7 memory")
    assert lines[7].startswith("Q8 integrity")
    assert main(["questions", str(trace_dir), "--needle", "60:40"]) == 2


def test_image_question_on_a_recorded_image_session(tmp_path):
    """Q3 on a real image session: the merged grid from the token table, the reads of the answer
    generated after the picture, each beside its chance value (as patch_reads computes them)."""
    from workbench.analysis import patch_reads
    from workbench.questions import image_reads
    from workbench.sessions import recorded_session

    with recorded_session("preset:tiny", tmp_path / "t", prefill_chunk=256, progress=False) as run:
        session = run.session
        session.append(workbench.haystack(200, session.tokenizer, seed=1), name="report")
        seg = session.append(image=workbench.chart_picture(), name="chart.png", role="user")
        session.append("What does the chart show?", role="user")
        list(session.generate(6, temperature=0.0, stop_ids=()))
    trace = workbench.open_trace(tmp_path / "t")
    answer = image_reads(trace)
    rows, cols = seg.image["grid_rows"], seg.image["grid_cols"]
    assert f"({rows}x{cols} merged patches)" in answer.line and "chance" in answer.line, answer.line
    gen = [s for s in trace.segments().itertuples() if s.kind == "generated"][-1]
    queries = (int(gen.start), int(gen.end) - 1)
    by_hand = patch_reads(trace.table("dsa_topk", positions=queries), trace.tokens(), seg.id, queries=queries)
    assert answer.frame.equals(by_hand.table())
