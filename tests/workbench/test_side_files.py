"""A trace's side files (`workbench.trace.side_files`): written only into a trace, atomically, and read
back with the size checked before anything is read; every problem a TraceError naming the file."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from workbench.trace.errors import TraceError
from workbench.trace.side_files import SideFile, trace_directory

NOTE = SideFile("note.json", "a note", max_bytes=64)


@pytest.fixture
def trace_dir(tmp_path):
    (tmp_path / "session.json").write_text("{}")
    return tmp_path


def test_written_atomically_into_a_trace_and_read_back(trace_dir) -> None:
    assert NOTE.read_bytes(trace_dir) is None and NOTE.existing(trace_dir) is None
    assert NOTE.write_bytes(trace_dir, b'{"a": 1}') == trace_dir / "note.json"
    NOTE.write_bytes(trace_dir, b'{"a": 2}')
    assert NOTE.read_bytes(trace_dir) == b'{"a": 2}'
    # the temporary is hidden and gone: the name `target.clear_previous_trace` deletes with the session
    assert sorted(os.listdir(trace_dir)) == ["note.json", "session.json"]

    table = pa.table({"x": [1, 2, 3]})
    written = SideFile("t.parquet", "a table", 1 << 20).write_parquet(trace_dir, table)
    assert pq.read_table(written).equals(table)


def test_refused_outside_a_trace_and_when_too_large(tmp_path, trace_dir) -> None:
    with pytest.raises(TraceError, match="not a trace directory .*a note is written into a trace"):
        NOTE.write_bytes(tmp_path / "elsewhere", b"{}")
    (trace_dir / "note.json").write_bytes(b" " * 65)
    for read in (NOTE.existing, NOTE.read_bytes):
        with pytest.raises(TraceError, match=r"note.json: 65 bytes is too large for a note \(at most 64\)"):
            read(trace_dir)
    (trace_dir / "note.json").unlink()
    (trace_dir / "note.json").mkdir()
    with pytest.raises(TraceError, match=r"cannot read the note \(not a regular file\)"):
        NOTE.read_bytes(trace_dir)
    os.rmdir(trace_dir / "note.json")
    os.mkfifo(trace_dir / "note.json")  # would block a plain read forever
    with pytest.raises(TraceError, match=r"cannot read the note \(not a regular file\)"):
        NOTE.read_bytes(trace_dir)
    with pytest.raises(TraceError, match="a trace path must be a str or path, got int"):
        trace_directory(3)
