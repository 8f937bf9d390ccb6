"""View 3, KDA state: how the recurrent memories fill and decay over the context.

- heat map: KDA layers x position of the state's Frobenius norm (mean or max over heads), binned
  to the screen on the server, segment boundaries dashed;
- lines: per-head norm of one chosen layer over position (heads that saturate flatten early, heads
  that forget drop at a boundary).
"""

from __future__ import annotations

import numpy as np
import panel as pn
import param
from bokeh.models import ColumnDataSource, HoverTool, Range1d
from bokeh.palettes import Category20_20
from bokeh.plotting import figure

from apps.dashboard.components.base import ViewComponent
from apps.dashboard.components.figures import HeatFigure, position_format, segment_starts, trim
from workbench.analysis.views import KDAStateData, RecordingMapData


class KDAStateView(ViewComponent):
    """KDA state norms: layer x position heat map and per-head lines of one layer."""

    view = "kda"
    layer = param.Selector(default=None, objects=[], allow_None=True,
                           doc="KDA layer of the per-head lines (filled in as layers appear in the trace)")
    reduce = param.Selector(default="mean", objects=["mean", "max"], doc="how heads are combined in the heat map")

    def __init__(self, **params) -> None:
        super().__init__(**params)
        self.heat = HeatFigure("KDA state norm ||S||_F over the context", "position", "KDA layer", "norm")
        self.lines_source = ColumnDataSource({"xs": [], "ys": [], "head": [], "colour": []})
        self.lines = figure(title="Per-head state norm", height=220, sizing_mode="stretch_width",
                            x_range=Range1d(0, 1), tools="xpan,xwheel_zoom,reset,save", toolbar_location="above",
                            x_axis_label="position", y_axis_label="norm")
        self.lines.multi_line(xs="xs", ys="ys", line_color="colour", line_width=1.3, source=self.lines_source)
        self.lines.xaxis.formatter = position_format()
        self.lines.add_tools(HoverTool(tooltips=[("head", "@head"), ("position", "$x{0,0}"), ("norm", "$y{0.000}")]))
        self.bounds = ColumnDataSource({"x": []})
        self.lines.vspan(x="x", source=self.bounds, line_color="#888", line_dash="dashed")
        trim(self.lines)
        self.layer_select = pn.widgets.Select.from_param(self.param.layer, label="Layer (per-head lines)", width=180)
        self.reduce_select = pn.widgets.RadioButtonGroup.from_param(self.param.reduce, width=140)
        self.redraw()

    @param.depends("layer", "reduce", watch=True)
    def _options(self) -> None:
        self.state.set_options(kda_layer=self.layer, kda_reduce=self.reduce)

    def draw(self, data: KDAStateData, session: RecordingMapData, changed: set[str]) -> None:
        if "heat" in changed:
            self.heat.update(data.heat)
            layers = list(data.heat.rows) if data.heat is not None else []
            if layers != self.param.layer.objects:
                self.param.layer.objects = layers
        if "segments" in changed:
            starts = segment_starts(session.segments)
            self.heat.set_boundaries(starts)
            self.bounds.data = {"x": starts}
        if "heads" in changed and data.heads is not None:
            self._lines(data)
        if self.layer is None and data.head_layer is not None and data.head_layer in self.param.layer.objects:
            # show which layer the follower picked (it already computes that one)
            self.layer = data.head_layer

    def _lines(self, data: KDAStateData) -> None:
        heads = data.heads
        n_bins = heads.values.shape[1] if heads.values.ndim == 2 else 0
        x = (np.arange(n_bins) + 0.5) * (heads.x1 - heads.x0) / max(n_bins, 1) + heads.x0
        xs, ys = [], []
        for row in heads.values:
            keep = ~np.isnan(row)  # bins without a measurement are gaps, not zeros
            xs.append(x[keep])
            ys.append(row[keep])
        self.lines_source.data = {"xs": xs, "ys": ys, "head": list(range(len(xs))),
                                  "colour": [Category20_20[i % 20] for i in range(len(xs))]}
        self.lines.x_range.update(start=heads.x0, end=heads.x1)
        self.lines.title.text = f"Per-head state norm, layer {data.head_layer} ({len(xs)} heads)"

    def __panel__(self) -> pn.viewable.Viewable:
        return pn.Card(
            pn.Row(self.layer_select, pn.Column(pn.pane.HTML("heads:", margin=(0, 5)), self.reduce_select)),
            self.heat.figure, self.lines, self.drawn_marker,
            title="KDA state", sizing_mode="stretch_width", collapsible=False, css_classes=["k3-view-kda"])
