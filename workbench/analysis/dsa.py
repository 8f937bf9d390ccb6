"""DSA questions (spec section 6), as pure functions over dsa_* tables: no I/O, no trace object.

- `layers_reading`: when the model answered, which layers read a position range (the needle), how far back?
- `distance_summary`: how far back does each layer read (median / percentiles of read distance)?
- `sink_eviction`: did any layer stop reading the first tokens (attention sink) as the context grew?
- `segment_reads`: which document, turn or image did each layer read?
- `image_patch_reads`: which image patches were read while describing the image?
- `dense_mass_summary`: how much of dense attention's mass does top-k keep on this document?
- `rebin_counts`: the heat-map rebinning the reader and the dashboard share.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

from workbench.analysis.chance import chance_of_hit
from workbench.analysis.common import (Frame, column, list_values, log2_bin_quantiles, segment_of, to_pandas)
from workbench.analysis.recorded import check_dsa_layers


def rebin_counts(counts: np.ndarray, width: int, edges: np.ndarray) -> np.ndarray:
    """Counts of bins [i*width, (i+1)*width) redistributed onto arbitrary `edges` (float64 [len(edges)-1]).

    Each stored bin's count is spread uniformly over its tokens, so totals are preserved over the
    covered range and any output width works (finer or coarser than `width`, aligned or not).
    """
    counts = np.asarray(counts, dtype=np.float64)
    edges = np.asarray(edges, dtype=np.float64)
    cum = np.concatenate([[0.0], np.cumsum(counts)])
    src = np.arange(len(counts) + 1, dtype=np.float64) * width
    at_edges = np.interp(edges, src, cum, left=0.0, right=cum[-1])
    return np.diff(at_edges)


def layers_reading(topk: Frame, start: int, end: int, queries: tuple[int, int] | None = None) -> pd.DataFrame:
    """Which layers read keys in [start, end) and how far back: one row per layer of `topk` (dsa_topk rows).

    Args:
        topk (DataFrame | Table): dsa_topk rows (layer, position, selected).
        start (int), end (int): the key position range of interest (e.g. the needle's tokens).
        queries (tuple[int, int], Optional): inclusive query-position range to consider (e.g. the answer).

    Returns: layer, queries, queries_reading (queries that selected at least one key in range),
    read_share (= queries_reading / queries), keys_read (selected keys in range over all queries),
    distance_min / distance_median (query position - key position over those keys), chance (mean over
    the queries of the exact probability that as many uniform picks among the keys the query can see,
    positions 0..q, hit the range: `workbench.analysis.chance`), expected_reading (its sum: queries
    random picks would make read the range) and ratio (read_share / chance), sorted by read_share
    descending.
    """
    layer = column(topk, "layer").astype(np.int64)
    qpos = column(topk, "position").astype(np.int64)
    rows = np.arange(len(layer))
    if queries is not None:
        rows = rows[(qpos >= queries[0]) & (qpos <= queries[1])]
    keys, owner = list_values(topk, "selected")
    in_query = np.zeros(len(layer), dtype=bool)
    in_query[rows] = True
    hit = (keys >= start) & (keys < end) & in_query[owner]
    hit_rows = owner[hit]
    distance = qpos[hit_rows] - keys[hit].astype(np.int64)
    picks = np.bincount(owner, minlength=len(layer))
    visible_span = np.clip(np.minimum(end, qpos + 1) - start, 0, None)
    chance = np.atleast_1d(chance_of_hit(qpos + 1, visible_span, picks)) if len(layer) else np.zeros(0)
    out = []
    for l in np.unique(layer[rows]):
        mine = layer[rows] == l
        mine_hits = layer[hit_rows] == l
        d = distance[mine_hits]
        reading = len(np.unique(hit_rows[mine_hits]))
        share = reading / max(int(mine.sum()), 1)
        mine_chance = chance[rows[mine]]
        mean_chance = float(mine_chance.mean()) if len(mine_chance) else 0.0
        out.append({"layer": int(l), "queries": int(mine.sum()), "queries_reading": reading,
                    "read_share": share, "keys_read": int(mine_hits.sum()),
                    "distance_min": int(d.min()) if len(d) else -1,
                    "distance_median": float(np.median(d)) if len(d) else np.nan,
                    "chance": mean_chance, "expected_reading": float(mine_chance.sum()),
                    "ratio": share / mean_chance if mean_chance > 0 else np.nan})
    cols = ["layer", "queries", "queries_reading", "read_share", "keys_read", "distance_min", "distance_median",
            "chance", "expected_reading", "ratio"]
    return pd.DataFrame(out, columns=cols).sort_values(["read_share", "layer"], ascending=[False, True],
                                                       ignore_index=True)


def distance_summary(hist: Frame, quantiles: Sequence[float] = (0.1, 0.5, 0.9), local: int = 128,
                     far: int = 65536) -> pd.DataFrame:
    """How far back each layer reads, from dsa_distance_hist deltas: one row per layer.

    Returns: layer, reads, p10/p50/p90 (read distance in tokens, for the default quantiles; geometric
    interpolation inside log2 bins), local_share (distance < `local`), far_share (distance >= `far`).
    """
    df = to_pandas(hist)
    out = []
    for l, g in df.groupby("layer", sort=True):
        counts = np.bincount(g["log2_bin"].to_numpy().astype(np.int64), weights=g["count"].to_numpy(),
                             minlength=1)
        total = counts.sum()
        upper = np.exp2(np.arange(len(counts)) + 1) - 1  # exclusive upper distance bound of each bin
        row = {"layer": int(l), "reads": int(total)}
        row.update({f"p{round(q * 100)}": v for q, v in zip(quantiles, log2_bin_quantiles(counts, quantiles))})
        # a bin counts as local (far) when all (any) of its distances are below (at least) the bound
        row["local_share"] = counts[upper <= local].sum() / total if total else np.nan
        row["far_share"] = counts[upper > far].sum() / total if total else np.nan
        out.append(row)
    return pd.DataFrame(out)


def sink_eviction(sink: Frame, threshold: float = 0.5, window: int = 1) -> pd.DataFrame:
    """Did a layer stop reading the attention sink as the context grew? One row per layer of dsa_sink.

    The hit rate per step is sink_hits / queries of that step's deltas, summed over a rolling
    `window` of steps to smooth sparse decode steps.

    Returns: layer, overall_rate, final_rate (rate at the last step), first_step_below and
    position_below (first step, and the context position reached then, where the rate fell under
    `threshold`; -1 if never), evicted (final_rate < threshold).
    """
    df = to_pandas(sink)
    out = []
    for l, g in df.groupby("layer", sort=True):
        per_step = g.groupby("step", sort=True).agg(queries=("queries", "sum"), hits=("sink_hits", "sum"),
                                                    position=("position", "max"))
        q = per_step["queries"].rolling(window, min_periods=1).sum().to_numpy()
        h = per_step["hits"].rolling(window, min_periods=1).sum().to_numpy()
        rate = np.divide(h, q, out=np.full(len(q), np.nan), where=q > 0)
        below = np.flatnonzero(rate < threshold)
        first = int(below[0]) if len(below) else -1
        out.append({"layer": int(l), "overall_rate": per_step["hits"].sum() / max(per_step["queries"].sum(), 1),
                    "final_rate": float(rate[-1]) if len(rate) else np.nan,
                    "first_step_below": int(per_step.index[first]) if first >= 0 else -1,
                    "position_below": int(per_step["position"].iloc[first]) if first >= 0 else -1,
                    "evicted": bool(len(rate) and rate[-1] < threshold)})
    return pd.DataFrame(out, columns=["layer", "overall_rate", "final_rate", "first_step_below", "position_below",
                                      "evicted"])


def queries_per_position(sink: Frame, extent: int) -> np.ndarray:
    """How many DSA queries were made at each position 0..extent-1, from the dsa_sink deltas: int64 [extent].

    A dsa_sink row covers one forward of one layer (`position` its last query, `queries` how many, in a
    contiguous run ending there); the layer and rank with the most queries are counted (every DSA layer
    sees the same queries), positions past `extent` dropped.
    """
    df = to_pandas(sink)
    out = np.zeros(max(int(extent), 0) + 1, np.int64)
    if len(df) == 0 or extent <= 0:
        return out[:-1]
    totals = df.groupby(["layer", "rank"])["queries"].sum()
    layer, rank = totals.idxmax()
    mine = df[(df["layer"] == layer) & (df["rank"] == rank)]
    last = mine["position"].to_numpy().astype(np.int64)
    first = np.maximum(last - mine["queries"].to_numpy().astype(np.int64) + 1, 0)
    keep = first < extent
    np.add.at(out, first[keep], 1)
    np.add.at(out, np.minimum(last[keep] + 1, extent), -1)
    return np.cumsum(out)[:-1]


def segment_reads(totals: Frame, segments: pd.DataFrame | None = None) -> pd.DataFrame:
    """Which segment each layer read: share of a layer's selections per segment (dsa_segment_totals).

    Returns a long table: layer, segment, count, share (of the layer's total), plus name and kind
    when `segments` (trace.segments()) is given; sorted by layer, then share descending.
    """
    df = to_pandas(totals)
    agg = df.groupby(["layer", "segment"], as_index=False)["count"].sum()
    agg["share"] = agg["count"] / agg.groupby("layer")["count"].transform("sum")
    if segments is not None and len(segments):
        agg = agg.merge(segments[["id", "name", "kind"]].rename(columns={"id": "segment"}), on="segment", how="left")
    return agg.sort_values(["layer", "share"], ascending=[True, False], ignore_index=True)


def image_patch_reads(topk: Frame, tokens: pd.DataFrame, image_id: int, grid: tuple[int, int],
                      queries: tuple[int, int] | None = None, layers: Sequence[int] | None = None) -> np.ndarray:
    """Which patches of an image were read: selections per patch, int64 [grid_rows, grid_cols].

    Args:
        topk (DataFrame | Table): dsa_topk rows (layer, position, selected).
        tokens (DataFrame): the token table (position, image_id, patch_row, patch_col).
        image_id (int): the image's segment id.
        grid (tuple[int, int]): (grid_rows, grid_cols) of the image (session segment "image").
        queries (tuple[int, int], Optional): inclusive query-position range (e.g. the description).
        layers (Sequence[int], Optional): layers to count (default: all in `topk`).
    """
    keys, owner = list_values(topk, "selected")
    qpos = column(topk, "position")
    keep = np.ones(len(owner), dtype=bool)
    if queries is not None:
        keep &= (qpos[owner] >= queries[0]) & (qpos[owner] <= queries[1])
    if layers is not None:
        check_dsa_layers(topk, layers, "image_patch_reads")
        keep &= np.isin(column(topk, "layer")[owner], list(layers))
    patches = tokens[tokens["image_id"] == image_id]
    lookup = np.full(int(tokens["position"].max()) + 1 if len(tokens) else 0, -1, dtype=np.int64)
    lookup[patches["position"].to_numpy()] = (patches["patch_row"].to_numpy().astype(np.int64) * grid[1]
                                              + patches["patch_col"].to_numpy().astype(np.int64))
    keys = keys[keep].astype(np.int64)
    keys = keys[keys < len(lookup)]
    cells = lookup[keys]
    cells = cells[cells >= 0]
    return np.bincount(cells, minlength=grid[0] * grid[1]).reshape(grid)


def dense_mass_summary(mass: Frame, segments: pd.DataFrame | None = None, below: float = 0.9) -> pd.DataFrame:
    """How much of dense attention's mass top-k keeps: per layer (and per segment of the query if given).

    Returns: layer[, segment], queries, mean, p5, median, min, share_below (queries keeping less than
    `below` of the mass).
    """
    df = to_pandas(mass)[["layer", "position", "mass"]].copy()
    keys = ["layer"]
    if segments is not None:
        df["segment"] = segment_of(df["position"].to_numpy(), segments)
        keys.append("segment")
    out = df.groupby(keys, sort=True)["mass"].agg(
        queries="count", mean="mean", p5=lambda m: float(np.quantile(m, 0.05)), median="median", min="min",
        share_below=lambda m: float((m < below).mean()))
    return out.reset_index()
