"""Bokeh building blocks shared by the views: a layer x position heat map that is redrawn in place.

A heat map is one `image` glyph fed a [rows, bins] float32 array (sent as binary), never one glyph
per token; segment boundaries are `vspan`s from a small source. Updating replaces the source data
of the existing models, so a live refresh sends a few kB and the browser keeps one set of objects.

`trim(figure)` drops the models a figure carries but the views never show (hidden grids, the glyph
copies drawn for "not selected" and "muted"): every Bokeh model costs the server time to build and
serialise and the browser time to build a view of, on every page open.
"""

from __future__ import annotations

import numpy as np
from bokeh.models import (Axis, ColorBar, ColumnDataSource, CustomJSHover, FixedTicker, GlyphRenderer, Grid, HoverTool,
                          Image, LinearColorMapper, LogColorMapper, NumeralTickFormatter, Range1d, VSpan, VStrip)
from bokeh.palettes import Inferno256, Viridis256
from bokeh.plotting import figure

from workbench.analysis.views import HeatMap

SEGMENT_COLOURS = {"document": "#4c78a8", "turn": "#f58518", "image": "#54a24b", "generated": "#e45756"}


class HeatFigure:
    """A heat map figure (rows = layers or heads) with optional segment boundaries.

    Args:
        title (str): figure title.
        x_label (str), y_label (str): axis labels.
        value_label (str): what the colour means (hover and colour bar).
        palette (str): "viridis" or "inferno".
        height (int): pixel height.
        log_scale (bool): colour on a log scale (counts spanning orders of magnitude); zeros get the
            palette's darkest colour, below the lowest count shown.
        chance_label (str, Optional): the hover also shows, per column, the value `update(..., chance=)`
            gives (what uniformly random picks would give there) beside the cell's value and their ratio.

    The hover names the row by its label (a layer id, not the row index) and the cell's x range.
    """

    def __init__(self, title: str, x_label: str, y_label: str, value_label: str, palette: str = "viridis",
                 height: int = 260, log_scale: bool = False, chance_label: str | None = None) -> None:
        self.source = ColumnDataSource(self._empty_data())
        self.bounds = ColumnDataSource({"x": []})
        colours = Inferno256 if palette == "inferno" else Viridis256
        if log_scale:
            # the darkest eighth is kept for empty cells, so a cell read once never looks unread
            # low/high are set from each update's counts (a log scale cannot start at a bin that was never read)
            self.mapper = LogColorMapper(palette=colours[32:], low_color=colours[0], nan_color="rgba(0,0,0,0)",
                                         low=1.0, high=10.0)
        else:
            self.mapper = LinearColorMapper(palette=colours, nan_color="rgba(0,0,0,0)")
        self.log_scale = log_scale
        # the linear range this figure last chose itself; a view that fixes its own (0..1) is left alone
        self._auto_range: tuple[float | None, float | None] = (None, None)
        self.figure = figure(title=title, height=height, sizing_mode="stretch_width", x_range=Range1d(0, 1),
                             y_range=Range1d(-0.5, 0.5), tools="xpan,xwheel_zoom,reset,save",
                             toolbar_location="above", x_axis_label=x_label, y_axis_label=y_label)
        # glyphs added as models (not through figure.image & co., which build and then drop two copies each)
        self.glyph = self.figure.add_glyph(self.source, Image(image="image", x="x", y="y", dw="dw", dh="dh",
                                                              color_mapper=self.mapper))
        self.figure.add_glyph(self.bounds, VSpan(x="x", line_color="white", line_alpha=0.7, line_dash="dashed"))
        self.marks = ColumnDataSource({"x0": [], "x1": [], "label": []})
        self.figure.add_glyph(self.marks, VStrip(x0="x0", x1="x1", fill_color="#00e5ff", fill_alpha=0.25,
                                                 line_color="#00e5ff", line_width=1.5))
        self.row_names = CustomJSHover(args={"labels": []}, code=_ROW_LABEL_JS)
        tooltips = [(y_label, "$y{custom}"), (x_label, "$x{custom}"), (value_label, "@image{0,0.[00]}")]
        formatters = {"$y": self.row_names, "$x": CustomJSHover(args={"source": self.source}, code=_CELL_RANGE_JS)}
        if chance_label:
            # the chance column rides on a second special variable: a field takes one formatter, and $x has one
            tooltips.append((chance_label, "$sx{custom}"))
            formatters["$sx"] = CustomJSHover(args={"source": self.source}, code=_CHANCE_JS)
        self.figure.add_tools(HoverTool(renderers=[self.glyph], tooltips=tooltips, formatters=formatters))
        self.figure.add_layout(ColorBar(color_mapper=self.mapper, width=8, title=value_label), "right")
        self.figure.grid.visible = False
        self.figure.xaxis.formatter = position_format()
        # one ticker whose ticks change: a new ticker model per update would re-index the whole document
        self.row_ticks = FixedTicker(ticks=[])
        self.figure.yaxis.ticker = self.row_ticks
        trim(self.figure)
        self.rows: tuple[int, ...] = ()

    @staticmethod
    def _empty_data(values: np.ndarray | None = None) -> dict:
        # nothing yet is NaN (transparent), not a zero cell that paints the whole plot the palette's darkest
        return {"image": [values if values is not None else np.full((1, 1), np.nan, np.float32)], "x": [0.0], "y": [-0.5],
                "dw": [1.0], "dh": [1.0], "chance": [[]]}

    def update(self, heat: HeatMap | None, row_labels: list[str] | None = None,
               chance: np.ndarray | None = None) -> None:
        """Show `heat` (rows x bins) in place; `row_labels` name the rows (default: heat.rows); `chance`
        [bins] is what uniformly random picks would give in each column (the hover shows it)."""
        if heat is None or heat.values.size == 0:
            self.source.data = self._empty_data(np.full((1, 1), np.nan, np.float32))
            return
        n = len(heat.rows)
        values = np.ascontiguousarray(heat.values, dtype=np.float32)
        if self.log_scale or (self.mapper.low, self.mapper.high) == self._auto_range:  # not fixed by the view
            auto = colour_range(values, self.log_scale)
            self.mapper.update(**auto)
            self._auto_range = (auto["low"], auto["high"])
        self.source.data = {"image": [values], "x": [heat.x0], "y": [-0.5], "dw": [heat.x1 - heat.x0],
                            "dh": [float(n)],
                            "chance": [_chance_column(chance)]}
        self.figure.x_range.update(start=heat.x0, end=heat.x1)
        if heat.rows != self.rows:
            self.rows = heat.rows
            labels = row_labels or [str(r) for r in heat.rows]
            self.row_names.args = {"labels": labels}
            step = max(1, n // 16)  # at most ~16 labels, so 69 or 92 layers stay readable
            ticks = list(range(0, n, step))
            self.row_ticks.ticks = ticks
            self.figure.yaxis.major_label_overrides = {t: labels[t] for t in ticks}
            self.figure.y_range.update(start=-0.5, end=n - 0.5)

    def set_marks(self, marks: tuple[tuple[int, int, str], ...]) -> None:
        """Shade marked position ranges (e.g. the planted needle), at least one pixel-ish wide."""
        self.marks.data = {"x0": [a for a, _, _ in marks], "x1": [b for _, b, _ in marks],
                           "label": [label for _, _, label in marks]}

    def set_boundaries(self, positions: list[int]) -> None:
        """Mark segment starts (dashed vertical lines)."""
        if list(self.bounds.data.get("x", [])) != positions:
            self.bounds.data = {"x": positions}


# a colour scale spans at least this: a near-uniform map (a short session's few stored bins spread over
# the screen's columns, all about 8.73) would otherwise stretch 8.7280-8.7288 over the whole palette
MIN_LOG_DECADES = 1.0
MIN_LINEAR_SPAN = 1e-3  # relative to the largest magnitude


def colour_range(values: np.ndarray, log_scale: bool) -> dict:
    """The colour mapper's low/high for `values`: a log scale from the smallest count shown to the largest,
    over at least `MIN_LOG_DECADES`; a linear scale automatic (None, None) unless it would be degenerate."""
    finite = values[np.isfinite(values)]
    if log_scale:
        shown = finite[finite > 0]
        high = float(shown.max()) if shown.size else 10.0
        low = float(shown.min()) if shown.size else 1.0
        return {"low": min(low, high / 10.0 ** MIN_LOG_DECADES), "high": high}
    if not finite.size:
        return {"low": None, "high": None}
    low, high = float(finite.min()), float(finite.max())
    if high - low >= MIN_LINEAR_SPAN * max(abs(low), abs(high), 1e-12):
        return {"low": None, "high": None}
    low, high = min(low, 0.0), max(high, 0.0)  # a constant map: from zero to its value
    return {"low": low, "high": high if high > low else low + 1.0}


def _chance_column(chance: np.ndarray | None) -> np.ndarray | list:
    """The chance row as the source sends it: float32, and an empty one as a plain list (no zero-byte buffer)."""
    if chance is None or len(chance) == 0:
        return []
    return np.ascontiguousarray(chance, dtype=np.float32)


# hover formatters (run in the browser). `special_vars.image_index` is the hovered cell: i its column, j its
# row counted from the bottom, which is the order the rows are drawn in
_ROW_LABEL_JS = """
const at = special_vars.image_index;
return at == null ? "" : String(labels[at.j] ?? "");
"""
_CELL_RANGE_JS = """
const at = special_vars.image_index;
const d = source.data;
const img = d.image[0];
const n = img.shape ? img.shape[img.shape.length - 1] : 1;
if (at == null || !n) { return ""; }
const w = d.dw[0] / n, a = d.x[0] + at.i * w;
const fmt = (v) => Math.round(v).toLocaleString("en-US");
return fmt(a) + " – " + fmt(a + w) + " (one of " + n + " columns)";
"""
_CHANCE_JS = """
const at = special_vars.image_index;
const d = source.data;
const chance = d.chance[0];
if (at == null || chance == null || at.i >= chance.length) { return "n/a"; }
const img = d.image[0];
const count = img[at.flat_index];
const c = chance[at.i];
const ratio = c > 0 && Number.isFinite(count) ? (count / c).toFixed(1) + "x" : "n/a";
const shown = c >= 100 ? Math.round(c).toLocaleString("en-US") : c.toPrecision(3);
return shown + " (observed / chance " + ratio + ")";
"""


def lean(renderer: GlyphRenderer) -> GlyphRenderer:
    """`renderer` without its own copies of the glyph for "not selected" and "muted" (no view selects or
    mutes anything; BokehJS derives them itself when asked: "auto"): two models fewer per renderer."""
    renderer.nonselection_glyph = "auto"
    renderer.muted_glyph = "auto"
    return renderer


def trim(fig: figure) -> figure:
    """`fig` with lean renderers and without hidden grids and axes (hidden, each is still a few models
    to send and build: ticker, formatter, labels)."""
    for renderer in fig.renderers:
        if isinstance(renderer, GlyphRenderer):
            lean(renderer)
    fig.center = [c for c in fig.center if not (isinstance(c, Grid) and not c.visible)]
    used = {id(c.axis) for c in fig.center if isinstance(c, Grid)}
    for side in ("left", "right", "above", "below"):
        kept = [a for a in getattr(fig, side) if not (isinstance(a, Axis) and not a.visible and id(a) not in used)]
        if len(kept) != len(getattr(fig, side)):
            setattr(fig, side, kept)
    return fig


def legend_above(fig: figure) -> figure:
    """Move `fig`'s legend out of the plot area to a row above it: a legend inside covers the glyphs
    under it (the last experts' bars), whatever corner it is put in."""
    for legend in list(fig.legend):
        fig.center = [c for c in fig.center if c is not legend]
        legend.update(orientation="horizontal", location="top_left", label_text_font_size="10px", glyph_height=10,
                      glyph_width=14, padding=2, spacing=8, margin=0, border_line_alpha=0)
        fig.add_layout(legend, "above")
    return fig


def position_format() -> NumeralTickFormatter:
    """131072 -> "131.1k": positions stay readable at any length (a new model per figure: Bokeh models
    belong to one document, i.e. one browser session)."""
    return NumeralTickFormatter(format="0.[0]a")


def segment_starts(segments: tuple[dict, ...]) -> list[int]:
    """Start positions of every segment but the first (the boundaries worth marking)."""
    return sorted({int(s["start"]) for s in segments if int(s["start"]) > 0})
