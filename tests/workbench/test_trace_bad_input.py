"""Bad traces: not there, not a trace, a newer schema, missing parts, corrupt parts, stray temporaries.

Each gives one clear message naming the path (a `TraceError`, never a raw pyarrow traceback), or a
line in `trace.problems` while the rest of the trace stays readable."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.errors import EngineError
from workbench.trace import TraceCorruptError, TraceError, TraceVersionError, TraceWriter, open_trace


def _trace(tmp_path, flushes: int = 3):
    path = tmp_path / "t"
    w = TraceWriter.create(path, {}, fsync=False)
    for step in range(flushes):
        w.append("dsa_dense_mass", layer=3, step=step, rank=0, position=np.arange(10) + 10 * step, mass=np.ones(10))
        w.flush()
    w.close()
    return path


def _part(path, seq: int):
    return path / "dsa_dense_mass" / f"part-{seq:06d}.parquet"


def test_missing_directory_file_and_non_trace(tmp_path):
    with pytest.raises(TraceError, match="does not exist"):
        open_trace(tmp_path / "nope")
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(TraceError, match="not a directory"):
        open_trace(tmp_path / "f.txt")
    with pytest.raises(TraceError, match="has no session.json"):
        open_trace(tmp_path)
    (tmp_path / "session.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(TraceError, match="lacks the schema marker"):
        open_trace(tmp_path)
    (tmp_path / "session.json").write_text("{not json")
    with pytest.raises(TraceCorruptError, match="session.json cannot be read as JSON"):
        open_trace(tmp_path)
    assert issubclass(TraceError, EngineError)


@pytest.mark.parametrize("version, words", [(2, "newer than this workbench reads \\(version 1\\)"),
                                            (0, "no longer reads")])
def test_unknown_schema_versions_are_refused(tmp_path, version, words):
    path = _trace(tmp_path)
    session = json.loads((path / "session.json").read_text())
    session["schema_version"] = version
    (path / "session.json").write_text(json.dumps(session))
    with pytest.raises(TraceVersionError, match=f"schema version {version}, .*{words}"):
        open_trace(path)


def test_missing_parts_are_reported_and_the_rest_is_readable(tmp_path):
    path = _trace(tmp_path, flushes=4)
    _part(path, 1).unlink()
    t = open_trace(path)
    assert len(t.problems) == 1 and "dsa_dense_mass: 1 part(s) missing (part-000001.parquet)" in t.problems[0]
    assert t.table("dsa_dense_mass")["step"].to_pylist() == [0] * 10 + [2] * 10 + [3] * 10
    with pytest.raises(TraceError, match="missing"):
        open_trace(path, strict=True)


def test_a_deleted_last_part_is_noticed_through_the_manifest(tmp_path):
    path = _trace(tmp_path, flushes=3)
    _part(path, 2).unlink()
    t = open_trace(path)
    assert any("part-000002.parquet" in p for p in t.problems)
    assert t.table("dsa_dense_mass").num_rows == 20


@pytest.mark.parametrize("damage", ["truncate", "garbage", "flip_bytes", "wrong_table", "wrong_type"])
def test_corrupt_parts_are_skipped_with_a_problem_naming_the_file(tmp_path, damage):
    path = _trace(tmp_path)
    bad = _part(path, 1)
    data = bytearray(bad.read_bytes())
    if damage == "truncate":
        bad.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "garbage":
        bad.write_bytes(b"this is not parquet" * 20)
    elif damage == "flip_bytes":
        # inside the first data page: the footer still parses, the page checksum does not match
        for i in range(8, 40):
            data[i] ^= 0x5A
        bad.write_bytes(bytes(data))
    elif damage == "wrong_table":
        pq.write_table(pa.table({"x": [1, 2]}), bad)
    else:
        good = pq.read_table(bad)
        pq.write_table(good.set_column(0, "layer", good["layer"].cast(pa.int64())), bad)
    t = open_trace(path)
    rows = t.table("dsa_dense_mass").num_rows
    assert rows == 20
    assert len(t.problems) == 1 and str(bad) in t.problems[0] and "skipped" in t.problems[0]
    with pytest.raises(TraceCorruptError, match=str(bad)):
        open_trace(path, strict=True).check()


def test_stray_temporaries_are_invisible(tmp_path):
    path = _trace(tmp_path)
    (path / "dsa_dense_mass" / ".part-000003.parquet.tmp").write_bytes(b"PAR1 half a part")
    (path / "dsa_dense_mass" / "notes.txt").write_text("ignored")
    t = open_trace(path)
    assert t.problems == [] and t.table("dsa_dense_mass").num_rows == 30
    assert t.check() == []


def test_unknown_table_and_column_requests(tmp_path):
    t = open_trace(_trace(tmp_path))
    with pytest.raises(TraceError, match="unknown trace table 'dsa'"):
        t.table("dsa")
    with pytest.raises(TraceError, match="no column"):
        t.table("dsa_dense_mass", columns=["nope"])
    assert t.table("kda_norms").num_rows == 0 and t.kda_norm_matrix(0)[1].shape == (0, 0)
    assert t.dsa_heatmap(bins=4).shape[0] == 0 and t.moe_counts_matrix().shape == (0, 0)
