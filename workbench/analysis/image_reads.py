"""Which patches of an image each DSA layer read (spec section 6: "which image patches did the model
read while describing the image?"), beside what uniformly random selections would read.

- `patch_reads(topk, tokens, image_id, grid)`: per DSA layer, how often each merged patch of the image
  was selected by the chosen queries (one clicked token, or every token of the answer), and the
  chance values of the same queries (`PatchReads`).
- `PatchReads.summary(layer)`: one layer's (or all layers') patches read, selections in the image and
  their chance values; `format_patches` prints "patches read: 12 of 256, chance 4".

Chance model (the one of `workbench.analysis.chance`): a query at position p whose row selected k
keys picks k of the p + 1 keys it can see uniformly at random, so each visible patch is picked with
probability k / (p + 1). A patch is "read" when at least one query picked it, so its chance is
1 - prod over queries (1 - k / (p + 1)), and the expected number of patches read is the sum of that
over the patches; the expected selections inside the image are the sum of k * visible patches / (p + 1).

Pure numpy over `trace.table("dsa_topk", ...)` rows and the token table: no trace object, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd

from workbench.analysis.chance import format_hits
from workbench.analysis.common import Frame, column, list_chunks
from workbench.analysis.recorded import check_dsa_layers

__all__ = ["PatchReads", "format_patches", "image_grid", "patch_reads"]


@dataclass(frozen=True, eq=False)
class PatchReads:
    """Selections per merged patch of one image, by DSA layer, with the chance values of the same queries.

    Attributes:
        image_id: the image's segment id.
        grid: (rows, cols) of merged patches (language-model tokens) of the image.
        layers: DSA layers, in the order of the first axis below.
        counts: int64 [L, rows, cols]: how often the layer's chosen queries selected each patch.
        queries: int64 [L]: query rows of the layer that were counted.
        picks: int64 [L]: keys those rows selected (anywhere in the context).
        expected: float64 [L]: selections inside the image that random picks would make.
        log_miss: float64 [L, rows * cols]: log P(random picks of the layer's queries never pick the patch).
    """

    image_id: int
    grid: tuple[int, int]
    layers: tuple[int, ...]
    counts: np.ndarray
    queries: np.ndarray
    picks: np.ndarray
    expected: np.ndarray
    log_miss: np.ndarray

    @property
    def patches(self) -> int:
        return int(self.grid[0] * self.grid[1])

    def _rows(self, layer: int | None) -> np.ndarray:
        if layer is None:
            return np.arange(len(self.layers))
        return np.asarray([i for i, l in enumerate(self.layers) if l == layer], dtype=np.int64)

    def grid_of(self, layer: int | None = None) -> np.ndarray:
        """Selections per patch [rows, cols] of one layer (None: summed over every layer)."""
        rows = self._rows(layer)
        if not len(rows):
            return np.zeros(self.grid, np.int64)
        return self.counts[rows].sum(axis=0)

    def summary(self, layer: int | None = None) -> dict:
        """One layer's (None: every layer's) reads of the image beside their chance values.

        Returns {"layer", "queries", "patches", "patches_read" (patches selected at least once),
        "chance_patches" (expected patches read by random picks), "selections" (selected keys inside
        the image), "expected_selections" (random picks inside the image)}.
        """
        rows = self._rows(layer)
        grid = self.grid_of(layer)
        miss = self.log_miss[rows].sum(axis=0) if len(rows) else np.zeros(self.patches)
        return {"layer": layer, "queries": int(self.queries[rows].sum()) if len(rows) else 0,
                "patches": self.patches, "patches_read": int((grid > 0).sum()),
                "chance_patches": float((-np.expm1(miss)).sum()),
                "selections": int(grid.sum()), "expected_selections": float(self.expected[rows].sum()) if len(rows) else 0.0}

    def table(self) -> pd.DataFrame:
        """`summary` of every layer, one row each, plus an "all" row (layer -1) last."""
        rows = [self.summary(l) for l in self.layers] + [dict(self.summary(None), layer=-1)]
        return pd.DataFrame(rows, columns=["layer", "queries", "patches", "patches_read", "chance_patches",
                                           "selections", "expected_selections"])


def format_patches(summary: dict) -> str:
    """'patches read: 12 of 256, chance 4 · 40 hits, expected 13.4, 3.0x' for one `PatchReads.summary`."""
    chance = summary["chance_patches"]
    shown = f"{chance:.0f}" if chance >= 10 else f"{chance:.2g}"
    return (f"patches read: {summary['patches_read']} of {summary['patches']}, chance {shown} · selections in the "
            f"image: {format_hits(summary['selections'], summary['expected_selections'])}")


def image_grid(tokens: pd.DataFrame, image_id: int, segment: dict | None = None) -> tuple[int, int]:
    """(rows, cols) of the image's merged-patch grid: from its tokens' patch_row/col, else the segment."""
    mine = tokens[tokens["image_id"] == image_id] if len(tokens) else tokens
    if len(mine):
        return int(mine["patch_row"].max()) + 1, int(mine["patch_col"].max()) + 1
    info = (segment or {}).get("image") or {}
    merged = info.get("merged_grid")
    if isinstance(merged, (list, tuple)) and len(merged) == 2:
        return int(merged[0]), int(merged[1])
    return int(info.get("grid_rows", 0)), int(info.get("grid_cols", 0))


def patch_reads(topk: Frame, tokens: pd.DataFrame, image_id: int, grid: tuple[int, int] | None = None,
                queries: tuple[int, int] | None = None, layers: Sequence[int] | None = None) -> PatchReads:
    """Which merged patches of image `image_id` each DSA layer selected, and what chance would give.

    Args:
        topk (DataFrame | Table): dsa_topk rows (layer, position, selected), e.g. `trace.topk_for(pos)` or
            `trace.table("dsa_topk", positions=answer)`.
        tokens (DataFrame): the token table (position, image_id, patch_row, patch_col).
        image_id (int): the image's segment id.
        grid (tuple[int, int], Optional): (rows, cols) of merged patches (default: from `tokens`).
        queries (tuple[int, int], Optional): inclusive query-position range to count.
        layers (Sequence[int], Optional): layers to count (default: every layer in `topk`).
    """
    mine = tokens[tokens["image_id"] == image_id] if len(tokens) else tokens
    grid = grid or image_grid(tokens, image_id)
    n_cells = int(grid[0] * grid[1])
    pos = mine["position"].to_numpy().astype(np.int64)
    cell = (mine["patch_row"].to_numpy().astype(np.int64) * grid[1] + mine["patch_col"].to_numpy().astype(np.int64))
    ok = (cell >= 0) & (cell < n_cells)
    pos, cell = pos[ok], cell[ok]
    order = np.argsort(pos, kind="stable")
    pos, cell = pos[order], cell[order]

    layer_col = column(topk, "layer").astype(np.int64) if len(topk) else np.zeros(0, np.int64)
    qpos = column(topk, "position").astype(np.int64) if len(topk) else np.zeros(0, np.int64)
    keep = np.ones(len(layer_col), dtype=bool)
    if queries is not None:
        keep &= (qpos >= queries[0]) & (qpos <= queries[1])
    if layers is not None:
        check_dsa_layers(topk, layers, "patch_reads")
        keep &= np.isin(layer_col, list(layers))
    chunks = list(list_chunks(topk, "selected")) if len(topk) else []
    picks_per_row = np.concatenate([np.diff(offsets) for _, offsets, _ in chunks]) if chunks else np.zeros(0, np.int64)

    found = sorted(set(layer_col[keep].tolist())) if layers is None else sorted(set(int(l) for l in layers))
    L = len(found)
    counts = np.zeros((L, n_cells), np.int64)
    n_queries = np.zeros(L, np.int64)
    picks = np.zeros(L, np.int64)
    expected = np.zeros(L, np.float64)
    log_miss = np.zeros((L, n_cells), np.float64)
    # key -> patch cell: only keys inside the image's position range can be patches (a cheap compare over
    # every key, in the keys' own dtype), and only those are looked up among the image's sorted positions
    owners, ats = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for keys, offsets, first in chunks if len(pos) else ():
        flat = np.flatnonzero((keys >= int(pos[0])) & (keys <= int(pos[-1])))
        at = np.searchsorted(pos, keys[flat])
        inside = at < len(pos)
        inside[inside] = pos[at[inside]] == keys[flat[inside]]
        flat, at = flat[inside], at[inside]
        owner = np.searchsorted(offsets, flat, side="right") - 1 + first
        kept_hit = keep[owner]
        owners.append(owner[kept_hit])
        ats.append(at[kept_hit])
    owner, at = np.concatenate(owners), np.concatenate(ats)
    # layer -> row of the result, as a lookup table (the loops over rows and hits run in numpy)
    row_of_layer = np.full(int(max(found)) + 1 if found else 1, -1, np.int64)
    row_of_layer[list(found)] = np.arange(L)
    kept_rows = np.flatnonzero(keep)
    kept_li = row_of_layer[layer_col[kept_rows]]
    np.add.at(n_queries, kept_li, 1)
    np.add.at(picks, kept_li, picks_per_row[kept_rows])
    if len(owner):
        np.add.at(counts, (row_of_layer[layer_col[owner]], cell[at]), 1)
    # chance: each kept row picks k of its p + 1 visible keys; the image patches it can see are those <= p
    if len(kept_rows) and len(pos):
        visible_keys = qpos[kept_rows] + 1
        k = np.minimum(picks_per_row[kept_rows], visible_keys).astype(np.float64)
        p_pick = k / visible_keys
        seen = np.searchsorted(pos, qpos[kept_rows], side="right")  # image patches at positions <= p
        np.add.at(expected, kept_li, p_pick * seen)
        # a row that picked every visible key makes its patches certain: log(1e-12) stands for log(0)
        log_keep = np.log1p(-np.minimum(p_pick, 1.0 - 1e-12))
        # a row's log(1 - q) applies to the first `seen` image tokens (by position): difference array + cumsum
        diff = np.zeros((L, len(pos) + 1), np.float64)
        np.add.at(diff, (kept_li, np.zeros(len(kept_rows), np.int64)), log_keep)
        np.add.at(diff, (kept_li, seen), -log_keep)
        log_miss[:, cell] = np.cumsum(diff, axis=1)[:, :len(pos)]
    return PatchReads(int(image_id), (int(grid[0]), int(grid[1])), tuple(found), counts.reshape(L, *grid),
                      n_queries, picks, expected, log_miss)
