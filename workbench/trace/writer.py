"""`TraceWriter`: the only code that writes a trace directory (crash-safe, append-only, bounded memory).

Usage (what the recorders do)::

    w = TraceWriter.create("traces/run1", {"model": {...}, "policy": {...}, "segments": [...]})
    w.append("tokens", position=pos, token_id=ids, piece=pieces, segment=0, modality="text")
    w.append("dsa_topk", layer=3, step=step, rank=0, position=q, selected=idx)    # idx [n_q, k]
    w.flush()                                    # cheap; call it every second
    w.update_session(timings={"ttft_s": 1.2})    # dicts merge, other values replace
    w.close()                                    # final flush, tokens.parquet, status "complete"

Appends are validated at once (so bad input fails at the call site) and buffered per table as numpy
arrays (an append costs tens of microseconds); `flush()` converts them to Arrow and writes one new
part per table that has rows. `flush(wait=False)` does that on a background thread. A buffer that
grows past `max_buffer_rows` rows, or the writer past `max_buffer_bytes`, flushes by itself (in the
background), so memory stays bounded at any length. Delta tables are coalesced at flush (equal keys
summed), so appending per step costs nothing on disk. The writer is thread-safe: a timer thread may
flush while the engine thread appends.
"""

from __future__ import annotations

import copy
import datetime as _dt
import json
import os
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Collection, Mapping

import pyarrow as pa
import pyarrow.parquet as pq

from engine.session.segments import MAX_SEGMENT_NAME, MAX_SEGMENTS
from workbench.trace.columns import Batch, coalesce, prepare, to_table
from workbench.trace.bounds import MAX_SESSION_BYTES, check_session
from workbench.trace.errors import TraceCorruptError, TraceError
from workbench.trace.files import (list_parts, part_name, remove_stale_temps, write_bytes_atomic,
                                   write_parquet_atomic)
from workbench.trace.schema import (IMAGES_DIR, MODALITIES, POLICY_DEFAULTS, SCHEMA_NAME, SCHEMA_VERSION, SEGMENT_KINDS,
                                    SESSION_FILE, STATUSES, TABLES, TOKENS_FILE, parquet_options, part_notes, table_spec)
from workbench.trace.thumbnail_files import MAX_THUMBNAIL_BYTES, MAX_THUMBNAIL_SIDE
from workbench.trace.target import check_contents, check_trace_target, clear_previous_trace, take_lock

# fields the writer owns; a caller may read them but update_session refuses to set them
_MANAGED = ("schema", "schema_version", "created", "updated", "status", "tokens", "parts")
# bytes of session.json kept free when a caller's fields are written: the managed fields grow later
# (part counts, tokens, status) and must still fit the reader's limit
_MANAGED_HEADROOM = 4096


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def check_segments(segments: Any) -> list[dict]:
    """Validate session segments (id, kind, name, start, end, modality, optional image) and return them."""
    if not isinstance(segments, list):
        raise TraceError("session segments must be a list of dicts")
    if len(segments) > MAX_SEGMENTS:  # a reader would refuse the trace
        raise TraceError(f"a session may have at most {MAX_SEGMENTS:,} segments, got {len(segments):,}")
    ids = set()
    for i, seg in enumerate(segments):
        where = f"segments[{i}]"
        if not isinstance(seg, dict):
            raise TraceError(f"{where} must be a dict")
        for key in ("id", "kind", "start", "end"):
            if key not in seg:
                raise TraceError(f"{where} lacks {key!r}")
        if seg["kind"] not in SEGMENT_KINDS:
            raise TraceError(f"{where}.kind must be one of {SEGMENT_KINDS}, got {seg['kind']!r}")
        if seg.get("modality", "text") not in MODALITIES:
            raise TraceError(f"{where}.modality must be one of {MODALITIES}, got {seg['modality']!r}")
        if not 0 <= int(seg["start"]) <= int(seg["end"]):
            raise TraceError(f"{where}: token range [{seg['start']}, {seg['end']}) is not valid")
        name = seg.get("name", "")
        if isinstance(name, str) and len(name) > MAX_SEGMENT_NAME:
            raise TraceError(f"{where}.name has {len(name):,} characters; at most {MAX_SEGMENT_NAME:,} are kept")
        if seg["id"] in ids:
            raise TraceError(f"{where}: duplicate segment id {seg['id']!r}")
        ids.add(seg["id"])
        image = seg.get("image")
        if image is not None:
            missing = {"width", "height", "grid_rows", "grid_cols"} - set(image)
            if missing:
                raise TraceError(f"{where}.image lacks {sorted(missing)}")
    return segments


