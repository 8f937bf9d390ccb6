"""Replacing a directory the command wrote before, so that a crash at any point keeps a good copy.

A directory cannot be swapped with one rename, so a replacement takes three steps: the old
directory is renamed aside (`.NAME.old-PID`), the finished new one (`.NAME.tmp-PID`) is renamed
in, and only then the old one is deleted. A SIGKILL between any two steps leaves either the old or
the new directory at the path, or the old one aside with nothing at the path; `recover` (called
before every save and load) renames it back and removes what dead writers left behind.

The marker check (`require_ours`) is what keeps `--overwrite` from deleting a directory that some
other program, or the user, put there. A temporary is marked from its creation (`make_temp` writes
`PARTIAL_MARKER` first), so `recover` removes only siblings that carry our naming AND one of our
markers: a user's own `.NAME.old-123` directory is never touched. Files the user added to one of our
directories are carried into its replacement (`carry_over`), so `--overwrite` replaces only what the
command wrote.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from engine.errors import EngineError
from engine.io.files import file_kind, process_alive

_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)$")
# inside a directory still being built; removed just before it is renamed into place (by then the
# writer's own completion marker is there, so the directory stays recognisable at every instant)
PARTIAL_MARKER = ".k3-workbench-partial"


def temp_path(path: Path) -> Path:
    """Where this process builds the new directory before it is renamed to `path`."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _aside_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.old-{os.getpid()}")


def make_temp(path: Path) -> Path:
    """Create (afresh) and mark the temporary directory in which this process builds `path`."""
    tmp = temp_path(path)
    if tmp.is_dir() and not tmp.is_symlink() and (tmp / PARTIAL_MARKER).is_file():
        remove_ours(tmp)  # this pid's own temporary from before (a reused pid, or a retry)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()  # fails on anything else at that name: never ours to delete
    (tmp / PARTIAL_MARKER).write_bytes(b"")
    return tmp


@contextmanager
def building(path: Path, what: str, error: type[Exception], previous_kept: Callable[[Path], bool]) -> Iterator[Path]:
    """A partial directory beside `path` to write `what` into; the block moves it into place (`replace`).

    An OSError (disk full, permissions) becomes one `error` line saying what is still at `path`; the
    partial directory is removed unless the block renamed it into place.
    """
    tmp = None
    try:
        tmp = make_temp(path)
        yield tmp
    except OSError as exc:
        kept = f"the previous {what} there is kept" if previous_kept(path) else "nothing was written"
        raise error(f"cannot write the {what} to {path}: {exc.strerror or exc}; {kept}") from None
    finally:
        if tmp is not None and tmp.is_dir():
            remove_ours(tmp)


def remove_ours(p: Path) -> None:
    """Delete a directory of ours so that it stays recognisable as ours if a kill interrupts this:
    the partial marker goes in first and out last, then the (by then empty) directory."""
    try:
        (p / PARTIAL_MARKER).touch()
        for entry in p.iterdir():
            if entry.name == PARTIAL_MARKER:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        (p / PARTIAL_MARKER).unlink(missing_ok=True)
        p.rmdir()
    except OSError:
        pass  # what is left still bears the marker (or is empty): the next recovery finishes it


def _is_our_leftover(p: Path, is_complete: Callable[[Path], bool]) -> bool:
    if p.is_symlink() or not p.is_dir():
        return False
    try:
        empty = not any(p.iterdir())  # killed between mkdir and the partial marker
    except OSError:
        return False
    return empty or (p / PARTIAL_MARKER).is_file() or is_complete(p)


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
    if not path.exists() and not path.is_symlink():
        # killed between "old aside" and "new in": the old copy is the last good one
        asides = [p for kind, pid, p in leftovers if kind == "old" and not process_alive(pid) and is_complete(p)
                  and not p.is_symlink() and not (p / PARTIAL_MARKER).exists()]
        if asides:
            os.replace(max(asides, key=lambda p: p.stat().st_mtime), path)
    for kind, pid, p in _leftovers(path):
        if not process_alive(pid) and _is_our_leftover(p, is_complete):
            remove_ours(p)


def carry_over(old: Path, tmp: Path, is_ours: Callable[[str], bool]) -> None:
    """Put into `tmp` every entry of `old` that the writer did not write (`is_ours(name)` False).

    Files are hard-linked (copied where links fail) and folders copied, never moved, so the user's
    files exist at every instant of the swap that follows.
    """
    if not old.is_dir() or old.is_symlink():
        return
    built = {p.name for p in tmp.iterdir()}
    for entry in old.iterdir():
        if entry.name in built or entry.name == PARTIAL_MARKER or is_ours(entry.name):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, tmp / entry.name, symlinks=True)
            continue
        try:
            os.link(entry, tmp / entry.name, follow_symlinks=False)
        except OSError:
            shutil.copy2(entry, tmp / entry.name, follow_symlinks=False)


def replace(tmp: Path, path: Path) -> None:
    """Move the finished directory `tmp` to `path`, replacing what is there in crash-safe steps.

    The writer's completion marker must already be in `tmp` (it is what recovery recognises then).
    """
    (tmp / PARTIAL_MARKER).unlink(missing_ok=True)
    if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
        path.rmdir()  # an empty directory the user pointed at: nothing in it to keep
    if not path.exists():
        os.replace(tmp, path)
        return
    aside = _aside_path(path)
    if aside.exists() or aside.is_symlink():
        raise FileExistsError(f"{aside} is in the way of the replacement (not ours to delete)")
    os.replace(path, aside)
    os.replace(tmp, path)
    remove_ours(aside)


def require_ours(path: Path, overwrite: bool, is_ours: Callable[[Path], bool], what: str,
                 error: type[EngineError], flag: str = "--overwrite") -> None:
    """Check an output directory before any work: absent or empty is fine; else it must be `what` and `overwrite`.

    Raises `error` (one line) for a file at `path`, a non-empty directory without `overwrite`, and a
    non-empty directory that is not `what` (recognised by `is_ours`) even with `overwrite`.
    """
    if path.is_symlink():
        raise error(f"{path} is a symbolic link; refusing to write through it (give the directory itself)")
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


def require_replaceable(path: Path, is_ours: Callable[[str], bool], error: type[EngineError]) -> None:
    """Refuse to replace a directory in which an entry we would drop (`is_ours(name)`) is not a plain
    file or folder: a FIFO, device, socket or symbolic link there was put by someone else."""
    for entry in path.iterdir():
        if not is_ours(entry.name):
            continue
        kind = _odd_kind(entry)
        if kind is not None:
            raise error(f"{entry} is {kind}, not a file this command wrote; refusing to replace {path}")


def _odd_kind(entry: Path) -> str | None:
    mode = entry.lstat().st_mode
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return "a symbolic link" if stat.S_ISLNK(mode) else (file_kind(entry) or "not a regular file")

