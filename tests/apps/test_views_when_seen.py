"""Views below the first screen join a served page when the reader scrolls near them (`components/seen.py`).

- the served document holds a placeholder for each such view (none of the view's models), while the
  view's component already follows the state: once seen, it takes its place drawn with the trace's data;
- in headless Chromium, a 1400 x 1000 window shows the session map and the DSA map with data and only
  placeholders below; scrolling to a placeholder builds that view with its data.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from bokeh.document import Document

from apps.dashboard.app import DashboardConfig, create_app
from apps.dashboard.components.seen import ShownWhenSeen
from apps.dashboard.views import VIEWS
from k3testing.browser import chromium_available
from tests.apps.served_page import served_page


def _figure(component):
    """The view's main Bokeh figure (a heat map's, or the health view's own)."""
    return component.heat.figure if hasattr(component, "heat") else component.figure


def test_views_below_the_first_screen_are_placeholders_until_seen(small_trace: Path) -> None:
    page = create_app(DashboardConfig(trace=small_trace, root=small_trace.parent), session_args={})
    document = Document()
    page.server_doc(document)
    dash = page.dashboard
    try:
        dash.state.sync()
        below = [name for name, spec in VIEWS.items() if spec.until_seen]
        assert set(below) >= {"kda", "health", "experts"}
        served = {m.id for m in document.models}
        # the whole page: 208 models at this commit (495 when every view was built into it)
        assert len(served) <= 260, len(served)
        # each view is a root of its own (a change in one lays out only that one in the browser)
        roots = {type(r).__name__ for r in document.roots}
        assert len(document.roots) >= 6 and "Card" in roots, roots
        for name in below:
            place = dash._places[name]
            assert isinstance(place, ShownWhenSeen) and not place.shown
            component = dash.view(name)
            # the view's figure is not in the page, yet it holds the trace's data already
            assert _figure(component).id not in served
            assert "k3-has-data" in component.drawn_marker.object
        # the reader scrolls near the KDA view: it takes its place, once, and the other views below the first
        # screen with it (one round trip and one layout in the browser for all of them)
        place = dash._places["kda"]
        place.probe.seen = True
        shown = place.holder.objects
        assert place.shown and len(shown) == 1 and "k3-view-kda" in shown[0].css_classes  # the view's own card
        place.probe.seen = False
        place.probe.seen = True
        assert place.holder.objects == shown
        assert all(dash._places[name].shown for name in below)
        # the page's document now holds the views' figures, drawn from the same data
        assert {_figure(dash.view(name)).id for name in below} <= {m.id for m in document.models}
    finally:
        dash.close()


def test_a_notebook_dashboard_places_every_view(small_trace: Path) -> None:
    from apps.dashboard.app import Dashboard

    dash = Dashboard(DashboardConfig(trace=small_trace, root=small_trace.parent, drive=False))
    try:
        shown = dash.views()
        for name, spec in VIEWS.items():
            if spec.until_seen:
                assert dash.view(name) in shown
    finally:
        dash.close()


@pytest.mark.browser
@pytest.mark.skipif(not chromium_available(), reason="needs Debian's chromium at /usr/bin/chromium")
def test_scrolling_to_a_placeholder_builds_the_views_below_with_data(small_trace: Path) -> None:
    with served_page(DashboardConfig(root=small_trace.parent, drive=False), small_trace.name,
                     width=1400, height=1000) as browser:
        page = browser.page
        for view in ("session", "dsa"):
            page.locator(f".k3-view-{view} .k3-has-data").first.wait_for(state="attached", timeout=60_000)
        page.locator(".k3-unseen-experts .k3-unseen-note").first.wait_for(state="attached", timeout=30_000)
        assert page.locator(".k3-view-experts").count() == 0
        assert page.locator(".k3-view-kda").count() == 0
        page.locator(".k3-unseen-experts").first.scroll_into_view_if_needed()
        page.locator(".k3-view-experts canvas").first.wait_for(state="visible", timeout=60_000)
        page.locator(".k3-view-experts .k3-has-data").first.wait_for(state="attached", timeout=30_000)
        assert page.locator(".k3-unseen-experts .k3-unseen-note").count() == 0
        # the other views below the first screen came with it (one patch), drawn with their data too
        for view in ("kda", "health"):
            page.locator(f".k3-view-{view} .k3-has-data").first.wait_for(state="attached", timeout=30_000)
        assert browser.counters.errors == [] and browser.counters.external == []
