"""View 2, the DSA memory map: which context positions each DSA layer selects, and what it read for a token.

- heat map: DSA layers x context position, binned on the server to the screen width; colour =
  selections of keys in the bin on a log scale (from the trace's running sums, never per-token glyphs);
  the hover names the layer, the bin's key range, its count and what uniformly random top-k picks of
  the same queries would select there (chance) with the ratio;
- generated text: click a token (or type a position) to select a query;
- read-out: for the selected query, the same layers x position grid with only its selected keys,
  a per-layer table (keys, nearest / farthest read, share local, segment read most) with the text
  around the densest far reads (escaped, selected keys marked);
- image: the real picture of an image segment with the heat of what each layer read per merged patch,
  for the selected token or the whole answer, beside chance (`image_reads.ImageReadsPanel`).
"""

from __future__ import annotations

from functools import cached_property

import numpy as np
import panel as pn
import param
from bokeh.models import Span

from apps.dashboard.components.base import ViewComponent
from apps.dashboard.components.figures import HeatFigure, segment_starts
from apps.dashboard.components.image_reads import ImageReadsPanel
from apps.dashboard.components.panes import HTMLText, set_text, text_pane
from apps.dashboard.components.seen import ShownWhenSeen
from apps.dashboard.components.token_strip import TokenStrip, link_selection, strip_tokens
from workbench.analysis.views import DSAMapData, HeatMap, RecordingMapData


# the image panel's height in a 1400 px wide page (its placeholder keeps the page about as long)
IMAGE_CARD_PX = 460


