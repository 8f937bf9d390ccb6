"""Reducer of view 4, experts: usage heat map, text vs image shares, the selected token's routes, EP load.

- heat: each expert's share of its MoE layer's routed slots, filtered by modality and segment (from
  the trace's running sums of `moe_counts`, a finished trace's from the summary cache); text /
  image: slots per expert of text and of image tokens (one layer or all);
- routes: the experts, combine weights and router entropy each layer chose for the selected token;
- rank load: routed slots per expert-parallel rank over all layers, and the most imbalanced layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from workbench.trace import Trace

from workbench.analysis.views.base import CachedSums, HeatMap, Reducer, ViewOptions
from workbench.analysis.views.part_feed import PartFeeds
from workbench.analysis.views.session_map import RecordingMapData


@dataclass(frozen=True, eq=False)
class ExpertsData:
    heat: HeatMap | None = None  # rows are MoE layers, columns experts, values = share of the layer's slots
    text: np.ndarray | None = None  # [experts] slots of text tokens (moe_layer or all layers)
    image: np.ndarray | None = None
    rank_load: np.ndarray | None = None  # [ep ranks] routed slots over all layers
    rank_worst: tuple[int, float] | None = None  # (layer, max/mean) of the most imbalanced layer
    routes: list[dict] | None = None  # [{"layer", "experts", "weights", "entropy"}]; None: nothing selected


def expert_usage(trace: Trace, modality: str | None, segment: int | None, bars_layer: int | None
                 ) -> tuple[HeatMap | None, np.ndarray | None, np.ndarray | None]:
    """(share heat map, text slots, image slots) of the MoE layers, filtered by modality and segment."""
    layers = trace.layers("moe_counts")
    if not layers:
        return None, None, None
    segs = None if segment is None else [segment]
    counts = trace.moe_counts_matrix(modality, segs, layers).astype(np.float64)
    totals = counts.sum(axis=1, keepdims=True)
    share = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0).astype(np.float32)
    pick = layers if bars_layer not in layers else [bars_layer]
    text = trace.moe_counts_matrix("text", segs, pick).sum(axis=0)
    image = trace.moe_counts_matrix("image", segs, pick).sum(axis=0)
    # expert i is centred on x = i, like the bars and the routes below it
    return HeatMap(tuple(layers), share, -0.5, counts.shape[1] - 0.5), text, image


def rank_load(trace: Trace) -> tuple[np.ndarray | None, tuple[int, float] | None]:
    """(routed slots per EP rank over all layers, (layer, max/mean) of the most imbalanced layer)."""
    table = trace.table("moe_rank_load", columns=["layer", "ep_rank", "tokens"])
    if table.num_rows == 0:
        return None, None
    layer = table["layer"].to_numpy().astype(np.int64)
    rank = table["ep_rank"].to_numpy().astype(np.int64)
    load = table["tokens"].to_numpy().astype(np.float64)
    n_ranks = int(rank.max()) + 1
    ids, inv = np.unique(layer, return_inverse=True)
    per = np.bincount(inv * n_ranks + rank, weights=load, minlength=len(ids) * n_ranks).reshape(len(ids), n_ranks)
    mean = per.mean(axis=1)
    ratio = np.divide(per.max(axis=1), mean, out=np.ones_like(mean), where=mean > 0)
    worst = int(ratio.argmax())
    return per.sum(axis=0), (int(ids[worst]), float(ratio[worst]))


def token_routes(trace: Trace, position: int) -> list[dict]:
    """The experts each MoE layer chose for the token at `position`, by layer."""
    table = trace.routes_for(position)
    return [{"layer": int(r["layer"]), "experts": [int(e) for e in r["experts"]],
             "weights": [float(w) for w in r["weights"]], "entropy": float(r["entropy"])}
            for r in sorted(table.to_pylist(), key=lambda r: r["layer"])] if table.num_rows else []


class ExpertsReducer(Reducer[ExpertsData]):
    data_type = ExpertsData

    def __init__(self, feeds: PartFeeds | None = None) -> None:
        super().__init__(feeds)
        self.sums = CachedSums("moe_counts")

    def reduce(self, trace: Trace, options: ViewOptions, session: RecordingMapData) -> ExpertsData:
        self.sums.before(trace)
        usage = self.memo("usage", (len(trace.parts("moe_counts")), options.moe_modality, options.moe_segment,
                                    options.moe_layer),
                          lambda: expert_usage(trace, options.moe_modality, options.moe_segment, options.moe_layer))
        self.sums.after(trace)
        load, worst = self.memo("rank", (len(trace.parts("moe_rank_load")),), lambda: rank_load(trace))
        routes = None
        if options.position is not None:
            routes = self.memo("routes", (options.position, len(trace.parts("moe_routes"))),
                               lambda: token_routes(trace, options.position))
        heat, text, image = usage
        return self.result(heat=heat, text=text, image=image, rank_load=load, rank_worst=worst, routes=routes)
