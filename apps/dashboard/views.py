"""The one registry of dashboard views: name, reducer, component and the options the view adds.

    register_view(ViewSpec(name, reducer, component, options))   a new view: one line, nothing else
    VIEWS                                                      name -> ViewSpec, in page order

A view is a pure reducer (`workbench.analysis.views`: `cls(feeds).reduce(trace, options, session)`)
and a component (`components/`, a `ViewComponent` whose `view` is the registered name). The follower
reduces every registered view into the frame (`DashboardFrame.view(name)`), the served page and
`workbench.show` place the components in registry order, and the options a view declares are
accepted by `DashboardState.set_options` (read back with `ViewOptions.get`). The session map is
every view's context: always reduced, it has no reducer entry here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from apps.dashboard.components.attribution import AttributionView, pick_in_what_if
from apps.dashboard.components.base import ViewComponent
from apps.dashboard.components.dsa_map import DSAMemoryMap
from apps.dashboard.components.effects import EffectsView
from apps.dashboard.components.experts import ExpertsView
from apps.dashboard.components.integrity_banner import IntegrityBanner
from apps.dashboard.components.kda_health import KDAHealthView
from apps.dashboard.components.kda_state import KDAStateView
from workbench.analysis.views import VIEW_REDUCERS, Reducer
from workbench.analysis.views.attribution_view import CONTEXT_SPANS, AttributionReducer
from workbench.analysis.views.effects_view import EffectsReducer
from workbench.analysis.views.integrity_view import IntegrityReducer


@dataclass(frozen=True)
class ViewSpec:
    """One view. `component(dashboard)` builds its component for one dashboard (it may use the
    dashboard's state and session map); `options` are the view's own options with their defaults;
    `notebook` says whether `workbench.show()` shows it when no views are named; `lazy`, that the served
    page shows only its note until it has data (`components.base.PlacedWhenReady`): a view that is empty
    until the user acts costs the first paint one line (its models are built and sent when data comes);
    `until_seen`, that the served page shows a placeholder of about the view's height (`height_px`) until the
    reader scrolls near it (`components.seen.ShownWhenSeen`): a view below the first screen then costs the
    first paint nothing; `title` names it in that placeholder."""

    name: str
    reducer: type[Reducer]
    component: Callable[[Any], ViewComponent]
    options: Mapping[str, Any] = field(default_factory=dict)
    notebook: bool = True
    lazy: bool = False
    until_seen: bool = False
    height_px: int = 400
    title: str = ""


VIEWS: dict[str, ViewSpec] = {}
# names that cannot be views: the frame's own fields and the session map (every view's context)
_RESERVED = {"seq", "path", "error", "problems", "session", "diff", "more"}


def register_view(spec: ViewSpec) -> ViewSpec:
    """Add a view (after the registered ones on the page); returns it. A name already taken is an error."""
    if not spec.name.isidentifier() or spec.name in _RESERVED or spec.name in VIEWS:
        raise ValueError(f"view name {spec.name!r} is taken or not an identifier")
    VIEWS[spec.name] = spec
    return spec


def unregister_view(name: str) -> None:
    """Remove a view (tests)."""
    VIEWS.pop(name, None)


def view_reducers() -> dict[str, type[Reducer]]:
    """The registered views' reducers in the order the follower runs them: the built-in views in their
    run order (cheapest first, `workbench.analysis.views.VIEW_REDUCERS`), then the others."""
    first = [n for n in VIEW_REDUCERS if n in VIEWS]
    return {n: VIEWS[n].reducer for n in first + [n for n in VIEWS if n not in first]}


def view_options() -> dict[str, Any]:
    """Defaults of every registered view's own options."""
    return {k: v for spec in VIEWS.values() for k, v in spec.options.items()}


register_view(ViewSpec("dsa", VIEW_REDUCERS["dsa"],
                       lambda dash: DSAMemoryMap(state=dash.state, shown_together=dash.shown_together)))
# below the first screen (under the session map and the DSA map): built into the page when scrolled near;
# the heights are the cards' at demo dims in a 1400 px wide page (a placeholder keeps the page about as long)
register_view(ViewSpec("kda", VIEW_REDUCERS["kda"], lambda dash: KDAStateView(state=dash.state), until_seen=True,
                       height_px=650, title="KDA state"))
register_view(ViewSpec("health", VIEW_REDUCERS["health"],
                       lambda dash: KDAHealthView(state=dash.state, session_map=dash.session_map), notebook=False,
                       until_seen=True, height_px=880, title="KDA health"))
register_view(ViewSpec("experts", VIEW_REDUCERS["experts"], lambda dash: ExpertsView(state=dash.state),
                       until_seen=True, height_px=890, title="Experts"))
register_view(ViewSpec("effects", EffectsReducer, lambda dash: EffectsView(state=dash.state), lazy=True))
# a clicked span sets drive mode's What-if range (no runner: it is only marked on the view's DSA map)
register_view(ViewSpec("attribution", AttributionReducer, lambda dash: AttributionView(
    state=dash.state, on_pick=(lambda a, b: pick_in_what_if(dash.runner.what_if, a, b)) if dash.runner else None),
    options={"attribution_context": CONTEXT_SPANS}, notebook=False, lazy=True))
# drawn as a banner above the session map (`Dashboard.views`), not among the views below it
register_view(ViewSpec("integrity", IntegrityReducer, lambda dash: IntegrityBanner(state=dash.state), notebook=False))
