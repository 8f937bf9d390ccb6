"""Summaries of a finished trace kept on disk, so opening it again does not re-read every part.

    key(trace, table, extra)           which parts (path, size, mtime) the summary was made from
    load_arrow(key, name) / save_arrow(key, name, table)    Arrow IPC files (never pickle)
    load_json(key, name) / save_json(key, name, value)      small JSON documents
    restore_sums(trace, table) / store_sums(trace, table)   a trace's running sums (`Trace.running_sums`)

Only summaries of a *complete* trace are written (a live trace changes every poll); the key hashes
the trace's absolute path and every part of the tables the summary was read from, so a part that is
added, replaced or rewritten in place (size or mtime) gives another key and the summary is simply
not found. A summary that cannot be read (truncated, another layout, over `MAX_BYTES`) counts as not
found and is recomputed: the cache can always be deleted.

Where: `$K3WB_DASHBOARD_CACHE`, else `~/.cache/k3-workbench/dashboard`; `K3WB_DASHBOARD_CACHE=off`
turns it off. A directory that cannot be written turns it off for that summary, silently.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from workbench.trace import Trace

MAX_BYTES = 1 << 30  # a summary file larger than this is not read (they are a few MB at 1M tokens)
VERSION = 1  # bump when a summary's layout changes


def cache_root() -> Path | None:
    """The cache directory (None: off)."""
    env = os.environ.get("K3WB_DASHBOARD_CACHE")
    if env is not None and env.strip().lower() in ("", "off", "0", "none"):
        return None
    return Path(env) if env else Path.home() / ".cache" / "k3-workbench" / "dashboard"


def key(trace: Trace, tables: tuple[str, ...], extra: Any = None) -> str | None:
    """Key of a summary of `tables` of `trace` (and of `extra`, JSON-able); None when the trace is not
    complete or a part cannot be stat'ed (no summary is read or written then)."""
    if trace.status != "complete":
        return None
    digest = hashlib.sha256(f"v{VERSION}\0{trace.path.absolute()}\0".encode())
    for table in tables:
        for part in trace.parts(table):
            try:
                st = part.stat()
            except OSError:
                return None
            digest.update(f"{table}/{part.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    digest.update(json.dumps(extra, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:40]


def _path(cache_key: str, name: str) -> Path | None:
    root = cache_root()
    return None if root is None else root / cache_key[:2] / f"{cache_key}.{name}"


def _readable(path: Path | None) -> bool:
    try:
        return path is not None and path.is_file() and path.stat().st_size <= MAX_BYTES
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


def load_arrow(cache_key: str | None, name: str) -> pa.Table | None:
    path = _path(cache_key, name + ".arrow") if cache_key else None
    if not _readable(path):
        return None
    try:
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_file(source).read_all()
    except (OSError, pa.ArrowException, ValueError):
        return None


def save_arrow(cache_key: str | None, name: str, table: pa.Table) -> None:
    if not cache_key:
        return
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    _write(_path(cache_key, name + ".arrow"), sink.getvalue().to_pybytes())


def load_json(cache_key: str | None, name: str) -> Any:
    path = _path(cache_key, name + ".json") if cache_key else None
    if not _readable(path):
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def save_json(cache_key: str | None, name: str, value: Any) -> None:
    if cache_key:
        _write(_path(cache_key, name + ".json"), json.dumps(value).encode())


def restore_sums(trace: Trace, table: str) -> bool:
    """Give `trace` its running sums of `table` (dsa_key_counts, moe_counts) from the cache, so their
    parts are not read; whether they were there (and fit: `Trace.restore_running_sums` checks them)."""
    cache_key = key(trace, (table,))
    stored = load_arrow(cache_key, f"sums-{table}")
    if stored is None or "counts" not in stored.column_names:
        return False
    groups = [c for c in stored.column_names if c != "counts"]
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
