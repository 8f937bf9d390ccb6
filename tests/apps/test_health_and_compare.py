"""The KDA memory health view and the side-by-side (A vs B) dashboard on two real traces recorded by
`workbench compare` on the tiny preset (A sparse, B with the first DSA layer forced dense).

Independent checks: the health view's ranking equals `heads_at_risk(memory_health(...))` run on the
trace's own `kda_norms` table; the difference view's per-layer numbers equal `read_changes` of the
two `dsa_topk` tables, with chance from `chance_jaccard` per query; a trace whose KDA records are
gone gives a clear empty state; bad `compare` URL parameters give messages, never an exception."""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pandas as pd
import panel as pn
import pytest

import workbench
from apps.cli import main
from apps.dashboard.app import Dashboard, DashboardConfig, create_app, side_by_side
from workbench.analysis.views import DSADiffReducer, KDAHealthReducer, RecordingMapReducer, ViewOptions
from workbench.analysis.views.kda_health_view import NO_KDA
from k3testing.replay import TraceReplay
from apps.dashboard.side_by_side import SideBySide
from apps.dashboard.follower import DashboardState
from engine.errors import InputError
from workbench.analysis import chance_jaccard, health_of_layers, heads_at_risk, memory_health, read_changes, reads_vs_chance

BINS = 64
PROMPT = ("The harbour log for the spring season lists every ship that docked at the north pier. "
          "The Meridian arrived first with timber, then the Calla with salt and wool. On the ninth day "
          "the Orsino unloaded two hundred crates of glass, the largest cargo of the season. ") * 2
