"""Export a trace to plain files: Parquet, CSV, JSON Lines or NumPy `.npz`, one file per table.

Output directory layout: `<table>.<ext>` for each table (tokens included), a copy of session.json,
`images/<segment id>.png` (the thumbnails session.json names, so the export opens with its
pictures) and `export.json` (source, format, layers, rows and file per table). Conventions per format:
- parquet: one file per table, same schema and encodings as the trace parts.
- csv / jsonl: list columns as JSON arrays (`[12,40,977]`), nulls as empty fields / null.
- npz: one array per column; a list column becomes `<col>.values` + `<col>.offsets` (row i is
  values[offsets[i]:offsets[i+1]]); strings become fixed-width unicode; a nullable column also gets
  `<col>.valid` (bool) with nulls stored as -1 / NaN. Loads with `np.load(path)` (no pickle).

Safety: the trace is opened strictly (a corrupt or missing part or thumbnail is an error, not a silent hole); the
export is written to a temporary directory next to the target and moved into place only when
complete; an existing non-empty target is refused unless `overwrite=True` and it holds a previous
export and nothing else (its `export.json` lists every file); a trace or any other directory is
never replaced. The old export is set aside, the new one renamed in, then the old one deleted
(`engine.io.atomic_dir`), so a crash keeps one whole export at the path.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import shutil
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from engine.io import atomic_dir
from engine.io.files import parse_json
from workbench.trace.bounds import MAX_LAYERS, SessionBounds
from workbench.trace.errors import TraceError
from workbench.trace.reader import Trace, open_trace
from workbench.trace.schema import EXPORT_MANIFEST, IMAGES_DIR, SESSION_FILE, TABLES, parquet_options
from workbench.trace.thumbnail_files import thumbnail_path

FORMATS = {"parquet": "parquet", "csv": "csv", "jsonl": "jsonl", "npz": "npz"}
MANIFEST = EXPORT_MANIFEST
_LAYER_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$", re.ASCII)


def parse_layers(text: str) -> list[int]:
    """"0,3,5-7" -> [0, 3, 5, 6, 7] (sorted, unique); a clear TraceError for anything else."""
    layers: set[int] = set()
    for item in (s.strip() for s in text.split(",")):
        m = _LAYER_ITEM.match(item)
        if m is None or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise TraceError(f"bad layer list {text!r}: use numbers and ranges like 0,3,5-7")
        lo = int(m.group(1))
        hi = int(m.group(2) or lo)
        if hi > MAX_LAYERS:  # checked before the range is expanded: "0-2000000000" must not fill memory
            raise TraceError(f"bad layer list {text!r:.80}: layer {hi} is beyond {MAX_LAYERS}, the highest "
                             "layer a trace can hold")
        layers.update(range(lo, hi + 1))
    return sorted(layers)


def _check_layers(layers: Sequence[int], trace: Trace) -> None:
    """Refuse layers the trace's model does not have (TraceError naming them and the model's range)."""
    count = SessionBounds.of(trace.session).layers
    outside = [layer for layer in layers if not 0 <= layer < count]
    if outside:
        shown = ", ".join(map(str, outside[:3])) + (f" and {len(outside) - 3} more" if len(outside) > 3 else "")
        raise TraceError(f"layers {shown} are not layers of the trace {trace.path} (its model has layers "
                         f"0..{count - 1}); export aborted, nothing was written")


def _jsonable(table: pa.Table) -> pa.Table:
    """Half floats become float32 (CSV/JSON writers and Python floats have no float16)."""
    cols = []
    for field, col in zip(table.schema, table.columns):
        t = field.type
        if t == pa.float16():
            col = col.cast(pa.float32())
        elif pa.types.is_list(t) and t.value_type == pa.float16():
            col = col.cast(pa.list_(pa.float32()))
        elif pa.types.is_dictionary(t):
            col = col.cast(t.value_type)
        cols.append(col)
    return pa.table(cols, names=table.column_names)


def _csv_ready(table: pa.Table) -> pa.Table:
    table = _jsonable(table)
    cols = []
    for field, col in zip(table.schema, table.columns):
        if pa.types.is_list(field.type):
            joined = pc.binary_join(col.cast(pa.list_(pa.string())), ",")
            col = pc.binary_join_element_wise("[", joined, "]", "")
        cols.append(col)
    return pa.table(cols, names=table.column_names)


class _Sink:
    """Receives one table's parts in order and writes the output file."""

    def __init__(self, path: Path, fmt: str, name: str) -> None:
        self.path, self.fmt, self.name = path, fmt, name
        self.rows = 0
        self._writer = None
        self._chunks: list[pa.Table] = []
        self._file = open(path, "w", encoding="utf-8") if fmt == "jsonl" else None

    def write(self, table: pa.Table) -> None:
        self.rows += table.num_rows
        if self.fmt == "parquet":
            if self._writer is None:
                self._writer = pq.ParquetWriter(self.path, table.schema, **parquet_options(TABLES[self.name]))
            self._writer.write_table(table.unify_dictionaries())
        elif self.fmt == "csv":
            ready = _csv_ready(table)
            if self._writer is None:
                self._writer = pacsv.CSVWriter(self.path, ready.schema)
            self._writer.write_table(ready)
        elif self.fmt == "jsonl":
            for batch in _jsonable(table).to_batches(max_chunksize=65536):
                self._file.writelines(json.dumps(row, separators=(",", ":")) + "\n" for row in batch.to_pylist())
        else:
            self._chunks.append(table)

    def close(self, schema: pa.Schema) -> None:
        if self.fmt == "parquet" and self._writer is None:
            pq.write_table(schema.empty_table(), self.path, **parquet_options(TABLES[self.name]))
        elif self.fmt == "csv" and self._writer is None:
            with pacsv.CSVWriter(self.path, _csv_ready(schema.empty_table()).schema):
                pass
        elif self.fmt == "npz":
            table = pa.concat_tables(self._chunks).unify_dictionaries() if self._chunks else schema.empty_table()
            np.savez(self.path, **_npz_arrays(table))
        if self._writer is not None:
            self._writer.close()
        if self._file is not None:
            self._file.close()


