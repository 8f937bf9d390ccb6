"""The trace format, version 1, written down as data: tables, columns, Arrow types, docs, encodings.

Layout of a trace (one directory per session)::

    TRACE/
      session.json                      # schema marker + version, model, engine, policy, segments, timings, status
      tokens.parquet                    # the token table, compacted when the writer closes
      images/<segment id>.png           # thumbnail of each image segment (longest side <= 512 px)
      tokens/part-000000.parquet ...    # the token table while the session is live (gone after close)
      dsa_topk/part-000000.parquet ...  # every other table: a directory of rolled part files
      ...
      summaries/                        # optional: the dashboard's reductions of the finished trace (Arrow,
                                        # JSON), keyed by the parts' content; never read by `Trace`

Rules that make the store crash-safe and followable:
- A part is written under a hidden temporary name (`.part-000007.parquet.tmp`), fsynced, then renamed
  to `part-000007.parquet`. Readers only look at `part-*.parquet`, so a crash (or a reader racing the
  writer, even over a shared file system) never sees a half-written part. Part numbers are dense per
  table; a gap means a part was lost after the fact, and readers report it.
- `session.json` is rewritten the same way (temporary file, fsync, `os.replace`). After each flush it
  lists how many parts each table has (`parts`), so a reader can tell a deleted last part from one that
  was never written.
- Every part carries the Arrow schema of its table, so pandas, polars and DuckDB read the files with no
  project code (`SELECT layer, sum(count) FROM read_parquet('TRACE/dsa_key_counts/part-*.parquet') GROUP
  BY layer`).

Signal tables say which probe signal they are recorded from (`TableSpec.signal`, declared with its
payload fields in `engine.probes.SIGNALS`); a column that holds a payload field names it
(`Column.field`), and the recorder fills exactly those columns from the emitted tensors.

Signal tables tag every row with `layer` (model layer index), `step` (a session-wide forward counter:
each prefill chunk and each decode token is one step, so it only grows) and `rank` (the process that
recorded the row). Positions are sequence positions, never KV-cache slots; experts are logical ids.

Why aggregates are stored as per-flush deltas (tables with kind "delta"): the store stays append-only
(a part is never rewritten, so there is nothing to lose in a crash and nothing for a follower to
re-read), and a flush only writes the bins that changed. A dense snapshot of the heat map per flush
would be layers x bins x 8 bytes every second (24 x 4096 x 8 = 786 KB at 1M tokens, 2.8 GB over an
hour of flushes) and mostly repeat the previous one. The current value is the SUM over rows; within
one flush the writer coalesces rows with equal keys, and `step` is the last step the delta covers.

Why Parquet for the dense-ish signals too (KDA norms, top-k lists) rather than Zarr: they are
appended row by row as the session runs (a norm vector per measured position, a key list per query),
which is exactly a rolled Parquet part; one format keeps the trace readable by DuckDB/pandas/polars
with no extra dependency, and per-layer matrices are rebuilt by the reader in milliseconds. Lists use
DELTA_BINARY_PACKED (sorted key positions cost ~2.5 bytes each instead of 4) and float lists use
BYTE_STREAM_SPLIT + zstd.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np
import pyarrow as pa

from engine.probes import SIGNALS
from workbench.trace.errors import TraceError

SCHEMA_NAME = "k3-workbench-trace"
SCHEMA_VERSION = 1
SUPPORTED_VERSIONS = (1,)

SESSION_FILE = "session.json"
TOKENS_FILE = "tokens.parquet"
IMAGES_DIR = "images"  # image segments' thumbnails, named by the segment's "thumbnail"
EXPORT_MANIFEST = "export.json"  # marks a `workbench export` directory (which also holds a session.json)
PART_GLOB = "part-*.parquet"

SEGMENT_KINDS = ("document", "turn", "image", "generated")
MODALITIES = ("text", "image")
STATUSES = ("recording", "complete", "failed")

# policy keys the reader depends on, with the values assumed when a trace omits them
POLICY_DEFAULTS = {
    "dsa_bin_tokens": 256,  # width in tokens of a dsa_key_counts bin
    "sink_tokens": 4,  # a query "hits the sink" when it selects one of the first sink_tokens positions
}

Encoding = Literal["plain", "dict", "delta", "bss"]
MODALITY_TYPE = pa.dictionary(pa.int8(), pa.string())


class Column(NamedTuple):
    """One column: name, Arrow type, what it holds; whether it may be null; its Parquet encoding; the
    probe payload field it holds, if any (a field of the table's `signal`, batch row dropped)."""

    name: str
    type: pa.DataType
    doc: str
    nullable: bool = False
    # dict: few distinct values (RLE'd dictionary); delta: sorted or slowly changing integers;
    # bss: floats (byte-stream-split groups exponent bytes so zstd finds them); plain: everything else
    encoding: Encoding = "plain"
    field: str | None = None


@dataclass(frozen=True)
class TableSpec:
    """A table of the trace.

    Attributes:
        name: directory name of the table (and file stem in exports).
        doc: what one row means.
        columns: the columns in order (the tag columns first for signal tables).
        kind: "rows" (each row is a record) or "delta" (rows are increments; the value is their sum).
        sums: for delta tables, columns added up when rows with equal keys are coalesced.
        maxes: for delta tables, columns that take the maximum when coalesced (`step`, `position`).
        ragged_key: list column whose negative entries mark padding in 2-D input; the padded slots
            are dropped from every list column of the row.
        ascending: the writer stores each `ragged_key` list in ascending order (aligned lists follow).
        cache: whether a reader keeps the table in memory (small tables) or reads it on demand.
        signal: the probe signal (`engine.probes.SIGNALS`) the table is recorded from, if any.
    """

    name: str
    doc: str
    columns: tuple[Column, ...]
    kind: Literal["rows", "delta"] = "rows"
    sums: tuple[str, ...] = ()
    maxes: tuple[str, ...] = ()
    ragged_key: str | None = None
    ascending: bool = False
    cache: bool = True
    signal: str | None = None
    arrow_schema: pa.Schema = field(init=False, repr=False, compare=False)
    # column name -> (kind: "int" | "float" | "string" | "list", numpy dtype of the values), for the writer
    meta: dict[str, tuple[str, np.dtype]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        cited = [c.field for c in self.columns if c.field is not None]
        if cited and (self.signal not in SIGNALS or not set(cited) <= set(SIGNALS[self.signal].names)):
            raise ValueError(f"table {self.name}: columns cite fields {cited} that signal {self.signal!r} "
                             "does not declare")
        fields = [pa.field(c.name, c.type, nullable=c.nullable, metadata=_field_notes(self, c)) for c in self.columns]
        object.__setattr__(self, "arrow_schema", pa.schema(fields, metadata=_table_notes(self)))
        object.__setattr__(self, "meta", {c.name: _kind(c.type) for c in self.columns})

    @property
    def list_columns(self) -> list[str]:
        return [name for name, (kind, _) in self.meta.items() if kind == "list"]

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.columns]

    @property
    def keys(self) -> list[str]:
        """Columns that identify a delta row (everything not summed or maxed)."""
        return [c.name for c in self.columns if c.name not in self.sums and c.name not in self.maxes]

    @property
    def has_layer(self) -> bool:
        return "layer" in self.names

    def column(self, name: str) -> Column:
        for c in self.columns:
            if c.name == name:
                return c
        raise KeyError(name)


# units of the columns whose name alone does not say it; table-specific entries first
_UNITS = {
    ("dsa_key_counts", "count"): "selections (DSA picks of a key in the bin)",
    ("dsa_distance_hist", "count"): "selections (DSA picks at that distance)",
    ("dsa_segment_totals", "count"): "selections (DSA picks of a key in the segment)",
    ("moe_counts", "count"): "token slots (a token routed to k experts fills k slots)",
    "layer": "model layer index", "step": "forward step", "rank": "process rank", "position": "token position",
    "selected": "token positions", "key_bin": "bin index (key position // bin width)",
    "log2_bin": "floor(log2(distance + 1)), distance in tokens", "segment": "segment id", "expert": "expert id",
    "ep_rank": "expert-parallel rank", "tokens": "token slots", "queries": "queries", "sink_hits": "queries",
    "mass": "probability mass (0..1)", "iou": "ratio (0..1)", "recall": "ratio (0..1)", "norm": "Frobenius norm",
    "max_abs": "absolute value", "mean_decay": "decay factor exp(g) (0..1)", "mean_beta": "write strength (0..1)",
    "eff_rank": "effective rank", "half_life": "tokens", "global_share": "ratio (0..1)", "entropy": "nats",
    "weights": "combine weight", "experts": "expert ids", "scores": "indexer score", "token_id": "token id",
    "piece": "text", "modality": "text or image", "image_id": "segment id", "patch_row": "patch row",
    "patch_col": "patch column",
}

DELTA_NOTE = ("rows are increments written at each flush: the value is the SUM of {sums} over all rows with "
              "equal {keys}; a single row is only a part of it")


def _unit(table: str, column: str) -> str:
    return _UNITS.get((table, column)) or _UNITS.get(column, "")


def _field_notes(spec: "TableSpec", column: Column) -> dict[bytes, bytes]:
    """A column's description in its Arrow field metadata (pyarrow: `schema.field(name).metadata`)."""
    notes = {b"description": column.doc.encode(), b"unit": _unit(spec.name, column.name).encode()}
    if column.name in spec.sums:
        notes[b"aggregate"] = b"sum over rows with equal keys (a delta)"
    return notes


def _table_notes(spec: "TableSpec") -> dict[bytes, bytes]:
    """What the table's rows mean, as schema metadata: Parquet stores it as the file's key-value metadata,
    so DuckDB reads it too (`SELECT * FROM parquet_kv_metadata('part-000000.parquet')`); one
    `k3wb.column.<name>` entry per column repeats the field descriptions there, since DuckDB does not
    read Arrow field metadata."""
    notes = {"k3wb.table": spec.name, "k3wb.schema_version": str(SCHEMA_VERSION), "k3wb.row": spec.doc,
             "k3wb.kind": spec.kind}
    if spec.kind == "delta":
        notes["k3wb.read_as"] = DELTA_NOTE.format(sums=", ".join(spec.sums), keys=", ".join(spec.keys))
    if spec.name == "dsa_key_counts":
        notes["k3wb.bin_width"] = ("key_bin covers key positions [key_bin * W, (key_bin + 1) * W) with W = "
                                   "policy.dsa_bin_tokens of session.json (k3wb.dsa_bin_tokens in each part)")
    for c in spec.columns:
        unit = _unit(spec.name, c.name)
        notes[f"k3wb.column.{c.name}"] = c.doc + (f" [unit: {unit}]" if unit else "")
    return {k.encode(): v.encode() for k, v in notes.items()}


# the policy setting a table's values depend on, written into each of its parts (`part_notes`)
_PART_SETTINGS = {"dsa_key_counts": "dsa_bin_tokens", "dsa_sink": "sink_tokens"}


def part_notes(spec: "TableSpec", policy: dict) -> dict[bytes, bytes]:
    """The table's schema metadata plus the recording's own setting its values depend on (the bin width
    of dsa_key_counts, the sink size of dsa_sink), so one part file read alone is still readable."""
    notes = dict(spec.arrow_schema.metadata)
    setting = _PART_SETTINGS.get(spec.name)
    if setting is not None:
        notes[f"k3wb.{setting}".encode()] = str(policy.get(setting, POLICY_DEFAULTS[setting])).encode()
    return notes


def _kind(t: pa.DataType) -> tuple[str, np.dtype]:
    if pa.types.is_list(t):
        return "list", np.dtype(t.value_type.to_pandas_dtype())
    if pa.types.is_string(t) or pa.types.is_dictionary(t):
        return "string", np.dtype(object)
    return ("int" if pa.types.is_integer(t) else "float"), np.dtype(t.to_pandas_dtype())


def signal_tags() -> tuple[Column, ...]:
    """The tag columns every signal table starts with."""
    return (
        Column("layer", pa.int16(), "model layer index (0-based, as in config.json)", encoding="dict"),
        Column("step", pa.int32(), "session-wide forward counter: prefill chunk or decode step (monotone)",
               encoding="dict"),
        Column("rank", pa.int16(), "process (tensor/expert-parallel rank) that recorded the row", encoding="dict"),
    )


# every table of the format: the token table here, each signal family's tables added when
# `workbench.signals` registers the family (the writer, the reader and export read this one dict)
TABLES: dict[str, TableSpec] = {t.name: t for t in (
    TableSpec("tokens", "one row per token of the session (prompt, image patches and generated text)", (
        Column("position", pa.int32(), "sequence position", encoding="delta"),
        Column("token_id", pa.int32(), "token id"),
        Column("piece", pa.string(), "decoded text of the token", encoding="dict"),
        Column("segment", pa.int32(), "id of the segment (session.json segments[].id) holding the token",
               encoding="dict"),
        Column("modality", MODALITY_TYPE, "text or image", encoding="dict"),
        Column("image_id", pa.int32(), "segment id of the image this patch token belongs to", True, "dict"),
        Column("patch_row", pa.int16(), "row of the patch in the image's token grid", True),
        Column("patch_col", pa.int16(), "column of the patch in the image's token grid", True),
    )),
)}


def table_spec(name: str) -> TableSpec:
    """The spec of a table, or a clear error naming the known tables."""
    try:
        return TABLES[name]
    except KeyError:
        raise TraceError(f"unknown trace table {name!r}; tables are: {', '.join(TABLES)}") from None


def parquet_options(spec: TableSpec, compression_level: int = 3) -> dict:
    """Keyword arguments for `pyarrow.parquet.write_table` that apply the spec's encodings."""
    return {
        "compression": "zstd",
        "compression_level": compression_level,
        "use_dictionary": [c.name for c in spec.columns if c.encoding == "dict"],
        "column_encoding": {c.name: {"delta": "DELTA_BINARY_PACKED", "bss": "BYTE_STREAM_SPLIT"}[c.encoding]
                            for c in spec.columns if c.encoding in ("delta", "bss")},
        "write_statistics": True,
        # CRC32 per page: readers verify it, so a damaged part is reported instead of decoding garbage
        "write_page_checksum": True,
    }


def describe() -> str:
    """The schema as Markdown (for docs and notebooks)."""
    lines = [f"# {SCHEMA_NAME} version {SCHEMA_VERSION}", ""]
    for spec in TABLES.values():
        source = f" (recorded from probe `{spec.signal}`)" if spec.signal else ""
        lines += [f"## {spec.name} ({spec.kind})", "", spec.doc + source, ""]
        lines += [f"- `{c.name}` {c.type}{' (nullable)' if c.nullable else ''}: {c.doc}" for c in spec.columns]
        lines.append("")
    return "\n".join(lines)
