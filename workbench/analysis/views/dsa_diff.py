"""Reducer of the DSA difference view: where two traces of the same input read differently.

Used when the dashboard shows two traces side by side (`--compare B`, `?compare=B`), typically the
two runs of `workbench compare` (A sparse, B with some DSA layers forced dense). It runs in trace A's
follower: the follower hands it trace A, and it follows trace B itself (its own `open_trace`,
refreshed each poll), so it costs the event loop nothing.

- `read_changes` on the `dsa_topk` rows of both traces: per layer and query recorded in both, the
  Jaccard of the selected sets and whether they differ;
- heat: DSA layers x position, share of the queries in each bin whose reads changed (NaN where no
  query was recorded in both);
- layers: per layer mean Jaccard beside the Jaccard two random selections of the same sizes would
  give (`reads_vs_chance`), the share changed, the first changed query, and B's dense layers.
Recomputed only when either trace gained `dsa_topk` parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from workbench.analysis import bin_mean, read_changes, reads_vs_chance
from workbench.trace import Trace, TraceError, open_trace

from workbench.analysis.views.base import HeatMap, Reducer, ViewOptions
from workbench.analysis.views.session_map import RecordingMapData

_COLUMNS = ["layer", "position", "selected"]


@dataclass(frozen=True, eq=False)
class DSADiffData:
    heat: HeatMap | None = None  # rows are DSA layers; share of queries whose reads changed
    layers: tuple[dict, ...] = ()  # `reads_vs_chance` rows + dense_in_b
    queries: int = 0  # (layer, query) pairs compared
    other: str = ""  # trace B's path as shown
    dense_layers: tuple[int, ...] = ()  # B's forced-dense layers, from its session.json (when recorded by compare)
    note: str = ""  # why there is nothing to compare yet ("" when there is)


def changed_heat(changes: pd.DataFrame, extent: int, bins: int) -> HeatMap:
    """Share of compared queries whose selection changed, per DSA layer and position bin (NaN: none compared)."""
    layers = sorted(int(l) for l in changes["layer"].unique())
    rows = []
    for layer in layers:
        g = changes[changes["layer"] == layer]
        rows.append(bin_mean(g["position"].to_numpy(), g["changed"].to_numpy(np.float64), bins, extent))
    values = np.stack(rows).astype(np.float32) if rows else np.zeros((0, bins), np.float32)
    return HeatMap(tuple(layers), values, 0.0, float(extent))


def dense_layers_of(trace: Trace) -> tuple[int, ...]:
    """The layers a `workbench compare` run forced dense (session.json's comparison entry; () otherwise)."""
    entry = trace.session.get("comparison")
    layers = entry.get("dense_layers") if isinstance(entry, dict) else None
    if not isinstance(layers, list):
        return ()
    return tuple(sorted(int(l) for l in layers if isinstance(l, int) and not isinstance(l, bool)))


class DSADiffReducer(Reducer[DSADiffData]):
    """(trace A, trace B followed here) -> `DSADiffData`."""

    data_type = DSADiffData

    def __init__(self, other: str | Path, shown_as: str | None = None) -> None:
        super().__init__()
        self.other_path = Path(other)
        self.shown_as = shown_as or str(other)
        self._other: Trace | None = None

    def _other_trace(self) -> Trace | None:
        try:
            if self._other is None:
                self._other = open_trace(self.other_path)
            else:
                self._other.refresh()
        except TraceError:
            self._other = None
        return self._other

    def reduce(self, trace: Trace, options: ViewOptions, session: RecordingMapData) -> DSADiffData:
        other = self._other_trace()
        if other is None:
            return self.result(heat=None, layers=(), queries=0, other=self.shown_as, dense_layers=(),
                               note=f"trace B ({self.shown_as}) cannot be read yet; waiting for it")
        deps = (len(trace.parts("dsa_topk")), len(other.parts("dsa_topk")), session.extent, options.bins)
        heat, layers, queries = self.memo("diff", deps, lambda: self._compare(trace, other, session, options))
        dense = dense_layers_of(other)
        note = "" if queries else ("no DSA query was recorded in both traces (record both with the same policy, "
                                   "e.g. by `workbench compare`)")
        return self.result(heat=heat, layers=layers, queries=queries, other=self.shown_as, dense_layers=dense,
                           note=note)

    def _compare(self, trace: Trace, other: Trace, session: RecordingMapData,
                 options: ViewOptions) -> tuple[HeatMap | None, tuple[dict, ...], int]:
        changes = read_changes(trace.table("dsa_topk", columns=_COLUMNS), other.table("dsa_topk", columns=_COLUMNS))
        if not len(changes):
            return None, (), 0
        dense = set(dense_layers_of(other))
        summary = reads_vs_chance(changes)
        rows = tuple({**{k: (v.item() if isinstance(v, np.generic) else v) for k, v in r.items()},
                      "dense_in_b": int(r["layer"]) in dense} for r in summary.to_dict(orient="records"))
        return changed_heat(changes, session.extent, options.bins), rows, int(len(changes))
