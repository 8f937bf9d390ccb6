"""Two traces side by side: the same views for trace A and trace B, and a DSA difference view on top.

    workbench dashboard --trace traces/a --compare traces/b
    http://127.0.0.1:5006/?trace=a&compare=b          (both inside --root)

Typically the two traces of `workbench compare` (A sparse, B with some DSA layers forced dense). Each
side is a whole `Dashboard` without drive controls (its own follower, views and width probe, so each
column's heat maps are binned to that column's width); trace A's follower also follows B to compute
the difference (`reducers.dsa_diff`), so the event loop only draws.
"""

from __future__ import annotations

from typing import Any

import panel as pn



class SideBySide(pn.viewable.Viewer):
    """Dashboards of traces A and B in two columns, under the DSA difference view (A vs B)."""

    def __init__(self, a: Any, b: Any, **params: Any) -> None:
        """`a`, `b`: the two `Dashboard`s, built by `app.side_by_side` (A's follower also follows B for
        the difference view); taking them built keeps this module below `app` (no import cycle)."""
        super().__init__(**params)
        self.a, self.b = a, b

    @property
    def diff(self):
        return self.a.diff

    def start(self, sync: bool = False) -> None:
        self.a.start(sync=sync)
        self.b.start(sync=sync)

    def sync(self) -> None:
        """One complete frame of each side, computed here (tests, notebooks)."""
        self.a.state.sync()
        self.b.state.sync()

    def close(self) -> None:
        self.a.close()
        self.b.close()

    def sidebar(self) -> list:
        return [pn.pane.Markdown("### Trace A"), self.a.source, pn.pane.Markdown("### Trace B"), self.b.source]

    def views(self) -> list:
        columns = pn.Row(pn.Column(pn.pane.Markdown("#### A"), *self.a.views(), sizing_mode="stretch_width"),
                         pn.Column(pn.pane.Markdown("#### B"), *self.b.views(), sizing_mode="stretch_width"),
                         sizing_mode="stretch_width")
        return [self.diff, columns]

    def __panel__(self) -> pn.viewable.Viewable:
        self.start(sync=True)
        return pn.Row(pn.Column(*self.sidebar(), width=320), pn.Column(*self.views(), sizing_mode="stretch_width"),
                      sizing_mode="stretch_width")
