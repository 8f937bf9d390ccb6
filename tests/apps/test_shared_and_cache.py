"""Opening a trace again is cheap: the reducers are shared by the sessions following one trace
(`shared_reducers`), and a finished trace's KDA summaries are kept on disk (`summary_cache`)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from workbench.analysis.views import shared_reducers
from workbench.trace import summary_cache
from workbench.analysis.views import (DSAMapReducer, ExpertsReducer, KDAHealthReducer, KDAStateReducer,
                                     RecordingMapReducer, ViewOptions)
from apps.dashboard.follower import TraceFollower
from workbench.trace import open_trace

BINS = 128


def test_followers_of_one_trace_share_its_reducers(small_trace: Path, tmp_path: Path) -> None:
    first = TraceFollower(small_trace)
    frame = first.compute()
    second = TraceFollower(small_trace)
    again = second.compute()
    # the second session's data comes from what the first one reduced: the same objects
    assert again.kda is frame.kda and again.dsa is frame.dsa and again.health is frame.health
    first.stop()
    second.stop()
    # released, then opened again (a page reload): still shared
    third = TraceFollower(small_trace)
    assert third.compute().kda is frame.kda
    third.stop()
    # a trace re-recorded into the same directory is read afresh
    copy = tmp_path / "copy"
    shutil.copytree(small_trace, copy)
    a = TraceFollower(copy)
    shown = a.compute().kda
    a.stop()
    part = open_trace(copy).parts("kda_norms")[0]
    os.utime(part, ns=(part.stat().st_atime_ns, part.stat().st_mtime_ns + 10**9))
    b = TraceFollower(copy)
    assert b.compute().kda is not shown
    b.stop()


def test_kda_summaries_come_back_from_disk_equal(small_trace: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("K3WB_DASHBOARD_CACHE", str(tmp_path / "cache"))
    trace = open_trace(small_trace)
    session = RecordingMapReducer().reduce(trace, ViewOptions(bins=BINS))
    opts = ViewOptions(bins=BINS)
    cold_state = KDAStateReducer().reduce(trace, opts, session)
    cold_health = KDAHealthReducer().reduce(trace, opts, session)
    assert any((tmp_path / "cache").rglob("*.arrow")) and any((tmp_path / "cache").rglob("*.json"))
    reducer = KDAStateReducer()
    warm_state = reducer.reduce(trace, opts, session)
    assert reducer.folder.restore(trace) is False  # already folded: restore changes nothing
    warm_health = KDAHealthReducer().reduce(trace, opts, session)
    np.testing.assert_array_equal(warm_state.heat.values, cold_state.heat.values)
    np.testing.assert_array_equal(warm_state.heads.values, cold_state.heads.values)
    assert warm_state.heat.rows == cold_state.heat.rows and warm_state.head_layer == cold_state.head_layer
    # (NaN measures are equal as JSON text, not as floats)
    assert json.dumps(warm_health.ranked) == json.dumps(cold_health.ranked) and warm_health.ranked
    assert warm_health.measured == cold_health.measured and warm_health.heads == cold_health.heads
    # another layer's lines are read from the parts, as without the cache
    other = cold_state.heat.rows[1]
    switched = reducer.reduce(trace, ViewOptions(bins=BINS, kda_layer=other), session)
    fresh = KDAStateReducer()
    fresh.reduce(trace, opts, session)
    np.testing.assert_array_equal(switched.heads.values,
                                  fresh.reduce(trace, ViewOptions(bins=BINS, kda_layer=other), session).heads.values)
    # a damaged summary is recomputed, not trusted
    for f in (tmp_path / "cache").rglob("*.json"):
        f.write_text("{not json")
    for f in (tmp_path / "cache").rglob("*.arrow"):
        f.write_bytes(b"garbage")
    assert json.dumps(KDAHealthReducer().reduce(trace, opts, session).ranked) == json.dumps(cold_health.ranked)
    np.testing.assert_array_equal(KDAStateReducer().reduce(trace, opts, session).heat.values, cold_state.heat.values)


def test_live_traces_are_not_cached(small_trace: Path, tmp_path: Path) -> None:
    live = tmp_path / "live"
    shutil.copytree(small_trace, live)
    session = json.loads((live / "session.json").read_text())
    (live / "session.json").write_text(json.dumps({**session, "status": "recording"}))
    assert summary_cache.key(open_trace(live), ("kda_norms",)) is None
    assert summary_cache.key(open_trace(small_trace), ("kda_norms",)) is not None


def test_cache_can_be_turned_off(monkeypatch) -> None:
    monkeypatch.setenv("K3WB_DASHBOARD_CACHE", "off")
    assert summary_cache.cache_root() is None


def test_running_sums_come_back_from_disk_equal(small_trace: Path, tmp_path: Path, monkeypatch) -> None:
    """A new server process gets a finished trace's DSA and expert sums from the cache, equal to a fresh fold."""
    monkeypatch.setenv("K3WB_DASHBOARD_CACHE", str(tmp_path / "cache"))
    opts = ViewOptions(bins=BINS, moe_modality="text")
    trace = open_trace(small_trace)
    session = RecordingMapReducer().reduce(trace, opts)
    cold_dsa, cold_moe = DSAMapReducer(), ExpertsReducer()
    dsa, moe = cold_dsa.reduce(trace, opts, session), cold_moe.reduce(trace, opts, session)
    assert not cold_dsa.sums.restored and not cold_moe.sums.restored
    assert len(list((tmp_path / "cache").rglob("*.sums-*.arrow"))) == 2
    again = open_trace(small_trace)  # as a fresh process: a new trace object, nothing folded
    warm_dsa, warm_moe = DSAMapReducer(), ExpertsReducer()
    np.testing.assert_array_equal(warm_dsa.reduce(again, opts, session).heat.values, dsa.heat.values)
    warm = warm_moe.reduce(again, opts, session)
    assert warm_dsa.sums.restored and warm_moe.sums.restored
    np.testing.assert_array_equal(warm.heat.values, moe.heat.values)
    np.testing.assert_array_equal(warm.text, moe.text)
    assert warm.heat.rows == moe.heat.rows
    # sums that do not fit the table are refused, and nothing is changed by the refusal
    fresh = open_trace(small_trace)
    assert not fresh.restore_running_sums("dsa_key_counts", ("layer",), {(1, 2): np.zeros(3, np.int64)})
    assert not fresh.restore_running_sums("dsa_key_counts", ("layer",), {(1,): np.full(3, -1, np.int64)})
    assert not fresh.restore_running_sums("moe_counts", ("layer",), {(1,): np.zeros(3, np.int64)})
    np.testing.assert_array_equal(DSAMapReducer().reduce(fresh, ViewOptions(bins=BINS), session).heat.values,
                                  DSAMapReducer().reduce(trace, ViewOptions(bins=BINS), session).heat.values)
    # the key is the parts' content, not the trace's path or the parts' times: a copy finds the sums
    copy = tmp_path / "copy"
    shutil.copytree(small_trace, copy, copy_function=shutil.copyfile)  # new mtimes
    copied = DSAMapReducer()
    copied.reduce(open_trace(copy), opts, session)
    assert copied.sums.restored
    # a part rewritten in place gives another key: the cached sums are not used
    part = open_trace(copy).parts("dsa_key_counts")[0]
    rows = pq.read_table(part)
    pq.write_table(rows.set_column(rows.schema.get_field_index("count"), "count",
                                   pc.add(rows["count"], pa.scalar(1, rows.schema.field("count").type))), part)
    changed = DSAMapReducer()
    changed.reduce(open_trace(copy), opts, session)
    assert not changed.sums.restored


