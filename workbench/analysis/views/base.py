"""What every view reducer shares: the options the views ask for, the heat-map type, and memoisation.

A reducer is a function of (trace, options, session map data); `Reducer.memo` recomputes a field
only when what it depends on changed, and `Reducer.result` returns the previous data object when no
field changed, so a view can tell "nothing new" by identity and redraws nothing. `CachedSums` gives a
freshly opened finished trace its running sums from the summary cache, so a new server process does
not read every part of `dsa_key_counts` / `moe_counts` again.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, Generic, Mapping, TypeVar

import numpy as np

from workbench.trace import summary_cache
from workbench.analysis.views.part_feed import PartFeeds

MAX_BINS = 2048
MIN_BINS = 64


@dataclass(frozen=True)
class ViewOptions:
    """What the views currently ask of the follower (changed from the event loop, read by the thread)."""

    bins: int = 800  # screen bins of position axes (about the figure's width in pixels)
    kda_layer: int | None = None  # layer of the per-head lines (None: the first KDA layer)
    kda_reduce: str = "mean"  # "mean" or "max" over heads in the KDA heat map
    moe_modality: str | None = None  # None, "text" or "image": filter of the expert heat map
    moe_segment: int | None = None  # segment id filter of the expert heat map
    moe_layer: int | None = None  # layer of the text-vs-image bars (None: all layers)
    position: int | None = None  # selected token (DSA read-out, routes)
    image_id: int | None = None  # image segment drawn in the DSA map (None: the latest image)
    # options a view registered beside the built-in ones declares (apps/dashboard/views.py), by name
    extra: Mapping[str, Any] = field(default_factory=dict)

    def get(self, name: str, default: Any = None) -> Any:
        """A registered view's own option (`extra`), or `default` when no view declares it."""
        return self.extra.get(name, default)


def clamp_bins(bins: int) -> int:
    return int(min(max(int(bins), MIN_BINS), MAX_BINS))


@dataclass(frozen=True, eq=False)
class HeatMap:
    """A [rows, cols] matrix ready to draw: rows are layers (or heads), columns cover [x0, x1)."""

    rows: tuple[int, ...]
    values: np.ndarray  # float32 [len(rows), cols]
    x0: float
    x1: float


def same(a: Any, b: Any) -> bool:
    """Whether a view may skip redrawing `b` after showing `a`: the same object, or equal plain values.

    Arrays and heat maps compare by identity only (reducers keep the object when nothing changed);
    numbers, strings, tuples and dicts of them compare by value.
    """
    if a is b:
        return True
    if isinstance(a, (np.ndarray, HeatMap)) or isinstance(b, (np.ndarray, HeatMap)) or type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except (ValueError, TypeError):  # containers holding arrays
        return False


Data = TypeVar("Data")


class Reducer(Generic[Data]):
    """Base of the view reducers: `reduce(trace, options, session)` -> the view's data (subclasses).

    Holds what the reducer already read (the cache that makes a poll cost only what changed); one
    instance per followed trace, called from one thread at a time.
    """

    data_type: type

    def __init__(self, feeds: PartFeeds | None = None) -> None:
        # reads of trace tables shared with the other views of the same trace (`part_feed`)
        self.feeds = feeds if feeds is not None else PartFeeds()
        self._memo: dict[str, tuple[tuple, Any]] = {}
        self._last: Data | None = None

    def reduce(self, trace: Any, options: ViewOptions, session: Any) -> Data:
        raise NotImplementedError

    def memo(self, name: str, deps: tuple, compute: Callable[[], Any]) -> Any:
        """`compute()` when `deps` differ from the last call under `name`, else the previous value."""
        known = self._memo.get(name)
        if known is not None and known[0] == deps:
            return known[1]
        value = compute()
        self._memo[name] = (deps, value)
        return value

    def result(self, **values: Any) -> Data:
        """The view's data with these fields; the previous object itself when every field is identical."""
        last = self._last
        if last is not None and all(same(getattr(last, f.name), values[f.name]) for f in fields(last)):
            return last
        self._last = self.data_type(**values)
        return self._last


class CachedSums:
    """A trace's running sums of one delta table taken from the summary cache when a trace object is
    first seen, and put there once the trace is finished (`summary_cache.restore_sums` / `store_sums`:
    keyed by the table's parts, so a grown or rewritten trace never gets another trace's sums)."""

    def __init__(self, table: str) -> None:
        self.table = table
        self._trace: Any = None
        self._kept = False  # the cache holds this trace's sums (restored from it, or stored)
        self.restored = False

    def before(self, trace: Any) -> None:
        """Call before the sums are first used for `trace`."""
        if trace is not self._trace:
            self._trace = trace
            self.restored = self._kept = summary_cache.restore_sums(trace, self.table)

    def after(self, trace: Any) -> None:
        """Call after the sums were used: stores them the first time `trace` is seen finished."""
        if not self._kept and trace is self._trace and trace.status == "complete":
            summary_cache.store_sums(trace, self.table)
            self._kept = True
