"""The image panel of the DSA memory map: the real picture with the heat of what DSA layers read per patch.

The picture is the trace's thumbnail at screen size (`reducers.image_reads`); over it, one cell per
merged patch (language-model token) coloured by how often the chosen layer (or all layers) selected
it, for the selected token or over the whole answer. Beside it: "patches read: 12 of 256, chance 4"
and the selections inside the image against chance, for the chosen layer and for each layer.
Switching layer or scope redraws from data already on the server (no new trace read). The figure's
colour bar is its legend; what is drawn (image, layer, queries) is a caption above it that wraps, since a
figure title is cut at the figure's width and a tall image's figure is narrow.
"""

from __future__ import annotations

import numpy as np
import panel as pn
import param
from bokeh.models import ColorBar, ColumnDataSource, HoverTool, LinearColorMapper, Range1d
from bokeh.palettes import Plasma256
from bokeh.plotting import figure

from workbench.analysis import PatchReads, format_patches

from apps.dashboard.components.figures import trim
from apps.dashboard.components.panes import HTMLText, set_text, text_pane
from workbench.analysis.views import ImageReadsData

ALL_LAYERS = "all layers"
TOKEN, ANSWER = "selected token", "whole answer"


class ImageReadsPanel(pn.viewable.Viewer):
    """Picture + per-patch read heat + chance read-out of one image segment (drawn from ImageReadsData)."""

    scope = param.Selector(default=ANSWER, objects=[ANSWER, TOKEN], doc="queries counted: the clicked token or the answer")
    layer = param.Selector(default=ALL_LAYERS, objects=[ALL_LAYERS], doc="DSA layer whose reads are drawn")
    image = param.Selector(default=None, objects=[], allow_None=True, doc="image segment shown ('id: name')")

    def __init__(self, on_image=None, **params) -> None:
        super().__init__(**params)
        self._on_image = on_image  # called with the chosen image's segment id
        self._image_ids: dict[str, int] = {}
        self._quiet = False  # set while the panel itself sets `image` (not a user's choice)
        self.data: ImageReadsData | None = None
        self.picture_source = ColumnDataSource({"image": [np.zeros((1, 1), np.uint32)], "x": [0.0], "y": [0.0],
                                                "dw": [1.0], "dh": [1.0]})
        self.heat_source = ColumnDataSource({"image": [np.full((1, 1), np.nan, np.float32)], "x": [0.0], "y": [0.0],
                                             "dw": [1.0], "dh": [1.0]})
        self.mapper = LinearColorMapper(palette=Plasma256, nan_color="rgba(0,0,0,0)", low=0)
        self.figure = figure(width=SIDE + LEGEND_PX, height=SIDE, tools="hover,save",
                             toolbar_location=None, x_range=Range1d(0, 1), y_range=Range1d(0, 1))
        self.figure.add_layout(ColorBar(color_mapper=self.mapper, width=8, title="selections per patch",
                                        title_text_font_size="10px", major_label_text_font_size="10px"), "right")
        self.figure.image_rgba(image="image", x="x", y="y", dw="dw", dh="dh", source=self.picture_source)
        heat = self.figure.image(image="image", x="x", y="y", dw="dw", dh="dh", source=self.heat_source,
                                 color_mapper=self.mapper, global_alpha=0.6)
        self.figure.select_one(HoverTool).update(renderers=[heat], tooltips=[("selections", "@image{0}")])
        self.figure.axis.visible = False
        self.figure.grid.visible = False
        trim(self.figure)
        self.summary = text_pane("", sizing_mode="stretch_width", css_classes=["k3-image-summary"])
        self.caption = text_pane("", width=SIDE + LEGEND_PX, css_classes=["k3-image-caption"])
        self.picture = pn.Column(self.caption, self.figure, margin=0)
        self.layers_table = HTMLText("", sizing_mode="stretch_width", css_classes=["k3-image-layers"],
                                         stylesheets=[_CSS])
        self.image_select = pn.widgets.Select.from_param(self.param.image, label="Image", width=160, visible=False)
        self.controls = pn.Row(
            self.image_select,
            pn.widgets.RadioButtonGroup.from_param(self.param.scope),
            pn.widgets.Select.from_param(self.param.layer, label="DSA layer", width=120))

    @param.depends("image", watch=True)
    def _image_changed(self) -> None:
        if not self._quiet and self._on_image is not None and self.image in self._image_ids:
            self._on_image(self._image_ids[self.image])

    @param.depends("scope", "layer", watch=True)
    def _choice_changed(self) -> None:
        self._draw_reads()

    def reads(self) -> PatchReads | None:
        """The reads drawn now (the selected token's or the answer's)."""
        if self.data is None:
            return None
        return self.data.token if self.scope == TOKEN else self.data.answer

    def chosen_layer(self) -> int | None:
        return None if self.layer == ALL_LAYERS else int(self.layer.split()[-1])

    def show(self, data: ImageReadsData | None, selected_now: bool = False) -> None:
        """Draw `data` (None: no image in the session); `selected_now` switches to the clicked token."""
        self.data = data
        if data is None:
            return
        labels = {f"{i}: {name}": i for i, name in data.images}
        if labels != self._image_ids:
            self._image_ids = labels
            self.param.image.objects = list(labels)
            self.image_select.visible = len(labels) > 1
        current = next(k for k, v in labels.items() if v == data.image_id)
        if self.image != current:
            self._quiet = True
            try:
                self.image = current
            finally:
                self._quiet = False
        layers = sorted({*(data.answer.layers if data.answer else ()), *(data.token.layers if data.token else ())})
        options = [ALL_LAYERS, *(f"layer {l}" for l in layers)]
        if options != self.param.layer.objects:
            self.param.layer.objects = options
            if self.layer not in options:
                with param.discard_events(self):
                    self.layer = ALL_LAYERS
        rows, cols = data.grid
        for fig_range, end in ((self.figure.x_range, cols), (self.figure.y_range, rows)):
            fig_range.update(start=0, end=max(end, 1))
        # keep the figure's aspect the image's, inside a SIDE x SIDE box
        scale = SIDE / max(rows, cols, 1)
        self.figure.width, self.figure.height = max(int(cols * scale), 60) + LEGEND_PX, max(int(rows * scale), 60)
        if data.picture is not None:
            w, h = data.covers
            self.picture_source.data = {"image": [data.picture], "x": [0.0], "y": [rows - h], "dw": [w], "dh": [h]}
        else:
            self.picture_source.data = {"image": [np.zeros((1, 1), np.uint32)], "x": [0.0], "y": [0.0],
                                        "dw": [1.0], "dh": [1.0]}
        if selected_now and data.token is not None and self.scope != TOKEN:
            self.scope = TOKEN  # redraws through _choice_changed
            return
        self._draw_reads()

    def _draw_reads(self) -> None:
        data = self.data
        if data is None:
            return
        reads = self.reads()
        rows, cols = data.grid
        what = (f"token at position {data.token_position}" if self.scope == TOKEN else
                f"answer, queries {data.answer_range[0]}..{data.answer_range[1]}" if data.answer_range else "answer")
        problem = f"\n(picture not shown: {data.problem})" if data.problem else ""
        if reads is None or not reads.layers:
            self.heat_source.data = {"image": [np.full((1, 1), np.nan, np.float32)], "x": [0.0], "y": [0.0],
                                     "dw": [1.0], "dh": [1.0]}
            hint = ("click a generated token to see what it read" if self.scope == TOKEN and data.token is None else
                    "no top-k lists recorded for these queries")
            set_text(self.summary, f"{data.name} ({cols}x{rows} patches): {hint}{problem}")
            self.layers_table.object = ""
            set_text(self.caption, f"{data.name}: patches read")
            return
        layer = self.chosen_layer()
        grid = reads.grid_of(layer).astype(np.float32)
        shown = np.where(grid > 0, grid, np.nan)[::-1]  # row 0 at the top
        self.mapper.high = float(max(grid.max(), 1))
        self.heat_source.data = {"image": [np.ascontiguousarray(shown)], "x": [0.0], "y": [0.0],
                                 "dw": [float(cols)], "dh": [float(rows)]}
        summary = reads.summary(layer)
        who = "all DSA layers" if layer is None else f"DSA layer {layer}"
        set_text(self.caption, f"{data.name}: {who}, {self.scope} (uncoloured patches: not read)")
        set_text(self.summary, f"{who}, {what} ({summary['queries']} query rows):\n{format_patches(summary)}{problem}")
        self.layers_table.object = layers_html(reads)


def layers_html(reads: PatchReads) -> str:
    """Per-layer table: patches read beside chance, selections in the image beside chance."""
    body = []
    for l in reads.layers:
        s = reads.summary(l)
        ratio = s["selections"] / s["expected_selections"] if s["expected_selections"] > 0 else float("nan")
        body.append(f"<tr><td>{l}</td><td>{s['patches_read']} of {s['patches']}</td><td>{s['chance_patches']:.3g}</td>"
                    f"<td>{s['selections']}</td><td>{s['expected_selections']:.3g}</td><td>{ratio:.1f}x</td></tr>")
    return ("<table class='k3-image-layers'><tr><th>layer</th><th>patches read</th><th>chance</th>"
            "<th>selections in image</th><th>chance</th><th>ratio</th></tr>" + "".join(body) + "</table>")


SIDE = 320
LEGEND_PX = 80  # the colour bar beside the picture

_CSS = """
table.k3-image-layers { border-collapse: collapse; font-size: 12px; }
table.k3-image-layers td, table.k3-image-layers th { border-bottom: 1px solid #ddd; padding: 2px 6px; text-align: right; }
"""
