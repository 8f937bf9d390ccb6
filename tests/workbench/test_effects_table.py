"""The trace's effects table (`effects.parquet`): rows beside their controls, readable by pandas and
DuckDB with column descriptions, merged per check, refused when not one, cleared with its recording;
and the "which memory did the answer depend on?" question answered from it."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pyarrow.parquet as pq
import pytest

from workbench.questions import memory_dependence
from workbench.trace.effects_table import EFFECTS_FILE, COLUMNS, effect_row, read_effects, rows_from_attribution, write_effects
from workbench.trace.errors import TraceError
from workbench.trace.target import clear_previous_trace


@pytest.fixture
def trace_dir(tmp_path):
    (tmp_path / "session.json").write_text("{}")
    return tmp_path


def needle_rows() -> list[dict]:
    return [effect_row("needle", "4-7-1-9", "dsa.hide", effect=-14.7, controls=[0.01], plain=-0.3,
                       segment="needle", span=(100, 150), layer=5, fork_at=900),
            effect_row("needle", "4-7-1-9", "dsa.hide", effect=-0.2, controls=[0.01], plain=-0.3,
                       segment="needle", span=(100, 150), layer=2, fork_at=900)]


def test_rows_round_trip_with_descriptions_and_merge_per_check(trace_dir) -> None:
    write_effects(trace_dir, needle_rows())
    frame = read_effects(trace_dir)
    assert list(frame.columns) == list(COLUMNS) and len(frame) == 2
    assert frame.loc[0, "size"] == 50 and frame.loc[0, "layer"] == "5" and frame.loc[0, "control_mean"] == 0.01
    schema = pq.read_schema(trace_dir / EFFECTS_FILE)
    assert b"nats" in schema.field("effect").metadata[b"description"]
    assert b"k3wb.column.control_mean" in schema.metadata
    # a sweep's rows are added beside the needle's; writing the needle again replaces only its rows
    sweep = pd.DataFrame([{"op": "moe.ban", "segment": None, "layer": "3", "heads": None, "experts": [4, 9],
                           "size": 2, "effect": -1.0, "control_mean": -0.1, "control_min": -0.2,
                           "control_max": 0.0, "plain": -0.3}])
    write_effects(trace_dir, rows_from_attribution(sweep, "sweep", "4-7-1-9", controls=3))
    write_effects(trace_dir, needle_rows()[:1])
    frame = read_effects(trace_dir)
    assert sorted(frame["check_name"]) == ["needle", "sweep"]
    assert frame.loc[frame["check_name"] == "sweep", "experts"].item() == "[4, 9]"
    assert not (trace_dir / f".{EFFECTS_FILE}.tmp").exists()


def test_memory_question_names_the_largest_drop_beside_its_control(trace_dir) -> None:
    trace = SimpleNamespace(path=trace_dir)
    assert "no effects measured" in memory_dependence(trace).line
    write_effects(trace_dir, needle_rows() + [effect_row("picture", "red", "dsa.hide", effect=0.1, controls=[0.0],
                                                         plain=-0.1, segment="picture", span=(200, 216))])
    line = memory_dependence(trace).line
    assert ("needle ('4-7-1-9', log p -0.30, dsa.hide): hiding needle from layer 5 lowered the answer's "
            "log-probability by 14.7 nats; 1 random span of the same size changed it by +0.01 to +0.01; no verdict: "
            "1 control(s) cannot tell a drop from a lucky draw (8 needed) (rank 1 of 2, p = 0.50)") in line
    assert "picture" in line and "hiding picture raised" in line
    # eight controls decide; a row where no control fitted says so and gives no verdict
    eight = [0.01 * i for i in range(8)]
    write_effects(trace_dir, [effect_row("fact", "7142", "dsa.hide", effect=-12.3, controls=eight, plain=-0.2,
                                         segment="the fact", span=(10, 22)),
                              effect_row("doc", "7142", "dsa.hide", effect=-12.3, controls=[], plain=-0.2,
                                         segment="notes.txt", span=(5, 8521))])
    line = memory_dependence(trace).line
    assert ("hiding the fact lowered the answer's log-probability by 12.3 nats; 8 random spans of the same size "
            "changed it by +0.00 to +0.07: the answer depends on the fact (rank 1 of 9, p = 0.11)") in line
    assert "hiding notes.txt lowered the answer's log-probability by 12.3 nats; no verdict: no control fitted" in line


def test_a_bad_effects_file_is_a_clear_error_and_a_new_recording_clears_it(trace_dir) -> None:
    (trace_dir / EFFECTS_FILE).write_bytes(b"not parquet")
    with pytest.raises(TraceError, match="not a readable Parquet effects table"):
        read_effects(trace_dir)
    with pytest.raises(TraceError, match="not a trace directory"):
        write_effects(trace_dir / "elsewhere", needle_rows())
    (trace_dir / "notes.txt").write_text("mine")
    clear_previous_trace(trace_dir)
    assert not (trace_dir / EFFECTS_FILE).exists() and (trace_dir / "notes.txt").exists()
