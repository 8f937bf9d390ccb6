"""The attribution view: which spans of the context the answer came from, beside what the DSA layers read.

Left, the trace's attribution (`workbench.attribute`, written by drive mode's "Attribute"): the LDS
with its meaning, the top spans with their verdicts in words, and the context's text with each span
shaded by its effect (red: hiding it lowered the answer's log-probability, blue: raised it; scaled to
the largest effect; spans checked one by one outlined; spans no DSA layer read plain). A span's
tooltip gives its effect, its controls' range and count, its rank and p-value and its verdict. At long
contexts only windows around the top spans are sent (`attribution_view.text_pieces`). Right, the DSA
memory map of the same positions (the DSA view's own heat, layers x position) with the checked spans
marked: "read" beside "depended on". Clicking a span marks it there, zooms the map to it and, in drive
mode, sets the What-if range to it.
"""

from __future__ import annotations

import html
import math
from typing import Any, Callable

import numpy as np
import panel as pn
import param
from bokeh.models import ColumnDataSource, HoverTool, Quad, Range1d, Scatter, Span
from bokeh.plotting import figure
from panel.custom import JSComponent

from apps.dashboard.components.base import ViewComponent
from apps.dashboard.components.figures import HeatFigure, position_format, trim
from apps.dashboard.components.panes import HTMLText, html_table, set_text, text_pane
from workbench.analysis.causal import MIN_EFFECT_NATS
from workbench.analysis.views.attribution_view import (CONTEXT_SPANS, MAX_CONTEXT_SPANS, AttributionData, Piece,
                                                       SpanRow, SpanTrack)

TEXT_HEIGHT = 420  # pixels: the text scrolls inside, so the page does not grow with the context


def piece_rows(pieces: tuple[Piece, ...]) -> list[list]:
    """`SpanText.pieces` rows: [kind, start, end, text, shade, source, tooltip, hidden]."""
    rows = []
    for p in pieces:
        if p.kind == "span" and p.row is not None:
            r = p.row
            rows.append(["span", r.start, r.end, r.text, round(r.shade, 3), r.source, r.tooltip, 0])
        elif p.kind == "heading":
            rows.append(["heading", p.start, p.end, p.heading, 0.0, "", "", 0])
        else:
            rows.append(["more", p.start, p.end, "", 0.0, "", "", p.hidden])
    return rows


