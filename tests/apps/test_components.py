"""The four views and the dashboard without a browser: set widget values, assert params and figure data."""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np
import panel as pn
import pytest

from apps.dashboard.app import Dashboard, DashboardConfig, create_app
from apps.dashboard.components.dsa_map import DSAMemoryMap
from apps.dashboard.components.experts import ExpertsView
from apps.dashboard.components.kda_state import KDAStateView
from apps.dashboard.components.session_map import SessionMap, progress_text
from workbench.analysis.views import RecordingMapData
from apps.dashboard.follower import DashboardState

from tests.apps.conftest import HOSTILE


@pytest.fixture
def state(small_trace: Path) -> DashboardState:
    state = DashboardState(small_trace)
    state.sync()
    return state


def test_session_map_shows_segments_progress_and_text(state: DashboardState) -> None:
    view = SessionMap(state=state)
    data = view.source.data
    assert data["kind"] == ["turn", "document", "image", "document", "turn", "generated"]
    assert sum(data["tokens"]) == 8192
    assert view.progress.value == view.progress.max == 1
    assert "complete" in view.stats.object and "8,192" in view.stats.object
    assert len(view.strip.tokens) == 256
    view.strip.selected = view.strip.tokens[5][0]  # what a click in the browser does
    assert state.position == view.strip.tokens[5][0]
    assert isinstance(view.__panel__(), pn.Card)


def test_progress_text_during_prefill() -> None:
    snap = RecordingMapData(status="recording", progress={"phase": "prefill", "done": 4096, "total": 32768,
                                                  "tokens_per_s": 512.0, "eta_s": 56.0})
    assert progress_text(snap) == "recording · prefill: 4,096 / 32,768 tokens · 512.0 tokens/s · ETA 56 s"


def test_dsa_map_heat_and_readout(state: DashboardState) -> None:
    view = DSAMemoryMap(state=state)
    image = view.heat.source.data["image"][0]
    assert image.shape == (3, state.bins) and np.isfinite(image).all() and image.max() > 0
    assert view.heat.figure.x_range.end == 8192
    starts = [s["start"] for s in state.frame.session.segments][1:]
    assert list(view.heat.bounds.data["x"]) == starts and len(starts) == 5
    position = view.strip.tokens[20][0]
    view.position_input.value = position  # the widget is bound to the shared selection
    assert state.position == position
    state.sync()
    assert view.query_line.location == position and view.query_line.visible
    assert "k3-reads" in view.readout.object
    reads = view.reads.source.data["image"][0]
    assert reads.shape == (3, state.bins) and np.nansum(reads) > 0
    assert len(view.detail.objects) == 2  # the read-out figures joined the page with the first selection
    needle = state.frame.session.marks[0]
    assert needle[2] == "needle" and list(view.heat.marks.data["x0"]) == [needle[0]]  # the planted fact, shaded
    assert "keys in needle" in view.readout.object
    view.show_segments = False
    assert list(view.heat.bounds.data["x"]) == []


def test_kda_view_layer_and_reduce(state: DashboardState) -> None:
    view = KDAStateView(state=state)
    assert view.param.layer.objects == [0, 1, 2, 4, 5, 6, 8, 9, 10]
    assert view.heat.source.data["image"][0].shape == (9, state.bins)
    mean = view.heat.source.data["image"][0].copy()
    view.layer_select.value = 5
    assert state.follower.options.kda_layer == 5
    view.reduce_select.value = "max"
    state.sync()
    assert "layer 5" in view.lines.title.text and len(view.lines_source.data["xs"]) == 4
    peak = view.heat.source.data["image"][0]
    assert np.nanmean(peak) > np.nanmean(mean)  # max over heads >= mean over heads


def test_experts_view_filters(state: DashboardState) -> None:
    view = ExpertsView(state=state)
    both = view.heat.source.data["image"][0].copy()
    assert both.shape == (11, 64)
    view.modality = "image"
    assert state.follower.options.moe_modality == "image"
    state.sync()
    image_only = view.heat.source.data["image"][0]
    assert not np.allclose(image_only, both)
    view.segment = next(s for s in view.param.segment.objects if s.endswith("report.pdf"))
    assert state.follower.options.moe_segment == 1
    view.layer = "3"
    state.sync()
    assert len(view.bars_source.data["expert"]) == 64
    assert "busiest rank" in view.load_note.object
    state.position = state.frame.session.generated[0][0]
    state.sync()
    assert len(view.routes_source.data["expert"]) == 11 * 4  # 11 MoE layers x 4 experts per token
    assert "11 MoE layers" in view.routes_note.object


def test_token_text_is_escaped(hostile_trace: Path) -> None:
    state = DashboardState(hostile_trace)
    snap = state.sync()
    pieces = [p for _, p in snap.session.generated]
    assert HOSTILE[0] in pieces  # kept verbatim as data: the browser inserts it as text (textContent)
    dsa = DSAMemoryMap(state=state)
    hostile_pos = next(pos for pos, p in snap.session.generated if p == HOSTILE[0])
    state.position = hostile_pos
    state.sync()
    # Panel's Str/Markdown panes render HTML in the browser: our text panes escape on the server
    assert html.escape(HOSTILE[0]) in dsa.title.object and HOSTILE[0] not in dsa.title.object
    # read-out snippets are HTML built by us: every piece escaped
    for text in HOSTILE:
        assert text not in dsa.readout.object or text == "&amp;"
    assert "<script>" not in dsa.readout.object
    from workbench.analysis.views.readout import escape_piece
    assert escape_piece(HOSTILE[0]) == html.escape(HOSTILE[0])


def test_dashboard_composes_and_reports_problems(small_trace: Path, tmp_path: Path) -> None:
    dash = Dashboard(DashboardConfig(trace=small_trace, root=small_trace.parent))
    dash.state.sync()
    assert "status: complete" in dash.source.object and not dash.alert.visible
    dash.probe.px = 1100  # the browser reports the main column's width
    assert dash.state.bins == 1100 - 140 and dash.state.follower.options.bins == 960
    dash.state.sync()
    assert dash.dsa.heat.source.data["image"][0].shape == (3, 960)
    missing = Dashboard(DashboardConfig(trace=tmp_path / "nope", root=tmp_path))
    missing.state.sync()
    assert missing.alert.visible and "does not exist" in missing.alert.object
    dash.close()
    missing.close()


def test_create_app_builds_a_template(small_trace: Path) -> None:
    app = create_app(DashboardConfig(trace=small_trace, root=small_trace.parent), session_args={})
    assert isinstance(app, pn.template.BootstrapTemplate)
    app.dashboard.close()


def test_progress_text_during_decode() -> None:
    snap = RecordingMapData(status="recording", progress={"phase": "decode", "done": 119, "total": 119, "generated": 7,
                                                  "tokens_per_s": 4.0, "eta_s": 0.0})
    assert progress_text(snap).startswith("recording · decode: 7 tokens generated after a 119-token prefill")
