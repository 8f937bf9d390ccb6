"""Replacing a directory the command wrote before, so that a crash at any point keeps a good copy.

A directory cannot be swapped with one rename, so a replacement takes three steps: the old
directory is renamed aside (`.NAME.old-PID`), the finished new one (`.NAME.tmp-PID`) is renamed
in, and only then the old one is deleted. A SIGKILL between any two steps leaves either the old or
the new directory at the path, or the old one aside with nothing at the path; `recover` (called
before every save and load) renames it back and removes what dead writers left behind.

The marker check (`require_ours`) is what keeps `--overwrite` from deleting a directory that some
other program, or the user, put there.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Callable

from engine.errors import EngineError
from engine.fileio import process_alive

_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)$")


def temp_path(path: Path) -> Path:
    """Where this process builds the new directory before it is renamed to `path`."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _aside_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.old-{os.getpid()}")



def _leftovers(path: Path) -> list[tuple[str, int, Path]]:
    parent = path.parent
    if not parent.is_dir():
        return []
    found = []
    for entry in parent.iterdir():
        m = _LEFTOVER.match(entry.name)
        if m and m.group("name") == path.name:
            found.append((m.group("kind"), int(m.group("pid")), entry))
    return found


def recover(path: str | Path, is_complete: Callable[[Path], bool]) -> None:
    """Undo what an interrupted `replace` left: restore an old copy set aside, drop stale temporaries.

    `is_complete(dir)` says whether a directory is a whole one (its marker file is there).
    """
    path = Path(path)
    leftovers = _leftovers(path)
    if not path.exists():
        # killed between "old aside" and "new in": the old copy is the last good one
        asides = [p for kind, pid, p in leftovers if kind == "old" and not process_alive(pid) and is_complete(p)]
        if asides:
            os.replace(max(asides, key=lambda p: p.stat().st_mtime), path)
    for kind, pid, p in _leftovers(path):
        if not process_alive(pid):
            shutil.rmtree(p, ignore_errors=True)


def replace(tmp: Path, path: Path) -> None:
    """Move the finished directory `tmp` to `path`, replacing what is there in crash-safe steps."""
    if not path.exists():
        os.replace(tmp, path)
        return
    aside = _aside_path(path)
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(path, aside)
    os.replace(tmp, path)
    shutil.rmtree(aside, ignore_errors=True)


def require_ours(path: Path, overwrite: bool, is_ours: Callable[[Path], bool], what: str,
                 error: type[EngineError], flag: str = "--overwrite") -> None:
    """Check an output directory before any work: absent or empty is fine; else it must be `what` and `overwrite`.

    Raises `error` (one line) for a file at `path`, a non-empty directory without `overwrite`, and a
    non-empty directory that is not `what` (recognised by `is_ours`) even with `overwrite`.
    """
    if not path.exists():
        parent = next((p for p in path.parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            raise error(f"{path}: {parent} is not a directory")
        return
    if not path.is_dir():
        raise error(f"{path} exists and is not a directory (expected {what})")
    if not any(path.iterdir()):
        return
    if not is_ours(path):
        raise error(f"{path} is not empty and is not {what}; refusing to replace it (choose another path)")
    if not overwrite:
        raise error(f"{path} is not empty: it holds {what}; pass {flag} to replace it")