class SpanText(JSComponent):
    """The context's text as clickable spans shaded by effect (text and tooltips set as text, never HTML)."""

    pieces = param.List(default=[], doc="[[kind, start, end, text, shade, source, tooltip, hidden], ...]: "
                                        "kind 'span' (shade in [-1, 1]), 'heading' (a segment's name) or 'more' "
                                        "(`hidden` spans over [start, end) not sent)")
    selected = param.List(default=None, allow_None=True, doc="[start, end] of the clicked span (None: none)")
    placeholder = param.String(default="(no attribution yet)")

    def __init__(self, **params: Any) -> None:
        params.setdefault("height", TEXT_HEIGHT)  # fixed: a text that grew with its content would relayout the page
        super().__init__(**params)

    _esm = """
export function render({ model, el }) {
  const sheet = document.createElement('style');
  sheet.textContent = '.k3-attr-text { font-family: ui-serif, Georgia, serif; font-size: 14px; line-height: 1.8;' +
    ' white-space: pre-wrap; overflow-wrap: anywhere; overflow-y: auto; height: 100%; padding: 6px;' +
    ' width: 100%; box-sizing: border-box; contain: content; }' +
    ' .k3-attr-span { cursor: pointer; border-radius: 3px; padding: 1px 0; }' +
    ' .k3-attr-span.k3-checked { outline: 2px solid #333; outline-offset: 1px; }' +
    ' .k3-attr-span.k3-unread { color: #777; }' +
    ' .k3-attr-span.k3-selected { box-shadow: 0 0 0 3px #00e5ff; }' +
    ' .k3-attr-tag { color: #aaa; font: 10px ui-monospace, monospace; }' +
    ' .k3-attr-heading { display: block; font: bold 12px ui-sans-serif, sans-serif; color: #555; margin: 6px 0 2px; }' +
    ' .k3-attr-more { display: block; font: italic 12px ui-sans-serif, sans-serif; color: #888; margin: 4px 0;' +
    ' text-align: center; }';
  const box = document.createElement('div');
  box.className = 'k3-attr-text';
  el.append(sheet, box);
  let shown = null;
  const TAG = /(<\\|[A-Za-z0-9_:\\-]{1,40}\\|>)/;
  // an estimate (the surrogate's, unchecked) is drawn at half strength: it is a guess, a checked effect is measured
  const colour = (shade, source) => {
    if (!shade) { return ''; }
    const a = Math.min(1, Math.abs(shade)) * (source === 'checked' ? 0.8 : 0.4);
    return shade < 0 ? `rgba(214,39,40,${a.toFixed(2)})` : `rgba(31,119,180,${a.toFixed(2)})`;
  };
  const paint = () => {
    if (shown !== null) { shown.classList.remove('k3-selected'); shown = null; }
    const sel = model.selected;
    if (!sel) { return; }
    for (const s of box.querySelectorAll('.k3-attr-span')) {
      if (Number(s.dataset.start) === sel[0] && Number(s.dataset.end) === sel[1]) {
        shown = s; s.classList.add('k3-selected'); break;
      }
    }
  };
  box.onclick = (event) => {
    const s = event.target.closest('.k3-attr-span');
    if (s) { model.selected = [Number(s.dataset.start), Number(s.dataset.end)]; paint(); }
  };
  const draw = () => {
    const pieces = model.pieces;
    const out = document.createDocumentFragment();
    if (!pieces.length) {
      const p = document.createElement('i');
      p.textContent = model.placeholder;
      out.append(p);
    }
    for (const [kind, start, end, text, shade, source, tooltip, hidden] of pieces) {
      const s = document.createElement('span');
      if (kind === 'span') {
        // checked: outlined; estimated: shaded faint; unread and anything else (no effect known): plain
        s.className = 'k3-attr-span' + (source === 'checked' ? ' k3-checked' : source === 'estimated' ? '' : ' k3-unread');
        s.dataset.start = start; s.dataset.end = end; s.dataset.source = source;
        const bg = source === 'checked' || source === 'estimated' ? colour(shade, source) : '';
        if (bg) { s.style.background = bg; }
        s.title = tooltip;        // a property: text, never parsed as HTML
        // the chat format's control tags (<|open|>, <|sep|>, ...) in small grey, so the sentence reads as text
        text.split(TAG).forEach((part, i) => {
          if (!part) { return; }
          if (i % 2) {
            const t = document.createElement('span');
            t.className = 'k3-attr-tag';
            t.textContent = part;
            s.append(t);
          } else { s.append(document.createTextNode(part)); }
        });
      } else if (kind === 'heading') {
        s.className = 'k3-attr-heading';
        s.textContent = text;
      } else {
        s.className = 'k3-attr-more';
        s.textContent = `⋯ ${hidden.toLocaleString('en-US')} more spans (tokens ${start.toLocaleString('en-US')}` +
          `–${end.toLocaleString('en-US')}), not shown ⋯`;
      }
      out.append(s);
    }
    box.replaceChildren(out);
    shown = null;
    paint();
  };
  draw();
  model.on('pieces', draw);
  model.on('selected', paint);
}
"""


_DROP, _RISE, _READ = "#d62728", "#1f77b4", "#9e9e9e"


def track_data(track: SpanTrack | None) -> dict:
    """The span track's columns: per span a grey bar above the axis (its share of the most-read span's DSA
    reads by the answer) and a bar below it (|effect| over the scale; red a drop, blue a rise, faint an
    estimate, none unread)."""
    if track is None or not len(track.start):
        return {k: [] for k in ("left", "right", "read", "effect", "colour", "alpha", "reads", "nats", "source")}
    share = track.reads / max(int(track.reads.max()), 1)
    colour = np.where(track.shade < 0, _DROP, _RISE)
    alpha = np.array([0.9 if s == "checked" else 0.45 if s == "estimated" else 0.0 for s in track.source])
    return {"left": track.start.astype(np.float64), "right": track.end.astype(np.float64),
            "read": share.astype(np.float64), "effect": -np.abs(track.shade).astype(np.float64),
            "colour": colour.tolist(), "alpha": alpha, "reads": track.reads, "nats": track.effect.astype(np.float64),
            "source": list(track.source)}


def checked_marks(track: SpanTrack | None) -> dict:
    """A marker under each checked span (at its effect's depth): at 128K a sentence is narrower than a pixel,
    so its bar alone would vanish from the zoomed-out track."""
    if track is None:
        return {"x": [], "y": [], "colour": [], "left": [], "right": [], "reads": [], "nats": [], "source": []}
    keep = np.array([s == "checked" for s in track.source], bool)
    shade = track.shade[keep].astype(np.float64)
    return {"x": ((track.start[keep] + track.end[keep]) / 2).astype(np.float64),
            "y": -np.maximum(np.abs(shade), 0.05), "colour": np.where(shade < 0, _DROP, _RISE).tolist(),
            "left": track.start[keep].astype(np.float64), "right": track.end[keep].astype(np.float64),
            "reads": track.reads[keep], "nats": track.effect[keep].astype(np.float64),
            "source": ["checked"] * int(keep.sum())}


