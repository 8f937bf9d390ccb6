"""Reducer of view 3, KDA state: norm over position per layer (heat map) and per head of one layer (lines).

`kda_norms` holds every head of every KDA layer at every measured position (hundreds of MB at 1M
tokens on K3.1 Pro), so it is never held whole: `KDANormFolder` reads each new part once through
`Trace.read_part` (three columns, uncached, parts in parallel threads: decoding releases the GIL)
and keeps per layer only the head mean and head max at each position, plus every head of the one
layer whose lines are shown, taken from the same read. Changing that layer re-reads only its rows.
For a finished trace, what was folded (per layer: positions, head mean, head max; every head of the
first layer) is kept on disk (`summary_cache`, Arrow), so opening it again reads a few MB, not
every part of `kda_norms`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from workbench.analysis import bin_mean, carry_forward
from workbench.trace import Trace

from workbench.trace import summary_cache
from workbench.analysis.views.base import HeatMap, Reducer, ViewOptions
from workbench.analysis.views.list_columns import flat_lists
from workbench.analysis.views.part_feed import DecodedPart, PartFeed, PartFeeds
from workbench.analysis.views.session_map import RecordingMapData

_COLUMNS = ["layer", "position", "norm"]


@dataclass(frozen=True, eq=False)
class KDAStateData:
    heat: HeatMap | None = None  # rows are KDA layers
    heads: HeatMap | None = None  # rows are heads of `head_layer`
    head_layer: int | None = None


@dataclass
class _Series:
    """Pieces of arrays appended part by part, folded into one on read."""

    pieces: list[tuple[np.ndarray, ...]] = field(default_factory=list)

    def arrays(self, empty: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
        if len(self.pieces) > 1:
            self.pieces = [tuple(np.concatenate(col) for col in zip(*self.pieces))]
        return self.pieces[0] if self.pieces else empty


class KDANormFolder:
    """KDA state norms of a live trace, folded in one part file at a time (see the module docstring).

    Parts come through a `PartFeed` of `kda_norms` shared with the KDA health view (each part is
    decoded once for both); without one the folder has a feed of its own."""

    def __init__(self, feed: PartFeed | None = None) -> None:
        self.layers: dict[int, _Series] = {}  # layer -> (positions, head mean, head max)
        self.head_layer: int | None = None
        self._heads = _Series()  # (positions, [P, H] norms) of head_layer
        self._head_seen: set[Path] = set()
        self.feed = feed if feed is not None else PartFeed("kda_norms")
        self._sub = self.feed.subscribe(_COLUMNS, self._digest, self._apply)
        self._arrived = False  # a part with rows was folded in since the last `update`

    def _digest(self, part: DecodedPart) -> tuple[dict[int, tuple], tuple | None]:
        """(layer -> (positions, mean, max), (head layer, its rows)) of one part (runs in a reading thread)."""
        if part.num_rows == 0:
            return {}, None
        norms = part.matrix("norm")  # shared with the health view's digest of the same part
        if norms is None:
            return {}, None
        layer = part.column("layer").to_numpy()
        pos = part.column("position").to_numpy().astype(np.int64, copy=False)
        mean, peak = norms.mean(axis=1, dtype=np.float32), norms.max(axis=1)
        # rows grouped by layer once (stable: each layer keeps its part order), then sliced per layer;
        # a part the recorder wrote layer after layer is grouped already
        if (np.diff(layer) < 0).any():
            order = np.argsort(layer, kind="stable")
            layer, pos, mean, peak = layer[order], pos[order], mean[order], peak[order]
            norms = norms[order]
        layers, starts = np.unique(layer, return_index=True)
        spans = dict(zip(layers.tolist(), zip(starts.tolist(), [*starts[1:].tolist(), len(layer)])))
        out = {int(l): (pos[a:b], mean[a:b], peak[a:b]) for l, (a, b) in spans.items()}
        head_layer, head_rows = self.head_layer, None
        if head_layer is not None:
            a, b = spans.get(head_layer, (0, 0))
            head_rows = (head_layer, pos[a:b], np.array(norms[a:b]))  # a copy: the part's matrix is shared
        return out, head_rows

    def _apply(self, path: Path, piece: tuple[dict[int, tuple], tuple | None]) -> None:
        per_layer, head_rows = piece
        for l, arrays in per_layer.items():
            self.layers.setdefault(l, _Series()).pieces.append(arrays)
        self._arrived = self._arrived or bool(per_layer)
        # rows taken for another head layer than the one shown now are re-read by `heads` when asked
        if head_rows is not None and head_rows[0] == self.head_layer and path not in self._head_seen:
            self._head_seen.add(path)
            if len(head_rows[1]):
                self._heads.pieces.append(head_rows[1:])

    def update(self, trace: Trace, head_layer: int | None) -> bool:
        """Fold in parts not seen yet (keeping every head of `head_layer`, or of the first KDA layer when
        None and none is chosen yet); returns whether anything new arrived since the last call (also
        parts another view's read handed over)."""
        with self.feed.lock:
            if head_layer is not None and head_layer != self.head_layer:
                self._reset_heads(head_layer)
            if self.head_layer is None and not self.layers:
                # the first read: the lines show the first KDA layer unless told otherwise, so keep its heads
                # from this same pass instead of reading every part again (the footers name the layers)
                span = trace.layer_range("kda_norms")
                if span is not None:
                    self._reset_heads(span[0])
            self.feed.update(trace, self._sub)
            arrived, self._arrived = self._arrived, False
            return arrived

    def restore(self, trace: Trace) -> bool:
        """Take a finished trace's fold from the summary cache (nothing folded yet); whether it was there."""
        cache_key = summary_cache.key(trace, ("kda_norms",))
        layers = summary_cache.load_arrow(cache_key, "kda_layers")
        heads = summary_cache.load_arrow(cache_key, "kda_heads")
        if self._sub.seen or layers is None or heads is None \
                or layers.column_names != ["layer", "position", "mean", "max"] \
                or heads.column_names != ["position", "norms"] or not heads.schema.metadata \
                or not pa.types.is_fixed_size_list(heads.schema.field("norms").type):
            return False
        try:
            head_layer = int(heads.schema.metadata[b"layer"])
        except (KeyError, ValueError):
            return False
        n_heads = heads.schema.field("norms").type.list_size
        flat = pc.list_flatten(heads["norms"].combine_chunks()).to_numpy(zero_copy_only=False).astype(np.float32)
        if n_heads <= 0 or len(flat) != heads.num_rows * n_heads:
            return False
        layer = layers["layer"].to_numpy()
        pos, mean, peak = (layers[c].to_numpy() for c in ("position", "mean", "max"))
        for l in np.unique(layer):
            sel = layer == l
            self.layers[int(l)] = _Series([(pos[sel].astype(np.int64), mean[sel], peak[sel])])
        parts = set(trace.parts("kda_norms"))
        self._sub.skip(parts)
        self._reset_heads(head_layer)
        self._head_seen = set(parts)
        self._heads.pieces.append((heads["position"].to_numpy().astype(np.int64), flat.reshape(-1, n_heads)))
        return True

    def store(self, trace: Trace) -> None:
        """Put the fold of a finished trace in the summary cache (only a whole fold, with the first layer's heads)."""
        span = trace.layer_range("kda_norms")
        parts = set(trace.parts("kda_norms"))
        if span is None or self.head_layer != span[0] or self._sub.seen != parts or self._head_seen != parts:
            return
        cache_key = summary_cache.key(trace, ("kda_norms",))
        if cache_key is None:
            return
        cols: dict[str, list] = {"layer": [], "position": [], "mean": [], "max": []}
        for l in sorted(self.layers):
            pos, mean, peak = self.arrays(l)
            cols["layer"].append(np.full(len(pos), l, np.int16))
            cols["position"].append(pos)
            cols["mean"].append(mean)
            cols["max"].append(peak)
        pos, norms = self._heads.arrays((np.zeros(0, np.int64), np.zeros((0, 0), np.float32)))
        if not cols["layer"] or norms.ndim != 2 or norms.shape[1] == 0:
            return
        summary_cache.save_arrow(cache_key, "kda_layers", pa.table({k: np.concatenate(v) for k, v in cols.items()}))
        lists = pa.FixedSizeListArray.from_arrays(pa.array(norms.reshape(-1).astype(np.float32)), norms.shape[1])
        heads = pa.table({"position": pos, "norms": lists}).replace_schema_metadata({"layer": str(self.head_layer)})
        summary_cache.save_arrow(cache_key, "kda_heads", heads)

    def _reset_heads(self, layer: int) -> None:
        self.head_layer, self._heads, self._head_seen = layer, _Series(), set()

    def arrays(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(positions int64 [P], head mean float32 [P], head max float32 [P]) of one layer."""
        empty = np.zeros(0, np.float32)
        return self.layers[layer].arrays((np.zeros(0, np.int64), empty, empty))

    def heads(self, trace: Trace, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Per-head norms of one layer: (positions int64 [P], values float32 [P, H]), reading only parts
        whose heads of `layer` are not held yet."""
        if layer != self.head_layer:
            self._reset_heads(layer)
        for path in trace.parts("kda_norms"):
            if path in self._head_seen:
                continue
            self._head_seen.add(path)
            table = trace.read_part("kda_norms", path, _COLUMNS, layers=[layer])
            table = table.filter(pc.equal(table["layer"], layer)) if table.num_rows else table
            flat, n = flat_lists(table["norm"]) if table.num_rows else (None, 0)
            if n:
                self._heads.pieces.append((table["position"].to_numpy().astype(np.int64),
                                           flat.reshape(table.num_rows, n)))
        return self._heads.arrays((np.zeros(0, np.int64), np.zeros((0, 0), np.float32)))


def from_the_start(binned: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """`binned` [bins] with the bins before the first measurement given its value, when the recording began at
    the start of the context (the first measurement is nearer to position 0 than to the second one).

    The state is measured at the end of each interval (every 64 tokens, or a chunk's end): the bins
    before the first measurement are the tokens that wrote the state it shows, not "no data". A
    recording that began later (a resumed snapshot) leaves the positions before it blank."""
    if len(positions) == 0 or not np.isnan(binned).any():
        return binned
    first = int(positions.min())
    spacing = int(np.diff(np.unique(positions))[0]) if len(np.unique(positions)) > 1 else first + 1
    known = np.flatnonzero(~np.isnan(binned))
    if first >= spacing or not len(known):
        return binned
    out = binned.copy()
    out[:known[0]] = out[known[0]]
    return out


def layer_heat(folder: KDANormFolder, extent: int, bins: int, reduce: str) -> HeatMap:
    """Head mean (or max) of the state norm per KDA layer, binned and carried forward between measurements
    (and back to position 0 from the first one, `from_the_start`)."""
    rows, values = [], []
    for layer in sorted(folder.layers):
        pos, mean, peak = folder.arrays(layer)
        rows.append(layer)
        values.append(from_the_start(carry_forward(bin_mean(pos, peak if reduce == "max" else mean, bins, extent)),
                                     pos))
    matrix = np.stack(values) if values else np.zeros((0, bins), np.float32)
    return HeatMap(tuple(rows), matrix, 0.0, float(extent))


class KDAStateReducer(Reducer[KDAStateData]):
    data_type = KDAStateData

    def __init__(self, feeds: PartFeeds | None = None) -> None:
        super().__init__(feeds)
        self.folder = KDANormFolder(self.feeds.feed("kda_norms"))

    def reduce(self, trace: Trace, options: ViewOptions, session: RecordingMapData) -> KDAStateData:
        with self.folder.feed.lock:  # the health view's read may fold parts into this folder
            return self._reduce(trace, options, session)

    def _reduce(self, trace: Trace, options: ViewOptions, session: RecordingMapData) -> KDAStateData:
        folder = self.folder
        restored = not folder.layers and folder.restore(trace)
        wanted = options.kda_layer if options.kda_layer in folder.layers else None
        if folder.update(trace, wanted) and not restored:
            folder.store(trace)
        parts = len(trace.parts("kda_norms"))
        heat = self.memo("heat", (parts, session.extent, options.bins, options.kda_reduce),
                         lambda: layer_heat(folder, session.extent, options.bins, options.kda_reduce))
        layers = sorted(folder.layers)
        head_layer = options.kda_layer if options.kda_layer in folder.layers else (layers[0] if layers else None)
        heads = None
        if head_layer is not None:
            def lines() -> HeatMap:
                pos, vals = folder.heads(trace, head_layer)
                binned = bin_mean(pos, vals, options.bins, session.extent) if len(pos) else \
                    np.zeros((0, options.bins), np.float32)
                return HeatMap(tuple(range(len(binned))), binned, 0.0, float(session.extent))
            heads = self.memo("heads", (parts, head_layer, session.extent, options.bins), lines)
        else:
            previous = self._last
            heads = previous.heads if previous is not None else None
        return self.result(heat=heat, heads=heads, head_layer=head_layer if heads is not None else None)
