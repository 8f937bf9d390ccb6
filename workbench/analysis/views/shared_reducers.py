"""The reducers of one trace, shared by every browser session of this server that follows it.

    acquire(path, compare=None, root=None) -> SharedReducers   (one per trace; a counter of its users)
    release(shared)                                            (a session ended or followed another trace)

Why: a reducer's expensive part is folding the trace's parts in (the DSA and expert running sums, the
KDA norms, the health series); what a view asks for (bins, a layer, a token) is cheap on top of it.
Folded per page, a reload, a second viewer or a second tab of a long trace would pay the whole
read again while the page waited. Shared, the second
page gets the already reduced data at once (`Reducer.memo` answers from what the first computed).

The reducers are not thread-safe: a follower holds `lock` for a whole poll (refresh, then reduce),
so two sessions' polls of one trace run one after another, never interleaved. The last released
trace stays held (`KEEP_RELEASED`), so a page reload, which ends a session just before it opens
the next, finds it still folded; it is dropped instead when a part it read has changed on disk since
(a trace re-recorded into the same directory must not show the old one's data).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Mapping

from workbench.analysis.views import VIEW_REDUCERS, DSADiffReducer, Reducer, RecordingMapReducer
from workbench.analysis.views.part_feed import PartFeeds
from workbench.trace import TABLES, Trace

KEEP_RELEASED = 1  # traces without a user that stay folded (most recently released first out last)


class SharedReducers:
    """A trace opened once, with its session-map reducer and its views' reducers."""

    def __init__(self, key: tuple, path: Path, compare: Path | None, compare_label: str | None,
                 reducers: Mapping[str, type[Reducer]] | None = None) -> None:
        self.key = key
        self.path = path
        self.lock = threading.Lock()
        self.trace: Trace | None = None
        self.session = RecordingMapReducer()
        feeds = PartFeeds()  # a table two views fold (kda_norms) is read once for both
        self.views: dict[str, Reducer] = {name: cls(feeds) for name, cls in (reducers or VIEW_REDUCERS).items()}
        if compare is not None:
            self.views["diff"] = DSADiffReducer(compare, compare_label or str(compare))
        self.users = 0
        self.files: dict[str, tuple[int, int, int]] = {}  # part -> (inode, size, mtime) when released

    def fingerprint(self) -> dict[str, tuple[int, int, int]]:
        """(inode, size, mtime) of every part the held trace has read (empty when none is open)."""
        if self.trace is None:
            return {}
        out = {}
        for name in TABLES:
            for part in self.trace.parts(name):
                out[str(part)] = _stat(part)
        return out

    def unchanged(self) -> bool:
        """Whether every part seen when this was released is still the same file."""
        return all(_stat(Path(p)) == known for p, known in self.files.items())


def _stat(path: Path) -> tuple[int, int, int]:
    try:
        st = path.stat()
    except OSError:
        return (-1, -1, -1)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


_held: dict[tuple, SharedReducers] = {}
_released: OrderedDict[tuple, SharedReducers] = OrderedDict()
_guard = threading.Lock()


def _key(path: str | Path, compare: str | Path | None, reducers: Mapping[str, type[Reducer]] | None) -> tuple:
    views = None if reducers is None else tuple((name, cls) for name, cls in reducers.items())
    return (str(Path(path).absolute()), None if compare is None else str(Path(compare).absolute()), views)


def acquire(path: str | Path, compare: str | Path | None = None, compare_label: str | None = None,
            reducers: Mapping[str, type[Reducer]] | None = None) -> SharedReducers:
    """The shared reducers of `path` (compared with `compare`), created when no session holds them;
    `reducers` (view name -> reducer class, in run order) defaults to the built-in views."""
    key = _key(path, compare, reducers)
    with _guard:
        shared = _held.get(key)
        if shared is None:
            shared = _released.pop(key, None)
            shared = shared if shared is not None and shared.unchanged() else None
        if shared is None:
            shared = SharedReducers(key, Path(path), None if compare is None else Path(compare), compare_label,
                                    reducers)
        shared.users += 1
        _held[key] = shared
        return shared


def release(shared: SharedReducers) -> None:
    """One user fewer; with none left the trace is kept among the `KEEP_RELEASED` most recent, then dropped."""
    key = shared.key
    with _guard:
        shared.users = max(0, shared.users - 1)
        if shared.users or _held.get(key) is not shared:
            return
        del _held[key]
        # a poll still running must not change the trace while it is stat'ed; this runs on the server's
        # event loop, which must never wait for a poll: then the trace is simply not kept
        if not shared.lock.acquire(blocking=False):
            return
        try:
            shared.files = shared.fingerprint()
        finally:
            shared.lock.release()
        _released[key] = shared
        while len(_released) > KEEP_RELEASED:
            _released.popitem(last=False)


def forget_all() -> None:
    """Drop every shared trace (tests)."""
    with _guard:
        _held.clear()
        _released.clear()
