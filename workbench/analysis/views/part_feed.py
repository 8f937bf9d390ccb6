"""One read of a table's parts shared by the views that fold the same table.

    feed = PartFeeds().feed("kda_norms")
    sub = feed.subscribe(columns, digest, apply)     # digest(DecodedPart) -> piece (any thread); apply(path, piece)
    feed.update(trace, sub)                          # reads the parts `sub` has not seen, once for everyone

Why: the KDA state view and the KDA health view both fold every part of `kda_norms` (the largest
table of a long trace), and the Parquet decoding of the per-head lists is most of each view's first
open if each decodes every part on its own. So the first of
them to ask reads each new part once, with the columns both need, and hands it to every subscriber
that has not seen it. Each digest gets the part as a `DecodedPart`: its table, and its list columns
as float32 matrices converted once for all subscribers (both KDA views need every head's `norm`).

A part is read only for the subscriber that asks (`update(trace, sub)`): a view that restored its
summary from the cache and never asks causes no read; the table it was handed meanwhile by another
view's read is folded (bounded: each subscriber keeps only its reduction). `digest` runs in the
reading threads (pure: a decoded part in, that part's piece out); `apply` runs under the feed's lock,
in part order, so a subscriber's state changes only while the lock is held: a reducer reads its
folded state under `feed.lock` as well when its views may run in parallel threads.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa

from workbench.trace import Trace

from workbench.analysis.views.list_columns import list_matrix


class DecodedPart:
    """One part of a table as read once for every subscriber: its Arrow table (the columns all of them
    asked for) and its fixed-width list columns as float32 matrices, each made at most once."""

    def __init__(self, table: pa.Table) -> None:
        self.table = table
        self._matrices: dict[str, np.ndarray | None] = {}

    @property
    def num_rows(self) -> int:
        return self.table.num_rows

    def column(self, name: str) -> pa.ChunkedArray:
        return self.table[name]

    def matrix(self, name: str) -> np.ndarray | None:
        """`list_matrix` of a list column (float32 [rows, width], null rows NaN; None: nothing to show);
        the same array for every subscriber, which must not write into it."""
        if name not in self._matrices:
            matrix = list_matrix(self.table[name])
            if matrix is not None:
                matrix.flags.writeable = False
            self._matrices[name] = matrix
        return self._matrices[name]


class Subscription:
    """One view's interest in a table: the columns it reads, what it has seen, how it folds a part."""

    def __init__(self, columns: Sequence[str], digest: Callable[[DecodedPart], Any],
                 apply: Callable[[Path, Any], None]) -> None:
        self.columns = list(columns)
        self.digest = digest
        self.apply = apply
        self.seen: set[Path] = set()

    def skip(self, parts: Sequence[Path]) -> None:
        """Mark parts as folded without reading them (their reduction came from the summary cache)."""
        self.seen.update(parts)


class PartFeed:
    """The parts of one table of one trace, each read at most once for all its subscribers."""

    def __init__(self, table: str) -> None:
        self.table = table
        self.lock = threading.RLock()
        self._subs: list[Subscription] = []

    def subscribe(self, columns: Sequence[str], digest: Callable[[DecodedPart], Any],
                  apply: Callable[[Path, Any], None]) -> Subscription:
        sub = Subscription(columns, digest, apply)
        with self.lock:
            self._subs.append(sub)
        return sub

    def update(self, trace: Trace, sub: Subscription) -> int:
        """Read the parts of the table `sub` has not seen (once, with every subscriber's columns) and
        fold each into every subscriber that has not seen it; returns how many parts reached `sub`."""
        with self.lock:
            new = [p for p in trace.parts(self.table) if p not in sub.seen]
            if not new:
                return 0
            columns = list(dict.fromkeys(c for s in self._subs for c in s.columns))

            def read(path: Path) -> list[tuple[Subscription, Any]]:
                part = DecodedPart(trace.read_part(self.table, path, columns))
                return [(s, s.digest(part)) for s in self._subs if path not in s.seen]

            # decoding and the digests release the GIL: on two cores, two threads overlap one part's
            # decoding with the previous part's digest
            workers = min(4, max(2, (os.cpu_count() or 1) - 2), len(new))
            with ThreadPoolExecutor(workers, thread_name_prefix=f"feed-{self.table}") as pool:
                # a few parts ahead, no more: a digest can be large (the health view's per-head matrices
                # of one part) and is only made small by its `apply` (which thins what it keeps)
                ahead: deque[tuple[Path, Future]] = deque()
                for path in new:
                    ahead.append((path, pool.submit(read, path)))
                    if len(ahead) > 2 * workers:
                        self._apply(*ahead.popleft())
                while ahead:
                    self._apply(*ahead.popleft())
            return len(new)

    @staticmethod
    def _apply(path: Path, pending: Future) -> None:
        for s, piece in pending.result():
            if path not in s.seen:
                s.seen.add(path)
                s.apply(path, piece)


class PartFeeds:
    """The feeds of one followed trace, by table (one per `SharedReducers`)."""

    def __init__(self) -> None:
        self._feeds: dict[str, PartFeed] = {}
        self._guard = threading.Lock()

    def feed(self, table: str) -> PartFeed:
        with self._guard:
            return self._feeds.setdefault(table, PartFeed(table))
