"""Server-side reductions for the dashboard: everything here turns trace rows into screen-sized arrays.

- `bin_mean`: values at arbitrary positions averaged into `bins` equal ranges (NaN where empty).
- `KDAStore`: per-layer KDA state norms folded in part by part (head mean and max per measured
  position), plus per-head rows of one chosen layer; a refresh reads only new parts.
- `TokenText`: the token table as arrays, for piece lookup by position and the generated text.
- `token_reads`: what each DSA layer read for one query (binned heat + a per-layer read-out with the
  text around the densest runs of selected keys, HTML-escaped).
- `escape_piece`: how a token is shown in HTML (escaped, whitespace made visible).

No Bokeh or Panel here: the follower thread calls these, the views only draw their results.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from workbench.trace import Trace

# distance (in tokens) below which a selected key counts as "local" in the read-out
LOCAL_WINDOW = 128
# width (tokens) of the windows in which the read-out looks for dense runs of selected keys
SNIPPET_WINDOW = 32
SNIPPET_MARGIN = 6


def bin_mean(positions: np.ndarray, values: np.ndarray, bins: int, extent: float) -> np.ndarray:
    """Mean of `values` over `bins` equal position ranges of [0, extent): float32 [..., bins], NaN where empty.

    Args:
        positions (np.ndarray): [P] positions of the measurements.
        values (np.ndarray): [P] or [P, H] values (H series are binned independently).
        bins (int): number of ranges.
        extent (float): right end of the covered range (exclusive).
    """
    positions = np.asarray(positions, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    squeeze = values.ndim == 1
    if squeeze:
        values = values[:, None]
    out = np.full((values.shape[1], bins), np.nan, dtype=np.float32)
    if len(positions) == 0 or extent <= 0:
        return out[0] if squeeze else out
    idx = np.clip((positions * bins / extent).astype(np.int64), 0, bins - 1)
    counts = np.bincount(idx, minlength=bins)
    filled = counts > 0
    for h in range(values.shape[1]):
        sums = np.bincount(idx, weights=values[:, h], minlength=bins)
        out[h, filled] = sums[filled] / counts[filled]
    return out[0] if squeeze else out


def carry_forward(values: np.ndarray) -> np.ndarray:
    """Fill NaN bins between measurements with the last measured value, along the last axis.

    A KDA norm is measured every 64 tokens; on a screen with more bins than measurements the state is
    what the last measurement says until the next one, so the gaps are not "no data". Bins before the
    first and after the last measurement stay NaN (nothing known there yet).
    """
    out = np.array(values, dtype=np.float32, copy=True)
    flat = out.reshape(-1, out.shape[-1])
    for row in flat:
        known = ~np.isnan(row)
        if not known.any():
            continue
        idx = np.where(known, np.arange(len(row)), 0)
        np.maximum.accumulate(idx, out=idx)
        last = np.flatnonzero(known)[-1]
        first = np.flatnonzero(known)[0]
        filled = row[idx]
        row[first:last + 1] = filled[first:last + 1]
    return out


def bin_counts(positions: np.ndarray, bins: int, extent: float) -> np.ndarray:
    """How many of `positions` fall into each of `bins` equal ranges of [0, extent): float32 [bins]."""
    positions = np.asarray(positions, dtype=np.float64)
    if len(positions) == 0 or extent <= 0:
        return np.zeros(bins, np.float32)
    idx = np.clip((positions * bins / extent).astype(np.int64), 0, bins - 1)
    return np.bincount(idx, minlength=bins).astype(np.float32)


@dataclass
class _LayerNorms:
    positions: list[np.ndarray] = field(default_factory=list)
    mean: list[np.ndarray] = field(default_factory=list)
    peak: list[np.ndarray] = field(default_factory=list)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if len(self.positions) > 1:
            # fold the pieces once so later calls are O(1) concatenations
            self.positions = [np.concatenate(self.positions)]
            self.mean = [np.concatenate(self.mean)]
            self.peak = [np.concatenate(self.peak)]
        if not self.positions:
            empty = np.zeros(0, np.float32)
            return np.zeros(0, np.int64), empty, empty
        return self.positions[0], self.mean[0], self.peak[0]


class KDAStore:
    """KDA state norms of a live trace, folded in one part file at a time.

    Keeps, per KDA layer, the head mean and head max of the state norm at each measured position
    (a few bytes per position), and the full per-head rows of one chosen layer. The reader's own
    cache would hold every head of every layer (hundreds of MB at 1M tokens on K3.1 Pro), so the
    parts are read here directly, three columns at a time.
    """

    def __init__(self) -> None:
        self.layers: dict[int, _LayerNorms] = {}
        self.problems: list[str] = []
        self._seen: set[Path] = set()
        self.head_layer: int | None = None
        self._head_seen: set[Path] = set()
        self._head_pos: list[np.ndarray] = []
        self._head_val: list[np.ndarray] = []

    def update(self, trace: Trace) -> bool:
        """Fold in parts not seen yet; returns whether anything new arrived."""
        new = False
        for path in trace.parts("kda_norms"):
            if path in self._seen:
                continue
            self._seen.add(path)
            table = self._read(path)
            if table is None or table.num_rows == 0:
                continue
            new = True
            layer = table["layer"].to_numpy()
            pos = table["position"].to_numpy().astype(np.int64)
            flat, heads = _flat_lists(table["norm"])
            if heads == 0:
                continue
            norms = flat.reshape(len(pos), heads)
            mean, peak = norms.mean(axis=1), norms.max(axis=1)
            for l in np.unique(layer):
                sel = layer == l
                store = self.layers.setdefault(int(l), _LayerNorms())
                store.positions.append(pos[sel])
                store.mean.append(mean[sel].astype(np.float32))
                store.peak.append(peak[sel].astype(np.float32))
        return new

    def heads(self, trace: Trace, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Per-head norms of one layer: (positions int64 [P], values float32 [P, H]), incrementally."""
        if layer != self.head_layer:
            self.head_layer = layer
            self._head_seen, self._head_pos, self._head_val = set(), [], []
        for path in trace.parts("kda_norms"):
            if path in self._head_seen:
                continue
            self._head_seen.add(path)
            table = self._read(path, layer)
            if table is None or table.num_rows == 0:
                continue
            flat, heads = _flat_lists(table["norm"])
            if heads:
                self._head_pos.append(table["position"].to_numpy().astype(np.int64))
                self._head_val.append(flat.reshape(table.num_rows, heads))
        if not self._head_pos:
            return np.zeros(0, np.int64), np.zeros((0, 0), np.float32)
        if len(self._head_pos) > 1:
            self._head_pos = [np.concatenate(self._head_pos)]
            self._head_val = [np.concatenate(self._head_val)]
        return self._head_pos[0], self._head_val[0]

    def _read(self, path: Path, layer: int | None = None) -> pa.Table | None:
        try:
            filters = None if layer is None else [("layer", "=", layer)]
            return pq.read_table(path, columns=["layer", "position", "norm"], filters=filters)
        except FileNotFoundError:
            return None
        except (OSError, pa.ArrowException, ValueError) as exc:
            msg = f"kda_norms part {path} could not be read ({exc}); skipped"
            if msg not in self.problems:
                self.problems.append(msg)
            return None


