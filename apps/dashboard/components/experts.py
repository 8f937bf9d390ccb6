"""View 4, experts: how the MoE layers route tokens.

- heat map: MoE layer x expert, colour = the expert's share of the layer's routed slots, filtered by
  modality and segment (from the trace's running sums);
- text vs image: each expert's share among text tokens and among image tokens (one layer or all);
- routes: the experts (and combine weights) each layer chose for the selected token;
- load per expert-parallel rank, and the most imbalanced layer (max / mean rank load).

Each share is shown beside its uniform baseline (every expert equally used: 1/E; a router spreading
evenly: entropy ln E; every rank equally loaded: the mean), since any routing has some spread by chance.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np
import panel as pn
import param
from bokeh.models import ColumnDataSource, FactorRange, FixedTicker, HoverTool, Range1d
from bokeh.plotting import figure

from apps.dashboard.components.base import ViewComponent
from apps.dashboard.components.figures import HeatFigure, legend_above, trim
from apps.dashboard.components.panes import set_text, text_pane
from workbench.analysis.views import ExpertsData, RecordingMapData

ALL = "all"


class ExpertsView(ViewComponent):
    """Expert usage heat map, text-vs-image shares, per-token routes and expert-parallel rank load."""

    view = "experts"
    modality = param.Selector(default=ALL, objects=[ALL, "text", "image"], doc="tokens counted in the heat map")
    segment = param.Selector(default=ALL, objects=[ALL], doc="segment whose tokens are counted ('all' or 'id: name')")
    layer = param.Selector(default=ALL, objects=[ALL], doc="MoE layer of the text-vs-image bars ('all' sums layers)")

    def __init__(self, **params) -> None:
        super().__init__(**params)
        self.heat = HeatFigure("Expert usage (share of the layer's routed slots; hover: beside uniform 1/E)", "expert",
                               "MoE layer", "share", chance_label="uniform share 1/E")
        self.bars_source = ColumnDataSource({"expert": [], "text": [], "image": []})
        self.bars = figure(title="Text vs image tokens: share per expert", height=200, sizing_mode="stretch_width",
                           tools="xpan,xwheel_zoom,reset", toolbar_location="above", x_axis_label="expert",
                           y_axis_label="share", x_range=Range1d(-0.5, 0.5))
        self.bars.vbar(x="expert", top="text", width=0.9, source=self.bars_source, fill_color="#4c78a8",
                       line_color=None, legend_label="text", fill_alpha=0.7)
        self.bars.vbar(x="expert", top="image", width=0.5, source=self.bars_source, fill_color="#54a24b",
                       line_color=None, legend_label="image", fill_alpha=0.9)
        self.uniform_source = ColumnDataSource({"x": [], "y": []})
        self.bars.line(x="x", y="y", source=self.uniform_source, line_color="#333", line_dash="dashed",
                       legend_label="uniform 1/E")
        legend_above(self.bars)  # inside the plot it covered the bars of the last experts
        trim(self.bars)
        self.load_source = ColumnDataSource({"rank": [], "tokens": [], "colour": []})
        self.load_mean = ColumnDataSource({"x": [], "y": []})
        self.load_note = text_pane("", width=320, css_classes=["k3-ep-note"])  # wraps beside the routes
        # the rank-load figure joins the page when a trace has two ranks or more (`load`)
        self.load_box = pn.Column(self.load_note)
        self.routes_note = text_pane("Select a token to see its routes.", sizing_mode="stretch_width")
        # the routes figure joins the page with the first selection (a lighter first paint)
        self.routes_box = pn.Column(self.routes_note, sizing_mode="stretch_width")
        self.controls = pn.Row(pn.widgets.Select.from_param(self.param.modality, label="Tokens", width=120),
                               pn.widgets.Select.from_param(self.param.segment, label="Segment", width=220),
                               pn.widgets.Select.from_param(self.param.layer, label="Layer (bars)", width=140))
        self._segment_ids: dict[str, int] = {}
        self.redraw()

    @cached_property
    def routes_source(self) -> ColumnDataSource:
        return ColumnDataSource({"expert": [], "layer": [], "weight": [], "size": []})

    @cached_property
    def routes(self) -> figure:
        """The selected token's routes (built with the first selection: a figure nobody sees yet costs the
        server its models and the browser their views at every page open)."""
        routes = figure(title="Routes of the selected token", height=220, sizing_mode="stretch_width",
                        tools="reset,save", toolbar_location="above", x_axis_label="expert",
                        y_axis_label="MoE layer", y_range=FactorRange(factors=["-"]))
        routes.scatter(x="expert", y="layer", size="size", source=self.routes_source, fill_color="#e45756",
                       line_color="black", fill_alpha=0.7)
        routes.add_tools(HoverTool(tooltips=[("layer", "@layer"), ("expert", "@expert"), ("weight", "@weight{0.000}")]))
        return trim(routes)

    @param.depends("modality", "segment", "layer", watch=True)
    def _options(self) -> None:
        self.state.set_options(moe_modality=None if self.modality == ALL else self.modality,
                               moe_segment=self._segment_ids.get(self.segment),
                               moe_layer=None if self.layer == ALL else int(self.layer))

    def draw(self, data: ExpertsData, session: RecordingMapData, changed: set[str]) -> None:
        if "segments" in changed:
            # labels are shown by a Select widget, which renders option text as text (no HTML)
            self._segment_ids = {f"{s['id']}: {s.get('name') or s['kind']}": int(s["id"]) for s in session.segments}
            self.param.segment.objects = [ALL, *self._segment_ids]
        if "heat" in changed:
            experts = data.heat.values.shape[1] if data.heat is not None and data.heat.values.ndim == 2 else 0
            self.heat.update(data.heat, chance=np.full(experts, 1.0 / experts) if experts else None)
            layers = [ALL, *map(str, data.heat.rows)] if data.heat is not None else [ALL]
            if layers != self.param.layer.objects:
                self.param.layer.objects = layers
        if {"text", "image"} & changed:
            self._bars(data)
        if "routes" in changed:
            self._routes(data)
        if "rank_load" in changed:
            self._load(data)

    def _bars(self, data: ExpertsData) -> None:
        if data.text is None:
            self.bars_source.data = {"expert": [], "text": [], "image": []}
            return
        text = np.asarray(data.text, np.float64)
        image = np.zeros_like(text)
        got = np.asarray(data.image if data.image is not None else [], np.float64)[: len(text)]
        image[: len(got)] = got  # a trace without image tokens has an empty image vector
        self.bars_source.data = {"expert": np.arange(len(text)), "text": text / max(text.sum(), 1),
                                 "image": image / max(image.sum(), 1)}
        self.bars.x_range.update(start=-0.5, end=len(text) - 0.5)
        uniform = 1.0 / max(len(text), 1)
        self.uniform_source.data = {"x": [-0.5, len(text) - 0.5], "y": [uniform, uniform]}

    @cached_property
    def load(self) -> figure:
        """Routed slots per expert-parallel rank (built when a trace has several ranks: a one-rank trace, the
        common case on one machine, has no split to show, and a hidden figure still costs the server its
        models and the browser their views at every page open)."""
        load = figure(title="Routed slots per expert-parallel rank", height=200, width=320, tools="",
                      toolbar_location=None, x_axis_label="EP rank", y_axis_label="slots",
                      x_range=Range1d(-0.5, 0.5), visible=False)
        load.vbar(x="rank", top="tokens", width=0.8, fill_color="colour", line_color=None, source=self.load_source)
        load.line(x="x", y="y", source=self.load_mean, line_color="#333", line_dash="dashed",
                  legend_label="even split (mean)")
        legend_above(load)
        load.xaxis.ticker = FixedTicker(ticks=[])
        return trim(load)

    def _routes(self, data: ExpertsData) -> None:
        if data.routes is None and "routes" not in self.__dict__:
            set_text(self.routes_note, "Select a token to see its routes.")
            return
        routes = data.routes or []
        experts, layers, weights = [], [], []
        for r in routes:
            experts += r["experts"]
            layers += [str(r["layer"])] * len(r["experts"])
            weights += r["weights"]
        w = np.asarray(weights, dtype=np.float64)
        if data.routes is not None and len(self.routes_box.objects) == 1:
            self.routes_box.objects = [self.routes, self.routes_note]
        self.routes.y_range.factors = [str(r["layer"]) for r in routes] if routes else ["-"]
        self.routes_source.data = {"expert": experts, "layer": layers, "weight": w,
                                   "size": 6 + 24 * np.sqrt(w) if len(w) else w}
        if data.routes is None:
            set_text(self.routes_note, "Select a token to see its routes.")
        elif not routes:
            set_text(self.routes_note, f"No routes recorded for position {self.state.position} (the default "
                     "policy keeps them for generated tokens and sampled windows).")
        else:
            mean_h = np.mean([r["entropy"] for r in routes])
            experts = data.heat.values.shape[1] if data.heat is not None and data.heat.values.ndim == 2 else 0
            uniform = f" (a uniform router over {experts} experts: ln {experts} = {np.log(experts):.2f} nats)" \
                if experts > 1 else ""
            set_text(self.routes_note, f"{len(routes)} MoE layers routed this token; mean router entropy "
                     f"{mean_h:.2f} nats{uniform}")

    def _load(self, data: ExpertsData) -> None:
        if data.rank_load is None:
            self.load_source.data = {"rank": [], "tokens": [], "colour": []}
            set_text(self.load_note, "no expert-parallel load recorded")
            return
        load = np.asarray(data.rank_load, np.float64)
        if len(load) <= 1:
            # one rank holds every expert: there is no split to be uneven, so no chart
            if "load" in self.__dict__:
                self.load.visible = False
            self.load_source.data = {"rank": [], "tokens": [], "colour": []}
            set_text(self.load_note, "1 expert-parallel rank holds all experts: no load to balance "
                     "(run with several ranks to see their split)")
            return
        hot = int(load.argmax())
        mean = load.mean()
        # the busiest rank is red only when it is above an even split
        self.load_source.data = {"rank": np.arange(len(load)), "tokens": load,
                                 "colour": ["#e45756" if i == hot and load[hot] > mean else "#4c78a8"
                                            for i in range(len(load))]}
        self.load_mean.data = {"x": [-0.5, len(load) - 0.5], "y": [mean, mean]}
        self.load.x_range.update(start=-0.5, end=len(load) - 0.5)
        self.load.xaxis.ticker.ticks = list(range(len(load)))
        self.load.visible = True
        if len(self.load_box.objects) == 1:
            self.load_box.objects = [self.load, self.load_note]
        worst = data.rank_worst
        note = f"busiest rank {hot}: {load[hot] / mean:.2f} x mean" if mean else ""
        if worst is not None:
            note += f"; most imbalanced layer {worst[0]}: {worst[1]:.2f} x mean"
        set_text(self.load_note, note)

    def __panel__(self) -> pn.viewable.Viewable:
        return pn.Card(
            self.controls, self.heat.figure, self.bars,
            pn.Row(self.routes_box, self.load_box), self.drawn_marker,
            title="Experts", sizing_mode="stretch_width", collapsible=False, css_classes=["k3-view-experts"])
