"""Reducer of the KDA memory health view: which heads saturate or forget fastest, and where.

`workbench.analysis.health_of_layers` (`memory_health` from per-layer matrices) turns the `kda_norms`
rows into one row per (layer, head); `heads_at_risk` ranks the fastest-saturating and fastest-forgetting
heads with the position where it happened. Each new part of `kda_norms` is read once (through the
`PartFeed` shared with the KDA state view: one decode of the part serves both); this reducer keeps
per-layer float32 matrices and reruns the analysis when a part arrived, so a live trace updates the
ranking without re-reading what it already read.

Memory stays bounded on a long session: past `MAX_POSITIONS` measurements of a layer, every other
one is dropped (the latest is always kept), so a 1M-token trace is ranked from ~1-2K evenly spaced
measurements per layer instead of 16K; "largest drop" is then a drop between kept measurements.

For a finished trace the result is kept on disk (`summary_cache`, JSON, keyed by the parts of
`kda_norms` and the segments), so opening it again does not read `kda_norms` at all.

A trace without KDA records (recorded with `kda=False`, a model without KDA layers, or a session
still before its first measured chunk) gives `KDAHealthData(ranked=(), note=...)`: the view shows
that note instead of an empty chart, and nothing raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from workbench.analysis import health_of_layers, heads_at_risk
from workbench.trace import Trace

from workbench.trace import summary_cache
from workbench.analysis.views.base import Reducer, ViewOptions
from workbench.analysis.views.part_feed import DecodedPart, PartFeeds
from workbench.analysis.views.session_map import RecordingMapData

TOP_HEADS = 8  # heads listed per kind ("saturates", "forgets")
MAX_POSITIONS = 2048  # measurements kept per layer before thinning (see the module docstring)
_COLUMNS = ["layer", "position", "norm", "mean_decay", "mean_beta", "eff_rank", "half_life", "global_share"]
_OPTIONAL = ("eff_rank", "half_life", "global_share", "mean_decay", "mean_beta")

NO_KDA = "No KDA state records in this trace (recorded without KDA, or no KDA layer has been measured yet)."


@dataclass(frozen=True, eq=False)
class KDAHealthData:
    """Ranked heads as plain rows (kind, rank, layer, head, position, segment, measures...)."""

    ranked: tuple[dict, ...] = ()
    layers: int = 0  # KDA layers measured
    heads: int = 0  # (layer, head) pairs measured
    measured: tuple[str, ...] = ()  # optional measures the trace recorded (eff_rank, half_life, ...)
    last_position: int = -1  # the latest measured position (the ranking covers [0, last_position])
    note: str = NO_KDA  # what to show instead of the ranking ("" when there is one)


class _LayerSeries:
    """One layer's measurements: positions [P] and, per statistic, a float32 [P, H] matrix (None: not recorded).

    Parts arrive one by one (hundreds per layer on a long trace): they are kept as chunks and joined
    only when the series is thinned or read, since joining on every append would copy the whole
    series each time."""

    def __init__(self) -> None:
        self._chunks: list[tuple[np.ndarray, dict[str, np.ndarray | None]]] = []
        self._rows = 0
        self._positions = np.zeros(0, np.int64)
        self._values: dict[str, np.ndarray | None] = {}

    def append(self, positions: np.ndarray, values: dict[str, np.ndarray | None]) -> None:
        self._chunks.append((positions, values))
        self._rows += len(positions)
        if self._rows > 2 * MAX_POSITIONS:
            self._join()
            keep = np.zeros(len(self._positions), bool)
            keep[::2] = True
            keep[-1] = True
            self._positions = self._positions[keep]
            self._values = {k: (v[keep] if v is not None else None) for k, v in self._values.items()}
            self._rows = len(self._positions)

    def _join(self) -> None:
        if not self._chunks:
            return
        chunks = [(self._positions, self._values)] + self._chunks
        self._chunks = []
        names = list(dict.fromkeys(name for _, values in chunks for name in values))
        self._positions = np.concatenate([p for p, _ in chunks])
        joined: dict[str, np.ndarray | None] = {}
        for name in names:
            present = [v[name] for _, v in chunks if v.get(name) is not None]
            widths = {m.shape[1] for m in present}
            if len(widths) != 1:  # never recorded, or widths disagree between parts: not shown
                joined[name] = None
                continue
            width = widths.pop()
            # a statistic missing from some parts (policy changed, decode rows) is NaN there
            joined[name] = np.concatenate([v[name] if v.get(name) is not None
                                           else np.full((len(p), width), np.nan, np.float32) for p, v in chunks])
        self._values = joined

    @property
    def positions(self) -> np.ndarray:
        self._join()
        return self._positions

    @property
    def values(self) -> dict[str, np.ndarray | None]:
        self._join()
        return self._values

def _recorded(series: dict[int, _LayerSeries], name: str) -> bool:
    """Whether a statistic holds finite values in some layer (a policy that did not record it leaves nulls)."""
    return any(s.values.get(name) is not None and np.isfinite(s.values[name]).any() for s in series.values())


def ranked_rows(health: pd.DataFrame, segments: pd.DataFrame, top: int = TOP_HEADS) -> tuple[dict, ...]:
    """`heads_at_risk` as JSON-plain dicts, each with the name of the segment holding its `position`
    (a head that never lost norm is placed at its plateau, so that is where the view marks it)."""
    risk = heads_at_risk(health, top=top)
    rows = []
    for r in risk.to_dict(orient="records"):
        row = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in r.items()}
        row["segment"] = int(row["segment"]) if row.get("segment") is not None else -1
        inside = segments[(segments["start"] <= row["position"]) & (row["position"] < segments["end"])]
        row["segment_name"] = str(inside["name"].iloc[-1] or "") if len(inside) else ""
        rows.append(row)
    return tuple(rows)


class KDAHealthReducer(Reducer[KDAHealthData]):
    """`kda_norms` parts -> `KDAHealthData` (each part read once, through the `PartFeed` the KDA state
    view shares; the analysis reruns when one arrives)."""

    data_type = KDAHealthData

    def __init__(self, feeds: PartFeeds | None = None) -> None:
        super().__init__(feeds)
        self._layers: dict[int, _LayerSeries] = {}
        self.feed = self.feeds.feed("kda_norms")
        self._sub = self.feed.subscribe(_COLUMNS, _digest, self._apply)
        self._computed = False  # a result was computed or restored (the cache is looked up only before)

    def _apply(self, path: Path, pieces: list[tuple[int, np.ndarray, dict]]) -> None:
        for layer, positions, stats in pieces:
            self._layers.setdefault(layer, _LayerSeries()).append(positions, stats)

    def _compute(self, trace: Trace, segments: tuple[dict, ...]) -> dict:
        if not self._layers:
            return {"ranked": (), "layers": 0, "heads": 0, "measured": (), "last_position": -1, "note": NO_KDA}
        segs = pd.DataFrame([{"id": int(s["id"]), "name": s.get("name") or "", "start": int(s["start"]),
                              "end": int(s["end"])} for s in segments if s.get("id") is not None],
                            columns=["id", "name", "start", "end"])
        series = {l: (s.positions, s.values) for l, s in self._layers.items()}
        health = health_of_layers(series, segs)
        if not len(health):
            return {"ranked": (), "layers": 0, "heads": 0, "measured": (), "last_position": -1,
                    "note": "KDA records are present but hold no per-head norms to rank."}
        measured = tuple(name for name in _OPTIONAL if _recorded(self._layers, name))
        last = max(int(p.max()) for p, _ in series.values() if len(p))
        return {"ranked": ranked_rows(health, segs), "layers": int(health["layer"].nunique()),
                "heads": int(len(health)), "measured": measured, "last_position": last, "note": ""}

    def reduce(self, trace: Trace, options: ViewOptions, session: RecordingMapData) -> KDAHealthData:
        parts = tuple(trace.parts("kda_norms"))
        values = self.memo("health", (parts, session.segments), lambda: self._values(trace, session.segments))
        return self.result(**values)

    def _values(self, trace: Trace, segments: tuple[dict, ...]) -> dict:
        """The health of what the trace holds now: from the summary cache when it is there (a finished
        trace seen before), else folded and ranked here (and cached when the trace is finished)."""
        cache_key = summary_cache.key(trace, ("kda_norms",), [_segment_key(s) for s in segments]) \
            if not self._computed else None
        cached = _from_json(summary_cache.load_json(cache_key, "kda_health"))
        if cached is not None:
            self._computed = True
            return cached
        with self.feed.lock:  # the KDA state view's read may fold parts in meanwhile
            self.feed.update(trace, self._sub)
            values = self._compute(trace, segments)
        self._computed = True
        try:
            summary_cache.save_json(cache_key, "kda_health", {**values, "ranked": list(values["ranked"]),
                                                              "measured": list(values["measured"])})
        except (TypeError, ValueError):  # a value JSON cannot hold: not cached
            pass
        return values


def _digest(part: DecodedPart) -> list[tuple[int, np.ndarray, dict]]:
    """One part of `kda_norms` as (layer, positions, {statistic: float32 [P, H] or None}) per layer
    (runs in a reading thread; the matrices are the part's, shared with the KDA state view: sliced, never
    written)."""
    if part.num_rows == 0:
        return []
    layer = part.column("layer").to_numpy()
    position = part.column("position").to_numpy().astype(np.int64, copy=False)
    stats = {name: part.matrix(name) for name in _COLUMNS[2:]}
    if stats["norm"] is None:
        return []
    # rows grouped by layer once (stable: each layer keeps its part order), then sliced per layer;
    # a part the recorder wrote layer after layer is grouped already (no copy of its matrices)
    if (np.diff(layer) < 0).any():
        order = np.argsort(layer, kind="stable")
        layer, position = layer[order], position[order]
        stats = {k: (v[order] if v is not None else None) for k, v in stats.items()}
    layers, starts = np.unique(layer, return_index=True)
    ends = np.append(starts[1:], len(layer))
    return [(int(l), position[a:b], {k: (v[a:b] if v is not None else None) for k, v in stats.items()})
            for l, a, b in zip(layers.tolist(), starts.tolist(), ends.tolist())]


def _segment_key(segment: dict) -> list:
    return [segment.get(k) for k in ("id", "name", "start", "end")]


def _usable_row(row: object) -> bool:
    """Whether a cached ranked head has what the view reads: its kind, integer rank/layer/head/position,
    and numbers (or nothing) for its measures."""
    if not isinstance(row, dict) or row.get("kind") not in ("saturates", "forgets"):
        return False
    if not all(type(row.get(k)) is int for k in ("rank", "layer", "head", "position")):
        return False
    return all(isinstance(v, str) if k == "segment_name" else
               v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))
               for k, v in row.items() if k != "kind")


def _from_json(value: object) -> dict | None:
    """A cached health result checked field by field (None: not usable, recompute)."""
    if not isinstance(value, dict) or set(value) != {"ranked", "layers", "heads", "measured", "last_position", "note"}:
        return None
    ranked, measured = value["ranked"], value["measured"]
    if not (isinstance(ranked, list) and all(_usable_row(r) for r in ranked) and isinstance(measured, list)
            and all(isinstance(m, str) for m in measured) and isinstance(value["note"], str)
            and all(type(value[k]) is int for k in ("layers", "heads", "last_position"))):
        return None
    return {**value, "ranked": tuple(ranked), "measured": tuple(measured)}