def _fmt(value: float | None, spec: str = "+.3f") -> str:
    return "" if value is None or not math.isfinite(value) else format(value, spec)


def top_table(rows: tuple[SpanRow, ...]) -> str:
    """The top spans as an escaped HTML table: where, text, effect, controls, rank / p, reads, verdict."""
    cells = []
    for r in rows:
        controls = (f"{_fmt(r.control_min)} to {_fmt(r.control_max)} ({r.controls})" if r.controls else
                    "none (estimated)" if r.source == "estimated" else "none")
        rank = (f"{r.rank} of {r.controls + 1}, p = {r.p_value:.2f}" if r.rank is not None and r.p_value is not None
                else "")
        verdict = r.verdict if r.source == "checked" else f"estimated by the surrogate: {r.verdict}"
        cells.append([html.escape(f"{r.start:,}–{r.end:,}"), html.escape(r.text), html.escape(f"{r.effect:+.3f}"),
                      html.escape(controls), html.escape(rank), html.escape(f"{r.reads:,}"),
                      f"<span class='k3-attr-verdict k3-{html.escape(r.source)}'>{html.escape(verdict)}</span>"])
    return html_table("k3-attr-top", ["tokens", "text", "effect (nats)", "controls (count)", "rank, p",
                                      "read by the answer", "verdict"], cells)


def pick_in_what_if(what_if: Any, start: int, end: int) -> None:
    """Set drive mode's What-if range to [start, end) (as the map selections' range buttons do)."""
    if what_if is None:
        return
    what_if.positions = f"{start}:{end}"
    objects = what_if.param.segment.objects
    ranges = [o for o in objects if str(o).startswith("a range of positions")]
    if ranges:
        what_if.segment = ranges[0]


