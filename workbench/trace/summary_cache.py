"""Summaries of a finished trace kept on disk, so opening it again does not re-read every part.

    key(trace, table, extra)           which parts (name, size, content) the summary was made from
    load_arrow(key, name) / save_arrow(key, name, table)    Arrow IPC files (never pickle)
    load_json(key, name) / save_json(key, name, value)      small JSON documents
    restore_sums(trace, table) / store_sums(trace, table)   a trace's running sums (`Trace.running_sums`)
    into_trace(path)                   summaries made meanwhile go into the trace directory itself

Only summaries of a *complete* trace are written (a live trace changes every poll); the key hashes
every part of the tables the summary was read from (name, size and the part's last 64 KiB, which
hold its Parquet footer: every column chunk's offsets and statistics; a small part whole), not the
trace's path or the parts' times, so a copied trace still finds its summaries and a part that is
added, replaced or rewritten gives another key and the summary is simply not found. A summary that
cannot be read (truncated, another layout, over `MAX_BYTES` / `MAX_JSON_BYTES`, a column over
`MAX_ROWS` values, a compressed body: `arrow_limits`) counts as not found and is recomputed.

Two places, looked up in this order:
- `<trace>/summaries/`: written only inside `into_trace(trace)`, i.e. by the command that recorded
  the trace (`workbench run` calls `write_summaries` when the recording ends), so they travel with
  the trace (a 1M-token trace recorded on a GPU node opens in seconds on a laptop); a dashboard
  that merely views a trace never writes into it.
- the user cache: `$K3WB_DASHBOARD_CACHE`, else `~/.cache/k3-workbench/dashboard`, written by the
  dashboard for the traces it opened.
`K3WB_DASHBOARD_CACHE=off` turns both off. A directory that cannot be written turns it off for that
summary, silently; either can always be deleted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import numpy as np
import pyarrow as pa

from engine.errors import EngineError
from engine.io.files import parse_json
from workbench.trace.arrow_limits import BoundsError, read_bounded
from workbench.trace import Trace
from workbench.trace.bounds import MAX_DENSE_CELLS

# summaries arrive with traces from anyone: limits on what reading one may allocate (a 1M-token
# trace's summaries take a few tens of MB); the file limit bounds an Arrow summary's decoded size
# because only uncompressed bodies are read, mapped in place
MAX_BYTES = 256 << 20  # an Arrow summary file larger than this is not read
MAX_JSON_BYTES = 16 << 20  # a JSON summary: decoded into Python objects, several times its size
MAX_ROWS = 1 << 26  # values in one column of an Arrow summary (a list column's items too)
MAX_SUM_GROUPS = 1 << 20  # groups of a running-sums summary (each becomes a Python dict entry)
MAX_SUM_GROUP_COLUMNS = 8  # columns a running sum is grouped by (layer, segment, modality, ...)
VERSION = 3  # bump when a summary's layout, the key or what a view computes from it changes
TRACE_DIR = "summaries"  # inside a trace directory
_TAIL = 64 << 10  # bytes of a part's end hashed into the key (its footer); a smaller part is hashed whole

_into: set[Path] = set()  # trace directories whose summaries go into the trace (`into_trace`)
_into_guard = threading.Lock()


class Key(NamedTuple):
    """Where a summary of one trace lives: the digest of its parts and the trace directory."""

    digest: str
    trace: Path


def cache_root() -> Path | None:
    """The user cache directory (None: summaries off)."""
    env = os.environ.get("K3WB_DASHBOARD_CACHE")
    if env is not None and env.strip().lower() in ("", "off", "0", "none"):
        return None
    return Path(env) if env else Path.home() / ".cache" / "k3-workbench" / "dashboard"


@contextlib.contextmanager
def into_trace(path: str | Path) -> Iterator[None]:
    """Summaries saved meanwhile for the trace at `path` are written into `<path>/summaries/`."""
    path = Path(path).absolute()
    with _into_guard:
        _into.add(path)
    try:
        yield
    finally:
        with _into_guard:
            _into.discard(path)


def _part_digest(path: Path) -> bytes:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(max(0, size - _TAIL))
        return hashlib.sha256(f"{size}\0".encode() + f.read(_TAIL)).digest()


def key(trace: Trace, tables: tuple[str, ...], extra: Any = None) -> Key | None:
    """Key of a summary of `tables` of `trace` (and of `extra`, JSON-able); None when the trace is not
    complete, a part cannot be read, or summaries are off (nothing is read or written then)."""
    if trace.status != "complete" or cache_root() is None:
        return None
    digest = hashlib.sha256(f"v{VERSION}\0".encode())
    for table in tables:
        for part in trace.parts(table):
            try:
                digest.update(f"{table}/{part.name}\0".encode() + _part_digest(part))
            except OSError:
                return None
    digest.update(json.dumps(extra, sort_keys=True, default=str).encode())
    return Key(digest.hexdigest()[:40], trace.path.absolute())


def _paths(cache_key: Key, name: str) -> list[Path]:
    """Where a summary may be, in lookup order (the trace's own, then the user cache); inside
    `into_trace` only the trace's own, so that everything it summarizes is written there."""
    root = cache_root()
    if root is None:
        return []
    folder = cache_key.trace / TRACE_DIR
    # a trace is often someone else's: its summaries folder must be a folder of its own, not a link
    own = [folder / f"{cache_key.digest}.{name}"] if not folder.is_symlink() else []
    with _into_guard:
        if cache_key.trace in _into:
            return own
    return own + [root / cache_key.digest[:2] / f"{cache_key.digest}.{name}"]


def _target(cache_key: Key, name: str) -> Path | None:
    """Where a summary is written: into the trace inside `into_trace`, else the user cache."""
    paths = _paths(cache_key, name)  # inside `into_trace` only the trace's own folder (none if it is a link)
    return paths[-1] if paths else None


def _readable(path: Path, limit: int = MAX_BYTES) -> bool:
    try:
        return not path.is_symlink() and path.is_file() and path.stat().st_size <= limit
    except OSError:
        return False


def _write(path: Path | None, data: bytes) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)  # readers see the old file or the whole new one
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError:
        pass  # a cache that cannot be written is only slower


