"""What one query read: the DSA read-out of a single token, as data (no HTML, no trace object).

- `TokenText`: the token table as sorted arrays, for piece lookup by position and text spans.
- `token_reads(position, rows, tokens, segments, bins, extent)`: per DSA layer, the keys the query
  selected (binned to the screen), how near and how far back they lie, the share that is local,
  the segment read most, the keys inside marked ranges (a planted needle) and the windows of
  densest far reads (whose text `TokenText.span` gives).

The dashboard renders this as its read-out table; a notebook can use it on `trace.topk_for(pos)`.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from workbench.analysis.binning import bin_counts
from workbench.analysis.chance import chance_of_hit, expected_hits

# distance (in tokens) below which a selected key counts as "local" in the read-out
LOCAL_WINDOW = 128
# width (tokens) of the windows in which the read-out looks for dense runs of selected keys
SNIPPET_WINDOW = 32
# tokens of context shown on either side of such a window
SNIPPET_MARGIN = 6

Marks = tuple[tuple[int, int, str], ...]


class TokenText:
    """The token table as arrays: position -> piece, segment. Built from `trace.table("tokens")` (an Arrow
    table with position, piece and segment columns)."""

    def __init__(self, table: pa.Table | None = None) -> None:
        if table is None or table.num_rows == 0:
            self.positions = np.zeros(0, np.int64)
            self.pieces = pa.array([], pa.string())
            self.segments = np.zeros(0, np.int64)
            return
        pos = table["position"].to_numpy().astype(np.int64)
        order = None if np.all(pos[1:] >= pos[:-1]) else np.argsort(pos, kind="stable")
        pieces = table["piece"].combine_chunks()
        seg = table["segment"].to_numpy().astype(np.int64)
        if order is not None:
            pos, seg = pos[order], seg[order]
            pieces = pieces.take(pa.array(order))
        self.positions, self.pieces, self.segments = pos, pieces, seg

    def __len__(self) -> int:
        return len(self.positions)

    def _index(self, positions: np.ndarray) -> np.ndarray:
        idx = np.searchsorted(self.positions, positions)
        idx = np.clip(idx, 0, max(len(self.positions) - 1, 0))
        found = (len(self.positions) > 0) & (self.positions[idx] == positions) if len(self.positions) else \
            np.zeros(len(positions), bool)
        return np.where(found, idx, -1)

    def lookup(self, positions: np.ndarray) -> list[str | None]:
        """Pieces at `positions` (None where the token is not in the table yet)."""
        positions = np.asarray(positions, dtype=np.int64)
        idx = self._index(positions)
        ok = idx >= 0
        out: list[str | None] = [None] * len(positions)
        if ok.any():
            got = self.pieces.take(pa.array(idx[ok])).to_pylist()
            for i, piece in zip(np.flatnonzero(ok), got):
                out[int(i)] = piece
        return out

    def span(self, start: int, end: int) -> list[tuple[int, str]]:
        """(position, piece) of the tokens in [start, end) that are in the table."""
        lo = int(np.searchsorted(self.positions, start))
        hi = int(np.searchsorted(self.positions, end))
        return list(zip(self.positions[lo:hi].tolist(), self.pieces.slice(lo, hi - lo).to_pylist()))


def segment_name(segments: list[dict], position: int) -> str:
    """Name (or kind) of the segment holding `position`; "?" outside every segment."""
    for seg in segments:
        if seg["start"] <= position < seg["end"]:
            return str(seg.get("name") or seg["kind"])
    return "?"


def token_reads(position: int, rows: pa.Table, tokens: TokenText, segments: list[dict], bins: int,
                extent: float, windows: int = 2, marks: Marks = ()) -> dict:
    """What each DSA layer read for the query at `position` (rows of `trace.topk_for(position)`).

    Args:
        position (int): the query's position.
        rows (pa.Table): dsa_topk rows of that query (layer, selected).
        tokens (TokenText): the token table (for the query's piece).
        segments (list[dict]): session segments (id, kind, name, start, end).
        bins (int), extent (float): the screen axis the per-layer heat is binned onto.
        windows (int): dense far-read windows reported per layer.
        marks: key ranges (start, end, label) whose selected keys are counted, e.g. a planted needle.

    Returns {"position", "piece", "layers" [L], "heat" float32 [L, bins] (selected keys per screen bin),
    "marks", "rows": [{"layer", "keys", "selected" (int64 key positions), "nearest", "farthest",
    "local_share", "top_segment", "marked", "windows": [(start, end)], "snippet_starts"}]}. `marked`
    counts the selected keys inside each marked range, `marked_expected` what uniformly random picks of as
    many keys among the query's visible keys (0..position) would put there and `marked_chance` their
    chance of hitting the range at all (`workbench.analysis.chance`); `local_chance` is the share of
    visible keys within LOCAL_WINDOW (what random picks give `local_share`). Windows are the `windows` densest
    SNIPPET_WINDOW-token runs of selected keys at least LOCAL_WINDOW back, widened by SNIPPET_MARGIN.
    """
    out_rows, heat, layers = [], [], []
    if rows.num_rows:
        layer_col = rows["layer"].to_numpy()
        lists = rows["selected"].combine_chunks()
        for i in np.argsort(layer_col, kind="stable"):
            keys = np.asarray(lists[int(i)].values.to_numpy(zero_copy_only=False), dtype=np.int64)
            layer = int(layer_col[i])
            if layer in layers:  # a position recorded twice: keep the first record of each layer
                continue
            layers.append(layer)
            heat.append(bin_counts(keys, bins, extent))
            dist = position - keys
            row = {"layer": layer, "keys": int(len(keys)), "selected": keys,
                   "nearest": int(dist.min()) if len(keys) else -1,
                   "farthest": int(dist.max()) if len(keys) else -1,
                   "local_share": float((dist < LOCAL_WINDOW).mean()) if len(keys) else 0.0,
                   "marked": [int(((keys >= a) & (keys < b)).sum()) for a, b, _ in marks]}
            visible = position + 1
            spans = [max(0, min(b, visible) - max(a, 0)) for a, b, _ in marks]
            row["marked_expected"] = [float(expected_hits(visible, s, len(keys))) for s in spans]
            row["marked_chance"] = [float(chance_of_hit(visible, s, len(keys))) for s in spans]
            row["local_chance"] = min(LOCAL_WINDOW, visible) / visible
            if len(keys):
                owners = [segment_name(segments, int(k)) for k in keys[:: max(1, len(keys) // 256)]]
                names, counts = np.unique(owners, return_counts=True)
                row["top_segment"] = str(names[counts.argmax()])
                far = keys[dist >= LOCAL_WINDOW]
                cells, counts = np.unique(far // SNIPPET_WINDOW, return_counts=True)
                best = sorted(cells[np.argsort(-counts, kind="stable")[:windows]])
                row["windows"] = [(int(c) * SNIPPET_WINDOW - SNIPPET_MARGIN, int(c + 1) * SNIPPET_WINDOW + SNIPPET_MARGIN)
                                  for c in best]
                row["snippet_starts"] = [int(c) * SNIPPET_WINDOW for c in best]
            else:
                row["top_segment"], row["windows"], row["snippet_starts"] = "", [], []
            out_rows.append(row)
    piece = tokens.lookup(np.array([position]))[0]
    return {"position": int(position), "piece": piece, "layers": layers, "marks": list(marks),
            "heat": np.stack(heat) if heat else np.zeros((0, bins), np.float32), "rows": out_rows}
