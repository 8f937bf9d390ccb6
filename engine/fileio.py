"""Opening files a user names or receives: only regular files, with a size limit, one-line errors.

A FIFO in place of a file blocks `open()` forever, a directory raises `IsADirectoryError`, and
`/dev/zero` reads without end; every reader of user input goes through `file_kind` /
`read_limited` first, so those cases become an `EngineError` naming the path.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from engine.errors import EngineError


def file_kind(path: str | Path) -> str | None:
    """What `path` is when it is not a regular file (after symlinks), e.g. "a FIFO"; None for a regular file.

    Raises FileNotFoundError when nothing is there.
    """
    mode = os.stat(path).st_mode
    if stat.S_ISREG(mode):
        return None
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def require_regular(path: str | Path, what: str, error: type[EngineError]) -> Path:
    """`path` as a Path when it is an existing regular file; else `error` naming it and `what` it should be."""
    path = Path(path)
    try:
        kind = file_kind(path)
    except FileNotFoundError:
        raise error(f"{path}: no such file (expected {what})") from None
    except OSError as exc:
        raise error(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if kind is not None:
        raise error(f"{path} is {kind}, not a regular file (expected {what})")
    return path


def read_limited(path: str | Path, what: str, error: type[EngineError], limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (else `error`, one line naming the path)."""
    path = require_regular(path, what, error)
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise error(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if len(data) > limit:
        raise error(f"{path}: larger than the {limit:,} bytes allowed for {what}")
    return data


def fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def process_alive(pid: int) -> bool:
    """Whether process `pid` on this host still runs (this process counts; a pid that cannot be
    checked, e.g. another user's or out of range, counts as alive: never treat it as gone)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True
