"""Opening files a user names or receives: only regular files, with a size limit, one-line errors.

A FIFO in place of a file blocks `open()` forever, a directory raises `IsADirectoryError`, and
`/dev/zero` reads without end; every reader of user input goes through `file_kind` /
`read_limited` first, so those cases become an `EngineError` naming the path. `parse_json` reads
JSON that someone else may have written: bounded nesting, one-line errors.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import numpy as np

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


# Deeper than any file we write (session.json, snapshots, configs, summaries nest a few levels);
# anything past it is refused before code that walks the value recursively could hit Python's
# recursion limit.
MAX_JSON_DEPTH = 64


def parse_json(data: bytes | str, source: str, error: type[EngineError], max_depth: int = MAX_JSON_DEPTH) -> Any:
    """`data` parsed as JSON, nested at most `max_depth` deep; else `error`, one line naming `source`."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as exc:
        raise error(f"{source}: not valid JSON (not UTF-8 text: byte {exc.start})") from None
    if _bracket_depth(text) > max_depth:
        raise error(f"{source}: not valid JSON for this reader (nested deeper than {max_depth} levels)")
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError, ValueError) as exc:
        raise error(f"{source}: not valid JSON ({str(exc)[:200]})") from None


def _bracket_depth(text: str) -> int:
    """Deepest nesting of `[`/`{` outside strings: checked before parsing, since the parser itself
    recurses once per level. Strings and everything but brackets are cut out by regular expressions
    and the rest counted by a running sum: no Python loop over the file's characters (session.json is
    re-read on every poll of a live trace)."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text)).encode("ascii")
    chars = np.frombuffer(brackets, dtype=np.uint8)
    steps = ((chars == ord("[")) | (chars == ord("{"))).astype(np.int32)
    steps -= (chars == ord("]")) | (chars == ord("}"))
    return int(np.cumsum(steps).max(initial=0))


# a JSON string: quotes around anything but a quote or backslash, or an escaped character
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
