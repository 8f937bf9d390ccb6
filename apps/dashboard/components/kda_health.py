"""View 5, KDA memory health: which heads saturate or forget fastest, and where in the document.

- ranked bars on the position axis (shared with the session map's, so they line up with its
  segments): one bar per ranked head, from 0 to where it saturated (its norm reached 90% of its peak)
  or forgot (its largest norm drop, or the plateau when nothing fell), segments shaded behind;
- the same positions marked on the session map itself (triangles: saturates, inverted: forgets), with a
  legend beside the strip;
- one table per kind, each head listed once, with the measures behind that kind's ranking (escaped on
  the server): a saturating head's plateau, climb to it and lowest effective rank; a forgetting head's
  half-life, largest fall and final / peak norm;
- an empty state that says why when the trace has no KDA records.
The ranking is `workbench.analysis.heads_at_risk(memory_health(kda_norms))`.
"""

from __future__ import annotations

import html
import math
from typing import Any

import panel as pn
from bokeh.core.properties import field
from bokeh.models import ColumnDataSource, FactorRange, HoverTool, Legend, LegendItem, Range1d
from bokeh.plotting import figure

from apps.dashboard.components.base import ViewComponent
from apps.dashboard.components.figures import SEGMENT_COLOURS, lean, position_format, trim
from apps.dashboard.components.panes import HTMLText, html_table, set_text, text_pane
from workbench.analysis.views import KDAHealthData, RecordingMapData

KIND_COLOURS = {"saturates": "#b279a2", "forgets": "#f58518"}
KIND_MARKERS = {"saturates": "triangle", "forgets": "inverted_triangle"}


def row_label(row: dict) -> str:
    return f"{row['kind']} #{row['rank']}: L{row['layer']} h{row['head']}"