def _check_json(fields: Mapping[str, Any]) -> None:
    try:
        json.dumps(fields)
    except (TypeError, ValueError) as exc:
        raise TraceError(f"session fields must be JSON-serialisable: {exc}") from None


def _merged(base: dict, update: Mapping) -> dict:
    """`base` with `update` merged in, as a new dict (`base` is left as it was, so a merge the checks
    refuse changes nothing): nested dicts merge key by key, everything else (lists included) replaces."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            out[key] = _merged(base[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _encode_session(session: dict, file: Path, headroom: int = 0) -> bytes:
    """session.json's bytes, if a reader would accept them: the reader's own checks (`check_session`,
    `check_session_size` with `headroom` bytes kept for the fields the writer manages), else a
    TraceError naming the field at fault; nothing is written then."""
    data = (json.dumps(session, indent=1) + "\n").encode()
    try:
        if len(data) > MAX_SESSION_BYTES - headroom:
            largest = max(session, key=lambda k: len(json.dumps(session[k])))
            raise TraceCorruptError(f"{file}: would take {len(data):,} bytes, more than the "
                                    f"{MAX_SESSION_BYTES - headroom:,} a reader accepts (field `{largest}` takes "
                                    f"{len(json.dumps(session[largest])):,})")
        check_session(session, file)
    except TraceCorruptError as exc:
        raise TraceError(f"{exc}; not written, a reader would refuse it") from None
    return data


class TraceWriter:
    """Append-only writer of one trace directory. Create it with `TraceWriter.create`.

    Args (of `create`):
        path (str | Path): the trace directory; created (with parents) if absent.
        session (dict): initial session.json content: model, engine, policy, segments, timings, ...
        overwrite (bool, Optional): replace an existing trace at `path` (a non-trace directory is
            never deleted, files the user added to the trace directory are kept, and a trace another
            live writer records into is refused: `workbench.trace.target`). Default: False.
        max_buffer_rows (int, Optional): rows buffered per table before it flushes by itself.
        max_buffer_bytes (int, Optional): bytes buffered over all tables before everything flushes.
        fsync (bool, Optional): fsync parts and directories (durability across power loss; a process
            crash is safe either way because parts are renamed into place). Default: True.
        compression_level (int, Optional): zstd level of the parts. Default: 3.
    """

    def __init__(self, path: Path, session: dict, *, max_buffer_rows: int, max_buffer_bytes: int, fsync: bool,
                 compression_level: int) -> None:
        self.path = path
        self._session = session
        self._max_rows = max_buffer_rows
        self._max_bytes = max_buffer_bytes
        self._fsync = fsync
        self._level = compression_level
        self._lock = threading.RLock()  # buffers and part numbering
        self._session_lock = threading.RLock()  # the session dict and session.json (the flush thread takes it)
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        # CPU seconds (its own thread's) of the last part-writing job, background or not: what a flush costs
        # beyond the caller's thread, for callers that pace their flushes (the recorder)
        self.last_write_cpu_s = 0.0
        self._buffers: dict[str, list[Batch]] = {name: [] for name in TABLES}
        self._buffer_rows = dict.fromkeys(TABLES, 0)
        self._buffer_bytes = 0
        self._next_part = dict.fromkeys(TABLES, 0)
        self._closed = False
        self._lock_fd: int | None = None  # the one-writer-per-trace lock (LOCK_FILE), held until close

    @classmethod
    def create(cls, path: str | Path, session: Mapping[str, Any], *, overwrite: bool = False,
               max_buffer_rows: int = 1_000_000, max_buffer_bytes: int = 256 << 20, fsync: bool = True,
               compression_level: int = 3) -> "TraceWriter":
        """Start a new trace at `path` with status "recording"; see the class docstring for the arguments."""
        path = Path(path)
        unknown = sorted(set(session) & set(_MANAGED))
        if unknown:
            raise TraceError(f"session fields {unknown} are managed by the writer")
        _check_json(session)
        body = copy.deepcopy(dict(session))
        check_segments(body.setdefault("segments", []))
        body["policy"] = {**POLICY_DEFAULTS, **body.get("policy", {})}
        for key in ("model", "engine", "timings"):
            body.setdefault(key, {})
        full = {"schema": SCHEMA_NAME, "schema_version": SCHEMA_VERSION, "created": _now(), "updated": _now(),
                "status": "recording", "tokens": 0, "parts": {}, **body,
                # who writes (a copied trace's writer is replaced): a reader on this host tells a killed one
                "writer": {"pid": os.getpid(), "host": socket.gethostname()}}
        # refused before anything is touched: an existing trace at `path` is cleared only for one that can be read
        _encode_session(full, path / SESSION_FILE, _MANAGED_HEADROOM)
        check_trace_target(path, overwrite=overwrite)
        path.mkdir(parents=True, exist_ok=True)
        lock = take_lock(path)
        try:
            check_contents(path, overwrite)  # again under the lock: another writer may have finished meanwhile
            if (path / SESSION_FILE).exists():
                clear_previous_trace(path)
        except BaseException:
            os.close(lock)
            raise
        writer = cls(path, full, max_buffer_rows=max_buffer_rows, max_buffer_bytes=max_buffer_bytes, fsync=fsync,
                     compression_level=compression_level)
        writer._lock_fd = lock
        try:
            writer._write_session()
        except BaseException:
            writer._release_lock()
            raise
        return writer

    @property
    def session(self) -> dict:
        """A copy of the session as last written (or about to be written)."""
        with self._session_lock:
            return copy.deepcopy(self._session)

    @property
    def closed(self) -> bool:
        return self._closed

    def append(self, table: str, rows: Mapping[str, Any] | pa.Table | None = None, /, **columns: Any) -> int:
        """Buffer rows for `table`: columns as keyword arguments, or a mapping (dict, DataFrame) or Arrow table.

        Returns the number of rows buffered.

        See `workbench.trace.columns` for the accepted shapes (scalars broadcast, 2-D arrays for lists).
        """
        spec = table_spec(table)
        data: dict[str, Any] = {}
        if isinstance(rows, pa.Table):
            data.update({name: rows[name] for name in rows.column_names})
        elif rows is not None:
            data.update(rows)
        data.update(columns)
        batch = prepare(spec, data)
        with self._lock:
            self._check_open()
            if batch.n == 0:
                return 0
            self._buffers[table].append(batch)
            self._buffer_rows[table] += batch.n
            self._buffer_bytes += batch.nbytes
            # automatic flushes go to the background thread: the engine thread must not stall on I/O
            if self._buffer_rows[table] >= self._max_rows:
                self._flush([table], wait=False)
            elif self._buffer_bytes >= self._max_bytes:
                self._flush(list(TABLES), wait=False)
        return batch.n

    def flush(self, wait: bool = True, hold: Collection[str] = ()) -> dict[str, int]:
        """Write one new part per table with buffered rows; returns {table: rows written}.

        With wait=False the rows are handed to a background thread and the call returns at once
        (with {}): Parquet encoding and fsync then overlap the engine's work. At most one flush is in
        flight; the next flush waits for it and re-raises its error, if any. Tables in `hold` keep
        their rows buffered for a later flush (a caller's small, rarely urgent tables: each part costs
        a file and an fsync); `close` writes everything.
        """
        with self._lock:
            self._check_open()
            return self._flush([name for name in TABLES if name not in hold], wait)

    def update_session(self, **fields: Any) -> None:
        """Merge fields into session.json and rewrite it atomically (dicts merge, other values replace)."""
        with self._session_lock:
            self._check_open()
            managed = sorted(set(fields) & set(_MANAGED))
            if managed:
                raise TraceError(f"session fields {managed} are managed by the writer")
            if "segments" in fields:
                check_segments(fields["segments"])
            _check_json(fields)
            merged = _merged(self._session, fields)
            _encode_session(merged, self.path / SESSION_FILE, _MANAGED_HEADROOM)  # refused: nothing changes
            self._session = merged
            self._write_session(checked=True)

    def add_segment(self, segment: Mapping[str, Any]) -> None:
        """Append one segment (a new turn, an uploaded image, the generated answer) to session.json."""
        with self._session_lock:
            self.update_session(segments=[*self._session["segments"], dict(segment)])

    def write_image(self, segment_id: int, png: bytes) -> str:
        """Store an image segment's thumbnail (PNG bytes) as `images/<segment id>.png`, atomically, and
        return that path relative to the trace (what the segment's `thumbnail` names). Write it before
        announcing the segment, so a follower never sees a name without its file."""
        self._check_open()
        if isinstance(segment_id, bool) or not isinstance(segment_id, int) or segment_id < 0:
            raise TraceError(f"image segment id must be a non-negative integer, got {segment_id!r}")
        # the reader's limits (`thumbnail_files`): a thumbnail it would refuse is not written
        if len(png) > MAX_THUMBNAIL_BYTES:
            raise TraceError(f"image segment {segment_id}: a thumbnail of {len(png):,} bytes, more than the "
                             f"{MAX_THUMBNAIL_BYTES:,} a reader accepts")
        if png[:8] != b"\x89PNG\r\n\x1a\n" or len(png) < 24:
            raise TraceError(f"image segment {segment_id}: a thumbnail must be PNG bytes")
        width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")  # IHDR
        if not (1 <= width <= MAX_THUMBNAIL_SIDE and 1 <= height <= MAX_THUMBNAIL_SIDE):
            raise TraceError(f"image segment {segment_id}: a {width}x{height} thumbnail; a reader accepts sides "
                             f"1..{MAX_THUMBNAIL_SIDE}")
        rel = f"{IMAGES_DIR}/{segment_id}.png"
        (self.path / IMAGES_DIR).mkdir(exist_ok=True)
        write_bytes_atomic(self.path / rel, png, fsync=self._fsync)
        return rel

    def close(self, status: str = "complete") -> None:
        """Final flush, compaction of the tokens parts into tokens.parquet, and the final status."""
        if status not in STATUSES:
            raise TraceError(f"status must be one of {STATUSES}, got {status!r}")
        with self._lock:
            if self._closed:
                return
            try:
                self._flush(list(TABLES), wait=True)
            finally:
                if self._pool is not None:
                    self._pool.shutdown(wait=True)
                    self._pool = None
            try:
                with self._session_lock:
                    self._compact_tokens()
                    self._session["status"] = status
                    self._write_session()
                    self._closed = True
            finally:
                if self._closed:
                    self._release_lock()

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close("complete" if exc_type is None else "failed")

    def _check_open(self) -> None:
        if self._closed:
            raise TraceError(f"trace writer for {self.path} is closed")

    def _flush(self, names: list[str], wait: bool) -> dict[str, int]:
        self._await_background_write()
        jobs = []
        for name in names:
            if self._buffers[name]:
                jobs.append((name, self._next_part[name], self._buffers[name]))
                self._next_part[name] += 1
                self._buffer_bytes -= sum(b.nbytes for b in self._buffers[name])
                self._buffers[name] = []
                self._buffer_rows[name] = 0
        if not jobs:
            return {}
        if wait:
            return self._write(jobs)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"trace-writer-{self.path.name}")
        self._pending = self._pool.submit(self._write, jobs)
        return {}

    def _await_background_write(self) -> None:
        """Wait for the background flush, if any; its failure surfaces here, in the caller's thread."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _write(self, jobs: list[tuple[str, int, list[Batch]]]) -> dict[str, int]:
        """Encode and publish one part per job, then record them in session.json (parts before manifest)."""
        started = time.thread_time()
        try:
            return self._write_parts(jobs)
        finally:
            self.last_write_cpu_s = time.thread_time() - started

    def _write_parts(self, jobs: list[tuple[str, int, list[Batch]]]) -> dict[str, int]:
        written = {}
        for name, seq, batches in jobs:
            spec = TABLES[name]
            table = coalesce(spec, to_table(spec, batches))
            table = table.replace_schema_metadata(part_notes(spec, self._session.get("policy") or {}))
            directory = self.path / name
            if seq == 0:
                directory.mkdir(exist_ok=True)
            write_parquet_atomic(table, directory / part_name(seq), parquet_options(spec, self._level),
                                 fsync=self._fsync)
            written[name] = table.num_rows
        with self._session_lock:
            for name, seq, _ in jobs:
                if name == "tokens":
                    self._session["tokens"] += written[name]
                self._session["parts"][name] = seq + 1
            self._write_session()
        return written

    def _compact_tokens(self) -> None:
        """Merge tokens/part-*.parquet into tokens.parquet (sorted by position), then drop the parts.

        Parts are deleted highest first, so a reader racing the deletion sees a prefix, never a gap.
        """
        directory = self.path / "tokens"
        parts = list_parts(directory)
        spec = TABLES["tokens"]
        tables = [pq.read_table(p, schema=spec.arrow_schema) for _, p in parts]
        table = pa.concat_tables(tables) if tables else spec.arrow_schema.empty_table()
        table = table.sort_by([("position", "ascending")])
        write_parquet_atomic(table, self.path / TOKENS_FILE, parquet_options(spec, self._level), fsync=self._fsync)
        for _, p in reversed(parts):
            p.unlink()
        if directory.exists():
            remove_stale_temps(directory)
            directory.rmdir()
        self._session["parts"].pop("tokens", None)

    def _write_session(self, checked: bool = False) -> None:
        """Write session.json, held to the reader's checks (`checked`: `update_session` just did that;
        `updated` is set again here, a timestamp of the same length)."""
        self._session["updated"] = _now()
        file = self.path / SESSION_FILE
        if checked:
            data = (json.dumps(self._session, indent=1) + "\n").encode()
        else:
            data = _encode_session(self._session, file)
        write_bytes_atomic(file, data, fsync=self._fsync)