def _npz_arrays(table: pa.Table) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for field, col in zip(table.schema, table.columns):
        col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        t, name = field.type, field.name
        if pa.types.is_list(t):
            offsets = col.offsets.to_numpy().astype(np.int64)
            out[f"{name}.offsets"] = offsets - offsets[0]  # a sliced array's offsets need not start at 0
            out[f"{name}.values"] = pc.list_flatten(col).to_numpy(zero_copy_only=False)
            if field.nullable:
                out[f"{name}.valid"] = col.is_valid().to_numpy(zero_copy_only=False)
            continue
        if pa.types.is_dictionary(t) or pa.types.is_string(t):
            values = col.cast(pa.string()).fill_null("").to_pylist()
            out[name] = np.array(values, dtype=str) if values else np.zeros(0, dtype="<U1")
            continue
        if field.nullable:
            out[f"{name}.valid"] = col.is_valid().to_numpy(zero_copy_only=False)
            fill = -1 if pa.types.is_integer(t) else float("nan")
            col = col.fill_null(pa.scalar(fill, t))
        out[name] = col.to_numpy(zero_copy_only=False)
    return out


def _prepare_target(out: Path, source: Path, overwrite: bool) -> list[Path]:
    """Check the target; returns the entries there that a previous export did not write (kept)."""
    if out.is_symlink():
        raise TraceError(f"export target {out} is a symbolic link; refusing to write through it (give the directory "
                         f"itself)")
    src, dst = source.resolve(), out.resolve()
    if dst == src or src in dst.parents:
        raise TraceError(f"export target {out} is inside the trace {source}; choose another directory")
    if dst.exists() and not dst.is_dir():
        raise TraceError(f"export target {out} exists and is not a directory")
    if not dst.exists() or not any(dst.iterdir()):
        return []
    if (dst / SESSION_FILE).is_file() and not (dst / MANIFEST).is_file():
        raise TraceError(f"export target {out} is a trace, not an export; refusing to replace it")
    try:
        previous = parse_json((dst / MANIFEST).read_bytes(), str(dst / MANIFEST), TraceError)
        files = previous.get("files", []) if isinstance(previous, dict) else None
    except (OSError, TraceError):
        files = None
    if not isinstance(files, list):
        raise TraceError(f"export target {out} is not empty and holds no export ({MANIFEST}); refusing to replace it")
    if not overwrite:
        raise TraceError(f"export target {out} exists and is not empty; pass --overwrite to replace the export there")
    ours = {f for f in files if isinstance(f, str)}
    atomic_dir.require_replaceable(dst, ours.__contains__, TraceError)
    return [p for p in dst.iterdir() if p.name not in ours]  # not the export's: carried over untouched


