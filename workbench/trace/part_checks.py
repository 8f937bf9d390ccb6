"""What a trace's files must hold before any data is read from them.

- `read_session(path)`: session.json exists, is JSON with the schema marker, has a schema version
  this workbench reads, and its fields are within bounds (`bounds.check_session`); otherwise a
  `TraceError` subclass with one line naming the path.
- `read_footer(path, spec)`: a part's Parquet footer has the table's columns with their types; its
  row count and the integer ranges of its indexed columns (from the statistics) become a `Part`,
  which the reader uses to skip parts outside a query.
- `conform(table, spec)`: a decoded part with the schema's nullability (a part written by another
  tool may declare its columns nullable), or ValueError when a column that allows no null holds one.
- `valueless_columns(meta, spec, columns)`: the nullable columns a part's footer shows to hold no value
  (the reader of a part returns them as nulls without decoding them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from workbench.trace.bounds import check_session
from workbench.trace.errors import TraceCorruptError, TraceError, TraceVersionError
from workbench.trace.schema import EXPORT_MANIFEST, SCHEMA_NAME, SESSION_FILE, SUPPORTED_VERSIONS, TableSpec


@dataclass
class Part:
    """One visible part file and what its footer says."""

    seq: int
    path: Path
    rows: int
    ranges: dict[str, tuple[int, int]] = field(default_factory=dict)  # column -> (min, max) from statistics


def read_session(path: Path) -> dict:
    """Read and validate session.json of the trace at `path` (raises TraceError subclasses)."""
    if not path.exists():
        raise TraceError(f"no trace at {path}: the directory does not exist")
    if not path.is_dir():
        raise TraceError(f"{path} is not a trace: not a directory")
    file = path / SESSION_FILE
    if (path / EXPORT_MANIFEST).is_file():
        raise TraceError(f"{path} is an export written by `workbench export`, not a trace; read its files "
                         f"directly (its {EXPORT_MANIFEST} names the source trace)")
    if not file.is_file():
        if file.exists():
            raise TraceError(f"{file} is not a regular file; a trace's {SESSION_FILE} must be one")
        raise TraceError(f"{path} is not a K3 Workbench trace: it has no {SESSION_FILE}")
    try:
        session = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceCorruptError(f"{file} cannot be read as JSON: {exc}") from None
    if not isinstance(session, dict) or session.get("schema") != SCHEMA_NAME:
        raise TraceError(f"{path} is not a K3 Workbench trace: {SESSION_FILE} lacks the schema marker "
                         f"\"schema\": \"{SCHEMA_NAME}\"")
    version = session.get("schema_version")
    if not isinstance(version, int):
        raise TraceCorruptError(f"{file}: schema_version must be an integer, got {version!r}")
    supported = ", ".join(map(str, SUPPORTED_VERSIONS))
    if version > max(SUPPORTED_VERSIONS):
        raise TraceVersionError(f"{path} was written with trace schema version {version}, newer than this "
                                f"workbench reads (version {supported}); upgrade k3-workbench to open it")
    if version not in SUPPORTED_VERSIONS:
        raise TraceVersionError(f"{path} has trace schema version {version}, which this workbench no longer "
                                f"reads (it reads version {supported})")
    check_session(session, file)
    return session


def read_footer(path: Path, spec: TableSpec) -> tuple[int, dict[str, tuple[int, int]]]:
    """Rows and integer column ranges of a part; raises ValueError/ArrowException when it is unusable."""
    meta = pq.read_metadata(path)
    arrow = meta.schema.to_arrow_schema()
    missing = [c.name for c in spec.columns if c.name not in arrow.names]
    if missing:
        raise ValueError(f"missing column(s) {', '.join(missing)}")
    for c in spec.columns:
        found = arrow.field(c.name).type
        if found != c.type:
            raise ValueError(f"column {c.name} has type {found}, expected {c.type}")
    ranges: dict[str, tuple[int, int]] = {}
    for name in ("layer", "position", "step", "key_bin", "expert", "segment", "image_id"):
        if name not in arrow.names or meta.num_row_groups == 0:
            continue
        col = arrow.names.index(name)
        lo = hi = None
        for rg in range(meta.num_row_groups):
            stats = meta.row_group(rg).column(col).statistics
            if stats is None or not stats.has_min_max:
                lo = None
                break
            lo = stats.min if lo is None else min(lo, stats.min)
            hi = stats.max if hi is None else max(hi, stats.max)
        if lo is not None:
            ranges[name] = (int(lo), int(hi))
    return meta.num_rows, ranges


def valueless_columns(meta: pq.FileMetaData, spec: TableSpec, columns: Sequence[str]) -> list[str]:
    """The nullable columns among `columns` that hold no value in a part, by its footer: in every row
    group each of the column's leaves has one level per row and all of them null (a KDA statistic the
    recording policy left out: every row null; a list column of empty lists reads the same).

    Why: decoding such a column still costs as much as a short list per row (0.17 s for each of the
    five optional KDA statistics of a 1M-token trace); a reader that has the footer needs not decode it."""
    nullable = [c for c in columns if c in spec.arrow_schema.names and spec.arrow_schema.field(c).nullable]
    if not nullable or meta.num_row_groups == 0:
        return []
    leaves: dict[str, list[int]] = {}
    for i in range(meta.num_columns):
        leaves.setdefault(meta.schema.column(i).path.split(".")[0], []).append(i)

    def no_value(group: pq.RowGroupMetaData, i: int) -> bool:
        stats = group.column(i).statistics
        return stats is not None and stats.has_null_count and \
            stats.null_count == group.column(i).num_values == group.num_rows

    groups = [meta.row_group(rg) for rg in range(meta.num_row_groups)]
    out = [name for name in nullable
           if leaves.get(name) and all(no_value(g, i) for g in groups for i in leaves[name])]
    return out


def conform(table: pa.Table, spec: TableSpec) -> pa.Table:
    """`table` (a decoded part; its column types were checked on its footer) with the trace schema's
    nullability, so that parts written by different writers concatenate; raises ValueError naming the
    column when one the schema declares not null holds nulls. Extra columns are left as they are."""
    fields, changed = [], False
    for f in table.schema:
        want = spec.arrow_schema.field(f.name) if f.name in spec.arrow_schema.names else f
        if f.nullable != want.nullable:
            if not want.nullable and table[f.name].null_count:
                raise ValueError(f"column {f.name} holds {table[f.name].null_count} null(s); the trace schema "
                                 "allows none")
            f, changed = f.with_nullable(want.nullable), True
        fields.append(f)
    return table.cast(pa.schema(fields, metadata=table.schema.metadata)) if changed else table
