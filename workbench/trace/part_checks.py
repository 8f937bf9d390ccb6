"""What a trace's files must hold before any data is read from them.

- `read_session(path)`: session.json exists, is JSON with the schema marker, has a schema version
  this workbench reads, and its fields are within bounds (`bounds.check_session`); otherwise a
  `TraceError` subclass with one line naming the path.
- `read_footer(path, spec)`: a part's Parquet footer has the table's columns with their types; its
  row count and the integer ranges of its indexed columns (from the statistics) become a `Part`,
  which the reader uses to skip parts outside a query. A part whose footer claims more rows or
  decoded bytes than `MAX_PART_ROWS` / `MAX_PART_BYTES` is refused before any page is decoded: Parquet
  encodes a run of equal values in a few bytes, so a file of a few MB can decode to many GB. The
  pages are then held to the footer (`parquet_pages.check_pages`) before the reader decompresses one.
- `strings_as_dictionaries(spec)` / `check_strings(table)`: string columns are decoded as dictionaries
  and expanded only when their expanded size is within the limit (the footer cannot bound it).
- `conform(table, spec)`: a decoded part with the schema's nullability (a part written by another
  tool may declare its columns nullable), or ValueError when a column that allows no null holds one.
- `valueless_columns(meta, spec, columns)`: the nullable columns a part's footer shows to hold no value
  (the reader of a part returns them as nulls without decoding them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from engine.io.files import parse_json, read_limited
from workbench.trace.bounds import MAX_SESSION_BYTES, check_session
from workbench.trace.errors import TraceCorruptError, TraceError, TraceVersionError
from workbench.trace.parquet_pages import read_footer_checked
from workbench.trace.schema import EXPORT_MANIFEST, SCHEMA_NAME, SESSION_FILE, SUPPORTED_VERSIONS, TableSpec

# far above what the writer produces (a part is one flush: at most max_buffer_rows rows or
# max_buffer_bytes buffered; tokens.parquet one row per position) and far below what exhausts memory
MAX_PART_ROWS = 1 << 25
MAX_PART_BYTES = 1 << 30  # decoded size of one part, estimated from its footer
MAX_READ_BYTES = 3 << 30  # decoded size of the parts one `Trace.table` call reads together (all columns)
# decoded bytes of one value by Parquet physical type (strings and half floats: see `_decoded_bytes`)
_VALUE_BYTES = {"BOOLEAN": 1, "INT32": 4, "INT64": 8, "INT96": 12, "FLOAT": 4, "DOUBLE": 8}


@dataclass
class Part:
    """One visible part file and what its footer says."""

    seq: int
    path: Path
    rows: int
    ranges: dict[str, tuple[int, int]] = field(default_factory=dict)  # column -> (min, max) from statistics
    decoded: int = 0  # bytes its columns decode to at least, by its footer (`_decoded_bytes`)


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
        # read through the size limit: a sparse file can claim gigabytes while taking no disk space
        data = read_limited(file, "a trace's session.json", TraceCorruptError, MAX_SESSION_BYTES)
    except OSError as exc:
        raise TraceCorruptError(f"{file} cannot be read as JSON: {exc}") from None
    try:
        session = parse_json(data, str(file), TraceCorruptError)
    except TraceCorruptError as exc:
        raise TraceCorruptError(f"{file} cannot be read as JSON: {str(exc).removeprefix(f'{file}: ')}") from None
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


def read_footer(path: Path, spec: TableSpec) -> tuple[int, dict[str, tuple[int, int]], int]:
    """Rows, integer column ranges and decoded bytes (at least) of a part; raises ValueError/ArrowException
    when it is unusable."""
    meta = read_footer_checked(path)  # bounded before pyarrow decodes it, and consistent before a chunk is read
    if meta.num_rows > MAX_PART_ROWS:
        raise ValueError(f"its footer claims {meta.num_rows:,} rows, more than the {MAX_PART_ROWS:,} a part may hold")
    decoded = _decoded_bytes(meta)
    if decoded > MAX_PART_BYTES:
        raise ValueError(f"its footer claims about {decoded:,} decoded bytes, more than the {MAX_PART_BYTES:,} "
                         "a part may hold")
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
    return meta.num_rows, ranges, decoded


def _decoded_bytes(meta: pq.FileMetaData) -> int:
    """What decoding every column of a part allocates at least, from its footer alone: each leaf's value
    count (a list's items included) times the value's width, plus an offset per row of each column. A
    string column adds its uncompressed page bytes (what its plain-encoded values hold); one encoded
    with a dictionary can expand far beyond that, so the reader decodes strings as dictionaries and
    checks them with `check_strings` before expanding them."""
    total = meta.num_rows * 4 * meta.num_columns
    for rg in range(meta.num_row_groups):
        group = meta.row_group(rg)
        for i in range(group.num_columns):
            chunk = group.column(i)
            width = _VALUE_BYTES.get(chunk.physical_type)
            unpacked = max(chunk.total_uncompressed_size, 0)
            if width is None and chunk.physical_type == "FIXED_LEN_BYTE_ARRAY":  # half floats: 2 bytes
                width = meta.schema.column(i).length
            elif width is None:  # BYTE_ARRAY: an offset per value, the characters in the pages
                width = 4
                total += unpacked
                unpacked = 0
            # the pages are decompressed whole first: what they claim counts where it exceeds the values
            # (`parquet_pages.check_pages` holds the pages to it before one is decompressed)
            total += max(max(chunk.num_values, 0) * max(width, 1), unpacked)
    return total


def check_strings(table: pa.Table, spec: TableSpec, limit: int = MAX_PART_BYTES) -> pa.Table:
    """`table` with the plain string columns of `spec`, read as dictionaries (`strings_as_dictionaries`),
    expanded to plain strings once their expanded size is known to be within `limit` (ValueError naming
    the column otherwise): a few distinct long strings repeated over many rows take a few bytes in the
    file and many gigabytes expanded."""
    for name in strings_as_dictionaries(spec):
        col = table[name] if name in table.column_names else None
        if col is None or not pa.types.is_dictionary(col.type):
            continue
        expanded = 0
        for chunk in col.chunks:
            lengths = pc.binary_length(chunk.dictionary).fill_null(0)
            expanded += pc.sum(pc.take(lengths, chunk.indices)).as_py() or 0
        if expanded > limit:
            raise ValueError(f"column {name} expands to {expanded:,} bytes of text, more than the {limit:,} "
                             "a part may hold")
        table = table.set_column(table.column_names.index(name), name, col.cast(pa.string()))
    return table


def strings_as_dictionaries(spec: TableSpec) -> list[str]:
    """The plain string columns of a table, to be read as dictionaries and expanded by `check_strings`."""
    return [c.name for c in spec.columns if pa.types.is_string(c.type)]


def valueless_columns(meta: pq.FileMetaData, spec: TableSpec, columns: Sequence[str]) -> list[str]:
    """The nullable columns among `columns` that hold no value in a part, by its footer: in every row
    group each of the column's leaves has one level per row and all of them null (a KDA statistic the
    recording policy left out: every row null; a list column of empty lists reads the same).

    Why: decoding such a column still costs as much as a short list per row (noticeable for each
    optional KDA statistic of a 1M-token trace); a reader that has the footer needs not decode it."""
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