def load_arrow(cache_key: Key | None, name: str, max_rows: int = MAX_ROWS) -> pa.Table | None:
    for path in _paths(cache_key, name + ".arrow") if cache_key else ():
        if not _readable(path):
            continue
        try:
            return read_bounded(path, max_rows)
        except (OSError, BoundsError):
            continue
    return None


def save_arrow(cache_key: Key | None, name: str, table: pa.Table) -> None:
    if not cache_key:
        return
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    _write(_target(cache_key, name + ".arrow"), sink.getvalue().to_pybytes())


def load_json(cache_key: Key | None, name: str) -> Any:
    for path in _paths(cache_key, name + ".json") if cache_key else ():
        if not _readable(path, MAX_JSON_BYTES):
            continue
        try:
            with open(path, "rb") as f:  # bounded read: the file may have grown since it was checked
                data = f.read(MAX_JSON_BYTES + 1)
            if len(data) > MAX_JSON_BYTES:
                continue
            return parse_json(data, str(path), EngineError)
        except (OSError, EngineError):  # a deep or damaged summary counts as absent: it is recomputed
            continue
    return None


def save_json(cache_key: Key | None, name: str, value: Any) -> None:
    if cache_key:
        _write(_target(cache_key, name + ".json"), json.dumps(value).encode())


def restore_sums(trace: Trace, table: str) -> bool:
    """Give `trace` its running sums of `table` (dsa_key_counts, moe_counts) from the cache, so their
    parts are not read; whether they were there (and fit: `Trace.restore_running_sums` checks them)."""
    cache_key = key(trace, (table,))
    stored = load_arrow(cache_key, f"sums-{table}", max_rows=MAX_DENSE_CELLS)
    if stored is None or "counts" not in stored.column_names or stored.num_rows > MAX_SUM_GROUPS:
        return False
    groups = [c for c in stored.column_names if c != "counts"]
    # group columns are a few integer columns: anything else is refused before it is converted
    if len(groups) > MAX_SUM_GROUP_COLUMNS or not all(pa.types.is_integer(stored.schema.field(g).type) for g in groups):
        return False
    counts = stored["counts"].combine_chunks()
    if not (pa.types.is_list(counts.type) or pa.types.is_large_list(counts.type)) \
            or not pa.types.is_int64(counts.type.value_type) or counts.null_count:
        return False
    flat = counts.values.to_numpy(zero_copy_only=False)
    offsets = counts.offsets.to_numpy()
    columns = [stored[g].to_numpy() for g in groups]
    if any(not np.issubdtype(c.dtype, np.integer) for c in columns):
        return False
    sums = {tuple(int(c[i]) for c in columns): np.ascontiguousarray(flat[offsets[i]:offsets[i + 1]], np.int64)
            for i in range(stored.num_rows)}
    return trace.restore_running_sums(table, tuple(groups), sums)


def store_sums(trace: Trace, table: str) -> None:
    """Put `trace`'s running sums of `table` in the cache (a finished trace only; nothing otherwise)."""
    cache_key = key(trace, (table,))
    if cache_key is None:
        return
    groups, sums = trace.running_sums(table)
    keys = list(sums)
    columns = {g: pa.array([k[i] for k in keys], pa.int64()) for i, g in enumerate(groups)}
    offsets = np.cumsum([0] + [len(sums[k]) for k in keys]).astype(np.int64)
    flat = np.concatenate([sums[k] for k in keys]) if keys else np.zeros(0, np.int64)
    columns["counts"] = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat, pa.int64()))
    save_arrow(cache_key, f"sums-{table}", pa.table(columns))
