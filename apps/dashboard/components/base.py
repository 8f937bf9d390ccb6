"""`ViewComponent`: the base of the four views; it owns the "what changed since last shown" diff.

A view names the frame field it draws (`view = "dsa"`) and implements `draw(data, session, changed)`,
where `changed` holds the names of the fields (of its own data and of the session map's data, its
context) that differ from what it last drew. The base watches `state.frame`, diffs with
`reducers.base.same` (identity for arrays, value for plain data) and calls `draw` only when something
changed; `redraw()` forgets what was shown (e.g. after a display option changed).

`drawn_marker` is an empty pane each view puts in its card; once the view has drawn data from the
trace (`has_data`), it holds a `k3-has-data` element, so a browser test or benchmark can wait for
"drawn with data" rather than "drawn".
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, ClassVar

import panel as pn
import param

from apps.dashboard.components.panes import HTMLText, pre
from workbench.analysis.views.base import same
from apps.dashboard.follower import DashboardState


def changed_fields(shown: Any, data: Any) -> set[str]:
    """Names of the dataclass fields of `data` that differ from `shown` (all of them when shown is None)."""
    if shown is None:
        return {f.name for f in fields(data)}
    if shown is data:
        return set()
    return {f.name for f in fields(data) if not same(getattr(shown, f.name), getattr(data, f.name))}


class PlacedWhenReady(pn.viewable.Viewer):
    """A place on the page for a view that has nothing to show until the user acts (a what-if rerun, an
    attribution): until a frame gives the view data (`ViewComponent.has_data`) it holds one line, the
    view's own note on why there is none, so the first paint neither builds nor sends the view's models;
    then the view takes its place, once."""

    def __init__(self, component: "ViewComponent", name: str, state: DashboardState) -> None:
        super().__init__()
        self.component, self.view_name, self.state = component, name, state
        self.note = HTMLText("", sizing_mode="stretch_width", css_classes=["k3-pending-note"])
        self.holder = pn.Column(self.note, sizing_mode="stretch_width", margin=0, css_classes=[f"k3-pending-{name}"])
        self._watcher = state.param.watch(self._check, "frame")
        self._check()

    def _check(self, _event: Any = None) -> None:
        if self._watcher is None:
            return
        frame = self.state.frame
        data = frame.view(self.view_name)
        if data is not None and self.component.has_data(data, frame.session):
            self.state.param.unwatch(self._watcher)
            self._watcher = None
            self.holder.objects = [self.component]
            return
        note = getattr(data, "note", "") or ""
        if self.note.object != pre(note):
            self.note.object = pre(note) if note else ""

    def __panel__(self) -> pn.viewable.Viewable:
        return self.holder


class ViewComponent(pn.viewable.Viewer):
    """One dashboard view: build the widgets in `__init__`, draw frames in `draw`."""

    state = param.ClassSelector(class_=DashboardState, doc="shared dashboard state (frame, selection)")

    view: ClassVar[str | None] = None  # the DashboardFrame field this view draws (None: the session map only)

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self._shown: tuple[Any, Any] = (None, None)
        self.drawn_marker = HTMLText("", width=0, height=0, margin=0, css_classes=["k3-drawn-marker"])

    def draw(self, data: Any, session: Any, changed: set[str]) -> None:
        raise NotImplementedError

    def has_data(self, data: Any, session: Any) -> bool:
        """Whether this frame gives the view something from the trace to show (default: a heat map)."""
        return getattr(data, "heat", None) is not None

    def redraw(self) -> None:
        """Draw the current frame from scratch."""
        self._shown = (None, None)
        self._apply()

    @param.depends("state.frame", watch=True)
    def _apply(self) -> None:
        frame = self.state.frame
        session = frame.session
        data = frame.view(self.view) if self.view else None
        if self.view and data is None:
            return  # a registered view not reduced yet (the built-in ones start from empty data)
        shown_session, shown_data = self._shown
        changed = changed_fields(shown_session, session)
        if data is not None:
            changed |= changed_fields(shown_data, data)
        self._shown = (session, data)
        if changed:
            self.draw(data, session, changed)
            if not self.drawn_marker.object and self.has_data(data, session):
                self.drawn_marker.object = "<span class='k3-has-data'></span>"
