"""A dashboard built ahead (`apps/dashboard/spare.py`) serves the next request for the server's own trace only."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from apps.dashboard.app import Dashboard, DashboardConfig, build_dashboard, create_app
from apps.dashboard.spare import SpareDashboard


def test_spare_holds_one_and_take_waits_for_a_build_under_way() -> None:
    release = threading.Event()
    made: list[object] = []

    def build() -> object:
        release.wait(5)
        made.append(object())
        return made[-1]

    spare = SpareDashboard(build)
    spare.fill()
    spare.fill()  # one build at a time
    release.set()
    first = spare.take()
    assert first is made[0] and spare.built == 1 and spare.take(timeout=0) is None
    failing = SpareDashboard(lambda: 1 / 0)
    failing.fill()
    assert failing.take() is None  # a failed build: the request builds its own


def test_own_trace_request_takes_the_spare_others_build_their_own(small_trace: Path) -> None:
    config = DashboardConfig(trace=small_trace, root=small_trace.parent, drive=False)
    spare = SpareDashboard(lambda: build_dashboard(config))
    spare.fill()
    app = create_app(config, session_args={}, spare=spare)
    assert spare.built == 1 and isinstance(app.dashboard, Dashboard)
    assert app.dashboard.state.trace_path.endswith(small_trace.name)
    app.dashboard.state.sync()
    assert app.dashboard.state.frame.session.status == "complete"
    assert app.dashboard.dsa.heat.source.data["image"][0].shape[0] == 3  # its views were built ahead and draw
    app.dashboard.close()
    spare.fill()
    other = create_app(config, session_args={"trace": [small_trace.name.encode()]}, spare=spare)
    held = spare.take()
    assert held is not None and held is not other.dashboard  # a `?trace=` request built its own
    other.dashboard.close()
    held.close()


def test_the_servers_first_spare_reduces_its_trace_before_a_page_takes_it(small_trace: Path) -> None:
    config = DashboardConfig(trace=small_trace, root=small_trace.parent, drive=False)
    first = build_dashboard(config, follow=True)
    later = build_dashboard(config)
    try:
        assert first.state.follower.alive and not later.state.follower.alive
        deadline = time.monotonic() + 30
        while first.state.follower.completed == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        # a page taking it applies the waiting frame at once, before its document is sent
        assert first.state.poll() and first.state.frame.session.status == "complete"
        assert first.session_map.drawn_marker.object and first.dsa.drawn_marker.object
    finally:
        first.close()
        later.close()