def export_trace(source: str | Path | Trace, out: str | Path, fmt: str = "parquet", *,
                 layers: Sequence[int] | None = None, tables: Sequence[str] | None = None,
                 overwrite: bool = False, progress: Callable[[str, int], None] | None = None) -> dict:
    """Write each table of a trace (and session.json) to `out` in `fmt`; returns the manifest dict.

    Args:
        source (str | Path | Trace): the trace directory (opened strictly) or an open Trace.
        out (str | Path): output directory (created; must be empty or absent unless `overwrite`).
        fmt (str): parquet, csv, jsonl or npz.
        layers (Sequence[int], Optional): keep only these layers in signal tables (tokens are whole).
        tables (Sequence[str], Optional): tables to export (default: all).
        overwrite (bool): replace a previous export at `out`.
        progress (Callable, Optional): called with (table, rows) after each table.
    """
    if fmt not in FORMATS:
        raise TraceError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    try:
        trace = source if isinstance(source, Trace) else open_trace(source, strict=True)
    except TraceError as exc:
        kept = "the previous export there is kept" if is_export(Path(out)) else "nothing was written"
        raise type(exc)(f"{exc}; export aborted, {kept}") from None
    if layers is not None:
        _check_layers(layers, trace)
    names = list(TABLES) if tables is None else list(dict.fromkeys(tables))
    unknown = [t for t in names if t not in TABLES]
    if unknown:
        raise TraceError(f"unknown table(s) {', '.join(unknown)}; tables are: {', '.join(TABLES)}")
    out = Path(out)
    atomic_dir.recover(out, is_export)
    foreign = _prepare_target(out, trace.path, overwrite)
    with atomic_dir.building(out, "export", TraceError, is_export) as tmp:
        manifest = {"source": str(trace.path), "format": fmt, "schema_version": trace.session.get("schema_version"),
                    "status": trace.status,
                    "layers": None if layers is None else list(layers),
                    "exported": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "tables": {}}
        for name in names:
            spec = TABLES[name]
            file = f"{name}.{FORMATS[fmt]}"
            sink = _Sink(tmp / file, fmt, name)
            try:
                for part in trace.parts(name):
                    piece = trace.table_part(name, part, layers if spec.has_layer else None)
                    if piece.num_rows:
                        sink.write(piece)
            except TraceError as exc:
                raise _aborted(exc, out) from None
            finally:
                sink.close(spec.arrow_schema)
            manifest["tables"][name] = {"file": file, "rows": sink.rows}
            if progress:
                progress(name, sink.rows)
        shutil.copyfile(trace.path / SESSION_FILE, tmp / SESSION_FILE)
        try:
            _copy_thumbnails(trace, tmp)
        except TraceError as exc:
            raise _aborted(exc, out) from None
        manifest["files"] = sorted(p.name for p in tmp.iterdir() if p.name != atomic_dir.PARTIAL_MARKER) + [MANIFEST]
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        _move_into_place(tmp, out, foreign)
    return manifest


def _copy_thumbnails(trace: Trace, tmp: Path) -> None:
    """Copy the thumbnail of every image segment to the same relative path under `tmp`. Only the
    files session.json names, each checked (inside the trace, a regular file, bounded size), so
    nothing else in the trace's `images/` (nor what a link points to) leaves with the export."""
    for seg in trace.session.get("segments", []):
        if not isinstance(seg, dict):
            continue
        src = thumbnail_path(trace.path, seg)
        if src is None:
            continue
        rel = src.relative_to(trace.path.resolve())
        if rel.parts[0] != IMAGES_DIR:  # the recorder writes them nowhere else; keep the export's layout closed
            raise TraceError(f"segment {seg.get('id')} thumbnail {str(rel)!r}: not under {IMAGES_DIR}/")
        dst = tmp / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)


def is_export(path: Path) -> bool:
    """Whether `path` is a complete export (its manifest, written last, is there)."""
    return (Path(path) / MANIFEST).is_file()


def _aborted(exc: TraceError, out: Path) -> TraceError:
    """`exc` as it stops an export, saying what is still at `out`."""
    kept = "the previous export there is kept" if is_export(out) else "nothing was written"
    return type(exc)(f"{exc}; export aborted, {kept}")


def _move_into_place(tmp: Path, out: Path, foreign: list[Path]) -> None:
    # the user's own files beside a previous export are carried into the new one (linked, not moved)
    kept = {p.name for p in foreign}
    atomic_dir.carry_over(out, tmp, lambda name: name not in kept)
    atomic_dir.replace(tmp, out)
