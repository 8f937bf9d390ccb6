"""Where a trace may be written, and the one-writer-per-trace lock (used by `TraceWriter.create`).

A non-empty directory is replaced only with `overwrite`, only when it holds a trace
(`session.json`) and only when no live writer records into it. Replacing deletes only the entries a
trace writer writes (session.json last, so an interrupted clean-up still reads as a trace); files
the user added to the directory stay. The lock is `fcntl.flock` on `LOCK_FILE` inside the trace:
advisory, held by the writer from `create` to `close`, and released by the OS when its process
dies, so a crash never leaves a trace locked.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
from pathlib import Path

from engine.io import atomic_dir
from engine.io.files import parse_json
from workbench.trace.attribution_file import ATTRIBUTION_FILE
from workbench.trace.effects_table import EFFECTS_FILE
from workbench.trace.errors import TraceError
from workbench.trace.schema import IMAGES_DIR, SESSION_FILE, TABLES, TOKENS_FILE

LOCK_FILE = ".writer.lock"
# what the dashboard derives from a finished trace and keeps inside it (`workbench summarize`)
_DERIVED_DIRS = ("summaries",)


def _written_by_us(name: str) -> bool:
    """Whether a trace directory's entry is one a trace writer (or the dashboard's summaries) wrote."""
    return (name in (SESSION_FILE, TOKENS_FILE, IMAGES_DIR, LOCK_FILE) or name in TABLES or name in _DERIVED_DIRS
            or name in (f".{SESSION_FILE}.tmp", f".{TOKENS_FILE}.tmp")
            # the effects and the attribution measured on the session (`effects_table`, `attribution_file`):
            # they go with it
            or name in (EFFECTS_FILE, f".{EFFECTS_FILE}.tmp", ATTRIBUTION_FILE, f".{ATTRIBUTION_FILE}.tmp"))


def check_trace_target(path: str | Path, *, overwrite: bool = False) -> None:
    """Refuse, before any work, a path a new trace cannot be created at (TraceError, one line).

    A non-empty directory is replaced only with `overwrite`, only when it holds a trace
    (`session.json`) and only when no live writer records into it; what the user added to the
    directory is kept, anything else at the path is never deleted.
    """
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        _refuse_if_locked(path)  # first: "being recorded" says more than "not empty"
    check_contents(path, overwrite)


def check_contents(path: Path, overwrite: bool) -> None:
    """What `check_trace_target` checks besides the lock (the writer calls it again holding the lock)."""
    if path.is_symlink():
        raise TraceError(f"{path} is a symbolic link; refusing to write a trace through it (give the directory "
                         f"itself)")
    if path.exists():
        if not path.is_dir():
            raise TraceError(f"{path} exists and is not a directory")
        if any(p.name != LOCK_FILE for p in path.iterdir()):
            if not (path / SESSION_FILE).is_file():
                raise TraceError(f"{path} is not empty and holds no trace; refusing to delete it")
            if not overwrite:
                raise TraceError(f"{path} is not empty; pass overwrite=True (--overwrite) to replace the trace there")
            atomic_dir.require_replaceable(path, _written_by_us, TraceError)
    else:
        parent = next((p for p in path.parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            raise TraceError(f"{path}: {parent} is not a directory")


def _open_lock(path: Path, create: bool) -> int | None:
    """A descriptor of the trace's lock file (None when there is none and `create` is False)."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path / LOCK_FILE, flags, 0o644)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise TraceError(f"{path / LOCK_FILE}: cannot open the trace's writer lock ({exc.strerror or exc})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise TraceError(f"{path / LOCK_FILE} is not a regular file; refusing to record into {path}")
    return fd


def _locked_by_other(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    return False


def _busy_error(path: Path) -> TraceError:
    pid = None
    try:
        with open(path / SESSION_FILE, "rb") as f:
            writer = parse_json(f.read(1 << 20), "session.json", TraceError).get("writer")
        pid = writer.get("pid") if isinstance(writer, dict) else None
    except (OSError, ValueError, AttributeError, TraceError):
        pass
    who = f"another process (pid {pid})" if isinstance(pid, int) else "another process"
    return TraceError(f"{path} is being recorded by {who}; one writer per trace: wait for it to finish or choose "
                      f"another path")


def _refuse_if_locked(path: Path) -> None:
    fd = _open_lock(path, create=False)
    if fd is None:
        return
    try:
        if _locked_by_other(fd):
            raise _busy_error(path)
    finally:
        os.close(fd)  # also drops the probe's own lock


def take_lock(path: Path) -> int:
    """Lock the trace at `path` for this writer (the descriptor to close when done), or TraceError naming
    the process that records into it."""
    fd = _open_lock(path, create=True)
    if _locked_by_other(fd):
        os.close(fd)
        raise _busy_error(path)
    return fd


def clear_previous_trace(path: Path) -> None:
    """Delete what a previous recording wrote (session.json last: until then it is still a trace)."""
    for entry in path.iterdir():
        if entry.name in (SESSION_FILE, LOCK_FILE) or not _written_by_us(entry.name):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    (path / SESSION_FILE).unlink(missing_ok=True)