def test_summaries_written_by_the_recording_command_travel_with_the_trace(small_trace: Path, tmp_path: Path,
                                                                          monkeypatch) -> None:
    """`write_summaries` (what `workbench run` calls when a recording ends) puts them inside the trace; a copy
    of the trace opened elsewhere, with an empty user cache, reads them instead of the parts. Viewing a trace
    never writes into it."""
    from workbench.analysis.views.summaries import write_summaries

    monkeypatch.setenv("K3WB_DASHBOARD_CACHE", str(tmp_path / "cache"))
    viewed = tmp_path / "viewed"
    shutil.copytree(small_trace, viewed)
    follower = TraceFollower(viewed)
    follower.compute()
    follower.stop()
    assert not (viewed / summary_cache.TRACE_DIR).exists() and any((tmp_path / "cache").rglob("*.arrow"))

    recorded = tmp_path / "recorded"
    shutil.copytree(small_trace, recorded)
    shared_reducers.forget_all()
    assert write_summaries(recorded)
    inside = sorted(p.name.split(".", 1)[1] for p in (recorded / summary_cache.TRACE_DIR).iterdir())
    assert {"kda_layers.arrow", "kda_heads.arrow", "kda_health.json", "sums-dsa_key_counts.arrow",
            "sums-moe_counts.arrow"} <= set(inside)

    elsewhere = tmp_path / "laptop" / "trace"
    shutil.copytree(recorded, elsewhere, copy_function=shutil.copyfile)  # another path, new mtimes
    monkeypatch.setenv("K3WB_DASHBOARD_CACHE", str(tmp_path / "empty-cache"))
    trace = open_trace(elsewhere)
    opts = ViewOptions(bins=BINS)
    session = RecordingMapReducer().reduce(trace, opts)

    def no_part_reads(*args, **kwargs):
        raise AssertionError("a part was read although its summary is in the trace")

    monkeypatch.setattr(type(trace), "read_part", no_part_reads)
    state, health = KDAStateReducer(), KDAHealthReducer()
    dsa, moe = DSAMapReducer(), ExpertsReducer()
    warm = state.reduce(trace, opts, session)
    assert health.reduce(trace, opts, session).ranked
    dsa.reduce(trace, opts, session)
    moe.reduce(trace, opts, session)
    assert dsa.sums.restored and moe.sums.restored
    assert not (tmp_path / "empty-cache").exists() or not any((tmp_path / "empty-cache").rglob("*.*"))
    monkeypatch.undo()
    cold = KDAStateReducer().reduce(open_trace(small_trace), opts, session)
    np.testing.assert_array_equal(warm.heat.values, cold.heat.values)


