"""Read a trace, finished or live: `open_trace(path) -> Trace`.

What `open_trace` checks, and how problems surface:
- the directory exists, holds session.json with the schema marker, and its schema_version is one this
  workbench reads: otherwise a `TraceError` (`TraceVersionError` for a newer or older version) with
  one clear line naming the path and the versions;
- every visible part's Parquet footer and columns: a corrupt part is SKIPPED and described in
  `trace.problems` (naming the file), so a dashboard keeps working on the rest; `strict=True`
  raises `TraceCorruptError` instead (export uses it). Damage found later, when data pages are
  decoded, is handled the same way, and so are page headers that claim more than the footer
  (`parquet_pages.check_pages`, before a part's first page is decompressed);
- gaps in part numbering, and parts session.json says exist but are missing: listed in
  `trace.problems`; everything else stays readable.

Following a live trace: `trace.refresh()` re-reads session.json, lists new `part-*.parquet` files
(parts are renamed into place whole, so a half-written one is never visible) and returns the names
of what changed. Reads between refreshes see a fixed snapshot. Small tables are cached in memory;
large ones (`dsa_topk`, `moe_routes`, the delta tables behind the heat map and expert counts) are read
on demand or folded once into running sums.
"""

from __future__ import annotations

import os
import socket
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from engine.io.files import process_alive
from workbench.recorded_settings import SETTINGS_KEY, settings_of_session, with_settings
from workbench import signals
from workbench.trace import part_checks
from workbench.trace.aggregates import DenseSums
from workbench.trace.bounds import SessionBounds, out_of_bounds, table_ranges
from workbench.trace.errors import TraceCorruptError, TraceError
from workbench.trace.files import list_parts, not_regular
from workbench.trace.parquet_pages import check_pages
from workbench.trace.part_checks import (Part, check_strings, conform, read_footer, read_session,
                                         strings_as_dictionaries, valueless_columns)
from workbench.trace.schema import POLICY_DEFAULTS, TABLES, TOKENS_FILE, TableSpec, table_spec

_READ_ERRORS = (OSError, pa.ArrowException, ValueError)


def _kind_if_present(path: Path) -> str | None:
    """What `path` is when something other than a regular file is there; None when nothing is."""
    try:
        return not_regular(path)
    except OSError:
        return None


