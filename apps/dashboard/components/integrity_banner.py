"""The integrity banner: one line over the views saying whether the recording's health checks found a
fault (red, with layer, head and since which position), only warnings (amber) or nothing (hidden).
The data is `workbench.analysis.views.integrity_view.IntegrityData`."""

from __future__ import annotations

import panel as pn

from apps.dashboard.components.base import ViewComponent
from apps.dashboard.components.panes import AlertText, alert_text
from workbench.analysis.views.integrity_view import IntegrityData

LEVELS = {"fault": "danger", "warn": "warning"}


class IntegrityBanner(ViewComponent):
    view = "integrity"

    def __init__(self, **params) -> None:
        super().__init__(**params)
        self.banner = AlertText("", alert_type="danger", visible=False, sizing_mode="stretch_width",
                                css_classes=["k3-integrity"])
        self.redraw()

    def has_data(self, data: IntegrityData, session: object) -> bool:
        return data is not None and bool(data.line)

    def draw(self, data: IntegrityData, session: object, changed: set[str]) -> None:
        if data is None or not ({"line", "level"} & changed):
            return
        self.banner.object = alert_text(data.line)
        self.banner.alert_type = LEVELS.get(data.level, "warning")
        self.banner.visible = data.level in LEVELS

    def __panel__(self) -> pn.viewable.Viewable:
        return pn.Column(self.banner, self.drawn_marker, sizing_mode="stretch_width", margin=0)
