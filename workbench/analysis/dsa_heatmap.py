"""`Trace.dsa_heatmap`'s result: selection counts per DSA layer and position range, labelled, beside chance.

`DSAHeatmap` is a float64 [layers, columns] array (so code written for the plain array keeps working)
that also carries what its rows and columns are and what the dashboard's DSA map shows beside each
cell: `layers` (row i is DSA layer `layers[i]`), `edges` (column j counts keys in
[edges[j], edges[j + 1])), `bin_tokens` (the recording's own bin width), `chance` (the selections
uniformly random top-k picks of the same queries would make in each column, as the view computes
it) and `ratio` (count / chance, the view's "observed / chance"). `to_frame()` gives it all as a
table. Results derived from it (a row, a sum, a slice, `astype`) carry no labels: they might no
longer fit.

`columns(start, end, bins, bin_tokens)` is the number of columns a request gets: never more than the
recording's own bins over the range, so a count is never split into fractions of a stored bin.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd


def columns(start: int, end: int, bins: int, bin_tokens: int) -> int:
    """Columns for `bins` requested over [start, end) when the recording counted keys in bins of
    `bin_tokens` tokens: at most one column per stored bin (at least one)."""
    stored = max(1, math.ceil((end - start) / max(int(bin_tokens), 1)))
    return max(1, min(int(bins), stored))


class DSAHeatmap(np.ndarray):
    """Selections per DSA layer (rows) and position range (columns); see the module docstring."""

    layers: tuple[int, ...] | None
    edges: np.ndarray | None
    bin_tokens: int | None
    chance: np.ndarray | None

    def __new__(cls, counts: np.ndarray, layers: tuple[int, ...], edges: np.ndarray, bin_tokens: int,
                chance: np.ndarray | None) -> "DSAHeatmap":
        out = np.asarray(counts, dtype=np.float64).view(cls)
        out.layers = tuple(int(l) for l in layers)
        out.edges = np.asarray(edges, dtype=np.float64)
        out.bin_tokens = int(bin_tokens)
        out.chance = None if chance is None else np.asarray(chance, dtype=np.float64)
        return out

    def __array_finalize__(self, obj: object) -> None:
        # anything derived (a row, a slice, a reordering, a sum) is unlabelled: labels that might not fit are
        # worse than none
        self.layers = self.edges = self.bin_tokens = self.chance = None

    @property
    def ratio(self) -> np.ndarray:
        """count / chance per cell (float64, NaN where chance is 0 or unknown): the DSA map's "observed / chance"."""
        counts = np.asarray(self, dtype=np.float64)
        if self.chance is None:
            return np.full(counts.shape, np.nan)
        chance = np.broadcast_to(self.chance, counts.shape)
        return np.divide(counts, chance, out=np.full(counts.shape, np.nan), where=chance > 0)

    def to_frame(self) -> pd.DataFrame:
        """One row per (layer, column): layer, start, end, count, chance, ratio."""
        counts = np.asarray(self, dtype=np.float64)
        rows, cols = counts.shape if counts.ndim == 2 else (0, 0)
        edges = self.edges if self.edges is not None else np.arange(cols + 1, dtype=np.float64)
        chance = np.broadcast_to(self.chance, counts.shape) if self.chance is not None else np.full(counts.shape, np.nan)
        return pd.DataFrame({
            "layer": np.repeat(np.asarray(self.layers or range(rows), dtype=np.int64), cols),
            "start": np.tile(edges[:-1], rows), "end": np.tile(edges[1:], rows),
            "count": counts.ravel(), "chance": np.asarray(chance).ravel(), "ratio": self.ratio.ravel()})


__all__ = ["DSAHeatmap", "columns"]
