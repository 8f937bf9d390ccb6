"""The dashboard's views inline in a notebook: what `workbench.show` loads (entry point `k3_workbench.views`).

    inline_view(trace, views=["session", "kda"])  -> InlineView (a Panel Viewer; the cell displays it)

The same components, reducers and follower as the served dashboard, without the sidebar or drive
mode: one `Dashboard(drive=False)` per cell, whose follower thread tails the trace and whose periodic
callback (an asyncio task on the kernel's event loop, so it runs while no cell is busy) applies new
frames. The views redraw by changing their Bokeh models in place; in a notebook those changes reach
the page only when pushed over the comm (`pn.io.push_notebook`, which the server does by itself),
so the notebook dashboard pushes its layout after every frame it applies.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

import panel as pn

from apps.dashboard.app import Dashboard, DashboardConfig

# the names `show(views=...)` accepts -> the Dashboard attribute holding that view
VIEWS = {"session": "session_map", "dsa": "dsa", "kda": "kda", "experts": "experts"}


def _load_extension() -> None:
    """Send Bokeh's and Panel's JS to the page, inline (once per kernel, or again if loaded from a CDN).

    `pn.extension()` alone makes the page fetch BokehJS and Panel from cdn.bokeh.org / cdn.holoviz.org:
    on a machine without internet (CI, an air-gapped cluster) those loads fail, Panel logs "Bokeh or
    Panel library is missing" and every view stays an empty div. Inline, the bundle travels in the
    cell's output over the kernel connection, and the views' stylesheets are inlined too, so the page
    fetches nothing from outside the Jupyter server. A user who ran `pn.extension()` (CDN) before is
    loaded again inline: harmless online, the fix offline. Outside a kernel there is no page to load
    into, and Panel's global `inline` setting is left alone (a dashboard served from the same process
    keeps serving its resources as files).
    """
    if not _in_kernel():
        return
    if not getattr(pn.extension, "_loaded", False) or not pn.config.inline:
        pn.extension(inline=True)


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return hasattr(get_ipython(), "kernel")


# how long frames wait for the page to report that it drew the view, before they are applied anyway
PAGE_WAIT_S = 10.0


class NotebookDashboard(Dashboard):
    """The dashboard, pushing each applied frame to the notebook page (a no-op outside a notebook).

    Frames wait until the page has drawn the view: pyviz_comms drops every message for a view that
    is not yet in Bokeh's index, so a frame pushed while the page still builds the view would be lost
    (and for a finished trace no later frame would bring it). The width probe is the signal: the page
    sends its width once the view is laid out. A notebook run without a page (nbclient) gets its
    frames after `PAGE_WAIT_S`. (This did not measurably change the rare BokehJS receiver errors the
    JupyterLab browser test tolerates once; see tests/apps/test_jupyterlab.py.)
    """

    layout: pn.viewable.Viewable | None = None
    shown_at: float | None = None

    def _page_ready(self) -> bool:
        if self.probe.px > 0:
            return True
        return self.shown_at is not None and time.monotonic() - self.shown_at > PAGE_WAIT_S

    def _tick(self) -> None:
        if not self._page_ready():
            return
        before = self.state.frame
        super()._tick()
        if self.state.frame is not before and self.layout is not None:
            pn.io.push_notebook(self.layout)


class InlineView(pn.viewable.Viewer):
    """Some of the dashboard's views over one trace, followed live. `close()` stops following."""

    def __init__(self, trace: str | Path, views: Sequence[str] | None = None, *, refresh_ms: int = 300,
                 interval: float = 0.5, **params: Any) -> None:
        names = list(VIEWS) if views is None else list(views)
        unknown = [n for n in names if n not in VIEWS]
        if unknown or not names:
            raise ValueError(f"views must be a non-empty list of {', '.join(VIEWS)}; got {names}")
        super().__init__(**params)
        config = DashboardConfig(trace=Path(trace), drive=False, refresh_ms=refresh_ms, interval=interval)
        self.dashboard = NotebookDashboard(config)
        self.names = names
        self._layout: pn.Column | None = None

    @property
    def state(self) -> Any:
        """The `DashboardState` every view follows (its `frame` is the latest shown)."""
        return self.dashboard.state

    def __panel__(self) -> pn.viewable.Viewable:
        if self._layout is None:
            dash = self.dashboard
            dash.start(sync=True)
            views = [getattr(dash, VIEWS[n]) for n in self.names]
            self._layout = pn.Column(dash.probe, dash.alert, dash.source, *views, sizing_mode="stretch_width",
                                     css_classes=["k3-inline"])
            dash.layout = self._layout
            dash.shown_at = time.monotonic()
        return self._layout

    def close(self) -> None:
        self.dashboard.close()


def inline_view(trace: Path, *, views: Sequence[str] | None = None, **options: Any) -> InlineView:
    """The provider `workbench.show` calls: load Panel's notebook extension, then the views of `trace`."""
    _load_extension()
    return InlineView(trace, views, **options)
