"""Side files: what a trace directory keeps beside its recorded tables, measured after the recording.

`effects.parquet` (`effects_table`) and `attribution.json` (`attribution_file`) share one life:
- written only into an existing trace (a directory with `session.json`), atomically: a hidden
  temporary (`.NAME.tmp`, which `target` deletes with the session), fsynced, renamed over the old
  file, the directory fsynced (`files.write_bytes_atomic` / `write_parquet_atomic`), so a crash
  leaves the previous file whole;
- read back checked: the size is checked before anything is allocated, and every problem is a
  TraceError naming the file and the problem (a trace may come from anyone).
What the file holds, and how its content is checked, stays with its own module; this one knows only
the file.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from workbench.trace.errors import TraceError
from workbench.trace.files import write_bytes_atomic, write_parquet_atomic
from workbench.trace.schema import SESSION_FILE


def trace_directory(trace: Any) -> Path:
    """The trace directory of a `Trace` (its `.path`) or a path."""
    path = getattr(trace, "path", trace)
    if not isinstance(path, (str, os.PathLike)):
        raise TraceError(f"a trace path must be a str or path, got {type(path).__name__}")
    return Path(path)


@dataclass(frozen=True)
class SideFile:
    """One side file of a trace directory.

    Attributes:
        name (str): its file name inside the trace directory (`attribution.json`).
        noun (str): what it holds, with its article, for messages (`an attribution`).
        max_bytes (int): the largest file that is read; a larger one is a TraceError before any read.
    """

    name: str
    noun: str
    max_bytes: int

    def path(self, trace: Any) -> Path:
        """Where the file is in the trace directory of `trace` (a `Trace` or a path)."""
        return trace_directory(trace) / self.name

    def existing(self, trace: Any) -> Path | None:
        """The file's path when it exists and is at most `max_bytes`; None when the trace has none."""
        path = self.path(trace)
        try:
            info = path.stat()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise TraceError(f"{path}: cannot read {self._the()} ({exc.strerror or exc})") from None
        # a FIFO would block the read forever, a directory fail it: neither is a file we wrote
        if not stat.S_ISREG(info.st_mode):
            raise TraceError(f"{path}: cannot read {self._the()} (not a regular file)")
        size = info.st_size
        if size > self.max_bytes:
            raise TraceError(f"{path}: {size:,} bytes is too large for {self.noun} (at most {self.max_bytes:,})")
        return path

    def read_bytes(self, trace: Any) -> bytes | None:
        """The file's bytes (None when the trace has none); at most `max_bytes` are ever read, even
        from a file that grew after its size was checked."""
        path = self.existing(trace)
        if path is None:
            return None
        try:
            with open(path, "rb") as handle:
                data = handle.read(self.max_bytes + 1)
        except OSError as exc:
            raise TraceError(f"{path}: cannot read {self._the()} ({exc.strerror or exc})") from None
        if len(data) > self.max_bytes:
            raise TraceError(f"{path}: more than {self.max_bytes:,} bytes is too large for {self.noun}")
        return data

    def target(self, trace: Any) -> Path:
        """Where the file is written: inside a trace directory (TraceError when `trace` is not one)."""
        directory = trace_directory(trace)
        if not (directory / SESSION_FILE).is_file():
            raise TraceError(f"{directory}: not a trace directory (no {SESSION_FILE}); {self.noun} is written "
                             f"into a trace")
        return directory / self.name

    def write_bytes(self, trace: Any, data: bytes) -> Path:
        """Replace the file with `data` atomically; its path."""
        final = self.target(trace)
        write_bytes_atomic(final, data)
        return final

    def write_parquet(self, trace: Any, table: pa.Table) -> Path:
        """Replace the file with `table` as Parquet (pyarrow's default options) atomically; its path."""
        final = self.target(trace)
        write_parquet_atomic(table, final, {})
        return final

    def _the(self) -> str:
        # "an attribution" -> "the attribution": this trace's file, not any
        article, _, rest = self.noun.partition(" ")
        return f"the {rest}" if article in ("a", "an") and rest else self.noun


__all__ = ["SideFile", "trace_directory"]
