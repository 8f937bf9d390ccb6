"""A view of one side file of a trace (`effects.parquet`, `attribution.json`): read again only when it changed.

The effects and attribution views show what was measured on the session after its recording, kept in
one file of the trace directory (`workbench.trace.side_files`). Both re-read it only when the file
changed (its size and modification time) or an option of theirs did, and both show a note instead of
the view when there is no file yet or it cannot be read (the TraceError's message names the file and
the problem): `side_file_data` is that, once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, TypeVar

from workbench.analysis.views.base import Reducer
from workbench.trace import TraceError

Fields = TypeVar("Fields")


def file_version(path: Path) -> tuple:
    """(size, modification time in ns) of `path`; () when there is no file (or it cannot be stat'ed)."""
    try:
        info = path.stat()
    except OSError:
        return ()
    return (info.st_size, info.st_mtime_ns)


def side_file_data(reducer: Reducer, name: str, path: Path, build: Callable[[], Fields],
                   empty: Callable[[str], Fields], absent: str, options: Any = None) -> Fields:
    """`build()` (which reads the file), memoised under `name` on the file's version and `options`;
    `empty(absent)` when there is no file, `empty(message)` when reading it raised a TraceError."""
    version = file_version(path)

    def compute() -> Fields:
        if not version:
            return empty(absent)
        try:
            return build()
        except TraceError as exc:
            return empty(str(exc))

    return reducer.memo(name, (version, options), compute)


__all__ = ["file_version", "side_file_data"]