class Trace:
    """A trace directory opened for reading; create it with `open_trace`.

    Attributes:
        path (Path): the trace directory.
        session (dict): session.json as last read (`trace.policy` adds the defaults of missing keys).
        problems (list[str]): missing or corrupt parts found so far, one line each.
    """

    def __init__(self, path: Path, *, strict: bool = False) -> None:
        self.path = path
        self.strict = strict
        self.session: dict = {}
        self.problems: list[str] = []
        self._parts: dict[str, list[Part]] = {name: [] for name in TABLES}
        self._bad: set[Path] = set()
        self._tokens_compact = False
        self._bounds = SessionBounds()
        self._cache: dict[Path, pa.Table] = {}
        self._pages_checked: set[Path] = set()  # parts whose page headers agree with their footer
        self._sums: dict[str, DenseSums] = {
            table: DenseSums(sums.groups, sums.index, sums.value)
            for family in signals.registered().values() for table, sums in family.running_sums.items()}
        self.refresh()

    def _problem(self, message: str, exc_type: type[TraceError] = TraceCorruptError) -> None:
        message = " ".join(message.splitlines())  # pyarrow's messages span lines; a problem is one
        if self.strict:  # nothing is skipped in a strict read: the caller stops
            raise exc_type(message.removesuffix("; skipped"))
        if message not in self.problems:
            self.problems.append(message)

    @property
    def status(self) -> str:
        """"recording", "complete" or "failed" as session.json says; "stopped (writer gone)" for a
        recording whose writer process (same host) no longer exists."""
        status = self.session.get("status", "recording")
        return "stopped (writer gone)" if status == "recording" and self.writer_gone else status

    @property
    def writer_gone(self) -> bool:
        """Whether the process that wrote this trace is known to be dead (pid + host in session.json).

        A writer on another host cannot be checked from here: False (still "recording").
        """
        writer = self.session.get("writer")
        if not isinstance(writer, dict) or writer.get("host") != socket.gethostname():
            return False
        pid = writer.get("pid")
        if type(pid) is not int or pid <= 0:
            return False
        return not process_alive(pid)

    @property
    def policy(self) -> dict:
        return {**POLICY_DEFAULTS, **self.session.get("policy", {})}

    @property
    def settings(self) -> dict:
        """What the recording was made with: topk, dsa_bin_tokens, sink_tokens, dsa_layers, num_experts
        (`workbench.recorded_settings`; the tables and frames this trace returns carry them)."""
        return settings_of_session(self.session)

    def refresh(self) -> set[str]:
        """Pick up a new session.json and new parts; returns the names that changed ("session", tables)."""
        changed: set[str] = set()
        session = read_session(self.path)
        if session != self.session:
            self.session = session
            self._bounds = SessionBounds.of(session)
            changed.add("session")
        for name in TABLES:
            if self._refresh_table(name):
                changed.add(name)
        return changed

    def _refresh_table(self, name: str) -> bool:
        spec = TABLES[name]
        listing = [] if name == "tokens" and self._tokens_compact else list_parts(self.path / name)
        # tokens.parquet is published before the writer deletes tokens/ parts, so when it is absent
        # *after* the listing, the listing was complete
        if name == "tokens" and not self._tokens_compact and not (self.path / TOKENS_FILE).is_file():
            odd = _kind_if_present(self.path / TOKENS_FILE)
            if odd:  # the compacted tokens cannot be read: say so instead of showing an empty table
                self._problem(f"{self.path / TOKENS_FILE} is {odd}, not a regular file: the tokens table is "
                              "unreadable; skipped")
        if name == "tokens" and not self._tokens_compact and (self.path / TOKENS_FILE).is_file():
            self._tokens_compact = True
            for part in self._parts["tokens"]:
                self._cache.pop(part.path, None)
            self._parts["tokens"] = []
        if name == "tokens" and self._tokens_compact:
            if self._parts["tokens"]:
                return False
            listing = [(0, self.path / TOKENS_FILE)]
        known = {p.seq for p in self._parts[name]} | {seq for seq, path in listing if path in self._bad}
        added = False
        for seq, path in listing:
            if seq in known:
                continue
            try:
                # a FIFO or device in place of a part would block or stream forever when opened
                odd = not_regular(path)
                if odd:
                    raise ValueError(f"it is {odd}, not a regular file")
                rows, ranges, decoded = read_footer(path, spec)
                beyond = out_of_bounds(ranges, self._bounds)
                if beyond:
                    raise ValueError(beyond)
            except FileNotFoundError:
                continue
            except _READ_ERRORS as exc:
                self._bad.add(path)
                self._problem(f"corrupt Parquet part {path}: {exc}; skipped")
                continue
            self._parts[name].append(Part(seq, path, rows, ranges, decoded))
            added = True
        self._parts[name].sort(key=lambda p: p.seq)
        if not (name == "tokens" and self._tokens_compact):
            self._check_numbering(name, listing)
        return added

    def _check_numbering(self, name: str, listing: list[tuple[int, Path]]) -> None:
        present = {seq for seq, _ in listing}
        expected = max(max(present, default=-1) + 1, int(self.session.get("parts", {}).get(name, 0)))
        # counted, not listed: `parts` comes from session.json and may claim a billion parts
        n_missing = expected - sum(1 for seq in present if seq < expected)
        if n_missing:
            first = []
            seq = 0
            while len(first) < 5 and seq < expected:
                if seq not in present:
                    first.append(seq)
                seq += 1
            shown = ", ".join(f"part-{s:06d}.parquet" for s in first) + (" ..." if n_missing > 5 else "")
            self._problem(f"table {name}: {n_missing} part(s) missing ({shown}); their rows are absent",
                          TraceError)

    def parts(self, name: str) -> list[Path]:
        """Readable part files of a table, in order (tokens: tokens.parquet once compacted)."""
        return [p.path for p in self._parts[table_spec(name).name] if p.path not in self._bad]

    def _read(self, part: Part, spec: TableSpec, columns: list[str] | None,
              layers: Sequence[int] | None = None, skip_valueless: bool = False) -> pa.Table | None:
        try:
            if part.path not in self._pages_checked:
                # the pages must agree with the footer that passed the limits before one is decompressed
                check_pages(part.path)
                self._pages_checked.add(part.path)
            if layers is None:
                file = pq.ParquetFile(part.path, page_checksum_verification=True,
                                      read_dictionary=strings_as_dictionaries(spec))
                absent = valueless_columns(file.metadata, spec, columns) if skip_valueless and columns else []
                # one thread per part: the callers that read many parts already read them in parallel, and
                # Arrow's own pool on top of theirs only oversubscribed two cores (cold 1M open: -6 to -12%)
                table = file.read(columns=[c for c in columns if c not in absent] if absent else columns,
                                  use_threads=False)
                for name in absent:  # every row null: made, not decoded (the file's own type: list item names)
                    field = file.schema_arrow.field(name)
                    table = table.append_column(field, pa.nulls(file.metadata.num_rows, field.type))
            else:
                table = pq.read_table(part.path, columns=columns, filters=[("layer", "in", list(layers))],
                                      read_dictionary=strings_as_dictionaries(spec))
            table = conform(check_strings(table, spec), spec)
        except FileNotFoundError:
            if spec.name == "tokens":
                raise
            self._problem(f"part {part.path} disappeared after it was listed", TraceError)
            return None
        except _READ_ERRORS as exc:
            self._bad.add(part.path)
            self._problem(f"corrupt Parquet part {part.path}: {exc}; skipped")
            return None
        # footer statistics are optional: the decoded values are checked before anything is sized by them
        beyond = out_of_bounds(table_ranges(table), self._bounds)
        if beyond:
            self._bad.add(part.path)
            self._problem(f"corrupt Parquet part {part.path}: {beyond}; skipped")
            return None
        # the spec's columns in the spec's order (a part may carry extra columns a reader ignores)
        return table.select(columns or spec.names)

    def _load(self, part: Part, spec: TableSpec, columns: list[str] | None) -> pa.Table | None:
        if not spec.cache:
            return self._read(part, spec, columns)
        if part.path not in self._cache:
            table = self._read(part, spec, None)
            if table is None:
                return None
            self._cache[part.path] = table
        table = self._cache[part.path]
        return table if columns is None else table.select(columns)

    def table(self, name: str, layers: Sequence[int] | None = None, columns: Sequence[str] | None = None, *,
              steps: tuple[int, int] | None = None, positions: tuple[int, int] | None = None) -> pa.Table:
        """Rows of a table as one Arrow table (parts concatenated in order).

        Args:
            name (str): table name (see `workbench.trace.schema.TABLES`).
            layers (Sequence[int], Optional): keep rows of these layers only.
            columns (Sequence[str], Optional): columns to return (default: all).
            steps (tuple[int, int], Optional): inclusive step range to keep.
            positions (tuple[int, int], Optional): inclusive `position` range to keep; parts whose
                statistics miss the range are not read at all.
        """
        spec = table_spec(name)
        wanted = list(columns) if columns is not None else spec.names
        unknown = [c for c in wanted if c not in spec.names]
        if unknown:
            raise TraceError(f"table {name} has no column(s) {', '.join(unknown)}")
        filters = {"layer": None if layers is None else (min(layers, default=0), max(layers, default=-1)),
                   "step": steps, "position": positions}
        for col, wanted_range in filters.items():
            if wanted_range is not None and col not in spec.names:
                raise TraceError(f"table {name} has no {col} column to filter on")
        needed = list(dict.fromkeys(wanted + [c for c, r in filters.items() if r is not None]))
        if name == "tokens":
            table = self._tokens_table(needed)
        else:
            parts = [p for p in self._parts[name] if p.path not in self._bad and _overlaps(p, filters)]
            self._check_read_size(name, [p for p in parts if not (spec.cache and p.path in self._cache)])
            if len(parts) > 1 and (not spec.cache or any(p.path not in self._cache for p in parts)):
                # decoding releases the GIL: read parts on several threads (the first load of a big table)
                with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
                    loaded = list(pool.map(lambda p: self._load(p, spec, needed), parts))
            else:
                loaded = [self._load(p, spec, needed) for p in parts]
            pieces = [t for t in loaded if t is not None and t.num_rows]
            table = pa.concat_tables(pieces) if pieces else spec.arrow_schema.empty_table().select(needed)
        mask = None
        if layers is not None:
            mask = pc.is_in(table["layer"], value_set=pa.array(list(layers), pa.int16()))
        for col in ("step", "position"):
            if filters[col] is not None:
                lo, hi = filters[col]
                inside = pc.and_(pc.greater_equal(table[col], lo), pc.less_equal(table[col], hi))
                mask = inside if mask is None else pc.and_(mask, inside)
        # a filter copies every kept row, list cells included (the answer's top-k rows of a 1M trace hold
        # tens of millions of keys): skipped when every row is kept, as when the parts read hold only the wanted range
        if mask is not None and not (mask.null_count == 0 and pc.all(mask).as_py()):
            table = table.filter(mask)
        # the recording's top-k, bin width, sink size and layer ids travel with the rows (statistics read them)
        return with_settings(table.select(wanted), self.settings)

    def _check_read_size(self, name: str, parts: list[Part]) -> None:
        """Refuse a read whose parts decode to more than MAX_READ_BYTES together, by their footers (each part
        is within its own limit, but a few megabytes of parts can still claim billions of rows)."""
        total = sum(p.decoded for p in parts)
        if total > part_checks.MAX_READ_BYTES:
            raise TraceError(f"{self.path}: table {name} would decode to about {total:,} bytes in "
                             f"{len(parts)} part(s), more than the {part_checks.MAX_READ_BYTES:,} one read may hold; "
                             "read it part by part (`table_part`) or narrow it by layer, step or position")

    def _tokens_table(self, columns: Sequence[str] | None) -> pa.Table:
        spec = TABLES["tokens"]
        self._check_read_size("tokens", [p for p in self._parts["tokens"]
                                         if p.path not in self._bad and p.path not in self._cache])
        for _ in range(3):
            try:
                pieces = [t for p in self._parts["tokens"] if p.path not in self._bad
                          for t in [self._load(p, spec, None)] if t is not None]
                break
            except FileNotFoundError:
                # the writer compacted tokens/ into tokens.parquet between our listing and the read
                self._refresh_table("tokens")
        else:
            raise TraceError(f"{self.path}: the tokens table changed while it was read; retry")
        table = pa.concat_tables(pieces) if pieces else spec.arrow_schema.empty_table()
        return table if columns is None else table.select(list(columns))

    def table_part(self, name: str, path: Path, layers: Sequence[int] | None = None) -> pa.Table:
        """Rows of one part file of a table (a path from `parts(name)`), optionally only some layers.

        Lets a consumer stream a large table part by part (export does) instead of holding it whole.
        """
        spec = table_spec(name)
        part = next((p for p in self._parts[name] if p.path == Path(path)), None)
        if part is None:
            raise TraceError(f"{path} is not a part of table {name} of {self.path}")
        table = self._load(part, spec, None) if name != "tokens" else self._tokens_part(part)
        if table is None:
            return spec.arrow_schema.empty_table()
        if layers is not None and spec.has_layer:
            table = table.filter(pc.is_in(table["layer"], value_set=pa.array(list(layers), pa.int16())))
        return table

    def read_part(self, name: str, path: Path, columns: Sequence[str], layers: Sequence[int] | None = None) -> pa.Table:
        """Some columns of one part file (a path from `parts(name)`), read now and never cached.

        For consumers that fold a large table part by part and keep only a reduction of it (the
        dashboard's KDA view keeps head means of `kda_norms`, not every head of every layer). A part
        that cannot be read is listed in `problems` (or raises when strict) and yields no rows. A
        nullable column the part's footer shows to hold no value (every row null, as the KDA statistics a
        policy did not record) comes back as nulls without being decoded (empty lists there read as nulls).

        Args:
            name (str): table name.
            path (Path): one of `parts(name)`.
            columns (Sequence[str]): columns to read.
            layers (Sequence[int], Optional): keep rows of these layers only (row groups whose
                statistics miss them are skipped).
        """
        spec = table_spec(name)
        unknown = [c for c in columns if c not in spec.names]
        if unknown:
            raise TraceError(f"table {name} has no column(s) {', '.join(unknown)}")
        path = Path(path)
        part = next((p for p in self._parts[spec.name] if p.path == path), None)
        if part is None:
            raise TraceError(f"{path} is not a part of table {name} of {self.path}")
        if part.path in self._bad:
            return spec.arrow_schema.empty_table().select(list(columns))
        table = self._read(part, spec, list(columns), layers, skip_valueless=True)
        return table if table is not None else spec.arrow_schema.empty_table().select(list(columns))

    def _tokens_part(self, part: Part) -> pa.Table | None:
        try:
            return self._load(part, TABLES["tokens"], None)
        except FileNotFoundError:
            raise TraceError(f"{self.path}: the tokens table was compacted while it was read; retry") from None

    def df(self, name: str, layers: Sequence[int] | None = None, columns: Sequence[str] | None = None,
           **filters) -> pd.DataFrame:
        """`table(...)` as a pandas DataFrame (list columns hold numpy arrays; the recording's settings in
        `attrs`, as `workbench.recorded_settings` reads them)."""
        frame = self.table(name, layers, columns, **filters).to_pandas()
        frame.attrs[SETTINGS_KEY] = self.settings
        return frame

    def tokens(self, columns: Sequence[str] | None = None) -> pd.DataFrame:
        """The token table (position, token_id, piece, segment, modality, image_id, patch_row, patch_col)."""
        return self._tokens_table(columns).to_pandas()

    def segments(self) -> pd.DataFrame:
        """Segments from session.json, one row each, with `tokens` = end - start and image grid columns."""
        rows = []
        for seg in self.session.get("segments", []):
            image = seg.get("image") or {}
            rows.append({"id": seg["id"], "kind": seg["kind"], "name": seg.get("name", ""),
                         "start": int(seg["start"]), "end": int(seg["end"]),
                         "tokens": int(seg["end"]) - int(seg["start"]), "modality": seg.get("modality", "text"),
                         **{f"image_{k}": image.get(k) for k in ("width", "height", "grid_rows", "grid_cols")}})
        cols = ["id", "kind", "name", "start", "end", "tokens", "modality", "image_width", "image_height",
                "image_grid_rows", "image_grid_cols"]
        return pd.DataFrame(rows, columns=cols)

    def layers(self, name: str) -> list[int]:
        """Distinct layers that have rows in a signal table, ascending."""
        spec = table_spec(name)
        if not spec.has_layer:
            raise TraceError(f"table {name} has no layer column")
        if name in self._sums:
            self._fold(name)
            pos = self._sums[name].groups.index("layer")
            return sorted({key[pos] for key in self._sums[name].sums})
        layer = self.table(name, columns=["layer"])["layer"]
        return sorted(pc.unique(layer).to_pylist())

    def layer_range(self, name: str) -> tuple[int, int] | None:
        """(lowest, highest) layer with rows in a table, from the part footers alone (no data read);
        None when no part has rows or statistics."""
        ranges = [p.ranges["layer"] for p in self._parts[table_spec(name).name]
                  if p.path not in self._bad and p.rows and "layer" in p.ranges]
        return (min(r[0] for r in ranges), max(r[1] for r in ranges)) if ranges else None

    def folded_sums(self, name: str) -> DenseSums:
        """The running sums of a delta table a signal family declares (`SignalFamily.running_sums`), with
        every current part folded in; the object itself (for the families' accessors; do not change it)."""
        if name not in self._sums:
            raise TraceError(f"table {name} has no running sums")
        return self._fold(name)

    def _fold(self, name: str) -> DenseSums:
        sums = self._sums[name]
        spec = TABLES[name]
        cols = [*sums.groups, sums.index, sums.value]
        todo = [p for p in self._parts[name] if str(p.path) not in sums.seen and p.path not in self._bad]
        if len(todo) > 1:
            # decoding releases the GIL: the next parts are read while one is added in (the sums are
            # added in part order, on this thread only)
            with ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:
                self._add_parts(sums, zip(todo, pool.map(lambda p: self._read(p, spec, cols), todo)))
        else:
            self._add_parts(sums, ((p, self._read(p, spec, cols)) for p in todo))
        return sums

    def _add_parts(self, sums: DenseSums, tables: Iterable[tuple[Part, pa.Table | None]]) -> None:
        for part, table in tables:
            key = str(part.path)
            if table is not None:
                try:
                    sums.add(key, table)
                except ValueError as exc:
                    self._bad.add(part.path)
                    self._problem(f"corrupt Parquet part {part.path}: {exc}; skipped")

    def running_sums(self, name: str) -> tuple[tuple[str, ...], dict[tuple[int, ...], np.ndarray]]:
        """A delta table's running sums with every current part folded in: (group columns, {group
        values: dense int64 vector}), copies. `name` is dsa_key_counts or moe_counts. Meant for a cache
        of a finished trace's sums, given back later with `restore_running_sums`."""
        if name not in self._sums:
            raise TraceError(f"table {name} has no running sums")
        sums = self._fold(name)
        return sums.groups, {key: vec.copy() for key, vec in sums.sums.items()}

    def restore_running_sums(self, name: str, groups: tuple[str, ...], sums: dict[tuple[int, ...], np.ndarray]) -> bool:
        """Take running sums made earlier (`running_sums`) from exactly the current parts of `name` (the
        caller keys them by the parts' names, sizes and last 64 KiB) instead of reading those parts; parts added
        later are folded in as usual. Returns False and changes nothing when a part was already folded
        in, or when `groups` / `sums` do not fit the table (group columns, 1-D non-negative int64
        vectors) or its dense-cell cap."""
        if name not in self._sums:
            raise TraceError(f"table {name} has no running sums")
        target = self._sums[name]
        if tuple(groups) != target.groups:
            return False
        return target.restore(sums, {str(part.path) for part in self._parts[name] if part.path not in self._bad})

    def __getattr__(self, name: str) -> Any:
        """A signal family's reader as a method: `trace.dsa_heatmap(bins=512)`, `trace.routes_for(p)`, ...
        (`SignalFamily.readers`; each documents its arguments). The store itself names no family."""
        if not name.startswith("_"):
            for family in signals.registered().values():
                reader = family.readers.get(name)
                if reader is not None:
                    return types.MethodType(reader, self)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *(n for f in signals.registered().values() for n in f.readers)})

    def check(self) -> list[str]:
        """Decode every part once (not only footers); returns `problems` (raises instead when strict)."""
        for name, spec in TABLES.items():
            for part in list(self._parts[name]):
                if part.path not in self._bad:
                    self._read(part, spec, None)
        return self.problems

    def __repr__(self) -> str:
        counts = {name: sum(p.rows for p in parts) for name, parts in self._parts.items() if parts}
        return f"Trace({str(self.path)!r}, status={self.status!r}, rows={counts}, problems={len(self.problems)})"


def _overlaps(part: Part, filters: dict[str, tuple[int, int] | None]) -> bool:
    for col, wanted in filters.items():
        have = part.ranges.get(col)
        if wanted is not None and have is not None and (have[1] < wanted[0] or have[0] > wanted[1]):
            return False
    return True


def open_trace(path: str | Path, *, strict: bool = False) -> Trace:
    """Open the trace directory at `path` for reading (finished or still being written).

    Args:
        path (str | Path): the trace directory (the one holding session.json).
        strict (bool, Optional): raise `TraceCorruptError`/`TraceError` on a corrupt or missing part
            instead of listing it in `trace.problems`. Default: False.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TraceError(f"a trace path must be a str or path, got {type(path).__name__}")
    return Trace(Path(path), strict=strict)