class AttributionView(ViewComponent):
    """Which spans the answer came from (shaded text, top spans, LDS) beside the DSA map of the same positions."""

    view = "attribution"
    context = param.Integer(default=CONTEXT_SPANS, bounds=(0, MAX_CONTEXT_SPANS),
                            doc="spans shown on each side of a top span (long contexts)")

    def __init__(self, on_pick: Callable[[int, int], None] | None = None, **params: Any) -> None:
        super().__init__(**params)
        self._on_pick = on_pick  # told the clicked span's range (drive mode: the What-if range)
        self.summary = text_pane("no attribution yet", sizing_mode="stretch_width", css_classes=["k3-attr-summary"])
        self.lds = HTMLText("", sizing_mode="stretch_width", css_classes=["k3-attr-lds"])
        self.top = HTMLText("", sizing_mode="stretch_width", css_classes=["k3-attr-top"])
        self.text = SpanText(sizing_mode="stretch_width", css_classes=["k3-attr-spans"])
        self.text.param.watch(self._picked, "selected")
        self.picked = text_pane("", sizing_mode="stretch_width", css_classes=["k3-attr-picked"])
        self.heat = HeatFigure("What the DSA layers read (all queries) · checked spans marked", "key position",
                               "DSA layer", "selections", palette="inferno", log_scale=True,
                               chance_label="chance (random top-k)", height=300)
        # per span, along the same positions (the x range is shared): read by the answer above, effect below
        self.track_source = ColumnDataSource(track_data(None))
        self.track = figure(title="Per span: read by the answer (grey) · effect (below: red drop, blue rise)",
                            height=170, sizing_mode="stretch_width",
                            x_range=self.heat.figure.x_range, y_range=Range1d(-1.05, 1.05), tools="xpan,xwheel_zoom,reset",
                            toolbar_location="above", x_axis_label="key position")
        reads = self.track.add_glyph(self.track_source, Quad(left="left", right="right", bottom=0, top="read",
                                                             fill_color=_READ, line_color=None))
        effects = self.track.add_glyph(self.track_source, Quad(left="left", right="right", bottom="effect", top=0,
                                                               fill_color="colour", fill_alpha="alpha", line_color=None))
        self.checked_source = ColumnDataSource(checked_marks(None))
        checked = self.track.add_glyph(self.checked_source, Scatter(x="x", y="y", marker="inverted_triangle", size=10,
                                                                    fill_color="colour", line_color="#333"))
        self.track.add_layout(Span(location=0, dimension="width", line_color="#555", line_width=1))
        self.track.add_tools(HoverTool(renderers=[reads, effects, checked], tooltips=[
            ("tokens", "@left{0,0}–@right{0,0}"), ("read by the answer", "@reads{0,0} selections"),
            ("effect", "@nats{+0.000} nats (@source)")]))
        self.track.xaxis.formatter = position_format()
        self.track.yaxis.visible = False
        self.track.grid.visible = False
        trim(self.track)
        self._heat_shown: Any = None
        self._marks: tuple[tuple[int, int, str], ...] = ()
        self.redraw()

    def has_data(self, data: AttributionData, session: object) -> bool:
        return data is not None and bool(data.pieces)

    def draw(self, data: AttributionData, session: Any, changed: set[str]) -> None:
        if data is None:
            return
        if data.note:
            set_text(self.summary, data.note)
            self.lds.object = ""
            self.top.object = ""
            self.text.pieces = []
            self.track_source.data = track_data(None)
            self.checked_source.data = checked_marks(None)
            self._set_marks(())
            return
        if {"check", "summary", "notes", "shown", "spans"} & changed:
            shown = (f"; {data.shown:,} of {data.spans:,} spans shown (windows of {self.context} around the top "
                     "ones)" if data.shown < data.spans else "")
            set_text(self.summary, f"{data.check}: {data.summary}{shown}"
                     + "".join(f"\nnote: {n}" for n in data.notes))
        if {"lds_line", "trusted"} & changed:
            colour = "#1b5e20" if data.trusted else "#b45309"
            self.lds.object = (f"<div style='font-size:15px;font-weight:600;color:{colour}'>"
                               f"{html.escape(data.lds_line)}</div><div style='font-size:12px;color:#555'>Shading: "
                               f"the change of the answer's log-probability with the span hidden from every DSA layer, "
                               f"red = fell, blue = rose, full colour = {data.scale:.3f} nats "
                               f"({'the largest checked effect' if data.marks else 'the largest estimate'}, at least "
                               f"{MIN_EFFECT_NATS} nats: a smaller change is too small to matter); "
                               f"outlined = checked one by one beside same-size random controls; faint = the "
                               f"surrogate's estimate, unchecked; plain = never read while answering (or kept in every mask: "
                               f"no effect known). "
                               f"Click a span to mark it on the DSA map"
                               f"{' and set the What-if range' if self._on_pick else ''}.</div>")
        if "top" in changed:
            self.top.object = top_table(data.top)
        if "pieces" in changed:
            self.text.pieces = piece_rows(data.pieces)
        if "marks" in changed:
            self._set_marks(data.marks)
        if "track" in changed:
            self.track_source.data = track_data(data.track)
            self.checked_source.data = checked_marks(data.track)
            if self._heat_shown is None:  # no DSA heat (yet): the shared axis spans the context
                self.heat.figure.x_range.update(start=0, end=max(data.extent, 1))
        self._sync_heat()

    def _set_marks(self, marks: tuple[tuple[int, int, str], ...]) -> None:
        self._marks = marks
        selected = self.text.selected
        extra = ((int(selected[0]), int(selected[1]), "selected"),) if selected else ()
        self.heat.set_marks(marks + extra)

    @param.depends("state.frame", watch=True)
    def _sync_heat(self) -> None:
        """Show the DSA view's heat (reduced once, for both views) when it is new."""
        dsa = self.state.frame.view("dsa")
        heat = getattr(dsa, "heat", None)
        if heat is not None and heat is not self._heat_shown:
            self._heat_shown = heat
            self.heat.update(heat, chance=getattr(dsa, "heat_chance", None))

    def _picked(self, event: param.parameterized.Event) -> None:
        if not event.new:
            return
        start, end = int(event.new[0]), int(event.new[1])
        self._set_marks(self._marks)
        pad = max(32, (end - start) * 4)
        self.heat.figure.x_range.update(start=max(0, start - pad), end=end + pad)
        set_text(self.picked, f"selected tokens {start:,}–{end:,}: marked on the DSA map (zoomed to it; reset with "
                              f"the map's reset tool)" + ("; What-if range set to it" if self._on_pick else ""))
        if self._on_pick is not None:
            self._on_pick(start, end)

    @param.depends("context", watch=True)
    def _context_changed(self) -> None:
        self.state.set_options(attribution_context=self.context)

    def __panel__(self) -> pn.viewable.Viewable:
        left = pn.Column(self.lds, self.top,
                         pn.widgets.IntInput.from_param(self.param.context, label="Spans around each top span",
                                                        width=200),
                         self.text, self.picked, sizing_mode="stretch_width")
        right = pn.Column(self.heat.figure, self.track, sizing_mode="stretch_width")
        return pn.Card(self.summary, pn.Row(left, right, sizing_mode="stretch_width"), self.drawn_marker,
                       title="Attribution: which spans the answer depended on, beside what DSA read",
                       sizing_mode="stretch_width", collapsible=False, css_classes=["k3-view-attribution"])
