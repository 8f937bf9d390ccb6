"""The follower thread, the bounded queue and the frames (no Panel server, no browser)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from k3testing.replay import TraceReplay
from apps.dashboard.follower import MAX_GENERATED, DashboardFrame, DashboardState, TraceFollower
from workbench.analysis import bin_counts, bin_mean, carry_forward
from workbench.trace.schema import TABLES, parquet_options

from tests.helpers import nullable_copy


def test_frame_is_screen_sized(small_trace: Path) -> None:
    state = DashboardState(small_trace)
    state.bins = 300
    snap = state.sync()
    assert snap.session.status == "complete" and snap.error is None
    assert snap.session.tokens == 8192 and snap.session.extent == 8192
    # every array is reduced: rows x bins, never one entry per token
    assert snap.dsa.heat.values.shape == (3, 300)
    assert snap.kda.heat.values.shape == (9, 300)
    assert snap.kda.heads.values.shape == (4, 300)
    assert snap.experts.heat.values.shape == (11, 64)
    np.testing.assert_allclose(snap.experts.heat.values.sum(axis=1), 1.0, rtol=1e-5)
    assert len(snap.session.generated) == 256 <= MAX_GENERATED
    assert [s["kind"] for s in snap.session.segments] == ["turn", "document", "image", "document", "turn", "generated"]
    assert snap.experts.rank_load.shape == (2,) and snap.experts.rank_worst is not None


def test_selection_reads_and_routes(small_trace: Path) -> None:
    state = DashboardState(small_trace)
    first = state.sync()
    position = first.session.generated[10][0]
    state.position = position
    snap = state.sync()
    assert snap.dsa.reads["position"] == position
    assert snap.dsa.reads["layers"] == [3, 7, 11]
    assert snap.dsa.reads["heat"].shape == (3, state.bins)
    assert all(r["keys"] > 0 for r in snap.dsa.reads["rows"])
    assert "<table class='k3-reads'>" in snap.dsa.reads_html
    assert [r["layer"] for r in snap.experts.routes] == list(range(1, 12))
    image = snap.dsa.image
    assert image is not None and image.token is not None and image.token_position == position
    assert image.token.counts.ndim == 3 and image.token.counts.shape[1:] == image.grid
    state.position = None
    assert state.sync().dsa.reads is None


def test_unchanged_fields_keep_identity(small_trace: Path) -> None:
    state = DashboardState(small_trace)
    a = state.sync()
    b = state.sync()  # nothing changed on disk or in the options
    assert b.seq > a.seq and b.dsa is a.dsa and b.kda is a.kda and b.experts is a.experts and b.session.generated is a.session.generated


def test_queue_is_bounded(tmp_path: Path) -> None:
    follower = TraceFollower(tmp_path / "none", maxsize=2)
    for i in range(50):
        follower.publish(DashboardFrame(seq=i))
    assert follower.queue.qsize() == 2 and follower.dropped == 48
    assert [follower.queue.get_nowait().seq for _ in range(2)] == [48, 49]


def test_missing_then_appearing_trace(tmp_path: Path, small_trace: Path) -> None:
    target = tmp_path / "later"
    state = DashboardState(target)
    snap = state.sync()
    assert snap.session.status == "waiting" and "does not exist" in snap.error
    shutil.copytree(small_trace, target)
    snap = state.sync()
    assert snap.error is None and snap.session.status == "complete"


def test_corrupt_session_json_is_reported(tmp_path: Path, small_trace: Path) -> None:
    target = tmp_path / "broken"
    shutil.copytree(small_trace, target)
    (target / "session.json").write_text("{ not json")
    snap = DashboardState(target).sync()
    assert snap.session.status == "failed" and "JSON" in snap.error


def test_newer_schema_is_reported(tmp_path: Path, small_trace: Path) -> None:
    target = tmp_path / "future"
    shutil.copytree(small_trace, target)
    session = json.loads((target / "session.json").read_text())
    session["schema_version"] = 99
    (target / "session.json").write_text(json.dumps(session))
    snap = DashboardState(target).sync()
    assert "newer" in snap.error


def test_follower_sees_a_live_trace_grow(tmp_path: Path, small_trace: Path) -> None:
    replay = TraceReplay(small_trace, tmp_path / "live", seconds=2.0, decode_rate=400, interval=0.2).start()
    state = DashboardState(tmp_path / "live", interval=0.1)
    state.start()
    seen = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if state.poll():
            seen.append((state.frame.session.tokens, state.frame.session.progress.get("phase"), len(state.frame.session.generated)))
            if state.frame.session.status == "complete":
                break
        time.sleep(0.05)
    replay.join(5)
    state.close()
    assert replay.error is None
    assert state.frame.session.status == "complete" and state.frame.session.tokens == 8192
    tokens = [t for t, _, _ in seen]
    assert tokens == sorted(tokens) and len(set(tokens)) >= 3, seen
    assert "prefill" in {p for _, p, _ in seen}
    assert len(state.frame.session.generated) == 256
    assert state.frame.session.marks and state.frame.session.marks[0][2] == "needle"


def test_unreached_context_is_not_drawn_as_unread(tmp_path: Path, small_trace: Path) -> None:
    replay = TraceReplay(small_trace, tmp_path / "live", seconds=16.0, interval=0.2).start()
    state = DashboardState(tmp_path / "live")
    deadline = time.monotonic() + 30
    snap = state.sync()
    while (snap.dsa.heat is None or not snap.dsa.heat.rows or not 0 < snap.session.progress.get("done", 0)) and time.monotonic() < deadline:
        time.sleep(0.3)
        snap = state.sync()
    replay.stop()
    replay.join(5)
    values = snap.dsa.heat.values
    # during prefill the axis spans the whole prompt; bins past the frontier are NaN, the rest finite
    assert np.isnan(values[:, -1]).all() and np.isfinite(values[:, 0]).all()


def test_binning_helpers() -> None:
    pos = np.array([0, 1, 2, 9])
    np.testing.assert_allclose(bin_counts(pos, 5, 10), [2, 1, 0, 0, 1])
    out = bin_mean(pos, np.array([1.0, 3.0, 5.0, 7.0]), 5, 10)
    assert out[0] == 2.0 and out[1] == 5.0 and np.isnan(out[2]) and out[4] == 7.0
    heads = bin_mean(pos, np.ones((4, 3)), 2, 10)
    assert heads.shape == (3, 2)


def test_carry_forward_fills_only_between_measurements() -> None:
    row = np.array([np.nan, 1.0, np.nan, np.nan, 3.0, np.nan], np.float32)
    out = carry_forward(row[None])[0]
    np.testing.assert_array_equal(out[1:5], [1.0, 1.0, 1.0, 3.0])
    assert np.isnan(out[0]) and np.isnan(out[5])


def test_a_part_with_nulls_where_none_are_allowed_costs_only_its_own_rows(tmp_path: Path, small_trace: Path) -> None:
    """One such part of `dsa_topk` once made the whole trace unreadable ("Schema at index N was
    different"); now it is skipped and named among the problems, and every view still draws."""
    target = tmp_path / "nulls"
    shutil.copytree(small_trace, target)
    part = sorted((target / "dsa_topk").glob("part-*.parquet"))[-1]
    good = pq.read_table(part)
    loose = nullable_copy(good)
    at = loose.schema.get_field_index("selected")
    cells = loose["selected"].to_pylist()
    bad = loose.set_column(at, loose.schema.field(at), pa.array([None] + cells[1:], loose.schema.field(at).type))
    pq.write_table(bad, part, **parquet_options(TABLES["dsa_topk"]))
    snap = DashboardState(target).sync()
    assert snap.error is None and snap.session.status == "complete"
    assert any(part.name in p and "column selected holds 1 null(s)" in p for p in snap.problems), snap.problems
    assert snap.dsa.heat is not None and snap.kda.heat is not None and snap.experts is not None
