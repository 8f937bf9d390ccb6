"""DSA selection structure, each figure beside what uniformly random picks would give.

Pure functions over the dsa_topk rows (layer, position, selected), the dsa_dense_mass rows and the
dsa_sink deltas; no I/O.

- `jaccard(a, b)` and `cross_layer_jaccard(topk)`: overlap of consecutive DSA layers' selections for
  the same query (chance: the exact expected Jaccard of two random k-sets, hypergeometric overlap).
- `locality(topk)`: share of picks among the last W = 2k and 8k tokens (a layer collapsed to
  a sliding window reads ~100% there), read-distance quantiles.
- `faithfulness(dense_mass)`: IoU / recall of the selection against the dense top-k (sampled queries).
- `sink_over_time(sink)`: share of queries that select positions 0..sink-1 per step, with
  its chance value and an alarm where a layer stops reading the sink once the context passes top-k.

The top-k, the sink size and the DSA layer ids come from the table itself when it is a trace's
(`trace.table` / `trace.df` carry the recording's settings: `workbench.recorded_settings`); an explicit
value that disagrees with the recording raises InputError instead of moving every chance value.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import pandas as pd

from workbench.analysis.chance import chance_of_hit
from workbench.analysis.common import Frame, column, list_values, to_pandas
from workbench.analysis.recorded import check_dsa_layers, recorded_setting
from workbench.recorded_settings import settings_of


def jaccard(a: Sequence[int], b: Sequence[int]) -> float:
    """|a & b| / |a | b| of two sets of positions (negative entries = empty slots); 1.0 for two empty sets."""
    sa, sb = {int(x) for x in a if x >= 0}, {int(x) for x in b if x >= 0}
    union = len(sa | sb)
    return len(sa & sb) / union if union else 1.0


def chance_jaccard(visible: int, k1: int, k2: int | None = None) -> float:
    """Expected Jaccard of two independent uniform random sets of k1 and k2 keys among `visible`.

    The overlap X is hypergeometric (population visible, k1 marked, k2 drawn); J = X / (k1 + k2 - X).
    """
    k2 = k1 if k2 is None else k2
    v, k1, k2 = int(visible), min(int(k1), int(visible)), min(int(k2), int(visible))
    if k1 == 0 or k2 == 0:
        return 1.0 if k1 == k2 else 0.0
    lo, hi = max(0, k1 + k2 - v), min(k1, k2)
    x = np.arange(lo, hi + 1)
    lg = np.vectorize(math.lgamma)
    log_pmf = (lg(k1 + 1) - lg(x + 1) - lg(k1 - x + 1) + lg(v - k1 + 1) - lg(k2 - x + 1) - lg(v - k1 - k2 + x + 1)
               - lg(v + 1) + lg(k2 + 1) + lg(v - k2 + 1))
    pmf = np.exp(log_pmf - log_pmf.max())
    pmf /= pmf.sum()
    return float((pmf * x / (k1 + k2 - x)).sum())


def _rows_by_layer(topk: Frame) -> dict[int, dict[int, np.ndarray]]:
    """{layer: {query position: selected keys (>= 0)}}; a position recorded twice keeps the last row."""
    layer = column(topk, "layer").astype(np.int64)
    pos = column(topk, "position").astype(np.int64)
    keys, owner = list_values(topk, "selected")
    keys = keys.astype(np.int64)
    order = np.argsort(owner, kind="stable")
    keys, owner = keys[order], owner[order]
    bounds = np.searchsorted(owner, np.arange(len(layer) + 1))
    out: dict[int, dict[int, np.ndarray]] = {}
    for r in range(len(layer)):
        sel = keys[bounds[r]:bounds[r + 1]]
        out.setdefault(int(layer[r]), {})[int(pos[r])] = sel[sel >= 0]
    return out


def cross_layer_jaccard(topk: Frame, layers: Sequence[int] | None = None) -> pd.DataFrame:
    """Overlap of consecutive DSA layers' selections for the same queries.

    Args:
        topk (DataFrame | Table): dsa_topk rows.
        layers (Sequence[int], Optional): DSA layers in model order (default: the recording's DSA layers, else
            those in `topk`); a layer the recording does not call a DSA layer is an InputError.

    Returns: layer_a, layer_b, queries (positions both recorded), jaccard (mean over them),
    jaccard_min, chance (mean expected Jaccard of random sets of the same sizes), ratio.
    """
    by_layer = _rows_by_layer(topk)
    check_dsa_layers(topk, layers, "cross_layer_jaccard")
    chosen = layers if layers is not None else settings_of(topk).get("dsa_layers")
    order = sorted(by_layer) if chosen is None else [l for l in chosen if l in by_layer]
    out = []
    for a, b in zip(order[:-1], order[1:]):
        common = sorted(set(by_layer[a]) & set(by_layer[b]))
        js = [jaccard(by_layer[a][p], by_layer[b][p]) for p in common]
        cache: dict[tuple, float] = {}
        ch = []
        for p in common:
            key = (p + 1, len(by_layer[a][p]), len(by_layer[b][p]))
            if key not in cache:
                cache[key] = chance_jaccard(*key)
            ch.append(cache[key])
        mean, chance = (float(np.mean(js)) if js else np.nan), (float(np.mean(ch)) if ch else np.nan)
        out.append({"layer_a": a, "layer_b": b, "queries": len(common), "jaccard": mean,
                    "jaccard_min": float(np.min(js)) if js else np.nan, "chance": chance,
                    "ratio": mean / chance if chance and chance > 0 else np.nan})
    return pd.DataFrame(out, columns=["layer_a", "layer_b", "queries", "jaccard", "jaccard_min", "chance", "ratio"])


def locality(topk: Frame, topk_k: int | None = None, multiples: Sequence[int] = (2, 8),
             quantiles: Sequence[float] = (0.1, 0.5, 0.9)) -> pd.DataFrame:
    """How local each layer's reads are, from full index lists (dsa_topk rows).

    `topk_k` is the recorded DSA top-k of a trace's table (an explicit value must match it; a table
    built by hand needs it). Only queries that see more than top-k keys count (below that every key is read).
    Returns per layer: queries, picks, share_w{m}k (share of picks with distance < m * topk_k) and
    chance_w{m}k (share random picks would give: mean of min(W, visible) / visible), distance
    quantiles p10/p50/p90 (query position - key position), collapsed (share_w2k >= 0.95: the layer acts
    as a sliding window).
    """
    topk_k = int(recorded_setting(topk, "topk", topk_k, "locality", "topk_k"))
    layer = column(topk, "layer").astype(np.int64)
    pos = column(topk, "position").astype(np.int64)
    keys, owner = list_values(topk, "selected")
    keys = keys.astype(np.int64)
    valid = keys >= 0
    keys, owner = keys[valid], owner[valid]
    long = pos + 1 > topk_k
    out = []
    for l in np.unique(layer):
        rows = (layer == l) & long
        mine = rows[owner]
        dist = pos[owner[mine]] - keys[mine]
        visible = (pos[rows] + 1).astype(np.float64)
        row = {"layer": int(l), "queries": int(rows.sum()), "picks": int(mine.sum())}
        for m in multiples:
            w = m * topk_k
            row[f"share_w{m}k"] = float((dist < w).mean()) if len(dist) else np.nan
            row[f"chance_w{m}k"] = float((np.minimum(w, visible) / visible).mean()) if len(visible) else np.nan
        qs = np.quantile(dist, quantiles) if len(dist) else np.full(len(quantiles), np.nan)
        row.update({f"p{round(q * 100)}": float(v) for q, v in zip(quantiles, qs)})
        row["collapsed"] = bool(len(dist) and row[f"share_w{multiples[0]}k"] >= 0.95)
        out.append(row)
    return pd.DataFrame(out)


def faithfulness(dense_mass: Frame, topk_k: int | None = None) -> pd.DataFrame:
    """Does the indexer pick what dense attention would? Per layer, over the sampled queries (dsa_dense_mass
    rows recorded with policy.dense_overlap). `topk_k`: the recorded top-k (explicit: must match it).

    Returns: layer, queries, mass (mean dense mass kept), iou, recall (means), chance_recall (mean
    min(k, visible) / visible: a random k-set's expected recall of the dense top-k), chance_iou
    (expected IoU of two random k-sets), recall_ratio.
    """
    topk_k = int(recorded_setting(dense_mass, "topk", topk_k, "faithfulness", "topk_k"))
    df = to_pandas(dense_mass)
    if "iou" not in df or df["iou"].isna().all():
        raise ValueError("dsa_dense_mass has no iou/recall: record with policy dense_overlap=true (or 'all')")
    df = df.dropna(subset=["iou"])
    out = []
    for l, g in df.groupby("layer", sort=True):
        visible = g["position"].to_numpy().astype(np.int64) + 1
        k = np.minimum(topk_k, visible)
        ch_recall = float((k / visible).mean())
        ch_iou = float(np.mean([chance_jaccard(v, kk) for v, kk in zip(visible, k)]))
        recall = float(g["recall"].mean())
        out.append({"layer": int(l), "queries": len(g), "mass": float(g["mass"].mean()), "iou": float(g["iou"].mean()),
                    "recall": recall, "chance_iou": ch_iou, "chance_recall": ch_recall,
                    "recall_ratio": recall / ch_recall if ch_recall > 0 else np.nan})
    return pd.DataFrame(out)


def sink_over_time(sink: Frame, topk_k: int | None = None, sink_tokens: int | None = None, threshold: float = 0.5) -> tuple[pd.DataFrame,
                                                                                                     pd.DataFrame]:
    """Attention sink over time: per layer and step, the share of queries selecting a position < sink_tokens.

    Args:
        sink (DataFrame | Table): dsa_sink deltas (layer, step, position, queries, sink_hits).
        topk_k (int, Optional): the indexer's top-k (below it every query reads every key, the sink
            included); the recorded one of a trace's table, which an explicit value must match.
        sink_tokens (int, Optional): policy.sink_tokens; the recorded one likewise.
        threshold (float): a step's rate below this is "not reading the sink".

    Returns (timeline, alarms). timeline: layer, step, position (context reached), queries, rate,
    chance (P(random top-k picks include a sink position) at that context). alarms: one row per layer
    whose rate fell below `threshold` at a step where the context exceeded top-k after having been
    at or above it: layer, step, position, rate, chance, rate_before.
    """
    topk_k = int(recorded_setting(sink, "topk", topk_k, "sink_over_time", "topk_k"))
    sink_tokens = int(recorded_setting(sink, "sink_tokens", sink_tokens, "sink_over_time"))
    df = to_pandas(sink)
    tl = df.groupby(["layer", "step"], as_index=False, sort=True).agg(
        position=("position", "max"), queries=("queries", "sum"), hits=("sink_hits", "sum"))
    tl["rate"] = np.divide(tl["hits"], tl["queries"], out=np.full(len(tl), np.nan), where=tl["queries"] > 0)
    tl["chance"] = np.asarray(chance_of_hit(tl["position"].to_numpy() + 1, sink_tokens, topk_k), dtype=np.float64) \
        if len(tl) else np.zeros(0)
    alarms = []
    for l, g in tl.groupby("layer", sort=True):
        was_reading = np.maximum.accumulate(g["rate"].fillna(0).to_numpy() >= threshold)
        prev = np.concatenate([[False], was_reading[:-1]])
        bad = prev & (g["rate"].to_numpy() < threshold) & (g["position"].to_numpy() + 1 > topk_k)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            before = g["rate"].to_numpy()[:i]
            alarms.append({"layer": int(l), "step": int(g["step"].iloc[i]), "position": int(g["position"].iloc[i]),
                           "rate": float(g["rate"].iloc[i]), "chance": float(g["chance"].iloc[i]),
                           "rate_before": float(np.nanmean(before)) if len(before) else np.nan})
    cols = ["layer", "step", "position", "rate", "chance", "rate_before"]
    return (tl[["layer", "step", "position", "queries", "rate", "chance"]],
            pd.DataFrame(alarms, columns=cols))
