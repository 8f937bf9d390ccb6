"""The DSA difference view of the side-by-side dashboard: where trace B read other keys than trace A.

- heat map: DSA layers x query position, colour = share of the queries in the bin whose selected set
  changed between the traces (transparent where no query was recorded in both);
- table per DSA layer: queries compared, share changed, mean Jaccard of the two selections beside
  its chance value (two random selections of the same sizes), their ratio, first changed query, and
  whether B forced the layer dense.
"""

from __future__ import annotations

import html
import math

import panel as pn

from apps.dashboard.components.base import ViewComponent
from apps.dashboard.components.figures import HeatFigure, segment_starts
from apps.dashboard.components.panes import HTMLText, html_table, set_text, text_pane
from workbench.analysis.views import DSADiffData, RecordingMapData


def _ratio(value: float) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.1f}x"


def layers_table(rows: tuple[dict, ...]) -> str:
    """Per-layer comparison as an escaped HTML table (every Jaccard beside its chance value)."""
    headers = ["DSA layer", "in B", "queries", "reads changed", "mean Jaccard A/B", "chance", "ratio", "first changed"]
    cells = [[str(int(r["layer"])), "dense" if r.get("dense_in_b") else "sparse", f"{int(r['queries']):,}",
              f"{r['changed_share'] * 100:.0f}%", f"{r['mean_jaccard']:.2f}", f"{r['chance_jaccard']:.2f}",
              _ratio(r.get("ratio")), html.escape(str(r["first_changed"]) if r["first_changed"] >= 0 else "–")]
             for r in rows]
    return html_table("k3-dsa-diff", headers, cells)


def diff_summary(data: DSADiffData, trace: str) -> str:
    if not data.other:
        return "waiting for both traces…"
    dense = ", ".join(map(str, data.dense_layers)) if data.dense_layers else "not recorded"
    head = f"A = {trace}\nB = {data.other} (layers forced dense in B: {dense})"
    if data.note:
        return f"{head}\n{data.note}"
    return f"{head}\n{data.queries:,} (layer, query) pairs recorded in both traces"


class DSADiffView(ViewComponent):
    """Which queries' DSA selections changed between the two traces, per layer, beside chance."""

    view = "diff"

    def __init__(self, **params) -> None:
        super().__init__(**params)
        self.heat = HeatFigure("Share of queries whose DSA reads changed (A vs B)", "query position", "DSA layer",
                               "share changed", palette="inferno", height=220)
        self.heat.mapper.update(low=0.0, high=1.0)
        self.summary = text_pane("waiting for both traces…", sizing_mode="stretch_width",
                                 css_classes=["k3-dsa-diff-summary"])
        self.table = HTMLText("", sizing_mode="stretch_width", css_classes=["k3-dsa-diff-table"])
        self.redraw()

    def draw(self, data: DSADiffData, session: RecordingMapData, changed: set[str]) -> None:
        if data is None:
            return
        set_text(self.summary, diff_summary(data, self.state.trace_path))
        if "heat" in changed:
            self.heat.update(data.heat)
        if {"segments", "heat"} & changed:
            self.heat.set_boundaries(segment_starts(session.segments))
        if "layers" in changed:
            self.table.object = layers_table(data.layers) if data.layers else ""

    def __panel__(self) -> pn.viewable.Viewable:
        return pn.Card(self.summary, self.heat.figure, self.table, self.drawn_marker, title="DSA map: A vs B",
                       sizing_mode="stretch_width", collapsible=False, css_classes=["k3-view-dsa-diff"])
