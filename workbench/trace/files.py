"""File-level rules of the store, shared by the writer, the reader and export.

- Part names: `part-000000.parquet`; temporaries: `.part-000000.parquet.tmp` (hidden and not
  `*.parquet`, so neither our reader nor a `part-*.parquet` glob in DuckDB ever picks one up).
- Atomic publication: write the temporary, fsync it, `os.replace` it onto the final name, fsync the
  directory (so the rename itself survives a power cut, not only a process kill).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from engine.io.files import file_kind, fsync_dir

PART_RE = re.compile(r"^part-(\d{6,})\.parquet$", re.ASCII)  # ASCII: int() also reads other scripts' digits


def part_name(seq: int) -> str:
    return f"part-{seq:06d}.parquet"


def temp_name(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp")


def list_parts(directory: Path) -> list[tuple[int, Path]]:
    """(sequence number, path) of the visible parts of a table directory, in order; [] if it is absent."""
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []
    parts = []
    for entry in entries:
        m = PART_RE.match(entry.name)
        if m:
            parts.append((int(m.group(1)), Path(entry.path)))
    parts.sort()
    return parts


def not_regular(path: Path) -> str | None:
    """What `path` is when it is not a regular file ("a FIFO", "a directory", ...); None for a regular file."""
    return file_kind(path)



def publish(tmp: Path, final: Path, *, fsync: bool) -> None:
    """Rename a fully written temporary onto its final name."""
    os.replace(tmp, final)
    if fsync:
        fsync_dir(final.parent)


def write_bytes_atomic(path: Path, data: bytes, *, fsync: bool = True) -> None:
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        publish(tmp, path, fsync=fsync)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, obj: dict, *, fsync: bool = True) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode(), fsync=fsync)


def write_parquet_atomic(table: pa.Table, path: Path, options: dict, *, fsync: bool = True) -> int:
    """Write `table` to `path` through a temporary; returns the file size in bytes."""
    tmp = temp_name(path)
    try:
        pq.write_table(table, tmp, **options)
        if fsync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        size = tmp.stat().st_size
        publish(tmp, path, fsync=fsync)
    except BaseException:
        # a failed write (disk full, interrupt) leaves no temporary behind; readers never saw it anyway
        tmp.unlink(missing_ok=True)
        raise
    return size


def remove_stale_temps(directory: Path) -> list[Path]:
    """Delete temporaries a crashed writer left behind (only the writer calls this, never a reader)."""
    removed = []
    for p in directory.glob(".*.tmp"):
        try:
            p.unlink()
            removed.append(p)
        except FileNotFoundError:
            pass
    return removed