def _flat_lists(column: pa.ChunkedArray) -> tuple[np.ndarray, int]:
    """A fixed-length list column as (flat float32 values, list length); (empty, 0) if ragged or empty."""
    lists = column.combine_chunks()
    if len(lists) == 0:
        return np.zeros(0, np.float32), 0
    lengths = pc.list_value_length(lists).to_numpy(zero_copy_only=False)
    if (lengths != lengths[0]).any():
        return np.zeros(0, np.float32), 0
    values = pc.list_flatten(lists).to_numpy(zero_copy_only=False).astype(np.float32)
    return values, int(lengths[0])


class TokenText:
    """The token table as arrays: position -> piece, segment. Built from `trace.table("tokens")`."""

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


def escape_piece(piece: str | None) -> str:
    """HTML for one token: escaped, with newlines and tabs made visible (a token may be only whitespace)."""
    if piece is None:
        return "\u2026"
    return html.escape(piece).replace("\n", "\u23ce").replace("\t", "\u21e5")


def segment_name(segments: list[dict], position: int) -> str:
    for seg in segments:
        if seg["start"] <= position < seg["end"]:
            return str(seg.get("name") or seg["kind"])
    return "?"


def _snippet(tokens: TokenText, keys: np.ndarray, start: int, end: int) -> str:
    """Escaped text of [start, end) with the selected keys marked."""
    chosen = set(keys[(keys >= start) & (keys < end)].tolist())
    parts = []
    for pos, piece in tokens.span(start, end):
        text = escape_piece(piece)
        parts.append(f"<mark>{text}</mark>" if pos in chosen else text)
    return "".join(parts) or "<i>(text not recorded)</i>"


