"""View 1, the session map: the context as a strip of segments, prefill progress, the generated text.

- segments strip: one bar per document, turn, image and generated run, width = its token count
  (names escaped: Bokeh tooltips render text, and the table below escapes explicitly);
- progress: tokens done / total, tokens/s and ETA from session.json's "progress" entry;
- generated text: streaming, clickable tokens (selects the token for the DSA read-out and routes).
"""

from __future__ import annotations

import html

import panel as pn
import param
from bokeh.models import ColumnDataSource, HoverTool, Range1d
from bokeh.plotting import figure

from apps.dashboard.components.figures import SEGMENT_COLOURS, position_format, trim
from apps.dashboard.components.panes import HTMLText, set_text, text_pane
from apps.dashboard.components.base import ViewComponent
from apps.dashboard.components.token_strip import TokenStrip, link_selection, strip_tokens
from workbench.analysis.views import RecordingMapData


def conversation_size(snap: RecordingMapData) -> tuple[int, int]:
    """(turns answered or being answered, tokens in context) of the followed session: a turn is one
    answer (a generated segment, or an assistant message a transcript replayed); the context counts
    every recorded token, every turn's prompt and answer."""
    turns = sum(1 for s in snap.segments if s.get("kind") == "generated"
                or (s.get("kind") == "turn" and str(s.get("name") or "").endswith("(assistant)")))
    ends = [int(s.get("end") or 0) for s in snap.segments]
    return turns, max([snap.tokens, *ends])


def progress_text(snap: RecordingMapData) -> str:
    """One line: phase, tokens done / total, tokens/s, ETA (plain text, numbers only); in a conversation
    of several turns, also the turn and the whole context (the progress entry counts the last turn only)."""
    p = snap.progress
    if snap.requests and int(snap.requests[-1].get("end", -1)) >= snap.tokens:
        # a served conversation between or after its turns: the newest turn's figures, as the server measured them
        return f"{snap.status} · {turn_text(snap.requests[-1])}"
    turns, context = conversation_size(snap)
    done, total = int(p.get("done") or 0), int(p.get("total") or 0)
    # the whole context, when this turn's prefill and answer are not all of it
    earlier = turns > 1 or context > total + int(p.get("generated") or 0)
    counted = f"{turns:,} turns" if turns > 1 else "1 turn"
    whole = f"conversation: {counted}, {context:,} tokens in context" if earlier and p else ""
    if not p:
        return f"{snap.status}: {context:,} tokens" + (f" ({turns:,} turns)" if turns > 1 else "")
    rate = float(p.get("tokens_per_s") or 0.0)
    eta = p.get("eta_s")
    if p.get("phase") == "decode" and "generated" in p:
        # while decoding, the recorder keeps the prefill's done/total and counts generated tokens apart
        turn = f"turn {turns}: " if turns > 1 else ""
        prefill = "prefill of this turn" if turns > 1 else "prefill"
        head = (f"{snap.status} · decode: {turn}{int(p['generated']):,} tokens generated after a {total:,}-token "
                f"{prefill}")
    else:
        head = f"{snap.status} · {p.get('phase', '?')}: {done:,} / {total:,} tokens"
    parts = [head] + ([whole] if whole else []) + [f"{rate:,.1f} tokens/s"]
    if eta is not None:
        parts.append(f"ETA {float(eta):,.0f} s")
    return " · ".join(parts)


def turn_text(turn: dict) -> str:
    """A served turn in one line: 'turn 3: 9,090-token prompt (8,948 reused) · 96 generated · TTFT 0.42 s ·
    TPOT 38 ms · stop' (what `workbench serve` recorded for it; absent figures left out)."""
    parts = [f"turn {int(turn.get('turn', 0))}"]
    if "prompt_tokens" in turn:
        reused = f" ({int(turn['cached_tokens']):,} reused)" if turn.get("cached_tokens") else ""
        parts[0] += f": {int(turn['prompt_tokens']):,}-token prompt{reused}"
    if "completion_tokens" in turn:
        parts.append(f"{int(turn['completion_tokens']):,} generated")
    if "ttft_s" in turn:
        parts.append(f"TTFT {float(turn['ttft_s']):.2f} s")
    if "tpot_s" in turn:
        parts.append(f"TPOT {1000 * float(turn['tpot_s']):.0f} ms")
    if "finish_reason" in turn:
        parts.append(str(turn["finish_reason"]))
    return " · ".join(parts)