def _num(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–" if value is None or math.isnan(value) else "∞"
    return format(value, fmt)


def summary_text(data: KDAHealthData) -> str:
    """Two or three lines: what was measured, the fastest-saturating and the fastest-forgetting head."""
    if not data.ranked:
        return data.note
    lines = [f"{data.heads} heads of {data.layers} KDA layers, measured up to position {data.last_position:,}; "
             f"recorded: norm{''.join(', ' + m for m in data.measured)}"]
    for kind, what in (("saturates", "saturates first"), ("forgets", "forgets fastest")):
        top = next((r for r in data.ranked if r["kind"] == kind and r["rank"] == 1), None)
        if top is not None:
            where = f" in {top['segment_name']!r}" if top.get("segment_name") else ""
            lines.append(f"{what}: layer {top['layer']} head {top['head']} at position {top['position']:,}{where}")
    if "half_life" not in data.measured and "mean_decay" not in data.measured:
        lines.append("forgetting is ranked by the largest norm drop (decay half-lives were not recorded: "
                     "policy kda_extras)")
    return "\n".join(lines)


def kind_legend(fig: figure, size: int) -> Legend:
    """A legend of the two marks (saturates, forgets), from two glyphs that draw nothing: entries grouped
    from the live source instead (`legend_field`) made BokehJS fail to decode a live update of it."""
    empty = ColumnDataSource({"x": [], "y": []})
    items = []
    for kind in ("saturates", "forgets"):
        key = lean(fig.scatter(x="x", y="y", source=empty, marker=KIND_MARKERS[kind], size=size,
                               fill_color=KIND_COLOURS[kind], line_color="black"))
        items.append(LegendItem(label=kind, renderers=[key]))
    return Legend(items=items)


def _nan(value: Any) -> float:
    return float("nan") if value is None else float(value)


def ranked_table(rows: tuple[dict, ...]) -> str:
    """The ranked heads as escaped HTML: one table per kind, with that kind's own measures."""
    head = ["#", "layer", "head"]
    tables = []
    sat = [r for r in rows if r["kind"] == "saturates"]
    if sat:
        cells = [[str(int(r["rank"])), str(int(r["layer"])), str(int(r["head"])), f"{int(r['position']):,}",
                  f"{_num(_nan(r.get('saturate_fraction')) * 100, '.0f')}%", html.escape(str(r.get("segment_name") or "")),
                  _num(r.get("saturate_growth_per_1k"), ".3g"), _num(r.get("min_eff_rank"), ".1f")] for r in sat]
        tables.append(_kind_title("saturates") + html_table("k3-health", head + [
            "plateau at", "of context", "segment", "norm gained /1k tokens to plateau", "min eff. rank"], cells))
    fgt = [r for r in rows if r["kind"] == "forgets"]
    if fgt:
        cells = [[str(int(r["rank"])), str(int(r["layer"])), str(int(r["head"])), f"{int(r['position']):,}",
                  html.escape(str(r.get("segment_name") or "")), _num(r.get("half_life"), ",.0f"),
                  f"−{_num(_nan(r.get('forget_drop')) * 100, '.0f')}%" if _nan(r.get("forget_drop")) > 0 else "none",
                  _num(_nan(r.get("final_norm")) / _nan(r.get("peak_norm")) if _nan(r.get("peak_norm")) > 0
                       else float("nan"), ".2f")] for r in fgt]
        tables.append(_kind_title("forgets") + html_table("k3-health", head + [
            "fell at", "segment", "half-life (tokens)", "largest fall", "final / peak norm"], cells))
    return "".join(tables)


def _kind_title(kind: str) -> str:
    what = {"saturates": "Saturate first", "forgets": "Forget fastest"}[kind]
    return f"<p style='margin:6px 0 2px'><span style='color:{KIND_COLOURS[kind]}'>&#9632;</span> <b>{what}</b></p>"


class KDAHealthView(ViewComponent):
    """Heads ranked by how fast they saturate or forget, with where it happened on the context."""

    view = "health"

    def __init__(self, session_map: Any = None, **params: Any) -> None:
        super().__init__(**params)
        # the session map's own x range: the bars pan and zoom with its segments strip
        x_range = session_map.figure.x_range if session_map is not None else Range1d(0, 1)
        self._own_range = session_map is None
        self.source = ColumnDataSource({"label": [], "position": [], "colour": [], "marker": [], "kind": [],
                                        "layer": [], "head": [], "segment": []})
        self.segments = ColumnDataSource({"x0": [], "x1": [], "colour": []})
        self.figure = figure(title="KDA heads that saturate or forget fastest, and where", height=300,
                             sizing_mode="stretch_width", x_range=x_range, y_range=FactorRange(factors=["-"]),
                             tools="xpan,xwheel_zoom,reset,save", toolbar_location="above", x_axis_label="position")
        self.figure.vstrip(x0="x0", x1="x1", source=self.segments, fill_color="colour", fill_alpha=0.12, line_color=None)
        self.figure.hbar(y="label", left=0, right="position", height=0.6, source=self.source, fill_color="colour",
                         fill_alpha=0.35, line_color=None)
        marks = self.figure.scatter(x="position", y="label", marker=field("marker"), size=11, source=self.source,
                                    fill_color="colour", line_color="black")
        # beside the plot: inside it would hide the late heads' marks
        self.figure.add_layout(kind_legend(self.figure, 11), "right")
        tips = [("head", "L@layer h@head"), ("", "@kind at @position{0,0}"), ("segment", "@segment")]
        self.figure.add_tools(HoverTool(renderers=[marks], tooltips=tips))
        self.figure.xaxis.formatter = position_format()
        self.figure.grid.visible = False
        trim(self.figure)
        if session_map is not None:
            # the same positions on the session map's strip
            on_map = lean(session_map.figure.scatter(x="position", y=0.5, marker=field("marker"), size=10, source=self.source,
                                                fill_color="colour", line_color="black"))
            session_map.figure.add_tools(HoverTool(renderers=[on_map], tooltips=tips))
            # the strip is 90 px high: its legend (what the triangles are) sits beside it, not over the segments
            legend = kind_legend(session_map.figure, 10)
            legend.update(title="KDA heads", label_text_font_size="10px", glyph_height=12, spacing=0, padding=2,
                          margin=2, title_text_font_size="10px")
            session_map.figure.add_layout(legend, "right")
        self.summary = text_pane("waiting for the trace…", sizing_mode="stretch_width", css_classes=["k3-health-summary"])
        self.table = HTMLText("", sizing_mode="stretch_width", css_classes=["k3-health-table"])
        self.redraw()

    def has_data(self, data: KDAHealthData, session: RecordingMapData) -> bool:
        return data is not None and bool(data.ranked)

    def draw(self, data: KDAHealthData, session: RecordingMapData, changed: set[str]) -> None:
        if {"segments", "extent"} & changed:
            segs = session.segments
            self.segments.data = {"x0": [int(s["start"]) for s in segs], "x1": [int(s["end"]) for s in segs],
                                  "colour": [SEGMENT_COLOURS.get(s["kind"], "#999") for s in segs]}
            if self._own_range:
                self.figure.x_range.update(start=0, end=session.extent)
        if data is None or not ({"ranked", "note", "measured", "heads", "layers", "last_position", "status"} & changed):
            return
        waiting = not data.ranked and session.status == "waiting"
        set_text(self.summary, "waiting for the trace…" if waiting else summary_text(data))
        rows = data.ranked
        labels = [row_label(r) for r in rows]
        self.source.data = {"label": labels, "position": [int(r["position"]) for r in rows],
                            "colour": [KIND_COLOURS[r["kind"]] for r in rows],
                            "marker": [KIND_MARKERS[r["kind"]] for r in rows], "kind": [r["kind"] for r in rows],
                            "layer": [int(r["layer"]) for r in rows], "head": [int(r["head"]) for r in rows],
                            "segment": [str(r.get("segment_name") or "") for r in rows]}
        # rank 1 on top: factors run bottom-up
        self.figure.y_range.factors = list(reversed(labels)) or ["-"]
        self.figure.visible = bool(rows)
        self.table.object = ranked_table(rows) if rows else ""

    def __panel__(self) -> pn.viewable.Viewable:
        return pn.Card(self.summary, self.figure, self.table, self.drawn_marker, title="KDA memory health",
                       sizing_mode="stretch_width", collapsible=False, css_classes=["k3-view-health"])