class DSAMemoryMap(ViewComponent):
    """DSA selection heat map plus the per-token read-out of the selected generated token."""

    view = "dsa"
    show_segments = param.Boolean(default=True, doc="mark segment boundaries on the position axes")

    def __init__(self, shown_together: list[ShownWhenSeen] | None = None, **params) -> None:
        super().__init__(**params)
        # the places the image panel's place is shown with when any of them is seen (the dashboard's below the
        # first screen: `Dashboard.shown_together`)
        self.shown_together = shown_together if shown_together is not None else []
        self.heat = HeatFigure("How often each context range was selected (all queries so far; hover: beside chance)",
                               "keys", "DSA layer", "selections", palette="inferno", log_scale=True,
                               chance_label="chance (random top-k)")
        self.position_input = pn.widgets.IntInput.from_param(self.state.param.position, label="Query position",
                                                             width=160)
        self.strip = TokenStrip(sizing_mode="stretch_width", css_classes=["k3-dsa-tokens"])
        link_selection(self.strip, self.state)
        self.readout = HTMLText("<p>Select a generated token to see what each DSA layer read for it.</p>",
                                    sizing_mode="stretch_width", css_classes=["k3-dsa-readout"],
                                    stylesheets=[_READOUT_CSS])
        self.title = text_pane("", sizing_mode="stretch_width", css_classes=["k3-dsa-title"])
        # the image panel joins the page with the first frame that has an image segment, the read-out's
        # figure with the first selection: hidden, each still cost its models on the server and its
        # views in the browser at every page open (the image panel alone is ~40 models)
        self.image_box = pn.Column(sizing_mode="stretch_width", margin=0)
        self.detail = pn.Column(self.readout, sizing_mode="stretch_width")
        self.redraw()

    @cached_property
    def reads(self) -> HeatFigure:
        """The selected token's reads (built with the first selection, with the boundaries and marks shown now)."""
        reads = HeatFigure("What each layer read for the selected token", "key position", "DSA layer", "keys read",
                           height=200)
        reads.figure.add_layout(self.query_line)
        session = self.state.frame.session
        reads.set_boundaries(segment_starts(session.segments) if self.show_segments else [])
        reads.set_marks(session.marks)
        return reads

    @cached_property
    def query_line(self) -> Span:
        """The selected query's position on the reads figure."""
        return Span(location=0, dimension="height", line_color="#00e5ff", line_width=2, visible=False)

    @cached_property
    def image(self) -> ImageReadsPanel:
        """The image panel (built when the trace first shows an image segment)."""
        return ImageReadsPanel(on_image=lambda i: self.state.set_options(image_id=i))

    @cached_property
    def image_card(self) -> pn.Column:
        return pn.Column(pn.pane.Markdown("**What the DSA layers read in the image**", margin=(0, 10)),
                         self.image.controls, pn.Row(self.image.picture, pn.Column(
                             self.image.summary, self.image.layers_table, sizing_mode="stretch_width"),
                             sizing_mode="stretch_width"),
                         visible=False, sizing_mode="stretch_width", css_classes=["k3-dsa-image"])

    @cached_property
    def image_place(self) -> ShownWhenSeen:
        """The image panel's place: below the first screen, so it is built into the page when scrolled near."""
        return ShownWhenSeen(self.image_card, "dsa-image", IMAGE_CARD_PX, "What the DSA layers read in the image",
                             together=self.shown_together)

    def _show_detail(self, image: bool = False, reads: bool = False) -> None:
        """Add the image panel (its place until seen) and/or the read-out figure to the page (each once)."""
        if image and not self.image_box.objects:
            self.image_box.objects = [self.image_place]
        if reads and len(self.detail.objects) == 1:
            self.detail.objects = [self.reads.figure, self.readout]

    @param.depends("show_segments", watch=True)
    def _toggle_segments(self) -> None:
        self.redraw()

    def draw(self, data: DSAMapData, session: RecordingMapData, changed: set[str]) -> None:
        if {"heat", "heat_chance"} & changed:
            self.heat.update(data.heat, chance=data.heat_chance)
        if {"segments", "heat"} & changed:
            starts = segment_starts(session.segments) if self.show_segments else []
            self.heat.set_boundaries(starts)
            if "reads" in self.__dict__:
                self.reads.set_boundaries(starts)
        if "marks" in changed:
            self.heat.set_marks(session.marks)
            if "reads" in self.__dict__:
                self.reads.set_marks(session.marks)
        if "generated" in changed:
            self.strip.tokens = strip_tokens(session.generated)
        if "reads" in changed:
            self._show_reads(data, session)
        if "image" in changed and (data.image is not None or "image" in self.__dict__):
            self._show_detail(image=True)
            shown = self.image.data
            selected_now = data.image is not None and data.image.token is not None and (
                shown is None or shown.token_position != data.image.token_position)
            self.image.show(data.image, selected_now=selected_now)
            self.image_card.visible = data.image is not None

    def _show_reads(self, data: DSAMapData, session: RecordingMapData) -> None:
        reads = data.reads
        if reads is None:
            if "reads" in self.__dict__:
                self.reads.update(None)
                self.query_line.visible = False
            self.readout.object = "<p>Select a generated token to see what each DSA layer read for it.</p>"
            set_text(self.title, "")
            return
        self._show_detail(reads=True)
        # bins no key was read from are transparent, so the few read bins stand out
        counts = np.where(reads["heat"] > 0, reads["heat"], np.nan).astype(np.float32)
        heat = HeatMap(tuple(reads["layers"]), counts, 0.0, float(session.extent))
        self.reads.update(heat)
        self.query_line.location = reads["position"]
        self.query_line.visible = True
        piece = reads["piece"]
        # escaped on the server: a piece like "<script>" stays text
        set_text(self.title, f"token at position {reads['position']}: {piece!r}" if piece is not None else
                 f"position {reads['position']}")
        self.readout.object = data.reads_html

    def __panel__(self) -> pn.viewable.Viewable:
        return pn.Card(
            self.heat.figure,
            pn.pane.Markdown("**Generated text** — click a token to see what each layer read for it", margin=(0, 10)),
            self.strip,
            pn.Row(self.position_input, self.title, sizing_mode="stretch_width"),
            self.image_box, self.detail, self.drawn_marker,
            title="DSA memory map", sizing_mode="stretch_width", collapsible=False, css_classes=["k3-view-dsa"])


_READOUT_CSS = """
table.k3-reads { border-collapse: collapse; font-size: 12px; width: 100%; }
table.k3-reads td, table.k3-reads th { border-bottom: 1px solid #ddd; padding: 2px 6px; vertical-align: top; }
.k3-snippet { font-family: ui-monospace, monospace; white-space: pre-wrap; word-break: break-all; }
.k3-snippet mark { background: #ffd54f; }
.k3-at { color: #888; }
"""
