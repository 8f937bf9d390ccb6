"""Issue 11 items 1, 8, 11 (trace side): sizes from a trace are checked before anything is allocated;
only regular files are opened; malformed session.json fields give one line naming the file and field."""

from __future__ import annotations

import json
import os
import resource
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from workbench.trace import TraceCorruptError, TraceError, TraceWriter, open_trace
from workbench.trace.aggregates import DenseSums
from workbench.trace.schema import TABLES, parquet_options


def _trace(tmp_path, session: dict | None = None):
    path = tmp_path / "t"
    w = TraceWriter.create(path, session if session is not None else
                           {"model": {"layers": 8, "num_experts": 16, "max_position_embeddings": 4096}},
                           fsync=False)
    for step in range(2):
        w.append("dsa_key_counts", layer=3, step=step, rank=0, key_bin=np.arange(4), count=np.ones(4, np.int64))
        w.append("moe_counts", layer=2, step=step, rank=0, segment=0, modality="text", expert=np.arange(16),
                 count=np.ones(16, np.int64))
        w.flush()
    w.close()
    return path


def _write_part(path, name: str, seq: int, statistics: bool = True, **columns):
    """A one-row part copied from part 0 with some columns changed (written as a writer would)."""
    spec = TABLES[name]
    table = pq.read_table(path / name / "part-000000.parquet").slice(0, 1)
    for col, value in columns.items():
        table = table.set_column(table.column_names.index(col), col, pa.array([value], table[col].type))
    out = path / name / f"part-{seq:06d}.parquet"
    pq.write_table(table, out, **{**parquet_options(spec), "write_statistics": statistics})
    return out


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("statistics", [True, False])
def test_a_tiny_part_with_a_huge_key_bin_is_skipped_not_allocated(tmp_path, statistics):
    path = _trace(tmp_path)
    bad = _write_part(path, "dsa_key_counts", 2, statistics=statistics, key_bin=400_000_000)
    assert bad.stat().st_size < 16384  # one row: the file is its footer and the schema's column notes
    before = _peak_rss_mib()
    t = open_trace(path)
    heat = t.dsa_heatmap(bins=16)
    assert heat.shape[0] == 1 and heat.sum() == 8  # columns: at most the recording's bins (issue 42)
    assert _peak_rss_mib() - before < 200
    assert len(t.problems) == 1 and str(bad) in t.problems[0] and "key_bin" in t.problems[0]
    assert "skipped" in t.problems[0]
    with pytest.raises(TraceCorruptError, match="key_bin"):
        open_trace(path, strict=True).dsa_heatmap()


@pytest.mark.parametrize("column, value", [("expert", 30000), ("layer", 9), ("layer", -1)])
def test_experts_and_layers_beyond_the_model_are_refused(tmp_path, column, value):
    path = _trace(tmp_path)
    bad = _write_part(path, "moe_counts", 2, statistics=False, **{column: value})
    t = open_trace(path)
    m = t.moe_counts_matrix()
    assert m.shape == (1, 16) and m.sum() == 32
    assert len(t.problems) == 1 and str(bad) in t.problems[0] and column in t.problems[0]


def test_without_model_facts_type_limits_still_bound_the_sizes(tmp_path):
    # a trace without a model summary: positions are int32, so key_bin < 2**31 / dsa_bin_tokens
    path = _trace(tmp_path, session={})
    bad = _write_part(path, "dsa_key_counts", 2, statistics=False, key_bin=400_000_000)
    t = open_trace(path)
    assert t.dsa_heatmap(bins=4).sum() == 8
    assert any(str(bad) in p and "column key_bin spans 400000000..400000000" in p for p in t.problems)


def test_dense_sums_refuse_before_allocating():
    sums = DenseSums(("layer",), "key_bin", "count", max_cells=1000)
    with pytest.raises(ValueError, match="dense cells"):
        sums.add("p", pa.table({"layer": pa.array([0], pa.int16()), "key_bin": pa.array([5000], pa.int32()),
                                "count": pa.array([1], pa.int64())}))
    assert sums.sums == {}


def _edit_session(path, **fields):
    file = path / "session.json"
    session = json.loads(file.read_text())
    session.update(fields)
    file.write_text(json.dumps(session))


@pytest.mark.parametrize("fields, words", [
    ({"parts": ["dsa_key_counts"]}, "field `parts` must be an object"),
    ({"parts": {"dsa_key_counts": "abc"}}, "parts.dsa_key_counts"),
    ({"tokens": -5}, "field `tokens`"),
    ({"tokens": 2 ** 70}, "field `tokens`"),
    ({"policy": {"dsa_bin_tokens": 0}}, "policy.dsa_bin_tokens"),
    ({"policy": [1, 2]}, "field `policy` must be an object"),
    ({"model": {"num_experts": 10 ** 12}}, "model.num_experts"),
    ({"model": {"summary": {"num_experts": "x"}}}, "model.summary.num_experts"),
    ({"segments": [{"id": 0, "kind": "document", "start": 0}]}, r"segments\[0\] lacks end"),
    ({"segments": [{"id": 0, "kind": "document", "start": 5, "end": 2}]}, r"segments\[0\].end"),
    ({"segments": {"a": 1}}, "field `segments` must be a list"),
])
def test_malformed_session_fields_are_one_line_naming_the_field(tmp_path, fields, words):
    path = _trace(tmp_path)
    _edit_session(path, **fields)
    with pytest.raises(TraceCorruptError, match=words) as info:
        open_trace(path)
    assert "session.json" in str(info.value) and "\n" not in str(info.value)


def test_a_billion_parts_claimed_costs_nothing(tmp_path):
    path = _trace(tmp_path)
    _edit_session(path, parts={"dsa_key_counts": 10 ** 9})
    t = open_trace(path)
    assert any("999999998 part(s) missing (part-000002.parquet" in p for p in t.problems)


def _with_timeout(fn, seconds: float = 10.0):
    result: dict = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            result["error"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "blocked (opened a FIFO?)"
    if "error" in result:
        raise result["error"]
    return result.get("value")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_in_place_of_a_part_is_skipped_not_opened(tmp_path):
    path = _trace(tmp_path)
    fifo = path / "dsa_key_counts" / "part-000002.parquet"
    os.mkfifo(fifo)
    t = _with_timeout(lambda: open_trace(path))
    assert any(str(fifo) in p and "a FIFO, not a regular file" in p for p in t.problems)
    assert t.dsa_heatmap(bins=2).sum() == 8
    with pytest.raises(TraceCorruptError, match="FIFO"):
        _with_timeout(lambda: open_trace(path, strict=True))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_export_does_not_hang_on_a_fifo(tmp_path):
    from workbench.trace.export import export_trace
    path = _trace(tmp_path)
    os.mkfifo(path / "moe_counts" / "part-000002.parquet")
    with pytest.raises(TraceError, match="FIFO"):
        _with_timeout(lambda: export_trace(path, tmp_path / "out", fmt="parquet"))


def test_session_json_that_is_a_fifo_or_directory(tmp_path):
    path = _trace(tmp_path)
    (path / "session.json").unlink()
    (path / "session.json").mkdir()
    with pytest.raises(TraceError, match="not a regular file"):
        open_trace(path)
    if hasattr(os, "mkfifo"):
        (path / "session.json").rmdir()
        os.mkfifo(path / "session.json")
        with pytest.raises(TraceError, match="not a regular file"):
            _with_timeout(lambda: open_trace(path))