FIRST_DSA = 2  # tiny preset: DSA layers 2 and 5, KDA layers 0, 1, 3, 4


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Traces A and B of `workbench compare` (every prefill query kept, KDA extras and effective rank)."""
    root = tmp_path_factory.mktemp("compare")
    policy = root / "policy.json"
    policy.write_text(json.dumps({"dsa_prefill_stride": 1, "kda_extras": True, "kda_rank_every": 64}))
    code = main(["compare", "--model", "preset:tiny", "--prompt", PROMPT, "--dense-layers", str(FIRST_DSA),
                 "--trace-a", str(root / "a"), "--trace-b", str(root / "b"), "--policy", str(policy),
                 "--prefill-chunk", "64"])
    assert code == 0
    return root / "a", root / "b"


def _session(trace):
    return RecordingMapReducer().reduce(trace, ViewOptions(bins=BINS))


def test_health_reducer_ranks_the_heads_of_the_recorded_trace(compared) -> None:
    path, _ = compared
    trace = workbench.open_trace(path)
    session = _session(trace)
    reducer = KDAHealthReducer()
    data = reducer.reduce(trace, ViewOptions(bins=BINS), session)
    direct = heads_at_risk(memory_health(trace.df("kda_norms"), trace.segments()), top=8)
    assert data.note == "" and data.ranked
    got = [(r["kind"], r["rank"], r["layer"], r["head"], r["position"]) for r in data.ranked]
    want = [(r.kind, r.rank, r.layer, r.head, r.position) for r in direct.itertuples()]
    assert got == want
    assert data.layers == 4 and data.heads == len(memory_health(trace.df("kda_norms")))
    assert {"eff_rank", "half_life", "mean_decay"} <= set(data.measured)
    assert data.last_position == int(trace.df("kda_norms")["position"].max())
    assert all(0 <= r["position"] <= data.last_position for r in data.ranked)
    assert all(r["segment_name"] == "prompt" for r in data.ranked)
    assert reducer.reduce(trace, ViewOptions(bins=BINS), session) is data  # nothing new: the same object


def test_health_view_renders_and_marks_the_session_map(compared) -> None:
    path, _ = compared
    dash = Dashboard(DashboardConfig(trace=path, root=path.parent, drive=False))
    frame = dash.state.sync()
    view = dash.health
    rows = frame.health.ranked
    assert view.source.data["position"] == [r["position"] for r in rows]
    assert view.figure.y_range.factors[-1].startswith("saturates #1")  # rank 1 on top
    assert "k3-has-data" in view.drawn_marker.object
    assert "saturates first: layer" in view.summary.object and "forgets fastest: layer" in view.summary.object
    assert "<table class='k3-health'" in view.table.object
    # the positions are on the session map too: a renderer of the session map's figure draws this source
    assert any(getattr(r, "data_source", None) is view.source for r in dash.session_map.figure.renderers)
    assert view.figure.x_range is dash.session_map.figure.x_range
    card = view.__panel__()
    assert isinstance(card, pn.Card)
    card.get_root()  # Bokeh models build
    dash.close()


def test_health_without_kda_records_is_an_empty_state(compared, tmp_path: Path) -> None:
    path, _ = compared
    partial = tmp_path / "no-kda"
    shutil.copytree(path, partial)
    for part in workbench.open_trace(partial).parts("kda_norms"):
        part.unlink()
    trace = workbench.open_trace(partial)
    data = KDAHealthReducer().reduce(trace, ViewOptions(bins=BINS), _session(trace))
    assert data.ranked == () and data.note == NO_KDA
    dash = Dashboard(DashboardConfig(trace=partial, root=tmp_path, drive=False))
    frame = dash.state.sync()
    assert frame.error is None and frame.health.ranked == ()
    assert "No KDA state records" in dash.health.summary.object and not dash.health.figure.visible
    assert not dash.health.drawn_marker.object and dash.health.table.object == ""
    dash.health.__panel__().get_root()
    dash.close()


def test_health_updates_live_while_the_trace_grows(compared, tmp_path: Path) -> None:
    path, _ = compared
    replay = TraceReplay(path, tmp_path / "live", seconds=30.0, interval=0.5).start()
    state = DashboardState(tmp_path / "live")
    seen = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        frame = state.sync()
        seen.append(frame.health.last_position)
        if frame.session.status == "complete" and replay.done:
            frame = state.sync()
            seen.append(frame.health.last_position)
            break
        time.sleep(0.3)
    replay.join(5)
    state.close()
    assert replay.error is None
    final = int(workbench.open_trace(path).df("kda_norms")["position"].max())
    assert seen == sorted(seen) and seen[-1] == final and len(set(seen)) >= 2, seen


def test_reads_vs_chance_against_hand_counts() -> None:
    a = pd.DataFrame({"layer": [5, 5, 5], "position": [3, 40, 41],
                      "selected": [np.arange(4), np.arange(16), np.arange(16)]})
    b = pd.DataFrame({"layer": [5, 5, 5], "position": [3, 40, 41],
                      "selected": [np.arange(4), np.arange(8, 24), np.arange(16)]})
    changes = read_changes(a, b)
    assert list(changes["keys_a"]) == [4, 16, 16] and list(changes["keys_b"]) == [4, 16, 16]
    row = reads_vs_chance(changes).iloc[0]
    assert row["queries"] == 3 and row["changed_share"] == pytest.approx(1 / 3)
    assert row["mean_jaccard"] == pytest.approx((1 + 8 / 24 + 1) / 3)
    chance = (chance_jaccard(4, 4, 4) + chance_jaccard(41, 16, 16) + chance_jaccard(42, 16, 16)) / 3
    assert chance_jaccard(4, 4, 4) == pytest.approx(1.0)  # a query that sees 4 keys reads all of them
    assert row["chance_jaccard"] == pytest.approx(chance) and row["ratio"] == pytest.approx(row["mean_jaccard"] / chance)
    assert row["first_changed"] == 40


def test_diff_reducer_matches_the_two_traces(compared) -> None:
    a, b = compared
    ta, tb = workbench.open_trace(a), workbench.open_trace(b)
    session = _session(ta)
    data = DSADiffReducer(b).reduce(ta, ViewOptions(bins=BINS), session)
    cols = ["layer", "position", "selected"]
    changes = read_changes(ta.table("dsa_topk", columns=cols), tb.table("dsa_topk", columns=cols))
    want = reads_vs_chance(changes).set_index("layer")
    assert data.note == "" and data.queries == len(changes) > 0 and data.dense_layers == (FIRST_DSA,)
    layers = {r["layer"]: r for r in data.layers}
    assert sorted(layers) == [2, 5]
    for layer, r in layers.items():
        for key in ("queries", "changed_share", "mean_jaccard", "chance_jaccard", "first_changed"):
            assert r[key] == pytest.approx(want.loc[layer, key])
    assert layers[FIRST_DSA]["dense_in_b"] and layers[FIRST_DSA]["changed_share"] == 0  # same input to its indexer
    assert layers[5]["changed_share"] > 0 and not layers[5]["dense_in_b"]
    assert all(r["mean_jaccard"] > r["chance_jaccard"] for r in layers.values())
    assert data.heat.rows == (2, 5) and data.heat.values.shape == (2, BINS)
    assert np.nanmax(data.heat.values[0]) == 0 and np.nanmax(data.heat.values[1]) > 0


def test_side_by_side_app_from_url_parameters(compared) -> None:
    a, b = compared
    config = DashboardConfig(root=a.parent)
    app = create_app(config, session_args={"trace": [a.name.encode()], "compare": [b.name.encode()]})
    side = app.dashboard
    assert isinstance(side, SideBySide) and side.a.runner is None and side.b.runner is None
    side.close()
    side = side_by_side(config, a, b)
    side.sync()
    diff = side.diff
    assert diff.heat.source.data["image"][0].shape == (2, side.a.state.bins)
    assert "<table class='k3-dsa-diff'" in diff.table.object and "dense" in diff.table.object
    assert "k3-has-data" in diff.drawn_marker.object
    assert side.a.state.frame.health.ranked and side.b.state.frame.health.ranked
    assert side.a.state.frame.dsa.heat is not None and side.b.state.frame.dsa.heat is not None
    pn.Column(*side.views()).get_root()
    side.close()


@pytest.mark.parametrize("args, expected", [
    ({"trace": [b"a"], "compare": [b"../../etc"]}, "outside the dashboard's trace root"),
    ({"compare": [b"b"]}, "compare needs a trace"),
    ({"trace": [b"a"], "compare": [b"a"]}, "same trace"),
    ({"trace": [b"a"], "compare": [b""]}, "empty or malformed"),
])
def test_bad_compare_parameter_gives_a_message(compared, args, expected) -> None:
    a, _ = compared
    app = create_app(DashboardConfig(root=a.parent, drive=False), session_args=args)
    dash = app.dashboard
    assert isinstance(dash, Dashboard) and expected in dash.message
    assert dash.alert.visible and "error" in dash.alert.object
    dash.close()


def test_cli_compare_flag(tmp_path: Path) -> None:
    from apps.cli.dashboard_cmd import dashboard_config

    def ns(**kw):
        return argparse.Namespace(**{"trace": None, "compare": None, "model": None, "host": "127.0.0.1",
                                     "port": 5997, "root": tmp_path, "no_drive": False, **kw})

    config = dashboard_config(ns(trace=tmp_path / "a", compare=tmp_path / "b"))
    assert config.compare == tmp_path / "b" and config.trace == tmp_path / "a" and not config.drive
    with pytest.raises(InputError, match="needs --trace"):
        dashboard_config(ns(compare=tmp_path / "b"))
    with pytest.raises(InputError, match="same directory"):
        dashboard_config(ns(trace=tmp_path / "a", compare=tmp_path / "a"))


def test_health_series_stays_bounded_and_fills_missing_statistics() -> None:
    from workbench.analysis.views.kda_health_view import MAX_POSITIONS, _LayerSeries

    series = _LayerSeries()
    step = 64
    for chunk in range(6):
        pos = np.arange(chunk * MAX_POSITIONS, (chunk + 1) * MAX_POSITIONS) * step
        norms = np.ones((len(pos), 2), np.float32)
        series.append(pos, {"norm": norms, "half_life": norms if chunk == 5 else None})
        assert len(series.positions) <= 2 * MAX_POSITIONS + 1
    assert series.positions[-1] == (6 * MAX_POSITIONS - 1) * step and series.positions[0] == 0
    assert np.all(np.diff(series.positions) > 0)
    half = series.values["half_life"]
    assert half.shape == (len(series.positions), 2) and np.isnan(half[0]).all() and (half[-1] == 1).all()
    # the analysis takes the thinned rows as it takes the table
    assert len(health_of_layers({3: (series.positions, series.values)})) == 2