def token_reads(position: int, rows: pa.Table, tokens: TokenText, segments: list[dict], bins: int,
                extent: float, windows: int = 2, marks: tuple[tuple[int, int, str], ...] = ()) -> dict:
    """What each DSA layer read for the query at `position` (rows of `trace.topk_for(position)`).

    Returns {"position", "piece", "layers" [L], "heat" float32 [L, bins] (selected keys per screen bin),
    "marks", "rows": [{"layer", "keys", "nearest", "farthest", "local_share", "top_segment", "marked",
    "snippets": [html]}]}. `marked` counts the selected keys inside each marked range (e.g. a planted
    needle). Snippets are the `windows` densest SNIPPET_WINDOW-token runs of selected keys with some
    context, escaped, selected keys in <mark>.
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
            row = {"layer": layer, "keys": int(len(keys)), "nearest": int(dist.min()) if len(keys) else -1,
                   "farthest": int(dist.max()) if len(keys) else -1,
                   "local_share": float((dist < LOCAL_WINDOW).mean()) if len(keys) else 0.0,
                   "marked": [int(((keys >= a) & (keys < b)).sum()) for a, b, _ in marks]}
            if len(keys):
                owners = [segment_name(segments, int(k)) for k in keys[:: max(1, len(keys) // 256)]]
                names, counts = np.unique(owners, return_counts=True)
                row["top_segment"] = str(names[counts.argmax()])
                far = keys[dist >= LOCAL_WINDOW]
                cells, counts = np.unique(far // SNIPPET_WINDOW, return_counts=True)
                best = cells[np.argsort(-counts, kind="stable")[:windows]]
                row["snippets"] = [_snippet(tokens, keys, int(c) * SNIPPET_WINDOW - SNIPPET_MARGIN,
                                            int(c + 1) * SNIPPET_WINDOW + SNIPPET_MARGIN) for c in sorted(best)]
                row["snippet_starts"] = [int(c) * SNIPPET_WINDOW for c in sorted(best)]
            else:
                row["top_segment"], row["snippets"], row["snippet_starts"] = "", [], []
            out_rows.append(row)
    piece = tokens.lookup(np.array([position]))[0]
    return {"position": int(position), "piece": piece, "layers": layers, "marks": list(marks),
            "heat": np.stack(heat) if heat else np.zeros((0, bins), np.float32), "rows": out_rows}


def reads_html(reads: dict) -> str:
    """The per-layer read-out of `token_reads` as an HTML table (all text escaped)."""
    if not reads["rows"]:
        return (f"<p>No top-k lists recorded for position {reads['position']} (the default policy keeps them "
                "for every generated token and every 1024th prompt token).</p>")
    marks = "".join(f"<th>keys in {html.escape(label)} [{a}, {b})</th>" for a, b, label in reads["marks"])
    head = ("<table class='k3-reads'><tr><th>layer</th><th>keys</th><th>nearest</th><th>farthest back</th>"
            f"<th>local</th><th>mostly in</th>{marks}<th>text around the densest far reads</th></tr>")
    body = []
    for r in reads["rows"]:
        snippets = "".join(f"<div class='k3-snippet'><span class='k3-at'>@{s}</span> {t}</div>"
                           for s, t in zip(r["snippet_starts"], r["snippets"]))
        marked = "".join(f"<td><b>{n}</b></td>" if n else "<td>0</td>" for n in r["marked"])
        body.append(f"<tr><td>{r['layer']}</td><td>{r['keys']}</td><td>{r['nearest']}</td><td>{r['farthest']}</td>"
                    f"<td>{r['local_share']:.0%}</td><td>{html.escape(r['top_segment'])}</td>{marked}"
                    f"<td>{snippets}</td></tr>")
    return head + "".join(body) + "</table>"