class SessionMap(ViewComponent):
    """Segments strip, progress bar and streaming generated text of the followed session."""

    max_segments_listed = param.Integer(default=12, bounds=(1, None), doc="segments listed in the table")

    def __init__(self, **params) -> None:
        super().__init__(**params)
        self.source = ColumnDataSource({"left": [], "right": [], "name": [], "kind": [], "tokens": [], "colour": []})
        self.figure = figure(height=90, sizing_mode="stretch_width", tools="xpan,xwheel_zoom,reset", toolbar_location=None,
                             y_range=Range1d(0, 1), x_range=Range1d(0, 1), x_axis_label="position")
        self.figure.quad(left="left", right="right", bottom=0.1, top=0.9, fill_color="colour", line_color="white",
                         source=self.source)
        self.figure.add_tools(HoverTool(tooltips=[("segment", "@name"), ("kind", "@kind"), ("tokens", "@tokens{0,0}"),
                                                  ("range", "@left{0,0} – @right{0,0}")]))
        self.figure.yaxis.visible = False
        self.figure.grid.visible = False
        self.figure.xaxis.formatter = position_format()
        trim(self.figure)
        self.progress = pn.indicators.Progress(value=0, max=1, sizing_mode="stretch_width", height=14,
                                               bar_color="primary")
        self.stats = text_pane("waiting for the trace…", sizing_mode="stretch_width")
        self.table = HTMLText("", sizing_mode="stretch_width")
        self.strip = TokenStrip(sizing_mode="stretch_width", css_classes=["k3-session-text"])
        link_selection(self.strip, self.state)
        self.redraw()

    def draw(self, data: None, snap: RecordingMapData, changed: set[str]) -> None:
        p = snap.progress
        if p and p.get("total"):
            self.progress.max = max(int(p["total"]), 1)
            self.progress.value = min(int(p.get("done") or 0), self.progress.max)
        elif snap.status == "complete":
            self.progress.max, self.progress.value = 1, 1
        set_text(self.stats, progress_text(snap))
        if {"segments", "extent"} & changed:
            segs = snap.segments
            self.source.data = {"left": [int(s["start"]) for s in segs], "right": [int(s["end"]) for s in segs],
                                "name": [str(s.get("name") or "") for s in segs], "kind": [s["kind"] for s in segs],
                                "tokens": [int(s["end"]) - int(s["start"]) for s in segs],
                                "colour": [SEGMENT_COLOURS.get(s["kind"], "#999") for s in segs]}
            self.figure.x_range.update(start=0, end=snap.extent)
            self.table.object = self._segment_table(segs)
        if "generated" in changed:
            self.strip.tokens = strip_tokens(snap.generated)

    def has_data(self, data: None, session: RecordingMapData) -> bool:
        return bool(session.segments)

    def _segment_table(self, segs: tuple[dict, ...]) -> str:
        rows = "".join(
            f"<tr><td><span style='color:{SEGMENT_COLOURS.get(s['kind'], '#999')}'>&#9632;</span> "
            f"{html.escape(str(s.get('name') or ''))}</td><td>{html.escape(s['kind'])}</td>"
            f"<td style='text-align:right'>{int(s['end']) - int(s['start']):,}</td></tr>"
            for s in segs[: self.max_segments_listed])
        more = len(segs) - self.max_segments_listed
        tail = f"<tr><td colspan=3>… {more} more</td></tr>" if more > 0 else ""
        return ("<table class='k3-segments' style='font-size:12px;width:100%'><tr><th>segment</th><th>kind</th>"
                f"<th style='text-align:right'>tokens</th></tr>{rows}{tail}</table>")

    def __panel__(self) -> pn.viewable.Viewable:
        return pn.Card(
            self.stats, self.progress, self.figure, self.table,
            pn.pane.Markdown("**Generated text** (click a token to inspect it)", margin=(0, 10)), self.strip,
            self.drawn_marker, title="Session map", sizing_mode="stretch_width", collapsible=False, css_classes=["k3-view-session"])
