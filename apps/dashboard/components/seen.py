"""A place on the served page for a view below the first screen: the view joins the page when the reader
scrolls near it.

    ShownWhenSeen(component, name, height)   one light placeholder (a title line in a box of about the
                                             view's height) until the browser reports it near the viewport;
                                             then the component, once

Why: the browser builds every Bokeh model of a page's document before it draws any of it, and the server
makes the Panel models of every view before it answers the page request; the views under the first screen
(KDA state, KDA health, experts, the DSA image panel: 60% of the page's models) held the session map's
first paint back by seconds on a 128K trace (docs/benchmarks.md, issue 43). The component itself is built and follows
the state from the start (its figures hold the current frame's data), so once shown it draws what the page
would have drawn, and a reader who never scrolls down costs nothing more.

The browser reports with an IntersectionObserver (`SeenProbe.seen`, with a margin of `MARGIN_PX`, so a
view is usually built before it scrolls into sight). The swap waits for the page's onload (Panel holds a
document's events until then: `page_gate.py`); outside a server session (a notebook, a test) it is
immediate. Places made `together` (the dashboard's views below the first screen and the DSA image panel)
are shown as one when any of them is seen: a reader who scrolls to one goes on to the next, and one held
patch with the document's model index frozen costs one round trip, one re-index on the server and one
layout in the browser, where a patch per view cost each of those again.

The page does not fill the places by itself once loaded: tried (one view every 0.5 s from 1 s after
onload, and every 0.1 s from 0.25 s), it made both the first screen and an at-once scroll to every view
slower in the same runs, each added card making the browser lay the whole page out again while it was
still finishing the first screen (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

import panel as pn
import param
from panel.custom import JSComponent
from panel.io.document import hold
from panel.io.state import set_curdoc

# how far outside the viewport a placeholder counts as near it: the view is built while the reader scrolls
# towards it (about a third of a screen ahead)
MARGIN_PX = 300


class SeenProbe(JSComponent):
    """A box of fixed height showing `label`; `seen` turns True (once) when it comes within `near_px` px of
    the viewport."""

    seen = param.Boolean(default=False, doc="the box came near the viewport (set by the browser, once)")
    label = param.String(default="", doc="the line shown in the box (plain text)")
    near_px = param.Integer(default=MARGIN_PX, doc="pixels around the viewport that count as near it")

    _esm = """
export function render({ model, el }) {
  const note = document.createElement('div');
  note.className = 'k3-unseen-note';
  note.style.cssText = 'color:#888;font-size:13px;padding:10px 12px;border:1px dashed #ccc;border-radius:4px;' +
    'height:100%;box-sizing:border-box';
  note.textContent = model.label;  // text, never HTML
  el.append(note);
  if (model.seen) { return; }
  const observer = new IntersectionObserver((entries) => {
    if (entries.some((e) => e.isIntersecting)) { observer.disconnect(); model.seen = true; }
  }, { rootMargin: model.near_px + 'px 0px' });
  observer.observe(el);
  model.on('remove', () => observer.disconnect());
}
"""


class ShownWhenSeen(pn.viewable.Viewer):
    """The place of `component` (view `name`) on a served page: `SeenProbe` of `height` px until seen."""

    def __init__(self, component: Any, name: str, height: int, title: str = "",
                 together: list["ShownWhenSeen"] | None = None) -> None:
        super().__init__()
        self.component, self.view_name = component, name
        # the places shown with this one when any of them is seen (this one joins the list)
        self.together = together if together is not None else []
        self.together.append(self)
        label = f"{title or name}: drawn when scrolled into view"
        self.probe = SeenProbe(label=label, height=height, sizing_mode="stretch_width", margin=(5, 5))
        self.holder = pn.Column(self.probe, sizing_mode="stretch_width", margin=0, css_classes=[f"k3-unseen-{name}"])
        self.probe.param.watch(self._seen, "seen")

    @property
    def shown(self) -> bool:
        """Whether the component has taken its place."""
        return self.holder.objects[0] is not self.probe

    def _seen(self, event: param.parameterized.Event) -> None:
        if event.new and not self.shown:
            # in a served page: after its onload (at once when it has loaded); elsewhere at once
            pn.state.onload(self._queue)

    def _queue(self) -> None:
        """Show this place and the others of its `together` group not shown yet (a reader who scrolls to one
        scrolls on to the next), in one held patch on the document's next tick: one round trip and one layout
        in the browser instead of one per view."""
        places = [p for p in self.together if not p.shown]
        doc = pn.state.curdoc
        if doc is None or getattr(doc, "session_context", None) is None:
            for place in places:
                place.show()
            return
        doc.add_next_tick_callback(lambda: _show_held(doc, places))

    def show(self) -> None:
        """Put the component in its place (once)."""
        if not self.shown:
            self.holder.objects = [self.component]

    def __panel__(self) -> pn.viewable.Viewable:
        return self.holder


def _show_held(doc: Any, places: list[ShownWhenSeen]) -> None:
    """Show `places` of `doc` in one held (and frozen) patch; those shown meanwhile stay as they are."""
    with set_curdoc(doc), hold(doc, freeze=True):
        for place in places:
            place.show()