def test_a_traces_summaries_folder_that_is_a_link_is_neither_read_nor_written(small_trace: Path, tmp_path: Path,
                                                                              monkeypatch) -> None:
    from workbench.analysis.views.summaries import write_summaries

    monkeypatch.setenv("K3WB_DASHBOARD_CACHE", str(tmp_path / "cache"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    trace = tmp_path / "t"
    shutil.copytree(small_trace, trace)
    (trace / summary_cache.TRACE_DIR).symlink_to(elsewhere, target_is_directory=True)
    shared_reducers.forget_all()
    write_summaries(trace)
    assert not any(elsewhere.iterdir())  # nothing written through the link
    # summaries written by a real folder, then the folder swapped for a link to them: not read
    real = tmp_path / "real"
    shutil.copytree(small_trace, real)
    shared_reducers.forget_all()
    assert write_summaries(real)
    linked = tmp_path / "linked"
    shutil.copytree(small_trace, linked)
    (linked / summary_cache.TRACE_DIR).symlink_to(real / summary_cache.TRACE_DIR, target_is_directory=True)
    monkeypatch.setenv("K3WB_DASHBOARD_CACHE", str(tmp_path / "empty-cache"))
    opened = open_trace(linked)
    assert summary_cache.load_json(summary_cache.key(opened, ("kda_norms",)), "anything") is None
    session = RecordingMapReducer().reduce(opened, ViewOptions(bins=BINS))
    dsa = DSAMapReducer()
    dsa.reduce(opened, ViewOptions(bins=BINS), session)
    assert not dsa.sums.restored
