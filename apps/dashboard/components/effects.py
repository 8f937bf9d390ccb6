"""The effects view: the trace's effects table as an attribution heat map, each effect beside its control.

One grid per check (the needle, the picture, a sweep, a "what if" rerun): rows are the memories
switched off, columns the layers they were switched off from. A cell's colour is the effect (change of
the target's log-probability, nats: red where it fell, blue where it rose, scaled to the grid's largest
change); its text is the effect beside the controls' mean; hovering shows the verdict in words and
the controls' mean, min and max. A cell whose effect is not a drop below every control is marked
"~" and drawn faint (a random switch-off of the same size did as much); one with too few disjoint
controls to judge is marked "?" (no verdict).
"""

from __future__ import annotations

import html
import math

import panel as pn

from apps.dashboard.components.base import ViewComponent
from apps.dashboard.components.panes import HTMLText, html_table, set_text, text_pane
from workbench.analysis.causal import NO_VERDICT
from workbench.analysis.views.effects_view import EffectCell, EffectsData, EffectsGrid

CHANCE_MARK = "~"
NO_VERDICT_MARK = "?"  # too few disjoint controls fitted to judge the effect


def cell_colour(effect: float, scale: float) -> str:
    """Background for an effect: red where the log-probability fell, blue where it rose."""
    if not math.isfinite(effect) or scale <= 0:
        return "transparent"
    alpha = min(1.0, abs(effect) / scale)
    rgb = "214,39,40" if effect < 0 else "31,119,180"
    return f"rgba({rgb},{alpha:.2f})"


def cell_hover(cell: EffectCell) -> str:
    controls = (f"control mean {cell.control_mean:+.3f}, min {cell.control_min:+.3f}, max {cell.control_max:+.3f} "
                f"({cell.controls} random same-size switch-offs)" if cell.controls else "no control fitted")
    return (f"{cell.sentence or f'effect {cell.effect:+.3f} nats'}. Effect {cell.effect:+.3f} nats; {controls}; "
            f"log p without intervention {cell.plain:.3f}")


def cell_html(cell: EffectCell | None, scale: float) -> str:
    if cell is None:
        return ""
    mark = f" {NO_VERDICT_MARK}" if cell.verdict == NO_VERDICT else f" {CHANCE_MARK}" if cell.within_control else ""
    style = f"background:{cell_colour(cell.effect, scale)};{'opacity:0.55;' if cell.within_control else ''}"
    return (f"<div class='k3-effect-cell{' k3-within-control' if cell.within_control else ''}' style='{style}' "
            f"title='{html.escape(cell_hover(cell), quote=True)}'>{cell.effect:+.2f}{mark}"
            f"<br><small>{f'ctl {cell.control_mean:+.2f}' if cell.controls else 'no control'}</small></div>")


def grid_table(grid: EffectsGrid) -> str:
    """One check's grid as an escaped HTML table."""
    effects = [abs(c.effect) for row in grid.cells for c in row if c is not None and math.isfinite(c.effect)]
    scale = max(effects, default=0.0)
    headers = ["switched off"] + [f"layer {c}" if c != "all" else "all layers" for c in grid.columns]
    rows = [[html.escape(label)] + [cell_html(c, scale) for c in cells] for label, cells in zip(grid.rows, grid.cells)]
    title = html.escape(f"{grid.check}" + (f" (target {grid.target!r})" if grid.target else ""))
    return f"<div class='k3-effects-check'><b>{title}</b>{html_table('k3-effects-table', headers, rows)}</div>"


def effects_html(data: EffectsData) -> str:
    return "".join(grid_table(g) for g in data.grids)


class EffectsView(ViewComponent):
    """Which memory the answers depended on: effect beside control, per switched-off memory and layer."""

    view = "effects"

    def __init__(self, **params) -> None:
        super().__init__(**params)
        self.summary = text_pane("no effects table yet", sizing_mode="stretch_width", css_classes=["k3-effects-summary"])
        self.table = HTMLText("", sizing_mode="stretch_width", css_classes=["k3-effects-grids"])
        self.redraw()

    def has_data(self, data: EffectsData, session: object) -> bool:
        return data is not None and bool(data.grids)

    def draw(self, data: EffectsData, session: object, changed: set[str]) -> None:
        if data is None or not ({"grids", "note"} & changed):
            return
        if data.grids:
            rows = sum(len(g.rows) for g in data.grids)
            set_text(self.summary, f"{len(data.grids)} check(s), {rows} switched-off memories. Cell: change of the "
                                   f"target's log-probability (nats) beside the controls' mean; {CHANCE_MARK} = not "
                                   f"distinguishable from random same-size switch-offs; {NO_VERDICT_MARK} = no "
                                   f"verdict (too few disjoint controls fitted). Hover a cell for its verdict.")
        else:
            set_text(self.summary, data.note or "no effects table yet")
        self.table.object = effects_html(data)

    def __panel__(self) -> pn.viewable.Viewable:
        return pn.Card(self.summary, self.table, self.drawn_marker, title="Effects: which memory the answer depended on",
                       sizing_mode="stretch_width", collapsible=False, css_classes=["k3-view-effects"])
